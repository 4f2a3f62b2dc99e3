"""Factories for the kernel tests: pools, decode batches and a dense attention baseline.

Page 0 of every pool is a poison page full of NaN and is never handed to a sequence; unused block
table entries point at it, and slots past each sequence's length are NaN too. Any read the kernels
are not allowed to make therefore turns the output into NaN.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# pytest puts tests/ on sys.path (tests/conftest.py is not in a package), and there the directory
# tests/kernels/ looks like a namespace package "kernels" that hides the real one, which the
# editable install only offers through a finder consulted after sys.path. The repository root on
# sys.path lets the regular package win; drop a namespace "kernels" imported before this ran.
_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.append(_REPO)
if getattr(sys.modules.get("kernels"), "__file__", "") is None:
    del sys.modules["kernels"]

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

POISON_PAGE = 0


@dataclass
class Pool:
    kv: torch.Tensor  # (P, L, 2, page_size, kvh, D)
    page_gen: torch.Tensor  # (P,) int64

    @property
    def page_size(self) -> int:
        return self.kv.shape[3]


@dataclass
class Batch:
    q: torch.Tensor  # (B, H, D)
    block_tables: torch.Tensor  # (B, max_pages) int32
    expected_gen: torch.Tensor  # (B, max_pages) int64
    seq_lens: torch.Tensor  # (B,) int32
    scale: float

    def args(self, pool: Pool, layer: int) -> tuple:
        """Positional arguments of ``paged_decode_attention``."""
        return (
            self.q,
            pool.kv,
            layer,
            self.block_tables,
            self.expected_gen,
            pool.page_gen,
            self.seq_lens,
            self.scale,
        )


def _make_pool(
    *,
    dtype: torch.dtype = torch.float32,
    num_pages: int = 12,
    num_layers: int = 2,
    page_size: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> Pool:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
    kv = torch.randn(shape, generator=gen).to(dtype)
    kv[POISON_PAGE] = float("nan")
    page_gen = torch.arange(num_pages, dtype=torch.int64) * 7 + 3  # distinct, nonzero
    return Pool(kv, page_gen)


def _make_batch(
    pool: Pool,
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    max_pages: int = 4,
    seed: int = 1,
) -> Batch:
    """Sequences on distinct pages (never page 0); positions past each length are set to NaN."""
    gen = torch.Generator().manual_seed(seed)
    page_size, head_dim = pool.page_size, pool.kv.shape[5]
    free = (torch.randperm(pool.kv.shape[0] - 1, generator=gen) + 1).tolist()
    tables = torch.full((len(seq_lens), max_pages), POISON_PAGE, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        for i in range(min(used, max_pages)):
            tables[b, i] = free.pop()
        if n % page_size and used <= max_pages:
            pool.kv[int(tables[b, used - 1]), :, :, n % page_size :] = float("nan")
    expected = pool.page_gen[tables.long()].clone()
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(pool.kv.dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return Batch(q, tables, expected, seq, head_dim**-0.5)


def _dense_attention(pool: Pool, batch: Batch, layer: int) -> torch.Tensor:
    """SDPA per sequence over its K/V gathered into one dense tensor. (B, H, D) float32."""
    num_heads, num_kv_heads = batch.q.shape[1], pool.kv.shape[4]
    outs = []
    for b, n in enumerate(batch.seq_lens.tolist()):
        pages = batch.block_tables[b, : -(-n // pool.page_size)].long()
        k = pool.kv[pages, layer, 0].flatten(0, 1)[:n].float()  # (n, kvh, D)
        v = pool.kv[pages, layer, 1].flatten(0, 1)[:n].float()
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, n, D)
        v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        q = batch.q[b].float()[:, None, :]  # (H, 1, D)
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=batch.scale)[:, 0])
    return torch.stack(outs)


@pytest.fixture(scope="session")
def make_pool() -> Callable[..., Pool]:
    return _make_pool


@pytest.fixture(scope="session")
def make_batch() -> Callable[..., Batch]:
    return _make_batch


@pytest.fixture(scope="session")
def dense_attention() -> Callable[[Pool, Batch, int], torch.Tensor]:
    return _dense_attention
