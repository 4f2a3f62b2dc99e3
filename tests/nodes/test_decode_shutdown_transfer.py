"""A decode node shut down while a KV transfer into it is mid-receive leaks nothing."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import torch
from asyncwait import eventually
from test_prefill_decode import make_cfg, tiny_dir  # noqa: F401  (fixture)

from kvfence.auth import with_token
from kvfence.config import Role
from kvfence.kv.pool import PageState
from kvfence.node_main import start_node
from kvfence.proto.kvfence.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2
from kvfence.transfer import InboundState, KvReceiver, _expect_ok, _send_json, authenticator


async def stalled_sender(dec, res, stage: str):
    """A prefill that says hello, is accepted, and stalls: before any batch header
    (``"hello"``) or after announcing a batch whose pages never come (``"batch"``: decode's
    receives stay posted into the reserved pages)."""
    import ucxx

    host, _, port = dec.receiver.address.rpartition(":")
    ep = await ucxx.create_endpoint(host, int(port))
    await _send_json(
        ep,
        {
            "reservation_id": res.reservation_id,
            "request_id": "r-stall",
            "auth": authenticator(res.secret, res.reservation_id),
        },
    )
    await _expect_ok(ep, 5)
    if stage == "batch":
        await _send_json(ep, {"indices": [0, 1]})
    return ep


async def reserve(dec):
    """Reserve decode pages for a 30-token prompt, as the control plane would."""
    async with grpc.aio.insecure_channel(dec.address) as ch:
        return await with_token(decode_pb2_grpc.DecodeStub(ch), dec.node_token).Reserve(
            decode_pb2.ReserveRequest(
                request_id="r-stall", tenant_id="t", prompt_tokens=30, max_new_tokens=4
            )
        )


@pytest.mark.parametrize("stage", ["hello", "batch"])
async def test_decode_shutdown_mid_receive_frees_pages_and_ends_the_handler(
    tiny_dir,  # noqa: F811
    tmp_path,
    stage,
):
    """A prefill stalls mid-transfer (after its hello, or with a batch's receives posted) and the
    decode node shuts down gracefully: the transfer ends CANCELLED, not RECEIVING, the pages are
    free at a new generation with no operation outstanding, and the handler
    task has ended. Regression test: this held before it was written."""
    cfg = make_cfg(tiny_dir, tmp_path)
    dec = await start_node(cfg, Role.DECODE, register=False)
    stopped = False
    ep = None
    try:
        pool, rx = dec.rt.pool, dec.receiver
        res = await reserve(dec)
        t = rx.transfers[res.reservation_id]
        ep = await stalled_sender(dec, res, stage)
        want_ops = 2 if stage == "batch" else 0
        # decode accepted the hello and (stage "batch") posted the batch's receives
        assert await eventually(
            lambda: (
                t.state == InboundState.RECEIVING
                and pool.outstanding_ops(res.reservation_id) == want_ops
            )
        )
        held = [r.page_id for r in res.pages]
        assert all(pool.state_of(p) == PageState.RECEIVING for p in held)
        handlers = set(rx._handlers)
        assert handlers

        await asyncio.wait_for(dec.stop(grace=1), 20)
        stopped = True

        # the transfer ended (cancelled), not left RECEIVING; the reservation is gone
        assert t.state == InboundState.CANCELLED and t.done.is_set()
        assert res.reservation_id not in dec.servicer.reservations
        assert res.reservation_id not in rx.transfers
        # every page is free again, at a new generation; nothing is quarantined or counted
        assert pool.num_free == pool.num_pages
        assert pool.stats().quarantined == 0
        assert pool.outstanding_ops(res.reservation_id) == 0
        assert all(pool.state_of(p) == PageState.FREE for p in held)
        assert all(pool.generation(r.page_id) > r.generation for r in res.pages)
        pool.check_integrity()
        # no handler task is left pending, and the receiver holds no endpoint
        assert all(h.done() for h in handlers)
        assert not rx._handlers and rx.open_endpoints == 0
    finally:
        if ep is not None:
            ep.abort()
        if not stopped:
            await dec.stop(grace=0)


async def test_a_connection_still_in_its_handshake_at_shutdown_is_not_served_after_it(
    tiny_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """UCX accepts a connection before kvfence sees it (ucxx exchanges peer info first): one
    whose handshake was still running when the node stopped reaches the receiver afterwards, and
    must be closed at once, not served (a task and an endpoint waiting batch_timeout_s for a hello,
    reporting to a stopped event bus) after the node said it had stopped."""
    import ucxx
    from ucxx._lib_async import listener as ucxx_listener

    gate, held = asyncio.Event(), asyncio.Event()
    real_exchange = ucxx_listener.exchange_peer_info

    async def gated_exchange(*args, **kw):
        if kw.get("listener"):
            held.set()
            await gate.wait()
        return await real_exchange(*args, **kw)

    monkeypatch.setattr(ucxx_listener, "exchange_peer_info", gated_exchange)
    reached = asyncio.Event()  # the connection reached the receiver
    real_on_connect = KvReceiver._on_connect

    async def on_connect(self, ep):
        reached.set()
        await real_on_connect(self, ep)

    monkeypatch.setattr(KvReceiver, "_on_connect", on_connect)
    cfg = make_cfg(tiny_dir, tmp_path)
    dec = await start_node(cfg, Role.DECODE, register=False)
    rx = dec.receiver
    host, _, port = rx.address.rpartition(":")
    connect = asyncio.ensure_future(ucxx.create_endpoint(host, int(port)))
    ep = None
    try:
        await asyncio.wait_for(held.wait(), 10)  # decode's side of the handshake is running
        await asyncio.wait_for(dec.stop(grace=0), 20)
        events_at_stop = len(dec.bus.recent)
        gate.set()  # the handshake completes after the node stopped
        with contextlib.suppress(Exception):
            ep = await asyncio.wait_for(connect, 5)
        await asyncio.wait_for(reached.wait(), 5)
        # what the handshake handed to the receiver was closed, not served: no handler waits
        # for a hello and the receiver holds no endpoint
        assert await eventually(lambda: not rx._handlers and rx.open_endpoints == 0, 1.0)
        assert rx.connections == 0
        assert len(dec.bus.recent) == events_at_stop  # nothing reported after the stop
    finally:
        gate.set()
        if ep is not None:
            ep.abort()
        if not connect.done():
            connect.cancel()
            with contextlib.suppress(BaseException):
                await connect


async def test_control_a_transfer_to_a_running_decode_node_completes_and_frees_its_pages(
    tiny_dir,  # noqa: F811
    tmp_path,
):
    """Control for the shutdown tests: the same reservation and UCX path with no shutdown ends
    COMPLETE, and the pages come back when the reservation is released."""
    from kvfence.transfer import OutboundPage, page_buffer, send_pages

    cfg = make_cfg(tiny_dir, tmp_path)
    dec = await start_node(cfg, Role.DECODE, register=False)
    try:
        pool, rx = dec.rt.pool, dec.receiver
        async with grpc.aio.insecure_channel(dec.address) as ch:
            stub = with_token(decode_pb2_grpc.DecodeStub(ch), dec.node_token)
            res = await stub.Reserve(
                decode_pb2.ReserveRequest(
                    request_id="r-ok", tenant_id="t", prompt_tokens=30, max_new_tokens=4
                )
            )
            t = rx.transfers[res.reservation_id]
            sources = [torch.full(pool.kv.shape[1:], 1.0 + i) for i in range(2)]
            await send_pages(
                rx.address,
                reservation_id=res.reservation_id,
                request_id="r-ok",
                secret=res.secret,
                pages=[OutboundPage(i, page_buffer(s)) for i, s in enumerate(sources)],
                page_bytes=pool.page_bytes,
                max_batch_bytes=cfg.transfer.max_batch_bytes,
                batch_timeout_s=5,
            )
            await asyncio.wait_for(t.done.wait(), 5)
            assert t.state == InboundState.COMPLETE and sorted(t.received) == [0, 1]
            assert all(
                torch.equal(pool.kv[r.page_id], s)
                for r, s in zip(res.pages[:2], sources, strict=True)
            )
            assert pool.num_free == pool.num_pages - len(res.pages)
            released = await stub.Release(prefill_pb2.ReleaseRequest(request_id="r-ok"))
        assert released.held
        assert await eventually(lambda: pool.num_free == pool.num_pages)
        assert pool.stats().quarantined == 0
        pool.check_integrity()
    finally:
        await dec.stop(grace=0)
    assert not rx._handlers and rx.open_endpoints == 0


@pytest.mark.parametrize("cancel", [True, False], ids=["handler-cancelled", "control"])
async def test_a_cancelled_transfer_handler_leaves_its_transfer_cancelled(
    tiny_dir,  # noqa: F811
    tmp_path,
    cancel,
):
    """The receiver's handler task cancelled mid-receive (``KvReceiver.stop`` cancels a handler
    that outlives its wait) ends the transfer CANCELLED and done, not RECEIVING until the
    reservation times out. Control: the same stalled transfer, not cancelled, stays RECEIVING."""
    cfg = make_cfg(tiny_dir, tmp_path)
    dec = await start_node(cfg, Role.DECODE, register=False)
    ep = None
    try:
        pool, rx = dec.rt.pool, dec.receiver
        res = await reserve(dec)
        t = rx.transfers[res.reservation_id]
        ep = await stalled_sender(dec, res, "batch")
        assert await eventually(
            lambda: (
                t.state == InboundState.RECEIVING and pool.outstanding_ops(res.reservation_id) == 2
            )
        )
        (handler,) = rx._handlers
        if cancel:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(handler, 10)
            assert t.state == InboundState.CANCELLED and t.done.is_set()
            # the posted receives were settled, not abandoned
            assert pool.outstanding_ops(res.reservation_id) == 0
        else:
            await asyncio.sleep(0.5)
            assert t.state == InboundState.RECEIVING and not t.done.is_set()
            assert not handler.done()
    finally:
        if ep is not None:
            ep.abort()
        await dec.stop(grace=0)
