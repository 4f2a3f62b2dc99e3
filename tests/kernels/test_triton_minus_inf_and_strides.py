"""The Triton attention launcher under the interpreter: a row whose
first block of scores is all -inf, a head whose every score is -inf, a query with no head, and
width-1 tensors whose last-dimension stride is not 1.

The interpreter is chosen when triton is first imported, so the launchers run in one subprocess
(as in ``test_kernel_arg_checks.py``), which reports each case's result or ValueError; this
process builds the inputs and runs the torch reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_interpreted

from kernels import reference

SCRIPT = """
import sys
import torch
from kernels import triton_impl

results = {}
for name, (fn, args) in torch.load(sys.argv[1]).items():
    try:
        if fn == "attention":
            plan, call = args
            results[name] = ("ok", triton_impl.plan_decode_attention(*plan)(*call))
        else:
            triton_impl.write_kv_pages(*args)
            results[name] = ("ok", args[2])
    except ValueError as exc:
        results[name] = ("ValueError", str(exc))
torch.save(results, sys.argv[2])
"""


def _attention(q, kv, layer, tables, expected, page_gen, seq_lens, scale) -> tuple:
    return "attention", ((kv, tables, expected, page_gen, seq_lens, scale), (q, layer))


def _leading_inf(dtype: torch.dtype) -> tuple:
    """head_dim 4 gives BLOCK_T 64: tokens 0-63 (pages 1-4) have K[..., 0] = -inf, so with q all
    ones the row's whole first block scores -inf; tokens 64-69 (page 5) are finite."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(8, 1, 2, 16, 1, 4, generator=gen).to(dtype)
    kv[1:5, 0, 0, :, 0, 0] = float("-inf")
    page_gen = torch.arange(8, dtype=torch.int64) + 1
    tables = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32)
    q = torch.ones(1, 1, 4, dtype=dtype)
    return (q, kv, 0, tables, page_gen[tables.long()].clone(), page_gen,
            torch.tensor([70], dtype=torch.int32), 0.5)  # fmt: skip


def _all_inf(lens: list[int]) -> tuple:
    """Two rows on page 1; kv head 0 has K[..., 0] = +inf and query head 0 has q[0] = -1, so
    head 0 of each row scores -inf at every token; head 1 (kv head 1) is finite."""
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(4, 1, 2, 4, 2, 4, generator=gen)
    kv[1, 0, 0, :, 0, 0] = float("inf")
    page_gen = torch.arange(4, dtype=torch.int64) + 1
    tables = torch.tensor([[1], [1]], dtype=torch.int32)
    q = torch.randn(2, 2, 4, generator=gen)
    q[:, 0, 0] = -1.0
    return (q, kv, 0, tables, page_gen[tables.long()].clone(), page_gen,
            torch.tensor(lens, dtype=torch.int32), 0.5)  # fmt: skip


def _width1(tables: torch.Tensor, head_dim: int = 8, q: torch.Tensor | None = None) -> tuple:
    """Three one-page rows (pages 1-3) with block table ``tables`` (3, 1) or (3, 2)."""
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(4, 1, 2, 4, 1, head_dim, generator=gen)
    page_gen = torch.arange(4, dtype=torch.int64) + 1
    if q is None:
        q = torch.randn(3, 2, head_dim, generator=gen)
    expected = page_gen[tables.long()].contiguous()
    return (q, kv, 0, tables, expected, page_gen, torch.tensor([2, 3, 4], dtype=torch.int32), 0.3)


def _cases() -> dict:
    cases = {
        "leading_inf_f32": _leading_inf(torch.float32),
        "leading_inf_f16": _leading_inf(torch.float16),
        "all_inf_unmasked": _all_inf([3, 3]),
        "all_inf_masked": _all_inf([2, 3]),
    }
    # A (3, 1) block table made by a transpose: is_contiguous() but last-dim stride 3.
    column = torch.tensor([[1, 2, 3]], dtype=torch.int32).T
    dense = torch.tensor([[1], [2], [3]], dtype=torch.int32)  # stride (1, 1)
    cases["width1_transposed"] = _width1(column)
    cases["width1_contiguous"] = _width1(dense)  # control
    # Width 2, last-dim stride 2: the kernel would read the wrong entries; still refused.
    cases["width2_strided"] = _width1(torch.tensor([[1, 9, 0, 9], [2, 9, 0, 9], [3, 9, 0, 9]],
                                                   dtype=torch.int32)[:, ::2])  # fmt: skip
    # head_dim 1: a query whose last dimension (size 1) has stride 2.
    q1 = torch.randn(3, 1, 2).transpose(1, 2)  # (3, 2, 1), strides (2, 1, 2)
    cases["q_head_dim1_strided"] = _width1(dense, head_dim=1, q=q1)
    zero_heads = _width1(dense)
    cases["zero_heads"] = (torch.zeros(3, 0, 8), *zero_heads[1:])
    jobs = {name: _attention(*args) for name, args in cases.items()}
    # The empty batch: a (0, 1) expected_gen whose last-dim stride is 0 (torch.where makes one).
    e0 = torch.zeros(1, dtype=torch.int64).as_strided((0, 1), (1, 0))
    empty = _width1(dense)
    jobs["empty_batch_expanded"] = _attention(
        torch.zeros(0, 2, 8), empty[1], 0, torch.zeros(0, 1, dtype=torch.int32), e0, empty[5],
        torch.zeros(0, dtype=torch.int32), 0.3,
    )  # fmt: skip
    # A write of head_dim-1 K and V whose last dimension has stride 3.
    kv = torch.zeros(4, 1, 2, 4, 2, 1)
    k = torch.arange(1.0, 7.0).view(3, 1, 2).transpose(1, 2)  # (3, 2, 1), strides (2, 1, 2)
    v = -k
    jobs["write_head_dim1_strided"] = ("write", (k, v, kv, 0, torch.tensor([1, 6, 15])))
    return {"cases": cases, "jobs": jobs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    built = _cases()
    out = run_interpreted(SCRIPT, built["jobs"], tmp_path_factory.mktemp("triton_edges"))
    return built, out


def _ok(results: dict, name: str) -> tuple:
    kind, value = results[name]
    assert kind == "ok", f"{name}: {value}"
    return value


@pytest.mark.parametrize("name", ["leading_inf_f32", "leading_inf_f16"])
def test_a_first_block_of_minus_inf_scores_gives_the_reference_answer_not_nan(runs, name):
    built, results = runs
    args = built["cases"][name]
    out, flags = _ok(results, name)
    want, want_flags = reference.paged_decode_attention(*args)
    assert flags.tolist() == want_flags.tolist() == [False]
    assert bool(torch.isfinite(out).all()), out
    tol = 1e-5 if args[0].dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    # Control: the reference's answer is attention over the six finite tokens (page 5).
    q, kv = args[0], args[1]
    k, v = kv[5, 0, 0, :6, 0].float(), kv[5, 0, 1, :6, 0].float()
    dense = torch.softmax((k @ q[0, 0].float()) * 0.5, 0) @ v
    torch.testing.assert_close(want[0, 0].float(), dense, atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("name", ["all_inf_unmasked", "all_inf_masked"])
def test_a_head_whose_every_score_is_minus_inf_is_nan_as_in_the_reference(runs, name):
    built, results = runs
    args = built["cases"][name]
    out, flags = _ok(results, name)
    want, want_flags = reference.paged_decode_attention(*args)
    assert flags.tolist() == want_flags.tolist() == [False, False]
    assert bool(out[:, 0].isnan().all()) and bool(want[:, 0].isnan().all())
    # Control: head 1 reads a finite kv head: plain attention, in both.
    assert bool(torch.isfinite(out[:, 1]).all())
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    q, kv, lens = args[0], args[1], args[6].tolist()
    for row, n in enumerate(lens):
        k, v = kv[1, 0, 0, :n, 1], kv[1, 0, 1, :n, 1]
        dense = F.scaled_dot_product_attention(q[row, 1][None, None], k[None], v[None], scale=0.5)
        torch.testing.assert_close(out[row, 1], dense[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "arg"), [("width1_transposed", 3), ("q_head_dim1_strided", 0)])
def test_a_size_1_last_dimension_of_any_stride_is_taken(runs, name, arg):
    built, results = runs
    args = built["cases"][name]
    strided = args[arg]  # the block table, or q
    assert strided.shape[-1] == 1 and strided.stride(-1) != 1
    out, flags = _ok(results, name)
    want, want_flags = reference.paged_decode_attention(*args)
    assert flags.tolist() == want_flags.tolist() == [False, False, False]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # Control: the same call on a table with stride 1 gives the same.
    assert built["cases"]["width1_contiguous"][3].stride(-1) == 1
    same, _ = _ok(results, "width1_contiguous")
    if name == "width1_transposed":
        torch.testing.assert_close(out, same, atol=0, rtol=0)


def test_the_empty_batch_with_a_stride_0_expected_gen_is_taken(runs):
    assert runs[0]["jobs"]["empty_batch_expanded"][1][0][2].stride() == (1, 0)
    out, flags = _ok(runs[1], "empty_batch_expanded")
    assert out.shape == (0, 2, 8) and flags.shape == (0,)


def test_a_wider_last_dimension_with_stride_2_is_still_refused(runs):
    kind, detail = runs[1]["width2_strided"]
    assert kind == "ValueError" and "contiguous in its last dimension" in detail


def test_a_head_dim_1_write_with_strided_k_and_v_is_taken(runs):
    built, results = runs
    k, v, kv, layer, slots = built["jobs"]["write_head_dim1_strided"][1]
    got = _ok(results, "write_head_dim1_strided")
    want = kv.clone()
    reference.write_kv_pages(k, v, want, layer, slots)
    assert int(want.count_nonzero()) == 12  # control: the reference wrote every value
    assert torch.equal(got, want)


def test_a_query_with_no_head_is_refused(runs):
    kind, detail = runs[1]["zero_heads"]
    assert kind == "ValueError" and "at least one head" in detail
