"""The UCX data path against a real pool: pages land only in reserved buffers, errors settle ops."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvfence.kv.pool import PagePool, PageState
from kvfence.transfer import (
    InboundState,
    KvReceiver,
    OutboundPage,
    TransferError,
    page_buffer,
    send_pages,
)


def make_pool(pages: int = 8) -> PagePool:
    return PagePool(pages, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)


def make_source(pool: PagePool, n: int, fill: float = 1.0) -> list[torch.Tensor]:
    return [torch.full(pool.kv.shape[1:], fill + i) for i in range(n)]


async def make_receiver(pool: PagePool, **kw) -> tuple[KvReceiver, list]:
    events: list = []
    rx = KvReceiver(
        pool,
        host="127.0.0.1",
        max_batch_bytes=kw.get("max_batch_bytes", 2 * pool.page_bytes),
        batch_timeout_s=kw.get("batch_timeout_s", 5.0),
        report=lambda kind, payload: events.append((kind, payload)),
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
