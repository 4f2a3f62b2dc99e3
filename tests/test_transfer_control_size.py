"""A control message's announced length is bounded before decode allocates or receives its body.

The length arrives first, from whoever connects to decode's UCX port: no hello has been verified
yet. A message sent as a length and a body (``_recv_json``) may be at most ``MAX_CONTROL_BYTES``;
without the bound decode would allocate, and post a receive of, whatever the peer announced.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from asyncwait import eventually

from kvfence import transfer
from kvfence.kv.pool import PagePool
from kvfence.transfer import (
    FRAME_BYTES,
    LEN_TAG,
    MAX_CONTROL_BYTES,
    InboundState,
    KvReceiver,
    TransferError,
    authenticator,
)


class AnnouncingPeer:
    """An endpoint whose peer announces a body of ``n`` bytes, then sends ``{}`` padded with
    spaces to whatever length the body receive asks for. Notes the size of every receive."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.asked: list[tuple[int, int]] = []  # (tag, bytes)

    async def recv(self, buffer: Any, tag: int) -> None:
        self.asked.append((tag, buffer.size))
        if buffer.size > MAX_CONTROL_BYTES:  # filling it could take gigabytes (np.empty is lazy)
            raise AssertionError(f"a receive of {buffer.size} bytes was posted")
        if tag == LEN_TAG:
            buffer[:8] = np.frombuffer(np.int64(self.n).tobytes(), np.uint8)
        else:
            buffer[:] = np.frombuffer(b"{}".ljust(buffer.size), np.uint8)


@pytest.mark.parametrize("n", [MAX_CONTROL_BYTES + 1, 1 << 33], ids=["max+1", "8GiB"])
async def test_an_announced_body_over_the_bound_is_refused_before_any_receive(n: int) -> None:
    peer = AnnouncingPeer(n)
    with pytest.raises(TransferError, match=f"control message of {n} bytes") as err:
        await transfer._recv_json(peer)
    assert err.value.reason == "PROTOCOL"
    assert peer.asked == [(LEN_TAG, FRAME_BYTES)]  # the length's receive only: no body posted


@pytest.mark.parametrize("n", [2, MAX_CONTROL_BYTES], ids=["small", "max"])
async def test_a_body_up_to_the_bound_is_received(n: int) -> None:
    """Control: the same two-part path takes a body of up to MAX_CONTROL_BYTES, the bound itself
    included."""
    peer = AnnouncingPeer(n)
    assert await transfer._recv_json(peer) == {}
    assert peer.asked == [(LEN_TAG, FRAME_BYTES), (transfer.BODY_TAG, n)]


def make_pool() -> PagePool:
    return PagePool(4, num_layers=1, page_size=4, num_kv_heads=1, head_dim=8)


async def test_decode_refuses_an_unverified_peer_announcing_an_oversized_hello(monkeypatch):
    """Through decode's receiver: a peer that has said nothing verified announces a hello body
    of MAX_CONTROL_BYTES + 1. Decode refuses it at once (batch_timeout_s is far longer than the
    wait), reports a bad hello and posts no receive larger than a frame. Control: a hello of the
    same form (length, then body) within the bound is answered."""
    import ucxx

    posted: list[int] = []
    recv = transfer._recv

    def recording(ep: Any, buffer: Any, *, tag: int) -> Any:
        if tag in (LEN_TAG, transfer.BODY_TAG):  # decode's side (the test's own are replies)
            posted.append(buffer.size)
        return recv(ep, buffer, tag=tag)

    monkeypatch.setattr(transfer, "_recv", recording)
    pool = make_pool()
    events: list = []
    rx = KvReceiver(pool, host="127.0.0.1", max_batch_bytes=2 * pool.page_bytes,
                    batch_timeout_s=60.0, report=lambda k, p: events.append((k, p)))  # fmt: skip
    await rx.start()
    eps = []
    try:
        eps.append(await ucxx.create_endpoint("127.0.0.1", rx.port))
        await eps[-1].send(np.array([MAX_CONTROL_BYTES + 1], dtype=np.int64), tag=LEN_TAG)
        assert await eventually(lambda: bool(events), timeout=10), "no refusal reported"
        assert events == [
            ("transfer_failed", {"reason": "BAD_HELLO", "error": "TransferError",
                                 "stage": "ucx_hello"}),
        ]  # fmt: skip
        assert max(posted) <= FRAME_BYTES, posted

        # Control: a hello in the same two-part form, within the bound, is read and answered.
        refs = pool.allocate(1, "res-1")
        assert refs is not None
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        hello = {"reservation_id": "res-1", "request_id": "req-1",
                 "auth": authenticator(b"k" * 32, "res-1")}  # fmt: skip
        body = json.dumps(hello).encode()
        eps.append(await ucxx.create_endpoint("127.0.0.1", rx.port))
        await eps[-1].send(np.array([len(body)], dtype=np.int64), tag=LEN_TAG)
        await eps[-1].send(np.frombuffer(body, dtype=np.uint8), tag=transfer.BODY_TAG)
        answer = await asyncio.wait_for(transfer._recv_json(eps[-1], reply=True), 10)
        assert answer["ok"], answer
        assert len(body) in posted and t.state == InboundState.RECEIVING  # the hello passed
        assert len(events) == 1  # nothing more reported
    finally:
        for ep in eps:
            ep.abort()
        await rx.stop()
