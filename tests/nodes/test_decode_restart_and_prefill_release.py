"""Prefill node review fixes: a decode restarted in place is UNAVAILABLE, not an integrity failure;
a Release during the UCX send ends the call RESERVATION_RELEASED; node stop keeps the event loop
running while a forward pass ends; the batcher's tail scrub runs on the pool's device."""

from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from asyncwait import eventually
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    make_cfg,
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

import prefill_svc.batcher as batcher_mod
from kvfence.auth import with_token
from kvfence.config import Role
from kvfence.errors import NODE_RESTARTED, RESERVATION_RELEASED, error_info
from kvfence.kv.pool import PagePool, PageRef, PageState
from kvfence.localstack import free_port
from kvfence.model.sampling import SamplingParams
from kvfence.node_main import start_node
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvfence.transfer import (
    INTEGRITY_REASONS,
    KvReceiver,
    OutboundPage,
    TransferError,
    node_tag,
    page_buffer,
    reservation_origin,
    send_pages,
)
from prefill_svc.batcher import PrefillBatcher

PROMPT = list(range(3, 40))  # 37 tokens: 3 pages of 16


def integrity_count(metrics: Any) -> float:
    """Every kvfence_integrity_failures_total sample of a node, summed."""
    return sum(
        s.value
        for m in metrics.integrity_failures_total.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )


def kept_events(node: Any) -> list[tuple[str, dict[str, Any]]]:
    """The node's events from now on, kept (they still go to its bus)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    real = node.bus.emit

    def emit(kind: str, **payload: Any) -> Any:
        seen.append((kind, payload))
        return real(kind, **payload)

    node.bus.emit = emit
    return seen


async def outcome(call: Any) -> tuple[grpc.StatusCode, str | None]:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        info = error_info(err)
        return err.code(), info.reason if info else None
    return grpc.StatusCode.OK, None


async def stream_outcome(call: Any) -> tuple[grpc.StatusCode, str | None]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        info = error_info(err)
        return err.code(), info.reason if info else None
    return grpc.StatusCode.OK, None


# ---- 1. a decode restarted at the same UCX address -------------------------------------------


def test_reservation_ids_name_their_receiver_node_and_instance():
    pool = PagePool(4, num_layers=1, page_size=16, num_kv_heads=1, head_dim=8)

    def receiver(node_id: str | None, host: str = "127.0.0.1") -> KvReceiver:
        return KvReceiver(
            pool, host=host, max_batch_bytes=1, batch_timeout_s=1, report=print, node_id=node_id
        )

    a = receiver("decode-0")  # decode-0's process...
    a2 = receiver("decode-0")  # ...and the one that replaced it in place (same node id)
    b = receiver("decode-1")  # another decode node, alive
    assert a.instance != a2.instance and a.node == a2.node == node_tag("decode-0") != b.node
    rid = a.new_reservation_id()
    assert reservation_origin(rid) == (a.node, a.instance)
    assert a2.restarted(rid)  # the same node's previous process: NODE_RESTARTED
    # Another node's id is not a restart (a misrouted transfer, decode-0 is alive): it stays
    # UNKNOWN_RESERVATION, and this whatever the instance part says.
    assert not b.restarted(rid)
    assert not b.restarted(f"{a.node}.{b.instance}.{'0' * 32}")
    assert not a.restarted(rid)  # its own: unknown there is still UNKNOWN_RESERVATION
    assert not a.restarted(a.new_reservation_id())
    legacy = uuid.uuid4().hex  # the shape before ids named a node and instance
    for other in (
        "nope",
        legacy,
        f"{a2.instance}.{legacy}",  # the "<instance>.<uuid>" shape of e70759b: no node part
        f"{a.node}.{a2.instance}.",
        # Upper-case hex is not the id's shape. A fixed instance: a random one made only of
        # digits is unchanged by upper() (about 2% of runs), which made this line flaky.
        f"{a.node}.DEADBEEF.{'0' * 32}",
    ):
        assert reservation_origin(other) is None and not a2.restarted(other)
    # Made directly without a node id, a receiver is the node of the host it advertises: two on
    # different hosts are different nodes, two on one host the same one.
    h1, h2, h1b = receiver(None, "10.0.0.5"), receiver(None, "10.0.0.6"), receiver(None, "10.0.0.5")
    assert not h2.restarted(h1.new_reservation_id())
    assert h1b.restarted(h1.new_reservation_id())


async def test_a_hello_for_another_nodes_reservation_is_an_integrity_violation():
    """A transfer for a reservation another, live, decode node issued that reaches this one (a
    misrouted request, a stale address) is refused UNKNOWN_RESERVATION, an integrity violation,
    as for any id this node never issued; the control, the same node's previous process's id, is
    NODE_RESTARTED, a failed transfer."""
    pool = PagePool(4, num_layers=1, page_size=16, num_kv_heads=1, head_dim=8)
    events: list[tuple[str, dict[str, Any]]] = []
    rx = KvReceiver(
        pool,
        host="127.0.0.1",
        max_batch_bytes=1 << 20,
        batch_timeout_s=5,
        report=lambda kind, payload: events.append((kind, payload)),
        node_id="decode-y",
    )
    await rx.start()
    try:

        def issued_by(node_id: str) -> str:
            return KvReceiver(
                pool, host="127.0.0.1", max_batch_bytes=1, batch_timeout_s=1, report=print,
                node_id=node_id,
            ).new_reservation_id()  # fmt: skip

        source = torch.ones(pool.kv.shape[1:])
        page_bytes = source.numel() * source.element_size()
        for rid, kind, field, reason in (
            (issued_by("decode-x"), "integrity_violation", "check", "UNKNOWN_RESERVATION"),
            (issued_by("decode-y"), "transfer_failed", "reason", NODE_RESTARTED),  # control
        ):
            events.clear()
            with pytest.raises(TransferError) as err:
                await send_pages(
                    rx.address,
                    reservation_id=rid,
                    request_id="r",
                    secret=b"k" * 32,
                    pages=[OutboundPage(0, page_buffer(source))],
                    page_bytes=page_bytes,
                    max_batch_bytes=1 << 20,
                    batch_timeout_s=5,
                )
            assert err.value.reason == reason
            assert (err.value.reason in INTEGRITY_REASONS) == (kind == "integrity_violation")
            assert events == [(kind, {field: reason, "reservation_id": rid, "stage": "ucx_hello"})]
        assert pool.num_free == pool.num_pages
    finally:
        await rx.stop()


async def test_decode_restarted_in_place_is_unavailable_not_an_integrity_failure(
    tiny_dir,  # noqa: F811
    tmp_path,
):
    ucx_port = free_port()
    cfg = make_cfg(tiny_dir, tmp_path, node={"ucx_port": ucx_port})
    dec = await start_node(cfg, Role.DECODE, register=False)
    pre = await start_node(cfg, Role.PREFILL, register=False)
    dec2 = None
    try:
        async with grpc.aio.insecure_channel(pre.address) as pch:
            pstub = with_token(prefill_pb2_grpc.PrefillStub(pch), pre.node_token)
            async with grpc.aio.insecure_channel(dec.address) as dch:
                dstub = with_token(decode_pb2_grpc.DecodeStub(dch), dec.node_token)
                old = await dstub.Reserve(
                    decode_pb2.ReserveRequest(
                        request_id="r", tenant_id="t-c", prompt_tokens=len(PROMPT),
                        max_new_tokens=4,
                    )
                )  # fmt: skip
            await dec.stop(grace=0.2)
            # The container restarts: a new process, same UCX address, none of the old state.
            dec2 = await start_node(cfg, Role.DECODE, register=False)
            assert dec2.receiver.address == old.decode_ucx_address
            events = kept_events(dec2)
            async with grpc.aio.insecure_channel(dec2.address) as dch2:
                dstub2 = with_token(decode_pb2_grpc.DecodeStub(dch2), dec2.node_token)

                # The transfer for the previous process's reservation: UNAVAILABLE, no alarm.
                _, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT, res=old)
                assert await outcome(call) == (grpc.StatusCode.UNAVAILABLE, NODE_RESTARTED)
                assert [k for k, _ in events] == ["transfer_failed"]
                assert events[0][1]["reason"] == NODE_RESTARTED
                assert integrity_count(dec2.metrics) == 0
                assert integrity_count(pre.metrics) == 0

                # Its Decode (had the transfer gone before the restart): UNAVAILABLE as well, and
                # the controls, an unknown id of the running process and one another decode node
                # issued (here its instance even the old process's: only the node part differs),
                # are DATA_LOSS RESERVATION, an integrity failure.
                _, old_instance = reservation_origin(old.reservation_id) or ("", "")
                for rid, expected in (
                    (old.reservation_id, (grpc.StatusCode.UNAVAILABLE, NODE_RESTARTED)),
                    (
                        f"{dec2.receiver.node}.{dec2.receiver.instance}.{uuid.uuid4().hex}",
                        (grpc.StatusCode.DATA_LOSS, "RESERVATION"),
                    ),
                    (
                        f"{node_tag('decode-elsewhere')}.{old_instance}.{uuid.uuid4().hex}",
                        (grpc.StatusCode.DATA_LOSS, "RESERVATION"),
                    ),
                ):
                    events.clear()
                    before = integrity_count(dec2.metrics)
                    decode = dstub2.Decode(
                        decode_pb2.DecodeRequest(
                            request_id="r", tenant_id="t-c", reservation_id=rid,
                            manifest=common_pb2.KvManifest(reservation_id=rid),
                            sampling=common_pb2.SamplingParams(max_new_tokens=4),
                        )
                    )  # fmt: skip
                    assert await stream_outcome(decode) == expected
                    assert integrity_count(dec2.metrics) == before + (rid != old.reservation_id)
                events.clear()

                # Controls: an id this process never issued, of its own instance, of another
                # decode node (with the old process's instance), or of no recognised shape (the
                # bare uuid4 hex of releases before node and instance parts among them), is still
                # a forged hello: DATA_LOSS and an integrity violation.
                res = await dstub2.Reserve(
                    decode_pb2.ReserveRequest(
                        request_id="r2", tenant_id="t-c", prompt_tokens=len(PROMPT),
                        max_new_tokens=4,
                    )
                )  # fmt: skip
                node = node_tag(dec2.rt.node_id)
                assert reservation_origin(res.reservation_id) == (node, dec2.receiver.instance)
                forged_ids = [
                    f"{node}.{dec2.receiver.instance}.{uuid.uuid4().hex}",
                    f"{node_tag('decode-elsewhere')}.{old_instance}.{uuid.uuid4().hex}",
                    uuid.uuid4().hex,
                    "not-an-id",
                ]
                base = integrity_count(dec2.metrics)  # the Decode control's
                for n, forged_id in enumerate(forged_ids, start=1):
                    events.clear()
                    forged = prefill_pb2.Reservation()
                    forged.CopyFrom(res)
                    forged.reservation_id = forged_id
                    _, call = await reserve_and_prefill(dstub2, pstub, f"f{n}", PROMPT, res=forged)
                    assert await outcome(call) == (grpc.StatusCode.DATA_LOSS, "UNKNOWN_RESERVATION")
                    assert [k for k, _ in events] == ["integrity_violation"]
                    assert events[0][1]["check"] == "UNKNOWN_RESERVATION"
                    assert integrity_count(dec2.metrics) == base + n
                assert pre.rt.pool.num_free == pre.rt.pool.num_pages
    finally:
        await pre.stop(grace=0.2)
        if dec2 is not None:
            await dec2.stop(grace=0.2)


# ---- 2. a Release while the pages are on the wire --------------------------------------------


@pytest.mark.parametrize("release", ["rpc", "direct", None])
async def test_release_during_the_send_ends_the_call_released(
    tiny_dir,  # noqa: F811
    tmp_path,
    release,
):
    # One page per batch: the transfer is three stop-and-wait batches, and decode holds batch 1.
    async with node_pair(tiny_dir, tmp_path, transfer={"max_batch_bytes": 1}) as (
        dec,
        pre,
        dstub,
        pstub,
    ):
        pool = pre.rt.pool
        reached, gate = asyncio.Event(), asyncio.Event()
        real = dec.receiver._receive_pages

        async def hold_batch_1(ep, t, batch, indices):
            if batch == 1:
                reached.set()
                await gate.wait()
            return await real(ep, t, batch, indices)

        dec.receiver._receive_pages = hold_batch_1
        _, call = await reserve_and_prefill(dstub, pstub, "c", PROMPT)
        task = asyncio.ensure_future(outcome(call))
        try:
            assert await eventually(reached.is_set, 30)
            ids = [r.page_id for r in pre.servicer.held["c"].pages]
            if release == "rpc":
                assert (await pstub.Release(prefill_pb2.ReleaseRequest(request_id="c"))).held
            elif release == "direct":
                # What the Release RPC runs, called here so that nothing runs between it and the
                # check: the cancelled send has not settled, so the pages stay QUARANTINED.
                assert pre.servicer._release("c")
                assert {pool.state_of(i) for i in ids} == {PageState.QUARANTINED}
        finally:
            gate.set()  # decode goes on: without a stop, the send would now complete
        if release is not None:
            assert await task == (grpc.StatusCode.UNAVAILABLE, RESERVATION_RELEASED)
            assert pre.servicer.endpoints.discarded == 1  # the send was cut short
        else:
            assert await task == (grpc.StatusCode.OK, None)
            assert pre.servicer.endpoints.discarded == 0
            await pstub.Release(prefill_pb2.ReleaseRequest(request_id="c"))
        assert await eventually(lambda: pool.num_free == pool.num_pages)
        assert not pre.servicer.held
        pool.check_integrity()


async def test_release_during_the_send_returns_no_manifest(
    tiny_dir,  # noqa: F811
    tmp_path,
):
    """The call's manifest is refused too when the Release lands as the send ends (nothing
    left to cancel)."""
    async with node_pair(tiny_dir, tmp_path) as (_dec, pre, dstub, pstub):
        servicer = pre.servicer
        real = servicer._send

        async def send_then_released(req, outbound, fault):
            sent = await real(req, outbound, fault)
            # The control plane's Release, run after the send is over and before the call
            # resumes: there is no send left to cancel.
            asyncio.get_running_loop().call_soon(servicer._release, req.request_id)
            return sent

        servicer._send = send_then_released
        _, call = await reserve_and_prefill(dstub, pstub, "late", PROMPT)
        assert await outcome(call) == (grpc.StatusCode.UNAVAILABLE, RESERVATION_RELEASED)
        servicer._send = real  # control: the same call, not released, returns its manifest
        _, call = await reserve_and_prefill(dstub, pstub, "kept", PROMPT)
        assert (await call).manifest.token_count == len(PROMPT)


# ---- 3. stop while a forward pass runs ---------------------------------------------------------


async def test_stop_waits_for_the_running_pass_off_the_event_loop(
    tiny_dir,  # noqa: F811
    tmp_path,
):
    async with node_pair(tiny_dir, tmp_path) as (_dec, pre, dstub, pstub):
        entered, go, pass_over = threading.Event(), threading.Event(), threading.Event()
        engine = pre.rt.engine
        real = engine.prefill_many

        def held_pass(prompts, pages):
            entered.set()
            go.wait(10)  # a long pass; without the fix the event loop is frozen all this time
            try:
                return real(prompts, pages)
            finally:
                pass_over.set()

        engine.prefill_many = held_pass
        batcher = pre.servicer.batcher
        real_aclose = batcher.aclose
        closed_after_pass: list[bool] = []

        async def aclose():
            await real_aclose()
            closed_after_pass.append(pass_over.is_set())

        batcher.aclose = aclose
        _, call = await reserve_and_prefill(dstub, pstub, "a", PROMPT)
        task = asyncio.ensure_future(outcome(call))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        stop = asyncio.ensure_future(pre.stop(grace=0.1))
        try:
            # The loop runs on while stop waits for the pass: this task sees the batcher
            # closed while the pass is still held.
            assert await eventually(lambda: batcher._closed, 5)
            assert not pass_over.is_set()
            assert not stop.done()
        finally:
            go.set()
        await stop
        assert closed_after_pass == [True]  # the servicer's close still waits for the pass
        await task
        assert pre.rt.pool.num_free == pre.rt.pool.num_pages


# ---- 4. the tail scrub's tensors on the pool's device -----------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tail_scrub_gets_ids_on_the_pools_device(monkeypatch, device):
    """A meta pool stands in for a CUDA one (no CUDA here): the kernel's first check is that ids
    and tails are where the pool is."""
    kv = torch.ones((4, 1, 2, 16, 1, 8), device=device)
    pool = SimpleNamespace(page_size=16, kv=kv)
    engine = SimpleNamespace(
        prefill_many=lambda prompts, pages: (torch.zeros(len(prompts), 10), [None] * len(prompts))
    )
    real_scrub = batcher_mod.kernels.scrub_pages
    seen: list[tuple[torch.device, torch.device]] = []

    def scrub(kv_pages, page_ids, from_slot):
        seen.append((page_ids.device, from_slot.device))
        if kv_pages.device.type == "meta":  # no contents to zero: the checks that come first
            batcher_mod.kernels._checks.check_page_ids(page_ids, kv_pages)
            batcher_mod.kernels._checks.check_same_device(from_slot, page_ids)
            return None
        return real_scrub(kv_pages, page_ids, from_slot)

    monkeypatch.setattr(batcher_mod.kernels, "scrub_pages", scrub)
    batcher = PrefillBatcher(engine, pool)  # type: ignore[arg-type]
    try:
        greedy = SamplingParams(max_new_tokens=1, ignore_eos=True)
        first = batcher.submit(list(range(20)), [PageRef(1, 1), PageRef(2, 1)], greedy)
        assert first.result(30) == 0
    finally:
        batcher.close()
    assert seen == [(kv.device, kv.device)]
    if device == "cpu":  # the tail of the last page zeroed, the rest kept
        assert kv[2, :, :, 4:].abs().sum() == 0 and kv[2, :, :, :4].min() == 1
        assert kv[1].min() == 1
