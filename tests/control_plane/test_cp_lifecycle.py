"""The lifecycle state machine: legal moves only, terminal states are final, one writer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from asyncwait import eventually
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from control_plane.detok import IncrementalDetokenizer
from control_plane.lifecycle import (
    TERMINAL,
    IllegalTransition,
    RequestRecord,
    RequestState,
    Run,
    allowed,
    transition,
)
from control_plane.model_info import ByteTokenizer
from kvfence.errors import Cancelled, Unavailable

S = RequestState
HAPPY = [S.ADMITTED, S.RESERVED, S.PREFILLING, S.KV_VERIFIED, S.DECODING, S.FINISHED]


def make_record() -> RequestRecord:
    return RequestRecord("req-1", "acme")


def test_happy_path_and_history() -> None:
    rec = make_record()
    for state in HAPPY:
        transition(rec, state)
    assert rec.state == S.FINISHED and rec.terminal
    assert [s for s, _ in rec.history] == [S.RECEIVED, *HAPPY[:-1]]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (S.RECEIVED, S.RESERVED),  # skipping admission
        (S.RECEIVED, S.FINISHED),
        (S.ADMITTED, S.REJECTED),  # REJECTED only before admission
        (S.RESERVED, S.DECODING),  # decoding without verified KV
        (S.PREFILLING, S.DECODING),
        (S.DECODING, S.PREFILLING),
    ],
)
def test_illegal_moves_raise(src: RequestState, dst: RequestState) -> None:
    rec = make_record()
    rec.state = src
    with pytest.raises(IllegalTransition):
        transition(rec, dst)
    assert rec.state == src


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
def test_terminal_is_never_resumed(terminal: RequestState) -> None:
    rec = make_record()
    rec.state = terminal
    for dst in RequestState:
        with pytest.raises(IllegalTransition):
            transition(rec, dst)


class LifecycleMachine(RuleBasedStateMachine):
    """Random walks over every (src, dst) pair: transition() agrees with the diagram."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = make_record()
        self.path = [S.RECEIVED]

    @rule(dst=st.sampled_from(list(RequestState)))
    def move(self, dst: RequestState) -> None:
        src = self.rec.state
        if allowed(src, dst):
            transition(self.rec, dst)
            self.path.append(dst)
        else:
            with pytest.raises(IllegalTransition):
                transition(self.rec, dst)
            assert self.rec.state == src

    @invariant()
    def path_is_a_prefix_of_the_happy_path_plus_one_terminal(self) -> None:
        body = self.path[1:]
        if body and body[-1] in (S.FAILED, S.CANCELLED, S.REJECTED):
            body = body[:-1]
        assert body == HAPPY[: len(body)]
        if S.REJECTED in self.path:
            assert self.path == [S.RECEIVED, S.REJECTED]
        assert sum(s in TERMINAL for s in self.path) <= 1


TestLifecycleMachine = LifecycleMachine.TestCase


async def test_interrupt_cancels_the_guarded_await_and_first_wins() -> None:
    run = Run(make_record())
    started = asyncio.Event()

    async def node_call() -> str:
        started.set()
        await asyncio.sleep(10)
        return "never"

    task = asyncio.create_task(run.guard(node_call()))
    await started.wait()
    assert run.interrupt(Unavailable("node lost"))
    assert not run.interrupt(Cancelled("too late"))
    with pytest.raises(Unavailable, match="node lost"):
        await task
    with pytest.raises(Unavailable):  # later awaits see it at once
        await run.guard(asyncio.sleep(10))
    # Control: without an interrupt the guarded value comes back.
    assert await Run(make_record()).guard(asyncio.sleep(0, result=7)) == 7


@given(st.text().filter(lambda t: "\ufffd" not in t), st.lists(st.integers(1, 4), min_size=1))
def test_detokenizer_never_splits_characters(text: str, steps: list[int]) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = steps[k % len(steps)]
        pieces.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@contextlib.asynccontextmanager
async def numbers_server() -> AsyncIterator[tuple[grpc.aio.Channel, asyncio.Event]]:
    """A server whose one stream sends ``b"0"``, ``b"1"``, ... up to the count asked (b"3"), and
    then hangs when asked (b"3+hang") until cancelled (the event it returns is set then)."""
    cancelled = asyncio.Event()

    async def numbers(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        count, _, hang = request.decode().partition("+")
        for i in range(int(count)):
            yield str(i).encode()
        if hang:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "t.Numbers", {"Count": grpc.unary_stream_rpc_method_handler(numbers)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, cancelled
    finally:
        await server.stop(None)


async def test_read_stream_interrupt_cancels_the_rpc_and_raises() -> None:
    async with numbers_server() as (channel, server_cancelled):
        count = channel.unary_stream("/t.Numbers/Count")
        # Control: without an interrupt every message comes, then the stream ends.
        assert [m async for m in Run(make_record()).read_stream(count(b"3"))] == [b"0", b"1", b"2"]

        run = Run(make_record())
        call = count(b"2+hang")
        got: list[bytes] = []

        async def consume() -> None:
            async for msg in run.read_stream(call):
                got.append(msg)

        task = asyncio.create_task(consume())
        assert await eventually(lambda: len(got) == 2)
        assert run.interrupt(Unavailable("node lost"))
        with pytest.raises(Unavailable, match="node lost"):
            await asyncio.wait_for(task, 5)
        assert got == [b"0", b"1"]
        assert call.cancelled()
        await asyncio.wait_for(server_cancelled.wait(), 5)  # the node stopped working for it
        with pytest.raises(Unavailable):  # an interrupted run reads no further stream
            await anext(run.read_stream(count(b"3")))


async def test_read_stream_lets_a_task_cancel_through_as_cancel() -> None:
    """Cancelling the pipeline task (shutdown) is not the interrupt, even when one is pending."""
    async with numbers_server() as (channel, _):
        run = Run(make_record())
        call = channel.unary_stream("/t.Numbers/Count")(b"0+hang")
        task = asyncio.create_task(anext(run.read_stream(call)))
        await asyncio.sleep(0.1)
        task.cancel()
        run.interrupt(Unavailable("node lost"))
        with pytest.raises(asyncio.CancelledError):
            await task
