"""kvfence control_plane service."""
