"""Token sampling that gives the same tokens wherever a step runs.

Disaggregation splits one request over two processes: the prefill node samples the first token and
a decode node samples the rest. Each draw therefore uses a fresh ``torch.Generator`` seeded with a
pure function of (request seed, step index), on the CPU, from float32 logits: the prefill node, the
decode node and one colocated process all draw the same token for the same logits.

Greedy (temperature 0) is argmax; otherwise softmax(logits / T), optional top-p, then the
exponential race ``argmax(p / E)`` with ``E ~ Exp(1)``, which samples exactly from ``p``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

# Torch-free (the control plane imports them from there); still importable from here.
from kvfence.model.stops import find_stop as find_stop
from kvfence.model.stops import stream_safe_len as stream_safe_len

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops (mirrors kvfence.v1.SamplingParams)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0  # 0 or 1 = no nucleus filtering
    seed: int | None = None  # required when temperature > 0 and the request spans two nodes
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed must be a uint64, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def missing_seed(self) -> bool:
        """Sampled, and without the seed that makes its draws the same on every node."""
        return not self.greedy and self.seed is None

    def with_seed(self) -> SamplingParams:
        """This with a random seed if it has none (do it once, where the request enters)."""
        if self.seed is not None or self.greedy:
            return self
        return replace(self, seed=secrets.randbits(64))


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for draw ``step`` of a request (splitmix64 of seed and step)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _filter_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the smallest prefix of tokens, by descending probability, whose mass reaches top_p.
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly before each token
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter_(0, order, sorted_p)


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """The token for draw ``step`` from ``logits`` (vocab,)."""
    logits = logits.detach().float().cpu()
    if params.greedy:
        return int(torch.argmax(logits))
    if params.seed is None:
        raise ValueError("a sampled request needs a seed (SamplingParams.with_seed())")
    # Shifted so that the top logit is 0: logits / T overflows float32 for a tiny T (the wire
    # allows any positive float), and softmax of inf is NaN everywhere, whose argmax is token 0.
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if 0 < params.top_p < 1:
        probs = _filter_top_p(probs, params.top_p)
    gen = torch.Generator().manual_seed(step_seed(params.seed, step))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
) -> list[int]:
    """One token per row of ``logits`` (B, vocab); greedy rows are decided in one argmax."""
    if len(params) != logits.shape[0] or len(steps) != logits.shape[0]:
        raise ValueError("one SamplingParams and one step index per row")
    logits = logits.detach().float().cpu()
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, steps[i])
    return [int(t) for t in out]
