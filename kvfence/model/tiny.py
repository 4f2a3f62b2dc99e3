"""The embedded default model: a small deterministic Llama checkpoint, so nothing is downloaded.

``TINY_CONFIG`` is its Hugging Face ``config.json``; static checks (``check-config --static``) read
the KV shape from it when the config names no checkpoint.
"""

from __future__ import annotations

from typing import Any

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 384,  # 256 byte tokens + specials, room to spare
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
TINY_SEED = 20260829
