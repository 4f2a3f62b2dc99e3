"""A malformed batch header after a verified hello is answered PROTOCOL, warm endpoint or fresh.

Decode refused a header object without indices with the answer {ok: false, error: PROTOCOL}, and
prefill failed the transfer with that reason; so it did a warm hello's batch 0 that was not an
object. But a BATCH message (batch 0 on a fresh endpoint, any later batch) that was not a JSON
object (a list, a number, a string, null) or not JSON at all, or whose length no control message
may have, failed inside the receive, which aborted the endpoint before decode answered: prefill
read only a lost connection (``UCXXCanceledError``, reason TRANSFER_FAILED), and one that was not
JSON failed the transfer with the parser's exception name as its reason. Each malformed header
now gets the same PROTOCOL answer and leaves the reservation as the header without indices did; a
well-formed header on the same path completes (the control). An unverified peer is still answered
nothing more than before: a malformed hello gets no answer.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
import pytest
import torch
from asyncwait import eventually
from test_transfer import holds, make_pool, make_receiver, make_source, send, warm_setup
from test_transfer_control_msgs import answer, hello, say

from kvfence import transfer
from kvfence.kv.pool import PagePool, PageState
from kvfence.transfer import (
    FRAME_BYTES,
    LEN_TAG,
    MAX_CONTROL_BYTES,
    EndpointPool,
    InboundState,
    InboundTransfer,
    KvReceiver,
    TransferError,
    page_buffer,
    page_tag,
)

PROTOCOL_ANSWER = {"ok": False, "error": "PROTOCOL"}
PROTOCOL_EVENT = (
    "transfer_failed",
    {"reason": "PROTOCOL", "reservation_id": "res-1", "request_id": "req-1"},
)

# Headers a sender may put where a batch header goes. "no-indices" and "indices-not-list" are
# the PROTOCOL cases decode already answered: the reference the others must now match.
MALFORMED = {
    "list": [{"indices": [0], "last": True}],
    "number": 7,
    "string": "batch",
    "null": None,
    "no-indices": {"last": True},
    "indices-not-list": {"indices": 0, "last": True},
}
WELL_FORMED = "well-formed"  # the control: the header the sender would have sent


def sender_cases() -> list[Any]:
    cases = []
    for opening in ("warm", "fresh"):
        for batch in (0, 1):
            for name in [*MALFORMED, WELL_FORMED]:
                # warm-b0-null is a warm hello whose "batch" is null: malformed like the others,
                # not a cold hello (decode took it for one, and answered it on its own).
                cases.append(pytest.param(opening, batch, name, id=f"{opening}-b{batch}-{name}"))
    return cases


def fate(pool: PagePool, t: InboundTransfer) -> tuple[Any, ...]:
    """What a failed transfer leaves of its reservation: decode's state of it, the outstanding
    operations and page states in the pool, and the pages a release frees at once (a page
    with an operation outstanding would stay QUARANTINED instead)."""
    pids = [r.page_id for r in t.pages]
    states = [pool.state_of(pid) for pid in pids]
    ops = pool.outstanding_ops(t.reservation_id)
    freed = sorted(pool.release(t.reservation_id))
    return (t.state, t.error, t.received, ops, states, freed == sorted(pids))


def expected_fate(batch: int) -> tuple[Any, ...]:
    """What the PROTOCOL refusal of batch ``batch`` of two one-page batches leaves: the batches
    before it received, no operation outstanding, every page freed by the release."""
    return (InboundState.FAILED, "PROTOCOL", list(range(batch)), 0, [PageState.RECEIVING] * 2, True)


@pytest.mark.parametrize(("opening", "batch", "name"), sender_cases())
async def test_a_malformed_batch_header_from_prefill_is_answered_protocol(
    monkeypatch, opening, batch, name
) -> None:
    """Through send_pages, two one-page batches, batch ``batch``'s header replaced. On a warm
    (pooled, v4) endpoint batch 0 travels in the hello and batch 1 as a BATCH message; on a fresh
    endpoint both are BATCH messages. Prefill's error is decode's answer (``refused``, reason
    PROTOCOL), not a lost connection."""
    pool, rx, events, eps = await warm_setup()
    if opening == "fresh":
        await eps.close()
        eps = EndpointPool()
    real_header = transfer._batch_header

    def header(batches, k, version):
        good = real_header(batches, k, version)
        return good if name == WELL_FORMED or k != batch else MALFORMED[name]

    monkeypatch.setattr(transfer, "_batch_header", header)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        sources = make_source(pool, 2, fill=4.0)
        if name == WELL_FORMED:
            await send(rx, t, sources, endpoints=eps, max_batch_bytes=pool.page_bytes)
            assert t.state == InboundState.COMPLETE and sorted(t.received) == [0, 1]
            assert holds(pool, refs, sources) and events == [] and rx.handler_errors == 0
            assert eps.idle("127.0.0.1", rx.port) == 1 and eps.discarded == 0
            return
        with pytest.raises(TransferError) as err:
            await send(rx, t, sources, endpoints=eps, max_batch_bytes=pool.page_bytes)
        assert (err.value.reason, str(err.value)) == ("PROTOCOL", "decode refused: PROTOCOL")
        assert err.value.refused and not err.value.timeout
        await asyncio.wait_for(t.done.wait(), 5)
        # the batch before the malformed header landed; nothing of it or after it did
        assert holds(pool, refs[:batch], sources[:batch])
        assert all(pool.kv[r.page_id].abs().sum() == 0 for r in refs[batch:])
        assert fate(pool, t) == expected_fate(batch)
        assert events == [PROTOCOL_EVENT] and rx.handler_errors == 0
        # the endpoint ended on both sides, as after any refused batch
        assert eps.discarded == 1 and eps.open_endpoints == 0
        assert await eventually(lambda: rx.open_endpoints == 0)
    finally:
        await eps.close()
        await rx.stop()


def frame(body: bytes, n: int | None = None) -> bytes:
    """``body`` as one frame whose length field says ``n`` (by default its true length)."""
    return struct.pack("=q", -(len(body) if n is None else n)) + body


# The bytes of a header no JSON object can be read from, each sent as one message on the length
# tag, the way a v4 sender sends a header (decode posts no other receive for them).
UNPARSABLE = {
    "not-json": frame(b"{indices: [0], last: true}"),
    "not-utf8": frame(b'{"indices": [0], "last": true, "x": "\xff"}'),
    "nested-too-deep": frame(b"[" * 2000 + b"]" * 2000),
    "length-zero": struct.pack("=q", 0),
    "frame-longer-than-a-frame": frame(b"{}".ljust(FRAME_BYTES - 8), FRAME_BYTES - 7),
    "length-over-bound": struct.pack("=q", MAX_CONTROL_BYTES + 1),
    # one message longer than a frame: UCX fills decode's frame and fails the receive truncated
    "message-longer-than-a-frame": frame(b"{}".ljust(FRAME_BYTES - 7)),
    "message-of-4-MiB": frame(b"{}".ljust(4 << 20)),
}
GOOD_BYTES = frame(b'{"indices": [1], "last": true}')  # the control


async def verified_transfer(rx: KvReceiver, pool: PagePool, opening: str) -> tuple[Any, Any]:
    """A raw endpoint on which decode verified the hello of reservation "res-1" (two pages);
    "warm": the hello carried batch 0 (page 0, received), "cold": it carried none. The next
    header is batch 1's on both."""
    import ucxx

    t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(2, "res-1"))
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    if opening == "warm":
        await say(ep, {**hello("res-1"), "batch": {"indices": [0]}})
        await ep.send(page_buffer(torch.full(pool.kv.shape[1:], 2.0)), tag=page_tag("res-1", 0, 0))
        assert await answer(ep) == {"ok": True, "v": 4}
        assert t.received == [0]
    else:
        await say(ep, hello("res-1"))
        assert await answer(ep) == {"ok": True, "v": 4}
        await say(ep, {"indices": [0]})
        await ep.send(page_buffer(torch.full(pool.kv.shape[1:], 2.0)), tag=page_tag("res-1", 0, 0))
        assert await answer(ep) == {"ok": True, "v": 4}
    return t, ep


@pytest.mark.parametrize("opening", ["warm", "cold"])
@pytest.mark.parametrize("name", [*UNPARSABLE, WELL_FORMED])
async def test_a_batch_header_that_cannot_be_parsed_is_answered_protocol(opening, name) -> None:
    """Bytes that are no JSON object (or a length no control message has) where a verified
    transfer's next header goes: the same PROTOCOL answer, reason and fate as a header without
    indices, not the parser's exception name and an aborted endpoint."""
    pool = make_pool()
    rx, events = await make_receiver(pool)
    ep = None
    try:
        t, ep = await verified_transfer(rx, pool, opening)
        raw = GOOD_BYTES if name == WELL_FORMED else UNPARSABLE[name]
        await ep.send(np.frombuffer(raw, np.uint8), tag=LEN_TAG)
        if name == WELL_FORMED:
            source = torch.full(pool.kv.shape[1:], 3.0)
            await ep.send(page_buffer(source), tag=page_tag("res-1", 1, 0))
            assert await answer(ep) == {"ok": True, "received": 2, "v": 4}
            assert t.state == InboundState.COMPLETE and torch.equal(
                pool.kv[t.pages[1].page_id], source
            )
            assert events == [] and rx.handler_errors == 0
            return
        assert await answer(ep) == PROTOCOL_ANSWER
        await asyncio.wait_for(t.done.wait(), 5)
        assert fate(pool, t) == expected_fate(1)
        assert events == [PROTOCOL_EVENT] and rx.handler_errors == 0
    finally:
        if ep is not None:
            ep.abort()
        await rx.stop()


@pytest.mark.parametrize("name", ["message-of-4-MiB", WELL_FORMED])
async def test_a_header_longer_than_a_frame_is_answered_without_reading_it(monkeypatch, name):
    """A verified transfer's next header is one message of 4 MiB on the length tag: decode
    answers PROTOCOL having posted one receive of a frame for it, nothing larger. Control: a
    well-formed header on the same path takes the same one receive, and is answered ok."""
    posted: list[int] = []
    recv = transfer._recv

    def recording(ep: Any, buffer: Any, *, tag: int) -> Any:
        if tag in (LEN_TAG, transfer.BODY_TAG):  # decode's side (the test's own are replies)
            posted.append(buffer.size)
        return recv(ep, buffer, tag=tag)

    monkeypatch.setattr(transfer, "_recv", recording)
    pool = make_pool()
    rx, events = await make_receiver(pool)
    ep = None
    try:
        _, ep = await verified_transfer(rx, pool, "cold")
        posted.clear()
        if name == WELL_FORMED:
            await ep.send(np.frombuffer(GOOD_BYTES, np.uint8), tag=LEN_TAG)
            await ep.send(page_buffer(torch.full(pool.kv.shape[1:], 3.0)),
                          tag=page_tag("res-1", 1, 0))  # fmt: skip
            assert await answer(ep) == {"ok": True, "received": 2, "v": 4}
            assert events == []
        else:
            await ep.send(np.frombuffer(UNPARSABLE[name], np.uint8), tag=LEN_TAG)
            assert await answer(ep) == PROTOCOL_ANSWER
            assert events == [PROTOCOL_EVENT] and rx.handler_errors == 0
        # the header's one frame; then, after the answer, at most decode's wait for a next hello
        assert posted[0] == FRAME_BYTES and max(posted) == FRAME_BYTES, posted
    finally:
        if ep is not None:
            ep.abort()
        await rx.stop()


@pytest.mark.parametrize("batch", ["null", "control-cold", "control-warm"])
async def test_a_warm_hello_whose_batch_is_null_is_answered_protocol(batch: str) -> None:
    """A hello with "batch": null (kvfence's sender never sends one: a cold hello has no such
    key, a warm one a header object) is a warm hello whose header is malformed: verified, then
    refused PROTOCOL with the fate of a header without indices. Decode took it for a cold hello
    and answered {ok}, while a sender that sent it waits for batch 0's answer. Controls: the same
    hello without the key is answered on its own; with a header object its batch is received."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    ep = None
    try:
        if batch != "null":
            t, ep = await verified_transfer(rx, pool, batch.removeprefix("control-"))
            assert t.state == InboundState.RECEIVING and t.received == [0]
            assert rx.warm_hellos == (1 if batch == "control-warm" else 0) and events == []
            return
        t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(2, "res-1"))
        ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
        await say(ep, {**hello("res-1"), "batch": None})
        assert await answer(ep) == PROTOCOL_ANSWER
        await asyncio.wait_for(t.done.wait(), 5)
        assert fate(pool, t) == expected_fate(0)
        assert events == [PROTOCOL_EVENT] and rx.handler_errors == 0 and rx.warm_hellos == 1
    finally:
        if ep is not None:
            ep.abort()
        await rx.stop()


# ---- an unverified peer gets no more answers than before ----------------------------------------

BAD_HELLOS = {
    "not-json": frame(b"{reservation_id: res-1}"),
    "not-an-object": frame(b'["res-1"]'),
    "length-zero": struct.pack("=q", 0),
    # was reported PEER_GONE (the truncated receive read as a lost peer), though the peer is there
    "longer-than-a-frame": frame(b"{}".ljust(FRAME_BYTES - 7)),
}


@pytest.mark.parametrize("name", [*BAD_HELLOS, WELL_FORMED])
async def test_a_malformed_hello_is_still_answered_nothing(name) -> None:
    """A malformed hello is no verified one: decode reports BAD_HELLO, answers nothing and ends
    the endpoint, as before. Control: the well-formed hello on a fresh endpoint is answered."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(1, "res-1"))
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        if name == WELL_FORMED:
            await say(ep, hello("res-1"))
            assert await answer(ep) == {"ok": True, "v": 4} and rx.answers == 1
            assert t.state == InboundState.RECEIVING
            return
        await ep.send(np.frombuffer(BAD_HELLOS[name], np.uint8), tag=LEN_TAG)
        assert await eventually(lambda: bool(events) and rx.open_endpoints == 0, timeout=10)
        assert [(kind, p["reason"]) for kind, p in events] == [("transfer_failed", "BAD_HELLO")]
        assert rx.answers == 0 and rx.handler_errors == 0
        assert t.state == InboundState.EXPECTING
    finally:
        ep.abort()
        await rx.stop()


@pytest.mark.parametrize("says", ["nothing", "a malformed hello"])
async def test_a_peer_gone_before_its_hello_is_peer_gone_not_bad_hello(says: str) -> None:
    """A connection that ends before any hello (a prefill process killed mid-connection) is
    reported PEER_GONE: BAD_HELLO would read as a forged or malformed hello. Control: the same
    connection ended right after a malformed hello is still BAD_HELLO."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        if says != "nothing":
            await ep.send(np.frombuffer(BAD_HELLOS["not-an-object"], np.uint8), tag=LEN_TAG)
            assert await eventually(lambda: bool(events), timeout=10)
        assert await eventually(lambda: rx.open_endpoints == 1 or bool(events), timeout=10)
        await ep.close()
        assert await eventually(lambda: bool(events) and rx.open_endpoints == 0, timeout=10)
        reason = "PEER_GONE" if says == "nothing" else "BAD_HELLO"
        assert [(kind, p["reason"], p["stage"]) for kind, p in events] == [
            ("transfer_failed", reason, "ucx_hello")
        ]
        assert rx.answers == 0 and rx.handler_errors == 0
    finally:
        ep.abort()
        await rx.stop()
