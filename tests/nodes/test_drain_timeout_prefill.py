"""A prefill node whose drain times out ends its Prefill calls still in flight itself, before its
server stops (``PrefillServicer.end_in_flight``). Cut by the server's stop instead, they reached
the control plane as a lost connection (NODE_UNREACHABLE, "became unreachable": a network fault
to look for, where the node had stopped on purpose), and the tenant's request failed.

A call held in its forward pass (nothing of it left the node) ends UNAVAILABLE ``NODE_DRAINING``,
which the control plane takes as a draining node's refusal: the request is prefilled on another
node and succeeds. A call held in its KV send (decode may hold part of it: a reservation takes
one transfer only) ends CANCELLED ``NODE_DRAINING``, which the control plane does not retry and
passes on as UNAVAILABLE ``NODE_DRAINING`` ("shutting down"), counted against neither node.
Either way every page comes back and nothing is left running. Controls: with a drain long
enough, the same calls complete OK.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from asyncwait import eventually
from test_node_drain import (  # noqa: F401  (real: a fixture)
    RealCluster,
    real,
    refused_reason,
)
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    make_cfg,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.auth import with_token
from kvfence.config import Role
from kvfence.errors import NODE_DRAINING, Unavailable
from kvfence.node_main import RunningNode, start_node
from kvfence.proto.kvfence.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvfence.transfer import KvReceiver
from prefill_svc.batcher import PrefillBatcher

PROMPT = [(5 * i + 3) % 300 + 3 for i in range(20)]  # two pages of 16


class PassHold:
    """Holds the first prefill pass on its engine thread until ``gate`` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self._taken = False

    def first(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken


@pytest.fixture
def held_pass(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The first prefill pass of the test waits for its ``gate`` (an engine that does not finish:
    nothing can stop a pass once it started); later passes, another node's too, run at once."""
    hold = PassHold()
    real_run = PrefillBatcher._run

    def run(self: PrefillBatcher, batch: Any) -> Any:
        if hold.first():
            hold.entered.set()
            hold.gate.wait(60)  # bounded, so a failing test cannot hang the engine thread
        return real_run(self, batch)

    monkeypatch.setattr(PrefillBatcher, "_run", run)
    yield hold
    hold.gate.set()


class HelloHold:
    """Holds decode's answer to the first KV hello until ``gate`` is set."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.taken = False


@pytest.fixture
def held_hello(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Decode's receiver takes the first transfer's hello and does not answer it until ``gate``
    is set (a receiver that never answers: the sender's opening waits for it up to
    ``transfer.batch_timeout_s``)."""
    hold = HelloHold()
    real_serve = KvReceiver._serve_one

    async def serve_one(self: KvReceiver, ep: Any, hello: dict[str, Any], strays: list[int]) -> Any:
        if not hold.taken:
            hold.taken = True
            hold.entered.set()
            await hold.gate.wait()
        return await real_serve(self, ep, hello, strays)

    monkeypatch.setattr(KvReceiver, "_serve_one", serve_one)
    yield hold
    hold.gate.set()


class Pair:
    """An unregistered decode and prefill node, and stubs that call them as the control plane
    does. A test stops one of them itself (``stop_prefill``, ``stop_after_drain``); whatever is
    not stopped by the end is stopped then."""

    def __init__(self, dec: RunningNode, pre: RunningNode) -> None:
        self.dec, self.pre = dec, pre
        self.dstub: Any = None
        self.pstub: Any = None
        self.stopping: asyncio.Future[None] | None = None
        self.stopping_node: RunningNode | None = None  # the node ``stopping`` stops

    def stop_prefill(self, drain_timeout_s: float) -> asyncio.Task[None]:
        self.stopping_node = self.pre
        self.stopping = asyncio.create_task(self.pre.stop(drain_timeout_s=drain_timeout_s))
        return self.stopping

    def stop_after_drain(self, node: RunningNode) -> bool:
        """``node``'s stop with its drain timing out now, in this turn of the event loop: the
        real ``RunningNode.drain`` of 0 s (timed out at its first look; a node not registered
        awaits nothing before it) ends the calls in flight here, then the rest of the stop runs
        as a task, ``stopping``. Whether the drain did time out in this turn."""
        drain = node.drain(0)
        try:
            drain.send(None)
        except StopIteration as done:
            timed_out = done.value is False
        else:
            drain.close()
            timed_out = False  # it awaited: not run in this turn
        self.stopping_node = node
        self.stopping = asyncio.ensure_future(node.stop())
        return timed_out


@contextlib.asynccontextmanager
async def node_pair(
    tiny: Path, tmp_path: Path, pair_type: type[Pair] = Pair, **over: Any
) -> AsyncIterator[Any]:
    cfg = make_cfg(tiny, tmp_path, **over)
    dec = await start_node(cfg, Role.DECODE, register=False)
    pre = await start_node(cfg, Role.PREFILL, register=False)
    pair = pair_type(dec, pre)
    try:
        async with (
            grpc.aio.insecure_channel(dec.address) as dch,
            grpc.aio.insecure_channel(pre.address) as pch,
        ):
            pair.dstub = with_token(decode_pb2_grpc.DecodeStub(dch), dec.node_token)
            pair.pstub = with_token(prefill_pb2_grpc.PrefillStub(pch), pre.node_token)
            yield pair
    finally:
        for node in (pre, dec):
            if node is pair.stopping_node and pair.stopping is not None:
                await asyncio.wait_for(pair.stopping, 30)
            else:
                await node.stop(grace=1)


def assert_prefill_node_clean(pre: RunningNode) -> None:
    """Every page free (none quarantined) and nothing of a call left: no call, no send."""
    servicer = pre.servicer
    assert not servicer.calls and not servicer.winding and not servicer.held
    assert servicer.queue_length == 0
    pool = pre.rt.pool
    assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
    pool.check_integrity()


@pytest.mark.parametrize("drain_timeout_s", [0.3, 20.0], ids=["timed-out", "control"])
async def test_a_prefill_in_its_pass_at_a_timed_out_drain_ends_node_draining(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    held_pass: PassHold,
    drain_timeout_s: float,
) -> None:
    """A Prefill whose forward pass does not finish (held) when its node stops: the drain of
    0.3 s times out, and the call ends UNAVAILABLE NODE_DRAINING saying so, before the server
    stops. Once the pass is over the node's pages are all free. Control: with a drain of 20 s,
    the pass let go, the same call returns its manifest and the drain ends at its Release."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        _, call = await reserve_and_prefill(pair.dstub, pair.pstub, "r", PROMPT)
        try:
            assert await eventually(held_pass.entered.is_set, 30)
            stop = pair.stop_prefill(drain_timeout_s)
            if drain_timeout_s < 1:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(call, 30)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert refused_reason(err.value) == NODE_DRAINING, err.value
                assert "drain timed out" in (err.value.details() or "")
                # Answered before the stop went on to wait for the pass (nothing stops one).
                assert not stop.done()
                held_pass.gate.set()
            else:
                held_pass.gate.set()
                resp = await asyncio.wait_for(call, 30)
                assert resp.pages_sent == 2
                await pair.pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
            await asyncio.wait_for(stop, 30)
        finally:
            held_pass.gate.set()
    assert_prefill_node_clean(pair.pre)


@pytest.mark.parametrize("drain_timeout_s", [0.3, 20.0], ids=["timed-out", "control"])
async def test_a_prefill_in_its_send_at_a_timed_out_drain_ends_cancelled_node_draining(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    held_hello: HelloHold,
    drain_timeout_s: float,
) -> None:
    """A Prefill whose KV send waits for decode's answer to its hello when its node stops: the
    drain of 0.3 s times out, the call ends CANCELLED NODE_DRAINING saying so at once, and its
    send, cancelled in its hello, ends at once too (it waited out batch_timeout_s for an answer
    decode never gives), after which every page is free. Control: with a drain of 20 s, decode
    answering, the same call returns its manifest."""
    async with node_pair(tiny_dir, tmp_path, transfer={"batch_timeout_s": 10}) as pair:
        _, call = await reserve_and_prefill(pair.dstub, pair.pstub, "r", PROMPT)
        await asyncio.wait_for(held_hello.entered.wait(), 30)
        stop = pair.stop_prefill(drain_timeout_s)
        if drain_timeout_s < 1:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, 30)
            assert err.value.code() == grpc.StatusCode.CANCELLED, err.value
            assert refused_reason(err.value) == NODE_DRAINING, err.value
            assert "drain timed out" in (err.value.details() or "")
            # Its pages wait for the send (decode may still read them), not for the call; the
            # send settles its operations and ends in milliseconds, not batch_timeout_s.
            assert await eventually(lambda: not pair.pre.servicer.winding, 2.0)
        else:
            held_hello.gate.set()
            resp = await asyncio.wait_for(call, 30)
            assert resp.pages_sent == 2
            await pair.pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
        await asyncio.wait_for(stop, 30)
    assert_prefill_node_clean(pair.pre)


async def test_a_request_whose_prefill_a_timed_out_drain_ended_in_its_pass_runs_elsewhere(
    real: RealCluster,  # noqa: F811
    held_pass: PassHold,
) -> None:
    """Through the control plane: prefill-0's pass is held when it stops, and its drain times out.
    Its NODE_DRAINING is a draining node's refusal to the control plane (nothing of the request
    left the node): the request is prefilled on prefill-1, which joined meanwhile, and the tenant
    gets its answer. prefill-0 is not counted as failing (no cool-down), and leaves as a drained
    node, with no request failed."""
    await real.add(Role.DECODE, "decode-0")
    pre0 = await real.add(Role.PREFILL, "prefill-0")
    async with real.client() as client:
        gen = asyncio.create_task(
            client.generate(prompt_ids=PROMPT, max_new_tokens=2, ignore_eos=True)
        )
        try:
            assert await eventually(held_pass.entered.is_set, 30)
            await real.add(Role.PREFILL, "prefill-1")
            node0 = real.cp.registry.get("prefill-0")
            stop = asyncio.create_task(pre0.stop(drain_timeout_s=0.3))
            result = await asyncio.wait_for(gen, 30)
            assert result.finish_reason == "length"
            counts = real.cp.node_rpc_counts
            assert (counts[("prefill-0", "Prefill")], counts[("prefill-1", "Prefill")]) == (1, 1)
            assert node0 is not None and node0.failures == 0
            held_pass.gate.set()
            await asyncio.wait_for(stop, 30)
        finally:
            held_pass.gate.set()
    real.nodes.remove(pre0)
    assert await eventually(lambda: real.cp.registry.get("prefill-0") is None, 10)
    [lost] = real.events.of("node_lost")
    assert (lost["node"], lost["failed_requests"]) == ("prefill-0", 0)
    assert real.events.of("request_failed") == []
    assert_prefill_node_clean(pre0)


@pytest.mark.parametrize("drain_timeout_s", [0.3, 20.0], ids=["timed-out", "control"])
async def test_a_request_whose_prefill_a_timed_out_drain_ended_in_its_send_says_shutting_down(
    real: RealCluster,  # noqa: F811
    held_hello: HelloHold,
    drain_timeout_s: float,
) -> None:
    """Through the control plane: prefill-0's KV send waits for decode's answer when it stops,
    and its drain times out. The tenant's request fails UNAVAILABLE NODE_DRAINING, "shutting
    down"; it is not prefilled again on prefill-1 (decode may have taken the hello, and a
    reservation takes one transfer: a second is refused REPLAY), and neither node is counted as
    failing. Control: with a drain of 20 s, decode answering, the
    request completes."""
    dec = await real.add(Role.DECODE, "decode-0")
    pre0 = await real.add(Role.PREFILL, "prefill-0")
    async with real.client() as client:
        gen = asyncio.create_task(
            client.generate(prompt_ids=PROMPT, max_new_tokens=2, ignore_eos=True)
        )
        try:
            await asyncio.wait_for(held_hello.entered.wait(), 30)
            await real.add(Role.PREFILL, "prefill-1")
            node0, node_dec = real.cp.registry.get("prefill-0"), real.cp.registry.get("decode-0")
            stop = asyncio.create_task(pre0.stop(drain_timeout_s=drain_timeout_s))
            if drain_timeout_s < 1:
                with pytest.raises(Unavailable) as err:
                    await asyncio.wait_for(gen, 30)
                assert err.value.reason == NODE_DRAINING, err.value
                assert "the prefill node serving this request is shutting down" in str(err.value)
                assert real.cp.node_rpc_counts.get(("prefill-1", "Prefill"), 0) == 0
                held_hello.gate.set()  # decode answers late: the cancelled send ends sooner
            else:
                held_hello.gate.set()
                result = await asyncio.wait_for(gen, 30)
                assert result.finish_reason == "length"
            assert node0 is not None and node_dec is not None
            assert (node0.failures, node_dec.failures) == (0, 0)
            await asyncio.wait_for(stop, 30)
        finally:
            held_hello.gate.set()
    real.nodes.remove(pre0)
    assert_prefill_node_clean(pre0)
    pool = dec.rt.pool  # the request's Release reached decode too
    assert await eventually(lambda: pool.num_free == pool.num_pages, 10)
