"""kvfence kernels: paged attention with a generation check, KV write, page checksum, page scrub.

Every public function dispatches on the device of its tensors: CUDA tensors run the Triton kernel
in ``kernels.triton_impl``, CPU tensors run the torch reference in ``kernels.reference``. Both
follow one contract; the attention output agrees to float tolerance, the other three bit for bit.
Triton is imported only when a CUDA tensor arrives, so the CPU path works where triton is missing
or broken; if that import fails, CUDA tensors run the torch references for the rest of the process
(one warning, no retry).

Pool layout (``kvfence.kv.pool``): ``kv_pages`` is ``[num_pages, num_layers, 2, page_size,
num_kv_heads, head_dim]`` (dim 2: 0 = K, 1 = V), contiguous; ``page_gen`` is int64 ``[num_pages]``.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Protocol

import torch

from kernels import reference

__all__ = [
    "CHECKSUM_ALGO",
    "AttentionPlan",
    "checksum_as_uint64",
    "checksum_seed",
    "page_checksum",
    "page_checksums",
    "paged_decode_attention",
    "plan_decode_attention",
    "scrub_pages",
    "write_kv_pages",
]

CHECKSUM_ALGO = "kvf-mulfold64-v2"
"""Name of the page checksum algorithm; manifests carry it and decode refuses any other.

For a page of W 64-bit words ``u[j]`` (the page's raw bytes read little-endian, eight at a time)
and a seed ``s``::

    m       = fmix64(s) | 1                                   # MurmurHash3 finalizer, made odd
    k[j]    = j * 0x9E3779B97F4A7C15              mod 2**64   # position key
    x[j]    = (u[j] ^ k[j]) * m                   mod 2**64
    term[j] = x[j] ^ (x[j] >> 32)                              # logical shift
    checksum = sum(term[j]) mod 2**64

Each step is a bijection of the word, so a change to any one word always changes its term; the
multiply and the fold mix word, position and seed nonlinearly. The sum is associative and
commutative, so Triton's block order cannot change the result. It detects corruption and
misplaced pages; it is not a MAC (the manifest's HMAC is).

v1 hashed 32-bit words, each sign-extended to 64 bits: the torch reference then spent a widening
pass and twice the int64 arithmetic per byte, and reached 13% of memcpy on a CPU; v2 reaches the
stated >= 25% (``benchmarks/kernels.py``).
"""


def checksum_seed(reservation_id: str, page_index: int) -> int:
    """The checksum seed of page ``page_index`` of a reservation, as a signed int64.

    The first 8 bytes (little-endian) of blake2b over ``reservation_id`` and the index, so a correct
    copy of another page, or of a page of another reservation, fails the check.
    """
    if page_index < 0:
        raise ValueError(f"page_index must be >= 0, got {page_index}")
    digest = hashlib.blake2b(
        f"{reservation_id}\x00{page_index}".encode(), digest_size=8, person=b"kvfence-ck"
    ).digest()
    return int.from_bytes(digest, "little", signed=True)


def checksum_as_uint64(value: int) -> int:
    """The unsigned value (the proto's uint64) of an element of ``page_checksum``'s int64 result."""
    return value & ((1 << 64) - 1)


_cuda_impl: ModuleType | None = None
"""What CUDA tensors run, once :func:`_impl` has first been asked for it (None before)."""
_cuda_impl_lock = threading.Lock()


def _impl(device: torch.device) -> ModuleType:
    """The Triton launchers for CUDA tensors, the torch references otherwise."""
    if device.type != "cuda":
        return reference
    return _cuda_impl or _load_cuda_impl()


def _load_cuda_impl() -> ModuleType:
    """Import the Triton launchers once per process; the torch references if that fails.

    The outcome is kept: a failed import is not retried, so it costs one attempt and one warning
    per process, not an import and a warning on every kernel call (every layer of every step).
    """
    global _cuda_impl
    with _cuda_impl_lock:  # two engine threads' first calls: still one attempt, one warning
        if _cuda_impl is None:
            try:
                from kernels import triton_impl
            except Exception as exc:  # a broken triton install must not take serving down
                warnings.warn(
                    f"triton unusable ({exc!r}); running torch references on CUDA for the rest "
                    "of this process",
                    stacklevel=4,
                )
                _cuda_impl = reference
            else:
                _cuda_impl = triton_impl
        return _cuda_impl


def paged_decode_attention(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    expected_gen: torch.Tensor,
    page_gen: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of attention over paged KV, with the page-ownership check in the kernel.

    Args:
        q: ``[B, num_heads, head_dim]`` the step's queries (pool dtype). ``num_heads`` (>= 1) is a
            multiple of ``num_kv_heads`` (>= 1); head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)``.
        kv_pages: the pool; ``layer`` selects the layer read.
        block_tables: int32 ``[B, max_pages]`` page ids; entries at or beyond
            ``ceil(seq_len / page_size)`` are ignored (any value). ``max_pages`` may be 0 (every
            row is then flagged).
        expected_gen: int64 ``[B, max_pages]`` the generation each table entry was allocated at.
        page_gen: int64 ``[num_pages]`` the pool's current generations.
        seq_lens: int32 ``[B]`` valid tokens per sequence (>= 1); later positions are never read.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``out`` ``[B, num_heads, head_dim]`` in q's dtype (float32 accumulation), and
        ``error_flags`` bool ``[B]``: True when a page the sequence reads has ``page_gen[page] !=
        expected_gen``, an id outside the pool, ``seq_len`` needs more pages than ``max_pages``,
        or ``seq_len < 1``.
        A flagged row reads no K/V and its output is zeros; the caller must fail that request.
        A NaN or inf in the q, K or V a row reads is no flag: it reaches that row's output as
        NaN or inf (in the query heads that read it), never as zeros; in particular a query head
        whose every score is -inf outputs NaN (a head with some finite score attends over those).
    """
    return plan_decode_attention(kv_pages, block_tables, expected_gen, page_gen, seq_lens, scale)(
        q, layer
    )


class AttentionPlan(Protocol):
    """One decode step's attention, planned once (:func:`plan_decode_attention`)."""

    flags: torch.Tensor
    """bool ``[B]``: the OR of the ``error_flags`` of every call so far (all False before the
    first). A step reads it once, after its last layer, instead of ORing each layer's flags."""

    def __call__(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def plan_decode_attention(
    kv_pages: torch.Tensor,
    block_tables: torch.Tensor,
    expected_gen: torch.Tensor,
    page_gen: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> AttentionPlan:
    """:func:`paged_decode_attention` for every layer of one decode step, planned once.

    The arguments the layers share are checked once, here, and what the batch reads is worked
    out once; the returned plan ``attend(q, layer) -> (out, error_flags)`` then gives what
    ``paged_decode_attention(q, kv_pages, layer, ...)`` gives, and checks the generations of
    the pages it reads against ``page_gen`` as it is at *that* call: a page that changes owner
    between two layers of a step is flagged at the next layer. ``attend.flags`` is the OR of
    every call's ``error_flags`` so far. The plan holds the tensors it was given; they must not
    change while it is used (``page_gen`` excepted: that is what it checks). A call's
    ``error_flags`` may be a tensor the plan returns again (its all-False flags): read it, never
    write into it.
    """
    return _impl(kv_pages.device).plan_decode_attention(  # type: ignore[no-any-return]
        kv_pages, block_tables, expected_gen, page_gen, seq_lens, scale
    )


def write_kv_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Write one layer's K and V for ``T`` tokens into the pool, in place.

    ``k``, ``v``: ``[T, num_kv_heads, head_dim]`` in the pool dtype. ``slot_mapping``: int64
    ``[T]``, ``slot = page_id * page_size + offset``; ``-1`` skips the token. Slots must be
    distinct. A slot outside the pool raises ``ValueError`` in the torch reference (CPU, or CUDA
    when Triton is unusable); the Triton kernel (no host sync) drops the token, never writes it
    elsewhere, and the page checksum catches the missing write.
    """
    _impl(k.device).write_kv_pages(k, v, kv_pages, layer, slot_mapping)


def page_checksum(
    kv_pages: torch.Tensor, page_ids: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Checksum of each listed whole page (all layers, K and V): int64 ``[N]``.

    Each element holds the bit pattern of a uint64 (``checksum_as_uint64`` gives the unsigned
    value); the algorithm is ``CHECKSUM_ALGO``. ``page_ids``: int32/int64 ``[N]`` in
    ``[0, num_pages)`` (checked; raises ``ValueError``). ``seeds``: int64 ``[N]``, one per page,
    from ``checksum_seed``.
    """
    return _impl(kv_pages.device).page_checksum(  # type: ignore[no-any-return]
        kv_pages, page_ids, seeds
    )


def page_checksums(
    kv_pages: torch.Tensor, page_ids: Sequence[int], seeds: Sequence[int]
) -> list[int]:
    """``page_checksum`` of pages listed on the host, as unsigned ints (the proto's uint64). The
    ids and seeds go where the pool is: ``page_checksum`` refuses tensors on another device (on a
    CUDA pool, CPU ones would fail every Prefill's manifest and every verification)."""
    device = kv_pages.device
    sums = page_checksum(
        kv_pages,
        torch.tensor(page_ids, dtype=torch.int64, device=device),
        torch.tensor(seeds, dtype=torch.int64, device=device),
    )
    return [checksum_as_uint64(int(x)) for x in sums.tolist()]


def scrub_pages(
    kv_pages: torch.Tensor, page_ids: torch.Tensor, from_slot: int | torch.Tensor = 0
) -> None:
    """Zero slots ``>= from_slot`` of each listed page, all layers, K and V, in place.

    ``from_slot`` 0 zeroes whole pages; a partly filled last page passes its token count. It is an
    int for all pages or an int tensor ``[N]`` per page, each in ``[0, page_size]``. ``page_ids``:
    int32/int64 ``[N]`` in ``[0, num_pages)`` (checked; raises ``ValueError``).
    """
    _impl(kv_pages.device).scrub_pages(kv_pages, page_ids, from_slot)
