"""kvfence: shared core (config, model, page pool, manifest, transfer, events, auth, errors,
client)."""

__version__ = "0.1.0"
