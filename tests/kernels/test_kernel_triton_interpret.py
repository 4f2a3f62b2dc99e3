"""Every Triton kernel, run on CPU by the Triton interpreter, against its torch reference.

The interpreter is picked when triton is first imported, so the launchers run in one subprocess
(``interpret_runner.py``) per module; this process builds the inputs, runs the references and
compares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted

from kernels import reference

HERE = Path(__file__).resolve().parent
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
STALE_FLAGS = [False, True, False, False, True]
SHORT_FLAGS = [False, True, True, True, False]  # seq_len 1 (valid), 0, -5, INT32_MIN, 33


def _attention_cases(make_pool, make_batch) -> dict:
    cases = {}
    for name, dtype in DTYPES.items():
        pool = make_pool(dtype=dtype, num_pages=24)
        # One token, exactly one page, a masked tail, exactly max_pages pages.
        batch = make_batch(pool, [1, 16, 37, 64], seed=2)
        cases[f"attn_clean_{name}"] = (pool, batch, 1)
        # A pool of its own: make_batch writes NaN poison into the tails of the pages it uses.
        pool_stale = make_pool(dtype=dtype, num_pages=24, seed=1)
        stale = make_batch(pool_stale, [20, 20, 33, 17, 64], seed=3)
        pool_stale.page_gen[stale.block_tables[1, 1].long()] += 1  # read, stale: flagged
        stale.expected_gen[3, 2] = -1  # stale but past seq_len: not read, not flagged
        stale.block_tables[3, 3] = 10**6  # wild id past seq_len: not read
        stale.seq_lens[4] = 65  # needs a fifth page the table cannot name: flagged
        cases[f"attn_stale_{name}"] = (pool_stale, stale, 0)
    # seq_len < 1 breaks the contract: flagged like a stale page. f32 only (the check reads no
    # K/V, so the dtype cannot matter); the rows' tables name real pages, which must not be read.
    pool_short = make_pool(num_pages=24, seed=8)
    short = make_batch(pool_short, [1, 20, 20, 20, 33], seed=9)
    short.seq_lens[1:4] = torch.tensor([0, -5, -(2**31)], dtype=torch.int32)
    cases["attn_short_f32"] = (pool_short, short, 0)
    shapes = {
        "attn_d64_ps32_mha": (
            dict(page_size=32, head_dim=64, num_kv_heads=4),
            [31, 32, 33, 100],
            4,
        ),
        "attn_d128_group8": (dict(head_dim=128, num_kv_heads=1), [5, 48], 8),
        "attn_ps48": (dict(page_size=48, num_kv_heads=2), [47, 48, 49, 150], 4),
    }
    for name, (shape, lens, heads) in shapes.items():
        pool = make_pool(num_pages=16, **shape)
        cases[name] = (pool, make_batch(pool, lens, num_heads=heads, seed=4), 1)
    return cases


def _page_cases(make_pool) -> dict:
    """name -> (launcher, args) for the write, scrub and checksum launchers."""
    cases: dict = {}
    for name, dtype in DTYPES.items():
        pool = make_pool(dtype=dtype, num_pages=6)
        gen = torch.Generator().manual_seed(5)
        k = torch.randn(5, 2, 32, generator=gen).to(dtype)
        # V as a strided view (head stride 64) exercises the launcher's stride handling.
        v = torch.randn(5, 2, 64, generator=gen).to(dtype)[:, :, :32]
        slots = torch.tensor([17, -1, 31, 32, 95])
        cases[f"write_{name}"] = ("write_kv_pages", (k, v, pool.kv.clone(), 1, slots))
        ids = torch.tensor([3, 1, 5])
        cases[f"scrub_int_{name}"] = ("scrub_pages", (pool.kv.clone(), ids, 5))
        cases[f"scrub_whole_{name}"] = ("scrub_pages", (pool.kv.clone(), ids, 0))
        per_page = torch.tensor([0, 9, 16])
        cases[f"scrub_per_page_{name}"] = ("scrub_pages", (pool.kv.clone(), ids, per_page))
        seeds = torch.tensor([1, -2, 1 << 62])
        cases[f"checksum_{name}"] = ("page_checksum", (pool.kv, torch.tensor([3, 0, 5]), seeds))
    # 32768 words per page: the launcher splits each page across programs.
    big = make_pool(num_pages=3, page_size=32, num_kv_heads=4, head_dim=64)
    seeds = torch.tensor([7, 8, 9])
    cases["checksum_split_f32"] = ("page_checksum", (big.kv, torch.tensor([2, 1, 0]), seeds))
    return cases


def _planned_case(make_pool, make_batch) -> tuple:
    """A plan used for two layers; sequence 1's second page changes owner in between."""
    pool = make_pool(num_pages=24, seed=6)
    batch = make_batch(pool, [20, 20, 33], seed=7)
    _, kv, _, *rest = batch.args(pool, 0)
    return (kv, *rest, batch.q, int(batch.block_tables[1, 1]))


def _interpret(jobs: dict, tmp: Path, timeout: float) -> dict:
    """Run ``jobs`` (name -> (launcher, args)) in an interpreter subprocess; name -> result."""
    return run_interpreted(HERE / "interpret_runner.py", jobs, tmp, timeout)


def _attention_jobs(attn: dict) -> dict:
    return {
        name: ("paged_decode_attention", b.args(p, layer)) for name, (p, b, layer) in attn.items()
    }


@pytest.fixture(scope="module")
def runs(make_pool, make_batch, tmp_path_factory):
    """Build all cases, run the Triton launchers once in an interpreter subprocess."""
    attn = _attention_cases(make_pool, make_batch)
    pages = _page_cases(make_pool)
    jobs = _attention_jobs(attn)
    jobs.update(pages)
    jobs["planned"] = ("planned_attention", _planned_case(make_pool, make_batch))
    results = _interpret(jobs, tmp_path_factory.mktemp("interpret"), timeout=240)
    return attn, pages, results


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN payloads included (the pools carry NaN poison)."""
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("name", [f"attn_clean_{n}" for n in DTYPES])
def test_attention_clean_matches_reference_and_dense(runs, dense_attention, name):
    attn, _, results = runs
    pool, batch, layer = attn[name]
    out, flags = results[name]
    want, want_flags = reference.paged_decode_attention(*batch.args(pool, layer))
    assert flags.tolist() == want_flags.tolist() == [False, False, False, False]
    tol = TOL[batch.q.dtype]
    assert out.dtype == batch.q.dtype
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    # Positive control: with every generation matching, Triton is plain attention.
    dense = dense_attention(pool, batch, layer)
    torch.testing.assert_close(out.float(), dense, atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("name", [f"attn_stale_{n}" for n in DTYPES])
def test_attention_stale_generations_flag_exactly_those_rows(runs, name):
    attn, _, results = runs
    pool, batch, layer = attn[name]
    out, flags = results[name]
    want, want_flags = reference.paged_decode_attention(*batch.args(pool, layer))
    assert flags.tolist() == want_flags.tolist() == STALE_FLAGS
    assert int(out[torch.tensor(STALE_FLAGS)].count_nonzero()) == 0
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    assert bool(torch.isfinite(out).all())


def test_attention_seq_len_below_one_is_flagged_as_the_reference_does(runs):
    attn, _, results = runs
    pool, batch, layer = attn["attn_short_f32"]
    out, flags = results["attn_short_f32"]
    want, want_flags = reference.paged_decode_attention(*batch.args(pool, layer))
    assert flags.tolist() == want_flags.tolist() == SHORT_FLAGS
    assert int(out[torch.tensor(SHORT_FLAGS)].count_nonzero()) == 0
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # Positive control: the valid rows (seq_len 1 and 33) are plain attention, and nonzero.
    assert int(out[0].count_nonzero()) > 0 and int(out[4].count_nonzero()) > 0


@pytest.mark.parametrize("name", ["attn_d64_ps32_mha", "attn_d128_group8", "attn_ps48"])
def test_attention_shapes(runs, dense_attention, name):
    attn, _, results = runs
    pool, batch, layer = attn[name]
    out, flags = results[name]
    assert not bool(flags.any())
    want, _ = reference.paged_decode_attention(*batch.args(pool, layer))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, dense_attention(pool, batch, layer), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["write", "scrub_int", "scrub_whole", "scrub_per_page"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_in_place_kernels_are_bit_identical(runs, kind, dtype):
    _, pages, results = runs
    fn, args = pages[f"{kind}_{dtype}"]
    pool = args[2] if fn == "write_kv_pages" else args[0]
    before = pool.clone()
    getattr(reference, fn)(*args)  # args hold this process's copy of the pool
    assert not same_bits(pool, before)  # control: the call changed something
    assert same_bits(results[f"{kind}_{dtype}"], pool)


@pytest.mark.parametrize("name", [*(f"checksum_{n}" for n in DTYPES), "checksum_split_f32"])
def test_checksum_is_bit_identical(runs, name):
    _, pages, results = runs
    _, args = pages[name]
    got = results[name]
    want = reference.page_checksum(*args)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()
    assert len(set(want.tolist())) == len(want)  # control: distinct pages, distinct sums


def test_a_plan_checks_the_generations_anew_at_every_layer(runs, make_pool, make_batch):
    _, _, results = runs
    (out0, flags0), (out1, flags1), plan_flags0, plan_flags1 = results["planned"]
    kv, tables, expected, page_gen, lens, scale, q, bump = _planned_case(make_pool, make_batch)
    want0 = reference.paged_decode_attention(q, kv, 0, tables, expected, page_gen, lens, scale)
    assert flags0.tolist() == want0[1].tolist() == [False, False, False]  # control
    torch.testing.assert_close(out0, want0[0], atol=1e-5, rtol=1e-5)
    page_gen[bump] += 1  # as the runner did between the two layers
    want1 = reference.paged_decode_attention(q, kv, 1, tables, expected, page_gen, lens, scale)
    assert flags1.tolist() == want1[1].tolist() == [False, True, False]
    # The plan's flags: none after the clean layer (control), the OR of both after the second.
    assert plan_flags0.tolist() == [False, False, False]
    assert plan_flags1.tolist() == [False, True, False]
    assert int(out1[1].count_nonzero()) == 0
    torch.testing.assert_close(out1, want1[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Edge rows: seq_len near INT32_MAX, NaN/inf in K/V a row reads, a block table of width 0.

HUGE_FLAGS = [False, True, True, True, False]  # seq_len 20, 2**31-1, 2**31-15, 2**31-16, 33


def _huge_case(make_pool, make_batch) -> tuple:
    """seq_lens within page_size of INT32_MAX: ``seq_len + page_size - 1`` wraps int32 for the
    first two (not the third: it was flagged before the fix too). Each row's table names real
    pages, so a row that escapes the flag would read them."""
    pool = make_pool(num_pages=12, seed=10)
    batch = make_batch(pool, [20, 20, 20, 20, 33], seed=11)
    batch.seq_lens[1:4] = torch.tensor([2**31 - 1, 2**31 - 15, 2**31 - 16], dtype=torch.int32)
    return pool, batch, 0


def _nan_cases(make_pool, make_batch) -> dict:
    """A NaN (f32) and an inf (f16, what an fp16 overflow gives) in a K slot a row reads, in one
    kv head only (query heads 0-1 read kv head 0, heads 2-3 kv head 1); beside them a clean row
    and a seq_len 0 row (flagged: zeros, NaN nowhere)."""
    cases = {}
    for name, dtype, value, row, head in (
        ("attn_nan_k_f32", torch.float32, float("nan"), 1, 0),
        ("attn_inf_k_f16", torch.float16, float("inf"), 0, 1),
    ):
        pool = make_pool(dtype=dtype, num_pages=12, seed=12)
        batch = make_batch(pool, [20, 20, 5, 33], seed=13)
        batch.seq_lens[2] = 0
        page = int(batch.block_tables[row, 1])
        pool.kv[page, 1, 0, 2, head] = value  # token 18 of 20, layer 1, K
        cases[name] = (pool, batch, 1)
    return cases


def _width0_case(make_pool, make_batch) -> tuple:
    """A block table with no columns: every row needs more pages than it names (or has seq_len
    < 1), so every row is flagged."""
    pool = make_pool(num_pages=6, seed=14)
    return pool, make_batch(pool, [1, 0, 17], max_pages=0, seed=15), 0


@pytest.fixture(scope="module")
def huge_runs(make_pool, make_batch, tmp_path_factory):
    """The near-INT32_MAX rows in a subprocess of their own: without the int64 page count the
    kernel walks ~2**31 tokens past the block table, and that must not take the other tests'
    results with it."""
    attn = {"attn_huge": _huge_case(make_pool, make_batch)}
    return attn, _interpret(_attention_jobs(attn), tmp_path_factory.mktemp("huge"), timeout=90)


@pytest.fixture(scope="module")
def edge_runs(make_pool, make_batch, tmp_path_factory):
    attn = _nan_cases(make_pool, make_batch)
    attn["attn_width0"] = _width0_case(make_pool, make_batch)
    return attn, _interpret(_attention_jobs(attn), tmp_path_factory.mktemp("edge"), timeout=120)


def test_attention_seq_len_near_int32_max_is_flagged_as_the_reference_does(huge_runs):
    attn, results = huge_runs
    pool, batch, layer = attn["attn_huge"]
    out, flags = results["attn_huge"]
    want, want_flags = reference.paged_decode_attention(*batch.args(pool, layer))
    assert flags.tolist() == want_flags.tolist() == HUGE_FLAGS
    assert int(out[torch.tensor(HUGE_FLAGS)].count_nonzero()) == 0
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # Positive control: the valid rows (seq_len 20 and 33) are plain attention, and nonzero.
    assert bool(torch.isfinite(out).all())
    assert int(out[0].count_nonzero()) > 0 and int(out[4].count_nonzero()) > 0


@pytest.mark.parametrize(
    ("name", "row", "head"), [("attn_nan_k_f32", 1, 0), ("attn_inf_k_f16", 0, 1)]
)
def test_attention_nan_in_a_read_slot_comes_out_nan_as_in_the_reference(
    edge_runs, dense_attention, name, row, head
):
    attn, results = edge_runs
    pool, batch, layer = attn[name]
    out, flags = results[name]
    want, want_flags = reference.paged_decode_attention(*batch.args(pool, layer))
    # NaN is not a flag (no page was misused): the row's answer is NaN, for the caller to see.
    assert flags.tolist() == want_flags.tolist() == [False, False, True, False]
    nan_heads = torch.zeros(out.shape[:2], dtype=torch.bool)
    nan_heads[row, 2 * head : 2 * head + 2] = True  # the query heads of the poisoned kv head
    assert torch.equal(want.isnan().all(dim=2), nan_heads)
    assert torch.equal(out.isnan().any(dim=2), nan_heads)
    assert torch.equal(out.isnan().all(dim=2), nan_heads)
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol, equal_nan=True)
    # Positive control: the legitimately empty row (seq_len 0, flagged) is still zeros, and the
    # other heads and rows are unchanged: plain attention.
    assert int(out[2].count_nonzero()) == 0
    clean = ~nan_heads
    clean[2] = False
    dense = dense_attention(pool, batch, layer)
    torch.testing.assert_close(out[clean].float(), dense[clean], atol=2 * tol, rtol=2 * tol)
    assert bool(torch.isfinite(out[clean]).all()) and int(out[clean].count_nonzero()) > 0


def test_attention_zero_width_block_table_flags_every_row_as_the_reference_does(edge_runs):
    attn, results = edge_runs
    pool, batch, layer = attn["attn_width0"]
    out, flags = results["attn_width0"]
    want, want_flags = reference.paged_decode_attention(*batch.args(pool, layer))
    assert flags.tolist() == want_flags.tolist() == [True, True, True]
    assert out.dtype == want.dtype and out.shape == want.shape == batch.q.shape
    assert int(out.count_nonzero()) == 0 and int(want.count_nonzero()) == 0
