"""The UCX data path against a real pool: pages land only in reserved buffers, errors settle ops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import types

import pytest
import structlog
import torch
from asyncwait import eventually

from kvfence.kv.pool import PagePool, PageState
from kvfence.transfer import (
    FRAME_BYTES,
    INTEGRITY_REASONS,
    PROTOCOL_VERSION,
    EndpointPool,
    InboundState,
    InboundTransfer,
    KvReceiver,
    OutboundPage,
    TransferError,
    _recv_json,
    _send_json,
    _within,
    bind_host_of,
    page_buffer,
    page_tag,
    send_pages,
)


def make_pool(pages: int = 8) -> PagePool:
    return PagePool(pages, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)


def make_source(pool: PagePool, n: int, fill: float = 1.0) -> list[torch.Tensor]:
    return [torch.full(pool.kv.shape[1:], fill + i) for i in range(n)]


async def send_batch_of_a(ep, pool: PagePool) -> tuple[list[torch.Tensor], list]:
    """What a prefill node sends for reservation "A" (key ``b"k" * 32``, request "reqA") over
    ``ep``: the hello, once it is answered the batch header (pages 0 and 1, the last batch), then
    both pages right behind it, without waiting for decode. The pages' sources and the sends."""
    from kvfence.transfer import _expect_ok, authenticator

    hello = {"reservation_id": "A", "request_id": "reqA", "auth": authenticator(b"k" * 32, "A")}
    await _send_json(ep, hello)
    await _expect_ok(ep, 5)
    await _send_json(ep, {"indices": [0, 1], "last": True})
    sources = make_source(pool, 2, fill=1.0)
    sends = [
        asyncio.ensure_future(ep.send(page_buffer(s), tag=page_tag("A", 0, k, PROTOCOL_VERSION)))
        for k, s in enumerate(sources)
    ]
    return sources, sends


RECEIVER_ONLY = ("bind_host", "max_unverified", "on_reject")  # KvReceiver options ``send`` ignores


async def make_receiver(pool: PagePool, **kw) -> tuple[KvReceiver, list]:
    events: list = []
    rx = KvReceiver(
        pool,
        host="127.0.0.1",
        max_batch_bytes=kw.get("max_batch_bytes", 2 * pool.page_bytes),
        batch_timeout_s=kw.get("batch_timeout_s", 5.0),
        report=lambda kind, payload: events.append((kind, payload)),
        **{k: kw[k] for k in RECEIVER_ONLY if k in kw},
    )
    await rx.start()
    return rx, events


async def send(rx, t, sources, *, indices=None, secret=None, **kw):
    pool_bytes = sources[0].numel() * sources[0].element_size()
    pages = [
        OutboundPage(i, page_buffer(sources[j]))
        for j, i in enumerate(indices if indices is not None else range(len(sources)))
    ]
    return await send_pages(
        rx.address,
        reservation_id=t.reservation_id,
        request_id=t.request_id,
        secret=secret if secret is not None else t.secret,
        pages=pages,
        page_bytes=pool_bytes,
        max_batch_bytes=kw.get("max_batch_bytes", 2 * pool_bytes),
        batch_timeout_s=kw.get("batch_timeout_s", 5.0),
        endpoints=kw.get("endpoints"),
    )


async def test_pages_land_in_reserved_buffers_in_batches():
    pool = make_pool()
    rx, events = await make_receiver(pool)
    try:
        refs = pool.allocate(5, "res-1")
        t = rx.expect("res-1", "req-1", b"s" * 32, refs[:3])
        sources = make_source(pool, 3, fill=10.0)
        await send(rx, t, sources)
        await asyncio.wait_for(t.done.wait(), 5)
        assert t.state == InboundState.COMPLETE
        assert sorted(t.received) == [0, 1, 2]
        for i, ref in enumerate(refs[:3]):
            assert torch.equal(pool.kv[ref.page_id], sources[i])
        # pages not named by the transfer were not touched
        assert pool.kv[refs[3].page_id].abs().sum() == 0
        assert pool.state_of(refs[0].page_id) == PageState.RECEIVING
        assert events == []
        pool.check_integrity()
    finally:
        await rx.stop()


async def test_bad_authenticator_is_dropped_and_reported_with_control():
    pool = make_pool()
    rx, events = await make_receiver(pool)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        with pytest.raises(TransferError) as err:
            await send(rx, t, make_source(pool, 2), secret=b"x" * 32)
        assert err.value.reason == "BAD_AUTHENTICATOR"
        assert pool.kv[refs[0].page_id].abs().sum() == 0
        assert events[0][1]["check"] == "BAD_AUTHENTICATOR"
        assert t.state == InboundState.EXPECTING
        # control: the right secret on the same reservation goes through
        await send(rx, t, make_source(pool, 2))
        assert t.state == InboundState.COMPLETE
        # a second transfer into the same reservation is a replay
        with pytest.raises(TransferError) as err:
            await send(rx, t, make_source(pool, 2))
        assert err.value.reason == "REPLAY"
    finally:
        await rx.stop()


@pytest.mark.parametrize(
    "auth", ["0" * 64, "\u00e9" * 64, "\ud800"], ids=["ascii", "non-ascii", "surrogate"]
)
async def test_a_forged_authenticator_of_any_characters_is_refused_and_reported(auth):
    """A hello naming a live reservation (its id travels in the clear) with a non-ASCII
    authenticator made compare_digest raise TypeError: no answer, no integrity_violation event,
    the handler's exception loose in ucxx. Control: an ASCII one is refused and reported alike."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
        try:
            hello = {"reservation_id": "res-1", "request_id": "req-1", "auth": auth, "v": 4}
            await _send_json(ep, hello)
            [reply] = await _within(ep, [_recv_json(ep, reply=True)], 5)
        finally:
            ep.abort()
        assert reply == {"ok": False, "error": "BAD_AUTHENTICATOR"}
        assert await eventually(lambda: len(events) == 1)
        assert events[0][1]["check"] == "BAD_AUTHENTICATOR"
        assert t.state == InboundState.EXPECTING
        await send(rx, t, make_source(pool, 2))  # the reservation still takes its transfer
        assert t.state == InboundState.COMPLETE
    finally:
        await rx.stop()


@pytest.mark.parametrize("abort_takes", [True, False], ids=["abort", "abort-fails"])
@pytest.mark.parametrize("release", [True, False], ids=["released", "control"])
async def test_a_reservation_released_while_its_batch_header_arrives_gets_no_receive(
    abort_takes, release
):
    """Decode's Release (cancel, free, forget) can run between a batch header arriving and the
    handler posting that batch's receives, and a Reserve can take the pages at once. The
    receives were then posted into the new owner's pages: only the endpoint's abort (inside
    ucxx) kept the old transfer's bytes out; with an abort that did not take effect, they
    landed there and the transfer read COMPLETE. The handler now checks, before posting, that
    the reservation still receives and owns its pages. Control: not released, the same batch
    lands."""
    import ucxx

    pool = make_pool(pages=2)
    rx, events = await make_receiver(pool, max_batch_bytes=4 * pool.page_bytes)
    refs = pool.allocate(2, "A")
    t = rx.expect("A", "reqA", b"k" * 32, refs)
    real = rx._receive_pages
    other: list = []

    async def release_first(ep, tr, batch, indices):
        if release:  # what decode's Release, then another request's Reserve, do in the window
            if not abort_takes:
                tr.ep = None  # an abort that does not happen (cancel() suppresses its errors)
            rx.cancel("A")
            pool.release("A")
            rx.forget("A")
            other.extend(pool.allocate(2, "B"))
            for r in other:
                pool.kv[r.page_id].fill_(7.0)  # B's own KV
        return await real(ep, tr, batch, indices)

    rx._receive_pages = release_first
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        sources, sends = await send_batch_of_a(ep, pool)
        await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5)
        await asyncio.wait_for(t.done.wait(), 5)
        await asyncio.sleep(0.2)  # anything still to land
        if release:
            assert t.state == InboundState.CANCELLED
            assert all(float(pool.kv[r.page_id].flatten()[0]) == 7.0 for r in other)
            assert pool.outstanding_ops("B") == 0
            assert "integrity_violation" not in [k for k, _ in events]  # a release, not forged
        else:
            assert t.state == InboundState.COMPLETE
            assert all(torch.equal(pool.kv[r.page_id], sources[i]) for i, r in enumerate(refs))
    finally:
        ep.abort()
        await rx.stop()


@pytest.mark.parametrize("window", ["reallocated", "cancelled", "control"])
async def test_a_batch_gets_no_receive_unless_its_reservation_both_receives_and_owns_its_pages(
    window,
):
    """The check before a batch's receives are posted has two halves, each needed on its own.
    ``reallocated``: the reservation's pages were given back and taken by another owner while
    the transfer still reads RECEIVING (nothing cancelled it): ownership alone tells, and a
    receive posted would overwrite B's KV. ``cancelled``: the transfer was cancelled (its abort
    not taking effect) while its pages are still the reservation's: the state alone tells, and
    a receive posted would write into pages being given back. Either way the batch is refused
    before anything is posted. Control: neither, the same batch lands."""
    import ucxx

    pool = make_pool(pages=2)
    rx, events = await make_receiver(pool, max_batch_bytes=4 * pool.page_bytes)
    refs = pool.allocate(2, "A")
    t = rx.expect("A", "reqA", b"k" * 32, refs)
    real = rx._receive_pages
    other: list = []

    async def in_the_window(ep, tr, batch, indices):
        if window == "reallocated":  # A's pages freed and re-reserved, the transfer untouched
            pool.release("A")
            other.extend(pool.allocate(2, "B"))
            for r in other:
                pool.kv[r.page_id].fill_(7.0)  # B's own KV
        elif window == "cancelled":  # cancelled, its abort not taking effect; pages still A's
            tr.ep = None
            rx.cancel("A")
        return await real(ep, tr, batch, indices)

    rx._receive_pages = in_the_window
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        sources, sends = await send_batch_of_a(ep, pool)
        await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5)
        # decode's answer to the batch: sent once its receives completed, or were refused
        [answer] = await _within(ep, [_recv_json(ep, reply=True)], 5)
        if window == "control":
            assert answer["ok"] and answer["received"] == 2
            assert t.state == InboundState.COMPLETE
            assert all(torch.equal(pool.kv[r.page_id], sources[i]) for i, r in enumerate(refs))
            return
        if window == "reallocated":
            assert all(bool((pool.kv[r.page_id] == 7.0).all()) for r in other)  # B's, intact
            assert pool.outstanding_ops("B") == 0
            assert answer == {"ok": False, "error": "RESERVATION_RELEASED"}
            assert (t.state, t.error) == (InboundState.FAILED, "RESERVATION_RELEASED")
        else:
            assert all(int(pool.kv[r.page_id].count_nonzero()) == 0 for r in refs)
            assert pool.outstanding_ops("A") == 0
            assert not answer["ok"] and t.state == InboundState.CANCELLED
        assert t.received == []
        assert "integrity_violation" not in [k for k, _ in events]  # a release, not forged
    finally:
        ep.abort()
        await rx.stop()


async def test_a_hello_for_a_released_reservation_is_late_not_forged():
    """A reservation decode issued and released (expired, or the request aborted) gets a hello
    when prefill ran late: that is UNAVAILABLE-grade, reported as a failed transfer, not as an
    integrity violation. An id decode never issued still is one (the control)."""
    pool = make_pool()
    rx, events = await make_receiver(pool)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        rx.cancel("res-1")
        pool.release("res-1")
        rx.forget("res-1")
        with pytest.raises(TransferError) as late:
            await send(rx, t, make_source(pool, 2))
        assert late.value.reason == "RESERVATION_RELEASED" and late.value.refused
        assert late.value.reason not in INTEGRITY_REASONS
        assert events == [
            (
                "transfer_failed",
                {"reason": "RESERVATION_RELEASED", "reservation_id": "res-1", "stage": "ucx_hello"},
            )
        ]
        forged = InboundTransfer("res-never", "req-2", b"k" * 32, [])
        with pytest.raises(TransferError) as unknown:
            await send(rx, forged, make_source(pool, 2))
        assert unknown.value.reason == "UNKNOWN_RESERVATION" in INTEGRITY_REASONS
        assert events[-1][0] == "integrity_violation"
        assert all(int(pool.kv[r.page_id].count_nonzero()) == 0 for r in refs)
        pool.check_integrity()
    finally:
        await rx.stop()


async def test_duplicate_and_out_of_range_indices_fail_the_transfer():
    pool = make_pool()
    rx, _ = await make_receiver(pool)
    try:
        refs = pool.allocate(4, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs[:2])
        with pytest.raises(TransferError):
            await send(rx, t, make_source(pool, 2), indices=[0, 0])
        await asyncio.wait_for(t.done.wait(), 5)
        assert t.state == InboundState.FAILED and t.error == "DUPLICATE_PAGE"
        t2 = rx.expect("res-2", "req-2", b"k" * 32, pool.allocate(2, "res-2"))
        with pytest.raises(TransferError):
            await send(rx, t2, make_source(pool, 1), indices=[2])
        assert t2.error == "COVERAGE"
        assert pool.outstanding_ops("res-1") == 0 and pool.outstanding_ops("res-2") == 0
    finally:
        await rx.stop()


async def test_a_batch_over_decodes_max_batch_bytes_is_refused():
    pool = make_pool()
    rx, _ = await make_receiver(pool, max_batch_bytes=pool.page_bytes)
    try:
        # the sender cuts batches of two pages, decode takes one page per batch
        t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(2, "res-1"))
        with pytest.raises(TransferError):
            await send(rx, t, make_source(pool, 2), max_batch_bytes=2 * pool.page_bytes)
        await asyncio.wait_for(t.done.wait(), 5)
        assert t.state == InboundState.FAILED and t.error == "BATCH_TOO_LARGE"
        assert t.received == []
        # control: the same two pages, one per batch
        t2 = rx.expect("res-2", "req-2", b"k" * 32, pool.allocate(2, "res-2"))
        await send(rx, t2, make_source(pool, 2), max_batch_bytes=pool.page_bytes)
        await asyncio.wait_for(t2.done.wait(), 5)
        assert t2.state == InboundState.COMPLETE and sorted(t2.received) == [0, 1]
    finally:
        await rx.stop()


async def test_a_page_index_repeated_in_a_later_batch_or_sent_as_a_boolean_fails():
    pool = make_pool()
    rx, _ = await make_receiver(pool)
    try:
        # batches of two pages: [0, 1] then [0]; page 0 would be written twice
        t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(3, "res-1"))
        with pytest.raises(TransferError):
            await send(rx, t, make_source(pool, 3), indices=[0, 1, 0])
        await asyncio.wait_for(t.done.wait(), 5)
        assert t.state == InboundState.FAILED and t.error == "DUPLICATE_PAGE"
        assert t.received == [0, 1]
        # the refused batch's page, sent behind its header, is drained once the sender closes
        assert await eventually(lambda: rx.strays_drained == 1)
        # JSON true is not page 1
        t2 = rx.expect("res-2", "req-2", b"k" * 32, pool.allocate(2, "res-2"))
        with pytest.raises(TransferError):
            await send(rx, t2, make_source(pool, 1), indices=[True])
        assert t2.error == "COVERAGE" and t2.received == []
        assert await eventually(lambda: rx.strays_drained == 2)
        # control: the same three pages in the same two batches, each index once
        t3 = rx.expect("res-3", "req-3", b"k" * 32, pool.allocate(3, "res-3"))
        await send(rx, t3, make_source(pool, 3), indices=[2, 0, 1])
        await asyncio.wait_for(t3.done.wait(), 5)
        assert t3.state == InboundState.COMPLETE and sorted(t3.received) == [0, 1, 2]
        assert rx.strays_drained == 2
    finally:
        await rx.stop()


async def test_cancel_mid_transfer_settles_posted_receives_before_free():
    pool = make_pool()
    rx, _ = await make_receiver(pool, batch_timeout_s=30.0)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)

        import ucxx

        from kvfence.transfer import _expect_ok, _send_json, authenticator

        # A sender that announces a batch and then stalls: the receives stay posted.
        ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
        await _send_json(
            ep,
            {
                "reservation_id": "res-1",
                "request_id": "req-1",
                "auth": authenticator(b"k" * 32, "res-1"),
            },
        )
        await _expect_ok(ep, 5)
        await _send_json(ep, {"indices": [0, 1]})
        for _ in range(100):
            if pool.outstanding_ops("res-1") == 2:
                break
            await asyncio.sleep(0.02)
        assert pool.outstanding_ops("res-1") == 2
        pool.release("res-1")  # control plane gave up: pages must not be freed yet
        assert pool.state_of(refs[0].page_id) == PageState.QUARANTINED
        assert pool.num_free == 6
        rx.cancel("res-1")
        await asyncio.wait_for(t.done.wait(), 5)
        for _ in range(100):
            if pool.num_free == 8:
                break
            await asyncio.sleep(0.02)
        assert pool.num_free == 8
        assert pool.generation(refs[0].page_id) > refs[0].generation
        pool.check_integrity()
        ep.abort()
    finally:
        await rx.stop()


async def test_releasing_a_completed_transfer_leaves_the_pooled_endpoint_to_the_next(monkeypatch):
    """Release (``cancel``) of a reservation whose transfer completed, while decode's handler
    still holds the endpoint after its final answer (a busy decode resumes it late), must not
    abort that endpoint: prefill already read the answer and gave the endpoint back to its pool,
    and its next transfer runs on it. Aborting it failed that transfer with UCXXCanceledError on
    a healthy decode (chaos run, /tmp/ucxcancel). Control: a transfer still receiving is stopped,
    its endpoint aborted."""
    pool = make_pool()
    rx, events = await make_receiver(pool)
    eps = EndpointPool()
    original = rx._answer
    resume = asyncio.Event()
    final_sent = asyncio.Event()

    async def slow_to_resume(ep, answer, frame):
        await original(ep, answer, frame)
        if "received" in answer and not resume.is_set():
            final_sent.set()
            await resume.wait()  # the handler has not come back from its final answer yet

    monkeypatch.setattr(rx, "_answer", slow_to_resume)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        await send(rx, t, make_source(pool, 2), endpoints=eps)
        await asyncio.wait_for(final_sent.wait(), 5)
        assert t.state == InboundState.COMPLETE and t.ep is not None
        assert eps.idle("127.0.0.1", rx.port) == 1  # prefill gave the endpoint back
        rx.cancel("res-1")  # the control plane's Release, as the request ends
        resume.set()
        pool.release("res-1")
        rx.forget("res-1")
        await asyncio.sleep(0.2)  # time for prefill to see an abort, were there one
        # the next transfer runs on the same endpoint, as if the release had not happened
        refs = pool.allocate(2, "res-2")
        t2 = rx.expect("res-2", "req-2", b"k" * 32, refs)
        sources = make_source(pool, 2, fill=20.0)
        await send(rx, t2, sources, endpoints=eps)
        assert t2.state == InboundState.COMPLETE and holds(pool, refs, sources)
        assert (eps.opened, eps.reused, eps.discarded) == (1, 1, 0)
        assert rx.connections == 1 and rx.transfers_served == 2
        pool.release("res-2")
        rx.forget("res-2")

        # control: a transfer that is still receiving is stopped, its endpoint aborted
        refs = pool.allocate(2, "res-3")
        t3 = rx.expect("res-3", "req-3", b"k" * 32, refs)
        pages = [OutboundPage(i, page_buffer(s)) for i, s in enumerate(make_source(pool, 2))]
        sending = asyncio.ensure_future(
            send_pages(
                rx.address,
                reservation_id="res-3",
                request_id="req-3",
                secret=b"k" * 32,
                pages=pages,
                page_bytes=pool.page_bytes,
                max_batch_bytes=2 * pool.page_bytes,
                batch_timeout_s=5.0,
                endpoints=eps,
                stall_after_hello_s=1.0,  # decode took the warm hello; its pages are late
            )
        )
        assert await eventually(lambda: t3.state == InboundState.RECEIVING)
        rx.cancel("res-3")
        with pytest.raises(TransferError):
            await sending
        assert t3.state == InboundState.CANCELLED
        assert (eps.reused, eps.discarded) == (2, 1)
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert pool.outstanding_ops("res-3") == 0
        pool.release("res-3")
        rx.forget("res-3")
        assert events == []
        pool.check_integrity()
    finally:
        resume.set()
        await eps.close()
        await rx.stop()


# ---- protocol v4: on a warm endpoint the hello carries the first batch ---------------------------


class Wire:
    """Every UCX send of this process, in the order it was posted, by what it carries: "hello"
    (its JSON), "batch" (a BATCH header), "answer" (decode's answer) or "page". Both sides run
    here, so one list shows the whole exchange. A control message sent as a length and a body is
    logged once, at its body; ``messages`` counts every UCX message."""

    def __init__(self, monkeypatch):
        from ucxx._lib_async.endpoint import Endpoint

        from kvfence import transfer

        self.log: list[tuple[str, object]] = []
        self.messages = 0
        self.frames = 0  # control messages sent as one UCX message
        original = Endpoint.send
        control = {
            transfer.LEN_TAG: "batch",
            transfer.BODY_TAG: "batch",
            transfer.REPLY_LEN_TAG: "answer",
            transfer.REPLY_BODY_TAG: "answer",
        }

        async def send(ep, buffer, tag=None, force_tag=False):
            self.messages += 1
            raw = bytes(buffer)
            if tag in control:
                if tag in (transfer.LEN_TAG, transfer.REPLY_LEN_TAG) and len(raw) > 8:
                    raw = raw[8:]  # one frame: length, then the body
                    self.frames += 1
                if tag in (transfer.BODY_TAG, transfer.REPLY_BODY_TAG) or len(raw) != 8:
                    obj = json.loads(raw)
                    kind = control[tag]
                    self.log.append(("hello" if "reservation_id" in obj else kind, obj))
            else:
                self.log.append(("page", tag))
            return await original(ep, buffer, tag=tag, force_tag=force_tag)

        monkeypatch.setattr(Endpoint, "send", send)

    def take(self) -> list[tuple[str, object]]:
        log, self.log, self.messages, self.frames = self.log, [], 0, 0
        return log

    @staticmethod
    def kinds(log) -> list[str]:
        return [kind for kind, _ in log]


def holds(pool: PagePool, refs, sources) -> bool:
    """Every reserved page holds exactly its source's bytes."""
    return all(torch.equal(pool.kv[r.page_id], s) for r, s in zip(refs, sources, strict=True))


async def warm_setup(page_layout: dict | None = None, **kw):
    """A receiver, a pool of endpoints holding one warm endpoint (a completed transfer on it)."""
    pool = PagePool(
        8, **(page_layout or dict(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8))
    )
    rx, events = await make_receiver(pool, **kw)
    eps = EndpointPool()
    refs = pool.allocate(1, "res-0")
    t = rx.expect("res-0", "req-0", b"k" * 32, refs)
    await send(rx, t, make_source(pool, 1), endpoints=eps, **kw)
    assert t.state == InboundState.COMPLETE and eps.idle("127.0.0.1", rx.port) == 1
    pool.release("res-0")
    rx.forget("res-0")
    return pool, rx, events, eps


async def test_warm_endpoint_transfer_is_one_round_trip_and_cold_is_two(monkeypatch):
    pool = make_pool()
    rx, events = await make_receiver(pool)
    eps = EndpointPool()
    wire = Wire(monkeypatch)
    try:
        landed = []
        for n in range(3):
            rid = f"res-{n}"
            refs = pool.allocate(2, rid)
            t = rx.expect(rid, f"req-{n}", b"k" * 32, refs)
            sources = make_source(pool, 2, fill=10.0 * (n + 1))
            answers = rx.answers
            await send(rx, t, sources, endpoints=eps)
            assert t.state == InboundState.COMPLETE and sorted(t.received) == [0, 1]
            landed.append(holds(pool, refs, sources))
            messages, log = wire.messages, wire.take()
            if n == 0:
                # a new endpoint: the two-step hello, which decode v4 still accepts; the hello
                # is a length and a body (decode's version is not known yet), the rest frames
                assert Wire.kinds(log) == ["hello", "answer", "batch", "page", "page", "answer"]
                assert "batch" not in log[0][1]
                assert rx.answers - answers == 2 and messages == 2 + 1 + 1 + 2 + 1
            else:
                # warm: hello + batch + its pages, then one answer for all of it
                assert Wire.kinds(log) == ["hello", "page", "page", "answer"]
                assert log[0][1]["batch"] == {"indices": [0, 1], "last": True}
                assert log[-1][1] == {"ok": True, "received": 2, "v": PROTOCOL_VERSION}
                assert rx.answers - answers == 1 and messages == 1 + 2 + 1
            pool.release(rid)
            rx.forget(rid)
        assert landed == [True, True, True]
        assert (eps.opened, eps.reused) == (1, 2) and rx.warm_hellos == 2
        assert rx.transfers_served == 3 and events == []
        pool.check_integrity()
    finally:
        await eps.close()
        await rx.stop()


async def test_warm_transfer_without_pages_is_one_round_trip(monkeypatch):
    pool, rx, _, eps = await warm_setup()
    wire = Wire(monkeypatch)
    try:
        t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(1, "res-1"))
        await send_pages(rx.address, reservation_id="res-1", request_id="req-1",
                         secret=b"k" * 32, pages=[], page_bytes=pool.page_bytes,
                         max_batch_bytes=pool.page_bytes, batch_timeout_s=5.0,
                         endpoints=eps)  # fmt: skip
        assert t.state == InboundState.COMPLETE and t.received == []
        log = wire.take()
        assert Wire.kinds(log) == ["hello", "answer"] and log[0][1]["batch"] == {"done": True}
    finally:
        await eps.close()
        await rx.stop()


BIG_PAGES = dict(num_layers=4, page_size=16, num_kv_heads=8, head_dim=64)  # 256 KiB: rendezvous


@pytest.mark.parametrize("layout", [None, BIG_PAGES], ids=["small_pages", "big_pages"])
@pytest.mark.parametrize("auth", ["right", "wrong"])
async def test_warm_hello_is_verified_before_any_page_lands(monkeypatch, auth, layout):
    """The pages travel with the hello, before decode checked it: with a wrong authenticator they
    never reach the reserved pages and the error is today's; with the right one (the control,
    same path) they land. Afterwards the reservation takes a correct transfer, on a new endpoint,
    and the refused pages (same tags, other endpoint) do not land in it."""
    pool, rx, events, eps = await warm_setup(layout)
    wire = Wire(monkeypatch)
    try:
        refs = pool.allocate(2, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        garbage = make_source(pool, 2, fill=-50.0)
        ops = []
        original = pool.begin_ops
        monkeypatch.setattr(pool, "begin_ops", lambda pids: (ops.append(pids), original(pids)))
        secret = b"k" * 32 if auth == "right" else b"x" * 32
        err = None
        try:
            await send(rx, t, garbage, endpoints=eps, secret=secret)
        except TransferError as e:
            err = e
        # either way it went warm: hello + batch + pages on the wire before any answer
        log = wire.take()
        assert Wire.kinds(log) == ["hello", "page", "page", "answer"]
        assert log[0][1]["batch"] == {"indices": [0, 1], "last": True}
        assert (eps.opened, eps.reused) == (1, 1)
        if auth == "right":
            assert err is None and t.state == InboundState.COMPLETE
            assert holds(pool, refs, garbage)
            assert len(ops) == 1 and events == [] and rx.strays_drained == 0
            return
        assert err is not None
        assert err.reason == "BAD_AUTHENTICATOR" and err.refused and not err.timeout
        assert log[-1][1] == {"ok": False, "error": "BAD_AUTHENTICATOR"}
        assert ops == [] and pool.outstanding_ops("res-1") == 0  # no receive was ever posted
        assert all(pool.kv[r.page_id].abs().sum() == 0 for r in refs)
        assert t.state == InboundState.EXPECTING
        assert events == [
            (
                "integrity_violation",
                {"check": "BAD_AUTHENTICATOR", "reservation_id": "res-1", "stage": "ucx_hello"},
            )
        ]
        # the endpoint ended on both sides, as before v4
        assert eps.discarded == 1 and eps.open_endpoints == 0
        for _ in range(250):
            if rx.open_endpoints == 0:
                break
            await asyncio.sleep(0.02)
        assert rx.open_endpoints == 0
        # the refused pages were received into decode's scratch page, not left queued in UCX
        # (where each refused hello's pages stayed for the life of the process)
        assert await eventually(lambda: rx.strays_drained == 2), rx.strays_drained
        assert all(pool.kv[r.page_id].abs().sum() == 0 for r in refs)
        # the reservation still takes its one correct transfer, and gets exactly its own bytes
        good = make_source(pool, 2, fill=7.0)
        await send(rx, t, good, endpoints=eps)
        assert t.state == InboundState.COMPLETE and eps.opened == 2
        assert holds(pool, refs, good)
        pool.check_integrity()
    finally:
        await eps.close()
        await rx.stop()


@pytest.mark.parametrize("warm", [True, False])
async def test_batches_after_the_first_stay_stop_and_wait(monkeypatch, warm):
    """Five pages in batches of two: each later batch (header and pages) goes out only after the
    previous batch was answered, warm or cold; warm saves exactly the hello's round trip."""
    pool, rx, _, eps = await warm_setup()
    if not warm:
        await eps.close()
        eps = EndpointPool()
    wire = Wire(monkeypatch)
    try:
        refs = pool.allocate(5, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        sources = make_source(pool, 5, fill=3.0)
        await send(rx, t, sources, endpoints=eps, max_batch_bytes=2 * pool.page_bytes)
        assert t.state == InboundState.COMPLETE
        assert holds(pool, refs, sources)
        log = wire.take()
        rounds = ["page", "page", "answer", "batch", "page", "page", "answer", "batch", "page"]
        if warm:
            assert Wire.kinds(log) == ["hello", *rounds, "answer"]
        else:
            assert Wire.kinds(log) == ["hello", "answer", "batch", *rounds, "answer"]
        headers = [obj for kind, obj in log if kind in ("hello", "batch")]
        assert [h.get("batch", h).get("indices") for h in headers][-3:] == [[0, 1], [2, 3], [4]]
        # the page tags name the batch, counted from 0 whichever opening carried batch 0
        tags = [obj for kind, obj in log if kind == "page"]
        assert tags == [
            page_tag("res-1", b, k) for b, n in ((0, 2), (1, 2), (2, 1)) for k in range(n)
        ]
    finally:
        await eps.close()
        await rx.stop()


async def test_decode_speaking_v3_gets_the_two_step_hello_on_every_endpoint(monkeypatch):
    """A decode before v4 answers the hello before any batch: prefill pools its endpoints but
    never sends a batch with a hello on them (the control is the warm test above)."""
    from kvfence import transfer

    monkeypatch.setattr(transfer, "PROTOCOL_VERSION", 3)
    pool, rx, events, eps = await warm_setup()
    wire = Wire(monkeypatch)
    try:
        for n in (1, 2):
            rid = f"res-{n}"
            refs = pool.allocate(1, rid)
            t = rx.expect(rid, f"req-{n}", b"k" * 32, refs)
            sources = make_source(pool, 1, fill=5.0 * n)
            await send(rx, t, sources, endpoints=eps)
            assert torch.equal(pool.kv[refs[0].page_id], sources[0])
            log = wire.take()
            assert Wire.kinds(log) == ["hello", "answer", "batch", "page", "answer"]
            assert "batch" not in log[0][1] and log[1][1]["v"] == 3
            pool.release(rid)
            rx.forget(rid)
        assert (eps.opened, eps.reused) == (1, 2) and rx.warm_hellos == 0 and events == []
    finally:
        await eps.close()
        await rx.stop()


@pytest.mark.parametrize("size", [100, FRAME_BYTES - 8, FRAME_BYTES - 7, 50_000])
@pytest.mark.parametrize("frame", [True, False])
async def test_control_message_is_one_frame_only_when_asked_and_small(monkeypatch, frame, size):
    """Either form arrives intact through the one receive path; a frame is used only when the
    sender may (``frame``: the peer said v >= 4) and the message fits in FRAME_BYTES."""
    import ucxx

    from kvfence.transfer import _recv_json, _send_json

    got: list = []

    async def serve(ep):
        got.append(await _recv_json(ep))
        await _send_json(ep, {"ok": True}, reply=True, frame=frame)

    listener = ucxx.create_listener(serve)
    ep = await ucxx.create_endpoint("127.0.0.1", listener.port)
    wire = Wire(monkeypatch)
    try:
        obj = {"pad": ""}
        obj["pad"] = "x" * (size - len(json.dumps(obj).encode()))
        await _send_json(ep, obj, frame=frame)
        assert await _recv_json(ep, reply=True) == {"ok": True}
        assert got == [obj]
        one = frame and size + 8 <= FRAME_BYTES
        assert wire.messages == (1 if one else 2) + (1 if frame else 2)
        assert wire.frames == (1 if one else 0) + (1 if frame else 0)
    finally:
        ep.abort()
        listener.close()


async def test_a_prefill_before_v4_is_answered_in_two_part_messages(monkeypatch):
    """A hello that names no version (prefill before v4) gets answers as a length and a body,
    the only form such a prefill can receive; the control is the v4 hello in the test above."""
    import ucxx

    from kvfence.transfer import _recv_json, _send_json, authenticator

    pool = make_pool()
    rx, events = await make_receiver(pool)
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    wire = Wire(monkeypatch)
    try:
        refs = pool.allocate(1, "res-1")
        t = rx.expect("res-1", "req-1", b"k" * 32, refs)
        hello = {"reservation_id": "res-1", "request_id": "req-1",
                 "auth": authenticator(b"k" * 32, "res-1")}  # fmt: skip
        await _send_json(ep, hello)
        assert (await _recv_json(ep, reply=True))["ok"]
        await _send_json(ep, {"indices": [0], "last": True})
        source = make_source(pool, 1, fill=9.0)[0]
        await ep.send(page_buffer(source), tag=page_tag("res-1", 0, 0))
        assert await _recv_json(ep, reply=True) == {"ok": True, "received": 1, "v": 4}
        assert torch.equal(pool.kv[refs[0].page_id], source)
        assert t.state == InboundState.COMPLETE and events == []
        assert wire.frames == 0
    finally:
        ep.abort()
        await rx.stop()


# ---- what a failed UCX operation leaves behind --------------------------------------------------


async def test_a_failed_operation_raises_a_copy_and_ucxx_keeps_no_traceback():
    """ucxx keeps the exception of a failed request alive for good; ``_op`` raises a copy and
    strips the original of its traceback, which would keep every frame it passed through."""
    from kvfence import transfer

    kept = RuntimeError("Request canceled")  # what ucxx's future holds on to

    async def failing():
        buffer = bytearray(1 << 16)  # a frame local that must not outlive the operation
        assert buffer
        raise kept

    with pytest.raises(RuntimeError) as err:
        await transfer._op(failing())
    assert err.value is not kept and err.value.args == ("Request canceled",)
    assert kept.__traceback__ is None

    async def ok():
        return 7

    assert await transfer._op(ok()) == 7  # control: a success is returned as it is


# Run in a process of its own: the services run ucxx with Python futures (use_ucx_futures), which
# binds ucxx to one event loop; in-process tests poll instead, and polling keeps nothing.
CHURN_SCRIPT = """
import asyncio, gc, sys, types
from kvfence.kv.pool import PagePool
from kvfence.transfer import (KvReceiver, OutboundPage, page_buffer, send_pages, stop_ucx_notifier,
                              use_ucx_futures)
import torch

async def main():
    use_ucx_futures()
    pool = PagePool(2, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)
    rx = KvReceiver(pool, host="127.0.0.1", max_batch_bytes=1 << 20, batch_timeout_s=5,
                    report=lambda kind, payload: None)
    await rx.start()
    src = torch.ones(pool.kv.shape[1:])
    for n in range(int(sys.argv[1])):  # no endpoint pool: a new endpoint for every transfer
        rid = f"res-{n}"
        t = rx.expect(rid, rid, b"k" * 32, pool.allocate(1, rid))
        await send_pages(rx.address, reservation_id=rid, request_id=rid, secret=b"k" * 32,
                         pages=[OutboundPage(0, page_buffer(src))], page_bytes=pool.page_bytes,
                         max_batch_bytes=1 << 20, batch_timeout_s=5)
        await asyncio.wait_for(t.done.wait(), 5)
        assert t.state.value == "complete" and torch.equal(pool.kv[t.pages[0].page_id], src)
        pool.release(rid)
        rx.forget(rid)
    while rx.open_endpoints:
        await asyncio.sleep(0.02)
    await rx.stop()
    gc.collect()
    frames = [o for o in gc.get_objects() if type(o) is types.FrameType]
    print(rx.connections, sum(f.f_code.co_name == "_recv_json" for f in frames))

asyncio.run(main())
stop_ucx_notifier()
"""


def test_endpoints_that_closed_leave_no_frames_behind():
    """Every decode endpoint closes with its next hello's receive posted; ucxx cancels it and keeps
    the exception for good. Measured before ``_op``: 14 KiB of frames and buffers kept per closed
    endpoint (each one a ``_recv_json`` frame with its buffer, and the frames above it)."""
    env = {**os.environ, "UCX_TLS": "tcp,self"}
    out = subprocess.run(
        [sys.executable, "-c", CHURN_SCRIPT, "6"],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    ).stdout  # fmt: skip
    connections, frames = (int(x) for x in out.split()[-2:])
    assert connections == 6  # six endpoints served a transfer each, and closed
    assert frames == 0


# A decode's receiver on a fixed port serves one transfer and its process exits (argv "serve");
# a new process (the restarted decode) then listens on the same port (argv "listen").
REBIND_SCRIPT = """
import asyncio, sys
from kvfence.kv.pool import PagePool
from kvfence.transfer import (EndpointPool, KvReceiver, OutboundPage, page_buffer, send_pages,
                              service_ucx_defaults, stop_ucx_notifier)
import torch

mode, port = sys.argv[1], int(sys.argv[2])

async def main():
    service_ucx_defaults()
    pool = PagePool(2, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)
    rx = KvReceiver(pool, host="127.0.0.1", port=port, max_batch_bytes=1 << 20,
                    batch_timeout_s=5, report=lambda kind, payload: None)
    try:
        await rx.start()
    except Exception as err:
        print("refused", type(err).__name__)
        return
    endpoints = EndpointPool(max_idle_per_peer=4)  # prefill keeps the endpoint for the next
    if mode == "serve":
        t = rx.expect("r", "r", b"k" * 32, pool.allocate(1, "r"))
        await send_pages(rx.address, reservation_id="r", request_id="r", secret=b"k" * 32,
                         pages=[OutboundPage(0, page_buffer(torch.ones(pool.kv.shape[1:])))],
                         page_bytes=pool.page_bytes, max_batch_bytes=1 << 20, batch_timeout_s=5,
                         endpoints=endpoints)
        await asyncio.wait_for(t.done.wait(), 5)
    print("listening", rx.port == port)
    await rx.stop()  # decode stops first and closes the pooled endpoint's connection
    await endpoints.close()

asyncio.run(main())
stop_ucx_notifier()
"""


@pytest.mark.parametrize("reuse", [None, "n"], ids=["service-defaults", "operator-says-n"])
def test_a_restarted_receiver_takes_its_fixed_port_at_once(reuse):
    """A decode container restarted in its pod listens on the same fixed UCX port while its
    previous process's connections are in TIME_WAIT: UCX refused the port ("Device is busy")
    for a minute. The services' UCX defaults let it bind. Control: with the operator's
    UCX_TCP_CM_REUSEADDR=n (their value wins) the same restart is refused."""
    import socket

    env = {k: v for k, v in os.environ.items() if k != "UCX_TCP_CM_REUSEADDR"}
    env["UCX_TLS"] = "tcp,self"
    if reuse is not None:
        env["UCX_TCP_CM_REUSEADDR"] = reuse

    def run(mode: str, port: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", REBIND_SCRIPT, mode, port],
            capture_output=True, text=True, timeout=120, env=env, check=True,
        ).stdout  # fmt: skip
        return out.split()[-2:]

    # The first process needs a port no earlier connection of this run left in TIME_WAIT: a port
    # bind(0) hands out is an ephemeral one, which client sockets of earlier tests may have used,
    # and with the operator's n even this first listen is refused then. Another port is tried.
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        first = run("serve", port)
        if first == ["listening", "True"]:
            break
    assert first == ["listening", "True"]
    want = ["listening", "True"] if reuse is None else ["refused", "UCXXBusyError"]
    assert run("listen", port) == want


# ---- exposure of decode's listener: unverified connections are capped ---------------------------


async def raw_endpoints(port: int, n: int, host: str = "127.0.0.1") -> list:
    """``n`` UCX connections to a receiver that say nothing (ucxx's own handshake only)."""
    import ucxx

    return [await ucxx.create_endpoint(host, port) for _ in range(n)]


async def say(ep, hello: dict) -> None:
    """Send a hello on a flood endpoint; decode may have closed it already (then it fails)."""
    from kvfence.transfer import _send_json

    with contextlib.suppress(Exception):
        await asyncio.wait_for(_send_json(ep, hello), 2)


FORGED = {"reservation_id": "res-forged", "request_id": "x", "auth": "0" * 64, "v": 4}


async def test_a_flood_of_unverified_connections_is_capped_and_legit_transfers_go_on():
    """Connections that never say a verified hello (silent ones, and ones whose forged hello was
    refused and that stay open) are served at most ``max_unverified`` at once: the rest are
    closed at once, unserved, counted per reason and logged once, not once each. Meanwhile a
    prefill's pooled endpoint (verified before) transfers as usual, and a new connection's
    transfer fails at once (it does not hang). When the flood's connections time out, a new
    connection transfers again (the positive control)."""
    rejected: list[str] = []
    with structlog.testing.capture_logs() as logs:
        pool, rx, events, eps = await warm_setup(
            batch_timeout_s=3.0, max_unverified=3, on_reject=rejected.append
        )
        flood: list = []
        try:
            flood = await raw_endpoints(rx.port, 8)
            for ep in flood[::2]:
                await say(ep, FORGED)
            assert await eventually(lambda: rx.rejected["unverified_limit"] == 5)
            assert rx.unverified == 3 and rx.connections == 1 + 3  # the warm one, 3 of the flood
            assert rejected == ["unverified_limit"] * 5

            # the pooled endpoint's hello was verified long ago: it transfers as usual
            refs = pool.allocate(2, "res-warm")
            t = rx.expect("res-warm", "req-warm", b"k" * 32, refs)
            sources = make_source(pool, 2, fill=3.0)
            await send(rx, t, sources, endpoints=eps, batch_timeout_s=3.0)
            assert t.state == InboundState.COMPLETE and holds(pool, refs, sources)
            assert eps.reused == 1 and rx.unverified == 3

            # a new connection meanwhile is closed under its hello: its transfer fails at once
            cold_refs = pool.allocate(2, "res-cold")
            cold = rx.expect("res-cold", "req-cold", b"k" * 32, cold_refs)
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(TransferError):
                await send(rx, cold, sources, batch_timeout_s=3.0)
            assert loop.time() - began < 2.0  # not the hello's timeout (3 s)
            assert rx.rejected["unverified_limit"] == 6 and cold.state == InboundState.EXPECTING

            # the flood's connections time out (silent) or linger out (refused): slots free again
            assert await eventually(lambda: rx.unverified == 0, timeout=10)
            kinds = sorted(kind for kind, _ in events)
            # one report per flood connection served, none for one closed unserved
            assert len(kinds) == 3 and set(kinds) <= {"transfer_failed", "integrity_violation"}
            await send(rx, cold, sources, batch_timeout_s=3.0)  # positive control
            assert cold.state == InboundState.COMPLETE and holds(pool, cold_refs, sources)
            pool.check_integrity()
        finally:
            for ep in flood:
                ep.abort()
            await eps.close()
            await rx.stop()
    closed = [e for e in logs if e["event"] == "UCX connections closed unserved"]
    # the first at once, the rest of the burst in one more line (at the end of the interval, or
    # at stop), never one per connection; together they count every one
    assert len(closed) == 2 and {e["log_level"] for e in closed} == {"warning"}
    assert closed[0]["closed"] == 1
    assert sum(e["closed"] for e in closed) == rx.rejected["unverified_limit"] == 6
    assert closed[0]["reason"] == "unverified_limit" and closed[0]["max_unverified"] == 3


async def test_a_verified_connection_leaves_the_unverified_count():
    """The cap counts only connections whose hello is not verified yet: a receiver that takes one
    such connection serves any number of transfers one after another, each on a new connection
    (each verified in turn), and the one on a pooled endpoint."""
    pool = make_pool()
    rx, events = await make_receiver(pool, max_unverified=1)
    eps = EndpointPool()
    try:
        for n in range(3):
            rid = f"res-{n}"
            t = rx.expect(rid, rid, b"k" * 32, pool.allocate(1, rid))
            await send(rx, t, make_source(pool, 1), endpoints=eps if n < 2 else None)
            assert t.state == InboundState.COMPLETE
        assert rx.unverified == 0 and not rx.rejected and events == []
        assert rx.connections == 2  # the pooled one served twice
    finally:
        await eps.close()
        await rx.stop()


def other_local_address() -> str | None:
    """An IPv4 address of this machine that is not on loopback, if it has one."""
    import ipaddress
    import socket

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


@pytest.mark.parametrize(
    ("listen", "bind_host"),
    [("127.0.0.1:0", "127.0.0.1"), ("[fd00::2]:50071", "fd00::2"), ("10.1.2.3", "10.1.2.3"),
     ("0.0.0.0:50071", ""), ("[::]:50071", ""), (":50071", "")],
)  # fmt: skip
def test_the_bind_host_is_the_listen_address_host_or_none_for_every_interface(listen, bind_host):
    assert bind_host_of(listen) == bind_host


async def test_a_receiver_says_when_it_listens_wider_than_the_node_binds():
    """ucxx (0.52) cannot bind the listener to one address (``create_listener`` takes a port only):
    it listens on every interface. A receiver told that the node binds 127.0.0.1 says so, at
    warning, at start; and that is no false alarm: where this machine has another address, a
    connection through it is served. Control: a node that binds every interface hears nothing."""
    import ucxx

    pool = make_pool()
    with structlog.testing.capture_logs() as logs:
        rx, _ = await make_receiver(pool, bind_host="127.0.0.1")
        try:
            assert rx.listen_ip == "0.0.0.0" and rx.listens_wider_than_bound
            other = other_local_address()
            if other is not None:
                ep = await asyncio.wait_for(ucxx.create_endpoint(other, rx.port), 5)
                assert await eventually(lambda: rx.connections == 1)
                ep.abort()
            t = rx.expect("res-1", "req-1", b"k" * 32, pool.allocate(1, "res-1"))
            await send(rx, t, make_source(pool, 1))  # through 127.0.0.1, as advertised
            assert t.state == InboundState.COMPLETE
        finally:
            await rx.stop()
        wide = [e for e in logs if e["event"].startswith("UCX transfer listener listens on every")]
        assert len(wide) == 1 and wide[0]["log_level"] == "warning"
        assert wide[0]["bind_host"] == "127.0.0.1" and wide[0]["listen_ip"] == "0.0.0.0"
        logs.clear()
        rx, _ = await make_receiver(pool)  # control: bind_host "" (0.0.0.0 / ::)
        await rx.stop()
        assert not rx.listens_wider_than_bound
        assert not [e for e in logs if e["event"].startswith("UCX transfer listener")]


async def start_decode(tmp_path, **transfer):
    """A real decode node on the embedded tiny model, unregistered, with these transfer
    settings."""
    from kvfence.config import Role, parse_config
    from kvfence.model.tiny import ensure_tiny_model
    from kvfence.node_main import start_node

    cfg = parse_config(
        {
            "model": {"path": str(ensure_tiny_model(tmp_path / "tiny"))},
            "kv": {"page_size": 16, "decode_pool": {"num_pages": 8}},
            "control_plane": {"state_dir": str(tmp_path / "state")},
            "transfer": transfer,
        },
        environ={},
    )
    return await start_node(cfg, Role.DECODE, register=False)


async def test_a_decode_node_caps_unverified_connections_from_its_config(tmp_path):
    """node_main wires it: transfer.max_unverified_connections is the receiver's cap, a connection
    beyond it counts in kvfence_transfer_connections_rejected_total, and the receiver knows the
    address node.listen binds (control: the same count is 0 before the flood)."""
    dec = await start_decode(tmp_path, batch_timeout_s=30, max_unverified_connections=2)
    flood: list = []

    def rejected() -> str:
        line = 'kvfence_transfer_connections_rejected_total{reason="unverified_limit"'
        text = dec.metrics.render().decode()
        return next((x.split()[-1] for x in text.splitlines() if x.startswith(line)), "none")

    try:
        rx = dec.receiver
        assert (rx.max_unverified, rx.bind_host) == (2, "127.0.0.1")
        assert rejected() == "none"
        flood = await raw_endpoints(rx.port, 5)
        assert await eventually(lambda: rejected() == "3.0")
        assert rx.unverified == 2
    finally:
        for ep in flood:
            ep.abort()
        await dec.stop(grace=0)


async def test_a_flood_of_forged_hellos_is_a_bounded_number_of_events(tmp_path):
    """Anyone who reaches the UCX port can say forged hellos: each is counted in the metric, but
    only the first HELLO_EVENTS_BURST of a window become events (log lines, MQTT messages, event
    buffer places); the rest are one summary event saying how many. Control: up to the burst every
    forged hello is an event, and a silent connection (BAD_HELLO) has a window of its own."""
    from decode_svc.service import HELLO_EVENTS_BURST

    # Long enough that the first connection is still waiting for its hello while the rest are
    # opened one by one (0.5 s made them BAD_HELLO instead on a loaded machine).
    dec = await start_decode(tmp_path, batch_timeout_s=3.0)

    def events(kind: str, what: str) -> list[dict]:
        field = "check" if kind == "integrity_violation" else "reason"
        return [e for e in dec.bus.recent if e["kind"] == kind and e.get(field) == what]

    def counted() -> str:
        line = 'kvfence_integrity_failures_total{check="UNKNOWN_RESERVATION"'
        text = dec.metrics.render().decode()
        return next((x.split()[-1] for x in text.splitlines() if x.startswith(line)), "none")

    flood: list = []
    try:
        forged = HELLO_EVENTS_BURST + 7
        flood = await raw_endpoints(dec.receiver.port, forged + 1)
        for ep in flood[:HELLO_EVENTS_BURST]:
            await say(ep, FORGED)
        assert await eventually(lambda: counted() == f"{HELLO_EVENTS_BURST}.0")
        assert len(events("integrity_violation", "UNKNOWN_RESERVATION")) == HELLO_EVENTS_BURST
        for ep in flood[HELLO_EVENTS_BURST:forged]:
            await say(ep, FORGED)
        # the last one says nothing: BAD_HELLO once batch_timeout_s has passed
        assert await eventually(lambda: counted() == f"{forged}.0")
        assert await eventually(
            lambda: len(events("transfer_failed", "BAD_HELLO")) == 1, timeout=15
        )
        sent = events("integrity_violation", "UNKNOWN_RESERVATION")
        assert len(sent) == HELLO_EVENTS_BURST and not any("suppressed" in e for e in sent)
        dec.servicer.flush_hello_events(force=True)
        [summary] = [
            e for e in events("integrity_violation", "UNKNOWN_RESERVATION") if "suppressed" in e
        ]
        assert summary["suppressed"] == forged - HELLO_EVENTS_BURST
        assert summary["stage"] == "ucx_hello"
        assert not [e for e in events("transfer_failed", "BAD_HELLO") if "suppressed" in e]
    finally:
        for ep in flood:
            ep.abort()
        await dec.stop(grace=0)


async def test_the_rest_of_a_burst_of_closed_connections_is_logged_when_the_interval_ends(
    monkeypatch,
):
    """A burst of connections closed unserved logs its first at once and the rest in one line
    when the interval is over, even if no connection comes after it (the rest used to wait for
    the next one, which may never come)."""
    import kvfence.transfer as transfer_mod

    monkeypatch.setattr(transfer_mod, "REJECT_LOG_INTERVAL_S", 0.3)
    rx = KvReceiver(
        make_pool(), host="127.0.0.1", max_batch_bytes=1, batch_timeout_s=1.0, report=print
    )
    aborted: list = []
    ep = types.SimpleNamespace(abort=lambda: aborted.append(1))
    with structlog.testing.capture_logs() as logs:
        for _ in range(7):
            rx._reject(ep, "unverified_limit")
        closed = [e for e in logs if e["event"] == "UCX connections closed unserved"]
        assert [e["closed"] for e in closed] == [1]  # control: the first at once
        await asyncio.sleep(0.6)
        closed = [e for e in logs if e["event"] == "UCX connections closed unserved"]
    assert [e["closed"] for e in closed] == [1, 6] and len(aborted) == 7


async def test_a_decode_that_stops_reports_no_bad_hello_for_the_connections_it_aborts(tmp_path):
    """A connection that says nothing within batch_timeout_s is a BAD_HELLO (control); the silent
    connections a stopping decode aborts itself are not (they were reported, and past the hello
    events' bound never summarised: the limiter had been flushed already)."""
    dec = await start_decode(tmp_path, batch_timeout_s=1.0)

    def bad_hellos() -> int:
        return sum(e.get("reason") == "BAD_HELLO" for e in dec.bus.recent)

    flood: list = []
    try:
        flood = await raw_endpoints(dec.receiver.port, 1)
        assert await eventually(lambda: bad_hellos() == 1)
        flood += await raw_endpoints(dec.receiver.port, 12)
        assert await eventually(lambda: dec.receiver.unverified == 12)
    finally:
        await dec.stop(grace=0)
        for ep in flood:
            ep.abort()
    assert bad_hellos() == 1


async def test_late_hellos_are_not_bounded_like_forged_ones(tmp_path):
    """A late hello (RESERVATION_RELEASED) names a reservation this node issued: not something
    anyone can send at will, and each says a transfer came too late, so every one is an event;
    forged ones (UNKNOWN_RESERVATION) past the bound are not (control)."""
    from decode_svc.service import HELLO_EVENTS_BURST

    dec = await start_decode(tmp_path, batch_timeout_s=1.0)
    n = HELLO_EVENTS_BURST + 5
    try:
        for i in range(n):
            for reason, field, kind in (
                ("RESERVATION_RELEASED", "reason", "transfer_failed"),
                ("UNKNOWN_RESERVATION", "check", "integrity_violation"),
            ):
                payload = {field: reason, "reservation_id": f"res-{i}", "stage": "ucx_hello"}
                dec.servicer.report_transfer(kind, payload)
        late = [e for e in dec.bus.recent if e.get("reason") == "RESERVATION_RELEASED"]
        forged = [e for e in dec.bus.recent if e.get("check") == "UNKNOWN_RESERVATION"]
        assert len(late) == n and len(forged) == HELLO_EVENTS_BURST
    finally:
        await dec.stop(grace=0)


async def test_a_batch_decode_refuses_is_counted_once_by_decode(tmp_path):
    """A page sent twice (or outside the reservation) fails the transfer DATA_LOSS; decode made
    that check, so decode counts it (reported as transfer_failed, which it did not count: prefill
    and the control plane, which count only their own checks, did not either, and the alert on
    kvfence_integrity_failures_total never fired). Control: a sound transfer counts nothing."""
    dec = await start_decode(tmp_path)

    def counted(check: str) -> float | None:
        labels = {"service": "decode", "check": check}
        return dec.metrics.registry.get_sample_value("kvfence_integrity_failures_total", labels)

    try:
        pool, rx = dec.rt.pool, dec.receiver
        assert counted("DUPLICATE_PAGE") == 0  # exported from the start, at 0
        good = rx.expect("res-ok", "req-ok", b"k" * 32, pool.allocate(2, "res-ok"))
        await send(rx, good, make_source(pool, 2))
        bad = rx.expect("res-dup", "req-dup", b"k" * 32, pool.allocate(2, "res-dup"))
        with pytest.raises(TransferError) as err:
            await send(rx, bad, make_source(pool, 2), indices=[0, 0])
        assert err.value.reason == "DUPLICATE_PAGE" and err.value.refused
        assert await eventually(lambda: counted("DUPLICATE_PAGE") == 1)
        assert sum(counted(c) or 0 for c in ("COVERAGE", "PROTOCOL", "CHECKSUM")) == 0
        # A batch over decode's max_batch_bytes (prefill's setting over decode's: a rollout
        # half done) fails the transfer, but is no integrity failure: nothing counted.
        rx.max_batch_bytes = pool.page_bytes  # decode takes one page per batch, prefill sends 2
        big = rx.expect("res-big", "req-big", b"k" * 32, pool.allocate(2, "res-big"))
        with pytest.raises(TransferError) as err:
            await send(rx, big, make_source(pool, 2), max_batch_bytes=2 * pool.page_bytes)
        assert err.value.reason == "BATCH_TOO_LARGE"
        await asyncio.sleep(0.2)
        assert counted("PROTOCOL") == 0 and counted("DUPLICATE_PAGE") == 1
    finally:
        await dec.stop(grace=0)


@pytest.mark.parametrize("stuck", [0, 3])
async def test_a_stopping_receiver_waits_for_its_connections_together_and_boundedly(stuck):
    """A node's stop is bounded (node_main.STOP_TAIL_S, which the chart adds to the pod's grace
    period). The receiver waited up to 5 s for each connection's handler in turn; a handler that
    ucxx holds past the abort is now cancelled after HANDLERS_STOP_S, all of them together.
    Control (0 stuck): silent connections' handlers end on the abort, and stop() is quick.

    Asserted by what happens, not how long it took: every stuck handler is cancelled, and each
    finds, as its cancellation arrives, every other stuck one already cancelled (one wait for
    all of them; waited for in turn, the first would be cancelled alone); the silent
    connections' handlers end by themselves on the abort (cancelled, they would have been
    left to the wait's timeout, or cancelled at once without a wait)."""
    rx, _ = await make_receiver(make_pool())
    flood = await raw_endpoints(rx.port, 4)
    assert await eventually(lambda: rx.unverified == 4)
    served = set(rx._handlers)  # the flood's handlers, each waiting for a hello
    assert len(served) == 4
    started = 0
    cancelled_with: list[int] = []  # per stuck handler: how many stuck ones stop() had cancelled

    async def stuck_handler() -> None:
        nonlocal started
        started += 1
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled_with.append(sum(1 for h in held if h.cancelling()))
            raise

    held = [asyncio.create_task(stuck_handler()) for _ in range(stuck)]
    rx._handlers.update(held)  # handlers that the abort does not end
    try:
        await rx.stop()
        assert started == stuck  # each ran into its sleep before stop() cancelled it
        assert all(t.cancelled() for t in held)
        assert cancelled_with == [stuck] * stuck  # together, not one after another
        assert all(t.done() and not t.cancelled() for t in served)  # ended on the abort
        assert not rx._handlers - set(held)
    finally:
        for ep in flood:
            ep.abort()
