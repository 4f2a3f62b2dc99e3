"""kvfence.model: the Llama-family engine that prefill and decode run."""
