"""The stray pages decode drains behind a refused hello are bounded by what the hello proves.

Decode drains the pages a refused warm hello had right behind it (into a scratch page) so that
they neither stay in UCX for good nor hold up the sender's rendezvous sends. It drained as many
as the named reservation had for any hello naming a known or released id, with or without its
authenticator: reservation ids are no secret, so any peer that learnt one could make decode post
that many receives per connection, and its late-hello events (RESERVATION_RELEASED) were not
bounded at all. Now a hello without the reservation's authenticator drains at most
UNKNOWN_RESERVATION_STRAYS, as one for an unknown id, and its events are bounded (decode_svc).
Controls: a genuine late sender (the right authenticator, its reservation released by decode)
still has every page it sent drained and fails RESERVATION_RELEASED at once, and its events are
never held back.
"""

from __future__ import annotations

import asyncio

import pytest
from asyncwait import eventually
from test_transfer import make_receiver, make_source, send, start_decode

from kvfence.kv.pool import PagePool
from kvfence.transfer import (
    UNKNOWN_RESERVATION_STRAYS,
    EndpointPool,
    InboundState,
    KvReceiver,
    TransferError,
    _recv_json,
    _send_json,
    _within,
    page_buffer,
    page_tags,
)

N = UNKNOWN_RESERVATION_STRAYS + 24  # pages of the victim reservation: more than the bound


def big_pool() -> PagePool:
    # 32 KiB pages: over UCX's eager limit on TCP, so a page nobody receives holds its send up
    return PagePool(N + 8, num_layers=2, page_size=4, num_kv_heads=2, head_dim=256)


async def forged_hello(rx: KvReceiver, rid: str, n_pages: int) -> dict:
    """A warm hello for ``rid`` with a wrong authenticator on a new connection, ``n_pages``
    pages really sent behind it; decode's answer once decode posted its scratch receives. The
    connection is aborted before this returns (decode's linger ends)."""
    import ucxx

    posted = rx.strays_posted
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    sends: list[asyncio.Future] = []
    try:
        hello = {
            "reservation_id": rid,
            "request_id": "forger",
            "auth": "0" * 64,
            "v": 4,
            "batch": {"indices": list(range(n_pages)), "last": True},
        }
        await _send_json(ep, hello, frame=True)
        tags = page_tags(rid, 0, n_pages)
        sends = [
            asyncio.ensure_future(ep.send(page_buffer(s), tag=tag))
            for s, tag in zip(make_source(rx.pool, n_pages, fill=-7.0), tags, strict=True)
        ]
        [answer] = await _within(ep, [_recv_json(ep, reply=True)], 5)
        assert await eventually(lambda: rx.strays_posted > posted)
    finally:
        ep.abort()
        if sends:  # the pages decode did not drain: completed (cancelled) by the abort
            await asyncio.wait(sends, timeout=5)
            for s in sends:
                _ = s.cancelled() or s.exception()
    assert await eventually(lambda: rx.open_endpoints == 0, timeout=3 * rx.batch_timeout_s)
    return answer


def released(rx: KvReceiver, rid: str, n: int) -> None:
    """Reserve ``n`` pages for ``rid`` and release them, as DecodeServicer._release does."""
    rx.expect(rid, f"req-{rid}", b"k" * 32, rx.pool.allocate(n, rid))
    rx.cancel(rid)
    rx.pool.release(rid)
    rx.forget(rid)


async def test_a_hello_without_the_authenticator_drains_no_more_than_an_unknown_ids():
    pool = big_pool()
    rx, events = await make_receiver(pool, batch_timeout_s=2.0, max_batch_bytes=16 << 20)
    try:
        rid = rx.new_reservation_id()
        released(rx, rid, N)
        answer = await forged_hello(rx, rid, N)
        assert answer == {"ok": False, "error": "RESERVATION_RELEASED"}
        assert rx.strays_posted == UNKNOWN_RESERVATION_STRAYS  # not N
        assert events == [
            (
                "transfer_failed",
                {
                    "reason": "RESERVATION_RELEASED",
                    "reservation_id": rid[:64],
                    "stage": "ucx_hello",
                    "authenticated": False,
                },
            )
        ]

        live = rx.new_reservation_id()
        t = rx.expect(live, "req-live", b"k" * 32, pool.allocate(N, live))
        posted = rx.strays_posted
        answer = await forged_hello(rx, live, N)
        assert answer == {"ok": False, "error": "BAD_AUTHENTICATOR"}
        assert rx.strays_posted - posted == UNKNOWN_RESERVATION_STRAYS
        assert events[-1][0] == "integrity_violation"
        assert t.state == InboundState.EXPECTING  # untouched: its own transfer may still come
        assert rx.handler_errors == 0
    finally:
        await rx.stop()


async def test_a_genuine_late_sender_still_has_every_page_it_sent_drained():
    """Control: the sender holds the authenticator; decode released its reservation between
    Reserve and the transfer. Every page of its warm batch 0 is drained (more than the bound for
    forged hellos) and the sender fails RESERVATION_RELEASED, its sends completed."""
    pool = big_pool()
    rx, events = await make_receiver(pool, batch_timeout_s=2.0, max_batch_bytes=16 << 20)
    eps = EndpointPool()
    try:
        warm = rx.expect("res-warm", "req-warm", b"k" * 32, pool.allocate(1, "res-warm"))
        await send(rx, warm, make_source(pool, 1), endpoints=eps)
        assert warm.state == InboundState.COMPLETE and eps.idle("127.0.0.1", rx.port) == 1

        rid = rx.new_reservation_id()
        t = rx.expect(rid, "req-late", b"s" * 32, pool.allocate(N, rid))
        rx.cancel(rid)
        pool.release(rid)
        rx.forget(rid)
        with pytest.raises(TransferError) as err:
            await send(rx, t, make_source(pool, N), endpoints=eps, max_batch_bytes=16 << 20)
        assert err.value.reason == "RESERVATION_RELEASED" and err.value.refused
        assert eps.reused == 1  # a warm endpoint: batch 0 went right behind the hello
        assert rx.strays_posted == N
        assert await eventually(lambda: rx.strays_drained == N, timeout=3 * rx.batch_timeout_s)
        assert events == [
            (
                "transfer_failed",
                {"reason": "RESERVATION_RELEASED", "reservation_id": rid, "stage": "ucx_hello"},
            )
        ]
    finally:
        await eps.close()
        await rx.stop()


async def test_late_hellos_without_the_authenticator_are_bounded_events(tmp_path):
    """On a decode node: forged late hellos past HELLO_EVENTS_BURST are held back and summed up
    in one event; genuine late hellos (control) are all reported, even past the bound."""
    from decode_svc.service import HELLO_EVENTS_BURST

    dec = await start_decode(tmp_path, batch_timeout_s=1.0)
    rx = dec.receiver
    n = HELLO_EVENTS_BURST + 3
    try:
        rid = rx.new_reservation_id()
        rx.expect(rid, "req-gone", b"k" * 32, rx.pool.allocate(1, rid))
        rx.cancel(rid)
        rx.pool.release(rid)
        rx.forget(rid)
        for _ in range(n):
            await forged_hello(rx, rid, 1)

        def late(**match):
            return [
                e
                for e in dec.bus.recent
                if e.get("reason") == "RESERVATION_RELEASED"
                and all(e.get(k) == v for k, v in match.items())
            ]

        assert len(late()) == HELLO_EVENTS_BURST
        assert all(e.get("authenticated") is False for e in late())
        # control: a genuine one (the right authenticator, sent by prefill's send_pages) is
        # reported though the bound was reached
        genuine = rx.new_reservation_id()
        t = rx.expect(genuine, "req-genuine", b"g" * 32, rx.pool.allocate(1, genuine))
        rx.cancel(genuine)
        rx.pool.release(genuine)
        rx.forget(genuine)
        with pytest.raises(TransferError) as err:
            await send(rx, t, make_source(rx.pool, 1))
        assert err.value.reason == "RESERVATION_RELEASED"
        assert await eventually(lambda: len(late(reservation_id=genuine)) == 1)
        assert "authenticated" not in late(reservation_id=genuine)[0]
        dec.servicer.flush_hello_events(force=True)
        summary = late(suppressed=n - HELLO_EVENTS_BURST)
        assert len(summary) == 1 and summary[0]["authenticated"] is False
    finally:
        await dec.stop(grace=0)
