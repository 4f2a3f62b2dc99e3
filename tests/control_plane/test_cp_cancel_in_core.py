"""An interrupted node call is cancelled in grpc core, and grpc's own task is let finish its batch
(``control_plane.lifecycle._cancel``): cancelling that task with the batch in flight leaks the
batch's native op array, about 1 KB per call (grpc/grpc#43360), and the control plane cancels a
Reserve or a Prefill for every client that goes away before its first token. The leak itself is
measured outside the tests (README, "Memory over time"); here: the RPC is cancelled on the server
at once, the interrupt is raised, and the call was cancelled in core (its details are the control
plane's words, not those of grpc's task cancel). Control: an await that is not a grpc call is
cancelled as before."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from control_plane.lifecycle import RequestRecord, Run
from kvfence.errors import Cancelled

METHOD = "/kvfence.test.Hang/Call"


async def _hanging_server() -> tuple[grpc.aio.Server, int, asyncio.Event, asyncio.Event]:
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def hang(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b""

    handler = grpc.method_handlers_generic_handler(
        "kvfence.test.Hang", {"Call": grpc.unary_unary_rpc_method_handler(hang)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, entered, cancelled


async def test_an_interrupted_unary_call_is_cancelled_in_grpc_core() -> None:
    server, port, entered, cancelled = await _hanging_server()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD)(b"x")
            assert isinstance(call, grpc.aio.UnaryUnaryCall)
            run = Run(RequestRecord("req-core", "t"))
            guarded = asyncio.create_task(run.guard(call))
            await asyncio.wait_for(entered.wait(), 5)
            run.interrupt(Cancelled("the client went away"))
            with pytest.raises(Cancelled):
                await asyncio.wait_for(guarded, 5)
            await asyncio.wait_for(cancelled.wait(), 5)  # the node stops working for it
            assert call.done() and await call.code() == grpc.StatusCode.CANCELLED
            # cancelled in core with the control plane's words, not through grpc's task (whose
            # cancel says "Locally cancelled by application!")
            assert "cancelled by the control plane" in (await call.details() or "")
    finally:
        await server.stop(0)


async def test_control_an_await_that_is_not_a_grpc_call_is_cancelled() -> None:
    run = Run(RequestRecord("req-sleep", "t"))
    sleeping = asyncio.ensure_future(asyncio.sleep(100))
    guarded = asyncio.create_task(run.guard(sleeping))
    await asyncio.sleep(0)
    run.interrupt(Cancelled("the client went away"))
    with pytest.raises(Cancelled):
        await asyncio.wait_for(guarded, 5)
    assert sleeping.cancelled()
