"""The engine counts its page writes as pool operations for a whole pass (decode step, prefill).

Its write targets' generations are checked once, before layer 0; each later layer writes where
that check allowed. A page released between two layers' writes must therefore not change owner
before the pass ends, or the later layers would write the old owner's K/V into the new owner's
page. Each test releases the writer's pages from inside the pass (as another thread could), at
layer 0's write, and lets a second request ask for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kernels
from kvfence.kv.pool import PageState
from kvfence.model.engine import DecodeBatch, DecodeItem, Engine

PROMPT_A = [10, 11, 12, 13, 14]  # 5 tokens on 4-token pages: the next write is page 1, slot 1
PROMPT_B = list(range(30, 38))  # 8 tokens: fills both pages


def _b_pages_alone(tiny_loaded: Any, make_pool: Callable[..., Any]) -> torch.Tensor:
    """What B's prefill alone writes into its two pages (all layers, K and V)."""
    engine = Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=2, page_size=4))
    b = engine.pool.allocate(2, "B")
    engine.prefill(PROMPT_B, b)
    return engine.pool.kv[[r.page_id for r in b]].clone()


class _ReleaseAtLayer0:
    """A ``write_kv_pages`` that, at layer 0 of the first write of ``tokens`` tokens, releases
    ``victim`` and lets B allocate two pages and prefill into them (with plain writes)."""

    def __init__(self, engine: Engine, victim: str, tokens: int):
        self.engine, self.victim, self.tokens = engine, victim, tokens
        self.real = kernels.write_kv_pages
        self.b_mid: Any = None  # B's pages, if it got any during the pass
        self.victim_state: list[PageState] = []
        self.layers: list[int] = []  # layers of the pass's writes

    def __call__(self, k: Any, v: Any, kv: Any, layer: int, slot_mapping: Any) -> None:
        self.real(k, v, kv, layer, slot_mapping)
        if slot_mapping.numel() != self.tokens:
            return
        self.layers.append(layer)
        if len(self.layers) > 1:
            return
        pool = self.engine.pool
        victim_pages = [r.page_id for r in pool.pages_of(self.victim)]
        pool.release(self.victim)
        self.victim_state = [pool.state_of(p) for p in victim_pages]
        self.b_mid = pool.allocate(2, "B")
        if self.b_mid is not None:  # the pages changed owner mid-pass: B prefills into them
            saved, kernels.write_kv_pages = kernels.write_kv_pages, self.real
            try:
                self.engine.prefill(PROMPT_B, self.b_mid)
            finally:
                kernels.write_kv_pages = saved


@pytest.fixture
def engine(tiny_loaded: Any, make_pool: Callable[..., Any]) -> Engine:
    # Two pages: B can only get A's pages.
    return Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=2, page_size=4))


def _b_after_the_pass(engine: Engine, hook: _ReleaseAtLayer0) -> torch.Tensor:
    """B's pages once A's pass is over: B allocates (and prefills) them now if it could not
    during the pass."""
    b = hook.b_mid
    if b is None:
        b = engine.pool.allocate(2, "B")
        assert b is not None, "A's pages were not freed at the end of the pass"
        engine.prefill(PROMPT_B, b)
    return engine.pool.kv[[r.page_id for r in b]]


def test_decode_write_page_released_mid_step_is_not_reowned_before_the_step_ends(
    engine: Engine,
    tiny_loaded: Any,
    make_pool: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = engine.pool
    a = pool.allocate(2, "A")
    engine.prefill(PROMPT_A, a)
    hook = _ReleaseAtLayer0(engine, "A", tokens=1)
    monkeypatch.setattr(kernels, "write_kv_pages", hook)

    engine.decode_step([DecodeItem(99, len(PROMPT_A), a)])
    monkeypatch.setattr(kernels, "write_kv_pages", hook.real)

    assert hook.layers == [0, 1]  # control: the release came between the step's two writes
    # B's pages hold exactly what B wrote: nothing of A's step.
    assert torch.equal(_b_after_the_pass(engine, hook), _b_pages_alone(tiny_loaded, make_pool))
    # A's read-only page 0 was freed at once; the page the step writes waited for the step.
    assert hook.victim_state == [PageState.FREE, PageState.QUARANTINED]
    assert pool.stats().quarantined == 0
    pool.check_integrity()


def test_prefill_page_released_mid_pass_is_not_reowned_before_the_pass_ends(
    engine: Engine,
    tiny_loaded: Any,
    make_pool: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = engine.pool
    a = pool.allocate(2, "A")
    hook = _ReleaseAtLayer0(engine, "A", tokens=len(PROMPT_A))
    monkeypatch.setattr(kernels, "write_kv_pages", hook)

    engine.prefill(PROMPT_A, a)
    monkeypatch.setattr(kernels, "write_kv_pages", hook.real)

    assert hook.layers == [0, 1]
    assert torch.equal(_b_after_the_pass(engine, hook), _b_pages_alone(tiny_loaded, make_pool))
    assert hook.victim_state == [PageState.QUARANTINED, PageState.QUARANTINED]
    assert pool.stats().quarantined == 0
    pool.check_integrity()


def test_b_pages_control_a_pass_without_release_leaves_b_exact(
    engine: Engine, tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    """Positive control for the comparison above: B's pages after A's whole (undisturbed) life
    and B's own prefill equal B's prefill alone, so a difference can only come from A's pass."""
    pool = engine.pool
    a = pool.allocate(2, "A")
    engine.prefill(PROMPT_A, a)
    engine.decode_step([DecodeItem(99, len(PROMPT_A), a)])
    pool.release("A")
    b = pool.allocate(2, "B")
    engine.prefill(PROMPT_B, b)
    assert torch.equal(pool.kv[[r.page_id for r in b]], _b_pages_alone(tiny_loaded, make_pool))


class _OpsAtWrite:
    """A ``write_kv_pages`` that records each owner's outstanding operations at every write."""

    def __init__(self, pool: Any, owners: list[str]):
        self.pool, self.owners, self.real = pool, owners, kernels.write_kv_pages
        self.seen: list[list[int]] = []

    def __call__(self, *args: Any) -> None:
        self.seen.append([self.pool.outstanding_ops(o) for o in self.owners])
        self.real(*args)


@pytest.mark.parametrize("pages_held", [False, True])
def test_counts_nest_with_the_callers_and_pages_held_skips_the_engines(
    tiny_loaded: Any,
    make_pool: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    pages_held: bool,
) -> None:
    engine = Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=4, page_size=4))
    pool = engine.pool
    a, b = pool.allocate(2, "a"), pool.allocate(2, "b")
    engine.prefill(PROMPT_A, a)
    engine.prefill(PROMPT_A, b)
    writes = [a[1].page_id, b[1].page_id]
    pool.begin_ops(writes)  # the caller's own count, as the decode batcher keeps
    batch = DecodeBatch(engine)
    batch.sync([a, b])
    spy = _OpsAtWrite(pool, ["a", "b"])
    monkeypatch.setattr(kernels, "write_kv_pages", spy)

    _, flags = batch.step([7, 8], [len(PROMPT_A)] * 2, pages_held=pages_held)

    assert flags.tolist() == [False, False]
    during = 1 if pages_held else 2
    assert spy.seen == [[during, during]] * 2  # both layers
    assert [pool.outstanding_ops(o) for o in ("a", "b")] == [1, 1]  # the caller's is left
    pool.end_ops(writes)
    pool.release("a")
    assert pool.num_free == 2  # settled: a's pages free at once


def test_a_free_write_target_is_flagged_and_the_other_rows_stay_counted(
    tiny_loaded: Any, make_pool: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """begin_ops refuses a batch with a free page in it; the engine must still count the others
    (and not fail the step)."""
    engine = Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=4, page_size=4))
    pool = engine.pool
    a, b = pool.allocate(2, "a"), pool.allocate(2, "b")
    engine.prefill(PROMPT_A, a)
    engine.prefill(PROMPT_A, b)
    pool.release("a")  # a's pages are free, and stay so
    spy = _OpsAtWrite(pool, ["b"])
    monkeypatch.setattr(kernels, "write_kv_pages", spy)

    _, flags = engine.decode_step(
        [DecodeItem(7, len(PROMPT_A), a), DecodeItem(8, len(PROMPT_A), b)]
    )

    assert flags.tolist() == [True, False]
    assert spy.seen == [[1], [1]]  # b's write target counted through both layers
    assert pool.outstanding_ops("b") == 0
    pool.check_integrity()
