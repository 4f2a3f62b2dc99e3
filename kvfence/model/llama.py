"""A Llama-family decoder (Llama 2/3, Qwen2 and checkpoints with their layout) in plain torch.

Tokens are laid out flat, vLLM style: a forward pass takes ``T`` tokens with their positions,
whatever sequences they belong to, and an ``attend`` callback that does the attention for one
layer. Prefill passes causal attention over one prompt; decode passes paged attention over the KV
pool. The model itself holds no cache, so the same weights serve both paths.

Parameter names equal the Hugging Face ones (``model.layers.0.self_attn.q_proj.weight`` ...) so a
checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.config import ModelShape
from kvfence.config_check import mistral_sliding_window
from kvfence.model.rope import (
    RopeSpec,
    apply_rope_factors,
    inv_freq_and_scale,
    rope_cos_sin,
    rope_factors,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

# attend(layer, q (T, H, hd), k (T, KVH, hd), v (T, KVH, hd)) -> (T, H, hd)
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weight dtype, as the reference implementation does.
        # (The casts are skipped, not changed, when x already is float32: same arithmetic.)
        dtype = x.dtype
        h = x if dtype == torch.float32 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h if dtype == torch.float32 else h.to(dtype))


class Attention(nn.Module):
    """Q/K/V projections with RoPE; the attention itself is the caller's ``attend``."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        d, hd = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(d, args.num_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * hd, d, bias=args.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        # Linear layers are called through F.linear, not Module.__call__: with a small model the
        # per-call hook bookkeeping costs as much as the matmul. Same ops, same arithmetic.
        t = x.shape[0]
        q = _linear(self.q_proj, x).view(t, self.num_heads, self.head_dim)  # (T, H, hd)
        k = _linear(self.k_proj, x).view(t, self.num_kv_heads, self.head_dim)  # (T, KVH, hd)
        v = _linear(self.v_proj, x).view(t, self.num_kv_heads, self.head_dim)  # (T, KVH, hd)
        # cos, sin: (T, 1, hd) factors from rope_factors, shared by every layer
        q, k = apply_rope_factors(q, cos, sin), apply_rope_factors(k, cos, sin)
        out = attend(self.layer, q, k, v)  # (T, H, hd)
        return _linear(self.o_proj, out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=args.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=args.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self.gate_proj, x), _linear(self.up_proj, x)
        return _linear(self.down_proj, F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        # Submodules' forward called directly (no hooks are ever registered on them).
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, attend)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied or not)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        inv_freq, scale = inv_freq_and_scale(args.rope, args.head_dim, args.max_position_embeddings)
        self.rope_scale = scale
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Hidden states (T, D) after the final norm for ``tokens`` (T,) at ``positions`` (T,)."""
        x = F.embedding(tokens, self.model.embed_tokens.weight)  # (T, D)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions, x.dtype)  # (T, hd)
        cos, sin = rope_factors(cos, sin)  # (T, 1, hd), computed once for every layer
        for block in self.model.layers:
            x = block.forward(x, cos, sin, attend)
        return self.model.norm.forward(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, D) -> (T, vocab) float32: sampling always runs in float32."""
        out = _linear(self.lm_head, hidden)
        return out if out.dtype == torch.float32 else out.float()


def causal_attend(scale: float) -> AttendFn:
    """Causal self-attention over the tokens of one sequence (prefill: reads no page)."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        # (1, H, T, hd); KV heads repeated for GQA, as the reference SDPA path does.
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
        vh = v.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return out.squeeze(0).transpose(0, 1)  # (T, H, hd)

    return attend
