"""The prefill node's batcher: prompts that wait for the engine thread share a forward pass, and
each one still gets what a pass of its own gives it."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
import torch

from kvfence.errors import IntegrityError
from kvfence.kv.pool import PagePool, PageRef
from kvfence.model.engine import Engine
from kvfence.model.loader import load_model
from kvfence.model.sampling import SamplingParams
from kvfence.model.tiny import ensure_tiny_model
from prefill_svc.batcher import PrefillBatcher

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPTS = [list(range(5, 22)), list(range(30, 39)), [7, 8, 9], list(range(50, 83))]  # 17, 9, 3, 33


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny"))


def make_engine(loaded) -> Engine:
    s = loaded.shape
    pool = PagePool(
        32, num_layers=s.num_layers, page_size=16, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim
    )
    return Engine(loaded.model, pool)


def alloc(engine: Engine, prompts: list[list[int]], tag: str) -> list[list[PageRef]]:
    pool = engine.pool
    return [list(pool.allocate(-(-len(p) // 16), f"{tag}{i}") or []) for i, p in enumerate(prompts)]


class Gate:
    """Wraps ``engine.prefill_many``: records each pass's prompt count; the first pass waits for
    ``go.set()`` so that the next prompts queue up behind it."""

    def __init__(self, engine: Engine, fail_when=None):
        self.real = engine.prefill_many
        self.passes: list[int] = []
        self.entered, self.go = threading.Event(), threading.Event()
        self.fail_when = fail_when
        engine.prefill_many = self  # type: ignore[method-assign]

    def __call__(self, prompts, pages):
        self.passes.append(len(prompts))
        if len(self.passes) == 1:
            self.entered.set()
            assert self.go.wait(30)
        if self.fail_when is not None and self.fail_when(prompts):
            raise RuntimeError("this pass fails")
        return self.real(prompts, pages)


def queue_behind_first(batcher: PrefillBatcher, gate: Gate, engine, prompts, tag):
    """The first prompt enters the engine thread alone; the rest queue behind it."""
    refs = alloc(engine, prompts, tag)
    futures = [batcher.submit(prompts[0], refs[0], GREEDY)]
    assert gate.entered.wait(30)
    futures += [batcher.submit(p, r, GREEDY) for p, r in zip(prompts[1:], refs[1:], strict=True)]
    return refs, futures


@pytest.mark.parametrize("budget, passes", [(4096, [1, 3]), (1, [1, 1, 1, 1]), (44, [1, 2, 1])])
def test_waiting_prompts_share_a_pass_and_get_what_a_pass_of_their_own_gives(
    loaded, budget, passes
):
    # the reference: each prompt in a pass of its own (budget 1 is also that, through the batcher)
    alone = make_engine(loaded)
    alone_refs = alloc(alone, PROMPTS, "a")
    want = [int(alone.prefill(p, r).argmax()) for p, r in zip(PROMPTS, alone_refs, strict=True)]

    engine = make_engine(loaded)
    engine.pool.kv.fill_(7.0)  # what pages held before: the tail of a last page must not keep it
    gate = Gate(engine)
    seen: list[int] = []
    batcher = PrefillBatcher(engine, engine.pool, max_batch_tokens=budget, on_pass=seen.append)
    try:
        refs, futures = queue_behind_first(batcher, gate, engine, PROMPTS, "b")
        gate.go.set()
        got = [f.result(30) for f in futures]
    finally:
        batcher.close()
    assert gate.passes == passes  # at 44: 9 + 3 = 12 fit,, + 33 does not
    assert batcher.passes == len(passes) and batcher.prompts == len(PROMPTS)
    assert seen == passes  # what the prefill_pass_prompts metric observes
    assert got == want
    for r_alone, r_batch, p in zip(alone_refs, refs, PROMPTS, strict=True):
        kv_alone = alone.pool.kv[[r.page_id for r in r_alone]]
        kv_batch = engine.pool.kv[[r.page_id for r in r_batch]]
        torch.testing.assert_close(kv_batch, kv_alone, rtol=1e-5, atol=1e-5)  # tails zeroed
        tail = len(p) % 16
        if tail:  # and the pages did hold something there
            assert (kv_batch[-1][..., tail:, :, :] == 0).all()


def test_a_prompt_cancelled_while_waiting_never_runs(loaded):
    engine = make_engine(loaded)
    gate = Gate(engine)
    batcher = PrefillBatcher(engine, engine.pool)
    try:
        refs, futures = queue_behind_first(batcher, gate, engine, PROMPTS[:3], "c")
        assert futures[1].cancel()
        assert not futures[0].cancel()  # running: it goes to the end
        gate.go.set()
        with pytest.raises(CancelledError):
            futures[1].result(30)
        assert isinstance(futures[0].result(30), int)
        assert isinstance(futures[2].result(30), int)  # control: the one not cancelled ran
    finally:
        batcher.close()
    assert gate.passes == [1, 1]
    assert not engine.pool.kv[[r.page_id for r in refs[1]]].any()  # its pages never written
    assert engine.pool.kv[[r.page_id for r in refs[2]]].any()


def test_a_stale_page_fails_only_its_own_prompt(loaded):
    engine = make_engine(loaded)
    gate = Gate(engine)
    batcher = PrefillBatcher(engine, engine.pool)
    prompts = PROMPTS[:3]
    refs = alloc(engine, prompts, "s")
    stale = [PageRef(r.page_id, r.generation + 1) for r in refs[1]]
    try:
        futures = [batcher.submit(prompts[0], refs[0], GREEDY)]
        assert gate.entered.wait(30)
        futures.append(batcher.submit(prompts[1], stale, GREEDY))
        futures.append(batcher.submit(prompts[2], refs[2], GREEDY))
        gate.go.set()
        with pytest.raises(IntegrityError):
            futures[1].result(30)
        assert all(isinstance(f.result(30), int) for f in (futures[0], futures[2]))
    finally:
        batcher.close()
    assert gate.passes == [1, 2]  # it shared its pass with the prompt that succeeded


def test_a_failing_pass_is_run_again_prompt_by_prompt(loaded):
    bad = PROMPTS[2]
    engine = make_engine(loaded)
    gate = Gate(engine, fail_when=lambda prompts: bad in prompts)
    seen: list[int] = []  # the on_pass metric's view
    batcher = PrefillBatcher(engine, engine.pool, on_pass=seen.append)
    try:
        _, futures = queue_behind_first(batcher, gate, engine, PROMPTS, "f")
        gate.go.set()
        with pytest.raises(RuntimeError, match="this pass fails"):
            futures[2].result(30)
        firsts = [futures[i].result(30) for i in (0, 1, 3)]  # control: the others still run
    finally:
        batcher.close()
    assert all(isinstance(t, int) for t in firsts)
    assert gate.passes == [1, 3, 1, 1, 1]  # the shared pass, then each of its prompts alone
    # The failed shared pass gave no result: not counted; each prompt is, once, in its own
    # rerun (counting both counted the failed pass's prompts twice).
    assert seen == [1, 1, 1, 1]
    assert (batcher.passes, batcher.prompts) == (4, 4)


def test_close_cancels_what_waits_and_refuses_more(loaded):
    engine = make_engine(loaded)
    gate = Gate(engine)
    batcher = PrefillBatcher(engine, engine.pool)
    refs, futures = queue_behind_first(batcher, gate, engine, PROMPTS[:2], "x")
    closer = threading.Thread(target=batcher.close)
    closer.start()
    with pytest.raises(CancelledError):
        futures[1].result(30)
    gate.go.set()  # the pass that had started ends normally
    closer.join(30)
    assert not closer.is_alive()
    assert isinstance(futures[0].result(30), int)
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(PROMPTS[0], refs[0], GREEDY)
    with pytest.raises(ValueError):
        PrefillBatcher(engine, engine.pool, max_batch_tokens=0)


def test_a_failing_pass_callback_does_not_stop_the_engine_thread(loaded):
    engine = make_engine(loaded)

    def broken(n: int) -> None:
        raise RuntimeError("metrics down")

    batcher = PrefillBatcher(engine, engine.pool, on_pass=broken)
    try:
        refs = alloc(engine, PROMPTS[:2], "cb")
        first = batcher.submit(PROMPTS[0], refs[0], GREEDY).result(30)
        second = batcher.submit(PROMPTS[1], refs[1], GREEDY).result(30)  # the thread still runs
    finally:
        batcher.close()
    assert isinstance(first, int) and isinstance(second, int)
    assert batcher.passes == 2
