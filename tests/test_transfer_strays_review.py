"""Decode's drain of stray pages behind a refused hello or batch is bounded by decode's own
reservation, never by the sender's count of indices; a hello no check foresaw cannot escape the
connection handler into ucxx."""

from __future__ import annotations

import asyncio
import logging

import pytest
import structlog
from asyncwait import eventually
from test_transfer import holds, make_pool, make_receiver, make_source, send, warm_setup

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
    pages_per_batch,
)

BIG_BATCH = 16 << 20  # the default transfer.max_batch_bytes: thousands of pages per batch here


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def ucx_errors():
    """What ucxx logs at error (an exception that escaped a listener callback is one such line
    per connection); its "ucx" logger does not propagate, so caplog would not see it."""
    handler = _Records()
    logger = logging.getLogger("ucx")
    logger.addHandler(handler)
    try:
        yield lambda: [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]
    finally:
        logger.removeHandler(handler)


async def refused_hello(
    rx: KvReceiver, pool: PagePool, rid: str, n_indices: int, n_pages: int = 0
) -> dict:
    """On a new connection, a warm hello for ``rid`` with a wrong authenticator whose batch 0
    names ``n_indices`` pages, ``n_pages`` of them really sent behind it; returns decode's
    answer once decode has posted its scratch receives for the strays (the endpoint is then
    closed, ending decode's linger)."""
    import ucxx

    posted = rx.strays_posted
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        hello = {
            "reservation_id": rid,
            "request_id": "req",
            "auth": "0" * 64,
            "v": 4,
            "batch": {"indices": list(range(n_indices)), "last": True},
        }
        await _send_json(ep, hello)
        sources = make_source(pool, n_pages, fill=-3.0)
        tags = page_tags(rid, 0, n_pages)
        sends = [ep.send(page_buffer(s), tag=tag) for s, tag in zip(sources, tags, strict=True)]
        [answer] = await _within(ep, [_recv_json(ep, reply=True)], 5)
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        # decode posts its scratch receives right after it answered
        assert await eventually(lambda: rx.strays_posted > posted)
        if n_pages:
            drained = rx.strays_drained
            want = min(n_pages, rx.strays_posted - posted)
            # Decode adds the drained receives up when its linger ends, and the endpoint is
            # still open here: that is after its batch_timeout_s (5 s), eventually's default
            # too, so wait past it, as for the endpoint below, rather than race it.
            assert await eventually(
                lambda: rx.strays_drained - drained == want, timeout=3 * rx.batch_timeout_s
            )
    finally:
        ep.abort()
    # Decode lingers up to its batch_timeout_s (5 s) for the sender to close: on a loaded
    # machine UCX may see the abort only then, so wait past it rather than race it.
    assert await eventually(lambda: rx.open_endpoints == 0, timeout=3 * rx.batch_timeout_s)
    return answer


async def test_a_refused_hello_drains_no_more_than_decodes_own_reservation():
    """Decode drained min(indices, its pages_per_batch) scratch receives behind any refused
    hello: thousands with the default max_batch_bytes, for an unauthenticated peer naming any id.
    Now: an unknown id gets at most UNKNOWN_RESERVATION_STRAYS, a known reservation (wrong
    authenticator) its own pages, a released one the pages it had."""
    pool = make_pool(pages=8)
    rx, _ = await make_receiver(pool, max_batch_bytes=BIG_BATCH)
    try:
        assert pages_per_batch(BIG_BATCH, pool.page_bytes) >= 1000  # the old bound was no bound
        answer = await refused_hello(rx, pool, "never-issued", 1000)
        assert answer == {"ok": False, "error": "UNKNOWN_RESERVATION"}
        assert rx.strays_posted == UNKNOWN_RESERVATION_STRAYS

        t = rx.expect("res-known", "req-known", b"k" * 32, pool.allocate(2, "res-known"))
        posted = rx.strays_posted
        answer = await refused_hello(rx, pool, "res-known", 1000)
        assert answer == {"ok": False, "error": "BAD_AUTHENTICATOR"}
        assert rx.strays_posted - posted == 2

        rx.expect("res-gone", "req-gone", b"k" * 32, pool.allocate(3, "res-gone"))
        rx.cancel("res-gone")
        pool.release("res-gone")
        rx.forget("res-gone")
        posted = rx.strays_posted
        answer = await refused_hello(rx, pool, "res-gone", 1000)
        assert answer == {"ok": False, "error": "RESERVATION_RELEASED"}
        assert rx.strays_posted - posted == 3

        # positive controls: pages really sent behind a refused hello are still drained, up to
        # the bound (the rest of an unknown id's stay in UCX) ...
        drained = rx.strays_drained
        await refused_hello(rx, pool, "res-known", 2, n_pages=2)
        assert rx.strays_drained - drained == 2
        drained = rx.strays_drained
        n = UNKNOWN_RESERVATION_STRAYS + 4
        await refused_hello(rx, pool, "never-issued-2", n, n_pages=n)
        assert rx.strays_drained - drained == UNKNOWN_RESERVATION_STRAYS
        # ... and the known reservation still takes its one valid transfer, untouched by them
        assert all(pool.kv[r.page_id].abs().sum() == 0 for r in t.pages)
        sources = make_source(pool, 2, fill=5.0)
        await send(rx, t, sources)
        assert t.state == InboundState.COMPLETE and holds(pool, t.pages, sources)
        assert rx.handler_errors == 0
        pool.check_integrity()
    finally:
        await rx.stop()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_a_batch_too_large_has_every_page_sent_behind_it_drained(warm):
    """Prefill's max_batch_bytes over decode's (a rollout half done): decode refuses the batch
    BATCH_TOO_LARGE but drained only its own pages_per_batch of the pages sent behind the
    header; the rest stayed in UCX for good. Now every one of them, up to the reservation's
    size. Control: the same pages in batches decode takes are received."""
    pool, rx, _, eps = await warm_setup(max_batch_bytes=pool_page_bytes())
    if not warm:
        await eps.close()
        eps = EndpointPool()
    try:
        n = 4
        t = rx.expect("res-big", "req-big", b"k" * 32, pool.allocate(n, "res-big"))
        drained = rx.strays_drained
        with pytest.raises(TransferError) as err:
            await send(rx, t, make_source(pool, n), endpoints=eps,
                       max_batch_bytes=n * pool.page_bytes)  # fmt: skip
        assert err.value.reason == "BATCH_TOO_LARGE"
        assert (eps.reused == 1) == warm and rx.warm_hellos == int(warm)
        await asyncio.wait_for(t.done.wait(), 5)
        assert t.state == InboundState.FAILED and t.received == []
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert await eventually(lambda: rx.strays_drained - drained == n), rx.strays_drained
        assert all(pool.kv[r.page_id].abs().sum() == 0 for r in t.pages)

        # control: batches within decode's max_batch_bytes are received, nothing to drain
        drained = rx.strays_drained
        t2 = rx.expect("res-ok", "req-ok", b"k" * 32, pool.allocate(n, "res-ok"))
        sources = make_source(pool, n, fill=9.0)
        await send(rx, t2, sources, endpoints=eps, max_batch_bytes=pool.page_bytes)
        assert t2.state == InboundState.COMPLETE and holds(pool, t2.pages, sources)
        assert rx.strays_drained == drained
        pool.check_integrity()
    finally:
        await eps.close()
        await rx.stop()


def pool_page_bytes() -> int:
    return make_pool().page_bytes


@pytest.mark.parametrize("rid", ["\ud800", "plain-unknown"], ids=["surrogate", "ascii"])
async def test_a_hello_naming_a_lone_surrogate_is_refused_like_any_unknown_id(rid, ucx_errors):
    """A reservation id with a lone surrogate (valid JSON, "\\ud800") made the page tags' encode
    raise out of the handler: no answer, no drain, a traceback from ucxx per connection. Control:
    an ASCII unknown id gets the same answer."""
    import ucxx

    pool = make_pool()
    rx, events = await make_receiver(pool, batch_timeout_s=2.0)
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        hello = {"reservation_id": rid, "request_id": "r", "auth": "x", "v": 4,
                 "batch": {"indices": [0], "last": True}}  # fmt: skip
        await _send_json(ep, hello, frame=True)  # json.dumps: the surrogate as \ud800
        [answer] = await _within(ep, [_recv_json(ep, reply=True)], 3.0)
        assert answer == {"ok": False, "error": "UNKNOWN_RESERVATION"}
        assert await eventually(lambda: rx.strays_posted == 1)  # it lingers and drains
        ep.abort()
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert rx.handler_errors == 0
        assert [e[1]["check"] for e in events] == ["UNKNOWN_RESERVATION"]
        assert ucx_errors() == []
    finally:
        ep.abort()
        await rx.stop()


@pytest.mark.parametrize("fails", [True, False], ids=["handler-raises", "control"])
async def test_a_handler_that_raises_ends_its_connection_and_logs_at_a_limited_rate(
    fails, ucx_errors, monkeypatch
):
    """Whatever a connection's handler raises stays in decode: the connection is aborted,
    counted, and logged at error at most once per REJECT_LOG_INTERVAL_S (a burst in one more
    line), never left to ucxx's per-connection traceback. Control: the same hellos, served by
    the real handler, are refused with an answer and nothing is counted."""
    import ucxx

    import kvfence.transfer as transfer_mod

    monkeypatch.setattr(transfer_mod, "REJECT_LOG_INTERVAL_S", 30.0)
    pool = make_pool()
    rx, _ = await make_receiver(pool, batch_timeout_s=2.0)
    if fails:

        async def broken(ep, hello, strays):
            raise RuntimeError("a case no check foresaw")

        rx._serve_one = broken  # type: ignore[method-assign]
    eps = []
    with structlog.testing.capture_logs() as logs:
        try:
            for k in range(3):
                ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
                eps.append(ep)
                await _send_json(ep, {"reservation_id": f"nope-{k}", "auth": "x", "v": 4})
                if not fails:
                    [answer] = await _within(ep, [_recv_json(ep, reply=True)], 3.0)
                    assert answer == {"ok": False, "error": "UNKNOWN_RESERVATION"}
                    ep.abort()
            assert await eventually(lambda: rx.handler_errors == (3 if fails else 0))
            assert await eventually(lambda: rx.open_endpoints == 0)
            failed = [e for e in logs if e["event"] == "UCX connection handler failed"]
            assert [e["failed"] for e in failed] == ([1] if fails else [])
        finally:
            for ep in eps:
                ep.abort()
            await rx.stop()  # logs the rest of the burst
        failed = [e for e in logs if e["event"] == "UCX connection handler failed"]
    assert [e["failed"] for e in failed] == ([1, 2] if fails else [])
    assert all(e["log_level"] == "error" for e in failed)
    if fails:
        assert "RuntimeError: a case no check foresaw" in failed[0]["error"]
    assert ucx_errors() == []
