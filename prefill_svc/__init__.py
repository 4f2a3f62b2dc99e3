"""kvfence prefill_svc service."""
