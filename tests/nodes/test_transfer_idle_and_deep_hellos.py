"""What decode reports about the hellos it waits for on an endpoint.

1. An endpoint that served a transfer and then goes idle past decode's ``idle_timeout_s`` (prefill's
   reaper comes round late, or its host vanished without a reset) used to be reported
   ``BAD_HELLO``, as if a malformed hello had come on a healthy endpoint. Now decode closes it
   quietly. Controls: a new connection that says nothing within ``batch_timeout_s`` is still
   ``BAD_HELLO``, and so is a malformed hello on a pooled endpoint.
2. A hello nested too deep to parse (json raises RecursionError, no ValueError) was reported
   ``PEER_GONE`` on a new connection and not at all on a pooled one. Now ``BAD_HELLO`` like any
   other malformed hello (control: a hello that is no JSON at all).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from asyncwait import eventually
from test_transfer import make_pool, make_receiver, make_source, send

from kvfence.transfer import FRAME_BYTES, LEN_TAG, EndpointPool, InboundState, KvReceiver

DEEP = b"[" * 2000 + b"]" * 2000  # over the interpreter's recursion limit, within one frame
NOT_JSON = b"{not json"


def frame(body: bytes) -> np.ndarray:
    """A control message as one v4 frame: the negated length, then the body."""
    assert 8 + len(body) <= FRAME_BYTES
    return np.frombuffer(struct.pack("=q", -len(body)) + body, np.uint8)


async def pooled_endpoint(rx: KvReceiver, eps: EndpointPool, rid: str):
    """An endpoint that served one completed transfer (for ``rid``), taken out of prefill's pool."""
    pool = rx.pool
    t = rx.expect(rid, f"req-{rid}", b"k" * 32, pool.allocate(1, rid))
    await send(rx, t, make_source(pool, 1), endpoints=eps)
    assert t.state == InboundState.COMPLETE
    ep = eps.take("127.0.0.1", rx.port)
    assert ep is not None
    return ep


async def test_an_idle_pooled_endpoint_is_closed_quietly_and_a_silent_new_one_is_not():
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool, batch_timeout_s=0.5)
    rx.idle_timeout_s = 0.5  # prefill's pool below keeps its endpoint for 30 s: decode goes first
    eps = EndpointPool(idle_timeout_s=30.0)
    ep = None
    try:
        t = rx.expect("res-idle", "req-idle", b"k" * 32, pool.allocate(1, "res-idle"))
        await send(rx, t, make_source(pool, 1), endpoints=eps)
        assert t.state == InboundState.COMPLETE and eps.idle("127.0.0.1", rx.port) == 1
        assert rx.open_endpoints == 1
        # decode gives up waiting for the next hello and closes the endpoint ...
        assert await eventually(lambda: rx.open_endpoints == 0, timeout=10)
        assert events == []  # ... reporting nothing: no hello was malformed

        # control: a new connection that says nothing within batch_timeout_s is a bad hello
        ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
        assert await eventually(lambda: bool(events), timeout=10)
        assert events == [
            (
                "transfer_failed",
                {"reason": "BAD_HELLO", "error": "TransferError", "stage": "ucx_hello"},
            )
        ]
    finally:
        if ep is not None:
            ep.abort()
        await eps.close()
        await rx.stop()


async def test_a_malformed_hello_on_a_pooled_endpoint_is_still_reported():
    """Control for the quiet close: what decode reads on an endpoint that served a transfer is
    still checked; only the absence of a next hello is quiet."""
    pool = make_pool()
    rx, events = await make_receiver(pool)
    eps = EndpointPool()
    ep = await pooled_endpoint(rx, eps, "res-a")
    try:
        await ep.send(frame(NOT_JSON), tag=LEN_TAG)
        assert await eventually(lambda: bool(events), timeout=10)
        assert events[0][1]["reason"] == "BAD_HELLO", events
    finally:
        ep.abort()
        await eps.close()
        await rx.stop()


@pytest.mark.parametrize("pooled", [False, True], ids=["new", "pooled"])
@pytest.mark.parametrize("body", [DEEP, NOT_JSON], ids=["too_deep", "not_json"])
async def test_a_hello_nested_too_deep_to_parse_is_a_bad_hello(pooled, body):
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    eps = EndpointPool()
    try:
        if pooled:
            ep = await pooled_endpoint(rx, eps, "res-p")
        else:
            ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
        try:
            await ep.send(frame(body), tag=LEN_TAG)
            # decode aborts the endpoint of a malformed hello
            assert await eventually(lambda: rx.open_endpoints == 0, timeout=10)
            assert await eventually(lambda: bool(events), timeout=2)
        finally:
            ep.abort()
        assert [(k, p["reason"]) for k, p in events] == [("transfer_failed", "BAD_HELLO")]
        assert events[0][1]["stage"] == "ucx_hello"
        assert rx.handler_errors == 0
    finally:
        await eps.close()
        await rx.stop()
