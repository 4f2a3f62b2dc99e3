"""Real prefill and decode nodes drain when they stop (``RunningNode.stop(drain_timeout_s=...)``,
what ``kvfence serve`` does on SIGTERM): new Reserve / Prefill calls are refused NODE_DRAINING, the
work already held finishes, the control plane routes around the node, and the node stops once it
holds nothing or the drain timeout passes, leaking nothing either way.

The control-plane side with fake nodes is tests/control_plane/test_cp_draining.py; the SIGTERM path
of a ``kvfence serve`` process is tests/stack/test_node_sigterm.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from asyncwait import eventually
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    make_cfg,
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from control_plane.service import ControlPlane
from control_plane.tenants import TenantLimits
from decode_svc.batcher import DecodeBatcher
from kvfence import node_main
from kvfence.auth import with_token
from kvfence.client import AsyncClient
from kvfence.config import Role, parse_config
from kvfence.errors import NODE_DRAINING, KvfenceError, error_info
from kvfence.node_main import RunningNode, start_node
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
)

STEP_S = 0.03  # each decode step made this slow, so a stream is still running when a node stops


@pytest.fixture
def slow_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = DecodeBatcher._step

    def step(self: DecodeBatcher, batch: Any) -> None:
        time.sleep(STEP_S)  # on the engine thread
        real_step(self, batch)

    monkeypatch.setattr(DecodeBatcher, "_step", step)


def cluster_data(tiny: Path, tmp_path: Path, decode_pages: int = 24) -> dict[str, Any]:
    return {
        "model": {"path": str(tiny)},
        "kv": {
            "page_size": 16,
            "prefill_pool": {"num_pages": 16},
            "decode_pool": {"num_pages": decode_pages},
        },
        "control_plane": {
            "state_dir": str(tmp_path),
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "heartbeat_interval_s": 0.1,
            "node_timeout_s": 1.0,
        },
    }


class Events:
    """The control plane's events, kept (in place of its event bus)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **payload: Any) -> int:
        self.events.append({"kind": kind, **payload})
        return len(self.events)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


class RealCluster:
    """A control plane and real nodes in this event loop."""

    def __init__(self, tiny: Path, tmp_path: Path):
        self.tiny, self.tmp_path = tiny, tmp_path
        self.events = Events()
        self.cp = ControlPlane(
            parse_config(cluster_data(tiny, tmp_path), environ={}), events=self.events
        )
        self.nodes: list[RunningNode] = []
        self.address = ""
        self.key = ""

    async def start(self) -> RealCluster:
        ports = await self.cp.start()
        self.address = f"127.0.0.1:{ports.public}"
        _, self.key, _ = self.cp.tenants.create_tenant("acme", TenantLimits())
        return self

    async def add(self, role: Role, node_id: str, decode_pages: int = 24) -> RunningNode:
        data = cluster_data(self.tiny, self.tmp_path, decode_pages)
        data["control_plane"]["address"] = self.address
        data["node"] = {"node_id": node_id}
        node = await start_node(parse_config(data, environ={}), role)
        self.nodes.append(node)
        return node

    def client(self) -> AsyncClient:
        return AsyncClient(self.address, self.key, timeout=60)

    def reserves(self, node_id: str) -> int:
        return self.cp.node_rpc_counts.get((node_id, "Reserve"), 0)

    async def close(self) -> None:
        for node in reversed(self.nodes):
            await node.stop(grace=1)
        await self.cp.stop(grace=1)


@pytest.fixture
async def real(tiny_dir, tmp_path):  # noqa: F811
    c = await RealCluster(tiny_dir, tmp_path).start()
    yield c
    await c.close()


async def stream_tokens(client: AsyncClient, n: int, started: asyncio.Event) -> list[int]:
    """Generate ``n`` tokens, setting ``started`` at the first message; the token ids."""
    tokens: list[int] = []
    finish = ""
    async for chunk in client.stream(prompt_ids=[5, 6, 7], max_new_tokens=n, ignore_eos=True):
        tokens.extend(chunk.token_ids)
        finish = chunk.finish_reason or finish
        started.set()
    assert finish == "length"
    return tokens


@pytest.mark.parametrize("drain_timeout_s", [20.0, 0.0])
async def test_a_decode_node_stopped_mid_stream_lets_the_stream_finish(
    real: RealCluster, slow_decode: None, drain_timeout_s: float
) -> None:
    """The decode node is stopped (as on SIGTERM) while a 100-token stream runs (~3 s): with a
    drain the stream finishes OK with every token, the node stops only after it, and the control
    plane then drops it with no request failed. Control, without a drain (drain_timeout_s 0, the
    old stop): the same stream fails."""
    dec = await real.add(Role.DECODE, "decode-0")
    await real.add(Role.PREFILL, "prefill-0")
    async with real.client() as client:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_tokens(client, 100, started))
        await asyncio.wait_for(started.wait(), 30)
        stop = asyncio.create_task(dec.stop(drain_timeout_s=drain_timeout_s))
        if drain_timeout_s == 0:
            with pytest.raises(KvfenceError):
                await asyncio.wait_for(stream, 30)
            await stop
            return
        tokens = await asyncio.wait_for(stream, 30)
        assert len(tokens) == 100
        await asyncio.wait_for(stop, 10)
        real.nodes.remove(dec)
        assert dec.rt.pool.num_free == dec.rt.pool.num_pages
        assert await eventually(lambda: real.cp.registry.get("decode-0") is None, 5)
        [lost] = real.events.of("node_lost")
        assert (lost["node"], lost["failed_requests"]) == ("decode-0", 0)
        assert real.events.of("request_failed") == []


async def test_while_a_decode_node_drains_new_requests_go_to_the_other(
    real: RealCluster, slow_decode: None
) -> None:
    """decode-big (the larger pool, so routing prefers it: control, a first request lands there)
    drains while a stream runs on it: a new request reserves on decode-small, decode-big is sent
    no Reserve any more, and its own stream still finishes OK before it stops."""
    big = await real.add(Role.DECODE, "decode-big", decode_pages=48)
    await real.add(Role.DECODE, "decode-small", decode_pages=24)
    await real.add(Role.PREFILL, "prefill-0")
    async with real.client() as client:
        await client.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, ignore_eos=True)
        assert (real.reserves("decode-big"), real.reserves("decode-small")) == (1, 0)

        started = asyncio.Event()
        stream = asyncio.create_task(stream_tokens(client, 100, started))
        await asyncio.wait_for(started.wait(), 30)
        assert real.reserves("decode-big") == 2
        stop = asyncio.create_task(big.stop(drain_timeout_s=20))
        registry = real.cp.registry
        assert await eventually(lambda: registry.get("decode-big").draining, 5)
        result = await client.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, ignore_eos=True)
        assert result.finish_reason == "length"
        assert (real.reserves("decode-big"), real.reserves("decode-small")) == (2, 1)
        assert not stream.done() and not stop.done()  # the drain waits for the stream
        assert len(await asyncio.wait_for(stream, 30)) == 100
        await asyncio.wait_for(stop, 10)
        real.nodes.remove(big)


async def test_with_the_only_decode_node_draining_a_request_waits_for_a_new_one(
    real: RealCluster, slow_decode: None
) -> None:
    """The only decode node drains (a stream holds it): a new request waits in the queue (no
    Reserve reaches the draining node, and it is not failed), and runs once a decode node
    joins. Control: it was still waiting when the new node joined."""
    old = await real.add(Role.DECODE, "decode-old")
    await real.add(Role.PREFILL, "prefill-0")
    async with real.client() as client:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_tokens(client, 100, started))
        await asyncio.wait_for(started.wait(), 30)
        stop = asyncio.create_task(old.stop(drain_timeout_s=20))
        assert await eventually(lambda: real.cp.registry.get("decode-old").draining, 5)
        waiting = asyncio.create_task(
            client.generate(prompt_ids=[1, 2, 3], max_new_tokens=2, ignore_eos=True)
        )
        await asyncio.sleep(0.5)
        assert not waiting.done()
        assert real.reserves("decode-old") == 1
        await real.add(Role.DECODE, "decode-new")
        result = await asyncio.wait_for(waiting, 30)
        assert result.finish_reason == "length"
        assert (real.reserves("decode-old"), real.reserves("decode-new")) == (1, 1)
        assert len(await asyncio.wait_for(stream, 30)) == 100
        await asyncio.wait_for(stop, 10)
        real.nodes.remove(old)


def refused_reason(err: grpc.aio.AioRpcError) -> str:
    info = error_info(err)
    return info.reason if info is not None else ""


async def test_a_draining_decode_node_refuses_new_reserves_and_serves_what_it_holds(
    tiny_dir,  # noqa: F811
    tmp_path,
) -> None:
    """Nodes without a control plane, called as it calls them. Before the drain a Reserve is
    granted (control); during it a new Reserve is UNAVAILABLE/NODE_DRAINING and takes no page,
    while the reservation made before goes on: its KV transfer, its Decode stream, to a finish.
    The drain ends once that stream has ended."""
    async with node_pair(tiny_dir, tmp_path) as (dec, _pre, dstub, pstub):
        prompt = [(5 * i + 3) % 300 + 3 for i in range(20)]
        res = await dstub.Reserve(
            decode_pb2.ReserveRequest(
                request_id="held", tenant_id="t", prompt_tokens=len(prompt), max_new_tokens=4
            )
        )
        drain = asyncio.create_task(dec.drain(20))
        assert await eventually(lambda: dec.draining)
        free = dec.rt.pool.num_free
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dstub.Reserve(
                decode_pb2.ReserveRequest(
                    request_id="new", tenant_id="t", prompt_tokens=3, max_new_tokens=4
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused_reason(err.value) == NODE_DRAINING
        assert "draining" in (err.value.details() or "")
        assert dec.rt.pool.num_free == free and "new" not in dec.servicer.by_request

        await asyncio.sleep(0.2)
        assert not drain.done()  # it holds a reservation
        _, call = await reserve_and_prefill(dstub, pstub, "held", prompt, res=res, tenant="t")
        manifest = (await call).manifest
        tokens, finish = [], ""
        async for msg in dstub.Decode(
            decode_pb2.DecodeRequest(
                request_id="held",
                tenant_id="t",
                reservation_id=res.reservation_id,
                manifest=manifest,
                sampling=common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True),
            )
        ):
            tokens.extend(msg.token_ids)
            finish = msg.finish_reason or finish
        assert finish == "length" and len(tokens) == 4
        assert await asyncio.wait_for(drain, 5) is True
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="held"))
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    dec.rt.pool.check_integrity()


async def test_a_draining_prefill_node_refuses_new_prefills_and_waits_for_its_release(
    tiny_dir,  # noqa: F811
    tmp_path,
) -> None:
    """A prefill node that holds a request's source pages (prefilled, not yet Released) drains
    until the control plane's Release comes; a new Prefill meanwhile is UNAVAILABLE/NODE_DRAINING
    before any page is taken. Control: the same Prefill was served before the drain."""
    async with node_pair(tiny_dir, tmp_path) as (_dec, pre, dstub, pstub):
        _, call = await reserve_and_prefill(dstub, pstub, "first", [5, 6, 7])
        await call  # control: served; its source pages stay held until Release
        assert "first" in pre.servicer.held
        drain = asyncio.create_task(pre.drain(20))
        assert await eventually(lambda: pre.draining)
        free = pre.rt.pool.num_free
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _, call = await reserve_and_prefill(dstub, pstub, "second", [5, 6, 7])
            await call
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused_reason(err.value) == NODE_DRAINING
        assert pre.rt.pool.num_free == free and "second" not in pre.servicer.held
        await asyncio.sleep(0.2)
        assert not drain.done()
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="first"))
        assert await asyncio.wait_for(drain, 5) is True
        for rid in ("first", "second"):
            await dstub.Release(prefill_pb2.ReleaseRequest(request_id=rid))
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages


async def test_drain_gives_up_after_drain_timeout_s_and_the_node_stops_leaking_nothing(
    tiny_dir,  # noqa: F811
    tmp_path,
) -> None:
    """A decode node holds a reservation whose Decode never comes: the drain gives up after
    drain_timeout_s (here 0.5 s), and the node stops as without a drain, every page free at a new
    generation and no reservation or transfer left. Control: a node holding nothing drains at
    once."""
    cfg = make_cfg(tiny_dir, tmp_path)
    idle = await start_node(cfg, Role.DECODE, register=False)
    with structlog.testing.capture_logs() as logs:
        # Nothing held: the drain ends because the node is empty, not at its timeout. With an
        # hour's timeout, a stop that waited for it fails the test's 30 s wait, which is many
        # times what an empty node's stop takes, however loaded the machine.
        await asyncio.wait_for(idle.stop(drain_timeout_s=3600), 30)
    assert [e["event"] for e in logs if e["event"].startswith("node drain")] == [
        "node draining",
        "node drained",
    ]
    assert not [e for e in logs if e["event"].startswith("drain timed out")]

    dec = await start_node(cfg, Role.DECODE, register=False)
    async with grpc.aio.insecure_channel(dec.address) as ch:
        res = await with_token(decode_pb2_grpc.DecodeStub(ch), dec.node_token).Reserve(
            decode_pb2.ReserveRequest(
                request_id="stuck", tenant_id="t", prompt_tokens=30, max_new_tokens=4
            )
        )
    pool = dec.rt.pool
    assert pool.num_free < pool.num_pages
    loop = asyncio.get_running_loop()
    with structlog.testing.capture_logs() as logs:
        began = loop.time()
        # The reservation is never released: only the timeout can end this drain. It does not
        # end before it (a lower bound load cannot break); that it ends at it, not never, is
        # the wait_for's bound, twenty times the timeout so that a loaded machine stays within.
        assert await asyncio.wait_for(dec.drain(0.5), 10) is False
        assert loop.time() - began >= 0.5
    (gave_up,) = [e for e in logs if e["event"].startswith("drain timed out")]
    assert gave_up["reservations"] == 1 and dec.draining
    # The stop after a drain that gives up ends within its documented bound (drain_timeout_s +
    # STOP_TAIL_S, what the chart's grace period is sized from), not at the reservation's end.
    await asyncio.wait_for(dec.stop(drain_timeout_s=0.5), 0.5 + node_main.STOP_TAIL_S)
    assert not dec.servicer.reservations and not dec.receiver.transfers
    assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
    assert all(pool.generation(r.page_id) > r.generation for r in res.pages)
    pool.check_integrity()


def test_a_nodes_stop_budget_adds_up() -> None:
    """node_main.STOP_TAIL_S, which the chart adds to drainTimeoutS for the pod's grace period,
    covers each bounded wait of the stop after the drain (the listener's close, decode's receiver
    connections or prefill's winding sends, the bus's flush and its disconnect from a broker that
    does not answer) with five seconds left for the engine thread's current pass."""
    from kvfence import events, node_main, transfer
    from prefill_svc import service as prefill_service

    waits = (
        node_main.STOP_GRACE_S
        # decode's receiver connections, or prefill's sends ended by the timed-out drain
        + max(
            transfer.HANDLERS_STOP_S + 0.5,  # the cancelled handlers' own wait
            prefill_service.WINDING_STOP_S,
        )
        + node_main.STOP_FLUSH_S
        + events.PUBLISH_TIMEOUT_S
        + 1
    )
    assert waits + 5 <= node_main.STOP_TAIL_S
