"""kvfence decode_svc service."""
