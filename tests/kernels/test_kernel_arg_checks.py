"""The argument checks the attention, checksum and scrub entry points share (``kernels._checks``).

The attention checks have a fast path (one expression over the tensors' metadata) in front of the
checks one by one; an argument the fast path lets through is never checked again. Each case here
breaks one term of that expression, or the lower bound of a page id, in a way the kernels would
otherwise act on: the torch reference indexes with it (a negative index wraps to another layer or
page), the Triton kernels turn it into pointer arithmetic (memory before the pool: another
request's KV). Both entry points must refuse it: the reference through ``kernels``' public
dispatch (what the decode and prefill services call, CPU tensors), the Triton launchers under the
interpreter in one subprocess (the checks run before any launch, so only the controls launch).
Each refusal has a control: the same call with the good argument goes through.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

import kernels

NUM_LAYERS = 2


def _good(make_pool, make_batch) -> dict:
    """A small valid attention call, by argument name."""
    pool = make_pool(num_pages=6, num_layers=NUM_LAYERS, page_size=4, head_dim=16)
    batch = make_batch(pool, [5, 3], num_heads=4, max_pages=2)
    q, kv, layer, tables, expected, page_gen, seq_lens, scale = batch.args(pool, 1)
    return dict(q=q, kv=kv, layer=layer, tables=tables, expected=expected, page_gen=page_gen,
                seq_lens=seq_lens, scale=scale)  # fmt: skip


# name -> (what the bad argument replaces, the refusal's message)
ATTENTION_CASES = {
    # 0 <= layer: layer -1 wraps to the last layer in torch; in Triton, page base + layer * stride
    # lies in the page before (another request's KV).
    "layer_minus_1": (lambda a: {"layer": -1}, "layer -1 out of range"),
    "layer_minus_pool_layers": (lambda a: {"layer": -NUM_LAYERS}, "out of range"),
    # expected_gen narrower than the block table: the tag a page is compared with is read past
    # the row's end (a stale page could pass the tag check).
    "expected_gen_narrower": (
        lambda a: {"expected": a["expected"][:, :1].contiguous()},
        "expected_gen shape",
    ),
    # page_gen shorter than the pool: the last pages' tags are read past its end.
    "page_gen_shorter": (lambda a: {"page_gen": a["page_gen"][:-1]}, "page_gen must be"),
    # seq_lens shorter than the batch: the last row's length is read past its end; longer: rows
    # are given the lengths of others.
    "seq_lens_shorter": (lambda a: {"seq_lens": a["seq_lens"][:-1]}, "seq_lens must be"),
    "seq_lens_longer": (
        lambda a: {"seq_lens": torch.cat([a["seq_lens"], a["seq_lens"][:1]])},
        "seq_lens must be",
    ),
    # a query of another head_dim than the pool's: K/V rows are read at the query's width.
    "q_head_dim_narrower": (lambda a: {"q": a["q"][:, :, :8].contiguous()}, "q must be"),
}

# name -> (page ids, the refusal's message or None for a control)
PAGE_ID_CASES = {
    "ids_in_range": ([0, 5, 2], None),
    "id_minus_1": ([0, -1], "page_ids must lie in"),  # -1 is the pool's last page in torch
    "id_past_the_pool": ([6], "page_ids must lie in"),
}


def _attention_args(args: dict) -> tuple:
    """``plan_decode_attention``'s arguments, then the call's (q, layer)."""
    plan = (args["kv"], args["tables"], args["expected"], args["page_gen"], args["seq_lens"])
    return (*plan, args["scale"]), (args["q"], args["layer"])


def _reference_attention(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    plan, call = _attention_args(args)
    return kernels.plan_decode_attention(*plan)(*call)


def _seeds(n: int) -> torch.Tensor:
    return torch.tensor([kernels.checksum_seed("r", i) for i in range(n)], dtype=torch.int64)


# ---- the torch reference, through the public dispatch ----------------------------------------


def test_the_good_attention_call_goes_through(make_pool, make_batch):
    """Control for every attention refusal below: the same call, every argument good."""
    args = _good(make_pool, make_batch)
    out, flags = _reference_attention(args)
    assert flags.tolist() == [False, False]
    assert bool(torch.isfinite(out).all())
    for layer in range(NUM_LAYERS):  # both ends of the layer range
        assert _reference_attention({**args, "layer": layer})[1].tolist() == [False, False]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_the_reference_refuses_an_argument_its_fast_path_must_not_pass(make_pool, make_batch, case):
    args = _good(make_pool, make_batch)
    bad, message = ATTENTION_CASES[case]
    with pytest.raises(ValueError, match=message):
        _reference_attention({**args, **bad(args)})


@pytest.mark.parametrize("case", PAGE_ID_CASES)
def test_the_reference_checksum_and_scrub_take_only_page_ids_in_the_pool(make_pool, case):
    ids, message = PAGE_ID_CASES[case]
    pool = make_pool(num_pages=6, page_size=4, head_dim=16)
    page_ids = torch.tensor(ids, dtype=torch.int64)
    before = pool.kv.clone()
    if message is None:  # control: ids in the pool are summed, and scrubbed
        assert kernels.page_checksum(pool.kv, page_ids, _seeds(len(ids))).shape == (len(ids),)
        kernels.scrub_pages(pool.kv, page_ids, 0)
        assert int(pool.kv[page_ids].count_nonzero()) == 0
        return
    with pytest.raises(ValueError, match=message):
        kernels.page_checksum(pool.kv, page_ids, _seeds(len(ids)))
    with pytest.raises(ValueError, match=message):
        kernels.scrub_pages(pool.kv, page_ids, 0)
    assert torch.equal(pool.kv.view(torch.int32), before.view(torch.int32))  # nothing zeroed


# ---- the Triton launchers, under the interpreter ----------------------------------------------

TRITON_SCRIPT = """
import sys
import torch
from kernels import triton_impl

results = {}
for name, (fn, args) in torch.load(sys.argv[1]).items():
    try:
        if fn == "attention":
            plan, call = args
            results[name] = ("ok", triton_impl.plan_decode_attention(*plan)(*call))
        elif fn == "checksum":
            results[name] = ("ok", triton_impl.page_checksum(*args))
        else:
            triton_impl.scrub_pages(*args)
            results[name] = ("ok", args[0])
    except ValueError as exc:
        results[name] = ("ValueError", str(exc))
torch.save(results, sys.argv[2])
"""


@pytest.fixture(scope="module")
def triton_runs(make_pool, make_batch, tmp_path_factory):
    """Every case through the Triton launchers, in one interpreter subprocess: name -> ("ok",
    result) or ("ValueError", message)."""
    args = _good(make_pool, make_batch)
    jobs: dict = {"attention_good": ("attention", _attention_args(args))}
    for case, (bad, _) in ATTENTION_CASES.items():
        jobs[case] = ("attention", _attention_args({**args, **bad(args)}))
    pool = make_pool(num_pages=6, page_size=4, head_dim=16)
    for case, (ids, _) in PAGE_ID_CASES.items():
        page_ids = torch.tensor(ids, dtype=torch.int64)
        jobs[f"checksum_{case}"] = ("checksum", (pool.kv, page_ids, _seeds(len(ids))))
        jobs[f"scrub_{case}"] = ("scrub", (pool.kv.clone(), page_ids, 0))
    out = run_interpreted(TRITON_SCRIPT, jobs, tmp_path_factory.mktemp("arg_checks"))
    return args, pool, out


def test_triton_takes_the_good_attention_call(triton_runs):
    """Control for the Triton refusals below: the good call runs and agrees with the reference."""
    args, _, results = triton_runs
    kind, (out, flags) = results["attention_good"]
    assert kind == "ok" and flags.tolist() == [False, False]
    want, _ = _reference_attention(args)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_triton_refuses_an_argument_the_fast_path_must_not_pass(triton_runs, case):
    _, message = ATTENTION_CASES[case]
    kind, detail = triton_runs[2][case]
    assert kind == "ValueError", f"{case}: the launcher ran the kernel"
    assert message in detail


@pytest.mark.parametrize("case", PAGE_ID_CASES)
def test_triton_checksum_and_scrub_take_only_page_ids_in_the_pool(triton_runs, case):
    _, pool, results = triton_runs
    ids, message = PAGE_ID_CASES[case]
    for fn in ("checksum", "scrub"):
        kind, detail = results[f"{fn}_{case}"]
        if message is None:
            assert kind == "ok", detail  # control
        else:
            assert kind == "ValueError", f"{fn} {case}: the launcher ran the kernel"
            assert message in detail
    if message is None:  # the control did the work: the reference's checksums, pages zeroed
        page_ids = torch.tensor(ids, dtype=torch.int64)
        want = kernels.page_checksum(pool.kv, page_ids, _seeds(len(ids)))
        assert torch.equal(results[f"checksum_{case}"][1], want)
        assert int(results[f"scrub_{case}"][1][page_ids].count_nonzero()) == 0
