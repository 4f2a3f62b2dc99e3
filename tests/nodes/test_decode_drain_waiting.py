"""A decode node's timed-out drain ends a Decode call still waiting for its KV transfer
(``DecodeServicer.end_in_flight``). It used to end only the streams already decoding: a call
waiting for its transfer (up to ``transfer.batch_timeout_s``) was left to the server's stop, which
cut it, and the control plane read a lost connection (NODE_UNREACHABLE, "became unreachable")
although the node had stopped on purpose. Now it ends UNAVAILABLE ``NODE_DRAINING``, and its
reservation is released by the drain: the pages of receives still posted stay QUARANTINED until
those settle (never reused while UCX may write into them), the others are free at once, and every
page is free once the node stopped.

Each test runs the node's real drain (``RunningNode.drain`` of 0 s) at a chosen turn of the event
loop, then the rest of its stop: no sleep decides which comes first. Control: a call whose
transfer completed and which decodes (verified, its first step held) is ended as before, through
its stream.
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
from test_decode_restart_and_prefill_release import outcome
from test_drain_timeout_prefill import Pair
from test_drain_timeout_prefill import node_pair as shared_node_pair
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    _decode_request,
    make_cfg,
    reserve_and_prefill,
    tiny_dir,
)

from decode_svc.batcher import DecodeBatcher
from decode_svc.service import DecodeServicer
from kvfence import transfer as transfer_module
from kvfence.errors import NODE_DRAINING, error_info
from kvfence.node_main import RunningNode
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2

PROMPT = [(5 * i + 3) % 300 + 3 for i in range(20)]  # two pages of 16
MAX_NEW = 40  # four pages reserved in all: two the transfer writes, two it never touches
SAMPLING = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


class DrainPair(Pair):
    """The nodes of ``node_pair``; the test stops the decode node (``drain_times_out``)."""

    def __init__(self, dec: RunningNode, pre: RunningNode) -> None:
        super().__init__(dec, pre)
        # What end_in_flight saw (each reservation's state, its transfer's, whether a call
        # waited for it) and how many calls it ended; the decode pool right after it.
        self.ends: list[tuple[list[tuple[str, str, bool]], int]] = []
        self.after: tuple[int, int] | None = None  # (quarantined, free)


@contextlib.asynccontextmanager
async def node_pair(tiny: Path, tmp_path: Path) -> AsyncIterator[DrainPair]:
    async with shared_node_pair(tiny, tmp_path, DrainPair) as pair:
        watch_ends(pair)
        yield pair


def watch_ends(pair: DrainPair) -> None:
    servicer: DecodeServicer = pair.dec.servicer
    real = servicer.end_in_flight

    def end_in_flight(err: Any) -> int:
        where = [
            (r.state.value, r.transfer.state.value, r.awaited)
            for r in servicer.reservations.values()
        ]
        ended = real(err)
        pair.ends.append((where, ended))
        return ended

    servicer.end_in_flight = end_in_flight  # type: ignore[method-assign]


def drain_times_out(pair: DrainPair) -> None:
    """The decode node's stop with its drain timing out in this turn of the event loop
    (``Pair.stop_after_drain``); the pool is looked at in the same turn."""
    timed_out = pair.stop_after_drain(pair.dec)
    pool = pair.dec.rt.pool
    pair.after = (pool.stats().quarantined, pool.num_free)
    assert timed_out


class HeldBatch:
    """Prefill's first page batch held until ``gate`` is set, its header sent: decode has posted
    the batch's receives into the reserved pages, and waits for them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        real = transfer_module._send_batch
        taken = False

        async def send_batch(*args: Any) -> None:
            nonlocal taken
            if not taken:
                taken = True
                self.entered.set()
                await self.gate.wait()
            await real(*args)

        monkeypatch.setattr(transfer_module, "_send_batch", send_batch)


class StepHold:
    """The first decode step waits on the engine thread until ``gate`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        real = DecodeBatcher._step
        lock = threading.Lock()
        taken = False

        def step(batcher: DecodeBatcher, batch: Any) -> None:
            nonlocal taken
            with lock:
                first, taken = not taken, True
            if first:
                self.entered.set()
                self.gate.wait(60)  # bounded, so a failing test cannot hang the engine thread
            real(batcher, batch)

        monkeypatch.setattr(DecodeBatcher, "_step", step)


class DrainAtDone(asyncio.Event):
    """A transfer's done event that, when set, has the drain time out on the next turn of the
    loop, ahead of the wake-up of the call waiting on it (queued after it)."""

    def __init__(self, pair: Pair) -> None:
        super().__init__()
        self.pair = pair

    def set(self) -> None:
        if not self.is_set():
            asyncio.get_running_loop().call_soon(drain_times_out, self.pair)
        super().set()


def captured_manifest(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[common_pb2.KvManifest]:
    """Prefill's manifests as it builds them (signed before its send begins)."""
    built: list[common_pb2.KvManifest] = []
    servicer = pair.pre.servicer
    real = servicer._manifest

    def manifest(*args: Any) -> common_pb2.KvManifest:
        built.append(real(*args))
        return built[-1]

    monkeypatch.setattr(servicer, "_manifest", manifest)
    return built


async def ended_draining(call: Any) -> None:
    """The Decode call ends UNAVAILABLE NODE_DRAINING, saying the drain timed out."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await asyncio.wait_for(call.read(), 30) is not grpc.aio.EOF:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    info = error_info(err.value)
    assert info is not None and info.reason == NODE_DRAINING, err.value
    assert "drain timed out" in (err.value.details() or "")


@pytest.mark.parametrize("drain_at", ["receiving", "transfer-done"])
async def test_a_decode_waiting_for_its_transfer_at_a_timed_out_drain_ends_node_draining(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    drain_at: str,
) -> None:
    """A Decode call waits for its transfer when the drain times out: its first batch's receives
    posted (receiving), or the transfer just complete, the call not woken yet (transfer-done).
    Either way the drain ends it UNAVAILABLE NODE_DRAINING and releases its reservation in the
    same turn: pages with a receive posted QUARANTINED, the others free; prefill's held send then
    fails, and every page is free once the node stopped."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        pool = pair.dec.rt.pool
        servicer: DecodeServicer = pair.dec.servicer
        held = HeldBatch(monkeypatch)
        manifests = captured_manifest(pair, monkeypatch)
        res, prefill = await reserve_and_prefill(
            pair.dstub, pair.pstub, "r", PROMPT, SAMPLING, max_new=MAX_NEW
        )
        rid = res.reservation_id
        try:
            await asyncio.wait_for(held.entered.wait(), 30)
            assert await eventually(lambda: pool.outstanding_ops(rid) > 0, 30)
            posted = pool.outstanding_ops(rid)
            assert 0 < posted < len(res.pages)
            reservation = servicer.reservations[rid]
            if drain_at == "transfer-done":
                reservation.transfer.done = DrainAtDone(pair)
            [manifest] = manifests
            reply = prefill_pb2.PrefillResponse(manifest=manifest)
            call = pair.dstub.Decode(_decode_request(res, reply, "r", SAMPLING))
            assert await eventually(lambda: reservation.awaited, 30)
            if drain_at == "receiving":
                drain_times_out(pair)
                # In the drain's own turn: released, and only the pages UCX may still write
                # into are held back.
                assert rid not in servicer.reservations
                assert pair.after == (posted, pool.num_pages - posted)
                await ended_draining(call)
                held.gate.set()
                code, _ = await asyncio.wait_for(outcome(prefill), 30)
                assert code != grpc.StatusCode.OK
                assert pair.ends == [([("reserved", "receiving", True)], 1)]
            else:
                held.gate.set()
                reply = await asyncio.wait_for(prefill, 30)  # decode took the whole transfer
                assert reply.pages_sent == 2
                await ended_draining(call)
                assert pair.ends == [([("reserved", "complete", True)], 1)]
                assert pair.after == (0, pool.num_pages)  # no receive left posted
        finally:
            held.gate.set()
        assert pair.stopping is not None
        await asyncio.wait_for(pair.stopping, 30)
        await pair.pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
    assert not servicer.reservations
    assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
    pool.check_integrity()


async def test_a_decoding_stream_at_a_timed_out_drain_is_ended_through_its_stream(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control: the transfer completed before the Decode call, which verified the KV and decodes
    (its first step held on the engine thread) when the drain times out: ended UNAVAILABLE
    NODE_DRAINING through its stream, as before; its reservation is released by the stream's
    end, not by the drain; every page is free once the node stopped."""
    step = StepHold(monkeypatch)
    async with node_pair(tiny_dir, tmp_path) as pair:
        pool = pair.dec.rt.pool
        servicer: DecodeServicer = pair.dec.servicer
        try:
            res, prefill = await reserve_and_prefill(
                pair.dstub, pair.pstub, "r", PROMPT, SAMPLING, max_new=MAX_NEW
            )
            reply = await asyncio.wait_for(prefill, 30)
            call = pair.dstub.Decode(_decode_request(res, reply, "r", SAMPLING))
            first = await asyncio.wait_for(call.read(), 30)
            assert first.verified
            assert await eventually(step.entered.is_set, 30)
            drain_times_out(pair)
            assert res.reservation_id in servicer.reservations  # its stream's end releases it
            await ended_draining(call)
        finally:
            step.gate.set()
        assert pair.ends == [([("decoding", "complete", False)], 1)]
        assert pair.stopping is not None
        await asyncio.wait_for(pair.stopping, 30)
        await pair.pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
    assert not servicer.reservations
    assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
    pool.check_integrity()
