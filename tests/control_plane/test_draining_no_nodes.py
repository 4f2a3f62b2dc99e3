"""A role whose registered nodes are all draining has no node that takes requests: requests wait
for one to register at most ``control_plane.no_node_wait_s`` from the moment the last one started
draining, then fail UNAVAILABLE (NO_NODES) saying the nodes drain, as with none registered.

They used to wait out their own deadline for a draining node and fail RESOURCE_EXHAUSTED
(NO_CAPACITY): the on-call operator was told to add capacity (KvfenceOutOfCapacity) when no node
took requests (KvfenceNoNodes), and tenants waited their whole deadline to learn it.

Fake nodes (``cp_fakes``); the ordinary drain (one node of several) is test_cp_draining.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from asyncwait import eventually
from cp_fakes import FakeNode
from cp_harness import Cluster, make_cluster
from test_cp_draining import draining_error
from test_cp_registry import _gauge

from control_plane.lifecycle import RequestState
from kvfence.errors import ResourceExhausted, Unavailable

WAIT_S = 1.5  # control_plane.no_node_wait_s where requests wait out the window
DEADLINE_S = 10.0  # each request's own deadline: far beyond the window, so the two differ
ROLES = ["decode", "prefill"]


def nodes_of(c: Cluster, role: str) -> list[FakeNode]:
    return c.decode if role == "decode" else c.prefill


async def drain(c: Cluster, *nodes: FakeNode) -> float:
    """Start ``nodes`` draining as a SIGTERM does (heartbeat flag, Reserve / Prefill refused);
    returns the loop time once the control plane has marked every one draining."""
    for node in nodes:
        node.draining = True
        node.servicer.refuse = draining_error(node.role)
    registry = c.cp.registry
    assert await eventually(lambda: all(registry.get(n.node_id).draining for n in nodes))
    return asyncio.get_running_loop().time()


def generate(c: Cluster) -> asyncio.Task:
    return asyncio.create_task(
        c.client(timeout=DEADLINE_S).generate(prompt_ids=[10, 11], max_new_tokens=3)
    )


def no_capacity_counted(c: Cluster) -> float:
    """What KvfenceOutOfCapacity reads for NO_CAPACITY (0 when never counted)."""
    return _gauge(c, "kvfence_admission_rejections_total", reason="NO_CAPACITY") or 0.0


@pytest.mark.parametrize("role", ROLES)
async def test_a_new_request_fails_no_nodes_after_the_window_when_every_node_drains(
    tmp_path: Path, role: str
) -> None:
    """Both nodes of a role drain: a new request waits, unadmitted and sending nothing, and fails
    UNAVAILABLE (NO_NODES) "no <role> node takes requests: 2 draining" about ``no_node_wait_s``
    after the drain began, neither at once nor at its deadline, and never NO_CAPACITY. Once the
    window has passed, the next request fails at once."""
    c = await make_cluster(
        tmp_path,
        decode_nodes=2 if role == "decode" else 1,
        prefill_nodes=2 if role == "prefill" else 1,
        no_node_wait_s=WAIT_S,
    )
    loop = asyncio.get_running_loop()
    try:
        drained = await drain(c, *nodes_of(c, role))
        call = generate(c)
        assert await eventually(lambda: c.cp.queue.waiting == 1)
        assert [r.record.state for r in c.cp.table] == [RequestState.RECEIVED]
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, WAIT_S + 3)
        failed = loop.time() - drained
        assert err.value.reason == "NO_NODES", err.value
        assert f"no {role} node takes requests: 2 draining" in err.value.message
        assert WAIT_S - 0.3 < failed < WAIT_S + 2.0, failed
        assert c.node_calls() == 0

        again = loop.time()
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(generate(c), 2)
        assert err.value.reason == "NO_NODES" and loop.time() - again < 1.0
        assert {e["reason"] for e in c.events.of("admission_rejected")} == {"NO_NODES"}
        assert no_capacity_counted(c) == 0
        assert not c.cp.table and c.cp.queue.waiting == 0
    finally:
        await c.close()


@pytest.mark.parametrize("role", ROLES)
async def test_with_no_wait_every_node_draining_fails_no_nodes_at_once(
    tmp_path: Path, role: str
) -> None:
    """``no_node_wait_s: 0``: with the role's only node draining a new request fails NO_NODES
    at once (well within its deadline), while the request already running on the draining node
    finishes OK, unaffected."""
    c = await make_cluster(tmp_path, no_node_wait_s=0)
    try:
        hold = asyncio.Event()
        if role == "decode":
            c.script.decode_hold = hold
            running_in = RequestState.DECODING
        else:
            c.script.prefill_hold = hold
            running_in = RequestState.PREFILLING
        running = generate(c)
        assert await eventually(
            lambda: (
                [r.record.state for r in c.cp.table] == [running_in]
                and nodes_of(c, role)[0].servicer.entered.is_set()
            )
        )
        await drain(c, nodes_of(c, role)[0])

        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(generate(c), 2)
        assert err.value.reason == "NO_NODES", err.value
        assert f"no {role} node takes requests: 1 draining" in err.value.message

        assert not running.done()
        hold.set()
        result = await asyncio.wait_for(running, 5)
        assert result.finish_reason == "length" and len(result.token_ids) == 3
        assert c.events.of("request_failed") == []
    finally:
        await c.close()


async def test_a_request_waiting_for_decode_pages_fails_no_nodes_when_every_decode_node_drains(
    tmp_path: Path,
) -> None:
    """A request admitted and queued for decode pages (both decode nodes full) when both start
    draining fails NO_NODES about ``no_node_wait_s`` after, not NO_CAPACITY at its deadline: it is
    not counted against capacity (KvfenceOutOfCapacity)."""
    c = await make_cluster(tmp_path, decode_nodes=2, no_node_wait_s=WAIT_S)
    loop = asyncio.get_running_loop()
    try:
        c.script.reserve_error = ResourceExhausted("pool full")
        call = generate(c)
        assert await eventually(
            lambda: all("Reserve" in n.methods() for n in c.decode) and c.cp.queue.waiting == 1
        )
        [run] = list(c.cp.table)
        assert run.record.state == RequestState.ADMITTED

        drained = await drain(c, *c.decode)
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, WAIT_S + 3)
        failed = loop.time() - drained
        assert err.value.reason == "NO_NODES", err.value
        assert "no decode node takes requests: 2 draining" in err.value.message
        assert WAIT_S - 0.3 < failed < WAIT_S + 2.0, failed
        [failure] = c.events.of("request_failed")
        assert (failure["code"], failure["reason"]) == ("UNAVAILABLE", "NO_NODES")
        assert c.events.of("admission_rejected") == [] and no_capacity_counted(c) == 0
        assert not c.cp.table and c.cp.queue.waiting == 0
    finally:
        await c.close()


async def test_a_request_waiting_for_prefill_room_fails_no_nodes_and_frees_its_decode_pages(
    tmp_path: Path,
) -> None:
    """A request holding decode pages and waiting for prefill room (both prefill nodes full) when
    both prefill nodes start draining fails NO_NODES about ``no_node_wait_s`` after, not
    NO_CAPACITY at its deadline, and gives its decode pages back (Release) then, not at its
    deadline."""
    c = await make_cluster(tmp_path, prefill_nodes=2, no_node_wait_s=WAIT_S)
    loop = asyncio.get_running_loop()
    try:
        c.script.prefill_error = ResourceExhausted("prefill queue full")
        call = generate(c)
        assert await eventually(lambda: all("Prefill" in n.methods() for n in c.prefill))
        [run] = list(c.cp.table)
        assert run.record.state == RequestState.PREFILLING
        assert c.decode[0].methods() == ["Reserve"]

        drained = await drain(c, *c.prefill)
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, WAIT_S + 3)
        failed = loop.time() - drained
        assert err.value.reason == "NO_NODES", err.value
        assert "no prefill node takes requests: 2 draining" in err.value.message
        assert WAIT_S - 0.3 < failed < WAIT_S + 2.0, failed
        assert await eventually(lambda: c.decode[0].methods() == ["Reserve", "Release"])
        [failure] = c.events.of("request_failed")
        assert (failure["code"], failure["reason"]) == ("UNAVAILABLE", "NO_NODES")
    finally:
        await c.close()


@pytest.mark.parametrize("role", ROLES)
async def test_a_replacement_registering_within_the_window_serves_the_waiting_request(
    tmp_path: Path, role: str
) -> None:
    """The role's only node drains; a request waits, unadmitted in the queue (it holds no decode
    pages), and a replacement that registers within ``no_node_wait_s`` serves it at once: the
    registration wakes it, it does not wait for its next poll (3 s here). The draining node is
    sent nothing."""
    c = await make_cluster(tmp_path, no_node_wait_s=5, heartbeat_interval_s=3.0, node_timeout_s=30)
    loop = asyncio.get_running_loop()
    try:
        old = nodes_of(c, role)[0]
        await drain(c, old)
        call = generate(c)
        assert await eventually(lambda: c.cp.queue.waiting == 1)
        await asyncio.sleep(0.3)
        assert not call.done()
        assert [r.record.state for r in c.cp.table] == [RequestState.RECEIVED]
        assert c.node_calls() == 0

        new = FakeNode(role, f"{role}-new", c.script)
        joined = loop.time()
        assert (await c.add_node(new)).accepted
        result = await asyncio.wait_for(call, 5)
        assert result.finish_reason == "length" and len(result.token_ids) == 3
        assert loop.time() - joined < 2.0
        assert old.methods() == []
        assert new.methods()[0] == ("Reserve" if role == "decode" else "Prefill")
        assert c.events.of("request_failed") == c.events.of("admission_rejected") == []
    finally:
        await c.close()


@pytest.mark.parametrize("role", ROLES)
async def test_one_node_draining_the_other_serves_until_it_drains_too(
    tmp_path: Path, role: str
) -> None:
    """Two nodes of a role, no wait: with one draining the other serves the request (the draining
    one is sent nothing); once the other drains too, the next request fails NO_NODES at once."""
    c = await make_cluster(
        tmp_path,
        decode_nodes=2 if role == "decode" else 1,
        prefill_nodes=2 if role == "prefill" else 1,
        no_node_wait_s=0,
    )
    try:
        first, second = nodes_of(c, role)
        await drain(c, first)
        result = await asyncio.wait_for(generate(c), 5)
        assert result.finish_reason == "length"
        assert first.methods() == []
        assert second.methods()[0] == ("Reserve" if role == "decode" else "Prefill")

        await drain(c, second)
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(generate(c), 2)
        assert err.value.reason == "NO_NODES", err.value
        assert f"no {role} node takes requests: 2 draining" in err.value.message
        assert first.methods() == []
    finally:
        await c.close()
