"""The UCX side of a transfer that decode stops while receiving it (``KvReceiver.cancel``).

1. Cancelled because its request ended (``request_ended``), a transfer still receiving is no
   longer aborted: decode answers ``{ok: false, error: RESERVATION_RELEASED, request_ended:
   true}``, after the receives it had posted settled, and ``send_pages`` raises a refusal with
   ``request_ended`` set. Control: a plain cancel (a release for trouble) still aborts; the
   sender reads a lost connection, not a refusal. A sender that predates frames and the key (a
   hello without ``v``) reads the same refusal as an ordinary two-message answer.
2. A UCX error while decode reads a batch header, or sends a hello's answer, failed the transfer
   with the exception's class name as its reason (``UCXXCanceledError``...), where a UCX error on
   the page receives says TRANSFER_FAILED: now all of them say TRANSFER_FAILED (the class name
   goes to the event's ``error``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asyncwait import eventually
from test_transfer import make_pool, make_receiver, make_source, send

from kvfence import transfer as tr
from kvfence.errors import RESERVATION_RELEASED
from kvfence.kv.pool import PageState
from kvfence.transfer import (
    InboundState,
    TransferError,
    _expect_ok,
    _recv_json,
    _send_json,
    _within,
    authenticator,
)


class SendGate:
    """Holds ``send_pages`` before its first batch header (``"header"``: decode awaits it) or
    right after it (``"pages"``: decode has posted the batch's receives into the pages)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
        self.gate = asyncio.Event()
        self.held = asyncio.Event()
        real_json, real_batch = tr._send_json, tr._send_batch

        async def send_json(ep: Any, obj: dict[str, Any], **kw: Any) -> None:
            if stage == "header" and "indices" in obj and not self.held.is_set():
                self.held.set()
                await self.gate.wait()
            await real_json(ep, obj, **kw)

        async def send_batch(*args: Any) -> None:
            if stage == "pages" and not self.held.is_set():
                self.held.set()
                await self.gate.wait()
            await real_batch(*args)

        monkeypatch.setattr(tr, "_send_json", send_json)
        monkeypatch.setattr(tr, "_send_batch", send_batch)


@pytest.mark.parametrize("stage", ["header", "pages"])
@pytest.mark.parametrize("request_ended", [True, False], ids=["ended", "control"])
async def test_a_transfer_cancelled_for_its_requests_end_is_refused_saying_so(
    monkeypatch: pytest.MonkeyPatch, stage: str, request_ended: bool
) -> None:
    """Decode cancels a transfer it is receiving (2 batches of 2 pages: the first batch's header
    awaited, or its receives posted) and releases it. ``ended``: the sender gets the refusal,
    ``request_ended`` set; the receives posted settle first, their pages QUARANTINED meanwhile,
    and the pages behind a header refused after the cancel are drained. ``control``: aborted,
    the sender reads no refusal. Decode reports neither."""
    gate = SendGate(monkeypatch, stage)
    pool = make_pool()
    rx, events = await make_receiver(pool)
    try:
        refs = pool.allocate(4, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        sending = asyncio.ensure_future(send(rx, t, make_source(pool, 4)))
        await asyncio.wait_for(gate.held.wait(), 5)
        posted = 2 if stage == "pages" else 0
        assert await eventually(
            lambda: t.state == InboundState.RECEIVING and pool.outstanding_ops("res-1") == posted
        )
        rx.cancel("res-1", request_ended=request_ended)
        pool.release("res-1")
        rx.forget("res-1", request_ended=request_ended, tenant_id="t-1")
        if request_ended and stage == "pages":
            await asyncio.sleep(0.05)  # not aborted: the receives stay posted, the pages held
            assert pool.outstanding_ops("res-1") == 2
            assert all(pool.state_of(r.page_id) == PageState.QUARANTINED for r in refs[:2])
            assert pool.num_free == pool.num_pages - 2
        gate.gate.set()
        with pytest.raises(TransferError) as err:
            await asyncio.wait_for(sending, 10)
        if request_ended:
            assert (err.value.reason, err.value.refused, err.value.request_ended) == (
                RESERVATION_RELEASED,
                True,
                True,
            )
            # the header refused after the cancel: its 2 pages drained, none received
            drained = 2 if stage == "header" else 0
            assert await eventually(lambda: rx.strays_drained == drained)
            assert rx.strays_posted == drained
        else:
            assert not err.value.refused and not err.value.request_ended
            assert err.value.reason == "TRANSFER_FAILED"
        assert t.state == InboundState.CANCELLED
        assert await eventually(lambda: pool.num_free == pool.num_pages)
        assert all(pool.generation(r.page_id) > r.generation for r in refs)
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert events == []
        pool.check_integrity()
    finally:
        gate.gate.set()
        await rx.stop()


@pytest.mark.parametrize("header", ["too-large", "outside", "duplicate", "sound"])
@pytest.mark.parametrize("released", [True, False], ids=["released", "control"])
async def test_a_header_after_a_request_ended_release_is_refused_as_released_not_judged(
    monkeypatch: pytest.MonkeyPatch, header: str, released: bool
) -> None:
    """Released for its request's end while decode awaits a batch header, the endpoint stays
    open, so decode reads that header. Its own checks (over decode's max_batch_bytes, mid-rollout;
    an index outside the reservation; a duplicate index) used to run first and fail the transfer
    with an answer of ``cancelled`` that prefill reported, an integrity reason dropped on decode:
    now any such header is refused RESERVATION_RELEASED with ``request_ended``, as an abort left
    it unread, and its pages are drained. Control (not released): each header gets its own
    reason from decode and is reported; the sound one completes."""
    gate = SendGate(monkeypatch, "header")
    pool = make_pool()
    rx, events = await make_receiver(pool)  # decode's max_batch_bytes: 2 pages
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        kw: dict[str, Any] = {}
        if header == "too-large":
            rx.max_batch_bytes = pool.page_bytes  # prefill's are larger (2 pages)
        elif header == "outside":
            kw = {"indices": [0, 5]}
        elif header == "duplicate":
            kw = {"indices": [1, 1]}
        sending = asyncio.ensure_future(send(rx, t, make_source(pool, 2), **kw))
        await asyncio.wait_for(gate.held.wait(), 5)
        assert await eventually(lambda: t.state == InboundState.RECEIVING)
        if released:
            rx.cancel("res-1", request_ended=True)
            pool.release("res-1")
            rx.forget("res-1", request_ended=True, tenant_id="t-1")
        gate.gate.set()
        if not released and header == "sound":
            await asyncio.wait_for(sending, 10)
            assert t.state == InboundState.COMPLETE and sorted(t.received) == [0, 1]
            assert events == []
            return
        with pytest.raises(TransferError) as err:
            await asyncio.wait_for(sending, 10)
        got = (err.value.reason, err.value.refused, err.value.request_ended)
        if released:
            assert got == (RESERVATION_RELEASED, True, True)
            assert events == []
            assert await eventually(lambda: rx.strays_drained == 2)
            assert await eventually(lambda: pool.num_free == pool.num_pages)
        else:
            reason = {"too-large": "BATCH_TOO_LARGE", "outside": "COVERAGE"}
            assert got == (reason.get(header, "DUPLICATE_PAGE"), True, False)
            assert [(k, p["reason"]) for k, p in events] == [("transfer_failed", got[0])]
        pool.check_integrity()
    finally:
        gate.gate.set()
        await rx.stop()


async def test_a_sender_before_frames_reads_the_refusal_as_a_plain_answer() -> None:
    """A prefill that says no ``v`` in its hello (before v4: no frames, no ``request_ended``)
    reads the refusal in the two-message form and fails cleanly on its error."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    refs = pool.allocate(2, "res-1")
    t = rx.expect("res-1", "req-1", b"k" * 32, refs)
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        hello = {"reservation_id": "res-1", "request_id": "req-1"}
        await _send_json(ep, {**hello, "auth": authenticator(b"k" * 32, "res-1")})
        await _expect_ok(ep, 5)
        assert t.state == InboundState.RECEIVING
        rx.cancel("res-1", request_ended=True)
        pool.release("res-1")
        rx.forget("res-1", request_ended=True)
        await _send_json(ep, {"indices": [0, 1]})
        [answer] = await _within(ep, [_recv_json(ep, reply=True)], 5)
        assert answer == {"ok": False, "error": RESERVATION_RELEASED, "request_ended": True}
        assert events == []
    finally:
        ep.abort()
        await rx.stop()
    assert pool.num_free == pool.num_pages
    pool.check_integrity()


@pytest.mark.parametrize("where", ["header", "answer", "pages"])
async def test_a_ucx_error_mid_transfer_fails_it_transfer_failed(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The sender goes away while decode awaits a batch header (``header``: the send cancelled
    before it), or decode's answer to a hello fails in UCX (``answer``): the transfer failed
    ``TRANSFER_FAILED``, the UCX exception's class named only in the event's ``error``. Control
    (``pages``): the sender goes away with a batch's receives posted, which already said
    TRANSFER_FAILED."""
    import ucxx.exceptions

    stage = "pages" if where == "pages" else "header"
    gate = SendGate(monkeypatch, stage)
    pool = make_pool()
    rx, events = await make_receiver(pool)
    if where == "answer":
        real_answer = rx._answer

        async def failing_answer(ep: Any, answer: dict[str, Any], frame: bool) -> None:
            if answer == {"ok": True}:  # the cold hello's answer
                raise ucxx.exceptions.UCXConnectionResetError("Connection reset by remote peer")
            await real_answer(ep, answer, frame)

        monkeypatch.setattr(rx, "_answer", failing_answer)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        sending = asyncio.ensure_future(send(rx, t, make_source(pool, 2), batch_timeout_s=2.0))
        if where == "answer":
            with pytest.raises(TransferError):
                await asyncio.wait_for(sending, 10)
        else:
            await asyncio.wait_for(gate.held.wait(), 5)
            posted = 2 if stage == "pages" else 0
            assert await eventually(
                lambda: (
                    t.state == InboundState.RECEIVING and pool.outstanding_ops("res-1") == posted
                )
            )
            sending.cancel()  # settles its operations and aborts its endpoint
            with pytest.raises(asyncio.CancelledError):
                await sending
        assert await eventually(lambda: t.state == InboundState.FAILED)
        assert await eventually(lambda: len(events) == 1)
        [(kind, payload)] = events
        assert (kind, payload["reason"], t.error) == (
            "transfer_failed",
            "TRANSFER_FAILED",
            "TRANSFER_FAILED",
        )
        if where == "pages":
            assert "error" not in payload  # a TransferError's reason says it all
        else:
            assert payload["error"].startswith("UCX"), payload
        assert await eventually(lambda: pool.outstanding_ops("res-1") == 0)
        pool.release("res-1")
        assert pool.num_free == pool.num_pages
        pool.check_integrity()
    finally:
        gate.gate.set()
        await rx.stop()
