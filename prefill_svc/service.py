"""Prefill node: runs the prompt, writes KV into its own pages and sends them to decode.

For each ``Prefill`` call: allocate local pages for the prompt (RESOURCE_EXHAUSTED when the pool
has no room now), run the model off the event loop (prompts that wait for the engine thread share
a forward pass, up to ``prefill.max_batch_tokens``: prefill_svc/batcher.py), sample the first
token, zero the unused tail of the last page, checksum every page (seeded by reservation and page
index), send the pages over UCX in bounded batches (on an idle endpoint to that decode node when
the node's ``EndpointPool`` has one; see kvfence/transfer.py), and return the signed manifest.
The source pages stay held until the control plane calls ``Release`` (decode verified, or the
request ended), or until ``reservation_timeout_s`` passes without one, so a control plane that
vanished cannot pin the pool forever.

Released pages are never reused while this node still touches them: the forward pass (on the
engine thread; a call cancelled, or a request released, while its prompt waits for a pass drops
it (a released one's call fails UNAVAILABLE, RESERVATION_RELEASED); once the pass has started
neither can stop it) and this call's checksums and UCX send each count as an outstanding
operation on the pages, so a ``Release`` (or a cancel, or a failure) in the middle leaves them
QUARANTINED until both have ended (``PagePool.begin_ops``). A ``Release`` once the pass is over
ends the call UNAVAILABLE, RESERVATION_RELEASED, with no manifest: during the UCX send it cancels
the send (which settles every posted UCX operation before it ends, the pages QUARANTINED until
then), and one that lands as the send ends is seen before the manifest is returned. A call
releases only the pages it allocated itself: a duplicate ``Prefill`` for a request already here
is refused without touching the first one's pages. Bad input (a token outside the vocabulary, a
sampled request without a seed) is INVALID_ARGUMENT, found before any page is taken. Every RPC
needs the cluster node token (``NodeTokenCheck``): a call without it is UNAUTHENTICATED and runs
or releases nothing.

A send that fails is reported (a ``transfer_failed`` event, a "transfer failed" warning), but not
when its request has ended on this node by the time the failure is handled (its call cancelled, or
its pages released): on a client cancel the control plane cancels the call, then releases decode,
which refuses a hello it reads after that, or the transfer it was receiving at its next step
(``RESERVATION_RELEASED``). The call's cancel normally stops the send before decode's answer is
back; one that lands in the turn the answer is read is logged at info ("transfer ended: request
cancelled"), with no event. A refusal while the call is live (decode reaped the reservation: the
system was slow) is reported, and so is a failed integrity check whatever became of the request. A
refusal that overtook the call's cancel on the way (decode's Release delivered first) is live on
this node, but decode says in it that the reservation went with its request's end
(``request_ended``: for a hello carrying the reservation's authenticator, or a transfer decode was
receiving; kvfence/transfer.py): logged at info ("transfer ended: request ended on decode"), with
no event, the call still failing UNAVAILABLE ``RESERVATION_RELEASED``. A decode before that field
has such a refusal reported as before (and aborted a transfer it was receiving: a lost
connection, TRANSFER_FAILED, reported too).

Draining (the node shutting down, ``kvfence.node_main``): a new ``Prefill`` is refused UNAVAILABLE,
reason ``NODE_DRAINING``, before any page is taken (the control plane tries another prefill node);
the calls in flight finish, and ``Release`` goes on, so the node is drained once no call is in
flight and no source pages are held. A call still in flight when the drain times out is ended
then, before the server stops (``end_in_flight``; cut by the stop, it reached the control plane
as a lost connection, NODE_UNREACHABLE). Its status says where it was. Before its UCX send began
(queued for, or in, its forward pass) nothing of it left the node: UNAVAILABLE, ``NODE_DRAINING``,
which the control plane takes as a draining node's refusal and prefills the request on another
node, with the same decode reservation. Once its send began, decode may hold part of it, and
a reservation takes one transfer only (a second is refused REPLAY, an integrity violation): the
call ends CANCELLED, ``NODE_DRAINING``, which the control plane does not retry and passes on to
the tenant as UNAVAILABLE, ``NODE_DRAINING`` ("the prefill node serving this request is shutting
down"), counted against neither node. Such a call answers at once, without waiting for its send
to wind down (a cancelled send settles its UCX operations at once; only UCX's own connect of a
new endpoint goes on, in the endpoint pool, ``kvfence.transfer.EndpointPool.connect``); its
pages stay in use until every UCX operation of the send has settled, and ``close`` waits for it
(up to ``WINDING_STOP_S``). A send that ended failing, or cut by a ``Release``, before its call
resumed, is ended the same way, unless it failed an integrity check (decode refused the transfer
for one of its checks, or this node's check of decode's answers failed: ``transfer_status``):
that one was reported already (its ``transfer_failed`` event, counted where the check ran), and
the call answers it, DATA_LOSS with its reason, as it would without the drain, not a "shutting
down" that hides it from the tenant. What the send had done when the drain ended the call
decides: a send still in progress then is cancelled by the drain, and its call answers CANCELLED
``NODE_DRAINING`` whatever the send ends with later (a failure it ends with is still reported, as
any failed send is). One that ended having sent every page is not ended: decode holds the
whole transfer, and the call, with no await left before its answer, returns its manifest on its
next turn of the event loop, well within the grace the server's stop then gives in-flight calls
(``node_main.STOP_GRACE_S``).

A forward pass that fails this node's integrity check (``IntegrityError``: a page not at the
generation the request holds) is always reported (``report_integrity``: a metric, an
``integrity_violation`` event, an error line), once, when the pass ends, whether or not its call
still waits for it. A call whose pass failed it as a timed-out drain ended the call answers the
violation, DATA_LOSS, not ``NODE_DRAINING``: the control plane would prefill the request again
elsewhere as if nothing had happened. A pass that fails only after the drain ended its call (it
was still running) is reported then, its call already answered ``NODE_DRAINING``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc

import kernels
from kvfence import logging as kvlog
from kvfence import manifest as mf
from kvfence.config import ClusterConfig, pages_needed
from kvfence.errors import (
    NODE_DRAINING,
    RESERVATION_RELEASED,
    Cancelled,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    KvfenceError,
    ResourceExhausted,
    Unavailable,
)
from kvfence.events import EventBus
from kvfence.faults import Fault, FaultHook
from kvfence.kv.pool import PageRef, PageState
from kvfence.metrics import Metrics, publish_pool
from kvfence.node import NodeRuntime, NodeTokenCheck, report_integrity, sampling_from_proto
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from kvfence.server import abort
from kvfence.transfer import (
    INTEGRITY_REASONS,
    EndpointPool,
    OutboundPage,
    TransferError,
    host_port,
    send_pages,
)
from prefill_svc.batcher import PrefillBatcher

log = kvlog.get_logger("prefill")

# How long close() waits for the sends of calls a timed-out drain ended. Prefill has no receiver,
# so this takes the place of decode's receiver wait in node_main.STOP_TAIL_S's budget.
WINDING_STOP_S = 2.0


@dataclass(eq=False)
class Call:
    """One Prefill call in flight (compared by identity)."""

    task: asyncio.Task[Any] | None  # its handler's
    # Its UCX send, once begun (kept after it ended): from then on decode may hold part of it.
    send: asyncio.Task[int] | None = None
    # What a timed-out drain ended it with, the status it answers (``end_in_flight``), or None.
    ended: KvfenceError | None = None
    # Its forward pass failed this node's integrity check, and that was reported: once, by
    # whichever sees it first (the pass's end, or the call), as the call may no longer wait.
    integrity_reported: bool = False


@dataclass
class Held:
    pages: list[PageRef]
    since: float
    call: Call  # the Prefill call that allocated them (only it, Release or the reaper frees them)
    scrub: bool = False  # the tenant asked for its pages to be zeroed when freed
    # Its prompt's place in the engine thread's queue (PrefillBatcher.submit): a release cancels
    # it, which takes effect only while the pass has not started.
    job: Future[int] | None = None
    # Its UCX send, once started: a release cancels it (the call then fails RESERVATION_RELEASED).
    send: asyncio.Task[int] | None = None
    tenant_id: str = ""  # for the reaper's line, which no call's request context covers


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """The Prefill gRPC service (see module docstring)."""

    def __init__(
        self, cfg: ClusterConfig, rt: NodeRuntime, bus: EventBus, metrics: Metrics, node_token: str
    ):
        self.cfg = cfg
        self.authenticate = NodeTokenCheck(node_token, metrics)
        self.rt = rt
        self.pool = rt.pool
        self.bus = bus
        self.metrics = metrics
        self.faults = FaultHook(cfg.node.fault_file if cfg.node.fault_hook else None)
        self.batcher = PrefillBatcher(
            rt.engine,
            self.pool,
            cfg.prefill.max_batch_tokens,
            on_pass=metrics.prefill_pass_prompts.observe,
        )
        self.held: dict[str, Held] = {}
        self.calls: set[Call] = set()  # in flight
        # Sends of calls a timed-out drain ended, still winding down (``close`` waits for them).
        self.winding: set[asyncio.Task[int]] = set()
        # Idle UCX endpoints to decode nodes, reused by later transfers (kvfence/transfer.py).
        self.endpoints = EndpointPool(
            max_idle_per_peer=cfg.transfer.endpoint_pool_max_idle,
            idle_timeout_s=cfg.transfer.endpoint_idle_timeout_s,
        )
        self.rpc_count = 0
        self.queue_length = 0
        self._reaper: asyncio.Task[None] | None = None
        # Set once the node shuts down: new Prefill calls are refused (module docstring).
        self.draining = False

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self.winding:
            # Sends of calls ended by a timed-out drain: each settles its UCX operations (and
            # its call's pages come back) before the endpoints close under it. Cancelled, a send
            # aborts its endpoint, which completes them at once; WINDING_STOP_S bounds the wait
            # should ucxx not (node_main.STOP_TAIL_S's budget). What still winds then is
            # cancelled when the event loop ends.
            await asyncio.wait(self.winding, timeout=WINDING_STOP_S)
        await self.endpoints.close()
        for request_id in list(self.held):
            self._release(request_id)
        # Returns once the running forward pass is over (its pages' operations ended), as before,
        # but waits for it off the event loop: a pass takes seconds, and stop's later steps (and
        # every other task of the process) must not freeze behind it.
        await self.batcher.aclose()

    def busy(self) -> bool:
        """Whether the node still holds work (a draining node waits for this to be False)."""
        return self.queue_length > 0 or bool(self.held)

    def held_counts(self) -> dict[str, int]:
        return {"calls": self.queue_length, "held": len(self.held)}

    def end_in_flight(self, err: KvfenceError) -> int:
        """End every Prefill call in flight with ``err`` (UNAVAILABLE, NODE_DRAINING): the node's
        drain timed out, and its server is about to stop (``RunningNode.drain``). A call whose
        UCX send began gets the same reason as CANCELLED instead, which the control plane does
        not retry elsewhere (module docstring), and one whose send has just failed an integrity
        check answers that failure (DATA_LOSS, its reason). A call whose send already ended
        having sent every page is not ended: it answers its manifest. Each call's own end gives
        its pages back; a send winds down on its own (``close`` waits for it). How many were
        ended."""
        ended = 0
        for call in list(self.calls):
            if call.ended is not None or call.task is None or call.task.done():
                continue
            if sent_whole(call.send):
                # Its send is over and decode holds the whole transfer; only the call has not
                # resumed yet. Ended now, the request failed for nothing. Left alone, the call
                # answers its manifest without another await, on its next turn of the loop,
                # well within the server stop's grace that follows (``RunningNode.stop``). (The
                # fault hook's ``replay`` sends once more: that test-only send the stop may cut.)
                continue
            call.ended = err
            failed = send_integrity_failure(call.send)
            if failed is not None:
                # Its send has just failed an integrity check, reported already (its
                # transfer_failed event, counted where the check ran), and the call has not
                # resumed yet. It answers that, DATA_LOSS, as without the drain: NODE_DRAINING
                # would tell the tenant "shutting down" of a failed integrity check. Decided
                # here, from what the send had done by the drain, not when the call resumes.
                call.ended = failed
            elif call.send is not None:
                call.ended = Cancelled(err.message, reason=err.reason, metadata=err.metadata)
                if not call.send.done():
                    call.send.cancel()
                    self.winding.add(call.send)
                    call.send.add_done_callback(self._wound_down)
            call.task.cancel()
            ended += 1
        return ended

    def _wound_down(self, send: asyncio.Task[int]) -> None:
        self.winding.discard(send)
        if not send.cancelled():
            send.exception()  # retrieved: its call has answered already

    # ---- RPCs --------------------------------------------------------------------------------
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        await self.authenticate(context, "Prefill")
        self.rpc_count += 1
        self.metrics.rpcs_total.labels(method="Prefill").inc()
        self.queue_length += 1
        call = Call(asyncio.current_task())
        self.calls.add(call)
        with kvlog.request_context(request.request_id, request.tenant_id):
            try:
                return await self._prefill(request, call)
            except KvfenceError as err:
                self._release(request.request_id, call)
                answer = err
                if call.ended is not None:  # a failure that raced the drain's end of it
                    if call.task is not None:
                        call.task.uncancel()
                    # The drain's answer, unless the failure is an integrity violation: that
                    # one must reach the control plane as what it is (DATA_LOSS: the request
                    # fails, and the tenant is told why), never as a refusal to retry elsewhere.
                    if not isinstance(err, IntegrityError):
                        answer = call.ended
                self.metrics.requests_total.labels(status=answer.code.name).inc()
                await abort(context, answer)
            except asyncio.CancelledError:
                self._release(request.request_id, call)
                # Ended by a timed-out drain (end_in_flight), and by nothing else (grpc's own
                # cancel, the client gone or the server stopping, stays a cancel): its answer.
                if call.ended is None or call.task is None or call.task.uncancel() > 0:
                    # Finished all the same, as decode counts its cancelled streams.
                    self.metrics.requests_total.labels(status="CANCELLED").inc()
                    raise
                self.metrics.requests_total.labels(status=call.ended.code.name).inc()
                await abort(context, call.ended)
            except Exception as err:
                log.exception("prefill failed")
                self._release(request.request_id, call)
                self.metrics.requests_total.labels(status="INTERNAL").inc()
                await abort(context, KvfenceError(f"prefill failed: {type(err).__name__}"))
            finally:
                self.calls.discard(call)
                self.queue_length -= 1
        raise AssertionError("unreachable")

    async def Release(
        self, request: prefill_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseResponse:
        await self.authenticate(context, "Release")
        held = self._release(request.request_id)
        return prefill_pb2.ReleaseResponse(held=held)

    async def Stats(
        self, request: prefill_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.NodeStats:
        await self.authenticate(context, "Stats")
        return node_stats(self.rt, self.rpc_count, len(self.held))

    # ---- the work ----------------------------------------------------------------------------
    async def _prefill(
        self, req: prefill_pb2.PrefillRequest, call: Call
    ) -> prefill_pb2.PrefillResponse:
        if self.draining:
            raise Unavailable(
                f"prefill node {self.rt.node_id} is draining (shutting down): prefill elsewhere",
                reason=NODE_DRAINING,
            )
        res = req.reservation
        tokens = list(req.prompt_token_ids)
        page_size = self.pool.page_size
        n_pages = pages_needed(len(tokens), page_size)
        if not tokens:
            raise InvalidArgument("empty prompt")
        if len(tokens) != res.prompt_tokens or len(res.pages) < n_pages:
            raise InvalidArgument(
                f"prompt of {len(tokens)} tokens does not match the reservation "
                f"({res.prompt_tokens} tokens, {len(res.pages)} pages)"
            )
        if req.request_id in self.held:
            raise InvalidArgument("request already prefilled on this node")
        try:
            host_port(res.decode_ucx_address)
        except ValueError:
            # Refused before the forward pass: send_pages would fail on it only after the pass,
            # as an INTERNAL ValueError with a traceback and no transfer_failed event.
            raise InvalidArgument(
                f"the reservation's decode UCX address {res.decode_ucx_address!r} is not HOST:PORT"
            ) from None
        try:
            self.rt.engine.check_tokens(tokens)  # type: ignore[attr-defined]
            sampling = sampling_from_proto(req.sampling)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        if sampling.missing_seed:  # type: ignore[attr-defined]
            raise InvalidArgument("a sampled request (temperature > 0) needs a seed")
        try:
            refs = self.pool.allocate(n_pages, req.request_id)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        if refs is None:
            free = self.pool.num_free
            raise ResourceExhausted(
                f"prefill pool has {free} free pages, {n_pages} needed",
                reason="PREFILL_POOL_FULL",
                # the control plane reopens the node once a heartbeat shows more than this
                metadata={"free_pages": str(free)},
            )
        self.held[req.request_id] = Held(
            refs, time.monotonic(), call, req.scrub_on_free, tenant_id=req.tenant_id
        )
        self.pool.set_state(req.request_id, PageState.IN_USE)
        self._publish_pages()
        ids = [r.page_id for r in refs]
        # Two operations on the pages (see the module docstring): this call's, ended when it
        # returns or fails, and the forward pass's, ended when the engine thread is done with
        # them, or when the pass is cancelled before it started (which a cancelled call does).
        self.pool.begin_ops(ids)
        try:
            self.pool.begin_ops(ids)
            try:
                job = self.batcher.submit(
                    tokens,
                    refs,
                    sampling,  # type: ignore[arg-type]
                    request_id=req.request_id,
                    tenant_id=req.tenant_id,
                )
            except BaseException:
                self.pool.end_ops(ids)  # never queued: no pass will end the pass's operation
                raise
            self.held[req.request_id].job = job
            loop = asyncio.get_running_loop()

            def pass_over(done: Future[int]) -> None:  # on the engine thread
                self.pool.end_ops(ids)
                # Pages of a call cancelled mid-pass are freed here, after the call has ended:
                # the gauge must show it now, not at the node's next call (on an idle node,
                # KvfencePagesQuarantined for pages that are free). A pass that failed this
                # node's integrity check is reported here too, whether or not the call still
                # waits for it (ended by a drain or cancelled mid-pass, it no longer does).
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                    loop.call_soon_threadsafe(self._pass_over, req, call, done)

            job.add_done_callback(pass_over)
            try:
                first = await asyncio.wrap_future(job)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if job.cancelled() and (task is None or task.cancelling() == 0):
                    # Not this call's cancel: a release (the reaper, the control plane) took
                    # its prompt out of the queue before its pass (``_release``).
                    raise Unavailable(
                        "released while queued for prefill", reason=RESERVATION_RELEASED
                    ) from None
                violation = integrity_failure(job)
                if violation is not None:
                    # The pass failed the check as the call was cancelled, before it resumed.
                    # Reported in any case (the pass's end may not have run yet here); and a
                    # timed-out drain's cancel (end_in_flight: UNAVAILABLE, NODE_DRAINING, for
                    # a call before its send) must not turn it into a retry on another node:
                    # the call answers the violation (Prefill). Any other cancel stays one.
                    self._report_integrity(req, call, violation)
                    if call.ended is not None:
                        raise violation from None
                raise
            except IntegrityError as err:  # this node's own check (a page's generation)
                self._report_integrity(req, call, err)
                raise
            held = self.held.get(req.request_id)
            if held is None or held.call is not call:
                # Released by this node's reaper (a queue longer than
                # transfer.reservation_timeout_s) or by the control plane: the reservation is
                # over, as decode says of a late transfer.
                raise Unavailable("released while prefilling", reason=RESERVATION_RELEASED)
            return await self._finish(req, refs, first, len(tokens))
        finally:
            if call.send is not None and not call.send.done():
                # Ended by a timed-out drain before its send wound down (end_in_flight): the
                # pages stay in use until every UCX operation of the send has settled.
                call.send.add_done_callback(lambda _: self._ops_over(ids))
            else:
                self._ops_over(ids)

    def _ops_over(self, ids: list[int]) -> None:
        self.pool.end_ops(ids)
        self._publish_pages()

    def _pass_over(self, req: prefill_pb2.PrefillRequest, call: Call, job: Future[int]) -> None:
        """On the event loop, once a call's forward pass is over (or dropped before it ran)."""
        self._publish_pages()
        violation = integrity_failure(job)
        if violation is not None:
            self._report_integrity(req, call, violation)

    def _report_integrity(
        self, req: prefill_pb2.PrefillRequest, call: Call, err: IntegrityError
    ) -> None:
        """Report the failed check of a call's forward pass, once (``Call.integrity_reported``).
        The pass's end usually comes first, outside the call's log context: the logger is bound
        to the request here."""
        if call.integrity_reported:
            return
        call.integrity_reported = True
        logger = log.bind(request_id=req.request_id, tenant_id=req.tenant_id)
        report_integrity(
            self.metrics, self.bus, logger, err, "prefill", req.request_id, req.tenant_id
        )

    async def _finish(
        self, req: prefill_pb2.PrefillRequest, refs: list[PageRef], first: int, n_tokens: int
    ) -> prefill_pb2.PrefillResponse:
        """Manifest, checksums and the UCX send of a prefilled request."""
        res = req.reservation
        fault = self.faults.fault_for(req.tenant_id)
        m = self._manifest(req, refs, first, n_tokens)
        outbound = [
            OutboundPage(i, self.pool.page_buffer(ref.page_id)) for i, ref in enumerate(refs)
        ]
        secret = res.secret
        if fault is not None:
            log.warning("fault hook active", fault=fault.kind)
            outbound = apply_wire_fault(fault, outbound)
            apply_manifest_fault(fault, m, res)
            if fault.kind == "wrong_mac":
                secret = os.urandom(32)
        mf.sign(m, secret)
        sent = await self._send_unless_released(req, outbound, fault)
        if fault is not None and fault.kind == "replay":
            await self._send_unless_released(req, outbound, None)
        self.metrics.requests_total.labels(status="OK").inc()
        return prefill_pb2.PrefillResponse(manifest=m, pages_sent=len(outbound), bytes_sent=sent)

    def _manifest(
        self, req: prefill_pb2.PrefillRequest, refs: list[PageRef], first: int, n_tokens: int
    ) -> common_pb2.KvManifest:
        res = req.reservation
        page_size = self.pool.page_size
        seeds = [kernels.checksum_seed(res.reservation_id, i) for i in range(len(refs))]
        sums = kernels.page_checksums(self.pool.kv, [r.page_id for r in refs], seeds)
        pages = []
        for i, dest in enumerate(res.pages[: len(refs)]):
            in_page = min(page_size, n_tokens - i * page_size)
            pages.append(
                common_pb2.ManifestPage(
                    page_id=dest.page_id,
                    generation=dest.generation,
                    tokens_in_page=in_page,
                    checksum=sums[i],
                )
            )
        return common_pb2.KvManifest(
            request_id=req.request_id,
            tenant_id=req.tenant_id,
            reservation_id=res.reservation_id,
            model_fingerprint=self.rt.fingerprint,
            layout=self.rt.layout,
            token_count=n_tokens,
            first_token=first,
            pages=pages,
            checksum_algo=kernels.CHECKSUM_ALGO,
        )

    async def _send_unless_released(
        self, req: prefill_pb2.PrefillRequest, outbound: list[OutboundPage], fault: Fault | None
    ) -> int:
        """``_send`` as a task a ``Release`` can cancel (``_release``). Released during the send
        or as it ended, the call fails UNAVAILABLE, RESERVATION_RELEASED, and returns no manifest:
        the control plane dropped the request, and a manifest would have it decode pages that
        prefill no longer holds. A cancelled send settles every UCX operation before it ends
        (``send_pages``), so the pages stay QUARANTINED until then (the call's operation)."""
        held = self.held.get(req.request_id)
        if held is None:  # released before the send began: nothing to send for
            raise Unavailable("released before the KV transfer", reason=RESERVATION_RELEASED)
        send = asyncio.ensure_future(self._send(req, outbound, fault))
        held.send = held.call.send = send
        try:
            # Shielded, so that a timed-out drain ends the call without waiting for the send to
            # wind down (end_in_flight: it cancels the send itself). Any other cancel of the call
            # cancels the send and waits for it, below, as an unshielded await did.
            sent = await asyncio.shield(send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if held.call.ended is None and not send.done():
                send.cancel()
                while not send.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({send})
            if send.cancelled() and (task is None or task.cancelling() == 0):
                # Not this call's cancel (which cancels the send too, then re-raises here): a
                # release cancelled the send.
                log.info(
                    "released during the KV transfer", decode_node=req.reservation.decode_node_id
                )
                raise Unavailable(
                    "released during the KV transfer", reason=RESERVATION_RELEASED
                ) from None
            raise
        finally:
            if held.send is send:
                held.send = None
        if self.held.get(req.request_id) is not held:
            # Released after the send's last answer, before this call resumed.
            raise Unavailable("released during the KV transfer", reason=RESERVATION_RELEASED)
        return sent

    async def _send(
        self, req: prefill_pb2.PrefillRequest, outbound: list[OutboundPage], fault: Fault | None
    ) -> int:
        res = req.reservation
        page_bytes = self.pool.page_bytes
        if fault is not None and fault.kind == "kill":
            # Die while the transfer is in flight: decode sees the connection lost mid-transfer.
            send = asyncio.ensure_future(
                self._send_raw(req, outbound, page_bytes, auth=None, stall=0)
            )
            await asyncio.sleep(0.01)
            del send
            os._exit(17)
        try:
            seconds = await self._send_raw(
                req,
                outbound,
                page_bytes,
                auth="0" * 64 if fault is not None and fault.kind == "bad_auth" else None,
                stall=fault.seconds if fault is not None and fault.kind == "delay" else 0,
            )
        except TransferError as err:
            # The reason code alone ("TRANSFER_FAILED") left an operator nothing to go on; the
            # message is the transfer's own (UCX's error, decode's refusal), never request data.
            detail = str(err)[:300]
            ended = self._request_ended(req)
            if ended is None and err.request_ended:
                # Decode refused a late hello, or the transfer it was receiving, because the
                # request ended there first (the control plane's Release of a client cancel
                # overtook this call's cancel; decode's own answer says so, ``KvReceiver.forget``
                # and ``KvReceiver.cancel``).
                ended = "on decode"
            if ended is not None and err.reason not in INTEGRITY_REASONS:
                # The request ended as the failure came back: on a client cancel the control
                # plane cancels this call and then releases decode, which refuses the transfer
                # (RESERVATION_RELEASED; a decode before ``request_ended`` aborted one it was
                # receiving: a lost connection). Not a failed transfer: no event for an operator
                # to chase. A failed integrity check is reported below whatever became of the
                # request.
                log.info(
                    "transfer ended: request ended on decode"
                    if ended == "on decode"
                    else "transfer ended: request cancelled",
                    ended=ended,
                    reason=err.reason,
                    detail=detail,
                    decode_node=res.decode_node_id,
                )
                if ended == "released":
                    raise Unavailable(
                        "released during the KV transfer", reason=RESERVATION_RELEASED
                    ) from None
                raise transfer_status(err) from None
            log.warning(
                "transfer failed", reason=err.reason, detail=detail, decode_node=res.decode_node_id
            )
            self.bus.emit(
                "transfer_failed",
                request_id=req.request_id,
                tenant_id=req.tenant_id,
                reason=err.reason,
                detail=detail,
                decode_node=res.decode_node_id,
            )
            if err.reason in INTEGRITY_REASONS and not err.refused:
                # This node's check (decode answered outside the protocol); one decode refused
                # was decode's check, and decode counted it.
                self.metrics.integrity_failures_total.labels(check=err.reason).inc()
            raise transfer_status(err) from None
        nbytes = len(outbound) * page_bytes
        self.metrics.transfer_bytes_total.inc(nbytes)
        self.metrics.transfer_seconds.observe(seconds)
        return nbytes

    def _request_ended(self, req: prefill_pb2.PrefillRequest) -> str | None:
        """Whether the request of a send has ended on this node: "released" (a Release, or the
        reaper, took its pages), "cancelled" (its call was cancelled: its client went, or the
        control plane cancelled it), or None while its call is live. A call a timed-out drain
        ended is live here: its send's failures are reported as before (module docstring). Run
        in the send's task (``_send_unless_released``)."""
        held = self.held.get(req.request_id)
        if held is None or held.send is not asyncio.current_task():
            return "released"  # (or held again, by a later call of the request)
        task = held.call.task
        if held.call.ended is None and task is not None and (task.done() or task.cancelling()):
            return "cancelled"
        return None

    async def _send_raw(
        self,
        req: prefill_pb2.PrefillRequest,
        outbound: list[OutboundPage],
        page_bytes: int,
        *,
        auth: str | None,
        stall: float,
    ) -> float:
        res = req.reservation
        return await send_pages(
            res.decode_ucx_address,
            reservation_id=res.reservation_id,
            request_id=req.request_id,
            secret=res.secret,
            pages=outbound,
            page_bytes=page_bytes,
            max_batch_bytes=self.cfg.transfer.max_batch_bytes,
            batch_timeout_s=self.cfg.transfer.batch_timeout_s,
            endpoints=self.endpoints,
            auth_override=auth,
            stall_after_hello_s=stall,
        )

    # ---- release -----------------------------------------------------------------------------
    def release_all(self) -> None:
        """Drop every held request (the control plane has failed them all)."""
        for request_id in list(self.held):
            self._release(request_id)

    def _release(self, request_id: str, call: Call | None = None) -> bool:
        """Give the request's pages back (deferred while an operation is on them). With ``call``,
        only if that Prefill call allocated them: a refused duplicate must not free the pages of
        the request it duplicates."""
        held = self.held.get(request_id)
        if held is None or (call is not None and held.call is not call):
            return False
        del self.held[request_id]
        if held.job is not None:
            # A prompt still queued never runs: its pass would be spent on pages no one owns
            # (under overload the reaper releases exactly the prompts queued too long, and the
            # live ones behind them would wait for those passes too). Once its pass has started
            # this does nothing, and the call fails after it (RESERVATION_RELEASED).
            held.job.cancel()
        if held.send is not None:
            # Its UCX send stops (every posted operation settled first, the pages QUARANTINED
            # until then) and the call fails RESERVATION_RELEASED: a manifest must not come out
            # of a call whose request was dropped (``_send_unless_released``).
            held.send.cancel()
        self.pool.release(request_id, scrub=held.scrub)
        self._publish_pages()
        return True

    async def _reap(self) -> None:
        timeout = self.cfg.transfer.reservation_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            now = time.monotonic()
            for request_id, held in list(self.held.items()):
                if now - held.since > timeout:
                    log.warning(
                        "releasing source pages never released",
                        request_id=request_id,
                        tenant_id=held.tenant_id,
                    )
                    self._release(request_id)

    def _publish_pages(self) -> None:
        publish_pool(self.metrics, self.pool)


def sent_whole(send: asyncio.Task[int] | None) -> bool:
    """Whether a call's UCX send has ended having sent every page (decode holds all of it)."""
    return send is not None and send.done() and not send.cancelled() and send.exception() is None


def send_integrity_failure(send: asyncio.Task[int] | None) -> IntegrityError | None:
    """The integrity failure a call's UCX send has ended with (decode refused the transfer for
    one of its checks, or this node's check of decode's answers failed: ``transfer_status``), or
    None: not begun, not over, cancelled, sent, or another failure."""
    if send is None or not send.done() or send.cancelled():
        return None
    err = send.exception()
    return err if isinstance(err, IntegrityError) else None


def integrity_failure(job: Future[int]) -> IntegrityError | None:
    """The integrity violation a forward pass ended with (this node's own check), or None: not
    over yet, dropped before it ran, a result, or another failure."""
    if not job.done() or job.cancelled():
        return None
    err = job.exception()
    return err if isinstance(err, IntegrityError) else None


def transfer_status(err: TransferError) -> KvfenceError:
    """DATA_LOSS when decode saw wrong bytes or protocol, DEADLINE_EXCEEDED on a timeout, else
    UNAVAILABLE (decode unreachable or lost mid-transfer; decode refusing a late transfer,
    RESERVATION_RELEASED, or one for a reservation of its process before a restart,
    NODE_RESTARTED: a retry reserves anew)."""
    message = f"KV transfer to decode failed: {err}"
    if err.reason in INTEGRITY_REASONS:
        return IntegrityError(message, reason=err.reason)
    if err.timeout:
        return DeadlineExceeded(message, reason=err.reason)
    return Unavailable(message, reason=err.reason)


def node_stats(rt: NodeRuntime, rpc_count: int, active: int) -> prefill_pb2.NodeStats:
    s = rt.pool.stats()
    return prefill_pb2.NodeStats(
        node_id=rt.node_id,
        role=rt.role.value,
        total_pages=s.total,
        free_pages=s.free,
        quarantined_pages=s.quarantined,
        held_pages=s.held,
        rpc_count=rpc_count,
        active_requests=active,
    )


def apply_wire_fault(fault: Fault, pages: list[OutboundPage]) -> list[OutboundPage]:
    """Faults that change what goes over the wire (prefill's own pages stay intact)."""
    pages = list(pages)
    if fault.kind == "drop_page":
        pages = pages[:-1]
    elif fault.kind == "duplicate_page":
        pages = [pages[0], *pages]
    elif fault.kind == "reorder_pages" and len(pages) >= 2:
        pages[0], pages[1] = OutboundPage(0, pages[1].data), OutboundPage(1, pages[0].data)
    elif fault.kind == "corrupt_byte":
        data = pages[0].data.copy()
        data[len(data) // 2] ^= 0x01
        pages[0] = OutboundPage(0, data)
    return pages


def apply_manifest_fault(
    fault: Fault, m: common_pb2.KvManifest, res: prefill_pb2.Reservation
) -> None:
    """Faults that change what the manifest claims."""
    if fault.kind == "truncate_pages" and len(m.pages) > 0:
        del m.pages[-1]
    elif fault.kind == "fewer_tokens":
        m.token_count -= 1
    elif fault.kind == "stale_generation":
        m.pages[0].generation -= 1
    elif fault.kind == "foreign_page":
        # A page id this reservation does not hold (the pages after the reservation's own).
        taken = {p.page_id for p in res.pages}
        m.pages[0].page_id = next(i for i in range(len(taken) + 1) if i not in taken)
