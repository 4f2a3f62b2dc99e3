"""A batch that decode refuses after reading its header, because the reservation was released
while the handler awaited that header, has the pages sent behind the header drained into the
scratch page like any other refused batch's (``strays``), not left in UCX."""

from __future__ import annotations

import asyncio

import pytest
from asyncwait import eventually
from test_transfer import holds, make_pool, make_receiver, send_batch_of_a

from kvfence.errors import RESERVATION_RELEASED
from kvfence.transfer import InboundState, _recv_json, _within


@pytest.mark.parametrize("release", [True, False], ids=["released", "control"])
async def test_a_batch_refused_as_released_after_its_header_has_its_pages_drained(release):
    """_receive_batches cleared ``strays`` before _receive_pages checked that the reservation
    still receives and owns its pages; a batch that check refused (RESERVATION_RELEASED, no
    receive posted) left the pages sent behind its header in UCX for good. Released here with
    an endpoint abort that does not take effect (cancel() suppresses its errors), so the
    connection lingers and can drain. Control: not released, the same batch lands in the
    reserved pages and nothing is drained."""
    import ucxx

    pool = make_pool(pages=2)
    # a short batch timeout: the refused connection's linger ends (and counts its drains) soon
    rx, events = await make_receiver(pool, max_batch_bytes=4 * pool.page_bytes, batch_timeout_s=1.0)
    refs = pool.allocate(2, "A")
    t = rx.expect("A", "reqA", b"k" * 32, refs)
    real = rx._receive_pages

    async def release_first(ep, tr, batch, indices):
        if release:  # decode's Release, in the window between the header and the check
            tr.ep = None  # its endpoint abort does not happen
            rx.cancel("A")
            pool.release("A")
            rx.forget("A")
        return await real(ep, tr, batch, indices)

    rx._receive_pages = release_first
    ep = await ucxx.create_endpoint("127.0.0.1", rx.port)
    try:
        # the pages sent right behind the header, before decode answers (it answers a batch)
        sources, sends = await send_batch_of_a(ep, pool)
        [answer] = await _within(ep, [_recv_json(ep, reply=True)], 5)
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        if release:
            # the Release cancelled it: said in a reason prefill knows (it was "cancelled")
            assert answer == {"ok": False, "error": RESERVATION_RELEASED}
            assert t.state == InboundState.CANCELLED
            assert await eventually(lambda: rx.strays_drained == 2), (
                rx.strays_posted,
                rx.strays_drained,
            )
            assert rx.strays_posted == 2
            assert all(pool.kv[r.page_id].abs().sum() == 0 for r in refs)  # nothing in the pool
            assert "integrity_violation" not in [k for k, _ in events]
        else:
            assert answer["ok"] and answer["received"] == 2
            assert t.state == InboundState.COMPLETE and holds(pool, refs, sources)
            assert rx.strays_posted == 0 and rx.strays_drained == 0
        pool.check_integrity()
    finally:
        ep.abort()
        await rx.stop()
