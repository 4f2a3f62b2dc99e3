"""Checkpoints the benchmarks run on: the embedded tiny model and a larger random Llama.

The embedded model (hidden 128, 2 layers, 0.4M parameters) makes a decode step cost a few hundred
µs, so per-call costs that do not grow with the model (Python dispatch, gRPC messages, a tag
check per attention call) weigh far more on it than on any model people serve. ``small`` is a
random Llama drawn the same way (``kvfence.model.tiny.write_tiny_model`` with another config),
with the shape of a real small model (GQA, 8 layers, hidden 512: 24.5M parameters), so that the
same scripts also show how those fractions move with the model. Both use the byte tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfence.model.tiny import TINY_CONFIG, ensure_tiny_model

SMALL_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
SMALL_SEED = 20261129

MODELS = ("tiny", "small")


def bench_model(name: str) -> Path:
    """The folder of the named benchmark checkpoint, written on first use (user cache)."""
    if name == "tiny":
        return ensure_tiny_model()
    if name == "small":
        return ensure_tiny_model(config=SMALL_CONFIG, seed=SMALL_SEED)
    raise ValueError(f"unknown benchmark model {name!r}; choose one of {MODELS}")
