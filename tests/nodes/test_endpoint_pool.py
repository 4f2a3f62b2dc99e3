"""Prefill reuses UCX endpoints to a decode node: one transfer per endpoint at a time, an endpoint
whose transfer failed is never reused, a stale one is replaced, and nothing is left after close."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest
import torch
from asyncwait import eventually
from test_prefill_decode import make_cfg, run_request

from kvfence.auth import with_token
from kvfence.config import Role
from kvfence.kv.pool import PagePool
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node
from kvfence.proto.kvfence.v1 import decode_pb2_grpc, prefill_pb2_grpc
from kvfence.transfer import (
    PROTOCOL_VERSION,
    EndpointPool,
    InboundState,
    KvReceiver,
    OutboundPage,
    TransferError,
    page_buffer,
    page_tag,
    send_pages,
)

# ---- transfer level: a KvReceiver and an EndpointPool in this process ---------------------------


def make_pool() -> PagePool:
    return PagePool(32, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8)


async def make_receiver(pool: PagePool, port: int = 0, **kw) -> tuple[KvReceiver, list]:
    events: list = []
    rx = KvReceiver(
        pool,
        host="127.0.0.1",
        port=port,
        max_batch_bytes=2 * pool.page_bytes,
        batch_timeout_s=kw.get("batch_timeout_s", 5.0),
        idle_timeout_s=kw.get("idle_timeout_s", 60.0),
        report=lambda kind, payload: events.append((kind, payload)),
    )
    await rx.start()
    return rx, events


@contextlib.asynccontextmanager
async def transfer_rig(
    eps: EndpointPool | None = None, **kw
) -> AsyncIterator[tuple[PagePool, KvReceiver, list, EndpointPool, Transfers]]:
    """A page pool, decode's receiver over it (``kw`` as for :func:`make_receiver`), prefill's
    endpoint pool (a default one unless given) and a :class:`Transfers` driver; on the way out
    prefill's endpoints are closed and the receiver stopped, whatever the test did."""
    pool = make_pool()
    rx, events = await make_receiver(pool, **kw)
    eps = EndpointPool() if eps is None else eps
    try:
        yield pool, rx, events, eps, Transfers(pool, rx, eps)
    finally:
        await eps.close()
        await rx.stop()


class Transfers:
    """Reserves pages on the receiver and sends distinct bytes into them through ``eps``."""

    def __init__(self, pool: PagePool, rx: KvReceiver, eps: EndpointPool):
        self.pool, self.rx, self.eps, self.n = pool, rx, eps, 0

    async def run(self, n_pages: int = 3, *, auth: str | None = None, stall: float = 0.0,
                  batch_timeout_s: float = 5.0):  # fmt: skip
        self.n += 1
        rid = f"res-{self.n}"
        refs = self.pool.allocate(n_pages, rid)
        assert refs is not None
        t = self.rx.expect(rid, f"req-{self.n}", b"k" * 32, refs)
        src = [torch.full(self.pool.kv.shape[1:], 100.0 * self.n + i) for i in range(n_pages)]
        try:
            await send_pages(
                self.rx.address,
                reservation_id=rid,
                request_id=t.request_id,
                secret=b"k" * 32,
                pages=[OutboundPage(i, page_buffer(s)) for i, s in enumerate(src)],
                page_bytes=self.pool.page_bytes,
                max_batch_bytes=2 * self.pool.page_bytes,
                batch_timeout_s=batch_timeout_s,
                endpoints=self.eps,
                auth_override=auth,
                stall_after_hello_s=stall,
            )
            await asyncio.wait_for(t.done.wait(), 5)
            assert t.state == InboundState.COMPLETE
            for i, ref in enumerate(refs):
                assert torch.equal(self.pool.kv[ref.page_id], src[i])
        finally:
            self.rx.cancel(rid)
            await asyncio.wait_for(t.done.wait(), 10)
            self.pool.release(rid)
            self.rx.forget(rid)


async def test_consecutive_transfers_share_one_endpoint():
    async with transfer_rig() as (pool, rx, events, eps, tr):
        for _ in range(3):
            await tr.run()
        assert (eps.opened, eps.reused, eps.discarded) == (1, 2, 0)
        assert rx.connections == 1 and rx.transfers_served == 3
        assert eps.idle("127.0.0.1", rx.port) == 1
        assert events == []
    assert eps.open_endpoints == 0
    pool.check_integrity()
    assert pool.num_free == pool.num_pages


async def test_without_a_pool_every_transfer_has_its_own_endpoint():
    pool = make_pool()
    rx, _ = await make_receiver(pool)
    try:
        tr = Transfers(pool, rx, None)  # type: ignore[arg-type]
        await tr.run()
        await tr.run()
        assert rx.connections == 2
        assert await eventually(lambda: rx.open_endpoints == 0)
    finally:
        await rx.stop()


async def test_decode_without_reuse_gets_a_new_endpoint_per_transfer(monkeypatch):
    """A decode that does not say v >= 2 in its hello answer (an older one lingers after its final
    answer and serves no second hello) is sent ``done`` and its endpoints are never pooled."""
    import kvfence.transfer as transfer

    monkeypatch.setattr(transfer, "PROTOCOL_VERSION", 1)
    async with transfer_rig() as (_pool, rx, events, eps, tr):
        await tr.run()
        await tr.run()
        assert (eps.opened, eps.reused, eps.open_endpoints) == (2, 0, 0)
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert events == []


@pytest.mark.parametrize("failure", ["bad_auth", "timeout"])
async def test_failed_transfer_discards_its_endpoint_and_the_next_uses_a_new_one(failure):
    async with transfer_rig(batch_timeout_s=0.5) as (pool, rx, events, eps, tr):
        await tr.run(batch_timeout_s=0.5)  # leaves one idle endpoint
        assert (eps.opened, eps.reused) == (1, 0)
        with pytest.raises(TransferError) as err:
            if failure == "bad_auth":
                await tr.run(auth="0" * 64, batch_timeout_s=0.5)
            else:
                await tr.run(stall=1.5, batch_timeout_s=0.5)
        if failure == "bad_auth":
            assert err.value.reason == "BAD_AUTHENTICATOR" and err.value.refused
        # the failing transfer ran on the pooled endpoint, which is now gone for good
        assert (eps.opened, eps.reused, eps.discarded) == (1, 1, 1)
        assert eps.idle("127.0.0.1", rx.port) == 0 and eps.open_endpoints == 0
        assert await eventually(lambda: rx.open_endpoints == 0)
        # positive control: the next transfer succeeds, on a new endpoint
        await tr.run(batch_timeout_s=0.5)
        assert (eps.opened, eps.discarded) == (2, 1) and rx.connections == 2
        assert any(kind in ("integrity_violation", "transfer_failed") for kind, _ in events)
    pool.check_integrity()


@pytest.mark.parametrize("when", ["during_hello", "mid_transfer"])
async def test_cancelled_transfer_discards_its_endpoint(when):
    async with transfer_rig() as (pool, rx, _, eps, tr):
        await tr.run()  # one idle endpoint
        task = asyncio.ensure_future(tr.run(stall=5.0 if when == "mid_transfer" else 0.0))
        if when == "mid_transfer":
            assert await eventually(lambda: eps.reused == 1 and rx.transfers_served == 2)
        else:
            await asyncio.sleep(0)  # the hello is on its way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await eventually(lambda: eps.open_endpoints == 0)
        assert eps.discarded == 1 and eps.idle("127.0.0.1", rx.port) == 0
        assert await eventually(lambda: rx.open_endpoints == 0)
        await tr.run()  # positive control, on a new endpoint
        assert eps.opened == 2
    pool.check_integrity()


class Unaware:
    """A pooled endpoint as seen before UCX noticed that its peer went away."""

    def __init__(self, ep):
        self._ep = ep

    closed = False

    def __getattr__(self, name):
        return getattr(self._ep, name)


@pytest.mark.parametrize("noticed", [True, False])
async def test_stale_pooled_endpoint_is_replaced_transparently(noticed):
    """Decode dropped every connection (as a restarted decode has none of them) while prefill
    held one idle: the next transfer still succeeds, on a new endpoint. ``noticed``: UCX already
    marked the endpoint closed (skipped when taken), else its hello fails and is said again."""
    async with transfer_rig() as (pool, rx, events, eps, tr):
        await tr.run()
        assert eps.idle("127.0.0.1", rx.port) == 1
        for ep in list(rx._endpoints):
            ep.abort()  # the peer side of prefill's idle endpoint is gone
        assert await eventually(lambda: rx.open_endpoints == 0)
        [(stale, since, version)] = eps._idle[("127.0.0.1", rx.port)]
        assert version == PROTOCOL_VERSION  # so the next transfer starts warm
        if noticed:
            assert await eventually(lambda: stale.closed)
        else:
            eps._idle[("127.0.0.1", rx.port)] = [(Unaware(stale), since, version)]
        await tr.run()  # no error reaches the caller
        assert (eps.opened, eps.discarded) == (2, 1)
        assert eps.reused == (0 if noticed else 1)
        assert rx.connections == 2 and rx.transfers_served == 2
        await tr.run()  # and the new endpoint is pooled in turn
        assert eps.opened == 2 and rx.connections == 2
        assert events == []
    pool.check_integrity()


async def test_warm_hello_that_decode_may_have_taken_is_not_said_again(monkeypatch):
    """On a warm endpoint the pages go out with the hello, so once the hello has left, a failure
    is final: decode may have accepted it (here it did, then lost the endpoint), and saying it
    again would at best be refused as a replay. The stale-endpoint test above is the control:
    there the hello never left and is said again on a new endpoint."""
    async with transfer_rig() as (pool, rx, events, eps, tr):
        await tr.run()
        original = rx._receive_pages

        async def lose_endpoint(ep, t, batch, indices):
            ep.abort()  # decode accepted the hello, then its endpoint broke
            await original(ep, t, batch, indices)

        monkeypatch.setattr(rx, "_receive_pages", lose_endpoint)
        with pytest.raises(TransferError) as err:
            await tr.run()
        assert not err.value.refused and not err.value.timeout
        assert err.value.reason == "TRANSFER_FAILED"
        assert rx.warm_hellos == 1 and rx.transfers_served == 2
        # not retried: no new endpoint, no second hello (which decode would call a replay)
        assert (eps.opened, eps.reused, eps.discarded) == (1, 1, 1) and rx.connections == 1
        # decode's handler ended (it failed the transfer, or completed it and lost only its
        # answer: a receive posted on the broken endpoint may still take a page already queued)
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert not any(kind == "integrity_violation" for kind, _ in events)  # no replayed hello
        monkeypatch.setattr(rx, "_receive_pages", original)
        await tr.run()  # positive control: the next transfer, on a new endpoint
        assert eps.opened == 2
    pool.check_integrity()


class FakeEndpoint:
    closed = False

    def abort(self) -> None:
        self.closed = True


async def test_pool_remembers_the_protocol_version_per_endpoint():
    eps = EndpointPool()
    a, b = FakeEndpoint(), FakeEndpoint()
    for ep in (a, b):
        eps._leased[ep] = 0  # as connect() leases a new endpoint: version not known yet
    assert eps.peer_version(a) == 0
    eps.give_back("h", 1, a, version=4)
    eps.give_back("h", 1, b, version=3)
    assert eps.take("h", 1) is b and eps.peer_version(b) == 3  # most recently used first
    assert eps.take("h", 1) is a and eps.peer_version(a) == 4
    eps.give_back("h", 1, a)  # no version given: what the pool knew stays
    assert eps.take("h", 1) is a and eps.peer_version(a) == 4
    eps.discard(a)
    assert eps.peer_version(a) == 0 and eps.peer_version(b) == 3
    await eps.close()


async def test_an_idle_endpoint_past_its_timeout_is_never_leased(monkeypatch):
    """Between two reaper rounds an idle endpoint can outlive idle_timeout_s; decode may have
    closed its side by then, so take() must not lease it (the transfer on it would fail)."""
    import kvfence.transfer as transfer

    now = [1000.0]
    monkeypatch.setattr(transfer.time, "monotonic", lambda: now[0])
    eps = EndpointPool(idle_timeout_s=10.0)
    old, fresh = FakeEndpoint(), FakeEndpoint()
    for ep in (old, fresh):
        eps._leased[ep] = 4
    eps.give_back("h", 1, old)
    now[0] += 9.0
    eps.give_back("h", 1, fresh)
    now[0] += 2.0  # old: idle 11 s; fresh: 2 s
    assert eps.take("h", 1) is fresh  # control: a young one is leased
    assert eps.take("h", 1) is None and eps.expired == 1 and old.closed
    await eps.close()


async def test_pool_is_bounded_and_idle_endpoints_expire():
    bounded = EndpointPool(max_idle_per_peer=2, idle_timeout_s=0.3)
    async with transfer_rig(eps=bounded) as (_pool, rx, _, eps, tr):
        await asyncio.gather(*[tr.run(n_pages=2) for _ in range(5)])
        assert eps.opened == 5  # concurrent transfers never share an endpoint
        assert eps.idle("127.0.0.1", rx.port) == 2 and eps.open_endpoints == 2
        assert await eventually(lambda: rx.open_endpoints == 2)
        # unused for idle_timeout_s: closed by the pool (prefill closes first), decode follows
        assert await eventually(lambda: eps.open_endpoints == 0)
        assert eps.expired == 2
        assert await eventually(lambda: rx.open_endpoints == 0)
        assert await eventually(lambda: eps._reaper is None or eps._reaper.done())
        await tr.run()
        assert eps.opened == 6


async def test_close_leaves_no_endpoint_on_either_side():
    async with transfer_rig() as (_pool, rx, _, eps, tr):
        await asyncio.gather(*[tr.run(n_pages=2) for _ in range(3)])
        assert eps.open_endpoints == 3
        await eps.close()
        assert eps.open_endpoints == 0 and eps._reaper is None
        assert await eventually(lambda: rx.open_endpoints == 0)
        with pytest.raises(TransferError):
            await tr.run()  # a closed pool opens nothing
        assert eps.open_endpoints == 0
    assert rx.open_endpoints == 0 and not rx._handlers


# ---- node level: prefill and decode nodes, driven the way the control plane drives them ---------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
async def fault_nodes(tiny_model, tmp_path):
    fault_file = tmp_path / "faults.json"
    fault_file.write_text("[]")
    cfg = make_cfg(tiny_model, tmp_path, node={"fault_hook": True, "fault_file": str(fault_file)})
    dec = await start_node(cfg, Role.DECODE, register=False)
    pre = await start_node(cfg, Role.PREFILL, register=False)
    dch = grpc.aio.insecure_channel(dec.address)
    pch = grpc.aio.insecure_channel(pre.address)
    stopped: list = []

    async def stop_prefill() -> None:
        stopped.append(pre)
        await pre.stop(grace=1)

    try:
        yield (
            dec,
            pre,
            with_token(decode_pb2_grpc.DecodeStub(dch), dec.node_token),
            with_token(prefill_pb2_grpc.PrefillStub(pch), pre.node_token),
            fault_file,
            stop_prefill,
        )
    finally:
        await dch.close()
        await pch.close()
        if not stopped:
            await pre.stop(grace=1)
        await dec.stop(grace=1)


async def test_nodes_reuse_one_endpoint_and_replace_it_after_a_failure(fault_nodes):
    dec, pre, dstub, pstub, fault_file, stop_prefill = fault_nodes
    eps = pre.servicer.endpoints
    prompt = [(5 * i + 1) % 200 + 3 for i in range(37)]
    outputs = []
    for k in range(2):
        _, _, tokens, finish, verified = await run_request(dstub, pstub, f"a{k}", "t-a", prompt, 6)
        assert verified and finish == "length"
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert (eps.opened, eps.reused, eps.discarded) == (1, 1, 0)
    assert dec.receiver.connections == 1 and dec.receiver.transfers_served == 2

    fault_file.write_text(json.dumps([{"kind": "bad_auth", "tenant_id": "t-b"}]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_request(dstub, pstub, "b0", "t-b", prompt, 6)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    await pstub.Release(_release("b0"))
    await dstub.Release(_release("b0"))
    assert (eps.opened, eps.reused, eps.discarded) == (1, 2, 1)
    assert eps.open_endpoints == 0

    # positive control: the next request succeeds, on a new endpoint
    _, _, tokens, _, verified = await run_request(dstub, pstub, "a2", "t-a", prompt, 6)
    assert verified and tokens == outputs[0]
    assert eps.opened == 2 and dec.receiver.connections == 2
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages

    await stop_prefill()  # shutdown: nothing left open on either side
    assert eps.open_endpoints == 0
    assert await eventually(lambda: dec.receiver.open_endpoints == 0)


def _release(request_id: str):
    from kvfence.proto.kvfence.v1 import prefill_pb2

    return prefill_pb2.ReleaseRequest(request_id=request_id)


@pytest.mark.parametrize(
    "field, value",
    [
        ("endpoint_pool_max_idle", -1),
        ("endpoint_pool_max_idle", 257),
        ("endpoint_idle_timeout_s", 0),
    ],
)
def test_pool_settings_are_validated(field, value):
    from kvfence.config import ConfigError, parse_config

    cfg = parse_config({}, environ={})
    assert cfg.transfer.endpoint_pool_max_idle == 32 and cfg.transfer.endpoint_idle_timeout_s == 30
    with pytest.raises(ConfigError, match=f"transfer.{field}"):
        parse_config({"transfer": {field: value}}, environ={})
    env = {"KVFENCE__TRANSFER__ENDPOINT_POOL_MAX_IDLE": "0"}
    assert parse_config({}, environ=env).transfer.endpoint_pool_max_idle == 0


@pytest.mark.parametrize("stray_for", ["the previous transfer", "this transfer (control)"])
async def test_a_stray_page_left_on_a_reused_endpoint_cannot_land_in_the_next_transfer(stray_for):
    """A page message that no receive matched (a sender bug) stays queued on the endpoint. Page
    tags name the reservation and batch, so the next transfer's receives never match it. The
    control sends the stray under the next transfer's own tag: then it does land, which shows
    that the tag is what keeps it out."""
    async with transfer_rig() as (pool, rx, _, eps, tr):
        await tr.run(n_pages=1)  # res-1, leaves one idle endpoint
        host, _, port = rx.address.rpartition(":")
        ep = eps.take(host, int(port))
        assert ep is not None
        rid = "res-1" if stray_for == "the previous transfer" else "res-2"
        stray = torch.full(pool.kv.shape[1:], -7.0)
        await ep.send(page_buffer(stray), tag=page_tag(rid, 0, 0))
        eps.give_back(host, int(port), ep)
        if rid == "res-1":
            await tr.run(n_pages=1)  # res-2 on the same endpoint: its own bytes, checked
            assert (eps.opened, eps.reused) == (1, 2)  # our take, then res-2: one endpoint
        else:
            with pytest.raises(AssertionError):
                await tr.run(n_pages=1)  # page 0 of res-2 holds the stray's bytes
