"""The public ``Generation`` service: authenticates the tenant and pumps a request's stream.

The request itself runs in a task of its own (:class:`control_plane.pipeline.Pipeline`), not in the
RPC handler: when the client cancels or its deadline passes, gRPC cancels the handler, and the
handler only turns that into an interrupt. The request task then cancels its node RPCs and releases
everything it holds, independent of the dead RPC.

The handler ends the RPC as soon as the request's answer is decided: with OK once the final
message (finish reason, usage) is written, with the error once the pipeline emits it. The request
task releases on the nodes after that, on its own (a node slow to answer Release held a finished
answer up to RELEASE_TIMEOUT_S, past a client's deadline); the servicer keeps it in ``tasks``,
which the control plane's ``stop`` waits for, and logs its failure.

The other way round, a request whose pipeline has ended (its pages released) stays in the request
table, counted against its tenant's ``max_concurrent_requests``, until its handler has decided the
RPC's status (:class:`StreamRun`): a client that does not read its stream holds its answer in the
control plane until then. The handler writes within the request's deadline (the pipeline's,
already cut to ``max_deadline_s``) and ends DEADLINE_EXCEEDED when the client has not taken its
answer by then, dropping what it did not write; an interrupt (AbortRequest, a revoked key,
shutdown) or the pipeline's error ends a write in progress at once. Without that, unread streams
were admitted beyond the tenant's limit, unseen by ListRequests and out of AbortRequest's reach,
each holding its answer for as long as the client kept its connection. A stopping control plane
gives these handlers its grace period too (``settle``), as it does the pipelines, before it
interrupts them. A handler that ends its RPC with an error waits for grpc to send the status at
most ABORT_WAIT_S (grpc sends it after the messages already written, so only once the client has
read them).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable

import grpc

from control_plane.lifecycle import RequestRecord, RequestTable, Run
from control_plane.pipeline import Pipeline
from control_plane.tenants import Tenant, TenantStore, hash_key
from kvfence.errors import (
    Cancelled,
    DeadlineExceeded,
    KvfenceError,
    Unauthenticated,
    Unavailable,
)
from kvfence.logging import get_logger, request_context
from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc
from kvfence.server import abort, bearer_token

_DONE = object()

log = get_logger("generation")


def is_final(msg: client_pb2.GenerateResponse) -> bool:
    """The request's last message: it carries the finish reason and usage."""
    return msg.HasField("usage") or bool(msg.finish_reason)


# What grpc.aio raises from an abort it could not send (its call's batch failed): logged, not
# left to escape the handler. Private to grpcio: where it is missing, nothing is caught.
def _batch_errors() -> tuple[type[BaseException], ...]:
    try:
        from grpc._cython import cygrpc  # type: ignore[attr-defined]
    except ImportError:
        return ()
    err = getattr(cygrpc, "ExecuteBatchError", None)
    return (err,) if isinstance(err, type) and issubclass(err, BaseException) else ()


_BATCH_ERRORS = _batch_errors()
# A client that fell behind gets what piled up in messages of at most this many tokens (whole
# decode messages, so one larger than this goes alone): all of it in one message could pass the
# 4 MiB a client of another gRPC library accepts by default, and would be built on the event loop
# in one go.
MAX_IDS_PER_MESSAGE = 4096

# How long a handler that ends its RPC with an error waits for grpc to send the status (``_end``).
# grpc sends it after the messages already written, so to a client that does not read it waits
# until the client does or goes: with keepalive pings, for good, one handler (its request's prompt
# included) per such request. Past this the handler returns; the status stays queued in grpc, and
# a client that reads later still gets it after those messages. (grpc.aio has no way for a
# handler to reset its stream: a handler that returns, raises or is cancelled leaves the call open
# until the client reads or goes, with the part of the answer grpc took: as much as the client's
# flow-control window allowed.)
ABORT_WAIT_S = 2.0


class PendingAnswer:
    """What a request emitted that its handler has not written yet (``emit`` is the pipeline's
    ``Emit``), taken by the handler a message at a time (``get``).

    Token messages are kept as flat lists of their ids and text pieces, not as a message object
    each (about 1 KB apiece with upb, held as long as a client does not read), and what waited is
    written as one message built once: appending each waiting message's text to a message (upb
    copies the whole text into the arena on each assignment and keeps the old copies) cost
    O(k^2), 11 s and 2.4 GB for 40,000 waiting messages, on the event loop. The first item that is
    not a token message (the final message, an error, the end) ends the answer: it is never merged
    into nor merged, comes after the tokens emitted before it, and nothing emitted after it is
    kept."""

    def __init__(self) -> None:
        self._request_id = ""
        self._ids: list[int] = []
        self._texts: list[str] = []
        self._counts: list[int] = []  # ids per text piece: a message ends where a piece ends
        self._piece = 0  # the first piece not taken, and its first id
        self._id = 0
        self._alone: client_pb2.GenerateResponse | None = None  # the one message waiting
        self._end: object | None = None
        self._ready = asyncio.Event()

    def emit(self, item: object) -> bool:
        """Keep ``item``; False when the answer had already ended (it is dropped)."""
        if self._end is not None:
            return False
        if isinstance(item, client_pb2.GenerateResponse) and not is_final(item):
            if self._alone is None and not self._texts:
                # Nothing waits (a client that keeps up): written as it is, without the cost
                # of taking it apart and building it again (several µs a message).
                self._alone = item
            else:
                if self._alone is not None:
                    self._keep(self._alone)
                    self._alone = None
                self._keep(item)
        else:
            self._end = item
        self._ready.set()
        return True

    def _keep(self, msg: client_pb2.GenerateResponse) -> None:
        self._request_id = msg.request_id
        self._ids.extend(msg.token_ids)
        self._texts.append(msg.text)
        self._counts.append(len(msg.token_ids))

    @property
    def unwritten(self) -> int:
        """Token ids waiting to be written."""
        alone = len(self._alone.token_ids) if self._alone is not None else 0
        return alone + len(self._ids) - self._id

    def drop(self) -> None:
        """Nothing more is written: let go of what waits, and of what is emitted from now."""
        self._ids, self._texts, self._counts = [], [], []
        self._piece = self._id = 0
        self._alone = None
        if self._end is None:
            self._end = _DONE

    def take(self) -> object | None:
        """The next thing to write, without waiting: a message with the token pieces waiting
        (whole pieces, at most MAX_IDS_PER_MESSAGE ids unless one piece has more), or once none
        wait, the item that ended the answer; None when there is nothing yet."""
        if self._alone is not None:
            msg, self._alone = self._alone, None
            return msg
        first = self._piece
        if first == len(self._texts):
            if self._end is None:
                self._ready.clear()
            return self._end
        last, n = first, 0
        while last < len(self._counts) and (
            n == 0 or n + self._counts[last] <= MAX_IDS_PER_MESSAGE
        ):
            n += self._counts[last]
            last += 1
        msg = client_pb2.GenerateResponse(
            request_id=self._request_id,
            token_ids=self._ids[self._id : self._id + n],
            text="".join(self._texts[first:last]),
        )
        self._piece, self._id = last, self._id + n
        if last == len(self._texts):
            self._ids.clear()
            self._texts.clear()
            self._counts.clear()
            self._piece = self._id = 0
        elif last > 1024 and 2 * last > len(self._texts):
            # Written pieces go as the writer passes them (it may stay behind for long), each
            # removal costing at most what was written since the last: linear overall.
            del self._ids[: self._id], self._texts[:last], self._counts[:last]
            self._piece = self._id = 0
        return msg

    async def get(self) -> object:
        """The next thing to write, once there is one (``take``)."""
        while (item := self.take()) is None:
            await self._ready.wait()
        return item


class StreamRun(Run):
    """A Generate request's run: it counts against its tenant's concurrency (``live``) until its
    handler has decided the RPC's status (written the final message, or ends it with an error),
    however long after its pipeline ended the client takes its answer, and an interrupt reaches
    the handler's writing too.

    ``Run.interrupt`` refuses a request whose pipeline has ended (terminal): here, one whose
    answer is still being written accepts it, and the handler ends the RPC with it at once
    (``stop``)."""

    def __init__(self, record: RequestRecord, key_sha256: str = "", tenant: Tenant | None = None):
        super().__init__(record, key_sha256, tenant)
        # Set once the handler has decided the status (``GenerationServicer._answered``): what a
        # stopping control plane waits for, within its grace, besides the pipeline's task.
        self.decided = asyncio.Event()
        self.stopped: KvfenceError | None = None  # what the handler ends with, writing or not
        self.writing = False  # in context.write
        # The handler's deadline timer while it serves the stream: rescheduled to now, it ends
        # the handler's wait or write (TimeoutError, and the handler answers ``stopped``).
        self.timer: asyncio.Timeout | None = None

    @property
    def answered(self) -> bool:
        """The handler has decided the RPC's status (it may still be sending it)."""
        return self.decided.is_set()

    @property
    def live(self) -> bool:
        if self.answered:
            return False
        if self.record.terminal:  # its answer is still being written
            return self.stopped is None and self.interrupted is None
        return super().live

    def interrupt(self, err: KvfenceError) -> bool:
        if super().interrupt(err):
            return True  # the pipeline ends with ``err`` and emits it (``_run``'s emit)
        if not self.record.terminal or self.stopped is not None or self.timer is None:
            return False
        self.stop(err)
        return True

    def stop(self, err: KvfenceError) -> None:
        """End the handler's wait or write now, with ``err``: an interrupt once the pipeline has
        ended, or the pipeline's error while a write is in progress (the answer is that error:
        a client that does not read is not waited for to take the tokens ahead of it). A no-op
        once the handler is ending."""
        if self.stopped is None and self.timer is not None:
            self.stopped = err
            self.timer.reschedule(asyncio.get_running_loop().time())


def authenticate(context: grpc.aio.ServicerContext, tenants: TenantStore) -> Tenant:
    """The tenant of the call's API key; Unauthenticated when missing, unknown or revoked."""
    key = bearer_token(context)
    if key is None:
        raise Unauthenticated("missing API key ('authorization: Bearer <key>' metadata)")
    tenant = tenants.authenticate(key)
    if tenant is None:
        raise Unauthenticated("the API key is not valid or has been revoked")
    return tenant


class GenerationServicer(client_pb2_grpc.GenerationServicer):
    """Generate and ListModels."""

    def __init__(
        self,
        pipeline: Pipeline,
        tenants: TenantStore,
        table: RequestTable,
        metrics: Metrics,
        default_deadline_s: float,
        list_models: Callable[[], client_pb2.ListModelsResponse],
        *,
        max_deadline_s: float,
    ):
        self.pipeline = pipeline
        self.tenants = tenants
        self.table = table
        self.metrics = metrics
        self.default_deadline_s = default_deadline_s
        self.max_deadline_s = max_deadline_s
        self._list_models = list_models
        self.tasks: set[asyncio.Task[None]] = set()

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the requests in flight now to end: their pipelines
        (``tasks``: the releases on the nodes included) and their handlers' writing
        (``StreamRun.decided``). A request whose pipeline finished while its client was still
        reading its answer has no task left, and its answer must not be cut before the grace
        period is over. Returns early once they all have."""
        tasks = set(self.tasks)
        runs = [r for r in self.table if isinstance(r, StreamRun) and not r.answered]

        async def settled() -> None:
            if tasks:
                await asyncio.wait(tasks)
            for run in runs:
                await run.decided.wait()

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await settled()

    async def Generate(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self.metrics.rpcs_total.labels(method="Generate").inc()
        try:
            tenant = authenticate(context, self.tenants)
        except KvfenceError as err:
            self.metrics.requests_total.labels(status=err.code.name).inc()
            self._refused(context, "Generate", err)
            await abort(context, err)
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        # A client's own deadline is kept up to max_deadline_s: a request holds its queue place
        # (and its pages) until then, so an unbounded one could hold them for good.
        budget = (
            self.default_deadline_s if remaining is None else min(remaining, self.max_deadline_s)
        )
        deadline = loop.time() + budget
        run = StreamRun(
            RequestRecord("req-" + secrets.token_hex(8), tenant.name),
            key_sha256=hash_key(bearer_token(context) or ""),
            tenant=tenant,
        )
        answer = PendingAnswer()
        try:
            with request_context(run.record.request_id, tenant.name):
                self.table.add(run)
                task = loop.create_task(self._run(run, request, deadline, answer))
                # Owned here until it ends: the handler may return before it does (below). Added
                # in the request's context, so that a failure logged at its end names the request.
                self.tasks.add(task)
                task.add_done_callback(self._ended)
            # The request's deadline bounds the writing too: the pipeline's ends its work, not a
            # client that does not read what it was sent (with no deadline of its own and
            # keepalive pings, it held its answer here for good).
            async with asyncio.timeout_at(deadline) as timer:
                run.timer = timer
                try:
                    failed = await self._write(run, answer, context)
                finally:
                    run.timer = None
            if failed is not None:
                # Outside the timer: an abort that waits has its own bound (``_end``).
                await self._end(run, answer, context, failed)
        except TimeoutError:
            why = run.stopped
            if why is None:
                if run.record.terminal:
                    why = DeadlineExceeded(
                        "the request deadline passed before the client read its answer"
                    )
                    log.info(
                        "answer not read before the deadline",
                        request_id=run.record.request_id,
                        tenant_id=run.record.tenant_id,
                        tokens_unwritten=answer.unwritten,
                    )
                else:
                    why = DeadlineExceeded("the request deadline passed")
                    run.interrupt(why)
            await self._end(run, answer, context, why)
        except asyncio.CancelledError:
            if loop.time() >= deadline - 0.01:
                run.interrupt(DeadlineExceeded("the client's deadline passed"))
            else:
                run.interrupt(Cancelled("the client cancelled the request"))
            raise
        except Exception:
            # A write that fails rather than being cancelled (grpc may raise when the client has
            # gone): nobody reads the rest, so the request must not decode on for no one. After
            # an abort (the request's own error) the request has ended, and this is a no-op.
            run.interrupt(Cancelled("the response could not be written: the client has gone"))
            raise
        finally:
            self._answered(run, answer)

    async def _write(
        self, run: StreamRun, answer: PendingAnswer, context: grpc.aio.ServicerContext
    ) -> KvfenceError | None:
        """Write the answer as the pipeline emits it, to its final message (None) or its error
        (returned, for the caller to end the RPC with)."""
        headers_sent = False
        while True:
            item = await answer.get()
            if run.stopped is not None:  # see StreamRun.stop
                return run.stopped
            if item is _DONE:
                return None
            if isinstance(item, KvfenceError):
                return item
            assert isinstance(item, client_pb2.GenerateResponse)
            if not headers_sent:
                # The headers on their own first: a first message over the client's stream
                # window whose write is cut (deadline, interrupt, shutdown) left grpc unable to
                # send any status (the abort failed at once), and a client without a deadline of
                # its own waited for one for good.
                await context.send_initial_metadata(())
                headers_sent = True
            run.writing = True
            try:
                await context.write(item)
            finally:
                run.writing = False
            if is_final(item):
                # An interrupt accepted while the write completed wins. Otherwise the answer is
                # whole: the client hears OK now, not after the releases the request task still
                # awaits (each up to RELEASE_TIMEOUT_S on a silent node).
                return run.stopped

    async def _end(
        self,
        run: StreamRun,
        answer: PendingAnswer,
        context: grpc.aio.ServicerContext,
        err: KvfenceError,
    ) -> None:
        """End the RPC with ``err``. The request is answered first: grpc sends the status after
        the messages already written, so the abort waits for a client that does not read until it
        does or goes (no deadline of grpc's own bounds it), and the run must not count, nor its
        unwritten tokens stay held, meanwhile. The handler itself waits ABORT_WAIT_S at most, then
        returns (logged): the status is still sent if the client reads."""
        self._answered(run, answer)
        try:
            async with asyncio.timeout(ABORT_WAIT_S):
                await abort(context, err)
        except TimeoutError:
            log.info(
                "status not taken by the client",
                request_id=run.record.request_id,
                tenant_id=run.record.tenant_id,
                code=err.code.name,
                waited_s=ABORT_WAIT_S,
            )
        except _BATCH_ERRORS as failed:  # grpc could not send the status at all: say so
            # The call already over at the client (its deadline passed, or it cancelled): grpc
            # has ended the call, so there was no one to send the status to. Routine (about one
            # in eight short-deadline requests under load), so info. Otherwise a warning.
            remaining = context.time_remaining()
            gone = context.cancelled() or (remaining is not None and remaining <= 0)
            (log.info if gone else log.warning)(
                "status could not be sent",
                request_id=run.record.request_id,
                tenant_id=run.record.tenant_id,
                code=err.code.name,
                error=type(failed).__name__,  # its repr is a C object's address
                client_gone=gone,
            )

    def _answered(self, run: StreamRun, answer: PendingAnswer) -> None:
        """The handler has decided the request's status: the run leaves the table once its
        pipeline has ended too (``_run``), and what was not written is dropped."""
        run.decided.set()
        answer.drop()
        if run.done.is_set():
            self.table.remove(run)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        err = task.exception()  # retrieved, so asyncio does not report it again at collection
        if err is not None:
            log.error("request task failed", exc_info=err)

    async def _run(
        self,
        run: StreamRun,
        request: client_pb2.GenerateRequest,
        deadline: float,
        answer: PendingAnswer,
    ) -> None:
        def emit(item: object) -> None:
            # An error that comes after the answer ended (a failure in the pipeline's releases,
            # once its final message was emitted) is not the answer: it must not stop a write.
            if answer.emit(item) and isinstance(item, KvfenceError) and run.writing:
                run.stop(item)

        try:
            await self.pipeline.execute(run, request, deadline, emit)
            answer.emit(_DONE)
        except KvfenceError as err:
            emit(err)
        except Exception:
            # A bug here, not the tenant's nor a node's: INTERNAL, the details only in the log
            # ("request task failed", from _ended). Not "shutting down": that is a retry later.
            emit(KvfenceError("internal error in the control plane"))
            raise
        except BaseException:  # cancelled at shutdown: the handler must not wait forever
            emit(Unavailable("the control plane is shutting down"))
            raise
        finally:
            # The nodes' resources are released by now (the pipeline's own finally); the run
            # leaves the table once its handler has returned too (StreamRun).
            run.done.set()
            if run.answered:
                self.table.remove(run)

    async def ListModels(
        self, request: client_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.ListModelsResponse:
        self.metrics.rpcs_total.labels(method="ListModels").inc()
        try:
            authenticate(context, self.tenants)
        except KvfenceError as err:
            self._refused(context, "ListModels", err)
            await abort(context, err)
        return self._list_models()

    def _refused(self, context: grpc.aio.ServicerContext, method: str, err: KvfenceError) -> None:
        """A call refused for its API key: counted in ``auth_failures_total{listener="public"}``
        and logged throttled, without the key (``Metrics.credential_refused``)."""
        self.metrics.credential_refused(
            listener="public",
            method=method,
            status=err.code.name,
            reason="no API key" if bearer_token(context) is None else "wrong or revoked API key",
            peer=context.peer(),
        )
