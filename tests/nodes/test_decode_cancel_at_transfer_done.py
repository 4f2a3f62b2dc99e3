"""A Decode call cancelled in the very turn of the event loop in which its transfer completes.

The wait for the transfer was ``asyncio.wait_for``, which on Python 3.11 swallows a cancellation
that arrives when the awaited event is already set: the gone call went on, verified the manifest,
marked the reservation DECODING and yielded ``verified`` to nobody, and its pages stayed held
until the generator was collected (the module docstring says such a call gives them back at
once). Controls: a call cancelled while still waiting gives them back (as before), and a call
not cancelled verifies and decodes."""

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

from kvfence.auth import bearer_metadata
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2

# Long enough that the wait below ends only by the transfer or a cancel, never by a timeout.
TRANSFER = {"batch_timeout_s": 30, "reservation_timeout_s": 60.0}
PROMPT = list(range(3, 23))
MAX_NEW = 4
SAMPLING = common_pb2.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("case", ["cancelled-as-done", "cancelled-waiting", "not-cancelled"])
async def test_a_decode_cancelled_as_its_transfer_completes_gives_the_pages_back(
    tiny_dir,  # noqa: F811
    tmp_path,
    case,
):
    async with node_pair(tiny_dir, tmp_path, transfer=TRANSFER) as (dec, _, dstub, pstub):
        pool = dec.rt.pool
        res, call = await reserve_and_prefill(dstub, pstub, "c", PROMPT, SAMPLING, max_new=MAX_NEW)
        reply = await call  # the transfer is complete on decode
        reservation = dec.servicer.reservations[res.reservation_id]
        # The handler waits on this event instead of the transfer's own (set already): the test
        # decides the turn in which the transfer "completes".
        completes = asyncio.Event()
        reservation.transfer.done = completes
        aborted: list[grpc.StatusCode] = []

        class Context:  # what the handler uses of its context: the node token, ending the call
            def invocation_metadata(self):
                return bearer_metadata(dec.node_token)

            async def abort_with_status(self, status):
                aborted.append(status.code)
                raise asyncio.CancelledError  # how grpc.aio's abort ends a handler

        # Driven as grpc.aio drives it: the call's cancellation is its task's.
        handler = dec.servicer.Decode(_decode_request(res, reply, "c", SAMPLING), Context())
        first = asyncio.ensure_future(handler.__anext__())
        try:
            assert await eventually(lambda: reservation.awaited)  # waiting for the transfer
            if case != "cancelled-waiting":
                completes.set()
            if case != "not-cancelled":
                first.cancel()  # in the same turn as the set() above, for cancelled-as-done
            try:
                outcome = "verified" if (await first).verified else "not verified"
            except asyncio.CancelledError:
                outcome = "cancelled"
            held = pool.num_pages - pool.num_free
            if case == "not-cancelled":  # control: the call that stays decodes
                assert outcome == "verified"
                assert held == len(res.pages)
                tokens = [t async for msg in handler for t in msg.token_ids]
                assert len(tokens) == MAX_NEW and aborted == []
            else:
                assert outcome == "cancelled"
                assert held == 0  # given back at once, not when the generator is collected
                assert res.reservation_id not in dec.servicer.reservations
                assert not list(dec.servicer.by_request)
            assert dec.servicer.batcher is not None and dec.servicer.batcher.active == 0
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await handler.aclose()
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="c"))
        await _all_free(pool)
        pool.check_integrity()
