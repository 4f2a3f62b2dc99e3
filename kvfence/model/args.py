"""The architecture of a Llama-family checkpoint as its ``config.json`` states it: ``RopeSpec``
(rotary embedding settings) and ``ModelArgs`` (sizes, rope, EOS ids, the KV shape).

No torch here: the control plane reads a checkpoint's architecture (to admit requests and vet
nodes) but never runs the model. ``kvfence.model.rope`` and ``kvfence.model.llama``, which build
the model with torch, re-export both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvfence.config import ModelShape
from kvfence.config_check import mistral_sliding_window

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class RopeSpec:
    """Rope parameters as read from a checkpoint config (either HF v4 or v5 spelling)."""

    theta: float
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RopeSpec:
        # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints write
        # "rope_theta" plus an optional "rope_scaling" dict whose type key was once "type".
        new, old = cfg.get("rope_parameters"), cfg.get("rope_scaling")
        if new and old and _normalised(new, cfg) != _normalised(old, cfg):
            # transformers 5 lets rope_scaling win (an operator pasting a model card's
            # long-context snippet into a v5-saved config); a file that says two things is
            # ambiguous, so neither is guessed.
            raise ValueError(
                f"config.json has both 'rope_parameters' {new} and 'rope_scaling' {old}, "
                "which disagree; keep one"
            )
        theta, rope_type, params = _normalised(new or old or {}, cfg)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type in ("linear", "dynamic", "llama3") and "factor" not in params:
            raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
        if rope_type in ("llama3", "yarn"):
            # As transformers (standardize_rope_params): a top-level
            # original_max_position_embeddings wins over the rope dict's, and without either
            # the pretraining length is max_position_embeddings.
            if "original_max_position_embeddings" in cfg:
                params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
            params.setdefault(
                "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)
            )
        if rope_type == "llama3":
            missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
            if missing:  # transformers has no default for them either: never guess a rotation
                raise ValueError(f"rope type 'llama3' needs {' and '.join(map(repr, missing))}")
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        return cls(theta, rope_type, tuple(sorted(params.items())))


def _normalised(raw: Any, cfg: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(theta, rope type, other keys) of one rope dict: theta from the dict or the top-level
    rope_theta, the type under either spelling."""
    params = dict(raw)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    return theta, rope_type, params


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelArgs:
    """The architecture of one checkpoint, read from its Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral's sliding-window attention (None: none, or a window not below the context). kvfence
    # attends over the whole context, which is the same thing only up to the window: the usable
    # context window is capped there (``shape``).
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Validate and convert a ``config.json`` mapping; ValueError names what is unsupported."""
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu / SwiGLU)")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            args = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeSpec.from_config(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers
                # all four projections.
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                model_type=model_type,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            )
        except KeyError as err:
            raise ValueError(f"config.json lacks {err.args[0]!r}") from None
        if args.head_dim % 2:
            # rope rotates pairs of dimensions (rotate_half): an odd head loaded fine and failed
            # on the first request; transformers refuses it when it builds the model.
            raise ValueError(f"head_dim {args.head_dim} is odd; rotary embeddings need it even")
        if args.num_heads % args.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        window = mistral_sliding_window(cfg)
        if window is not None:
            args = dataclasses.replace(args, sliding_window=window)
        return args

    @property
    def shape(self) -> ModelShape:
        """The KV shape a page pool for this model needs."""
        return ModelShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            context_window=min(
                self.max_position_embeddings, self.sliding_window or self.max_position_embeddings
            ),
        )
