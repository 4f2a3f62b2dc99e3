"""A client that does not read its Generate stream (control_plane/generation.py).

The run stays in the request table, counted against its tenant's max_concurrent_requests and
within AbortRequest's reach, until its handler has decided the status; the writing is bounded by
the request's deadline. The handler runs here with a context whose writes wait until the test
lets the client "read": what a gRPC stream does once the client's flow-control window is full
(the status too waits behind the messages already written, as grpc sends it after them). The
last test runs a real gRPC channel whose client does not read, against a fake pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from cp_harness import Cluster, eventually, make_cluster

from control_plane import generation
from control_plane.generation import MAX_IDS_PER_MESSAGE
from control_plane.lifecycle import RequestState
from control_plane.tenants import TenantLimits
from kvfence.auth import bearer_metadata
from kvfence.client import build_request
from kvfence.errors import KvfenceError, ResourceExhausted, Unavailable
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc, common_pb2, control_pb2

DEADLINE_S = 1.0
NEW_TOKENS = 8  # the fake decode sends 3 a message: the first write waits, the rest pile up


class Aborted(Exception):
    """What grpc's abort raises (AbortError), once the status went out."""


class UnreadStream:
    """A Generate context whose client reads nothing until ``read`` is set."""

    def __init__(self, api_key: str):
        self.read = asyncio.Event()
        self.waiting = asyncio.Event()  # a write waits for the client
        self.written: list[client_pb2.GenerateResponse] = []
        self.status: Any = None
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # no deadline of its own: the control plane's default applies

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass  # headers are not flow-controlled: they never wait for the client

    async def write(self, msg: client_pb2.GenerateResponse) -> None:
        if not self.read.is_set():
            self.waiting.set()
            await self.read.wait()
        self.written.append(msg)

    async def abort_with_status(self, status: Any) -> None:
        self.status = status
        await self.read.wait()
        raise Aborted(status.code)

    def ids(self) -> list[int]:
        return [i for m in self.written for i in m.token_ids]


def start(c: Cluster, ctx: UnreadStream) -> asyncio.Task[None]:
    req = build_request(None, [5, 6, 7], max_new_tokens=NEW_TOKENS)
    return asyncio.create_task(c.cp.generation.Generate(req, ctx))  # type: ignore[arg-type]


@pytest.fixture
async def limited(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = await make_cluster(
        tmp_path, limits=TenantLimits(max_concurrent_requests=1), default_deadline_s=DEADLINE_S
    )
    yield c
    await c.close()


async def test_an_unread_stream_counts_against_its_tenant_until_read_to_the_end(
    limited: Cluster,
) -> None:
    """The pipeline finishes (its pages released: its task is gone) while the client reads
    nothing. The run used to leave the table then: the tenant's next request was admitted however
    many unread answers it held. Now it is refused TENANT_CONCURRENCY, and ListRequests shows
    the first. Control: once the client has read it to the end, the next request is served."""
    c = limited
    ctx = UnreadStream(c.api_key)
    handler = start(c, ctx)
    try:
        await asyncio.wait_for(ctx.waiting.wait(), 5)
        [run] = c.cp.table
        await eventually(lambda: not c.cp.generation.tasks)  # the pipeline ended, released
        assert run.record.state == RequestState.FINISHED
        assert c.cp.table.active_for_tenant("acme") == 1
        admin, auth = c.admin()
        listed = await admin.ListRequests(control_pb2.ListRequestsRequest(), metadata=auth)
        assert [r.request_id for r in listed.requests] == [run.record.request_id]
        with pytest.raises(ResourceExhausted) as err:
            await c.client().generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "TENANT_CONCURRENCY"

        ctx.read.set()  # the client reads it all
        await asyncio.wait_for(handler, 5)
        assert len(ctx.ids()) == NEW_TOKENS and ctx.written[-1].finish_reason == "length"
        assert ctx.status is None  # OK
        assert not c.cp.table
        result = await c.client().generate(prompt_ids=[10], max_new_tokens=2)
        assert result.finish_reason == "length"
    finally:
        ctx.read.set()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


@pytest.mark.parametrize("reads", [False, True], ids=["unread", "control-reads"])
async def test_an_unread_stream_ends_deadline_exceeded_at_its_deadline(
    limited: Cluster, reads: bool
) -> None:
    """No client deadline: the control plane's default (DEADLINE_S) applies. The handler waited
    on its write for good (the client keeps its connection with keepalive pings), holding the
    answer. Now it ends DEADLINE_EXCEEDED, and the run leaves the table and stops counting at
    once, while the status itself still waits for the client (grpc sends it after the messages
    already written). Control: a client that reads finishes OK within the same deadline."""
    c = limited
    ctx = UnreadStream(c.api_key)
    if reads:
        ctx.read.set()
    handler = start(c, ctx)
    try:
        if reads:
            await asyncio.wait_for(handler, 5)
            assert ctx.status is None
            assert len(ctx.ids()) == NEW_TOKENS and ctx.written[-1].usage.completion_tokens == 8
        else:
            with structlog.testing.capture_logs() as logs:
                await eventually(lambda: ctx.status is not None, timeout=DEADLINE_S + 5)
            [line] = [e for e in logs if e["event"] == "answer not read before the deadline"]
            assert line["tokens_unwritten"] == NEW_TOKENS - 3  # the first message was handed over
            assert ctx.status.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "before the client read its answer" in ctx.status.details
            assert not handler.done()  # the status waits behind the unread messages
            ctx.read.set()
            with pytest.raises(Aborted):
                await asyncio.wait_for(handler, 5)
            assert len(ctx.ids()) < NEW_TOKENS  # what was not written was dropped
        await eventually(lambda: not c.cp.table and not c.cp.generation.tasks)
        assert c.cp.table.active_for_tenant("acme") == 0
    finally:
        ctx.read.set()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


@pytest.mark.parametrize("phase", ["finished", "decoding"])
async def test_abort_request_ends_a_stream_whose_client_does_not_read(
    cluster: Cluster, phase: str
) -> None:
    """finished: the pipeline has finished, the answer waits for the client. AbortRequest used to
    answer NOT_FOUND (the run had left the table), and nothing ended the stream. decoding: the
    request still decodes (decode holds after its first tokens) while the write waits; the
    pipeline ended CANCELLED at once, but the stream waited on its write until the deadline
    before the error could go out. Now both are found, aborted, and end CANCELLED at once;
    then the request is gone (NOT_FOUND)."""
    c = cluster
    if phase == "decoding":
        c.script.tokens_hold = asyncio.Event()
    ctx = UnreadStream(c.api_key)
    handler = start(c, ctx)
    try:
        await asyncio.wait_for(ctx.waiting.wait(), 5)
        admin, auth = c.admin()
        if phase == "finished":
            await eventually(lambda: not c.cp.generation.tasks)
        [info] = (
            await admin.ListRequests(control_pb2.ListRequestsRequest(), metadata=auth)
        ).requests
        assert info.state == phase.upper()
        request = control_pb2.AbortRequestRequest(request_id=info.request_id)
        assert (await admin.AbortRequest(request, metadata=auth)).aborted
        await eventually(lambda: ctx.status is not None)
        assert ctx.status.code == grpc.StatusCode.CANCELLED
        assert "aborted by an operator" in ctx.status.details
        await eventually(lambda: not c.cp.table)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.AbortRequest(request, metadata=auth)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        if c.script.tokens_hold is not None:
            c.script.tokens_hold.set()
        ctx.read.set()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


class BigAnswer:
    """A pipeline that emits MESSAGES token messages of about 32 KB each, far more than a client's
    64 KiB stream window without BDP probing, then ends with ``end``: an error it raises, or
    (None) the final message."""

    MESSAGES = 8

    def __init__(self, end: KvfenceError | None, *, in_a_write: bool = False, first_bytes: int = 0):
        self.end = end
        self.in_a_write = in_a_write
        self.first_bytes = first_bytes  # the first message's text this long, if set

    async def execute(self, run: Any, request: Any, deadline: float, emit: Any) -> None:
        for k in range(self.MESSAGES):
            ids = list(range(20000, 20000 + MAX_IDS_PER_MESSAGE))
            text = "x" * self.first_bytes if k == 0 and self.first_bytes else "word " * len(ids)
            emit(
                client_pb2.GenerateResponse(
                    request_id=run.record.request_id, token_ids=ids, text=text
                )
            )
        if self.end is not None:
            # in_a_write: fails once a write waits for the client, so the answer is the error
            # (StreamRun.stop), not the tokens ahead of it; else the error follows the tokens.
            while self.in_a_write and not run.writing:
                await asyncio.sleep(0.005)
            run.record.state = RequestState.FAILED  # what the real pipeline ends in
            raise self.end
        run.record.state = RequestState.FINISHED
        emit(
            client_pb2.GenerateResponse(
                request_id=run.record.request_id,
                finish_reason="length",
                usage=common_pb2.Usage(completion_tokens=self.MESSAGES * MAX_IDS_PER_MESSAGE),
            )
        )


@pytest.mark.parametrize(
    ("end", "reads", "first_bytes"),
    [
        ("deadline", False, 0),
        ("deadline", False, 100_000),
        ("error", False, 0),
        ("error", True, 0),
    ],
    ids=["deadline-unread", "deadline-unread-big-first", "error-unread", "control-error-reads"],
)
async def test_a_status_the_client_does_not_read_does_not_hold_the_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str, reads: bool, first_bytes: int
) -> None:
    """A real gRPC channel whose client does not read. grpc sends a status after the messages
    already written, so the handler's abort (its deadline passed, or the pipeline failed) waited
    until the client read or went: with keepalive pings, for good, one handler per such request.
    Now the handler gives up after ABORT_WAIT_S (logged "status not taken by the client"); the
    status stays queued in grpc, and the client, when it reads at last, gets the messages sent
    and then that status. Control: a client that reads gets the error status as before, and the
    handler ends with it (nothing logged)."""
    monkeypatch.setattr(generation, "ABORT_WAIT_S", 1.0)
    c = await make_cluster(tmp_path, default_deadline_s=0.5)
    error = Unavailable("decode node lost")
    pipeline = BigAnswer(
        error if end == "error" else None, in_a_write=not reads, first_bytes=first_bytes
    )
    monkeypatch.setattr(c.cp.generation, "pipeline", pipeline)
    # No BDP probing: the client's stream window stays at 64 KiB, so the writes wait for it.
    channel = grpc.aio.insecure_channel(c.target, options=[("grpc.http2.bdp_probe", 0)])
    call = client_pb2_grpc.GenerationStub(channel).Generate(
        build_request(None, [5, 6, 7], max_new_tokens=NEW_TOKENS),
        metadata=bearer_metadata(c.api_key),
    )
    received: list[client_pb2.GenerateResponse] = []

    async def read_all() -> grpc.StatusCode:
        try:
            async for msg in call:
                received.append(msg)
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    try:
        with structlog.testing.capture_logs() as logs:
            if reads:
                code = await asyncio.wait_for(read_all(), 5)
                await eventually(lambda: not c.cp.table)
            else:
                await eventually(
                    lambda: any(e["event"] == "status not taken by the client" for e in logs),
                    timeout=5,
                )
                code = await asyncio.wait_for(read_all(), 5)  # the client reads at last
        gave_up = [e for e in logs if e["event"] == "status not taken by the client"]
        # the fake pipeline ran as meant (it did not fail on a bug of its own)
        assert not [e for e in logs if e["event"] == "request task failed"]
        # a first message over the client's 64 KiB window, its write cut by the deadline: with
        # the headers sent before it, grpc still sends the status (else the abort failed and
        # the client, reading at last, waited for a status that never came)
        assert not [e for e in logs if e["event"] == "status could not be sent"]
        expected = (
            grpc.StatusCode.UNAVAILABLE if end == "error" else grpc.StatusCode.DEADLINE_EXCEEDED
        )
        assert code == expected
        assert received
        if reads:
            assert len(received) == BigAnswer.MESSAGES  # every token, then the error
            assert not gave_up
        else:
            assert len(received) < BigAnswer.MESSAGES  # grpc took no more: the writes waited
            [line] = gave_up
            assert line["code"] == expected.name
            assert line["request_id"].startswith("req-")
            assert not c.cp.table
    finally:
        call.cancel()
        await channel.close(None)
        await c.close()


class FailsAfterItsAnswer:
    """A pipeline whose answer is whole (tokens, then the final message) while the handler is
    still writing its first tokens, and which then fails: its releases, say."""

    async def execute(self, run: Any, request: Any, deadline: float, emit: Any) -> None:
        emit(client_pb2.GenerateResponse(request_id=run.record.request_id, token_ids=[7, 8]))
        while not run.writing:  # the handler's write waits for the client
            await asyncio.sleep(0.005)
        run.record.state = RequestState.FINISHED
        emit(
            client_pb2.GenerateResponse(
                request_id=run.record.request_id,
                finish_reason="length",
                usage=common_pb2.Usage(completion_tokens=2),
            )
        )
        raise Unavailable("release bookkeeping broke")


@pytest.mark.parametrize("fails", [True, False], ids=["fails-after", "control"])
async def test_a_failure_after_the_answer_ended_does_not_stop_its_writing(
    limited: Cluster, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """The pipeline's error, emitted while a write waits, ends the stream with that error at
    once (the answer is the error). One emitted after the answer's final message is not the
    answer: it stopped the write all the same, and the client got UNAVAILABLE for a whole answer.
    Control: the same pipeline without the failure."""
    c = limited
    pipeline = FailsAfterItsAnswer()
    if not fails:
        real = pipeline.execute

        async def execute(*args: Any) -> None:
            with contextlib.suppress(Unavailable):
                await real(*args)

        monkeypatch.setattr(pipeline, "execute", execute)
    monkeypatch.setattr(c.cp.generation, "pipeline", pipeline)
    ctx = UnreadStream(c.api_key)
    handler = start(c, ctx)
    try:
        await asyncio.wait_for(ctx.waiting.wait(), 5)
        await eventually(lambda: not c.cp.generation.tasks)  # the pipeline has ended
        ctx.read.set()
        await asyncio.wait_for(handler, 5)
        assert ctx.status is None  # OK: the whole answer, not the late error
        assert ctx.ids() == [7, 8] and ctx.written[-1].finish_reason == "length"
    finally:
        ctx.read.set()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
