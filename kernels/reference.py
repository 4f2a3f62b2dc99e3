"""Torch references for the four kernels; the CPU services run these on every step.

Each function has the same contract as its Triton twin in ``kernels.triton_impl``: the attention
output matches to float tolerance (the reduction order differs), the other three match bit for bit.
Everything is vectorised over tokens; the only Python loops run over pages or chunks of a page.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from kernels import _checks

_U64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    """Reinterpret the low 64 bits of ``x`` as a two's-complement int64."""
    x &= _U64
    return x - (1 << 64) if x >= 1 << 63 else x


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer on a Python int (taken mod 2**64), returned unsigned."""
    x &= _U64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _U64
    x ^= x >> 33
    return x


def seed_multiplier(seed: int) -> int:
    """The per-page odd multiplier of the checksum, as a signed int64 (see ``page_checksum``)."""
    return _signed64(fmix64(seed) | 1)


# --------------------------------------------------------------------------------------------------
# paged decode attention


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
    """Torch reference of ``kernels.paged_decode_attention`` (same contract)."""
    return plan_decode_attention(kv_pages, block_tables, expected_gen, page_gen, seq_lens, scale)(
        q, layer
    )


class DecodeAttentionPlan:
    """One decode step's attention on the CPU: what the batch reads is worked out once, and
    every call attends one layer and checks the generations of those pages anew.

    The common case takes few tensor ops per call: every page read is in the pool and current.
    Its check is one gather of the generations of exactly the pages read and one compare, against
    a list of the generations expected of them made once per step. Their ids are range-checked
    once, when the plan is made (they come from ``block_tables`` and ``seq_lens``, fixed for the
    plan's life): on CUDA, where the reference runs when Triton is unusable, an id outside the
    pool reaching ``index_select`` is a device-side assert that kills the context, not an
    ``IndexError``. On a CPU with a small model the per-op dispatch cost, not arithmetic, is
    what the check costs, so a call that flags nothing makes no flags tensor: it returns the
    plan's all-False flags (made once), and ``flags``, the OR over the calls, changes only when
    a call flags a row. Any other batch (a seq_len <= 0 or beyond the table, a page id outside
    the pool, a stale generation) goes through ``_attention_flagging``, which flags rows.
    """

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
        self.kv_pages, self.page_gen, self.scale = kv_pages, page_gen, scale
        self.block_tables, self.expected_gen, self.seq_lens = block_tables, expected_gen, seq_lens
        self.batch = block_tables.shape[0]
        self._reads = self._what_is_read()
        self._clear = torch.zeros(self.batch, dtype=torch.bool, device=kv_pages.device)
        self.flags = self._clear  # replaced, never written into: ``_clear`` stays all False

    def _what_is_read(self) -> _Reads | None:
        """The short path's inputs; None when no call can take it (every call flags instead)."""
        if self.batch == 0:
            return None
        rows = _table_read(self.block_tables, self.seq_lens, self.kv_pages.shape[3])
        if rows is None:
            return None
        hi, read, table = rows
        expected = self.expected_gen[:, : table.shape[1]]
        if read is None:  # every row reads every entry of ``table``
            ids, generations = table.reshape(-1), expected.reshape(-1)
        else:
            ids, generations = table[read], expected[read]
        # Every row reads at least one page here, so ``ids`` is not empty; with them all in the
        # pool, page 0 (what ``table`` holds where a row reads nothing) is in it too.
        first, last = (int(x) for x in torch.aminmax(ids))
        if first < 0 or last >= self.kv_pages.shape[0]:
            return None
        if read is None:
            return _Reads(hi, table, ids, generations, None, None)
        valid = _valid_slots(table.shape[1] * self.kv_pages.shape[3], self.seq_lens)
        return _Reads(hi, table, ids, generations, valid, _invalid_slots(valid))

    def __call__(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` [B, num_heads, head_dim] over ``layer``; (out, error_flags)."""
        _checks.check_attention_call(q, self.kv_pages, layer, self.batch)
        fast = self._all_pages_current(q, layer)
        if fast is not None:
            return fast
        out, bad = _attention_flagging(
            q, self.kv_pages, layer, self.block_tables, self.expected_gen, self.page_gen,
            self.seq_lens, self.scale,
        )  # fmt: skip
        self.flags = self.flags | bad
        return out, bad

    def _all_pages_current(
        self, q: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The short path; None, having read no K/V, when any row needs the flagging path.

        (A numpy version of the check over views of the same memory was twice as fast timed in a
        loop but 1.3-1.6x slower inside real decode steps, between the matmuls, where torch's
        code is warm and numpy's is not.)
        """
        r = self._reads
        if r is None:
            return None
        # The ids are in the pool (``_what_is_read``). (``torch.take`` would be one op, but it
        # wraps a negative id around to a real page.)
        current = self.page_gen.index_select(0, r.ids)
        if not torch.equal(current, r.generations):
            return None
        out = _attend_pages(
            q, self.kv_pages, layer, r.table, r.hi, r.valid, self.scale, invalid=r.invalid
        )
        return out, self._clear


# Torch reference of ``kernels.plan_decode_attention`` (same contract): its class makes the plan.
plan_decode_attention = DecodeAttentionPlan


class _Reads(NamedTuple):
    """What a planned batch reads on the short path (a tuple: built once per decode step)."""

    hi: int  # the longest seq_len
    table: torch.Tensor  # (B, n) int64 page ids; entries a row does not read are page 0
    ids: torch.Tensor  # (N,) int64: the ids of the pages read, each once per row reading it
    generations: torch.Tensor  # (N,) int64: the generation expected of each
    valid: torch.Tensor | None  # (B, n * page_size) bool: the slots each row reads; None: hi each
    invalid: torch.Tensor | None  # ``_invalid_slots(valid)``, made once per step, not per layer


def _table_read(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[int, torch.Tensor | None, torch.Tensor] | None:
    """What the rows of a batch read: the longest seq_len ``hi``; ``read`` (B, n) bool, which of
    the first ``n = ceil(hi / page_size)`` table entries each row reads (None when every row has
    length ``hi`` and reads them all); and those entries as int64 (B, n), the unread ones set to
    page 0. None when a seq_len is <= 0 or needs more pages than the table holds."""
    lo, hi = (int(x) for x in torch.aminmax(seq_lens))
    n_read = (hi + page_size - 1) // page_size
    if lo <= 0 or n_read > block_tables.shape[1]:
        return None
    table = block_tables[:, :n_read]
    read = None
    if lo != hi:  # shorter rows: their table entries past their last page may hold any value
        n_pages = (seq_lens.to(torch.int64) + page_size - 1) // page_size
        read = torch.arange(n_read, device=table.device)[None, :] < n_pages[:, None]
        table = torch.where(read, table, 0)
    return hi, read, table.to(torch.int64)


def _valid_slots(slots: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """(B, slots) bool: which of the first ``slots`` slots each row reads (those before its
    seq_len)."""
    return torch.arange(slots, device=seq_lens.device)[None, :] < seq_lens[:, None]


def _invalid_slots(valid: torch.Tensor) -> torch.Tensor:
    """The flat indices (into ``valid.reshape(-1)``) of the slots ``valid`` (B, T) leaves out:
    what :func:`_attend` zeroes in K and V. A plan makes it once per step (three tensor ops that
    were made on every layer)."""
    return (~valid).reshape(-1).nonzero().squeeze(1)


def _attend_pages(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    hi: int,
    valid: torch.Tensor | None,
    scale: float,
    *,
    invalid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each row over the pages of its ``table`` row (int64, ids in the pool): over
    the slots ``valid`` (B, n * page_size) marks, or when it is None over the first ``hi`` slots
    (every row has length ``hi``: no mask at all). In q's dtype. ``invalid``: see
    :func:`_attend`."""
    k, v = _gather(kv_pages, layer, table)
    if valid is None:
        out = _attend(q, k[:, :hi], v[:, :hi], None, scale)
    else:
        out = _attend(q, k, v, valid, scale, invalid=invalid)
    return out.to(q.dtype)


def _gather(
    kv_pages: torch.Tensor, layer: int, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` for the pages in ``table`` (B, n): fresh (B, n * page_size, kvh, D)."""
    batch, n = table.shape
    _, _, _, page_size, num_kv_heads, head_dim = kv_pages.shape
    ids = table.reshape(-1)
    # index_select, not ``layer_kv[table, 0]``: the same bytes, 5-6x faster on the CPU (about
    # 60 against 340 us for 64 rows of 5 tiny-model pages), which was an eighth of a decode step
    # at batch 64. Callers pass ids in [0, num_pages): index_select refuses others with an
    # IndexError on the CPU only; on CUDA that is a device-side assert, which kills the context.
    k = kv_pages[:, layer, 0].index_select(0, ids)  # (B * n, page_size, kvh, D), fresh
    v = kv_pages[:, layer, 1].index_select(0, ids)
    shape = (batch, n * page_size, num_kv_heads, head_dim)
    return k.reshape(shape), v.reshape(shape)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
    *,
    invalid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of q (B, H, D) over k, v (B, T, kvh, D); float32 (B, H, D).

    ``valid`` (B, T) marks the slots a row may attend to (None: all). Invalid slots hold whatever
    was in the page before, even NaN, and a masked score is computed as score + (-inf), so
    NaN would survive the mask and 0 * NaN the softmax: they are zeroed in K and V first, as the
    kernel's masked loads never read them. A query head whose every score is -inf (an inf in q
    or K) comes out NaN, as the kernel's 0 / 0 does, and so does a row with no valid slot;
    callers zero the latter. ``k`` and ``v`` must be fresh copies (from ``_gather``): they are
    zeroed in place. ``invalid``: ``_invalid_slots(valid)`` when the caller has it (made once
    per step); computed here when None.
    """
    batch, num_heads, head_dim = q.shape
    _, t, num_kv_heads, _ = k.shape
    kf, vf = k.float(), v.float()
    mask = None
    if valid is not None:
        if invalid is None:
            invalid = _invalid_slots(valid)
        if invalid.numel():
            kf.view(batch * t, -1).index_fill_(0, invalid, 0.0)
            vf.view(batch * t, -1).index_fill_(0, invalid, 0.0)
        mask = valid[:, None, None, :]  # (B, 1, 1, T)
    # The query heads of one kv head are that head's "query positions": one SDPA call does GQA.
    qf = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.transpose(1, 2), vf.transpose(1, 2), attn_mask=mask, scale=scale
    ).reshape(batch, num_heads, head_dim)
    # SDPA gives a query head whose every score is -inf softmax weights of 0, so a row of zeros,
    # which would pass for an answer. Only a head whose output is all zeros can be one, so one
    # whose first element is zero: counting those (one op over B * H values; NaN counts as
    # nonzero) finds there is none, and only when there is one are such heads' scores computed.
    if head_dim and int(out.select(2, 0).count_nonzero()) < batch * num_heads:
        _nan_where_every_score_is_minus_inf(out, qf, kf, valid, scale)
    return out


def _nan_where_every_score_is_minus_inf(
    out: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, valid: torch.Tensor | None, scale: float
) -> None:
    """Set to NaN, in place, each head of ``out`` (B, H, D) that is all zeros because every score
    it had (q ``qf`` (B, kvh, G, D) against ``kf`` (B, T, kvh, D) over the ``valid`` slots) is
    -inf; an all-zero head with a score above -inf is a real answer and stays."""
    group = qf.shape[2]
    rows, heads = (out == 0).all(-1).nonzero(as_tuple=True)  # (N,) each
    q = qf.reshape(out.shape)[rows, heads]  # (N, D)
    k = kf[rows, :, heads // group]  # (N, T, D)
    scores = (k @ q[:, :, None]).squeeze(2) * scale  # (N, T)
    if valid is not None:  # an invalid slot's zeroed K may give NaN (inf * 0): not a score
        scores = torch.where(valid[rows], scores, float("-inf"))
    dead = (scores == float("-inf")).all(1)
    out[rows[dead], heads[dead]] = float("nan")


def _attention_flagging(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    expected_gen: torch.Tensor,
    page_gen: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any batch, with per-row flags: a flagged row reads no K/V and outputs zeros."""
    batch = q.shape[0]
    num_pages, page_size = kv_pages.shape[0], kv_pages.shape[3]
    max_pages = block_tables.shape[1]
    device = q.device

    seq = seq_lens.to(torch.int64)  # (B,)
    n_pages = (seq.clamp(min=0) + page_size - 1) // page_size  # (B,)
    page_idx = torch.arange(max_pages, device=device)  # (max_pages,)
    read = page_idx[None, :] < n_pages[:, None]  # (B, max_pages) pages the sequence reads
    pid = block_tables.to(torch.int64)
    in_range = (pid >= 0) & (pid < num_pages)
    safe_pid = torch.where(in_range, pid, 0)
    stale = ~in_range
    if num_pages:  # an empty pool has no page 0 to stand in for the ids outside it
        stale = stale | (page_gen[safe_pid] != expected_gen)
    # A sequence longer than its block table can describe is as wrong as a stale page, and so is
    # one with nothing to attend to (seq_len >= 1 is the contract; zeros would pass for an answer).
    bad = (read & stale).any(dim=1) | (n_pages > max_pages) | (seq < 1)  # (B,)

    # No row reads a page (an empty batch, every row flagged, a table of width 0 included): all
    # rows are zeros. (Gathering nothing would leave K/V with no slots to attend over.)
    n_read = int(torch.where(bad, 0, n_pages).max()) if batch else 0
    if n_read == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), bad
    # Flagged rows and unread table entries gather page 0 and are masked out below, so no byte of
    # a page the sequence does not own enters the arithmetic of its output.
    use = read[:, :n_read] & ~bad[:, None]  # (B, n_read)
    gather = torch.where(use, safe_pid[:, :n_read], 0)  # (B, n_read)
    k, v = _gather(kv_pages, layer, gather)
    pos = torch.arange(n_read * page_size, device=device)  # (T,)
    valid = (pos[None, :] < seq[:, None]) & ~bad[:, None]  # (B, T)
    out = _attend(q, k, v, valid, scale)
    # Rows with nothing valid (flagged) come out NaN: zero them. A row with something valid keeps
    # its NaN, if any (a NaN or inf in its K/V or q): that is its answer, as in the kernel.
    has_any = valid.any(dim=1)  # (B,)
    out = torch.where(has_any[:, None, None], out, 0.0)
    return out.to(q.dtype), bad


# --------------------------------------------------------------------------------------------------
# KV page write


def write_kv_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of ``kernels.write_kv_pages``.

    Raises ``ValueError`` for a slot outside ``[-1, num_pages * page_size)``; the Triton kernel,
    which cannot raise without a host sync, drops such tokens instead of writing outside the pool.
    """
    _checks.check_write_args(k, v, kv_pages, layer, slot_mapping)
    num_pages, num_layers, _, page_size = kv_pages.shape[:4]
    if slot_mapping.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(slot_mapping))
    if lo < -1 or hi >= num_pages * page_size:
        raise ValueError(f"slot_mapping must lie in [-1, {num_pages * page_size})")
    slots = slot_mapping
    if lo < 0:  # skipped tokens
        keep = slot_mapping >= 0
        slots, k, v = slot_mapping[keep], k[keep], v[keep]
    # The pool as rows of one token's (kvh * D) values: K of slot s in this layer is row
    # ((page * L + layer) * 2 + 0) * page_size + offset, and V is page_size rows further on.
    width = k.shape[1] * k.shape[2]
    rows = (slots // page_size * (num_layers * 2) + layer * 2) * page_size + slots % page_size
    flat = kv_pages.view(-1, width)  # a view: index_copy_ writes the pool
    flat.index_copy_(0, rows, k.reshape(-1, width))
    flat.index_copy_(0, rows + page_size, v.reshape(-1, width))


# --------------------------------------------------------------------------------------------------
# page checksum

# Words per chunk: big enough to amortise op dispatch and use both threads of torch's pool, small
# enough that the int64 working buffer (1 MiB) stays in cache between the passes over it.
_CHUNK_WORDS = 1 << 17
_POSITION_MULT = _signed64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd
_KEY_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _position_keys(words: int, device: torch.device) -> torch.Tensor:
    """``j * 0x9E3779B97F4A7C15 mod 2**64`` for every word index of a page, cached. (W,) int64."""
    key = (words, device)
    if key not in _KEY_CACHE:
        _KEY_CACHE[key] = torch.arange(words, dtype=torch.int64, device=device) * _POSITION_MULT
    return _KEY_CACHE[key]


def page_words(kv_pages: torch.Tensor) -> torch.Tensor:
    """The pool as 64-bit words, one row per page: (P, W) int64, a view of the pool's memory."""
    _checks.check_pool(kv_pages)
    flat = kv_pages.view(kv_pages.shape[0], -1)  # (P, elements per page)
    if flat.shape[1] * flat.element_size() % 8:
        raise ValueError("a page must be a whole number of 64-bit words")
    return flat.view(torch.int64)


def page_checksum(
    kv_pages: torch.Tensor, page_ids: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Torch reference of ``kernels.page_checksum`` (algorithm in ``kernels.CHECKSUM_ALGO``)."""
    _checks.check_page_ids(page_ids, kv_pages)
    _checks.check_same_device(seeds, kv_pages)
    _checks.check_dtype("seeds", seeds, torch.int64)
    if seeds.shape != page_ids.shape:
        raise ValueError(f"seeds shape {tuple(seeds.shape)} differs from page_ids {page_ids.shape}")
    _checks.check_page_ids_in_range(page_ids, kv_pages.shape[0])
    # Words are read little-endian and the x ^= x >>> 32 step reads an int64 as two int32 halves,
    # low half first.
    assert sys.byteorder == "little", "the checksum reference assumes a little-endian host"
    words = page_words(kv_pages)  # (P, W) int64
    num_words = words.shape[1]
    n = page_ids.shape[0]
    out = torch.zeros(n, dtype=torch.int64, device=kv_pages.device)
    if n == 0:
        return out
    mult = torch.tensor(
        [seed_multiplier(s) for s in seeds.tolist()], dtype=torch.int64, device=kv_pages.device
    )  # (N,)
    keys = _position_keys(num_words, kv_pages.device)  # (W,)
    cols = min(num_words, _CHUNK_WORDS)
    rows = max(1, _CHUNK_WORDS // num_words)  # small pages: several per pass
    buf = torch.empty(rows, cols, dtype=torch.int64, device=kv_pages.device)
    id_list = page_ids.tolist()
    # Four passes over the 1 MiB buffer (xor, multiply, fold, sum); the first reads the pool.
    for r0 in range(0, n, rows):
        ids = page_ids[r0 : r0 + rows]
        m = mult[r0 : r0 + rows, None]  # (R, 1)
        for c0 in range(0, num_words, cols):
            c1 = min(c0 + cols, num_words)
            x = buf[: ids.shape[0], : c1 - c0]  # (R, C) int64
            # One big page at a time reads a view; several small ones (whole rows: a page is
            # then at most half a chunk) need a gather.
            src = words[id_list[r0], None, c0:c1] if rows == 1 else words.index_select(0, ids)
            torch.bitwise_xor(src, keys[c0:c1], out=x)  # word ^ its position key
            x.mul_(m)  # wraps mod 2**64
            halves = x.view(torch.int32).unflatten(-1, (-1, 2))  # (R, C, 2): [lo, hi]
            halves[..., 0].bitwise_xor_(halves[..., 1])  # x ^= x >>> 32
            out[r0 : r0 + rows] += x.sum(dim=1)  # wrapping sum mod 2**64
    return out


# --------------------------------------------------------------------------------------------------
# page scrub


def scrub_pages(
    kv_pages: torch.Tensor, page_ids: torch.Tensor, from_slot: int | torch.Tensor
) -> None:
    """Torch reference of ``kernels.scrub_pages``."""
    _checks.check_page_ids(page_ids, kv_pages)
    _checks.check_page_ids_in_range(page_ids, kv_pages.shape[0])
    starts = from_slots(from_slot, page_ids, kv_pages.shape[3])
    if isinstance(from_slot, int) and from_slot == 0:
        kv_pages.index_fill_(0, page_ids.to(torch.int64), 0)
        return
    for page, start in zip(page_ids.tolist(), starts.tolist(), strict=True):
        kv_pages[page, :, :, start:].zero_()  # (L, 2, page_size - start, kvh, D)


def from_slots(
    from_slot: int | torch.Tensor, page_ids: torch.Tensor, page_size: int
) -> torch.Tensor:
    """``from_slot`` as an int64 tensor shaped like ``page_ids``, validated to [0, page_size]."""
    if isinstance(from_slot, int):
        starts = torch.full_like(page_ids, from_slot, dtype=torch.int64)
    else:
        _checks.check_same_device(from_slot, page_ids)
        _checks.check_dtype("from_slot", from_slot, torch.int32, torch.int64)
        if from_slot.shape != page_ids.shape:
            raise ValueError(f"from_slot shape {from_slot.shape} differs from {page_ids.shape}")
        starts = from_slot.to(torch.int64)
    if starts.numel() and (int(starts.min()) < 0 or int(starts.max()) > page_size):
        raise ValueError(f"from_slot must lie in [0, {page_size}]")
    return starts
