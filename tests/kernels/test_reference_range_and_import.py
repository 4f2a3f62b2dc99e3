"""What the kernels do where the torch reference would behave differently on CUDA than on CPU.

No GPU here: CUDA is stood in for by a device object whose type is "cuda" (dispatch reads only
that) and, for index ranges, by recording every ``index_select`` the reference makes. On CUDA an
index outside the tensor is a device-side assert that kills the context, not the ``IndexError``
the CPU raises, so the reference must never hand one over, even where it would catch it.
"""

from __future__ import annotations

import builtins
import types
import warnings

import pytest
import torch

import kernels
from kernels import reference


class _CudaDevice:
    """All of a ``torch.device`` that ``kernels._impl`` reads."""

    type = "cuda"


@pytest.fixture
def triton_import(monkeypatch):
    """Count ``from kernels import triton_impl`` attempts; each fails unless ``provide`` is set."""
    state = types.SimpleNamespace(attempts=0, provide=None)
    real_import = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "kernels" and fromlist and "triton_impl" in fromlist:
            state.attempts += 1
            if state.provide is None:
                raise ImportError("libtriton.so: cannot open shared object file")
            return types.SimpleNamespace(triton_impl=state.provide)
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(kernels, "_cuda_impl", None)  # as in a fresh process
    monkeypatch.setattr(builtins, "__import__", fake_import)
    return state


def _impl_three_times():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every warning, not the first per location
        impls = [kernels._impl(_CudaDevice()) for _ in range(3)]
    return impls, [str(w.message) for w in caught]


def test_a_failed_triton_import_is_tried_and_warned_once_per_process(triton_import):
    impls, warned = _impl_three_times()
    assert impls == [reference] * 3  # serving goes on, on the torch references
    assert triton_import.attempts == 1
    assert len(warned) == 1 and "triton unusable" in warned[0] and "libtriton.so" in warned[0]


def test_a_working_triton_import_is_made_once_and_used_without_a_warning(triton_import):
    # Control for the test above: the same fake import, succeeding, gives the Triton module.
    fake = types.ModuleType("kernels.triton_impl")
    triton_import.provide = fake
    impls, warned = _impl_three_times()
    assert impls == [fake] * 3
    assert triton_import.attempts == 1 and warned == []


def test_cpu_tensors_never_try_the_triton_import(triton_import):
    assert kernels._impl(torch.device("cpu")) is reference
    assert triton_import.attempts == 0 and kernels._cuda_impl is None


@pytest.fixture
def index_selects(monkeypatch):
    """Every ``Tensor.index_select`` made while the test runs, as (ids, size of the indexed dim),
    with a count of those whose ids reach outside that dim."""
    calls: list[tuple[list[int], int]] = []
    real = torch.Tensor.index_select

    def recording(self, dim, index):
        calls.append((index.tolist(), self.shape[dim]))
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", recording)
    return calls


def _outside(calls: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    return [(ids, size) for ids, size in calls if any(not 0 <= i < size for i in ids)]


def _attend_every_layer(pool, batch):
    attend = kernels.plan_decode_attention(
        pool.kv, batch.block_tables, batch.expected_gen, pool.page_gen, batch.seq_lens, batch.scale
    )
    outs = [attend(batch.q, layer) for layer in range(pool.kv.shape[1])]
    return attend, outs


@pytest.mark.parametrize("bad_id", [-1, 12, 2**31 - 1, -(2**31)])  # the pool has 12 pages
@pytest.mark.parametrize("seq_lens", [[33, 33], [20, 33]], ids=["uniform", "ragged"])
def test_a_page_id_outside_the_pool_is_flagged_without_indexing_with_it(
    make_pool, make_batch, dense_attention, index_selects, bad_id, seq_lens
):
    pool = make_pool(num_pages=12)
    batch = make_batch(pool, seq_lens, max_pages=4)
    dense = [dense_attention(pool, batch, layer) for layer in range(pool.kv.shape[1])]
    batch.block_tables[0, 1] = bad_id  # a page row 0 reads
    if bad_id == -1:  # -1 read from the end is the last page: expect its generation, so only
        batch.expected_gen[0, 1] = pool.page_gen[-1]  # the range check can refuse it
    attend, outs = _attend_every_layer(pool, batch)
    assert index_selects and _outside(index_selects) == []
    for layer, (out, flags) in enumerate(outs):
        # What the flagging path, which the short path falls back to, gives: bit for bit.
        want_out, want_flags = reference._attention_flagging(*batch.args(pool, layer))
        assert torch.equal(out, want_out) and torch.equal(flags, want_flags)
        assert flags.tolist() == [True, False]
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out[1], dense[layer][1])
    assert attend.flags.tolist() == [True, False]


@pytest.mark.parametrize("seq_lens", [[20, 33], [33, 33]], ids=["ragged", "uniform"])
def test_ids_outside_the_pool_in_entries_no_row_reads_keep_the_short_path(
    make_pool, make_batch, dense_attention, index_selects, seq_lens
):
    # Control for the test above: the range check is of the pages read, not of the whole table.
    pool = make_pool(num_pages=12)
    batch = make_batch(pool, seq_lens, max_pages=4)
    batch.block_tables[:, 3] = torch.tensor([10**6, -(2**31)])  # 33 tokens of 16 read 3 entries
    if seq_lens[0] == 20:  # and 20 read 2
        batch.block_tables[0, 2] = -1
    attend, outs = _attend_every_layer(pool, batch)
    assert attend._reads is not None  # the short path
    assert index_selects and _outside(index_selects) == []
    for layer, (out, flags) in enumerate(outs):
        assert flags.tolist() == [False, False]
        torch.testing.assert_close(out, dense_attention(pool, batch, layer).to(out.dtype))
    assert attend.flags.tolist() == [False, False]


def test_a_pool_with_no_pages_flags_every_row(make_batch, make_pool):
    # The flagging path reads page 0's generation for an id outside the pool; an empty pool has
    # no page 0 (on the CPU that was an IndexError out of the attention call).
    pool = make_pool(num_pages=5)
    batch = make_batch(pool, [5, 16, 17], max_pages=2)
    empty = type(pool)(pool.kv[:0].contiguous(), pool.page_gen[:0].clone())
    out, flags = kernels.paged_decode_attention(*batch.args(empty, layer=0))
    assert flags.tolist() == [True, True, True]
    assert torch.equal(out, torch.zeros_like(out))
    # Control: the same batch on the pool it was made for is not flagged.
    assert kernels.paged_decode_attention(*batch.args(pool, layer=0))[1].tolist() == [False] * 3
