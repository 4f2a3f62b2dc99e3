"""A Decode call that reaches a decode node after its drain timed out (``end_in_flight`` ran) and
before its server stops accepting calls: a reservation made earlier that no Decode call waited
for yet. Such a call used to wait for its transfer or decode, and was then cut by the server's
stop: the control plane read a lost connection (NODE_UNREACHABLE, "became unreachable") where
the node had stopped on purpose. It is now refused at once UNAVAILABLE ``NODE_DRAINING`` with the
drain's own error, and its reservation released then: pages free, a transfer still to come
refused ``RESERVATION_RELEASED``.

The window is held open by holding the gRPC server's stop; the drain is the node's real one
(``Pair.stop_after_drain``). In the same window a ``Release`` and a transfer of another held
reservation are served as before. Controls: with the drain still running (not timed out), the
same calls are served, and the Decode streams to its finish.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from asyncwait import eventually
from test_decode_drain_waiting import SAMPLING, captured_manifest, ended_draining
from test_decode_restart_and_prefill_release import outcome, stream_outcome
from test_drain_timeout_prefill import HelloHold, Pair, held_hello, node_pair  # noqa: F401
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    _decode_request,
    reserve_and_prefill,
    tiny_dir,
)

from decode_svc.service import DecodeServicer
from kvfence.errors import RESERVATION_RELEASED
from kvfence.node_main import RunningNode
from kvfence.proto.kvfence.v1 import decode_pb2, prefill_pb2

PROMPT = [(5 * i + 3) % 300 + 3 for i in range(20)]  # two pages of 16
MAX_NEW = SAMPLING.max_new_tokens


class HeldStop:
    """The node's gRPC server stop waits for ``gate``: until then it accepts calls, the window
    between a timed-out drain and the server's stop."""

    def __init__(self, node: RunningNode) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        real = node.server.stop

        async def stop(grace: float = 5.0) -> None:
            self.entered.set()
            await self.gate.wait()
            await real(grace)

        node.server.stop = stop  # type: ignore[method-assign]


async def drain(pair: Pair, timed_out: bool) -> tuple[HeldStop, asyncio.Task[bool] | None]:
    """The decode node drains: timed out in this turn, its stop then held before the server
    stops accepting (``timed_out``), or a drain of 20 s still running (the control)."""
    held = HeldStop(pair.dec)
    if timed_out:
        assert pair.stop_after_drain(pair.dec)
        await asyncio.wait_for(held.entered.wait(), 30)
        return held, None
    task = asyncio.create_task(pair.dec.drain(20))
    await asyncio.sleep(0)
    assert pair.dec.draining and not task.done()
    return held, task


async def reserve(pair: Pair, request_id: str) -> Any:
    return await pair.dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id=request_id,
            tenant_id="t-c",
            prompt_tokens=len(PROMPT),
            max_new_tokens=MAX_NEW,
        )
    )


def assert_decode_clean(dec: RunningNode) -> None:
    pool = dec.rt.pool
    assert not dec.servicer.reservations and not dec.receiver.transfers
    assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
    pool.check_integrity()


@pytest.mark.parametrize("timed_out", [True, False], ids=["timed-out", "draining"])
async def test_a_decode_after_a_timed_out_drain_is_refused_node_draining_and_released(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    timed_out: bool,
) -> None:
    """Two reservations made before the drain, neither awaited by a Decode call. In the window
    after the drain timed out: a Release of one answers held and frees its pages; the other's
    transfer arrives and completes (prefill OK); its Decode is refused UNAVAILABLE NODE_DRAINING
    "drain timed out" before anything is decoded, its reservation released in the same call
    (every page free before the server stops), so a later Release holds nothing. Control, the
    drain still running: the same Release and transfer, and the Decode streams every token to
    its finish, after which the drain ends emptied."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        servicer: DecodeServicer = pair.dec.servicer
        pool = pair.dec.rt.pool
        res = await reserve(pair, "r")
        await reserve(pair, "gone")
        held, draining = await drain(pair, timed_out)
        try:
            gone = await pair.dstub.Release(prefill_pb2.ReleaseRequest(request_id="gone"))
            assert gone.held and "gone" not in servicer.by_request
            _, prefill = await reserve_and_prefill(
                pair.dstub, pair.pstub, "r", PROMPT, SAMPLING, res=res, max_new=MAX_NEW
            )
            reply = await asyncio.wait_for(prefill, 30)
            assert reply.pages_sent == 2
            call = pair.dstub.Decode(_decode_request(res, reply, "r", SAMPLING))
            if timed_out:
                await ended_draining(call)
                # Released by the refused call itself: the server's stop is still held.
                assert res.reservation_id not in servicer.reservations
                assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
                again = await pair.dstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
                assert not again.held
            else:
                tokens: list[int] = []
                finish = ""
                async for msg in call:
                    tokens.extend(msg.token_ids)
                    finish = msg.finish_reason or finish
                assert (finish, len(tokens)) == ("length", MAX_NEW)
                assert draining is not None
                assert await asyncio.wait_for(draining, 10) is True
            await pair.pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
        finally:
            held.gate.set()
            if draining is not None:
                draining.cancel()
    assert_decode_clean(pair.dec)


@pytest.mark.parametrize("timed_out", [True, False], ids=["timed-out", "draining"])
async def test_a_transfer_after_a_decode_refused_by_a_timed_out_drain_is_refused_released(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    held_hello: HelloHold,  # noqa: F811
    timed_out: bool,
) -> None:
    """The transfer's hello is held at decode, unanswered, when the drain times out; the Decode
    call (the manifest as prefill signed it) comes in the window: refused UNAVAILABLE
    NODE_DRAINING at once, while the hello is still held, its reservation released. Let go, the
    hello finds the reservation released: prefill's call fails RESERVATION_RELEASED, and every
    page is free. Control, the drain still running: the same Decode waits for the transfer,
    which completes once the hello is let go, and streams to its finish."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        servicer: DecodeServicer = pair.dec.servicer
        pool = pair.dec.rt.pool
        manifests = captured_manifest(pair, monkeypatch)
        res, prefill = await reserve_and_prefill(
            pair.dstub, pair.pstub, "r", PROMPT, SAMPLING, max_new=MAX_NEW
        )
        held, draining = None, None
        try:
            await asyncio.wait_for(held_hello.entered.wait(), 30)
            held, draining = await drain(pair, timed_out)
            [manifest] = manifests
            request = _decode_request(
                res, prefill_pb2.PrefillResponse(manifest=manifest), "r", SAMPLING
            )
            call = pair.dstub.Decode(request)
            if timed_out:
                await ended_draining(call)
                assert not prefill.done()  # refused at once, not after waiting for the transfer
                assert res.reservation_id not in servicer.reservations
                assert pool.num_free == pool.num_pages
                held_hello.gate.set()
                assert await asyncio.wait_for(outcome(prefill), 30) == (
                    grpc.StatusCode.UNAVAILABLE,
                    RESERVATION_RELEASED,
                )
            else:
                reading = asyncio.ensure_future(stream_outcome(call))
                waiting = servicer.reservations[res.reservation_id]
                assert await eventually(lambda: waiting.awaited, 30)  # for the transfer
                held_hello.gate.set()
                assert await asyncio.wait_for(reading, 30) == (grpc.StatusCode.OK, None)
                assert (await asyncio.wait_for(prefill, 30)).pages_sent == 2
                assert draining is not None
                assert await asyncio.wait_for(draining, 10) is True
            await pair.pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
        finally:
            held_hello.gate.set()
            if held is not None:
                held.gate.set()
            if draining is not None:
                draining.cancel()
    assert_decode_clean(pair.dec)
