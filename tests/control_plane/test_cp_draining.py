"""A node that is shutting down drains: it heartbeats ``draining`` and refuses new Reserve / Prefill
calls (UNAVAILABLE, reason NODE_DRAINING). The control plane sends it no new request, tries
another node (or waits) when it refuses one, and fails none of the requests it still runs.

Fake nodes (``cp_fakes``); the real nodes' side is tests/nodes/test_node_drain.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cp_fakes import FakeNode
from cp_harness import Cluster, eventually, make_cluster

from control_plane.lifecycle import RequestState
from kvfence.errors import NODE_DRAINING, Unavailable
from kvfence.proto.kvfence.v1 import control_pb2


def draining_error(role: str) -> Unavailable:
    return Unavailable(f"{role} node is draining (shutting down)", reason=NODE_DRAINING)


async def listed_draining(cluster: Cluster) -> dict[str, bool]:
    admin, auth = cluster.admin()
    resp = await admin.ListNodes(control_pb2.ListNodesRequest(), metadata=auth)
    return {n.node_id: n.draining for n in resp.nodes}


async def test_a_node_that_heartbeats_draining_is_sent_no_new_request(tmp_path: Path) -> None:
    """Two decode and two prefill nodes with equal load: routing picks decode-0 and prefill-0
    (control). Once those heartbeat ``draining``, the next request goes to decode-1 and
    prefill-1, the draining nodes get no call at all, and ``kvfence nodes`` shows them
    draining."""
    c = await make_cluster(tmp_path, decode_nodes=2, prefill_nodes=2)
    try:
        first = await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
        assert first.finish_reason == "length"
        assert c.decode[0].methods() == ["Reserve", "Decode"]  # control: decode-0 is preferred
        assert "Prefill" in c.prefill[0].methods() and c.prefill[1].methods() == []
        assert c.decode[1].methods() == []
        assert await listed_draining(c) == dict.fromkeys(
            ["decode-0", "decode-1", "prefill-0", "prefill-1"], False
        )

        before = {n.node_id: len(n.calls) for n in [*c.decode, *c.prefill]}
        c.decode[0].draining = c.prefill[0].draining = True
        registry = c.cp.registry
        await eventually(lambda: all(registry.get(n).draining for n in ("decode-0", "prefill-0")))
        second = await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
        assert second.finish_reason == "length"
        assert len(c.decode[0].calls) == before["decode-0"]
        assert len(c.prefill[0].calls) == before["prefill-0"]
        assert c.decode[1].methods() == ["Reserve", "Decode"]
        assert "Prefill" in c.prefill[1].methods()
        listed = await listed_draining(c)
        assert listed == {
            "decode-0": True,
            "decode-1": False,
            "prefill-0": True,
            "prefill-1": False,
        }
    finally:
        await c.close()


async def test_a_draining_nodes_running_request_finishes_and_the_node_leaves_with_nothing_failed(
    cluster: Cluster,
) -> None:
    """A request streaming on decode-0 when it starts draining is not failed: it finishes OK; the
    node stays registered while it heartbeats, and once its heartbeats stop it is dropped with
    no request failed. Control: the request was on decode-0, mid-stream, when it drained."""
    cluster.script.decode_hold = asyncio.Event()
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await eventually(lambda: "Decode" in cluster.decode[0].methods())
    [run] = list(cluster.cp.table)
    assert run.record.decode_node == "decode-0"
    await eventually(lambda: run.record.state == RequestState.DECODING)
    cluster.decode[0].draining = True
    await eventually(lambda: cluster.cp.registry.get("decode-0").draining)
    await asyncio.sleep(0.3)  # several heartbeats: still registered, the request still running
    assert cluster.cp.registry.get("decode-0") is not None
    assert not call.done() and run.record.state == RequestState.DECODING
    cluster.script.decode_hold.set()
    result = await asyncio.wait_for(call, 5)
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    assert cluster.events.of("request_failed") == []

    await cluster.decode[0].stop_heartbeats()  # drained: the node stops
    await eventually(lambda: cluster.cp.registry.get("decode-0") is None)
    [lost] = cluster.events.of("node_lost")
    assert (lost["node"], lost["failed_requests"]) == ("decode-0", 0)


@pytest.mark.parametrize("reason", [NODE_DRAINING, "SOMETHING_BROKE"])
async def test_a_reserve_refused_as_draining_moves_on_to_another_decode_node(
    tmp_path: Path, reason: str
) -> None:
    """decode-0 (the preferred node) answers Reserve UNAVAILABLE/NODE_DRAINING before its
    draining heartbeat arrives: the request is not failed, it reserves on decode-1, and decode-0
    is marked draining at once and sent nothing more (no Release: it took nothing). Control: an
    UNAVAILABLE with any other reason still fails the request, keeping its reason."""
    c = await make_cluster(tmp_path, decode_nodes=2)
    try:
        c.decode[0].servicer.refuse = Unavailable("no", reason=reason)
        if reason != NODE_DRAINING:
            with pytest.raises(Unavailable) as err:
                await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
            assert err.value.reason == reason
            assert c.decode[1].methods() == []
            assert not c.cp.registry.get("decode-0").draining
            return
        result = await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
        assert result.finish_reason == "length"
        assert c.decode[0].methods() == ["Reserve"]
        assert c.decode[1].methods() == ["Reserve", "Decode"]
        assert c.cp.registry.get("decode-0").draining
        assert c.events.of("request_failed") == []
        again = await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
        assert again.finish_reason == "length"
        assert c.decode[0].methods() == ["Reserve"]  # not asked again
    finally:
        await c.close()


@pytest.mark.parametrize("reason", [NODE_DRAINING, "SOMETHING_BROKE"])
async def test_a_prefill_refused_as_draining_moves_on_to_another_prefill_node(
    tmp_path: Path, reason: str
) -> None:
    """The same for Prefill: prefill-0 refuses as draining, prefill-1 runs the prompt, the
    request finishes OK. Control: another UNAVAILABLE reason fails the request."""
    c = await make_cluster(tmp_path, prefill_nodes=2)
    try:
        c.prefill[0].servicer.refuse = Unavailable("no", reason=reason)
        if reason != NODE_DRAINING:
            with pytest.raises(Unavailable) as err:
                await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
            assert err.value.reason == reason
            assert c.prefill[1].methods() == []
            return
        result = await c.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
        assert result.finish_reason == "length"
        assert c.prefill[0].methods() == ["Prefill"]
        assert c.prefill[1].methods()[0] == "Prefill"
        assert c.cp.registry.get("prefill-0").draining
        assert c.events.of("request_failed") == []
    finally:
        await c.close()


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_with_every_node_of_a_role_draining_a_request_waits_for_a_new_one(
    tmp_path: Path, role: str
) -> None:
    """The only decode (or prefill) node drains: a new request is neither failed nor sent to it;
    it waits, unadmitted in the admission queue (within ``no_node_wait_s``, 10 s here; with no
    prefill node taking requests it no longer reserves decode pages to hold meanwhile), and
    finishes OK on the node that joins. Control: the request was still waiting, unfailed, before
    the new node joined."""
    c = await make_cluster(tmp_path)
    try:
        old = (c.decode if role == "decode" else c.prefill)[0]
        old.draining = True
        old.servicer.refuse = draining_error(role)
        await eventually(lambda: c.cp.registry.get(old.node_id).draining)
        call = asyncio.create_task(c.client().generate(prompt_ids=[10, 11], max_new_tokens=3))
        waiting = RequestState.RECEIVED
        await eventually(lambda: [r.record.state for r in c.cp.table] == [waiting])
        await asyncio.sleep(0.5)  # several heartbeats and queue polls
        assert not call.done()
        assert [r.record.state for r in c.cp.table] == [waiting]
        assert old.methods() == [] and c.node_calls() == 0

        new = FakeNode(role, f"{role}-new", c.script)
        assert (await c.add_node(new)).accepted
        result = await asyncio.wait_for(call, 5)
        assert result.finish_reason == "length"
        assert old.methods() == []
        assert new.methods()[0] == ("Reserve" if role == "decode" else "Prefill")
    finally:
        await c.close()


async def test_draining_is_one_way_until_the_node_registers_again(cluster: Cluster) -> None:
    """A heartbeat without the flag (one sent before the drain, arriving late) does not put a
    draining node back into routing; a new registration (a new process) does."""
    node = cluster.decode[0]
    registry = cluster.cp.registry
    node.draining = True
    await eventually(lambda: registry.get("decode-0").draining)
    registry.heartbeat(control_pb2.HeartbeatRequest(node_id="decode-0", free_pages=10))
    assert registry.get("decode-0").draining
    await node.stop_heartbeats()
    node.draining = False
    node.instance_id = "fake-process-2"
    assert (await node.register(cluster.ports.public, cluster.cp.node_token)).accepted
    assert not registry.get("decode-0").draining


async def test_a_replaced_process_draining_does_not_drain_its_replacement(
    cluster: Cluster,
) -> None:
    """A pod replaced while the old one drains: the replacement registers with the same node id
    (a new process), then the old process's heartbeat says draining. It used to be taken for the
    replacement's, which left routing for good (a chaos run: a decode node lost until restarted).
    The old process is told it is superseded. Control: the replacement's own draining heartbeat
    still drains it."""
    registry = cluster.cp.registry
    old = cluster.decode[0]
    new = FakeNode("decode", "decode-0", cluster.script)
    new.instance_id = "fake-process-2"
    assert (await cluster.add_node(new)).accepted
    assert registry.get("decode-0").grpc_address == f"127.0.0.1:{new.port}"
    old.draining = True  # its heartbeats go on, every 50 ms
    beat = control_pb2.HeartbeatRequest(
        node_id="decode-0", draining=True, instance_id="fake-process-1"
    )
    resp = registry.heartbeat(beat)
    assert resp.superseded and not resp.known
    await asyncio.sleep(0.3)
    assert not registry.get("decode-0").draining
    assert registry.get("decode-0").grpc_address == f"127.0.0.1:{new.port}"
    new.draining = True
    await eventually(lambda: registry.get("decode-0").draining)


# -- a role's only node replaced (a rolling update) --------------------------------------------

NO_NODE_WAIT_S = 3.0  # control_plane.no_node_wait_s in the rolling-update tests
REPLACED_AFTER_S = 1.0  # the replacement registers this long after the old node was dropped


@pytest.mark.parametrize("case", ["replaced", "not replaced", "wait 0"])
@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_the_only_node_of_a_role_drains_and_its_replacement_registers_later(
    tmp_path: Path, role: str, case: str
) -> None:
    """A rolling update of a role's only node: it drains, stops, is dropped, and its replacement
    registers a second later. Request A arrives while it drains, B after it was dropped. Both
    used to fail UNAVAILABLE (NO_NODES) the moment it was dropped (A: at once if it was waiting
    for decode pages; B: at once), with the replacement a second away. Now both wait for it,
    unadmitted (``no_node_wait_s``, counted from the drain: no node took requests since), and
    finish OK there, the old node sent nothing.

    Controls: with no replacement A and B fail NO_NODES once the wait is over, neither at once
    nor at their deadline (A waiting for a prefill node used to hold its decode reservation until
    its deadline). With ``no_node_wait_s: 0``: NO_NODES at once, A (the node draining) too."""
    wait = 0.0 if case == "wait 0" else NO_NODE_WAIT_S
    c = await make_cluster(tmp_path, no_node_wait_s=wait)
    loop = asyncio.get_running_loop()
    try:
        old = (c.decode if role == "decode" else c.prefill)[0]
        old.draining = True
        old.servicer.refuse = draining_error(role)
        await eventually(lambda: c.cp.registry.get(old.node_id).draining)
        drained = loop.time()  # the no-node wait counts from here, not from the drop
        a = asyncio.create_task(c.client(timeout=6).generate(prompt_ids=[10, 11], max_new_tokens=3))
        if case == "wait 0":
            with pytest.raises(Unavailable) as err:
                await asyncio.wait_for(a, 2)
            assert err.value.reason == "NO_NODES" and "1 draining" in err.value.message
        else:
            a_waits = RequestState.RECEIVED
            await eventually(lambda: [r.record.state for r in c.cp.table] == [a_waits])
            a_started = loop.time()

        await old.stop_heartbeats()  # drained: the process exits
        await eventually(lambda: c.cp.registry.get(old.node_id) is None, timeout=3)
        dropped = loop.time()
        b = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10, 11], max_new_tokens=3))

        if case == "wait 0":
            with pytest.raises(Unavailable) as err:
                await asyncio.wait_for(b, 2)
            assert err.value.reason == "NO_NODES" and loop.time() - dropped < 0.5
            return

        await asyncio.sleep(REPLACED_AFTER_S)
        assert not a.done() and not b.done()  # waiting, not failed
        states = sorted(r.record.state for r in c.cp.table)
        assert states == sorted([a_waits, RequestState.RECEIVED])
        # Both hold an admission queue place while they wait, unadmitted.
        assert c.cp.queue.waiting == 2

        if case == "replaced":
            new = FakeNode(role, f"{role}-new", c.script)
            assert (await c.add_node(new)).accepted
            for call in (a, b):
                result = await asyncio.wait_for(call, 5)
                assert result.finish_reason == "length" and len(result.token_ids) == 3
            assert old.methods() == []
            assert new.methods().count("Reserve" if role == "decode" else "Prefill") == 2
            assert c.events.of("request_failed") == c.events.of("admission_rejected") == []
            return

        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(b, 5)
        b_failed = loop.time() - drained
        assert err.value.reason == "NO_NODES", err.value
        assert f"no {role} node is registered" in err.value.message
        assert NO_NODE_WAIT_S - 0.3 < b_failed < NO_NODE_WAIT_S + 1.0, b_failed
        # A too, though its own deadline (6 s from its start) is further off
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(a, 1)
        assert err.value.reason == "NO_NODES"
        assert loop.time() - drained < NO_NODE_WAIT_S + 1.0
        assert loop.time() - a_started < 5.0  # its deadline would have ended it at 5.9 s
        assert not c.cp.table and c.cp.queue.waiting == 0
        if role == "prefill":  # A never held decode pages while no prefill node took requests
            assert c.decode[0].methods() == []
    finally:
        await c.close()
