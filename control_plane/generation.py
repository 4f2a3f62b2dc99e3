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
"""

from __future__ import annotations

import asyncio
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
from kvfence.server import abort, bearer_token, take_ready

_DONE = object()

log = get_logger("generation")


def is_final(msg: client_pb2.GenerateResponse) -> bool:
    """The request's last message: it carries the finish reason and usage."""
    return msg.HasField("usage") or bool(msg.finish_reason)


def coalesce_tokens(
    first: client_pb2.GenerateResponse, out: asyncio.Queue[object]
) -> tuple[client_pb2.GenerateResponse, object | None]:
    """``first`` with the token messages already waiting behind it appended, in order (see
    ``take_ready``). Returns the message to write and the next item taken from the queue that
    could not be merged (a final message, an error, the end), or None. A final message (usage,
    finish reason) is never merged into nor merged."""

    def plain(item: object) -> bool:
        return isinstance(item, client_pb2.GenerateResponse) and not is_final(item)

    if not plain(first):
        return first, None
    more, other = take_ready(out, plain)
    if not more:
        return first, other
    merged = client_pb2.GenerateResponse()
    merged.CopyFrom(first)
    for msg in more:
        assert isinstance(msg, client_pb2.GenerateResponse)
        merged.token_ids.extend(msg.token_ids)
        merged.text += msg.text
    return merged, other


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

    async def Generate(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self.metrics.rpcs_total.labels(method="Generate").inc()
        try:
            tenant = authenticate(context, self.tenants)
        except KvfenceError as err:
            self.metrics.requests_total.labels(status=err.code.name).inc()
            await abort(context, err)
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        # A client's own deadline is kept up to max_deadline_s: a request holds its queue place
        # (and its pages) until then, so an unbounded one could hold them for good.
        budget = (
            self.default_deadline_s if remaining is None else min(remaining, self.max_deadline_s)
        )
        deadline = loop.time() + budget
        run = Run(
            RequestRecord("req-" + secrets.token_hex(8), tenant.name),
            key_sha256=hash_key(bearer_token(context) or ""),
            tenant=tenant,
        )
        out: asyncio.Queue[object] = asyncio.Queue()
        with request_context(run.record.request_id, tenant.name):
            self.table.add(run)
            task = loop.create_task(self._run(run, request, deadline, out))
            # Owned here until it ends: the handler may return before it does (below). Added in
            # the request's context, so that a failure logged at its end names the request.
            self.tasks.add(task)
            task.add_done_callback(self._ended)
        try:
            item = await out.get()
            while item is not _DONE:
                if isinstance(item, KvfenceError):
                    await abort(context, item)
                assert isinstance(item, client_pb2.GenerateResponse)
                merged, item = coalesce_tokens(item, out)
                await context.write(merged)
                if is_final(merged):
                    # The answer is whole: the client hears OK now, not after the releases the
                    # request task still awaits (each up to RELEASE_TIMEOUT_S on a silent node).
                    return
                if item is None:
                    item = await out.get()
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

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        err = task.exception()  # retrieved, so asyncio does not report it again at collection
        if err is not None:
            log.error("request task failed", exc_info=err)

    async def _run(
        self,
        run: Run,
        request: client_pb2.GenerateRequest,
        deadline: float,
        out: asyncio.Queue[object],
    ) -> None:
        try:
            await self.pipeline.execute(run, request, deadline, out.put_nowait)
            out.put_nowait(_DONE)
        except KvfenceError as err:
            out.put_nowait(err)
        except BaseException:  # cancelled at shutdown: the handler must not wait forever
            out.put_nowait(Unavailable("the control plane is shutting down"))
            raise
        finally:
            self.table.remove(run)
            run.done.set()

    async def ListModels(
        self, request: client_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.ListModelsResponse:
        self.metrics.rpcs_total.labels(method="ListModels").inc()
        try:
            authenticate(context, self.tenants)
        except KvfenceError as err:
            await abort(context, err)
        return self._list_models()
