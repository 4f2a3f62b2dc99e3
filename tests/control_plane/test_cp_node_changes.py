"""Requests while nodes come and go under them: a node lost while it had a request's Reserve, a
node registered again by a new process at a new address while a request still held the old view
of it, and prefill room that does not come before decode's reservation expires.

Found by review and reproduced: the first failed NODE_LOST though the request held nothing and
another node was idle; in the second, the old view replaced the new process's channel, which cut
every call on it, and those requests failed "the control plane is shutting down"; the third
waited for prefill room long after decode had given its reservation back, spent a prefill pass,
and failed anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cp_fakes import FakeNode
from cp_harness import Cluster, eventually, make_cluster

from control_plane.lifecycle import RequestState
from kvfence.errors import DeadlineExceeded, KvfenceError, ResourceExhausted, Unavailable
from kvfence.server import abort


async def decode_node(c: Cluster, node_id: str, pool: int, reserve=None, instance="p1") -> FakeNode:
    """A decode node whose Reserve first runs ``reserve(real, request, context)`` if given."""
    node = FakeNode("decode", node_id, c.script, pool_tokens=pool)
    node.instance_id = instance
    if reserve is not None:
        real = node.servicer.Reserve

        async def patched(request, context):  # type: ignore[no-untyped-def]
            node.servicer.entered.set()
            return await reserve(real, request, context)

        node.servicer.Reserve = patched  # type: ignore[method-assign]
    assert (await c.add_node(node)).accepted
    c.decode.append(node)
    return node


@pytest.mark.parametrize("cut", ["reserve", "decode"])
async def test_a_node_lost_during_reserve_sends_the_request_to_the_next_node(
    tmp_path: Path, cut: str
) -> None:
    """decode-0 (the most free pages: tried first) stops answering and heartbeating with the
    request's Reserve in flight: nothing is held for it anywhere, so it goes to decode-1.
    Control: lost while it decodes (its KV went with the node), it still fails NODE_LOST."""
    c = await make_cluster(tmp_path, decode_nodes=0, prefill_nodes=1)
    hold = asyncio.Event()
    try:

        async def hang(real, request, context):  # type: ignore[no-untyped-def]
            if cut == "reserve":
                await hold.wait()
            return await real(request, context)

        first = await decode_node(c, "decode-0", 8192, hang)
        await decode_node(c, "decode-1", 4096)
        if cut == "decode":
            c.script.decode_hold = asyncio.Event()
        call = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=4))
        if cut == "reserve":
            await first.servicer.entered.wait()
        else:
            await eventually(lambda: "Decode" in first.methods())
        await first.stop_heartbeats()  # lost after node_timeout_s (0.5 s)
        if cut == "reserve":
            result = await asyncio.wait_for(call, 5)
            assert result.usage.completion_tokens == 4
            assert "Decode" in c.decode[1].methods()
            # Its Reserve timed out (node_timeout_s) and the request may finish on decode-1
            # before the registry notices the missing heartbeats (also node_timeout_s).
            await eventually(lambda: bool(c.events.of("node_lost")))
            [lost] = c.events.of("node_lost")
            assert lost["failed_requests"] == 0
        else:
            with pytest.raises(Unavailable) as err:
                await asyncio.wait_for(call, 5)
            assert err.value.reason == "NODE_LOST"
            assert c.events.of("node_lost")[0]["failed_requests"] == 1
    finally:
        hold.set()
        if c.script.decode_hold is not None:
            c.script.decode_hold.set()
        await c.close()


def after_first_reserve(c: Cluster, then: Callable[[Any], None]) -> None:
    """Run ``then(node)`` once, right after the first Reserve's answer arrives and before the
    request goes on: what the registry did meanwhile (a loss, a repeated registration)."""
    real = c.cp.clients.decode
    done = [False]

    def decode(node):  # type: ignore[no-untyped-def]
        stub = real(node)
        if done[0]:
            return stub

        class ThenOnAnswer:
            def __getattr__(self, name):  # type: ignore[no-untyped-def]
                return getattr(stub, name)

            def Reserve(self, req, timeout=None):  # type: ignore[no-untyped-def]
                async def reserve():  # type: ignore[no-untyped-def]
                    res = await stub.Reserve(req, timeout=timeout)
                    done[0] = True
                    then(node)
                    return res

                return reserve()

        return ThenOnAnswer()

    c.cp.clients.decode = decode  # type: ignore[method-assign]


@pytest.mark.parametrize("lose", [True, False])
async def test_a_reserve_answered_just_before_its_node_was_lost_goes_no_further(
    tmp_path: Path, lose: bool
) -> None:
    """The other side of letting a request in Reserve outlive its node's loss: a Reserve whose
    answer had arrived when the node was lost is not cut, and the request went on to prefill
    into pages that went with the node. It fails NODE_LOST at once now. Control: the same
    request with the node kept finishes."""
    c = await make_cluster(tmp_path)
    try:

        def reaped(node: Any) -> None:  # the reaper, between the answer and the request
            if lose:
                c.cp.registry.lose(node, "no heartbeat")

        after_first_reserve(c, reaped)
        call = c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        if lose:
            with pytest.raises(Unavailable) as err:
                await call
            assert err.value.reason == "NODE_LOST"
            assert "Prefill" not in c.prefill[0].methods()
        else:
            assert (await call).usage.completion_tokens == 2
    finally:
        await c.close()


async def test_an_old_view_of_a_node_registered_again_cuts_no_call_on_it(tmp_path: Path) -> None:
    """R1 lists [decode-0, decode-1] and waits on decode-0's Reserve; meanwhile decode-1 restarts
    as a new process at a new address, and R2 decodes on it. decode-0 then answers "full", and
    R1's next candidate was its old view of decode-1. Now R1 skips it (and later reserves on the
    new decode-1), and R2 finishes. Control: R2's stream is open on the new process while R1
    moves on, and no node_lost is reported for it."""
    c = await make_cluster(tmp_path, decode_nodes=0, prefill_nodes=1)
    hold = asyncio.Event()
    try:
        first_call = [True]

        async def first_hangs_then_full(real, request, context):  # type: ignore[no-untyped-def]
            if first_call[0]:
                first_call[0] = False
                await hold.wait()
            await abort(context, ResourceExhausted("full"))

        head = await decode_node(c, "decode-0", 8192, first_hangs_then_full)
        old = await decode_node(c, "decode-1", 4096)
        r1 = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=4))
        await head.servicer.entered.wait()
        await old.stop()
        c.decode.remove(old)
        c.script.decode_hold = asyncio.Event()
        new = await decode_node(c, "decode-1", 4096, instance="p2")
        assert new.port != old.port
        r2 = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[11], max_new_tokens=4))
        await eventually(lambda: "Decode" in new.methods(), 3)
        hold.set()  # R1: decode-0 is full; its next candidate is the old decode-1
        await asyncio.sleep(0.5)
        assert not r2.done()  # still streaming on the new process
        c.script.decode_hold.set()
        results = await asyncio.wait_for(asyncio.gather(r1, r2, return_exceptions=True), 8)
        for result in results:
            assert not isinstance(result, BaseException), result
            assert result.usage.completion_tokens == 4
        # the old process's own departure (its replacement registering) failed nothing
        assert all(e["failed_requests"] == 0 for e in c.events.of("node_lost"))
    finally:
        hold.set()
        if c.script.decode_hold is not None:
            c.script.decode_hold.set()
        await c.close()


@pytest.mark.parametrize("room", [False, True])
async def test_waiting_for_prefill_room_ends_before_the_reservation_expires(
    tmp_path: Path, room: bool
) -> None:
    """Decode releases a reservation transfer.reservation_timeout_s after Reserve when its Decode
    has not come. A request waiting for prefill room waited until its deadline regardless. Now it
    fails NO_CAPACITY (retry) within three quarters of that time and gives its decode pages back.
    Control: room that comes in time is used."""
    c = await make_cluster(tmp_path, transfer={"reservation_timeout_s": 1.0})
    try:
        c.script.prefill_error = ResourceExhausted("prefill full")
        full, c.prefill[0].free_pages = c.prefill[0].free_pages, 0  # its heartbeats say so
        call = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=2))
        # Waiting for prefill room (a node whose heartbeat says it is full gets no prompt).
        await eventually(lambda: [r.record.state for r in c.cp.table] == [RequestState.PREFILLING])
        loop = asyncio.get_running_loop()
        started = loop.time()
        if room:
            await asyncio.sleep(0.3)
            c.script.prefill_error = None
            c.prefill[0].free_pages = full  # and its next heartbeat shows the room
            assert (await asyncio.wait_for(call, 5)).usage.completion_tokens == 2
        else:
            with pytest.raises(KvfenceError) as err:
                await asyncio.wait_for(call, 5)
            assert isinstance(err.value, ResourceExhausted), err.value
            assert err.value.reason == "NO_CAPACITY"
            assert "reservation_timeout_s" in err.value.message
            assert loop.time() - started < 3.0  # 0.75 s; not the 8 s deadline
            await eventually(lambda: "Release" in c.decode[0].methods())
    finally:
        await c.close()


@pytest.mark.parametrize("again", [True, False])
async def test_a_node_repeating_its_registration_keeps_the_requests_holding_it(
    tmp_path: Path, again: bool
) -> None:
    """A node that repeats its own registration (a reply lost) is the same process and keeps
    its requests; the registry made it a new Node object all the same, and a request holding the
    old one read it as lost (NODE_LOST). Control: without the repeat, the same request."""
    from kvfence import PROTOCOL_VERSION
    from kvfence.proto.kvfence.v1 import control_pb2

    c = await make_cluster(tmp_path)
    try:

        def registers_again(node: Any) -> None:
            if again:
                again_req = control_pb2.RegisterRequest(
                    node_id=node.node_id,
                    role=node.role,
                    grpc_address=node.grpc_address,
                    ucx_address=node.ucx_address,
                    model_fingerprint=node.fingerprint,
                    layout=node.layout,
                    pool_tokens=node.pool_tokens,
                    total_pages=node.total_pages,
                    instance_id=node.instance_id,
                    protocol_version=PROTOCOL_VERSION,
                    kvfence_version=node.kvfence_version,
                )
                assert c.cp.registry.register(again_req).accepted

        after_first_reserve(c, registers_again)
        result = await c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        assert result.usage.completion_tokens == 2
        assert not c.events.of("node_lost")
    finally:
        await c.close()


async def test_past_the_reservation_bound_with_no_prefill_node_it_fails_no_nodes_at_once(
    tmp_path: Path,
) -> None:
    """Waiting for a prefill node to register (none takes requests) went on past the
    reservation bound with a wait of 0 s: a busy loop (121,185 waits in a review's run), and a
    node registering then got the Prefill for a reservation about to expire. Now the request
    fails NO_NODES at the bound. (The control, room coming in time, is the test above.)"""
    c = await make_cluster(tmp_path, transfer={"reservation_timeout_s": 1.0}, no_node_wait_s=4.0)
    waits: list[float] = []
    queue = c.cp.deps.queue
    real = queue.changed

    async def changed(timeout: float) -> None:
        waits.append(timeout)
        await real(timeout)

    queue.changed = changed  # type: ignore[method-assign]
    try:
        c.script.prefill_error = ResourceExhausted("prefill full")
        call = asyncio.create_task(c.client(timeout=20).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: "Prefill" in c.prefill[0].methods())
        # The refusal reached the pipeline and it waits for room: losing the node while its
        # Prefill is still in flight would fail the request NODE_LOST instead (a CI flake).
        await eventually(lambda: bool(waits))
        await c.prefill[0].stop_heartbeats()
        c.cp.registry.lose(c.cp.registry.get("prefill-0"), "the last prefill node went")
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.reason == "NO_NODES"
        assert "reservation_timeout_s" in err.value.message
        assert all(w > 0 for w in waits), waits
        assert len(waits) < 100
        await eventually(lambda: "Release" in c.decode[0].methods())
    finally:
        await c.close()


async def test_a_node_that_fails_every_call_stops_drawing_the_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill node failing every Prefill at once (its engine or UCX path broken) while it
    heartbeats on had the shortest queue, so it drew every request: 10 of 10 failed with a
    healthy node beside it. After control_plane.failures_to_cool (3) failures in a row it is
    left out while the other takes requests. Controls: one failure alone leaves it in (a
    transient error costs no capacity); the cool-down ends with a probe, and a success clears
    it; a node alone is still used."""
    c = await make_cluster(tmp_path, prefill_nodes=2)
    try:
        broken = Unavailable("KV transfer to decode failed", reason="TRANSFER_FAILED")
        flaky, other = c.prefill
        flaky.servicer.refuse = broken
        with pytest.raises(Unavailable):
            await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
        flaky.servicer.refuse = None  # one failure, then well: still chosen
        await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
        assert flaky.methods().count("Prefill") == 2 and "Prefill" not in other.methods()
        flaky.servicer.refuse = broken
        outcomes = []
        for _ in range(10):
            try:
                await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
                outcomes.append("ok")
            except Unavailable:
                outcomes.append("failed")
        assert outcomes == ["failed"] * 3 + ["ok"] * 7
        assert flaky.methods().count("Prefill") == 5
        monkeypatch.setattr(c.cp.registry, "failure_cooldown_s", 0.0)  # the cool-down is over
        flaky.servicer.refuse = None
        await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)  # the probe succeeds
        assert flaky.methods().count("Prefill") == 6
        monkeypatch.setattr(c.cp.registry, "failure_cooldown_s", 60.0)
        await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
        assert flaky.methods().count("Prefill") == 7  # cleared: chosen again at once
        flaky.servicer.refuse = broken
        for _ in range(3):
            with pytest.raises(Unavailable):
                await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
        await other.stop()  # the healthy one goes: the cooling one is all there is
        c.cp.registry.lose(c.cp.registry.get(other.node_id), "gone")
        flaky.servicer.refuse = None
        result = await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
        assert result.usage.completion_tokens == 2
    finally:
        await c.close()


async def test_a_cooling_node_is_not_used_while_another_of_its_role_takes_requests(
    tmp_path: Path,
) -> None:
    """With the healthy prefill node out of room, a first version sent the overflow to the
    node that kept failing (in a burst, 8 of 10 failed). Requests now wait for the healthy
    node's room. Control: the cooling node is still used when it is all there is (the test
    above)."""
    from kvfence.proto.kvfence.v1 import control_pb2

    c = await make_cluster(tmp_path, prefill_nodes=2, node_timeout_s=60.0)
    try:
        broken, healthy = c.prefill
        broken.servicer.refuse = KvfenceError("engine broken")  # INTERNAL
        for _ in range(3):
            with pytest.raises(KvfenceError):
                await c.client().generate(prompt_ids=[10], max_new_tokens=2)
        assert broken.methods().count("Prefill") == 3  # it is cooling now
        await healthy.stop_heartbeats()
        healthy.servicer.refuse = ResourceExhausted("pool full", reason="PREFILL_POOL_FULL")
        call = asyncio.create_task(c.client(timeout=10).generate(prompt_ids=[11], max_new_tokens=2))
        await eventually(lambda: healthy.methods().count("Prefill") >= 1)
        await asyncio.sleep(0.3)
        assert not call.done() and broken.methods().count("Prefill") == 3  # waits for room
        healthy.servicer.refuse = None
        c.cp.registry.heartbeat(
            control_pb2.HeartbeatRequest(
                node_id=healthy.node_id,
                free_pages=healthy.free_pages + 1,  # more than when it refused
                instance_id=healthy.instance_id,
            )
        )
        assert (await asyncio.wait_for(call, 5)).usage.completion_tokens == 2
        assert broken.methods().count("Prefill") == 3
    finally:
        await c.close()


@pytest.mark.parametrize(
    "failure, cools",
    [
        (
            Unavailable("KV transfer to decode failed: Endpoint timeout", reason="TRANSFER_FAILED"),
            True,
        ),
        (DeadlineExceeded("KV transfer to decode failed: batch timed out", reason="TIMEOUT"), True),
        (DeadlineExceeded("KV transfer to decode failed: batch timed out", reason="OTHER"), False),
    ],
    ids=["transfer-failed", "transfer-timed-out", "deadline-not-the-transfer"],
)
async def test_a_failed_transfer_counts_against_the_decode_node_it_went_to(
    tmp_path: Path, failure: KvfenceError, cools: bool
) -> None:
    """Prefill's transfer to a decode node fails (its UCX receiver down) or times out (a listener
    that accepts and never answers: DEADLINE_EXCEEDED, reason TIMEOUT, prefill's only
    DEADLINE_EXCEEDED) from every prefill node alike; the failed request gave that decode node
    its pages back, so it had the most free pages and drew every request (10 of 10 failed beside
    a healthy decode node; a timeout cost each the whole transfer timeout). Its failures count
    with the prefill node's now: after three, the next request is served on the other decode
    node. Control: a DEADLINE_EXCEEDED with another reason is no node's fault: the fourth
    request goes to the same node."""
    c = await make_cluster(tmp_path, decode_nodes=2)
    try:
        c.script.prefill_error = failure
        for _ in range(3):
            with pytest.raises(type(failure)):
                await c.client().generate(prompt_ids=[10], max_new_tokens=2)
        [first] = [n for n in c.decode if "Reserve" in n.methods()]
        c.script.prefill_error = None
        result = await c.client().generate(prompt_ids=[10], max_new_tokens=2)
        assert result.usage.completion_tokens == 2
        [other] = [n for n in c.decode if n is not first]
        if cools:
            assert first.methods().count("Reserve") == 3 and other.methods().count("Reserve") == 1
        else:
            assert first.methods().count("Reserve") == 4 and "Reserve" not in other.methods()
    finally:
        await c.close()


@pytest.mark.parametrize("restarted", [True, False])
async def test_a_decode_reservation_is_given_back_only_to_the_node_that_counted_it(
    tmp_path: Path, restarted: bool
) -> None:
    """A request holds decode pages (counted on the node's estimate) when its decode node
    restarts in place: a new process registers under the same node_id and address. The
    request's release gave its pages back to the new node's estimate, which never counted them,
    and the new node looked emptier than it was until its next heartbeat. Control: without a
    restart the pages come off the node that counted them."""
    c = await make_cluster(tmp_path, node_timeout_s=60.0)
    try:
        c.script.decode_hold = asyncio.Event()
        call = asyncio.create_task(c.client(timeout=10).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: [r.record.state for r in c.cp.table] == [RequestState.DECODING])
        old = c.cp.registry.get("decode-0")
        assert old is not None and old.reserved_since_heartbeat > 0
        if restarted:
            c.cp.registry.register(c.decode[0].register_request("restarted"))
        else:
            call.cancel()
        c.script.decode_hold.set()
        await asyncio.gather(call, return_exceptions=True)
        await eventually(lambda: len(c.cp.table) == 0)
        node = c.cp.registry.get("decode-0")
        assert node is not None and (node is not old) == restarted
        await eventually(lambda: "Release" in c.decode[0].methods())
        assert node.reserved_since_heartbeat == 0  # not minus the old process's pages
    finally:
        if c.script.decode_hold is not None:
            c.script.decode_hold.set()
        await c.close()
