"""Failure paths: node errors keep their status, lost nodes, cancellation, offline, abort, deadline.

Each test checks the status the client sees and the Release calls every node that held something
received, which is what keeps pages from leaking (or being read) after a failure.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cp_harness import Cluster, eventually

from control_plane.lifecycle import RequestState
from kvfence.errors import (
    Cancelled,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    KvfenceError,
    ResourceExhausted,
    Unavailable,
)
from kvfence.proto.kvfence.v1 import control_pb2


def released(node) -> bool:
    return "Release" in node.methods()


async def test_data_loss_from_decode_keeps_code_and_reason(cluster: Cluster) -> None:
    cluster.script.decode_error = IntegrityError("checksum of page 3", reason="CHECKSUM_MISMATCH")
    with pytest.raises(IntegrityError) as err:
        await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert err.value.reason == "CHECKSUM_MISMATCH"
    # The node's own text goes to the control plane's log, not to the tenant
    # (test_cp_error_messages.py).
    assert "checksum of page 3" not in err.value.message
    assert err.value.message.endswith("(DATA_LOSS, CHECKSUM_MISMATCH)")
    await eventually(lambda: released(cluster.decode[0]) and released(cluster.prefill[0]))
    [failed] = cluster.events.of("request_failed")
    assert (failed["code"], failed["reason"]) == ("DATA_LOSS", "CHECKSUM_MISMATCH")


async def test_a_failed_requests_status_does_not_wait_for_its_releases(cluster: Cluster) -> None:
    """The status went to the client only after every Release had answered (up to 5 s each):
    with decode slow to answer, as a node in trouble is, a DATA_LOSS reached a client with a
    2 s deadline as DEADLINE_EXCEEDED. The releases still happen, after. The tenant's retry at
    once is not refused for the request it just lost (limit 1). Control: with Release
    answering, the same failure, as the test above."""
    from control_plane.tenants import TenantLimits

    cluster.cp.tenants.set_limits("acme", TenantLimits(max_concurrent_requests=1))
    cluster.script.decode_error = IntegrityError("checksum of page 3", reason="CHECKSUM_MISMATCH")
    cluster.script.release_hold = asyncio.Event()
    try:
        with pytest.raises(IntegrityError) as err:
            await cluster.client(timeout=2).generate(prompt_ids=[10, 11], max_new_tokens=4)
        assert err.value.reason == "CHECKSUM_MISMATCH"
        await eventually(lambda: released(cluster.decode[0]))  # asked, not answered yet
        assert len(cluster.cp.table) == 1  # its releases go on
        cluster.script.decode_error = None
        retry = await cluster.client(timeout=5).generate(prompt_ids=[10, 11], max_new_tokens=4)
        assert retry.usage.completion_tokens == 4
    finally:
        cluster.script.release_hold.set()
    await eventually(lambda: not cluster.cp.table, 8)


@pytest.mark.parametrize("node", ["prefill", "decode"])
async def test_a_nodes_own_cancel_is_unavailable_not_the_clients_cancel(
    cluster: Cluster, node: str
) -> None:
    """A node that ends a call CANCELLED itself (prefill's reaper releasing a request whose pass
    waited past transfer.reservation_timeout_s; a node's server stopping) reached the client as
    CANCELLED, its own cancel to its eyes (no retry), counted as a client cancel. Now UNAVAILABLE
    NODE_CANCELLED (retry). Control: the client's own cancel stays CANCELLED (the test below)."""
    if node == "prefill":
        cluster.script.prefill_error = Cancelled("released while prefilling")
    else:
        cluster.script.decode_error = Cancelled("stopping")
    with pytest.raises(Unavailable) as err:
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=4)
    assert err.value.reason == "NODE_CANCELLED"
    assert err.value.message.startswith(f"the {node} node serving this request ended its call")
    assert f"{node}-0" not in err.value.message  # node ids are the operator's, not the tenant's
    [failed] = cluster.events.of("request_failed")
    assert failed["code"] == "UNAVAILABLE"
    await eventually(lambda: released(cluster.decode[0]))


def integrity_failures(cluster: Cluster, check: str) -> float:
    labels = {"service": "control-plane", "check": check}
    value = cluster.cp.metrics.registry.get_sample_value("kvfence_integrity_failures_total", labels)
    return value or 0.0


async def test_the_control_plane_counts_only_the_integrity_checks_it_made(
    cluster: Cluster,
) -> None:
    """A check decode failed is decode's to count: counted here as well, KvfenceIntegrityCheckFailed
    fired twice for one bad manifest and named the control plane, which never saw the bytes.
    Control: a check of the control plane's own (prefill's first token against decode's) is
    counted here. Both requests fail DATA_LOSS and both show in request_failed events."""
    cluster.script.decode_error = IntegrityError("manifest MAC", reason="MAC")
    with pytest.raises(IntegrityError):
        await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    assert integrity_failures(cluster, "MAC") == 0
    cluster.script.decode_error = None
    cluster.script.first_token_override = 99
    with pytest.raises(IntegrityError):
        await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    assert integrity_failures(cluster, "FIRST_TOKEN_MISMATCH") == 1
    failed = cluster.events.of("request_failed")
    assert [f["reason"] for f in failed] == ["MAC", "FIRST_TOKEN_MISMATCH"]


def releases_of(node, request_id: str) -> int:
    return sum(1 for m, req in node.calls if m == "Release" and req.request_id == request_id)


@pytest.mark.parametrize(
    "override",
    [
        {"tenant_id": "globex"},
        {"request_id": "req-of-another"},
        {"reservation_id": "res-of-another"},
        {"token_count": 1},
        {"token_count": 3},
    ],
    ids=["tenant", "request", "reservation", "fewer-tokens", "more-tokens"],
)
async def test_a_manifest_not_of_this_request_fails_before_decode(
    cluster: Cluster, override: dict
) -> None:
    """The control plane checks the manifest prefill returned against the request before
    anything of it goes to decode (control_plane.verify.check_manifest): one naming another
    tenant, request or reservation, or another prompt length, fails DATA_LOSS MANIFEST_MISMATCH,
    counted as the control plane's own check, and decode is never asked to Decode it; both nodes
    release the request. Control (first, on the same cluster): prefill's manifest untouched, the
    request decodes and decode gets that manifest."""
    ok = await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    assert ok.usage.completion_tokens == 4
    [decoded] = [req for m, req in cluster.decode[0].calls if m == "Decode"]
    m = decoded.manifest
    assert (m.request_id, m.tenant_id, m.token_count) == (ok.request_id, "acme", 2)
    assert m.reservation_id == decoded.reservation_id

    cluster.script.manifest_override = override
    with pytest.raises(IntegrityError) as err:
        await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert err.value.reason == "MANIFEST_MISMATCH"
    assert cluster.decode[0].methods().count("Decode") == 1  # the control's alone
    [failed] = cluster.events.of("request_failed")
    assert (failed["code"], failed["reason"]) == ("DATA_LOSS", "MANIFEST_MISMATCH")
    assert integrity_failures(cluster, "MANIFEST_MISMATCH") == 1
    rid = failed["request_id"]
    await eventually(
        lambda: releases_of(cluster.decode[0], rid) > 0 and releases_of(cluster.prefill[0], rid) > 0
    )


async def test_prefill_error_keeps_its_code_and_releases_decode(cluster: Cluster) -> None:
    cluster.script.prefill_error = InvalidArgument("bad prompt", reason="PREFILL_SAYS_NO")
    with pytest.raises(InvalidArgument) as err:
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=4)
    assert err.value.reason == "PREFILL_SAYS_NO"
    assert "Decode" not in cluster.decode[0].methods()
    await eventually(lambda: released(cluster.decode[0]) and released(cluster.prefill[0]))


async def test_node_lost_mid_request_is_unavailable_and_releases_the_other(
    cluster: Cluster,
) -> None:
    cluster.script.prefill_hold = asyncio.Event()
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await cluster.prefill[0].servicer.entered.wait()
    await cluster.prefill[0].stop_heartbeats()  # the prefill node goes silent mid-request
    with pytest.raises(Unavailable) as err:
        await asyncio.wait_for(call, 3)
    assert err.value.reason == "NODE_LOST"
    assert "the prefill node serving this request was lost" in err.value.message
    assert "prefill-0" not in err.value.message  # node ids are internal: the event names it
    # The decode node held a reservation: it is released (after the client heard why); the
    # lost node is not called again.
    await eventually(lambda: cluster.decode[0].methods() == ["Reserve", "Release"])
    assert cluster.prefill[0].methods() == ["Prefill"]
    assert [e["node"] for e in cluster.events.of("node_lost")] == ["prefill-0"]
    cluster.script.prefill_hold.set()


async def test_decode_lost_while_streaming(cluster: Cluster) -> None:
    cluster.script.decode_hold = asyncio.Event()
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await cluster.decode[0].servicer.entered.wait()
    await eventually(lambda: "Decode" in cluster.decode[0].methods())
    await cluster.decode[0].stop_heartbeats()
    with pytest.raises(Unavailable, match="the decode node serving this request was lost") as err:
        await asyncio.wait_for(call, 3)
    assert "decode-0" not in err.value.message
    await eventually(lambda: released(cluster.prefill[0]))
    cluster.script.decode_hold.set()


async def test_client_cancel_releases_every_node(cluster: Cluster) -> None:
    cluster.script.prefill_hold = asyncio.Event()
    client = cluster.client()
    call = asyncio.create_task(client.generate(prompt_ids=[10], max_new_tokens=4))
    await cluster.prefill[0].servicer.entered.wait()
    call.cancel()
    await eventually(lambda: released(cluster.decode[0]) and released(cluster.prefill[0]))
    assert cluster.decode[0].calls[-1][1].reason.startswith("CANCELLED")
    await eventually(lambda: not cluster.cp.table)
    cluster.script.prefill_hold.set()


async def test_deadline_while_decoding_releases(cluster: Cluster) -> None:
    cluster.script.decode_hold = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await cluster.client(timeout=0.5).generate(prompt_ids=[10], max_new_tokens=4)
    await eventually(lambda: released(cluster.decode[0]) and released(cluster.prefill[0]))
    # The deadline reached the node as the RPC timeout, not only as our own timer.
    cluster.script.decode_hold.set()


async def test_offline_refuses_new_and_queued_requests_and_online_restores(
    cluster: Cluster,
) -> None:
    admin, auth = cluster.admin()
    cluster.script.reserve_error = ResourceExhausted("full")
    queued = asyncio.create_task(
        cluster.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
    )
    await eventually(lambda: cluster.cp.queue.waiting == 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    status = await admin.SetModelAccess(
        control_pb2.SetModelAccessRequest(online=False, reason="incident 42"), metadata=auth
    )
    assert not status.online and status.reason == "incident 42"
    with pytest.raises(Unavailable) as err:
        await queued
    assert loop.time() - started < 1.0
    assert err.value.message == "model test-model is offline: incident 42"
    calls_before = cluster.node_calls()
    with pytest.raises(Unavailable, match="offline: incident 42"):
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
    assert cluster.node_calls() == calls_before
    assert [e["online"] for e in cluster.events.of("model_access")] == [False]

    cluster.script.reserve_error = None
    await admin.SetModelAccess(control_pb2.SetModelAccessRequest(online=True), metadata=auth)
    result = await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
    assert result.usage.completion_tokens == 2


@pytest.mark.parametrize("offline", [True, False])
async def test_offline_reaches_a_request_waiting_for_prefill_room(
    cluster: Cluster, offline: bool
) -> None:
    """A request holding its decode pages while every prefill node says it is full is as queued
    as one waiting for pages: the kill switch reaches it within a second, and its pages go back.
    The control: left online, the same request runs once prefill has room."""
    admin, auth = cluster.admin()
    cluster.script.prefill_error = ResourceExhausted("prefill queue full")
    prefill = cluster.prefill[0]
    room, prefill.free_pages = prefill.free_pages, 0  # its heartbeats say it is full
    call = asyncio.create_task(
        cluster.client(timeout=5).generate(prompt_ids=[10, 11], max_new_tokens=2)
    )
    # Waiting for prefill room (a node whose heartbeat says it is full gets no prompt).
    await eventually(
        lambda: [r.record.state for r in cluster.cp.table] == [RequestState.PREFILLING]
    )
    await asyncio.sleep(0.2)  # heartbeats come and go: it waits
    [run] = list(cluster.cp.table)
    assert run.record.state == RequestState.PREFILLING
    loop = asyncio.get_running_loop()
    started = loop.time()
    if offline:
        await admin.SetModelAccess(
            control_pb2.SetModelAccessRequest(online=False, reason="incident 7"), metadata=auth
        )
        with pytest.raises(Unavailable, match="offline: incident 7"):
            await asyncio.wait_for(call, 5)
        assert loop.time() - started < 1.0
        cluster.script.prefill_error = None
        await eventually(lambda: "Release" in cluster.decode[0].methods())
    else:
        cluster.script.prefill_error = None  # prefill has room again, its heartbeat says
        prefill.free_pages = room
        result = await asyncio.wait_for(call, 5)
        assert result.usage.completion_tokens == 2


async def test_admin_abort_cancels_and_releases(cluster: Cluster) -> None:
    admin, auth = cluster.admin()
    cluster.script.decode_hold = asyncio.Event()
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await eventually(lambda: "Decode" in cluster.decode[0].methods())
    [info] = (await admin.ListRequests(control_pb2.ListRequestsRequest(), metadata=auth)).requests
    assert (info.state, info.decode_node, info.tenant_id) == ("DECODING", "decode-0", "acme")
    resp = await admin.AbortRequest(
        control_pb2.AbortRequestRequest(request_id=info.request_id), metadata=auth
    )
    assert resp.aborted
    with pytest.raises(Cancelled, match="aborted by an operator"):
        await call
    await eventually(lambda: released(cluster.decode[0]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.AbortRequest(
            control_pb2.AbortRequestRequest(request_id=info.request_id), metadata=auth
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    cluster.script.decode_hold.set()


async def test_states_seen_by_a_finished_request(cluster: Cluster) -> None:
    seen: list[RequestState] = []
    original = cluster.cp.table.remove

    def remove(run) -> None:
        seen.extend([s for s, _ in run.record.history] + [run.record.state])
        original(run)

    cluster.cp.table.remove = remove  # type: ignore[method-assign]
    await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
    await eventually(lambda: bool(seen))
    assert seen == [
        RequestState.RECEIVED,
        RequestState.ADMITTED,
        RequestState.RESERVED,
        RequestState.PREFILLING,
        RequestState.KV_VERIFIED,
        RequestState.DECODING,
        RequestState.FINISHED,
    ]


async def test_unexpected_stream_end_is_never_ok(cluster: Cluster) -> None:
    cluster.script.finish_reason = ""  # decode ends the stream without saying why
    with pytest.raises(KvfenceError) as err:
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
    assert err.value.reason == "STREAM_TRUNCATED"


async def test_a_cancelled_pipeline_task_ends_its_request_cancelled(cluster: Cluster) -> None:
    """The pipeline task is cancelled only when the event loop goes down under it; its request
    must still end in a terminal state, counted as what it was, with its nodes released (it was
    counted OK and left DECODING)."""
    await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)  # control: counted OK
    cluster.script.decode_hold = asyncio.Event()
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await eventually(lambda: cluster.decode[0].methods().count("Decode") == 2)
    [run] = list(cluster.cp.table)
    [task] = cluster.cp.generation.tasks
    task.cancel()
    with pytest.raises(Unavailable):  # what the client is told (a shutdown)
        await asyncio.wait_for(call, 5)
    assert run.record.state == RequestState.CANCELLED
    await eventually(lambda: cluster.decode[0].methods()[-1] == "Release")
    text = cluster.cp.metrics.render().decode()
    assert 'kvfence_requests_total{service="control-plane",status="OK"} 1.0' in text
    assert 'kvfence_requests_total{service="control-plane",status="CANCELLED"} 1.0' in text
    cluster.script.decode_hold.set()


class _HeldEndOfStream:
    """A decode call whose end of stream has arrived but is handed to the pipeline only when
    ``go`` is set: the gap in which the control plane has the whole answer but has not yet
    finished the request (a task switch, in production)."""

    def __init__(self, call, at_end: asyncio.Event, go: asyncio.Event):
        self._call, self._at_end, self._go = call, at_end, go

    async def read(self):
        msg = await self._call.read()
        if msg is grpc.aio.EOF:
            self._at_end.set()
            await self._go.wait()
        return msg

    def __getattr__(self, name: str):
        return getattr(self._call, name)


def hold_end_of_stream(cluster: Cluster) -> tuple[asyncio.Event, asyncio.Event]:
    at_end, go = asyncio.Event(), asyncio.Event()
    clients = cluster.cp.clients
    original = clients.decode

    class Stub:
        def __init__(self, stub):
            self._stub = stub

        def Decode(self, *args, **kwargs):
            return _HeldEndOfStream(self._stub.Decode(*args, **kwargs), at_end, go)

        def __getattr__(self, name: str):
            return getattr(self._stub, name)

    clients.decode = lambda node: Stub(original(node))  # type: ignore[method-assign]
    return at_end, go


async def test_an_abort_that_races_the_last_token_wins_for_both(cluster: Cluster) -> None:
    """The operator's abort lands after decode's last token and end of stream arrived, before the
    pipeline finished the request: the operator was told aborted=True while the client got OK
    with the whole answer. The abort was accepted, so the client must see it too."""
    admin, auth = cluster.admin()
    at_end, go = hold_end_of_stream(cluster)
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await asyncio.wait_for(at_end.wait(), 5)
    [run] = list(cluster.cp.table)
    assert run.record.state == RequestState.DECODING
    resp = await admin.AbortRequest(
        control_pb2.AbortRequestRequest(request_id=run.record.request_id), metadata=auth
    )
    go.set()
    assert resp.aborted
    with pytest.raises(Cancelled, match="aborted by an operator"):
        await asyncio.wait_for(call, 5)
    assert run.record.state == RequestState.CANCELLED
    await eventually(lambda: released(cluster.decode[0]))  # a cancelled request releases decode


async def test_an_abort_after_the_request_finished_is_refused_and_the_client_gets_ok(
    cluster: Cluster,
) -> None:
    """Control for the race above: once the request is FINISHED (still in the table, on its way
    out) an abort is refused, and after it left the table it is not found; the client gets OK."""
    admin, auth = cluster.admin()
    answers: list[bool] = []
    original = cluster.cp.table.remove

    def remove(run) -> None:
        assert run.record.state == RequestState.FINISHED
        assert cluster.cp.table.get(run.record.request_id) is run
        answers.append(run.interrupt(Cancelled("the request was aborted by an operator")))
        original(run)

    cluster.cp.table.remove = remove  # type: ignore[method-assign]
    result = await cluster.client().generate(prompt_ids=[10], max_new_tokens=4)
    assert answers == [False]
    assert (result.finish_reason, result.usage.completion_tokens) == ("length", 4)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.AbortRequest(
            control_pb2.AbortRequestRequest(request_id=result.request_id), metadata=auth
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
