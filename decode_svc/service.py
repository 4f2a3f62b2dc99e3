"""Decode node: reserves pages, receives and verifies KV, runs continuous-batching decode.

Reservation life (one per request)::

    Reserve -> RESERVED --UCX hello--> RECEIVING --done--> (transfer complete)
            --Decode(manifest) verified--> DECODING --finish/cancel/Release--> released
    any failure -> pages QUARANTINED, freed once every posted receive has settled

``Reserve`` hands out pages for prompt + max_new_tokens up front, with a fresh secret. A reservation
that never sees its ``Decode`` call within ``transfer.reservation_timeout_s`` is cancelled and
released (its receives first), so a vanished control plane cannot pin pages. Once decoding, the
pages go back when the ``Decode`` stream ends, however it ends (finished, failed, cancelled by the
control plane): the control plane's ``Release``, which it logs and forgets when it fails, is not
needed for them; nor when the ``Decode`` call is cancelled while it waits for the transfer to
complete, before the KV is verified (its pages go back at once, unread). A ``Release`` that arrives
while the stream is open ends the stream CANCELLED.
A ``Decode`` may not ask for more new tokens than its reservation was made for: INVALID_ARGUMENT,
checked (with the other sampling parameters) only after the manifest verified, so a tampered
manifest is an integrity failure whatever parameters come with it; a verified manifest with bad
parameters leaves the reservation as it was (a corrected ``Decode`` can still use it).
A ``Decode`` for a reservation this node has already released (reaped after
``transfer.reservation_timeout_s``, released by the control plane, or released while the call
waited for the transfer) is refused UNAVAILABLE, reason ``RESERVATION_RELEASED``, without any
manifest check and with no integrity failure reported (no event, no count): it is a late
``Decode``, not a forgery.
A ``Decode`` whose request id is not its reservation's fails check 1 (DATA_LOSS) and leaves that
reservation as it was: it is not that request's to decode or to give back. One for the right
request under another tenant's name (in the call or in its manifest) fails check 1 as a forged
manifest does: quarantined, reported and released.
The integrity log lines of a reservation carry the reservation's own request and tenant ids; a
``Decode`` that claimed other ones is logged with them as ``claimed_request_id`` /
``claimed_tenant_id``.
Every RPC needs the cluster node token (``NodeTokenCheck``): a call without it is UNAUTHENTICATED
and reserves, decodes or releases nothing.

A duplicate ``Decode`` (a second call for the same request and reservation; the control plane
never makes one, a retried or replayed call can) fails manifest check 1 when its manifest is
checked after the first call's: DATA_LOSS, the pages quarantined and released, and the first
stream ends CANCELLED. Before that check it has claimed nothing: the reservation belongs to the
first call waiting for its transfer, and only that call's cancellation gives the pages back; a
duplicate cancelled while it waits just goes (a warning is logged), and the first call decodes
once the transfer arrives. So the pages go back once, never while that call still waits for them:
at its stream's end or cancellation, a duplicate's failed check, a ``Release``, or, for a
reservation no stream verified, the reaper (``transfer.reservation_timeout_s`` after Reserve).

Draining (the node shutting down, ``kvfence.node_main``): a new ``Reserve`` is refused UNAVAILABLE,
reason ``NODE_DRAINING``, taking nothing (the control plane tries another node); the transfers,
``Decode`` streams and ``Release`` calls of the reservations already made go on, and the node is
drained once it holds no reservation. A drain that times out (``node.drain_timeout_s``) ends the
``Decode`` calls still running, before the server stops (``end_in_flight``; cut by the stop, they
reached the control plane as a lost connection, NODE_UNREACHABLE, "became unreachable"), each
UNAVAILABLE, reason ``NODE_DRAINING``: a stream decoding, whose end gives its pages back; and a
call still waiting for its transfer (up to ``transfer.batch_timeout_s``), whose reservation is
released then: its transfer cancelled (its endpoint aborted, the node going away; a ``Decode``
cancelled while it waits lets it wind down instead, below), the pages of receives still posted
QUARANTINED until those have settled, the others free at once; a transfer still arriving finds
the reservation released (``RESERVATION_RELEASED``) or the node gone. A duplicate waiting beside
that call ends the same way. The control plane passes ``NODE_DRAINING`` on to the tenant ("the
decode node serving this request is shutting down"), retries nothing (the request's KV was on
this node), and counts no failure against the node.
A reservation no ``Decode`` call waits for yet is kept (its transfer may still arrive and
complete, a ``Release`` still releases it) until its ``Decode`` comes or the stop releases it.
From the timed-out drain until the server stops accepting calls, every new ``Decode`` is refused
at once with the same UNAVAILABLE ``NODE_DRAINING`` error (let wait for its transfer or decode,
it was cut by the stop: NODE_UNREACHABLE again). No manifest is checked then, since nothing will
be read (so a forged one goes unreported), and the reservation the call names, if it is that
request's and no stream's, is released at once, as by a ``Release``: its pages back, a transfer
still to come refused ``RESERVATION_RELEASED``.

Events about UCX hellos (``stage: ucx_hello``: a connection that said no hello, or a wrong one)
are what whoever reaches the UCX port can cause at will, so they are bounded: at most
``HELLO_EVENTS_BURST`` per ``HELLO_EVENTS_INTERVAL_S`` of each kind and check; once such a window
has closed, one more event of that kind says how many were held back (``suppressed``, with
``window_s``). ``kvfence_integrity_failures_total`` counts every integrity violation among them;
a ``transfer_failed`` one only the events count. A late hello (``RESERVATION_RELEASED``: for a
reservation this node issued and has released) is not bounded when it carries that reservation's
authenticator, which only its prefill has: each says the system is slow. One without it
(``authenticated: false`` in the event) is bounded like the others: a reservation id is no
secret (it travels in cleartext hellos, events and logs), so anyone can send it.

Why a reservation was released decides what its late hello is (``_release``'s ``request_ended``,
remembered with the id by ``KvReceiver.forget``). Released because its request ended by its
owner's decision, a late hello that carries the authenticator only raced that end (a client
cancel: the control plane cancels the Prefill call and releases here, and the Release can land
first): logged at info ("late KV hello refused: its request had ended", with the reservation,
request and tenant ids), no event, and the refusal says ``request_ended: true`` so that prefill
reports nothing either (kvfence/transfer.py). Those releases: the control plane's ``Release``
(whatever its reason), the ``Decode`` stream's end (``decode stream ended``), a ``Decode``
cancelled while it waits for its transfer, a stream a timed-out drain ended (``error`` with the
drain's status), the drain's own (``drain timed out``, ``Decode after the drain timed out``) and
the stop's (``shutdown``). Released because of trouble, its late hello is a ``transfer_failed``
event as above, on prefill too: ``reservation timeout`` (the reaper: the system was slow, the
case that event is for), a failed or cancelled transfer (``transfer failed: ...``, ``transfer
cancelled: ...``), a failed manifest check (``integrity``), a stream failed by a step or tag
check (``error``), and ``forgotten by the control plane`` (``release_all``). A late hello without
the authenticator is bounded and reported whatever the release was.
A transfer still receiving when its reservation is released for its request's end (a ``Release``,
a ``Decode`` cancelled while it waits) is not aborted: decode lets the receives it posted settle
(their pages QUARANTINED until then, within ``transfer.batch_timeout_s``), posts no other, and
refuses the transfer at its next step ``RESERVATION_RELEASED`` with ``request_ended: true``, logged
at info ("KV transfer refused: its request had ended"), reported by neither node
(``KvReceiver.cancel``). Released for trouble, or by a node going away (a timed-out drain's
releases, the stop's ``shutdown``: nothing may wait for a transfer then), it is aborted at once,
and prefill, reading a lost connection, reports it.

Reservation ids are ``<node>.<instance>.<uuid4 hex>``: the node part a hash of this node's id
(8 hex digits, the same in every process of the node; this servicer gives its receiver the id),
the instance (8 hex digits) drawn once per process (``KvReceiver.new_reservation_id``). A hello
for a reservation of this node's previous process (its container restarted in place, same node
id, same UCX address) names this node's part and another instance: refused ``NODE_RESTARTED``, a
``transfer_failed`` event and no integrity count, and prefill fails the call UNAVAILABLE: the
node lost the request, and a retry reserves anew. A ``Decode`` naming such a reservation is
UNAVAILABLE ``NODE_RESTARTED`` too, with no manifest check. An id of this process that it does
not know, one another decode node issued (a misrouted request: that node is alive, nothing was
lost to a restart), or one of any other shape (the bare uuid4 hex of earlier releases too) is
still an ``UNKNOWN_RESERVATION`` integrity violation (kvfence/transfer.py). Both events are
bounded as above: neither needs a real reservation id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn

import grpc

import kernels
from kvfence import logging as kvlog
from kvfence import manifest as mf
from kvfence.config import ClusterConfig, pages_needed
from kvfence.errors import (
    NODE_DRAINING,
    NODE_RESTARTED,
    RESERVATION_RELEASED,
    Cancelled,
    IntegrityError,
    InvalidArgument,
    KvfenceError,
    ResourceExhausted,
    Unavailable,
)
from kvfence.events import EventBus, EventLimiter
from kvfence.kv.pool import PageRef, PageState
from kvfence.metrics import Metrics, publish_pool
from kvfence.node import NodeRuntime, NodeTokenCheck, report_integrity, sampling_from_proto
from kvfence.proto.kvfence.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2
from kvfence.server import abort, take_ready
from kvfence.transfer import (
    INTEGRITY_REASONS,
    InboundState,
    InboundTransfer,
    KvReceiver,
)
from prefill_svc.service import node_stats

from .batcher import ActiveSeq, DecodeBatcher

log = kvlog.get_logger("decode")

HELLO_EVENTS_BURST = 10
HELLO_EVENTS_INTERVAL_S = 10.0


def drain_tokens(
    first: list[int], events: asyncio.Queue[tuple[str, Any]]
) -> tuple[list[int], tuple[str, Any] | None]:
    """``first`` plus the token events already queued behind it (sent as one message), and the
    first other event taken (see ``take_ready``)."""
    more, other = take_ready(events, lambda event: event[0] == "tokens")
    return [*first, *(t for _, ids in more for t in ids)], other


class _StreamFailed(Exception):
    """A Decode stream ending with ``status``; ``abort`` is what ended the RPC (re-raised)."""

    def __init__(self, status: str, abort: BaseException):
        super().__init__(status)
        self.status = status
        self.abort = abort


async def _end(context: grpc.aio.ServicerContext, err: KvfenceError) -> NoReturn:
    """End the Decode RPC with ``err``, telling the handler which status it ended with."""
    try:
        await abort(context, err)
    except BaseException as ended:
        raise _StreamFailed(err.code.name, ended) from None
    raise AssertionError("abort returned")


class ResState(Enum):
    RESERVED = "reserved"
    DECODING = "decoding"
    FAILED = "failed"
    RELEASED = "released"


@dataclass
class DecodeReservation:
    reservation_id: str
    request_id: str
    tenant_id: str
    secret: bytes
    pages: list[PageRef]
    prompt_tokens: int
    max_new_tokens: int
    scrub: bool
    transfer: InboundTransfer
    state: ResState = ResState.RESERVED
    # The Decode stream's event sink once it is decoding: a release tells that stream it ended.
    emit: Callable[[tuple[str, Any]], None] | None = None
    # A Decode call is waiting for the transfer and owns the reservation: a duplicate that waits
    # beside it and is cancelled must not release it (module docstring).
    awaited: bool = False
    # What a timed-out drain ended the Decode call waiting for its transfer with (end_in_flight).
    ended: KvfenceError | None = None
    created: float = field(default_factory=time.monotonic)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """The Decode gRPC service (see module docstring)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        rt: NodeRuntime,
        bus: EventBus,
        metrics: Metrics,
        receiver: KvReceiver,
        tokenizer: Any,
        node_token: str,
    ):
        self.cfg = cfg
        self.authenticate = NodeTokenCheck(node_token, metrics)
        self.rt = rt
        self.pool = rt.pool
        self.bus = bus
        self.metrics = metrics
        self.receiver = receiver
        # Prefill closes an idle endpoint after endpoint_idle_timeout_s; decode waits longer for
        # its next hello, so that decode does not close first. Prefill's reaper can still come
        # round later than that (a short batch_timeout_s): decode then closes the idle endpoint
        # quietly, and prefill never leases one idle past its timeout (KvReceiver._serve).
        receiver.idle_timeout_s = (
            cfg.transfer.endpoint_idle_timeout_s + cfg.transfer.batch_timeout_s
        )
        self.tokenizer = tokenizer
        self.reservations: dict[str, DecodeReservation] = {}
        self.by_request: dict[str, str] = {}
        self.rpc_count = 0
        self.batcher: DecodeBatcher | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._hello_events = EventLimiter(HELLO_EVENTS_BURST, HELLO_EVENTS_INTERVAL_S)
        # Set once the node shuts down: new reservations are refused (module docstring).
        self.draining = False
        # What a timed-out drain ended the node's Decode calls with (end_in_flight), or None: a
        # Decode call arriving after it, before the server stops accepting, is refused with it.
        self.drain_ended: KvfenceError | None = None
        self.closing = False  # close() began: the node is stopping

    def start(self) -> None:
        loaded: Any = self.rt.loaded
        self.batcher = DecodeBatcher(
            self.rt.engine,
            self.pool,
            loaded.eos_token_ids,
            self.tokenizer.decode,
            asyncio.get_running_loop(),
            max_batch=self.cfg.decode.max_batch,
            stream_interval=self.cfg.decode.stream_interval,
            on_step=self.metrics.decode_step_rows.observe,
        )
        self.batcher.start()
        self._reaper = asyncio.create_task(self._reap())

    async def close(self) -> None:
        self.closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.flush_hello_events(force=True)
        for rid in list(self.reservations):
            self._release(rid, "shutdown", request_ended=True)
        if self.batcher is not None:
            self.batcher.stop()

    def end_in_flight(self, err: KvfenceError) -> int:
        """End every running Decode stream with ``err``: the node's drain timed out, and its
        server is about to stop (``RunningNode.drain``, which calls prefill's servicer by the
        same name). Ended by the server's stop instead, a stream reached its client as a cut
        connection (NODE_UNREACHABLE, "became unreachable"), though the node had stopped on
        purpose. Each stream's own end gives its pages back. A Decode call still waiting for its
        transfer is ended too: its reservation is released now (module docstring). How many
        reservations had their calls ended. A Decode call that arrives after this, before the
        server stops accepting, is refused with ``err`` too (``_refuse_after_drain``)."""
        self.drain_ended = err
        ended = 0
        for res in list(self.reservations.values()):
            if res.state == ResState.DECODING and res.emit is not None:
                res.emit(("error", err))
                ended += 1
            elif res.state == ResState.RESERVED and res.awaited:
                # Released here, not by the call once it wakes: that would be on a later turn,
                # after the server's stop may have begun. The release cancels the transfer,
                # which wakes the call (its transfer's done event), and leaves the pages of
                # receives still posted quarantined until they settle.
                res.ended = err
                self._release(res.reservation_id, "drain timed out", request_ended=True)
                ended += 1
        return ended

    def busy(self) -> bool:
        """Whether the node still holds work (a draining node waits for this to be False)."""
        return bool(self.reservations)

    def held_counts(self) -> dict[str, int]:
        decoding = sum(r.state == ResState.DECODING for r in self.reservations.values())
        return {"reservations": len(self.reservations), "decoding": decoding}

    # ---- RPCs --------------------------------------------------------------------------------
    async def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.Reservation:
        await self.authenticate(context, "Reserve")
        self.rpc_count += 1
        self.metrics.rpcs_total.labels(method="Reserve").inc()
        with kvlog.request_context(request.request_id, request.tenant_id):
            try:
                return self._reserve(request)
            except KvfenceError as err:
                await abort(context, err)
        raise AssertionError("unreachable")

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        await self.authenticate(context, "Decode")  # once per stream
        self.rpc_count += 1
        self.metrics.rpcs_total.labels(method="Decode").inc()
        # How the stream ended, for requests_total: a finish, a failure's status, or CANCELLED
        # when it ended otherwise (the control plane went away, or a Release).
        status = "CANCELLED"
        try:
            with kvlog.request_context(request.request_id, request.tenant_id):
                # aclosing: a stream cancelled while suspended here must close the inner one now,
                # whose finally gives the pages back
                async with contextlib.aclosing(self._decode(request, context)) as messages:
                    async for message in messages:
                        if message.finish_reason:
                            status = "OK"
                        yield message
        except _StreamFailed as failed:
            status = failed.status
            raise failed.abort from None
        finally:
            self.metrics.requests_total.labels(status=status).inc()

    async def _decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        res = self.reservations.get(request.reservation_id)
        if self.drain_ended is not None:
            # Before any wait: a call let wait for its transfer or decode now would be cut by
            # the server's stop, which the control plane reads as a lost node.
            self._refuse_after_drain(request, res)
            await _end(context, self.drain_ended)
        try:
            params = await self._verify(request, res)
        except KvfenceError as err:
            await _end(context, err)
        assert res is not None
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        # From here on the pages are this stream's: whatever ends it (the client gone while the
        # first message was being written included), the finally below gives them back. The
        # reaper does not: it only reaps reservations never verified.
        try:
            res.state = ResState.DECODING
            self.pool.set_state(res.reservation_id, PageState.READY)
            self.pool.set_state(res.reservation_id, PageState.IN_USE)
            seq = ActiveSeq(
                res.reservation_id,
                res.pages,
                res.prompt_tokens,
                request.manifest.first_token,
                params,
                events.put_nowait,
            )
            res.emit = events.put_nowait
            yield decode_pb2.DecodeResponse(verified=True)
            # grpc.aio wrote that message while this generator was suspended: a Release (or a
            # duplicate Decode failing verification) may have given the pages back meanwhile.
            # Never add a sequence whose pages are no longer this reservation's.
            if self.reservations.get(res.reservation_id) is not res:
                await _end(context, Cancelled("the reservation was released before decoding"))
            assert self.batcher is not None
            self.batcher.add(seq)
            pending: tuple[str, Any] | None = None
            while True:
                kind, value = pending or await events.get()
                pending = None
                if kind == "tokens":
                    ids, pending = drain_tokens(value, events)
                    yield decode_pb2.DecodeResponse(token_ids=ids)
                elif kind == "finish":
                    yield decode_pb2.DecodeResponse(finish_reason=value)
                    break
                else:
                    failure: KvfenceError = value
                    with self._logged_as(res, request):
                        if isinstance(failure, IntegrityError):
                            self._integrity_failure(res, failure, stage="decode")
                        # A failed step or tag check is trouble; a timed-out drain ending
                        # the stream (end_in_flight) is the node's own decision.
                        self._release(
                            res.reservation_id,
                            "error",
                            request_ended=failure is self.drain_ended,
                        )
                    await _end(context, failure)
        finally:
            # Finished, failed, or the control plane gone: nothing reads these pages any more,
            # so they go back now, not when (or if) the control plane's Release arrives: a
            # lost Release must not pin them until the node restarts.
            if self.reservations.get(res.reservation_id) is res:
                self._release(res.reservation_id, "decode stream ended", request_ended=True)

    async def Release(
        self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseResponse:
        await self.authenticate(context, "Release")
        rid = self.by_request.get(request.request_id)
        held = rid is not None and self._release(
            rid, request.reason or "release", request_ended=True
        )
        return prefill_pb2.ReleaseResponse(held=held)

    async def Stats(
        self, request: prefill_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.NodeStats:
        await self.authenticate(context, "Stats")
        return node_stats(self.rt, self.rpc_count, len(self.reservations))

    # ---- reservation -------------------------------------------------------------------------
    def _reserve(self, req: decode_pb2.ReserveRequest) -> prefill_pb2.Reservation:
        if self.draining:
            raise Unavailable(
                f"decode node {self.rt.node_id} is draining (shutting down): reserve elsewhere",
                reason=NODE_DRAINING,
            )
        if req.prompt_tokens < 1 or req.max_new_tokens < 1:
            raise InvalidArgument("prompt_tokens and max_new_tokens must be >= 1")
        if req.request_id in self.by_request:
            raise InvalidArgument("request already holds a reservation on this node")
        page_size = self.pool.page_size
        n = pages_needed(req.prompt_tokens + req.max_new_tokens, page_size)
        # "<node>.<instance>.<uuid4 hex>": a transfer for a reservation this node made before
        # this process restarted is told from a forged or misrouted id by them (module docstring).
        rid = self.receiver.new_reservation_id()
        try:
            refs = self.pool.allocate(n, rid)
        except ValueError:
            raise InvalidArgument(
                f"{req.prompt_tokens} + {req.max_new_tokens} tokens need {n} pages; "
                f"this node has {self.pool.num_pages}",
                reason="OVER_POOL",
            ) from None
        if refs is None:
            raise ResourceExhausted(
                f"decode pool has {self.pool.num_free} free pages, {n} needed",
                reason="DECODE_POOL_FULL",
            )
        secret = os.urandom(32)
        prompt_pages = refs[: pages_needed(req.prompt_tokens, page_size)]
        transfer = self.receiver.expect(rid, req.request_id, secret, prompt_pages)
        self.reservations[rid] = DecodeReservation(
            rid,
            req.request_id,
            req.tenant_id,
            secret,
            refs,
            req.prompt_tokens,
            req.max_new_tokens,
            req.scrub_on_free,
            transfer,
        )
        self.by_request[req.request_id] = rid
        self._publish_pages()
        return prefill_pb2.Reservation(
            reservation_id=rid,
            decode_node_id=self.rt.node_id,
            decode_ucx_address=self.receiver.address,
            pages=[{"page_id": r.page_id, "generation": r.generation} for r in refs],
            secret=secret,
            prompt_tokens=req.prompt_tokens,
            max_new_tokens=req.max_new_tokens,
        )

    async def _verify(
        self, request: decode_pb2.DecodeRequest, res: DecodeReservation | None
    ) -> Any:
        """Manifest checks 1-6, then the sampling parameters; returns those parameters. A failed
        manifest check quarantines, reports, releases and raises; bad parameters (checked only
        once the manifest verified) raise InvalidArgument and leave the reservation as it was."""
        if res is None and self.receiver.released(request.reservation_id):
            raise self._released_before_decode(request.reservation_id)
        if res is None and self.receiver.restarted(request.reservation_id):
            # Reserved on this node's previous process (restarted in place since): lost with it,
            # nothing read or forged, so no integrity failure (as for its transfer's hello).
            raise Unavailable(
                f"reservation {request.reservation_id} was made by this node's previous process; "
                "the node restarted since",
                reason=NODE_RESTARTED,
            )
        if res is not None and res.request_id != request.request_id:
            res = None  # never act on another request's reservation
        if res is not None and res.state == ResState.RESERVED:
            # The transfer normally completed before prefill returned the manifest; allow a
            # moment for the last acknowledgement to be processed.
            owner = not res.awaited  # the first call to wait; a second is a duplicate
            res.awaited = True
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands in
                # the turn the transfer completes, and this call, gone, went on to decode.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.cfg.transfer.batch_timeout_s):
                        await res.transfer.done.wait()
            except asyncio.CancelledError:
                if not owner:
                    # A duplicate that went before verifying anything: the pages are the
                    # waiting owner's, which still decodes once the transfer arrives.
                    log.warning(
                        "duplicate Decode cancelled before verification; reservation kept",
                        reservation_id=res.reservation_id,
                    )
                elif self.reservations.get(res.reservation_id) is res:
                    # The caller went before the KV was verified. The control plane releases
                    # the reservation when the request ends, but its Release can be lost: the
                    # pages would then wait for the reaper (transfer.reservation_timeout_s).
                    # Nothing read them; give them back now.
                    self._release(
                        res.reservation_id,
                        "decode cancelled before verification",
                        request_ended=True,
                    )
                raise
            finally:
                if owner:
                    res.awaited = False
            if self.reservations.get(res.reservation_id) is not res:
                if res.ended is not None:
                    raise res.ended  # released by a timed-out drain (end_in_flight)
                # Reaped or released meanwhile: its transfer was cancelled, not forged.
                raise self._released_before_decode(res.reservation_id)
        exp = None
        if res is not None:
            exp = mf.Expected(
                request_id=res.request_id,
                tenant_id=res.tenant_id,
                reservation_id=res.reservation_id,
                secret=res.secret,
                prompt_tokens=res.prompt_tokens,
                pages=res.pages,
                receiving=res.state == ResState.RESERVED
                and res.transfer.state == InboundState.COMPLETE,
                received=list(res.transfer.received),
                fingerprint=self.rt.fingerprint,
                layout=self.rt.layout,
                checksum_algo=kernels.CHECKSUM_ALGO,
                vocab_size=self.rt.engine.vocab_size,
            )
        # The manifest first: a forged or tampered one is an integrity failure (quarantine, event)
        # whatever else the call carries, never hidden behind a bad parameter's INVALID_ARGUMENT.
        try:
            if res is not None and request.tenant_id != res.tenant_id:
                # Check 1 is "the same request and tenant": the call's own tenant too, not only
                # its manifest's (a call naming another tenant over an untouched manifest decoded).
                raise IntegrityError(
                    "the Decode call names another tenant than its reservation",
                    reason="RESERVATION",
                )
            mf.verify(
                request.manifest,
                exp,
                current_generation=self.pool.generation,
                checksums=self._checksums,
                checksum_seed=kernels.checksum_seed,
            )
        except IntegrityError as err:
            if res is None:
                self._report_integrity(request.request_id, request.tenant_id, err, "manifest")
            else:
                with self._logged_as(res, request):
                    self._integrity_failure(res, err, stage="manifest")
                    self._release(res.reservation_id, "integrity", request_ended=False)
            raise
        assert res is not None  # check 1 refuses a manifest without a reservation
        # A verified manifest with bad parameters is refused without touching the reservation:
        # it stays RESERVED with its transfer complete, so a corrected Decode verifies it again
        # and decodes (or the reaper, or the control plane's Release, gives the pages back).
        try:
            params: Any = sampling_from_proto(request.sampling)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        if params.missing_seed:
            # Prefill refuses it too; here it would raise inside the shared decode step and
            # fail every row of it, other tenants' included.
            raise InvalidArgument("a sampled request (temperature > 0) needs a seed")
        if params.max_new_tokens > res.max_new_tokens:
            # Its tokens would run past the reserved pages.
            raise InvalidArgument(
                f"max_new_tokens {params.max_new_tokens} is over the "
                f"{res.max_new_tokens} this reservation was made for"
            )
        return params

    def _refuse_after_drain(
        self, request: decode_pb2.DecodeRequest, res: DecodeReservation | None
    ) -> None:
        """A Decode arriving after the drain timed out: no manifest is checked (nothing will be
        read); the reservation is released now if it is this request's and no stream holds it,
        as its Release would (a transfer still to come finds it released), instead of at the
        stop. A stream decoding is ended by ``end_in_flight`` and gives its pages back itself."""
        if res is None or res.request_id != request.request_id:
            return  # never act on another request's reservation
        if res.state == ResState.RESERVED and not res.awaited:
            self._release(
                res.reservation_id, "Decode after the drain timed out", request_ended=True
            )

    def _released_before_decode(self, reservation_id: str) -> Unavailable:
        """A Decode for a reservation this node has released: nothing was read and nothing was
        forged (the request outlived transfer.reservation_timeout_s before its Decode, counted
        from Reserve, or it was released), so no integrity failure is reported."""
        return Unavailable(
            f"reservation {reservation_id} was released before its Decode: it waited longer than "
            f"transfer.reservation_timeout_s ({self.cfg.transfer.reservation_timeout_s:g} s) "
            "after Reserve, or the request was released",
            reason=RESERVATION_RELEASED,
        )

    def _checksums(self, page_ids: list[int], seeds: list[int]) -> list[int]:
        return kernels.page_checksums(self.pool.kv, page_ids, seeds)

    @staticmethod
    def _logged_as(
        res: DecodeReservation, request: decode_pb2.DecodeRequest
    ) -> contextlib.AbstractContextManager[None]:
        """Log lines about ``res`` carry its own request and tenant ids, not the ones the Decode
        call claims (bound by ``Decode``, unverified: a forged tenant must not be what the log
        names); a claim that differs is kept as ``claimed_request_id`` / ``claimed_tenant_id``."""
        claimed: dict[str, str] = {}
        if request.request_id != res.request_id:
            claimed["claimed_request_id"] = request.request_id
        if request.tenant_id != res.tenant_id:
            claimed["claimed_tenant_id"] = request.tenant_id
        return kvlog.request_context(res.request_id, res.tenant_id, **claimed)

    def _integrity_failure(self, res: DecodeReservation, err: IntegrityError, stage: str) -> None:
        res.state = ResState.FAILED
        self.pool.quarantine(res.reservation_id)
        self._report_integrity(res.request_id, res.tenant_id, err, stage)

    def _report_integrity(
        self, request_id: str, tenant_id: str, err: IntegrityError, stage: str
    ) -> None:
        report_integrity(self.metrics, self.bus, log, err, stage, request_id, tenant_id)

    def report_transfer(self, kind: str, payload: dict[str, Any]) -> None:
        """KvReceiver's reporter: bad hellos and failed transfers become events and metrics."""
        if kind == "integrity_violation":
            self.metrics.integrity_failures_total.labels(check=payload.get("check", "")).inc()
        elif kind == "transfer_failed" and payload.get("reason") in INTEGRITY_REASONS:
            # A batch this node refused (a page outside the reservation, one sent twice, a broken
            # protocol): its check, so its count; prefill and the control plane count none.
            self.metrics.integrity_failures_total.labels(check=payload["reason"]).inc()
        what = payload.get("check", payload.get("reason", ""))
        # A late hello is bounded only without its reservation's authenticator (anyone can send
        # a released id); its held-back count gets a key, and so a summary event, of its own.
        forged = payload.get("authenticated") is False
        bounded = payload.get("stage") == "ucx_hello" and (what != RESERVATION_RELEASED or forged)
        key = (kind, what, forged)
        if bounded and not self._hello_events.allow(key):
            return  # anyone can cause these: bounded (module docstring)
        self.bus.emit(kind, **payload)

    def flush_hello_events(self, force: bool = False) -> None:
        """One event per kind and check whose window closed with events held back, saying how
        many (all open windows with ``force``: at shutdown)."""
        for key, held in self._hello_events.flush(force):
            kind, what, forged = str(key[0]), str(key[1]), bool(key[2])  # type: ignore[index]
            field = "check" if kind == "integrity_violation" else "reason"
            extra = {"authenticated": False} if forged else {}
            self.bus.emit(
                kind,
                **{field: what},
                stage="ucx_hello",
                **extra,
                suppressed=held,
                window_s=HELLO_EVENTS_INTERVAL_S,
            )

    # ---- release -----------------------------------------------------------------------------
    def release_all(self) -> None:
        """Drop every reservation (the control plane has failed every request on this node)."""
        for rid in list(self.reservations):
            self._release(rid, "forgotten by the control plane", request_ended=False)

    def _release(self, rid: str, reason: str, *, request_ended: bool) -> bool:
        """Cancel the transfer, leave the batch and give the pages back (deferred while any
        receive or write may still land in them). Idempotent. ``request_ended``: released
        because the request ended by its owner's decision, not because of trouble; a late hello
        of its prefill is then logged, not reported (module docstring, ``KvReceiver.forget``)."""
        res = self.reservations.pop(rid, None)
        if res is None:
            return False
        # The reservation's own ids: Release, the reaper and shutdown reach here bound to none,
        # and a Decode call is bound to the ids it claims (a caller that bound the claims as
        # claimed_* keeps them: only request_id and tenant_id are rebound here).
        with kvlog.request_context(res.request_id, res.tenant_id):
            self.by_request.pop(res.request_id, None)
            # A transfer still receiving is refused saying its request ended, not aborted, only
            # while the node goes on serving (``KvReceiver.cancel``): a timed-out drain's
            # releases and the stop's cut it, the node going away with work still held.
            self.receiver.cancel(
                rid, request_ended=request_ended and self.drain_ended is None and not self.closing
            )
            if self.batcher is not None:
                self.batcher.remove(rid)
            if res.emit is not None:
                # Its Decode stream, if still open, must end now rather than wait for tokens
                # that will never come (a duplicate Decode failing verification also releases
                # it). A stream that is itself what ended reads no more events: then a no-op.
                res.emit(("error", Cancelled(f"reservation released: {reason}")))
            self.pool.release(rid, scrub=res.scrub)
            self.receiver.forget(rid, request_ended=request_ended, tenant_id=res.tenant_id)
            res.state = ResState.RELEASED
            log.info("reservation released", reservation_id=rid, reason=reason)
        self._publish_pages()
        return True

    async def _reap(self) -> None:
        timeout = self.cfg.transfer.reservation_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            self.flush_hello_events()
            now = time.monotonic()
            for rid, res in list(self.reservations.items()):
                if res.state != ResState.RESERVED:
                    continue
                if res.transfer.state in (InboundState.FAILED, InboundState.CANCELLED):
                    # A failed transfer can never be verified: give the pages back now (they
                    # stay quarantined until the cancelled receives have settled).
                    self.pool.quarantine(rid)
                    self._release(
                        rid,
                        f"transfer {res.transfer.state.value}: {res.transfer.error}",
                        request_ended=False,
                    )
                elif now - res.created > timeout:
                    self._release(rid, "reservation timeout", request_ended=False)
            self._publish_pages()

    def _publish_pages(self) -> None:
        publish_pool(self.metrics, self.pool)
