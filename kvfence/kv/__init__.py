"""kvfence.kv: the paged KV pool with generation tags."""
