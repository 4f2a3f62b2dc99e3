"""The torch reference's attention on a query head whose every score is -inf, and its refusal of
a query with no head or a pool with no kv head.

The contract (``kernels.paged_decode_attention``): an inf in the q or K a row reads is no flag,
and reaches the output as NaN, never as zeros that would pass for an answer; the Triton kernel's
0 / 0 gives NaN there. SDPA's softmax gives such a head weights of 0, so zeros, on every path of
the reference: the unmasked one (every row of the batch as long), the masked one and the
flagging one (another row stale).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels

PAGE_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 2, 2, 4  # head h reads kv head h
NEG_INF = float("-inf")


def _case(lens: list[int], *, stale_row: int | None = None) -> dict:
    """Two rows on pages of their own (row 0: pages 1, 2; row 1: pages 3, 4) with finite K, V
    and q. Returns the attention arguments by name."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 1, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    page_gen = torch.arange(6, dtype=torch.int64) * 5 + 1
    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    expected = page_gen[tables.long()].clone()
    if stale_row is not None:
        expected[stale_row, 0] += 1
    q = torch.randn(2, HEADS, HEAD_DIM, generator=gen)
    return dict(q=q, kv=kv, tables=tables, expected=expected, page_gen=page_gen,
                seq_lens=torch.tensor(lens, dtype=torch.int32))  # fmt: skip


def _set_k(a: dict, row: int, head: int, tokens: range, value: float) -> None:
    """K[..., 0] of ``tokens`` of ``row``, in kv head ``head``."""
    for t in tokens:
        page = int(a["tables"][row, t // PAGE_SIZE])
        a["kv"][page, 0, 0, t % PAGE_SIZE, head, 0] = value


def _attend(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.paged_decode_attention(
        a["q"], a["kv"], 0, a["tables"], a["expected"], a["page_gen"], a["seq_lens"], 0.5
    )


def _dense(a: dict, row: int, head: int, tokens: list[int]) -> torch.Tensor:
    """Plain softmax attention of one query head over the listed tokens of its row."""
    slots = [(int(a["tables"][row, t // PAGE_SIZE]), t % PAGE_SIZE) for t in tokens]
    k = torch.stack([a["kv"][p, 0, 0, s, head] for p, s in slots])  # (T, D)
    v = torch.stack([a["kv"][p, 0, 1, s, head] for p, s in slots])
    q = a["q"][row, head]
    return F.scaled_dot_product_attention(q[None, None], k[None], v[None], scale=0.5)[0, 0]


# The paths of the reference: every row as long (no mask), rows of different lengths (mask),
# and another row stale (the flagging path, which masks too).
PATHS = {
    "unmasked": dict(lens=[6, 6]),
    "masked": dict(lens=[6, 8]),
    "flagging": dict(lens=[6, 8], stale_row=1),
}


def _all_minus_inf(path: str, how: str) -> dict:
    """Row 0, head 0: every score -inf, by an inf in q (``how`` "q") or in each K it reads
    ("k"); row 0's invalid slots (in the masked paths) hold K = 0, which a -inf in q turns into
    a NaN score unless they are left out."""
    a = _case(**PATHS[path])
    if how == "q":
        a["q"][0, 0, 0] = NEG_INF
        _set_k(a, 0, 0, range(6), 1.0)
    else:
        a["q"][0, 0, 0] = -1.0
        _set_k(a, 0, 0, range(6), float("inf"))
    return a


@pytest.mark.parametrize("how", ["q", "k"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_head_whose_every_score_is_minus_inf_is_nan_not_zeros(path: str, how: str) -> None:
    a = _all_minus_inf(path, how)
    out, flags = _attend(a)
    stale = PATHS[path].get("stale_row") is not None
    assert flags.tolist() == [False, stale]
    assert bool(out[0, 0].isnan().all()), out[0, 0]
    # Only that head: row 0's other head and (unless flagged) row 1 are plain attention.
    torch.testing.assert_close(out[0, 1], _dense(a, 0, 1, list(range(6))))
    if stale:
        assert int(out[1].count_nonzero()) == 0  # flagged: zeros
    else:
        lens = PATHS[path]["lens"]
        for h in range(HEADS):
            torch.testing.assert_close(out[1, h], _dense(a, 1, h, list(range(lens[1]))))


@pytest.mark.parametrize("path", list(PATHS))
def test_control_a_head_with_some_finite_scores_attends_over_those(path: str) -> None:
    """An inf in the K of some tokens only: their scores are -inf, the others' finite, and the
    head attends over the finite ones (the kernel's answer too): no NaN."""
    a = _case(**PATHS[path])
    a["q"][0, 0, 0] = -1.0
    _set_k(a, 0, 0, range(4), float("inf"))  # tokens 0-3 of 6
    out, _ = _attend(a)
    assert bool(torch.isfinite(out[0]).all())
    torch.testing.assert_close(out[0, 0], _dense(a, 0, 0, [4, 5]))


@pytest.mark.parametrize("path", list(PATHS))
def test_control_a_head_over_zero_values_stays_zeros(path: str) -> None:
    """All-zero output is a real answer when the values are zero and the scores finite: the fix
    must not turn it into NaN (it looks at heads with an all-zero output only)."""
    a = _case(**PATHS[path])
    for page in (1, 2):
        a["kv"][page, 0, 1] = 0.0  # row 0's V
    out, _ = _attend(a)
    assert int(out[0].count_nonzero()) == 0
    assert not bool(out.isnan().any())


def test_a_query_with_no_head_is_refused() -> None:
    """No head, no kernel program: Triton would flag nothing, not even a stale row."""
    a = _case([6, 6], stale_row=1)
    plan = kernels.plan_decode_attention(
        a["kv"], a["tables"], a["expected"], a["page_gen"], a["seq_lens"], 0.5
    )
    with pytest.raises(ValueError, match="at least one head"):
        plan(torch.zeros(2, 0, HEAD_DIM), 0)
    # Control: the same plan with one query head per kv head runs, and flags the stale row.
    _, flags = plan(a["q"], 0)
    assert flags.tolist() == [False, True]


def test_a_pool_with_no_kv_head_is_refused_by_the_plan() -> None:
    a = _case([6, 6])
    empty = torch.zeros(6, 1, 2, PAGE_SIZE, 0, HEAD_DIM)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kernels.paged_decode_attention(
            torch.zeros(2, 0, HEAD_DIM), empty, 0, a["tables"], a["expected"], a["page_gen"],
            a["seq_lens"], 0.5,
        )  # fmt: skip
    # Control: the same arguments with the kv heads there go through.
    _, flags = _attend(a)
    assert flags.tolist() == [False, False]
