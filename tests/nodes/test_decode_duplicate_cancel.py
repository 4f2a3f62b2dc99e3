"""A duplicate Decode cancelled while the first call for its reservation waits for the transfer.

It used to release the reservation the first call was waiting on, so the transfer arriving after
it was refused as late (RESERVATION_RELEASED) and the request failed. The pages belong to the
first call waiting; only its own cancellation gives them back at once."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from asyncwait import eventually
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    _all_free,
    _decode_request,
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.errors import RESERVATION_RELEASED, error_info
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2

# Long enough that neither wait below ends by a timeout: only the transfer or a cancel ends it.
TRANSFER = {"batch_timeout_s": 30, "reservation_timeout_s": 60.0}
PROMPT = list(range(3, 23))  # 20 tokens: 2 pages of 16 with the 4 new ones
MAX_NEW = 4
SAMPLING = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def _cancelled_streams(dec) -> float:
    """Decode streams the node has ended CANCELLED (counted as each handler finishes)."""
    value = dec.metrics.registry.get_sample_value(
        "kvfence_requests_total", {"service": "decode", "status": "CANCELLED"}
    )
    return value or 0.0


def _held(pool) -> int:
    pool.check_integrity()  # free + held == total, no page with two owners
    return pool.num_pages - pool.num_free


class _HeldTransfer:
    """Prefill's send of the KV held until ``release()``: its signed manifest is known (what the
    Decode calls carry) while decode still waits for the transfer."""

    def __init__(self, monkeypatch, servicer):
        self.manifest: common_pb2.KvManifest | None = None
        self.sending = asyncio.Event()
        self._go = asyncio.Event()
        build, send = servicer._manifest, servicer._send

        def manifest(*args):
            self.manifest = build(*args)
            return self.manifest

        async def held_send(*args):
            self.sending.set()  # signed by now (mf.sign runs before the send)
            await self._go.wait()
            return await send(*args)

        monkeypatch.setattr(servicer, "_manifest", manifest)
        monkeypatch.setattr(servicer, "_send", held_send)

    def release(self) -> None:
        self._go.set()


@contextlib.asynccontextmanager
async def _two_waiting(tiny_dir, tmp_path, monkeypatch, request_id):  # noqa: F811
    """Nodes; a reservation; a Prefill whose transfer is held; then two Decode calls for the
    reservation, the first and a duplicate, both waiting on decode for the transfer. Yields
    ``(dec, pre, dstub, pstub, res, prefill, held, first, dup)``: ``prefill`` the Prefill call,
    ``held`` the held transfer, ``first`` and ``dup`` each ``(call, its first read)``."""
    async with node_pair(tiny_dir, tmp_path, transfer=TRANSFER) as (dec, pre, dstub, pstub):
        held = _HeldTransfer(monkeypatch, pre.servicer)
        res, prefill = await reserve_and_prefill(
            dstub, pstub, request_id, PROMPT, SAMPLING, max_new=MAX_NEW
        )
        assert await eventually(lambda: held.sending.is_set(), timeout=30)
        assert held.manifest is not None
        request = _decode_request(
            res, prefill_pb2.PrefillResponse(manifest=held.manifest), request_id, SAMPLING
        )
        calls = []
        for _ in ("first", "duplicate"):
            before = dec.servicer.rpc_count
            call = dstub.Decode(request)
            calls.append((call, asyncio.ensure_future(call.read())))
            # Counted as its handler starts; from there it goes straight to the transfer's wait.
            assert await eventually(lambda: dec.servicer.rpc_count == before + 1)  # noqa: B023
        assert not dec.servicer.reservations[res.reservation_id].transfer.done.is_set()
        assert _held(dec.rt.pool) == len(res.pages)
        try:
            yield dec, pre, dstub, pstub, res, prefill, held, calls[0], calls[1]
        finally:
            held.release()
            for call, read in calls:
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await read
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await prefill


async def _cancel(call, read) -> None:
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await read


async def test_a_cancelled_duplicate_leaves_the_first_decode_its_pages(
    tiny_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """The duplicate goes while both wait: the reservation stays held, the transfer is taken,
    and the first call decodes the same tokens as a colocated run; then every page is free."""
    ref = ColocatedEngine.from_path(tiny_dir).generate(
        [GenerationRequest(PROMPT, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))]
    )[0]
    async with _two_waiting(tiny_dir, tmp_path, monkeypatch, "dup") as waiting:
        dec, pre, _, pstub, res, prefill, held, first, dup = waiting
        pool = dec.rt.pool
        cancelled = _cancelled_streams(dec)
        await _cancel(*dup)
        # The duplicate's handler has ended (counted CANCELLED) ...
        assert await eventually(lambda: _cancelled_streams(dec) == cancelled + 1)
        # ... and took nothing with it: the first call still waits on its reservation's pages.
        assert _held(pool) == len(res.pages)
        assert list(dec.servicer.by_request) == ["dup"]
        assert not first[1].done()
        held.release()  # the transfer arrives
        reply = await prefill
        assert reply.manifest.token_count == len(PROMPT)
        call, read = first
        msg = await asyncio.wait_for(read, 30)
        assert msg.verified
        tokens, finish = [], ""
        while (msg := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
            tokens.extend(msg.token_ids)
            finish = msg.finish_reason or finish
        assert await call.code() == grpc.StatusCode.OK
        assert tokens == ref.token_ids and finish == ref.finish_reason == "length"
        # The stream's end gave the pages back, once: nothing leaked, nothing held twice.
        await _all_free(pool)
        pool.check_integrity()
        assert not dec.servicer.reservations
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="dup"))
        await _all_free(pre.rt.pool)
        pre.rt.pool.check_integrity()


async def test_the_first_decode_cancelled_beside_a_duplicate_still_gives_the_pages_back(
    tiny_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Control: the first call going while it waits releases the reservation at once (not at the
    reaper's 60 s), and the duplicate still waiting is told so, UNAVAILABLE
    RESERVATION_RELEASED; the transfer then arrives too late. Every page ends free."""
    async with _two_waiting(tiny_dir, tmp_path, monkeypatch, "own") as waiting:
        dec, pre, dstub, pstub, _, prefill, held, first, dup = waiting
        pool = dec.rt.pool
        await _cancel(*first)
        assert await eventually(lambda: pool.num_free == pool.num_pages, timeout=5)
        pool.check_integrity()
        assert not dec.servicer.reservations
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(dup[1], 10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(err.value).reason == RESERVATION_RELEASED
        held.release()
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await prefill
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not (await dstub.Release(prefill_pb2.ReleaseRequest(request_id="own"))).held
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="own"))
        await _all_free(pre.rt.pool)
        pre.rt.pool.check_integrity()
        pool.check_integrity()


async def test_a_duplicate_left_waiting_still_fails_the_request_once_the_transfer_arrives(
    tiny_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """The contract for a duplicate that stays (unchanged): checked after the first call's
    manifest, it fails check 1, DATA_LOSS, and the first stream ends CANCELLED; the pages go
    back once."""
    async with _two_waiting(tiny_dir, tmp_path, monkeypatch, "stays") as waiting:
        dec, pre, _, pstub, _, prefill, held, first, dup = waiting
        held.release()
        await prefill
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(dup[1], 30)
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS
        call, read = first
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            msg = await asyncio.wait_for(read, 30)
            while msg is not grpc.aio.EOF:
                msg = await asyncio.wait_for(call.read(), 30)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert any(e["kind"] == "integrity_violation" for e in dec.bus.recent)
        await _all_free(dec.rt.pool)
        dec.rt.pool.check_integrity()
        assert not dec.servicer.reservations
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="stays"))
        await _all_free(pre.rt.pool)
