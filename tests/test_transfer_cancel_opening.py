"""A send cancelled while it opens a new endpoint to decode ends at once.

The cold opening (UCX's connect, then the hello and decode's answer) used to be shielded from
cancellation as a whole, for up to 2 x ``batch_timeout_s``: a Release, or a prefill drain that
timed out, waited that long for a send that had sent no page. Now only ucxx's own connect is not
cut short (cancelled mid-way it crashed the process): it goes on in the endpoint pool, which
discards its endpoint unused; a hello is cut short like any other step, its operations settled
and its endpoint discarded. Each case has its control: the same peer without a cancel still takes
its timeout, or the same path against a healthy decode completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np
import pytest
import torch
from asyncwait import eventually
from test_transfer import holds, make_pool, make_receiver, make_source

from kvfence import transfer
from kvfence.transfer import (
    LINGER_TAG,
    EndpointPool,
    InboundState,
    KvReceiver,
    OutboundPage,
    TransferError,
    page_buffer,
    send_pages,
)

SECRET = b"k" * 32


def start_send(address: str, eps: EndpointPool, timeout: float, source: torch.Tensor) -> Any:
    """A one-page send of reservation "res-1" on ``eps``, as a task."""
    page_bytes = source.numel() * source.element_size()
    return asyncio.ensure_future(
        send_pages(
            address,
            reservation_id="res-1",
            request_id="req-1",
            secret=SECRET,
            pages=[OutboundPage(0, page_buffer(source))],
            page_bytes=page_bytes,
            max_batch_bytes=page_bytes,
            batch_timeout_s=timeout,
            endpoints=eps,
        )
    )


async def cancelled_within(task: Any) -> float:
    """Cancel ``task``, wait for it to end cancelled; the seconds that took."""
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    return time.monotonic() - t0


@pytest.fixture
def silent_decode(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Decode's receiver takes a hello and never answers it; it only notices when the sender
    ends the endpoint (a receive on a tag nobody sends on). The hellos it heard."""
    heard: list[dict[str, Any]] = []

    async def serve_one(self: KvReceiver, ep: Any, hello: dict[str, Any], strays: list[int]) -> Any:
        heard.append(hello)
        with contextlib.suppress(Exception):
            await transfer._within(
                ep, [transfer._recv(ep, np.empty(1, np.uint8), tag=LINGER_TAG)], None
            )
        return False

    monkeypatch.setattr(KvReceiver, "_serve_one", serve_one)
    return heard


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "control-uncancelled"])
async def test_a_send_cancelled_while_its_hello_is_unanswered_ends_at_once(
    silent_decode: list[dict[str, Any]], cancel: bool
) -> None:
    """The hello went out on a new endpoint and decode does not answer. Cancelled, the send ends
    within a tenth of its batch timeout, its endpoint aborted (decode sees it end) and nothing
    left in the pool. Control: not cancelled, the same send waits out its timeout (TIMEOUT)."""
    pool = make_pool()
    rx, _ = await make_receiver(pool, batch_timeout_s=30.0)
    eps = EndpointPool()
    timeout = 5.0 if cancel else 1.0
    try:
        t0 = time.monotonic()
        send = start_send(rx.address, eps, timeout, make_source(pool, 1)[0])
        assert await eventually(lambda: bool(silent_decode), 10), "decode heard no hello"
        assert silent_decode[0]["reservation_id"] == "res-1" and "batch" not in silent_decode[0]
        assert rx.open_endpoints == 1 and eps.open_endpoints == 1
        if cancel:
            assert await cancelled_within(send) < timeout / 10
        else:
            with pytest.raises(TransferError) as err:
                await asyncio.wait_for(send, 30)
            assert err.value.reason == "TIMEOUT" and err.value.timeout
            assert time.monotonic() - t0 >= timeout
        assert (eps.opened, eps.discarded, eps.open_endpoints) == (1, 1, 0)
        assert eps.abandoned_connects == 0
        # decode's side of the endpoint ended: prefill aborted it
        assert await eventually(lambda: rx.open_endpoints == 0, 10)
    finally:
        await eps.close()
        await rx.stop()


@pytest.mark.parametrize("case", ["cancelled", "timed-out", "control"])
async def test_a_connect_the_send_stops_waiting_for_runs_to_its_end_unused(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """ucxx's connect to a healthy decode is held (the test's gate) after its handshake ran.
    ``cancelled``: the send is cancelled meanwhile and ends at once, the gate still shut;
    ``timed-out``: the send fails UNREACHABLE at its timeout, the gate still shut. Either way the
    connect is not cut short: it ends when the gate opens, and the pool discards its endpoint
    unused (decode heard no hello: the peer went before it, PEER_GONE). Control: the same send,
    the gate opened in time, goes through, its page received."""
    import ucxx

    gate = asyncio.Event()
    cut_short: list[bool] = []
    real_create = ucxx.create_endpoint

    async def held_create(host: str, port: int) -> Any:
        connecting = asyncio.ensure_future(real_create(host, port))
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cut_short.append(True)
            # ucxx's own connect runs on: the test must not be what crashes the process
            await asyncio.shield(connecting)
            raise
        return await connecting

    monkeypatch.setattr(ucxx, "create_endpoint", held_create)
    pool = make_pool()
    rx, events = await make_receiver(pool, batch_timeout_s=30.0)
    eps = EndpointPool()
    timeout = 0.5 if case == "timed-out" else 5.0
    refs = pool.allocate(1, "res-1")
    t = rx.expect("res-1", "req-1", SECRET, refs)
    source = make_source(pool, 1, fill=7.0)[0]
    try:
        t0 = time.monotonic()
        send = start_send(rx.address, eps, timeout, source)
        assert await eventually(lambda: rx.connections == 1, 10), "no connection reached decode"
        if case == "control":
            gate.set()
            await asyncio.wait_for(send, 30)
            await asyncio.wait_for(t.done.wait(), 5)
            assert t.state == InboundState.COMPLETE and t.received == [0]
            assert holds(pool, refs, [source])
            assert (eps.opened, eps.discarded, eps.idle("127.0.0.1", rx.port)) == (1, 0, 1)
            assert events == [] and not cut_short
            return
        if case == "cancelled":
            assert await cancelled_within(send) < timeout / 10
        else:
            with pytest.raises(TransferError) as err:
                await asyncio.wait_for(send, 30)
            assert err.value.reason == "UNREACHABLE"
            assert time.monotonic() - t0 >= timeout
        assert not gate.is_set() and eps.abandoned_connects == 1
        assert (eps.opened, eps.discarded, eps.open_endpoints) == (0, 0, 0)
        gate.set()
        assert await eventually(lambda: eps.abandoned_connects == 0, 10)
        assert not cut_short
        assert (eps.opened, eps.discarded, eps.open_endpoints) == (1, 1, 0)
        assert await eventually(lambda: rx.open_endpoints == 0, 10)
        assert rx.transfers_served == 0 and t.state == InboundState.EXPECTING
        assert [(k, p["reason"]) for k, p in events] == [("transfer_failed", "PEER_GONE")]
    finally:
        gate.set()
        await eps.close()
        await rx.stop()


async def test_a_send_to_a_frozen_decode_ends_at_once_when_cancelled() -> None:
    """A decode whose process does not run: its port accepts TCP, nothing answers UCX's
    handshake. Two sends connect to it: the one cancelled ends at once, well within its timeout;
    the control, not cancelled, fails UNREACHABLE at its own. Both connects run on until ucxx
    gives up by itself, and leave nothing open."""
    frozen: list[asyncio.StreamWriter] = []

    def on_connection(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frozen.append(writer)

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    eps = EndpointPool()
    try:
        t0 = time.monotonic()
        cancelled = start_send(address, eps, 5.0, torch.ones(16))
        control = start_send(address, eps, 1.0, torch.ones(16))
        assert await eventually(lambda: len(frozen) == 2, 10), "the sends did not connect"
        assert await cancelled_within(cancelled) < 5.0 / 10
        with pytest.raises(TransferError) as err:
            await asyncio.wait_for(control, 30)
        assert err.value.reason == "UNREACHABLE" and time.monotonic() - t0 >= 1.0
        assert eps.abandoned_connects == 2  # ucxx is still connecting, for neither send
        assert await eventually(lambda: eps.abandoned_connects == 0, 20)
        assert (eps.opened, eps.open_endpoints) == (0, 0)
    finally:
        await eps.close()
        for writer in frozen:
            writer.close()
        server.close()
        await server.wait_closed()
