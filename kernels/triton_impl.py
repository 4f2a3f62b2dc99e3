"""Triton kernels and their launchers; imported lazily by ``kernels`` so a broken triton never
breaks the CPU path.

Launchers take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was
first imported (the tests run them that way in a subprocess). Each launcher checks devices, dtypes
and strides, not tensor contents: that would synchronise with the device on the decode hot path.
Where a content error could make a kernel touch memory outside the pool (a page id or slot out of
range), the kernel masks the access instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from kernels import _checks


def _check_runnable(device: torch.device) -> None:
    if device.type == "cpu" and not knobs.runtime.interpret:
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            "triton is imported; use kernels.<fn> (it runs the torch reference on CPU)"
        )


def _last_dim_dense(t: torch.Tensor) -> bool:
    """Whether the kernels may step through ``t``'s last dimension one element at a time. Its
    stride does not matter when it has at most one element (torch gives such a dimension any
    stride: a transposed (N, 1) table is contiguous with stride 3, an expanded one stride 0)."""
    return t.shape[-1] <= 1 or t.stride(-1) == 1


# --------------------------------------------------------------------------------------------------
# paged decode attention


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # (B, H, D) query, any float dtype; last dim contiguous
    kv_ptr,  # (P, L, 2, page_size, kvh, D) the whole pool, contiguous
    bt_ptr,  # (B, max_pages) int32 block tables; last dim contiguous
    egen_ptr,  # (B, max_pages) int64 generations the block tables expect; last dim contiguous
    gen_ptr,  # (P,) int64 current page generations
    seqlen_ptr,  # (B,) int32 valid tokens per sequence
    out_ptr,  # (B, H, D) output, q's dtype; last dim contiguous
    err_ptr,  # (B,) bool error flags
    scale,
    q_stride_b,
    q_stride_h,
    o_stride_b,
    o_stride_h,
    bt_stride_b,
    eg_stride_b,
    layer_offset,  # layer * pool stride of dim 1, in elements
    stride_page,
    stride_kv,  # offset from a K element to its V element
    stride_slot,
    stride_head,
    num_pages,
    max_pages,
    page_size,
    group,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    seq_len = tl.load(seqlen_ptr + b)
    # The page count in int64, as the reference has it: in int32, ``seq_len + page_size - 1``
    # wraps negative for a seq_len within page_size of INT32_MAX, the row escapes the flag
    # below, and pass 2 would walk ~2**31 tokens past the end of its block table. (Scalars, once
    # per program; pass 1 runs per page, so its int64 index costs nothing per token.)
    n_pages = (seq_len.to(tl.int64) + page_size - 1) // page_size
    # Pass 1: every page the sequence reads must carry the generation its block table expects.
    # Done before any K/V load so that a flagged sequence never reads the page it does not own.
    # A seq_len < 1 (the contract is >= 1) or one past the table is flagged as well.
    bad = (seq_len < 1) | (n_pages > max_pages)
    n_check = tl.minimum(n_pages, max_pages)
    for p0 in range(0, n_check, BLOCK_P):
        idx = p0 + tl.arange(0, BLOCK_P)
        m = idx < n_check
        page = tl.load(bt_ptr + b * bt_stride_b + idx, mask=m, other=0)
        in_range = (page >= 0) & (page < num_pages)
        gen = tl.load(gen_ptr + page, mask=m & in_range, other=0)
        want = tl.load(egen_ptr + b * eg_stride_b + idx, mask=m, other=0)
        stale = m & ((~in_range) | (gen != want))
        bad = bad | (tl.max(stale.to(tl.int32), axis=0) > 0)

    # Pass 2: online softmax over tokens, BLOCK_T at a time; a block may straddle pages.
    n_tok = tl.where(bad, 0, seq_len)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    q = tl.load(q_ptr + b * q_stride_b + h * q_stride_h + d, mask=dm, other=0.0).to(tl.float32)
    q = q * scale
    m_i = tl.max(tl.full([BLOCK_T], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_T], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # The loop counts blocks, not tokens: ``t0 += BLOCK_T`` past the last block would wrap int32
    # for a (valid) n_tok within BLOCK_T of INT32_MAX and loop on with negative positions. The
    # last block's positions stay below 2**31 (BLOCK_T is a power of two), so pos stays int32.
    n_blk = ((n_tok.to(tl.int64) + BLOCK_T - 1) // BLOCK_T).to(tl.int32)
    for blk in range(0, n_blk):
        pos = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = pos < n_tok
        page = tl.load(bt_ptr + b * bt_stride_b + pos // page_size, mask=tm, other=0)
        row = (
            page.to(tl.int64) * stride_page
            + layer_offset
            + (pos % page_size) * stride_slot
            + kvh * stride_head
        )  # (BLOCK_T,) element offset of each token's K row
        lm = tm[:, None] & dm[None, :]
        k = tl.load(kv_ptr + row[:, None] + d[None, :], mask=lm, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)  # (BLOCK_T,)
        s = tl.where(tm, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        # Until a block has a score above -inf (a K or q with -inf in it, an fp16 overflow, can
        # make a whole block's scores -inf), m_new is -inf and exp(-inf - -inf) would be NaN:
        # subtract 0 then, which makes alpha and every p of the block exactly 0, as they are.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_sub)
        p = tl.exp(s - m_sub)
        v = tl.load(kv_ptr + stride_kv + row[:, None] + d[None, :], mask=lm, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    # Only a row with no tokens (a flagged one: acc is 0) skips the division. Any other row has
    # l_i >= 1 (the max-score token adds exp(0)), unless a score was NaN or inf: a NaN or +inf
    # score (a NaN or inf in K or q, an fp16 overflow) makes l_i and acc NaN, and a row whose
    # every score is -inf has l_i = acc = 0, so 0 / 0: the output must be that NaN, as in the
    # reference, not a plausible row of zeros.
    out = acc / tl.where(n_tok > 0, l_i, 1.0)
    tl.store(out_ptr + b * o_stride_b + h * o_stride_h + d, out, mask=dm)
    tl.store(err_ptr + b, bad, mask=h == 0)


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
    """Triton launcher of ``kernels.paged_decode_attention`` (same contract)."""
    return plan_decode_attention(kv_pages, block_tables, expected_gen, page_gen, seq_lens, scale)(
        q, layer
    )


class DecodeAttentionPlan:
    """The shared arguments checked once; each call launches the kernel for one layer, and the
    kernel loads ``page_gen`` for every page it reads, at that launch."""

    def __init__(
        self,
        kv_pages: torch.Tensor,
        block_tables: torch.Tensor,
        expected_gen: torch.Tensor,
        page_gen: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ):
        _checks.check_attention_plan(kv_pages, block_tables, expected_gen, page_gen, seq_lens)
        _check_runnable(kv_pages.device)
        for name, t in (("block_tables", block_tables), ("expected_gen", expected_gen)):
            if not _last_dim_dense(t):
                raise ValueError(f"{name} must be contiguous in its last dimension")
        if not (page_gen.is_contiguous() and seq_lens.is_contiguous()):
            raise ValueError("page_gen and seq_lens must be contiguous")
        self.kv_pages, self.block_tables, self.expected_gen = kv_pages, block_tables, expected_gen
        self.page_gen, self.seq_lens, self.scale = page_gen, seq_lens, float(scale)
        self.batch = block_tables.shape[0]
        self.flags = torch.zeros(self.batch, dtype=torch.bool, device=kv_pages.device)

    def __call__(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv_pages, block_tables, expected_gen = self.kv_pages, self.block_tables, self.expected_gen
        _checks.check_attention_call(q, kv_pages, layer, self.batch)
        if not _last_dim_dense(q):
            raise ValueError("q must be contiguous in its last dimension")
        batch, num_heads, head_dim = q.shape
        num_pages, _, _, page_size, num_kv_heads, _ = kv_pages.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        err = torch.zeros(batch, dtype=torch.bool, device=q.device)
        if batch == 0:
            return out, err
        block_d = triton.next_power_of_2(head_dim)
        # Keep the (BLOCK_T, BLOCK_D) K and V tiles near 8K elements so they stay in registers.
        block_t = max(16, min(64, 8192 // block_d))
        _paged_decode_kernel[(batch, num_heads)](
            q,
            kv_pages,
            block_tables,
            expected_gen,
            self.page_gen,
            self.seq_lens,
            out,
            err,
            self.scale,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            expected_gen.stride(0),
            layer * kv_pages.stride(1),
            kv_pages.stride(0),
            kv_pages.stride(2),
            kv_pages.stride(3),
            kv_pages.stride(4),
            num_pages,
            block_tables.shape[1],
            page_size,
            num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_T=block_t,
            BLOCK_P=64,
        )
        self.flags = self.flags | err  # queued on the device after the kernel: no host sync
        return out, err


# Triton version of ``kernels.plan_decode_attention`` (same contract): its class makes the plan.
plan_decode_attention = DecodeAttentionPlan


# --------------------------------------------------------------------------------------------------
# KV page write


@triton.jit
def _write_kv_kernel(
    k_ptr,  # (T, kvh, D) new keys; last dim contiguous
    v_ptr,  # (T, kvh, D) new values; last dim contiguous
    kv_ptr,  # (P, L, 2, page_size, kvh, D) the whole pool, contiguous
    slot_ptr,  # (T,) int64 slot = page * page_size + offset; -1 skips the token
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    layer_offset,  # layer * pool stride of dim 1, in elements
    stride_page,
    stride_kv,
    stride_slot,
    stride_head,
    num_slots,  # num_pages * page_size: slots at or above it are dropped, never written
    page_size,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = slot // page_size
    offset = slot % page_size
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = tl.where(valid, num_heads, 0)  # a skipped token writes no head
    m = (hh[:, None] < heads) & (d[None, :] < HEAD_DIM)  # (BLOCK_H, BLOCK_D)
    src_k = k_ptr + t * k_stride_t + hh[:, None] * k_stride_h + d[None, :]
    src_v = v_ptr + t * v_stride_t + hh[:, None] * v_stride_h + d[None, :]
    dst = kv_ptr + page * stride_page + layer_offset + offset * stride_slot
    dst = dst + hh[:, None] * stride_head + d[None, :]
    tl.store(dst, tl.load(src_k, mask=m), mask=m)
    tl.store(dst + stride_kv, tl.load(src_v, mask=m), mask=m)


def write_kv_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton launcher of ``kernels.write_kv_pages``; slots outside the pool are dropped."""
    _checks.check_write_args(k, v, kv_pages, layer, slot_mapping)
    _check_runnable(k.device)
    if not (_last_dim_dense(k) and _last_dim_dense(v)):
        raise ValueError("k and v must be contiguous in their last dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_pages, _, _, page_size, num_kv_heads, head_dim = kv_pages.shape
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_pages,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        layer * kv_pages.stride(1),
        kv_pages.stride(0),
        kv_pages.stride(2),
        kv_pages.stride(3),
        kv_pages.stride(4),
        num_pages * page_size,
        page_size,
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------------------------------
# page checksum


@triton.jit
def _fmix64(x):
    # MurmurHash3's 64-bit finalizer on uint64 (shifts are logical, products wrap).
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53
    x ^= x >> 33
    return x


@triton.jit
def _page_checksum_kernel(
    words_ptr,  # (P, W) int64: the pool's raw bytes as 64-bit words, one row per page
    page_ids_ptr,  # (N,) int32/int64 pages to hash
    seeds_ptr,  # (N,) int64 one seed per page
    partial_ptr,  # (N, SPLITS) int64 out: wrapping sum of this split's terms
    words_per_page,
    words_per_split,
    num_pages,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    split = tl.program_id(1)
    page = tl.load(page_ids_ptr + n).to(tl.int64)
    # Out-of-range ids were rejected by the launcher; masking again keeps the kernel in bounds.
    page_ok = (page >= 0) & (page < num_pages)
    seed = tl.load(seeds_ptr + n).to(tl.uint64, bitcast=True)
    mult = _fmix64(seed) | 1
    base = words_ptr + page * words_per_page
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    start = split * words_per_split
    stop = tl.minimum(start + words_per_split, words_per_page)
    stop = tl.where(page_ok, stop, start)
    for w0 in range(start, stop, BLOCK):
        idx = w0 + tl.arange(0, BLOCK)
        m = idx < stop
        word = tl.load(base + idx, mask=m, other=0).to(tl.uint64, bitcast=True)
        # Xor the word with its position key, multiply by the seed's multiplier, fold.
        x = (word ^ (idx.to(tl.uint64) * 0x9E3779B97F4A7C15)) * mult
        x = x ^ (x >> 32)
        acc += tl.where(m, x, 0)
    total = tl.sum(acc, axis=0)
    tl.store(partial_ptr + n * SPLITS + split, total.to(tl.int64, bitcast=True))


def page_checksum(
    kv_pages: torch.Tensor, page_ids: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Triton launcher of ``kernels.page_checksum``; bit-identical to the reference."""
    _checks.check_page_ids(page_ids, kv_pages)
    _checks.check_same_device(seeds, kv_pages)
    _checks.check_dtype("seeds", seeds, torch.int64)
    if seeds.shape != page_ids.shape:
        raise ValueError(f"seeds shape {tuple(seeds.shape)} differs from page_ids {page_ids.shape}")
    _check_runnable(kv_pages.device)
    _checks.check_page_ids_in_range(page_ids, kv_pages.shape[0])
    from kernels.reference import page_words

    words = page_words(kv_pages)  # (P, W) int64 view
    n, num_words = page_ids.shape[0], words.shape[1]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=kv_pages.device)
    block = 1024
    # Split each page so that a handful of pages still fill the device; the wrapping sum is
    # associative and commutative, so the split cannot change the result.
    splits = max(1, min(64, triton.cdiv(num_words, 16 * block), triton.cdiv(512, n)))
    per_split = triton.cdiv(triton.cdiv(num_words, splits), block) * block
    splits = triton.cdiv(num_words, per_split)
    partial = torch.empty(n, splits, dtype=torch.int64, device=kv_pages.device)
    _page_checksum_kernel[(n, splits)](
        words,
        page_ids.contiguous(),
        seeds.contiguous(),
        partial,
        num_words,
        per_split,
        kv_pages.shape[0],
        SPLITS=splits,
        BLOCK=block,
    )
    return partial.sum(dim=1)  # int64 sum wraps mod 2**64 like the kernel's


# --------------------------------------------------------------------------------------------------
# page scrub


@triton.jit
def _scrub_kernel(
    kv_ptr,  # (P, L, 2, page_size, kvh, D) the whole pool, contiguous
    page_ids_ptr,  # (N,) int32/int64 pages to scrub
    from_ptr,  # (N,) int64 first slot to zero in each page
    num_pages,
    block_elems,  # page_size * kvh * D: one (layer, K or V) block of a page
    slot_elems,  # kvh * D: one slot of such a block
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    lkv = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
    chunk = tl.program_id(2)
    page = tl.load(page_ids_ptr + n).to(tl.int64)
    # Out-of-range ids were rejected by the launcher; an empty range keeps the kernel in bounds.
    page_ok = (page >= 0) & (page < num_pages)
    first = tl.where(page_ok, tl.load(from_ptr + n) * slot_elems, block_elems)
    page = tl.where(page_ok, page, 0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    m = (offs >= first) & (offs < block_elems)
    base = kv_ptr + (page * tl.num_programs(1) + lkv) * block_elems
    zero = tl.zeros([BLOCK], dtype=kv_ptr.dtype.element_ty)
    tl.store(base + offs, zero, mask=m)


def scrub_pages(
    kv_pages: torch.Tensor, page_ids: torch.Tensor, from_slot: int | torch.Tensor
) -> None:
    """Triton launcher of ``kernels.scrub_pages``."""
    from kernels.reference import from_slots

    _checks.check_pool(kv_pages)
    _checks.check_page_ids(page_ids, kv_pages)
    _check_runnable(kv_pages.device)
    _checks.check_page_ids_in_range(page_ids, kv_pages.shape[0])
    starts = from_slots(from_slot, page_ids, kv_pages.shape[3]).contiguous()
    n = page_ids.shape[0]
    if n == 0:
        return
    _, num_layers, _, page_size, num_kv_heads, head_dim = kv_pages.shape
    slot_elems = num_kv_heads * head_dim
    block_elems = page_size * slot_elems
    block = min(4096, triton.next_power_of_2(block_elems))
    grid = (n, num_layers * 2, triton.cdiv(block_elems, block))
    _scrub_kernel[grid](
        kv_pages,
        page_ids.contiguous(),
        starts,
        kv_pages.shape[0],
        block_elems,
        slot_elems,
        BLOCK=block,
    )
