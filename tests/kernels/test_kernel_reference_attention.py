"""The torch reference of paged decode attention against dense SDPA, and its generation check."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("page_size", "head_dim", "num_heads", "num_kv_heads"),
    [(16, 32, 4, 2), (32, 64, 4, 4), (16, 128, 8, 1)],
)
def test_matches_dense_sdpa(
    make_pool, make_batch, dense_attention, dtype, page_size, head_dim, num_heads, num_kv_heads
):
    pool = make_pool(dtype=dtype, page_size=page_size, head_dim=head_dim, num_kv_heads=num_kv_heads)
    # 1 token, exactly one page, a masked tail, exactly max_pages pages.
    lens = [1, page_size, 2 * page_size + 5, 4 * page_size]
    batch = make_batch(pool, lens, num_heads=num_heads)
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=1))
    assert flags.tolist() == [False, False, False, False]
    assert out.dtype == dtype and out.shape == (4, num_heads, head_dim)
    want = dense_attention(pool, batch, 1)
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_dispatcher_runs_the_reference_on_cpu(make_pool, make_batch):
    pool = make_pool()
    batch = make_batch(pool, [5, 20])
    got = kernels.paged_decode_attention(*batch.args(pool, layer=0))
    want = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_stale_generation_flags_only_that_sequence(make_pool, make_batch, dense_attention):
    pool = make_pool()
    batch = make_batch(pool, [20, 20, 33])
    clean, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [False, False, False]  # positive control
    # Sequence 1's second page was freed and handed to someone else: its generation moved on.
    pool.page_gen[batch.block_tables[1, 1].long()] += 1
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [False, True, False]
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])
    torch.testing.assert_close(out[[0, 2]], dense_attention(pool, batch, 0)[[0, 2]])


def test_stale_page_beyond_seq_len_is_not_read_or_flagged(make_pool, make_batch):
    pool = make_pool()
    batch = make_batch(pool, [16, 17])
    # Entries past ceil(seq_len / page_size) may hold anything: a stale generation, a wild id.
    batch.expected_gen[0, 1:] = -5
    batch.block_tables[0, 1:] = 10**6
    batch.block_tables[1, 2:] = -3
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [False, False]
    assert bool(torch.isfinite(out).all())


def test_page_id_outside_pool_within_seq_len_is_flagged(make_pool, make_batch):
    pool = make_pool()
    batch = make_batch(pool, [17, 17])
    batch.block_tables[0, 1] = pool.kv.shape[0]  # one past the last page
    batch.block_tables[1, 0] = -1
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [True, True]
    assert torch.equal(out, torch.zeros_like(out))


def test_seq_len_beyond_block_table_is_flagged(make_pool, make_batch):
    pool = make_pool()
    batch = make_batch(pool, [64, 10], max_pages=4)
    batch.seq_lens[0] = 65  # would need a fifth page the table cannot name
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [True, False]
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_seq_len_below_one_is_flagged(make_pool, make_batch):
    # The contract is seq_len >= 1; a row with less has nothing to attend to and used to come out
    # as zeros with no flag, as if it were a valid answer.
    pool = make_pool()
    batch = make_batch(pool, [1, 20, 20, 20, 33])
    clean, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [False] * 5  # control: seq_len 1, the least valid, is not flagged
    batch.seq_lens[1:4] = torch.tensor([0, -5, -(2**31)], dtype=torch.int32)
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [False, True, True, True, False]
    assert int(out[1:4].count_nonzero()) == 0
    assert torch.equal(out[[0, 4]], clean[[0, 4]])
    # the dispatcher and a plan agree
    got = kernels.paged_decode_attention(*batch.args(pool, layer=0))
    assert torch.equal(got[0], out) and torch.equal(got[1], flags)


def test_zero_width_block_table_flags_every_row(make_pool, make_batch):
    # A table with no columns names no page: every row needs more pages than it holds (or has
    # seq_len < 1) and is flagged, as the kernel flags it; the reference used to raise instead.
    pool = make_pool()
    clean, flags = reference.paged_decode_attention(
        *make_batch(pool, [1, 17], max_pages=2).args(pool, layer=0)
    )
    assert flags.tolist() == [False, False]  # control: the rows with a table are not flagged
    assert int(clean.count_nonzero()) > 0
    batch = make_batch(pool, [1, 0, 17], max_pages=0)
    assert batch.block_tables.shape == (3, 0)
    out, flags = reference.paged_decode_attention(*batch.args(pool, layer=0))
    assert flags.tolist() == [True, True, True]
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert int(out.count_nonzero()) == 0
    attend = kernels.plan_decode_attention(*plan_args(pool, batch))
    for got in (attend(batch.q, 1), kernels.paged_decode_attention(*batch.args(pool, layer=0))):
        assert torch.equal(got[0], out) and torch.equal(got[1], flags)


def test_nan_in_a_read_slot_comes_out_nan_not_zeros(make_pool, make_batch):
    # A NaN (an fp16 overflow's inf does the same) in K the row reads is that row's answer, on
    # both paths: never turned into a plausible zero, never flagged (no page was misused).
    pool = make_pool()
    batch = make_batch(pool, [20, 20, 0])
    pool.kv[int(batch.block_tables[1, 1]), 0, 0, 2, 0] = float("nan")  # token 18, kv head 0
    nan_heads = [[False] * 4, [True, True, False, False], [False] * 4]  # heads 0-1 read kv head 0
    for path in (reference.paged_decode_attention, reference._attention_flagging):
        out, flags = path(*batch.args(pool, layer=0))
        assert flags.tolist() == [False, False, True]
        assert out.isnan().any(dim=2).tolist() == nan_heads
        assert int(out[2].count_nonzero()) == 0  # control: the empty row is still zeros
        assert bool(torch.isfinite(out[0]).all()) and int(out[0].count_nonzero()) > 0


def test_rejects_bad_arguments(make_pool, make_batch):
    pool = make_pool()
    batch = make_batch(pool, [5])
    args = list(batch.args(pool, layer=0))
    with pytest.raises(ValueError, match="layer 2 out of range"):
        reference.paged_decode_attention(*args[:2], 2, *args[3:])
    bad_tables = batch.block_tables.long()
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        reference.paged_decode_attention(*args[:3], bad_tables, *args[4:])
    with pytest.raises(ValueError, match="q dtype"):
        reference.paged_decode_attention(batch.q.half(), *args[1:])
    with pytest.raises(ValueError, match="not a multiple"):
        reference.paged_decode_attention(batch.q[:, :3], *args[1:])


def short_path(q, kv_pages, layer, *shared):
    """The reference's short path for one call (``paged_decode_attention``'s arguments); None
    when it declines, having read no K/V."""
    return reference.DecodeAttentionPlan(kv_pages, *shared)._all_pages_current(q, layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_short_path_equals_the_flagging_path_bit_for_bit(make_pool, make_batch, dtype):
    # The reference takes a few-op path when every page read is current and falls back to the
    # per-row flagging path otherwise; on a clean batch both must give the same bits.
    pool = make_pool(dtype=dtype)
    batch = make_batch(pool, [1, 16, 17, 40])
    batch.block_tables[0, 1:] = 10**6  # unread entries may hold anything
    batch.expected_gen[1, 1:] = -5
    args = batch.args(pool, layer=1)
    short = short_path(*args)
    assert short is not None
    full = reference._attention_flagging(*args)
    assert torch.equal(short[0], full[0]) and torch.equal(short[1], full[1])
    assert short[1].tolist() == [False] * 4


def test_the_short_path_declines_every_case_that_needs_a_flag(make_pool, make_batch):
    pool = make_pool()

    def short(edit) -> object:
        batch = make_batch(pool, [20, 33], max_pages=4)
        edit(batch)
        return short_path(*batch.args(pool, layer=0))

    assert short(lambda b: None) is not None  # control: a clean batch takes it
    assert short(lambda b: b.expected_gen[1, 2].sub_(1)) is None  # stale page
    assert short(lambda b: b.block_tables[0, 1].fill_(-1)) is None  # id below the pool
    assert short(lambda b: b.block_tables[1, 0].fill_(pool.kv.shape[0])) is None  # above it
    assert short(lambda b: b.seq_lens[0].fill_(0)) is None  # nothing to attend to
    assert short(lambda b: b.seq_lens[1].fill_(65)) is None  # beyond the table

    def alias_last_page(b) -> None:
        # -1 read from the end would be the pool's last page: give it the generation expected, so
        # only the range check can refuse it
        b.block_tables[0, 0] = -1
        b.expected_gen[0, 0] = pool.page_gen[-1]

    assert short(alias_last_page) is None

    def uniform(edit) -> object:  # every row the same length: the path without a read mask
        batch = make_batch(pool, [33, 33], max_pages=4)
        edit(batch)
        return short_path(*batch.args(pool, layer=0))

    assert uniform(lambda b: None) is not None
    assert uniform(alias_last_page) is None
    assert uniform(lambda b: b.expected_gen[1, 2].sub_(1)) is None
    assert uniform(lambda b: b.block_tables[1, 1].fill_(pool.kv.shape[0])) is None


def plan_args(pool, batch) -> tuple:
    """``plan_decode_attention``'s arguments: ``paged_decode_attention``'s without q and layer."""
    _, kv, _, *rest = batch.args(pool, layer=0)
    return (kv, *rest)


@pytest.mark.parametrize("lens", [[5, 20, 33], [16, 16]])  # mixed lengths, and one length
def test_a_plan_gives_each_layer_what_one_call_gives(make_pool, make_batch, lens):
    pool = make_pool(num_layers=3)
    batch = make_batch(pool, lens)
    attend = kernels.plan_decode_attention(*plan_args(pool, batch))
    for layer in range(3):
        q = torch.randn_like(batch.q)
        got = attend(q, layer)
        want = reference.paged_decode_attention(q, *batch.args(pool, layer)[1:])
        assert torch.equal(got[0], want[0])
        assert got[1].tolist() == want[1].tolist() == [False] * len(lens)
    # Control: the layers hold different K/V, so the loop above could tell them apart.
    assert not torch.equal(attend(batch.q, 0)[0], attend(batch.q, 1)[0])


def test_a_plan_checks_the_generations_anew_at_every_layer(make_pool, make_batch):
    pool = make_pool(num_layers=2)
    batch = make_batch(pool, [20, 20, 33])
    attend = kernels.plan_decode_attention(*plan_args(pool, batch))
    _, flags0 = attend(batch.q, 0)
    assert flags0.tolist() == [False, False, False]  # control: every page current at layer 0
    assert attend.flags.tolist() == [False, False, False]  # control: nothing flagged so far
    # Between the layers of the step, sequence 1's second page changes owner.
    moved = batch.block_tables[1, 1].long()
    pool.page_gen[moved] += 1
    out1, flags1 = attend(batch.q, 1)
    assert flags1.tolist() == [False, True, False]
    assert torch.equal(out1[1], torch.zeros_like(out1[1]))
    want = reference.paged_decode_attention(*batch.args(pool, layer=1))
    assert torch.equal(out1, want[0]) and torch.equal(flags1, want[1])
    # The plan's flags are the OR over its calls: a later clean call (the page's generation put
    # back) does not clear them, and flagging wrote nothing into an earlier call's flags.
    assert attend.flags.tolist() == [False, True, False]
    pool.page_gen[moved] -= 1
    _, flags2 = attend(batch.q, 0)
    assert flags2.tolist() == [False, False, False]
    assert attend.flags.tolist() == [False, True, False]
    assert flags0.tolist() == [False, False, False]


def test_a_plan_rejects_shared_arguments_at_once_and_a_bad_layer_or_query_per_call(
    make_pool, make_batch
):
    pool = make_pool()
    batch = make_batch(pool, [5])
    kv, tables, *rest = plan_args(pool, batch)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        kernels.plan_decode_attention(kv, tables.long(), *rest)
    attend = kernels.plan_decode_attention(kv, tables, *rest)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        attend(batch.q, 2)
    with pytest.raises(ValueError, match=r"q must be \[1, num_heads, 32\]"):
        attend(torch.cat([batch.q, batch.q]), 0)  # two rows for a batch of one
    with pytest.raises(ValueError, match="q dtype"):
        attend(batch.q.half(), 0)
    assert attend(batch.q, 1)[1].tolist() == [False]  # control: the same plan, good arguments
