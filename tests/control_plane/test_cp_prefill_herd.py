"""Requests waiting for prefill room, woken together when room comes back.

A load test saw 359 refused Prefill calls for 40 waiting requests: a prefill node that refused for
room reopened when a release on it was answered, every waiter woke, each sent its whole prompt at
once, one or two fitted and the rest were refused again, at every release. A prefill node's
estimate (its last heartbeat's free pages less the prompt pages sent it since) now leaves it out
of routing once the prompts sent fill it, so as many waiters send as fit.

The fake prefill node here keeps a page pool as the real one does (prefill_svc/service.py): a
Prefill takes its prompt's pages or is refused RESOURCE_EXHAUSTED with the free count, holds them
until its Release, and its heartbeats report the free count.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from typing import Any

import pytest
from cp_fakes import FINGERPRINT, FakeNode, FakePrefill, Script, make_layout
from cp_harness import Cluster, eventually, make_cluster

from control_plane.lifecycle import RequestState
from control_plane.registry import Node
from kvfence.errors import KvfenceError, ResourceExhausted, Unavailable
from kvfence.proto.kvfence.v1 import common_pb2, control_pb2, prefill_pb2
from kvfence.server import abort

PAGE_SIZE = 16
PROMPT = list(range(10, 42))  # 32 tokens: 2 pages on the prefill node
PROMPT_PAGES = 2


class PooledPrefill(FakePrefill):
    """A prefill node with a page pool (module docstring). ``arrival``: a Prefill waits for it
    before it looks at the pool; ``gate``: passes wait for it (held pages stay held meanwhile);
    ``fail``: a pass that fails, its pages freed by the node as the real one does;
    ``release_error``: Release fails, freeing nothing."""

    def __init__(self, node: FakeNode, script: Script):
        super().__init__(node.node_id, script)
        self.node = node
        self.held: dict[str, int] = {}
        self.refused = 0  # Prefill calls refused for room
        self.arrival: asyncio.Event | None = None
        self.gate = asyncio.Event()
        self.fail: KvfenceError | None = None
        self.release_error: KvfenceError | None = None

    def _free(self, request_id: str) -> bool:
        pages = self.held.pop(request_id, None)
        if pages is None:
            return False
        self.node.free_pages += pages  # what its next heartbeat says
        return True

    async def Prefill(self, request: Any, context: Any) -> prefill_pb2.PrefillResponse:
        await self.authenticate("Prefill", context)
        self.calls.append(("Prefill", request))
        self.entered.set()
        if self.arrival is not None:
            await self.arrival.wait()
        pages = math.ceil(len(request.prompt_token_ids) / self.node.layout.page_size)
        free = self.node.free_pages
        if free < pages:
            self.refused += 1
            await abort(
                context,
                ResourceExhausted(
                    f"prefill pool has {free} free pages, {pages} needed",
                    reason="PREFILL_POOL_FULL",
                    metadata={"free_pages": str(free)},
                ),
            )
        self.node.free_pages -= pages
        self.held[request.request_id] = pages
        await self.gate.wait()
        if self.fail is not None:
            self._free(request.request_id)
            await abort(context, self.fail)
        manifest = common_pb2.KvManifest(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            reservation_id=request.reservation.reservation_id,
            model_fingerprint=FINGERPRINT,
            layout=make_layout(),
            token_count=len(request.prompt_token_ids),
            first_token=self.script.tokens[0],
        )
        return prefill_pb2.PrefillResponse(manifest=manifest, pages_sent=pages, bytes_sent=64)

    async def Release(self, request: Any, context: Any) -> prefill_pb2.ReleaseResponse:
        await self.authenticate("Release", context)
        self.calls.append(("Release", request))
        if self.release_error is not None:
            await abort(context, self.release_error)
        return prefill_pb2.ReleaseResponse(held=self._free(request.request_id))


async def add_pooled(c: Cluster, pages: int, heartbeat_s: float = 0.05) -> PooledPrefill:
    """A prefill node whose pool has ``pages`` pages (PROMPT takes PROMPT_PAGES)."""
    node = FakeNode(
        "prefill",
        "prefill-0",
        c.script,
        pool_tokens=pages * PAGE_SIZE,
        page_size=PAGE_SIZE,
        heartbeat_s=heartbeat_s,
    )
    pool = node.servicer = PooledPrefill(node, c.script)
    assert (await c.add_node(node)).accepted
    c.prefill.append(node)
    return pool


def registered(c: Cluster) -> Node:
    node = c.cp.registry.get("prefill-0")
    assert node is not None
    return node


def beat(c: Cluster, pool: PooledPrefill) -> None:
    """The node's heartbeat, now (its own come every 30 s in the tests that call this)."""
    node = pool.node
    c.cp.registry.heartbeat(
        control_pb2.HeartbeatRequest(
            node_id=node.node_id, free_pages=node.free_pages, instance_id=node.instance_id
        )
    )


@pytest.mark.parametrize("room_for", [2, 16])
async def test_waiters_for_prefill_room_send_only_the_prompts_that_fit(
    tmp_path: Path, room_for: int
) -> None:
    """16 requests, a prefill node with room for 2 prompts. Before the estimate each release
    answered reopened the node to every waiter, which sent its prompt (24-26 refused Prefills
    here); now only the prompts that fit are sent (none refused in three runs), the odd refusal
    left to a heartbeat racing a release. Control: with room for all 16, none is refused. Every
    request is served either way, and the node ends with every page free."""
    n = 16
    # Heartbeats and the waiters' poll 1 s apart, as deployed (control_plane.heartbeat_interval_s).
    c = await make_cluster(
        tmp_path, prefill_nodes=0, admission_queue=32, heartbeat_interval_s=1.0, node_timeout_s=10
    )
    try:
        pool = await add_pooled(c, room_for * PROMPT_PAGES, heartbeat_s=1.0)
        calls = [
            asyncio.create_task(c.client(timeout=30).generate(prompt_ids=PROMPT, max_new_tokens=2))
            for _ in range(n)
        ]
        # Every request holds its decode pages and prefills, or waits for prefill room.
        await eventually(
            lambda: (
                len(c.cp.table) == n
                and all(r.record.state == RequestState.PREFILLING for r in c.cp.table)
                and len(pool.held) == min(room_for, n)
            ),
            timeout=10,
        )
        pool.gate.set()  # passes run; each release answered makes room for one more
        results = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r.usage.completion_tokens for r in results] == [2] * n
        served = pool.methods().count("Prefill") - pool.refused
        assert served == n
        if room_for >= n:
            assert pool.refused == 0
        else:
            # Each heartbeat (1 s apart) may race a release or a Prefill and let one prompt too
            # many go: a few at most in a run this short, where each release reopened the node to
            # every waiter before (24-26 refused in three runs).
            assert pool.refused <= 4, pool.refused
        # Releases of the last requests may still be under way (the early one is not awaited).
        await eventually(lambda: pool.held == {})
        assert pool.node.free_pages == pool.node.total_pages
    finally:
        pool.gate.set()
        await c.close()


@pytest.mark.parametrize("case", ["answered", "not-answered", "answered-after-a-heartbeat"])
async def test_a_failed_prefills_pages_come_off_the_estimate_once_and_only_once(
    tmp_path: Path, case: str
) -> None:
    """A Prefill fails and the node frees its pages itself; then the Release is over. The pages
    counted on the node's estimate must come off exactly once, so that a node with room for one
    prompt serves the next request at once, with no refusal:
    * answered (held False: the node had freed them), no heartbeat since they were counted: off;
    * not answered (the Release failed) and no heartbeat since: off too. (They stayed counted:
      with heartbeats 30 s apart the next request waited for one, past its deadline, with every
      page of the node free.)
    * answered held False after a heartbeat had seen them free and reset the count: not off
      again. (They came off twice: the estimate showed room the node did not have.)"""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0)
    try:
        # Room for one prompt (the admissible limit counts max_new_tokens too: a spare page).
        pool = await add_pooled(c, PROMPT_PAGES + 1, heartbeat_s=30.0)
        pool.fail = KvfenceError("engine broken")
        if case == "not-answered":
            pool.release_error = Unavailable("release failed")
        first = asyncio.create_task(c.client().generate(prompt_ids=PROMPT, max_new_tokens=2))
        await pool.entered.wait()
        node = registered(c)
        assert node.reserved_since_heartbeat == PROMPT_PAGES  # counted as it went out
        if case == "answered-after-a-heartbeat":
            # The node, having failed and freed the pages, beats before its Release answer.
            beat_when_freeing(c, pool)
        pool.gate.set()
        with pytest.raises(KvfenceError) as err:
            await first
        # The node's own text ("engine broken") goes to the control plane's log, not to the
        # tenant (test_cp_error_messages.py): the node's code and reason reach it.
        assert (err.value.code.name, err.value.reason) == ("INTERNAL", "INTERNAL")
        await eventually(lambda: len(c.cp.table) == 0)  # its releases are over
        assert pool.node.free_pages == pool.node.total_pages  # the node has room
        # The estimate is the node's free count: the pages came off once.
        assert node.free_estimate == pool.node.total_pages
        assert node.reserved_since_heartbeat == 0
        pool.fail = pool.release_error = None
        result = await asyncio.wait_for(
            c.client(timeout=10).generate(prompt_ids=PROMPT, max_new_tokens=2), 5
        )
        assert result.usage.completion_tokens == 2
        assert c.cp.clients.rpc_counts[("prefill-0", "Prefill")] == 2 and pool.refused == 0
    finally:
        await c.close()


async def test_pages_counted_on_a_node_that_was_replaced_are_not_given_back_to_its_successor(
    tmp_path: Path,
) -> None:
    """A prefill node restarts in place (registers again, a new instance, the same address)
    while a request holds pages on it; the request's release, answered by the new process, gave
    its pages back to the new node's estimate, which never counted them: the new node looked
    emptier than it was. Control: pages counted on the node itself come off (the test above)."""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0)
    try:
        pool = await add_pooled(c, 4 * PROMPT_PAGES, heartbeat_s=30.0)
        call = asyncio.create_task(
            c.client(timeout=10).generate(prompt_ids=PROMPT, max_new_tokens=2)
        )
        await pool.entered.wait()
        old = registered(c)
        assert old.reserved_since_heartbeat == PROMPT_PAGES
        pool.held.clear()  # the new process's pool is empty
        pool.node.free_pages = pool.node.total_pages
        _register_again(c, pool, "restarted")
        new = registered(c)
        assert new is not old and new.reserved_since_heartbeat == 0
        pool.gate.set()
        with contextlib.suppress(KvfenceError):  # its node was lost under it
            await asyncio.wait_for(call, 5)
        await eventually(lambda: len(c.cp.table) == 0)
        assert "Release" in pool.methods()  # released, on the new process
        assert new.reserved_since_heartbeat == 0  # not -PROMPT_PAGES
        assert new.free_estimate == pool.node.total_pages
    finally:
        pool.gate.set()
        await c.close()


@pytest.mark.parametrize("beat_between", [False, True])
async def test_a_refused_prefill_gives_its_pages_back_unless_a_heartbeat_reset_them(
    tmp_path: Path, beat_between: bool
) -> None:
    """A Prefill refused for room took nothing: the pages counted for it come off the node's
    estimate again. Not after a heartbeat came meanwhile: it reset the count, and its free pages
    never lacked them, so taking them off again would make the node look emptier than it is.
    Control (both): the request is served once the node has room and says so."""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0)
    try:
        pool = await add_pooled(c, 4 * PROMPT_PAGES, heartbeat_s=30.0)
        pool.gate.set()
        hold = pool.arrival = asyncio.Event()
        call = asyncio.create_task(
            c.client(timeout=10).generate(prompt_ids=PROMPT, max_new_tokens=2)
        )
        node = registered(c)
        await pool.entered.wait()  # sent, counted, and held on arrival
        assert node.reserved_since_heartbeat == PROMPT_PAGES
        # Its pages taken meanwhile where this control plane does not see (it refuses).
        free, pool.node.free_pages = pool.node.free_pages, 0
        if beat_between:
            beat(c, pool)  # says 0 free: the count is reset
            assert node.reserved_since_heartbeat == 0
        hold.set()
        await eventually(lambda: node.refused_room)
        assert node.reserved_since_heartbeat == 0
        assert pool.refused == 1
        pool.node.free_pages = free
        beat(c, pool)
        assert (await asyncio.wait_for(call, 5)).usage.completion_tokens == 2
    finally:
        await c.close()


def _register_again(c: Cluster, pool: PooledPrefill, instance_id: str) -> None:
    """The node's registration, repeated now (its earlier answer lost: the same process; or a
    restart in place: another instance at the same address)."""
    c.cp.registry.register(pool.node.register_request(instance_id))


def beat_when_freeing(c: Cluster, pool: PooledPrefill) -> None:
    """From now on the node beats as it frees a request's pages, before it answers the Release
    (its heartbeat is another RPC: it can reach the control plane first)."""
    real_free = pool._free

    def free_then_beat(request_id: str) -> bool:
        held = real_free(request_id)
        beat(c, pool)
        return held

    pool._free = free_then_beat  # type: ignore[method-assign]


@pytest.mark.parametrize("beat_after_free", [True, False])
async def test_pages_held_until_the_release_come_off_once_whatever_heartbeat_came_between(
    tmp_path: Path, beat_after_free: bool
) -> None:
    """A request served, its prefill pages released after decode verified: the node frees them
    answering the Release (held), and its heartbeat, another RPC, can reach the control plane
    between that and the answer. The heartbeat reset the count with the pages free, and the
    answer took them off again: the node looked two pages emptier than it was. Control: no
    heartbeat between, they come off once."""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0)
    try:
        pool = await add_pooled(c, 4 * PROMPT_PAGES, heartbeat_s=30.0)
        # Another request's pages held on the node, so that the estimate's cap hides nothing.
        pool.held["other"] = PROMPT_PAGES
        pool.node.free_pages -= PROMPT_PAGES
        beat(c, pool)
        if beat_after_free:
            beat_when_freeing(c, pool)
        pool.gate.set()
        result = await asyncio.wait_for(
            c.client(timeout=10).generate(prompt_ids=PROMPT, max_new_tokens=2), 5
        )
        assert result.usage.completion_tokens == 2
        node = registered(c)
        await eventually(lambda: pool.held.keys() == {"other"} and len(c.cp.table) == 0)
        await eventually(lambda: node.reserved_since_heartbeat <= 0)  # the release is over
        assert node.free_estimate == pool.node.free_pages == 3 * PROMPT_PAGES
    finally:
        pool.gate.set()
        await c.close()


@pytest.mark.parametrize("registers_again", [True, False])
async def test_a_repeated_registration_is_no_heartbeat_for_the_estimate(
    tmp_path: Path, registers_again: bool
) -> None:
    """A Prefill fails (the node frees its pages) and its Release is not answered: the pages
    come off the estimate when no heartbeat came since they were counted. A node repeating its
    registration (its answer lost) moved the time of its last heartbeat without resetting the
    count, so they stayed counted, and a node with room for one prompt looked full until its
    next heartbeat. Control: without the repeated registration, they come off."""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0)
    try:
        pool = await add_pooled(c, PROMPT_PAGES + 1, heartbeat_s=30.0)
        pool.fail = KvfenceError("engine broken")
        pool.release_error = Unavailable("release failed")
        first = asyncio.create_task(c.client().generate(prompt_ids=PROMPT, max_new_tokens=2))
        await pool.entered.wait()
        node = registered(c)
        if registers_again:
            await asyncio.sleep(0.01)  # the clock moves
            _register_again(c, pool, pool.node.instance_id)
            assert registered(c) is node
        pool.gate.set()
        with pytest.raises(KvfenceError):
            await first
        await eventually(lambda: len(c.cp.table) == 0)
        assert node.reserved_since_heartbeat == 0
        assert node.free_estimate == pool.node.total_pages
    finally:
        pool.gate.set()
        await c.close()
