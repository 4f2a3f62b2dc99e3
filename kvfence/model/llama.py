"""A Llama-family decoder (Llama 2/3, Qwen2 and checkpoints with their layout) in plain torch.

Tokens are laid out flat, vLLM style: a forward pass takes ``T`` tokens with their positions,
whatever sequences they belong to, and an ``attend`` callback that does the attention for one
layer. Prefill passes causal attention over one prompt; decode passes paged attention over the KV
pool. The model itself holds no cache, so the same weights serve both paths.

Parameter names equal the Hugging Face ones (``model.layers.0.self_attn.q_proj.weight`` ...) so a
checkpoint's state dict loads without renaming.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Torch-free (the control plane reads a checkpoint's architecture); still importable from here.
from kvfence.model.args import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from kvfence.model.args import ModelArgs as ModelArgs
from kvfence.model.rope import (
    apply_rope_factors,
    inv_freq_and_scale,
    rope_cos_sin,
    rope_factors,
)

# attend(layer, q (T, H, hd), k (T, KVH, hd), v (T, KVH, hd)) -> (T, H, hd)
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
