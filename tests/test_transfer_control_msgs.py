"""What decode does with a control message (hello, batch header) that is malformed.

Control messages come from whoever connects to decode's UCX port, a hello before anything is
verified. A malformed one is a protocol failure decode names as such: a hello that is not a JSON
object is reported as a bad hello (not counted as a handler error, which the receiver's log calls
a bug of its own); a verified transfer whose batch header is not an object, or names no page,
fails with reason PROTOCOL, which prefill reads in decode's answer and the transfer_failed event
carries. A frame whose length says more than a frame holds is refused rather than parsed short.
Each refusal has a control: the same path with a well-formed message goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from typing import Any

import numpy as np
import pytest
import structlog
import torch
from asyncwait import eventually

from kvfence import transfer
from kvfence.kv.pool import PagePool
from kvfence.transfer import (
    FRAME_BYTES,
    LEN_TAG,
    InboundState,
    KvReceiver,
    TransferError,
    authenticator,
    page_buffer,
    page_tag,
)

# ---- _recv_json on its own: a peer that hands over fixed bytes --------------------------------


class BytesPeer:
    """An endpoint whose peer sent ``head`` on the length tag (at most one frame) and ``body`` on
    the body tag."""

    def __init__(self, head: bytes, body: bytes = b"") -> None:
        assert len(head) <= FRAME_BYTES
        self.head, self.body = head, body

    async def recv(self, buffer: Any, tag: int) -> None:
        raw = self.head if tag == LEN_TAG else self.body
        buffer[: len(raw)] = np.frombuffer(raw, np.uint8)


def framed(data: bytes, n: int | None = None) -> BytesPeer:
    """``data`` sent as one frame whose length field says ``n`` (by default its true length)."""
    return BytesPeer(struct.pack("=q", -(len(data) if n is None else n)) + data)


def two_part(data: bytes) -> BytesPeer:
    """``data`` sent as a length, then a body."""
    return BytesPeer(struct.pack("=q", len(data)), data)


NOT_OBJECTS = ["[]", '[{"reservation_id": "r"}]', '"hello"', "1", "null", "true"]


@pytest.mark.parametrize("form", [framed, two_part], ids=["frame", "two-part"])
@pytest.mark.parametrize("text", NOT_OBJECTS)
async def test_a_control_message_that_is_not_a_json_object_is_refused(form, text) -> None:
    with pytest.raises(TransferError, match="control message is not an object") as err:
        await transfer._recv_json(form(text.encode()))
    assert err.value.reason == "PROTOCOL"
    # control: an object in the same form is taken
    assert await transfer._recv_json(form(b'{"indices": [0]}')) == {"indices": [0]}


@pytest.mark.parametrize("claimed", [FRAME_BYTES - 7, FRAME_BYTES], ids=["max+1", "frame"])
async def test_a_frame_whose_length_says_more_than_a_frame_holds_is_refused(claimed) -> None:
    """A whole frame (FRAME_BYTES) holds a body of at most FRAME_BYTES - 8: one that says more
    cannot be whole, and is refused though the bytes it does hold would parse. Control: the same
    bytes with the largest length a frame can hold are taken."""
    body = b"{}".ljust(FRAME_BYTES - 8)
    with pytest.raises(TransferError, match=f"control message of {-claimed} bytes") as err:
        await transfer._recv_json(framed(body, claimed))
    assert err.value.reason == "PROTOCOL"
    assert await transfer._recv_json(framed(body, FRAME_BYTES - 8)) == {}


# ---- through decode's receiver ---------------------------------------------------------------


def make_pool() -> PagePool:
    return PagePool(4, num_layers=1, page_size=4, num_kv_heads=1, head_dim=8)


async def make_receiver(pool: PagePool) -> tuple[KvReceiver, list]:
    events: list = []
    rx = KvReceiver(pool, host="127.0.0.1", max_batch_bytes=2 * pool.page_bytes,
                    batch_timeout_s=5.0, report=lambda k, p: events.append((k, p)))  # fmt: skip
    await rx.start()
    return rx, events


def hello(rid: str) -> dict[str, Any]:
    """A v4 hello without a batch (decode answers it on its own)."""
    return {"reservation_id": rid, "request_id": rid, "auth": authenticator(b"k" * 32, rid), "v": 4}


async def say(ep: Any, message: Any) -> None:
    """Send any JSON value as a control message in one frame, as a v4 prefill does."""
    await asyncio.wait_for(transfer._send_json(ep, message, frame=True), 5)


async def answer(ep: Any) -> dict[str, Any]:
    return await asyncio.wait_for(transfer._recv_json(ep, reply=True), 5)


async def transfer_one_page(rx: KvReceiver, pool: PagePool, rid: str) -> None:
    """Control: a verified hello, then a well-formed header and its page: complete."""
    import ucxx

    t = rx.expect(rid, rid, b"k" * 32, pool.allocate(1, rid))
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        await say(ep, hello(rid))
        assert (await answer(ep))["ok"]
        await say(ep, {"indices": [0], "last": True})
        source = torch.full(pool.kv.shape[1:], 7.0)
        await ep.send(page_buffer(source), tag=page_tag(rid, 0, 0))
        assert await answer(ep) == {"ok": True, "received": 1, "v": 4}
        assert t.state == InboundState.COMPLETE
        assert torch.equal(pool.kv[t.pages[0].page_id], source)
    finally:
        ep.abort()


@pytest.mark.parametrize("text", ["[]", '"hello"'])
async def test_a_hello_that_is_not_an_object_is_a_bad_hello_not_a_handler_error(text) -> None:
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        with structlog.testing.capture_logs() as logs:
            await say(ep, json.loads(text))
            assert await eventually(lambda: bool(events) or rx.handler_errors > 0, timeout=10)
        assert events == [
            ("transfer_failed", {"reason": "BAD_HELLO", "error": "TransferError",
                                 "stage": "ucx_hello"}),
        ]  # fmt: skip
        assert rx.handler_errors == 0
        assert not [e for e in logs if e["event"] == "UCX connection handler failed"]
        await transfer_one_page(rx, pool, "res-ok")  # control
        assert len(events) == 1
    finally:
        ep.abort()
        await rx.stop()


# Each is answered PROTOCOL, those that are not a JSON object too: decode parses a batch header
# after its receive completed, on a sound endpoint (tests/test_transfer_header_protocol.py has
# more shapes, through the real sender).
MALFORMED_HEADERS = {
    "list": [{"indices": [0], "last": True}],
    "string": "batch",
    "no-page": {"indices": []},
    "no-page-last": {"indices": [], "last": True},
}


@pytest.mark.parametrize("header", MALFORMED_HEADERS.values(), ids=MALFORMED_HEADERS.keys())
async def test_a_verified_transfer_whose_batch_header_is_malformed_fails_as_protocol(
    header,
) -> None:
    """The transfer fails with reason PROTOCOL, reported and answered; with "last", an empty
    batch does not complete the transfer either."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(1, "res-1"))
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        await say(ep, hello("res-1"))
        assert (await answer(ep))["ok"]
        await say(ep, header)
        assert await answer(ep) == {"ok": False, "error": "PROTOCOL"}
        await asyncio.wait_for(t.done.wait(), 5)
        assert (t.state, t.error, t.received) == (InboundState.FAILED, "PROTOCOL", [])
        assert events == [
            ("transfer_failed", {"reason": "PROTOCOL", "reservation_id": "res-1",
                                 "request_id": "req-1"}),
        ]  # fmt: skip
        assert rx.handler_errors == 0
        await transfer_one_page(rx, pool, "res-ok")  # control
        assert len(events) == 1
    finally:
        with contextlib.suppress(Exception):
            ep.abort()
        await rx.stop()
