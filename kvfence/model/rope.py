"""Rotary position embeddings: inverse frequencies for the rope types Llama-family checkpoints use.

The formulas follow Hugging Face ``modeling_rope_utils`` so that kvfence and ``transformers`` rotate
queries and keys by bit-identical angles (the differential tests compare greedy tokens exactly).
"""

from __future__ import annotations

import math

import torch

# Torch-free (the control plane reads a checkpoint's rope settings); still importable from here.
from kvfence.model.args import SUPPORTED_ROPE_TYPES as SUPPORTED_ROPE_TYPES
from kvfence.model.args import RopeSpec as RopeSpec


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (theta**exponent)


def inv_freq_and_scale(
    spec: RopeSpec, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling applied to cos/sin)."""
    dim = head_dim
    if spec.rope_type in ("default", "dynamic"):
        # Dynamic NTK only changes the base beyond max_position_embeddings, and kvfence never
        # admits a position past the context window, which the control plane refuses to set
        # beyond it for this type (model_info), so inside it dynamic equals default.
        return _base_inv_freq(spec.theta, dim), 1.0
    if spec.rope_type == "linear":
        return _base_inv_freq(spec.theta, dim) / float(spec.get("factor")), 1.0
    if spec.rope_type == "llama3":
        return _llama3(spec, dim), 1.0
    return _yarn(spec, dim, max_positions)


def _llama3(spec: RopeSpec, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(spec.theta, dim)
    factor = float(spec.get("factor"))
    low = float(spec.get("low_freq_factor"))
    high = float(spec.get("high_freq_factor"))
    old_ctx = float(spec.get("original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    orig = spec.get("original_max_position_embeddings")
    factor = spec.get("factor") or max_positions / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = spec.get("attention_factor")
    if attention is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = spec.get("beta_fast") or 32
    beta_slow = spec.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the HF formula's guard against a zero-width ramp
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def rope_cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, head_dim) for integer ``positions`` (T,)."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (T, heads, hd) by (T, hd) angles, in HF's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin), both (T, 1, hd), for :func:`apply_rope_factors`: the sign of
    rotate_half's negated half moves onto sin (``(-a) * b == a * (-b)`` exactly in IEEE)."""
    half = cos.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[:, None, :], signed[:, None, :]


def apply_rope_factors(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """:func:`apply_rope` with factors from :func:`rope_factors`: bit-identical, fewer ops
    (rolling by half a head swaps the halves as rotate_half does, without its negation)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
