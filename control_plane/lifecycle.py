"""The request lifecycle: one state enum, one transition function, the table of requests in flight.

::

    RECEIVED -> ADMITTED -> RESERVED -> PREFILLING -> KV_VERIFIED -> DECODING -> FINISHED
        \\-> REJECTED (terminal, before any node is contacted)
     any non-terminal -> FAILED | CANCELLED (terminal; cleanup on every node that holds something)

Only the request's own pipeline task moves its state (through :func:`transition`). Anything else
that wants a request to end (node lost, operator abort, model offline, shutdown, client gone) calls
:meth:`Run.interrupt`; the pipeline sees the interrupt at its next await, cancels the node RPC in
flight and fails the request itself. So there is exactly one writer of the state and a terminal
request can never be resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvfence.errors import KvfenceError, Unavailable
from kvfence.logging import get_logger

if TYPE_CHECKING:
    from control_plane.registry import Node
    from control_plane.tenants import Tenant

log = get_logger("lifecycle")
T = TypeVar("T")


@dataclass(frozen=True)
class CountedPages:
    """Pages a request counted on a node's estimate (``Node.reserved_since_heartbeat``: its
    decode reservation, or its Prefill's prompt pages): the node object, the pages, and the
    node's heartbeat count (``Node.heartbeats``) when they were counted. They go back to that
    node object only, never to a process that replaced it under the same node_id."""

    node: Node
    pages: int
    beats: int


class RequestState(StrEnum):
    RECEIVED = "RECEIVED"
    ADMITTED = "ADMITTED"
    RESERVED = "RESERVED"
    PREFILLING = "PREFILLING"
    KV_VERIFIED = "KV_VERIFIED"
    DECODING = "DECODING"
    FINISHED = "FINISHED"
    REJECTED = "REJECTED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL = frozenset(
    {RequestState.FINISHED, RequestState.REJECTED, RequestState.FAILED, RequestState.CANCELLED}
)
_FORWARD: dict[RequestState, frozenset[RequestState]] = {
    RequestState.RECEIVED: frozenset({RequestState.ADMITTED, RequestState.REJECTED}),
    RequestState.ADMITTED: frozenset({RequestState.RESERVED}),
    RequestState.RESERVED: frozenset({RequestState.PREFILLING}),
    RequestState.PREFILLING: frozenset({RequestState.KV_VERIFIED}),
    RequestState.KV_VERIFIED: frozenset({RequestState.DECODING}),
    RequestState.DECODING: frozenset({RequestState.FINISHED}),
}
_ABORT = frozenset({RequestState.FAILED, RequestState.CANCELLED})


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow; always a bug in the caller."""


def allowed(src: RequestState, dst: RequestState) -> bool:
    """Whether ``src -> dst`` is a legal move (terminal states have no way out)."""
    if src in TERMINAL:
        return False
    return dst in _FORWARD.get(src, frozenset()) or dst in _ABORT


@dataclass
class RequestRecord:
    """What the control plane knows about one request; ``state`` changes only via transition()."""

    request_id: str
    tenant_id: str
    state: RequestState = RequestState.RECEIVED
    created_at: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    decode_node: str = ""
    prefill_node: str = ""
    reservation_id: str = ""
    # The pages its decode reservation counted on decode_node's estimate, until the release.
    reserved: CountedPages | None = None
    # The prompt pages its Prefill counted on prefill_node's estimate, until they are given back
    # (pipeline.Pipeline._give_back).
    prefill_counted: CountedPages | None = None
    # node_id -> role of every node that received a request-carrying RPC and may hold something.
    contacted: dict[str, str] = field(default_factory=dict)
    # Decode nodes in ``contacted`` whose Reserve went unanswered (pipeline ``_try_reserve``): the
    # request went on to another node, and they stay contacted only for the Release of whatever
    # the call may have reserved late. Losing one of them takes nothing of the request.
    unanswered: set[str] = field(default_factory=set)
    reason: str = ""
    history: list[tuple[RequestState, float]] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.created_at


def transition(record: RequestRecord, dst: RequestState, reason: str = "", **fields: Any) -> float:
    """Move ``record`` to ``dst``; :class:`IllegalTransition` for a move the diagram forbids.
    Returns the seconds the request spent in the state it left."""
    src = record.state
    if not allowed(src, dst):
        raise IllegalTransition(f"request {record.request_id}: {src} -> {dst} is not allowed")
    now = time.monotonic()
    entered = record.history[-1][1] if record.history else record.created_at
    record.history.append((src, now))
    record.state = dst
    if reason:
        record.reason = reason
    line = dict(
        request_id=record.request_id,
        tenant_id=record.tenant_id,
        src=str(src),
        dst=str(dst),
        reason=reason or None,
    )
    if dst in TERMINAL:
        # One line per request at info (what an operator reads; a busy control plane serves
        # thousands a second), each state change on the way at debug.
        log.info(
            "request ended",
            **line,
            prompt_tokens=record.prompt_tokens,
            max_new_tokens=record.max_new_tokens,
            decode_node=record.decode_node or None,
            prefill_node=record.prefill_node or None,
            seconds=round(now - record.created_at, 6),
            **fields,
        )
    else:
        log.debug("request state", **line, **fields)
    return now - entered


class Run:
    """A request in flight: its record plus the interrupt that other parties may raise into it."""

    def __init__(self, record: RequestRecord, key_sha256: str = "", tenant: Tenant | None = None):
        self.record = record
        # The API key it came with (its hash): revoking that key ends the request too.
        self.key_sha256 = key_sha256
        # The tenant as its limits stand now: SetLimits replaces it for the requests in flight,
        # so one still waiting for pages reserves under the new limits (scrub_on_free included).
        self.tenant = tenant
        self._interrupt: asyncio.Future[KvfenceError] = asyncio.get_running_loop().create_future()
        self.done = asyncio.Event()

    @property
    def interrupted(self) -> KvfenceError | None:
        return self._interrupt.result() if self._interrupt.done() else None

    @property
    def live(self) -> bool:
        """Neither ended nor interrupted: what counts against its tenant's concurrency. An
        interrupted request (aborted, key revoked, deadline, client gone) will end with its
        interrupt, however long the await it is in takes to notice: a tokenizer thread cannot be
        stopped, and counting it until that returned refused the tenant's next request
        TENANT_CONCURRENCY for one nobody would be served."""
        return not self.record.terminal and not self._interrupt.done()

    def interrupt(self, err: KvfenceError) -> bool:
        """Ask the pipeline to end the request with ``err``; the first interrupt wins.

        True means the request will end with ``err``: the pipeline checks for an interrupt right
        before it moves the request to FINISHED, and a terminal request refuses (False)."""
        if self._interrupt.done() or self.record.terminal:
            return False
        self._interrupt.set_result(err)
        return True

    def check(self) -> None:
        """Raise the pending interrupt, if any."""
        if self._interrupt.done():
            raise self._interrupt.result()

    async def guard(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless an interrupt comes first; then cancel it and raise the interrupt.

        Cancelling a grpc.aio call cancels the RPC on the node too, so an interrupted request leaves
        no node working for it.
        """
        task = asyncio.ensure_future(aw)
        if not self._interrupt.done():
            try:
                waiters: set[asyncio.Future[Any]] = {task, self._interrupt}
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                await _cancel(task, aw)
                raise
        # A result that arrived wins; a failure that raced an interrupt is reported as the
        # interrupt (closing a lost node's channel fails its calls with CANCELLED, say).
        if task.done() and (
            not self._interrupt.done() or (not task.cancelled() and task.exception() is None)
        ):
            if task.cancelled():
                raise _channel_closed() from None
            return task.result()
        await _cancel(task, aw)
        raise self._interrupt.result()

    async def read_stream(self, call: Any) -> AsyncGenerator[Any, None]:
        """The messages of a grpc.aio response stream, to its end, guarded as :meth:`guard` guards
        one await, but without a task and a wait per message (a decode stream has one message per
        token or few): an interrupt cancels the call, which cancels the RPC on the node and ends
        the read in progress, and the interrupt is raised in its place.

        As in :meth:`guard`, a message that arrived wins, and a failure that raced an interrupt is
        reported as the interrupt.
        """
        self.check()

        def cancel(_: asyncio.Future[KvfenceError]) -> None:
            call.cancel()

        self._interrupt.add_done_callback(cancel)
        try:
            while True:
                try:
                    msg = await call.read()
                except (asyncio.CancelledError, Exception) as err:
                    task = asyncio.current_task()
                    # Our own task being cancelled (shutdown) is not the interrupt's doing.
                    if task and task.cancelling():
                        raise
                    if self._interrupt.done():
                        raise self._interrupt.result() from None
                    if isinstance(err, asyncio.CancelledError):
                        raise _channel_closed() from None
                    raise
                if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                yield msg
        finally:
            self._interrupt.remove_done_callback(cancel)

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake (raising) at once when interrupted."""
        await self.guard(asyncio.sleep(seconds))


def _channel_closed() -> Unavailable:
    """A node call cancelled though neither this request nor its task was: the control plane
    closed the node's channel (the node was lost or registered again elsewhere). Raised as the
    node's failure; a bare CancelledError would read as the control plane's own cancellation
    ("shutting down")."""
    return Unavailable(
        "the node's channel closed under the call (the node was lost or registered again)",
        reason="NODE_UNREACHABLE",
    )


# How long a node call cancelled in grpc core is given to end (it ends at once: grpc's own task
# sees its batch fail CANCELLED) before the plain cancel below is used after all.
CORE_CANCEL_WAIT_S = 1.0


async def _cancel(task: asyncio.Future[Any], aw: Awaitable[Any]) -> None:
    """Cancel a guarded await: a grpc.aio call's RPC itself, not only our wait on it.

    A unary-unary call (Reserve, Prefill) is cancelled in grpc core only, and grpc's own task is
    let finish its batch: cancelling that task with the batch in flight leaks the batch's native
    op array (grpc/grpc#43360, grpcio 1.85: about 1 KB per call, measured), and the control plane
    cancels a Reserve or a Prefill for every client that goes away before its first token (a
    stack's control plane grew about 2.2 MB per 1000 such cancels). ``_cython_call`` is grpcio's
    private core call: where it is missing (another grpcio) or the call does not end in time,
    the plain cancel is used."""
    core: Any = getattr(aw, "_cython_call", None)
    if isinstance(aw, grpc.aio.UnaryUnaryCall) and callable(getattr(core, "cancel", None)):
        with contextlib.suppress(Exception):
            if not core.done():
                core.cancel("cancelled by the control plane")
        done, _ = await asyncio.wait({task}, timeout=CORE_CANCEL_WAIT_S)
        if done:
            if not task.cancelled():
                task.exception()  # retrieved: the call's CANCELLED is expected
            return
    cancel = getattr(aw, "cancel", None)
    if callable(cancel):  # a grpc.aio call: cancel the RPC itself, not only our wait on it
        cancel()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # abandoned on purpose
        await task


class RequestTable:
    """Requests in flight, by id; what ListRequests shows and what interrupts are aimed at."""

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[Run]:
        return iter(list(self._runs.values()))

    def add(self, run: Run) -> None:
        assert run.record.request_id not in self._runs, "request ids are unique"
        self._runs[run.record.request_id] = run

    def remove(self, run: Run) -> None:
        self._runs.pop(run.record.request_id, None)

    def get(self, request_id: str) -> Run | None:
        return self._runs.get(request_id)

    def active_for_tenant(self, tenant_id: str, besides: Run | None = None) -> int:
        """The tenant's live requests (:attr:`Run.live`), ``besides`` left out: one that has
        ended (its status sent) while its releases still run does not count against its
        concurrency limit, or a client retrying at once after an error would be refused for the
        request it just lost; nor does one interrupted that has not ended yet."""
        return sum(
            1
            for r in self._runs.values()
            if r.record.tenant_id == tenant_id and r is not besides and r.live
        )

    def using_node(self, node_id: str) -> list[Run]:
        """Requests that may hold something on the node: not those whose only part in it is a
        Reserve left unanswered (``RequestRecord.unanswered``)."""
        return [
            r
            for r in self._runs.values()
            if node_id in r.record.contacted and node_id not in r.record.unanswered
        ]

    def in_state(self, *states: RequestState) -> list[Run]:
        return [r for r in self._runs.values() if r.record.state in states]
