"""PagePool under random operation sequences (hypothesis state machine) plus pinned regressions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvfence.kv.pool import PagePool, PageState

NUM_PAGES = 6
OWNERS = [f"o{i}" for i in range(5)]
FORWARD = [PageState.RECEIVING, PageState.READY, PageState.IN_USE]


def make_pool(num_pages: int = NUM_PAGES) -> PagePool:
    return PagePool(num_pages, num_layers=1, page_size=2, num_kv_heads=1, head_dim=2)


class PoolMachine(RuleBasedStateMachine):
    """A model of who holds what, how many operations are outstanding, and the last generation."""

    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool()
        self.held: dict[str, list[int]] = {}  # owner -> pages still held (released or not)
        self.released: set[int] = set()
        self.ops = [0] * NUM_PAGES
        self.gen = [0] * NUM_PAGES
        self.want_scrub: set[int] = set()

    # ---- helpers -----------------------------------------------------------------------------
    def _freed(self, pids: list[int]) -> None:
        """Model and check the frees the pool reported."""
        for pid in pids:
            assert pid in self.released and self.ops[pid] == 0, f"page {pid} freed too early"
            assert self.pool.state_of(pid) == PageState.FREE
            assert self.pool.generation(pid) > self.gen[pid], "free must bump the generation"
            self.gen[pid] = self.pool.generation(pid)
            data = self.pool.kv[pid]
            if pid in self.want_scrub:
                assert torch.count_nonzero(data) == 0, f"scrubbed page {pid} holds data"
            else:  # control: an unscrubbed page keeps its bytes, so the check above is not vacuous
                assert torch.all(data == pid + 1), f"page {pid} changed without a scrub"
            self.want_scrub.discard(pid)
            self.released.discard(pid)
            owner = next(o for o, ps in self.held.items() if pid in ps)
            self.held[owner].remove(pid)
            if not self.held[owner]:
                del self.held[owner]

    # ---- rules -------------------------------------------------------------------------------
    @rule(target=owners, owner=st.sampled_from(OWNERS), n=st.integers(1, NUM_PAGES))
    def allocate(self, owner: str, n: int):  # type: ignore[no-untyped-def]
        if owner in self.held:
            return multiple()
        free_before = self.pool.num_free
        refs = self.pool.allocate(n, owner)
        if n > free_before:
            assert refs is None
            return multiple()
        assert refs is not None and len(refs) == n
        for r in refs:
            assert self.pool.owner_of(r.page_id) is None or self.pool.owner_of(r.page_id) == owner
            assert r.generation > self.gen[r.page_id], "allocation must bump the generation"
            self.gen[r.page_id] = r.generation
            self.pool.kv[r.page_id] = r.page_id + 1  # recognisable data for the scrub checks
        self.held[owner] = [r.page_id for r in refs]
        assert self.pool.owns(owner, refs)
        return owner

    @rule(owner=owners, state=st.sampled_from(FORWARD))
    def set_state(self, owner: str, state: PageState) -> None:
        live = self.held.get(owner, [])
        before = [self.pool.state_of(p) for p in live]
        try:
            self.pool.set_state(owner, state)
        except (ValueError, KeyError):
            assert [self.pool.state_of(p) for p in live] == before, "failed move changed a page"
            return
        assert live and all(self.pool.state_of(p) == state for p in live)
        assert not any(p in self.released for p in live), "a released page moved forward"

    @rule(owner=owners, data=st.data())
    def begin_ops(self, owner: str, data: st.DataObject) -> None:
        live = self.held.get(owner, [])
        if not live:
            return
        pids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3))
        self.pool.begin_ops(pids)
        for pid in pids:
            self.ops[pid] += 1

    @precondition(lambda self: any(self.ops))
    @rule(data=st.data())
    def end_ops(self, data: st.DataObject) -> None:
        pending = [p for p in range(NUM_PAGES) if self.ops[p]]
        pid = data.draw(st.sampled_from(pending))
        self.ops[pid] -= 1
        self._freed(self.pool.end_ops([pid]))

    @rule(owner=owners)
    def quarantine(self, owner: str) -> None:
        self.pool.quarantine(owner)
        for pid in self.held.get(owner, []):
            assert self.pool.state_of(pid) == PageState.QUARANTINED

    @rule(owner=consumes(owners), scrub=st.booleans())
    def release(self, owner: str, scrub: bool) -> None:
        live = [p for p in self.held.get(owner, []) if p not in self.released]
        self.released.update(live)
        if scrub:
            self.want_scrub.update(live)
        freed = self.pool.release(owner, scrub=scrub)
        assert sorted(freed) == sorted(p for p in live if self.ops[p] == 0)
        self._freed(freed)
        for pid in self.held.get(owner, []):
            assert self.pool.state_of(pid) == PageState.QUARANTINED, "unsettled page not held"
        assert self.pool.release(owner) == []  # idempotent

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()

    @invariant()
    def one_owner_per_page_and_counts_add_up(self) -> None:
        pages = [p for ps in self.held.values() for p in ps]
        assert len(pages) == len(set(pages))
        stats = self.pool.stats()
        assert stats.free + stats.held == stats.total == NUM_PAGES
        assert stats.held == len(pages)
        for owner, ps in self.held.items():
            assert all(self.pool.owner_of(p) == owner for p in ps)

    @invariant()
    def outstanding_ops_pin_pages(self) -> None:
        for pid in range(NUM_PAGES):
            if self.ops[pid]:
                assert self.pool.state_of(pid) != PageState.FREE, f"page {pid} freed under an op"
            assert self.pool.generation(pid) == self.gen[pid]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_release_frees_every_page_of_a_multi_page_owner() -> None:
    """Regression: release() used to iterate the owner's page list while freeing from it, so every
    other page stayed held and the owner could never allocate again."""
    pool = make_pool()
    assert pool.allocate(4, "a") is not None
    assert sorted(pool.release("a")) == [0, 1, 2, 3]
    assert pool.num_free == NUM_PAGES and pool.owners() == []
    assert pool.allocate(4, "a") is not None  # control: the owner name is usable again
    pool.check_integrity()


def test_quarantined_page_waits_for_its_last_operation() -> None:
    pool = make_pool()
    refs = pool.allocate(2, "a")
    assert refs is not None
    pool.begin_ops([refs[0].page_id, refs[0].page_id])
    pool.quarantine("a")
    assert pool.release("a", scrub=True) == [refs[1].page_id]
    assert pool.end_ops([refs[0].page_id]) == []
    assert pool.state_of(refs[0].page_id) == PageState.QUARANTINED
    assert pool.end_ops([refs[0].page_id]) == [refs[0].page_id]
    assert pool.state_of(refs[0].page_id) == PageState.FREE
    assert pool.generation(refs[0].page_id) == refs[0].generation + 1


def test_an_operation_refused_on_a_free_page_counts_on_no_page() -> None:
    """begin_ops counted the pages before a free one and then raised: nobody ended those
    counts, so the owner's pages stayed QUARANTINED for good after its release. Control: the
    same pages without the free one are counted, and freed when their operation ends."""
    pool = make_pool()
    refs = pool.allocate(2, "a")
    assert refs is not None
    held = [r.page_id for r in refs]
    free = next(p for p in range(NUM_PAGES) if p not in held)
    try:
        pool.begin_ops([*held, free])
    except ValueError:
        pass
    else:
        raise AssertionError("an operation on a free page was counted")
    assert sorted(pool.release("a")) == sorted(held)  # nothing outstanding: freed at once
    refs = pool.allocate(2, "b")
    assert refs is not None
    held = [r.page_id for r in refs]
    pool.begin_ops(held)
    assert pool.release("b") == []
    assert sorted(pool.end_ops(held)) == sorted(held)
    pool.check_integrity()


def test_page_buffer_and_page_gen_are_the_pool_tensors_memory() -> None:
    """UCX receives into ``page_buffer`` and the kernels read ``page_gen``: both must alias the
    pool's tensors, not copies (the CPU pool keeps numpy views of them)."""
    pool = make_pool()
    refs = pool.allocate(2, "a")
    assert refs is not None
    pid, other = refs[0].page_id, refs[1].page_id
    buf = pool.page_buffer(pid)
    assert buf.nbytes == pool.page_bytes
    buf[:] = 7
    assert bool((pool.kv[pid].reshape(-1).view(torch.uint8) == 7).all())
    assert pool.kv[other].abs().sum() == 0  # control: the neighbouring page is untouched
    assert pool.page_gen[pid].item() == refs[0].generation
    pool.release("a")
    assert pool.page_gen[pid].item() == refs[0].generation + 1
    assert pool.page_gen.tolist() == [pool.generation(p) for p in range(NUM_PAGES)]


def test_owns_refuses_a_ref_of_an_earlier_generation() -> None:
    """A ref names a page at the generation it was taken at: the same page, freed and taken again
    by the same owner, is a different holding (the transfer and decode checks rely on it, so
    that a stale reservation's refs never cover the page's next use). Control: the fresh refs
    are owned."""
    pool = make_pool()
    old = pool.allocate(NUM_PAGES, "a")  # every page: the same ones come back below
    assert old is not None
    pool.release("a")
    new = pool.allocate(NUM_PAGES, "a")
    assert new is not None
    assert sorted(r.page_id for r in new) == sorted(r.page_id for r in old)
    assert pool.owns("a", new)  # control
    assert not pool.owns("a", old)
    stale = next(r for r in old if r.page_id == new[0].page_id)
    assert not pool.owns("a", [stale])
    assert not pool.owns("a", [*new[1:], stale])  # one stale ref among good ones is enough


def test_owns_refuses_a_released_page_still_quarantined() -> None:
    """A released page with an operation outstanding stays QUARANTINED under its owner until the
    operation ends: its owner no longer owns it (nothing may be received into it). Control: the
    same ref before the release, and a page of another owner, not released, still owned."""
    pool = make_pool()
    refs = pool.allocate(2, "a")
    other = pool.allocate(2, "b")
    assert refs is not None and other is not None
    pool.begin_ops([refs[0].page_id])
    assert pool.owns("a", refs[:1])  # control
    assert not pool.owns("b", refs[:1])  # another owner's page
    assert pool.release("a") == [refs[1].page_id]
    assert pool.owner_of(refs[0].page_id) == "a"  # still held: its operation is outstanding
    assert pool.generation(refs[0].page_id) == refs[0].generation
    assert not pool.owns("a", refs[:1])
    assert pool.owns("b", other)  # control: the unreleased owner's pages


def test_an_owner_that_holds_pages_cannot_allocate_again() -> None:
    """A second allocate for an owner would replace its page list: the first pages keep that
    owner but no list names them, so release() never frees them (leaked for good). Control:
    another owner allocates meanwhile, and the same owner again once it has released."""
    pool = make_pool()
    first = pool.allocate(2, "a")
    assert first is not None
    with pytest.raises(ValueError, match="already holds pages"):
        pool.allocate(1, "a")
    assert pool.pages_of("a") == first and pool.num_free == NUM_PAGES - 2
    assert pool.allocate(1, "b") is not None  # control: another owner
    assert sorted(pool.release("a")) == sorted(r.page_id for r in first)
    pool.release("b")
    assert pool.num_free == NUM_PAGES
    assert pool.allocate(1, "a") is not None  # control: the same owner, after its release
    pool.check_integrity()


def test_set_state_moves_pages_only_forward() -> None:
    """IN_USE -> RECEIVING would let a second transfer land in pages being decoded; RECEIVING ->
    IN_USE would decode pages no check has passed. A refused move changes no page. Control: the
    forward path RESERVED -> RECEIVING -> READY -> IN_USE."""
    pool = make_pool()
    refs = pool.allocate(2, "a")
    assert refs is not None
    pool.set_state("a", PageState.RECEIVING)
    for bad in (PageState.IN_USE, PageState.RESERVED, PageState.RECEIVING):
        with pytest.raises(ValueError, match=f"RECEIVING -> {bad.name} not allowed"):
            pool.set_state("a", bad)
        assert [pool.state_of(r.page_id) for r in refs] == [PageState.RECEIVING] * 2
    pool.set_state("a", PageState.READY)  # control
    pool.set_state("a", PageState.IN_USE)  # control
    for bad in (PageState.RESERVED, PageState.RECEIVING, PageState.READY, PageState.IN_USE):
        with pytest.raises(ValueError, match=f"IN_USE -> {bad.name} not allowed"):
            pool.set_state("a", bad)
        assert [pool.state_of(r.page_id) for r in refs] == [PageState.IN_USE] * 2


def test_quarantined_pages_never_move_back_into_use() -> None:
    """QUARANTINED pages are a failed transfer's, which may still be written into: no move out of
    it but the free that release() makes once they settle. Control: the same moves are allowed
    from RECEIVING, before the quarantine (READY) and in the pool's other owner."""
    pool = make_pool()
    refs = pool.allocate(2, "a")
    other = pool.allocate(1, "b")
    assert refs is not None and other is not None
    pool.set_state("a", PageState.RECEIVING)
    pool.set_state("b", PageState.RECEIVING)
    pool.quarantine("a")
    for bad in (PageState.RECEIVING, PageState.READY, PageState.IN_USE):
        with pytest.raises(ValueError, match=f"QUARANTINED -> {bad.name} not allowed"):
            pool.set_state("a", bad)
        assert [pool.state_of(r.page_id) for r in refs] == [PageState.QUARANTINED] * 2
    pool.set_state("b", PageState.READY)  # control
    pool.set_state("b", PageState.IN_USE)  # control
    assert sorted(pool.release("a")) == sorted(r.page_id for r in refs)  # control: freed
    pool.check_integrity()


def test_ending_an_operation_never_begun_is_refused_and_counts_nothing() -> None:
    """Without the refusal the page's count would go below zero; a receive posted into it later
    would then bring it to zero, not one, and release() would free the page while that receive
    may still write into it. Control: a begun operation ends, and holds the released page until
    then."""
    pool = make_pool()
    refs = pool.allocate(1, "a")
    assert refs is not None
    pid = refs[0].page_id
    with pytest.raises(ValueError, match="no outstanding operation"):
        pool.end_ops([pid])
    assert pool.outstanding_ops("a") == 0
    pool.begin_ops([pid])  # a receive posted into the page
    assert pool.outstanding_ops("a") == 1
    assert pool.release("a") == []  # held: the receive may still write
    assert pool.state_of(pid) == PageState.QUARANTINED
    assert pool.end_ops([pid]) == [pid]  # control: it settles, and that frees the page
    assert pool.state_of(pid) == PageState.FREE
    pool.check_integrity()
