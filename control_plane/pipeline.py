"""One request from admission to its last token: admit, reserve, prefill, decode, release.

Each request runs in a task of its own (see generation.py) and only this code moves its state.
Every node RPC is awaited through :meth:`Run.guard`, so an interrupt (node lost, abort, deadline,
client gone) cancels the RPC in flight; the ``finally`` of :meth:`Pipeline.execute` then releases
the request on every node that may hold something for it, whatever happened before. Errors from
nodes keep their status code and ErrorInfo reason: DATA_LOSS from decode reaches the client as
DATA_LOSS, with a message made of those alone (the node's own text and id go to the log:
``verify.node_error``).

A request that finds no node of a role that takes requests (none registered, or every registered
one draining) is not failed at once while that role's last such node started draining or left less
than ``no_node_wait_s`` ago (``Registry.vacant_for``): in a rolling update its replacement registers
within seconds. It waits in the admission queue (a place like any waiting request's, so the queue's
caps hold), at most until then and always within its deadline, then fails UNAVAILABLE (NO_NODES,
the message counting the nodes still draining); once the window has passed, new requests fail at
once. Draining nodes are not waited for: they take nothing new, and a request that waited its whole
deadline for one would fail NO_CAPACITY, telling the operator to add capacity rather than nodes.
A new request waits before it is ADMITTED and is checked against the admissible limit again once
nodes are there (a joining node may have a smaller pool); a queued one waits where it was queued.
Requests that were running on a node that is lost are not retried (NODE_LOST): its KV went with it.

Each Reserve is bounded by the registry's ``node_timeout_s`` (a node silent that long is lost),
capped by the deadline left. Only the head of the admission queue reserves (``AdmissionQueue``),
so a decode node that heartbeats but does not answer Reserve held every tenant's admission for up
to the head's deadline (``max_deadline_s``, up to an hour) while other decode nodes sat idle. A
Reserve not answered in time counts as a failed call towards the node's cool-down (routing's
``node_unanswered``) and the request tries the next node; the node stays in ``contacted`` (the call
may have reserved there late), so the request's Release reaches it, but its loss fails nothing of
the request (``RequestRecord.unanswered``).

Before the tokenizer runs, the tenant's own limits are checked with what is known without it: its
concurrency, and a lower bound of the prompt's tokens against its tokens per request (again with
the exact count after). An interrupt (abort, key revoked, deadline, SetLimits, client gone) while
a request is not yet admitted fails it (FAILED / CANCELLED), not counted as an admission refusal;
one waiting for its tokenizer thread stops waiting at once (the thread runs on, unheard), and an
interrupted request no longer counts against its tenant's concurrency (``Run.live``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from control_plane import admission
from control_plane.admission import AdmissionQueue, Prompt
from control_plane.detok import IncrementalDetokenizer
from control_plane.lifecycle import (
    CountedPages,
    RequestRecord,
    RequestState,
    RequestTable,
    Run,
    transition,
)
from control_plane.model_info import ModelAccess, ModelInfo
from control_plane.registry import DECODE, PREFILL, Node, Registry
from control_plane.routing import (
    NodeClients,
    decode_candidates,
    node_failed,
    node_succeeded,
    node_unanswered,
    prefill_candidates,
    prefill_pages,
    refuse_room,
    refused_draining,
)
from control_plane.tenants import Tenant
from control_plane.verify import (
    DecodeStream,
    check_manifest,
    check_reservation,
    check_reservation_node,
)
from kvfence.config import pages_needed
from kvfence.errors import (
    Cancelled,
    DeadlineExceeded,
    IntegrityError,
    KvfenceError,
    ResourceExhausted,
    Unavailable,
)
from kvfence.logging import get_logger
from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import (
    client_pb2,
    common_pb2,
    decode_pb2,
    prefill_pb2,
)
from kvfence.tokenizer import UNLOCKED_ENCODE_CHARS

log = get_logger("pipeline")

# Give up waiting for capacity this long before the deadline, so the client gets
# RESOURCE_EXHAUSTED from us rather than DEADLINE_EXCEEDED from its own timer.
QUEUE_MARGIN_S = 0.1
# Of a decode reservation's life (transfer.reservation_timeout_s), the part a request may spend
# waiting for prefill room; the rest is for the pass, the transfer and the Decode call.
RESERVATION_USE_FRACTION = 0.75
MODEL_OFFLINE = "MODEL_OFFLINE"
NO_NODES = "NO_NODES"
SHUTTING_DOWN = "SHUTTING_DOWN"
# The refusals of _check_serving: an interrupt with one of these reasons (the model taken offline,
# a shutdown) is the refusal a request not yet admitted gets, interrupt or not.
SERVING_REFUSALS = frozenset({MODEL_OFFLINE, SHUTTING_DOWN})


class EventSink(Protocol):
    def emit(self, kind: str, **payload: Any) -> int: ...


# Responses, in order, then possibly the request's error: the client hears its status as soon as
# it is decided, not after the releases on the nodes (each up to RELEASE_TIMEOUT_S).
Emit = Callable[[client_pb2.GenerateResponse | KvfenceError], None]


@dataclass
class PipelineDeps:
    """What a request needs from the control plane; shared by every request."""

    model: ModelInfo
    access: ModelAccess
    registry: Registry
    clients: NodeClients
    queue: AdmissionQueue
    table: RequestTable
    events: EventSink
    metrics: Metrics
    scrub_on_free: bool = False
    draining: bool = False
    poll_s: float = 1.0
    # How long after a role's last node taking requests drained or left requests wait for one
    # (module docstring); 0 = not.
    no_node_wait_s: float = 0.0
    # Decode releases a reservation whose Decode has not come this long after Reserve
    # (transfer.reservation_timeout_s); waiting for prefill room stops in time (0 = never).
    reservation_timeout_s: float = 0.0
    background: set[asyncio.Task[Any]] = field(default_factory=set)


class Pipeline:
    """Runs requests through the lifecycle (module docstring)."""

    def __init__(self, deps: PipelineDeps):
        self.d = deps

    # -- entry -------------------------------------------------------------------------------------

    async def execute(
        self,
        run: Run,
        req: client_pb2.GenerateRequest,
        deadline: float,
        emit: Emit,
    ) -> None:
        """Serve ``req`` for ``run.tenant``; streams responses through ``emit``, raises
        KvfenceError on failure."""
        loop = asyncio.get_running_loop()
        timer = loop.call_at(
            deadline, run.interrupt, DeadlineExceeded("the request deadline passed")
        )
        status = "OK"
        try:
            prompt = await self._admit(run, req, deadline)
            await self._serve(run, prompt, deadline, emit)
        except KvfenceError as err:
            status = err.code.name
            self._fail(run, err)
            # Before the releases below: a node slow to answer Release (one in trouble, when
            # requests fail) held a DATA_LOSS back until the client's deadline, which it then
            # heard instead.
            emit(err)
            raise
        except Exception as err:
            status = "INTERNAL"
            log.exception("request crashed")
            self._fail(run, KvfenceError("internal error"))
            internal = KvfenceError(f"internal error ({type(err).__name__})")
            emit(internal)
            raise internal from err
        except asyncio.CancelledError:  # the task itself cancelled (the loop shutting down)
            status = "CANCELLED"
            self._fail(run, Cancelled("the control plane cancelled the request", reason=status))
            raise
        finally:
            timer.cancel()
            await self._release_all(run)
            self.d.metrics.requests_total.labels(status=status).inc()

    def _transition(
        self, rec: RequestRecord, dst: RequestState, reason: str = "", **fields: Any
    ) -> None:
        """``transition``, and the time spent in the state left into ``request_state_seconds``
        (where an operator sees whether requests wait for decode pages, prefill or decode)."""
        src = rec.state
        seconds = transition(rec, dst, reason, **fields)
        self.d.metrics.request_state_seconds.labels(state=src.value.lower()).observe(seconds)

    def _fail(self, run: Run, err: KvfenceError) -> None:
        rec = run.record
        if rec.terminal:  # REJECTED at admission
            return
        dst = RequestState.CANCELLED if isinstance(err, Cancelled) else RequestState.FAILED
        self._transition(rec, dst, reason=f"{err.code.name}: {err.reason}")
        self.d.events.emit(
            "request_failed",
            request_id=rec.request_id,
            tenant_id=rec.tenant_id,
            code=err.code.name,
            reason=err.reason,
            state_before=str(rec.history[-1][0]),
        )
        if isinstance(err, IntegrityError) and err.reported_by is None:
            # Only the control plane's own checks: a node counts those it made (the alert then
            # names the service that saw the bad bytes, once); the request_failed event above
            # and requests_total{status="DATA_LOSS"} still show every one.
            self.d.metrics.integrity_failures_total.labels(check=err.reason).inc()

    # -- admission (no node contact) ---------------------------------------------------------------

    async def _admit(self, run: Run, req: client_pb2.GenerateRequest, deadline: float) -> Prompt:
        rec = run.record
        try:
            self._check_serving()
            # What needs no tokenizer first: a request that can never be served is refused
            # INVALID_ARGUMENT, never a retryable refusal of the limits below.
            admission.check_parameters(req, self.d.model)
            known = admission.prompt_tokens_at_least(req, self.d.model)
            rec.max_new_tokens = req.max_new_tokens
            if known is not None:  # refuse what cannot fit before paying for the tokenizer
                rec.prompt_tokens = known[0]
                admission.check_limit(
                    known[0],
                    req.max_new_tokens,
                    self.d.registry.admissible_limit(),
                    self.d.model.context_window,
                    known[1],
                )
            # The tenant's own limits too, before the tokenizer: a tenant at its concurrency
            # limit, or whose text is longer than its tokens per request by its bytes alone, cost
            # a tokenizer run in the worker threads every tenant shares for each refusal. The
            # prompt's lower bound (no bound: none, 0 tokens) refuses only what cannot fit.
            at_least, bound = known if known is not None else (0, "a prompt not yet tokenized")
            admission.check_tenant(
                _tenant(run),
                at_least + req.max_new_tokens,
                self.d.table.active_for_tenant(rec.tenant_id, besides=run),
                bound,
            )
            text_ids = None
            if req.WhichOneof("prompt") == "text" and len(req.text) >= UNLOCKED_ENCODE_CHARS:
                # A long text off the event loop (the tokenizer releases the GIL for a text this
                # long; a thread would cost a short one more than its tokenizing), so other
                # tenants' streams and the nodes' heartbeats go on meanwhile. Guarded: an
                # interrupt (abort, revoked key, deadline) ends the request now; the thread
                # cannot be stopped, its result is dropped.
                text_ids = await run.guard(
                    asyncio.to_thread(self.d.model.tokenizer.encode, req.text)
                )
            prompt = admission.validate(req, self.d.model, text_ids)
            rec.prompt_tokens = len(prompt.token_ids)
            rec.max_new_tokens = prompt.sampling.max_new_tokens
            admission.check_limit(
                len(prompt.token_ids),
                prompt.sampling.max_new_tokens,
                self.d.registry.admissible_limit(),
                self.d.model.context_window,
            )
            # Again with the exact count, and the tenant as it stands now: SetLimits may have
            # changed it since authentication (or while the tokenizer ran).
            admission.check_tenant(
                _tenant(run),
                prompt.total_tokens,
                self.d.table.active_for_tenant(rec.tenant_id, besides=run),
            )
            if await self._wait_for_nodes(run, deadline):
                # The limit above counted only the nodes registered then.
                admission.check_limit(
                    len(prompt.token_ids),
                    prompt.sampling.max_new_tokens,
                    self.d.registry.admissible_limit(),
                    self.d.model.context_window,
                )
        except KvfenceError as err:
            interrupt = run.interrupted
            if interrupt is not None and interrupt.reason not in SERVING_REFUSALS:
                # Interrupted (key revoked, an operator's abort, the deadline, SetLimits, the
                # client gone) is not a refusal at admission: it fails as it would anywhere
                # (_fail: FAILED or CANCELLED), not counted in admission_rejections_total nor
                # an admission_rejected event, which tell an operator about refusals. The
                # interrupt wins over a refusal that raced it (Run.interrupt's promise). The
                # kill switch and a shutdown interrupt waiting requests with the refusal
                # _check_serving gives (it would at the request's next wake-up): still refusals.
                if interrupt is err:
                    raise
                raise interrupt from None
            # Cancelled is CANCELLED, as anywhere; anything else refused before admission is
            # REJECTED.
            if not isinstance(err, Cancelled):
                self._reject(run, err)
            raise
        self._transition(rec, RequestState.ADMITTED, prompt_tokens=rec.prompt_tokens)
        return prompt

    async def _wait_for_nodes(self, run: Run, deadline: float) -> bool:
        """Wait, holding a place in the admission queue, while a role has no node that takes
        requests but had one recently (module docstring); NO_NODES when that wait is over or was
        not open. True when the request waited."""
        give_up = _give_up(deadline)
        ticket = object()
        with contextlib.ExitStack() as queued:
            waited = False
            while True:
                left = self._node_wait_left((DECODE, PREFILL), give_up)
                if left is None:
                    return waited
                if not waited:  # a place in the queue (or QUEUE_FULL) like any waiting request
                    queued.enter_context(self.d.queue.slot(ticket, run.record.tenant_id))
                    waited = True
                await run.guard(self.d.queue.changed(min(left, self.d.poll_s)))
                self._check_serving()

    def _node_wait_left(self, roles: tuple[str, ...], give_up: float) -> float | None:
        """None when every role has a node that takes requests (registered, not draining); else
        the seconds the request may still wait for one to register, or Unavailable (NO_NODES)
        when none."""
        now = asyncio.get_running_loop().time()
        left: float | None = None
        for role in roles:
            vacant = self.d.registry.vacant_for(role)
            if vacant is None:
                continue
            wait = min(self.d.no_node_wait_s - vacant, give_up - now)
            if wait <= 0:
                gone = f" (none for {vacant:.1f} s)" if self.d.no_node_wait_s else ""
                draining = len(self.d.registry.nodes(role))  # registered, so all draining
                what = f"takes requests: {draining} draining" if draining else "is registered"
                raise Unavailable(f"no {role} node {what}{gone}", reason=NO_NODES)
            left = wait if left is None else min(left, wait)
        return left

    def _reservation_expiring(self, node_wait: float | None) -> KvfenceError:
        """A request that waited for prefill too long for its decode reservation: NO_NODES when
        no prefill node takes requests (what it waited for), else NO_CAPACITY (all full)."""
        bound = f"transfer.reservation_timeout_s, {self.d.reservation_timeout_s:g} s"
        if node_wait is not None:
            return Unavailable(
                f"no {PREFILL} node takes requests, and the decode reservation would expire "
                f"before one registers ({bound})",
                reason=NO_NODES,
            )
        return ResourceExhausted(
            f"no prefill node had room before the decode reservation would expire ({bound})",
            reason=admission.NO_CAPACITY,
        )

    def _check_serving(self) -> None:
        if self.d.draining:
            raise Unavailable("the control plane is shutting down", reason=SHUTTING_DOWN)
        if not self.d.access.online:
            reason = self.d.access.reason or "no reason given"
            raise Unavailable(
                f"model {self.d.model.name} is offline: {reason}", reason=MODEL_OFFLINE
            )

    def _reject(self, run: Run, err: KvfenceError) -> None:
        rec = run.record
        self._transition(rec, RequestState.REJECTED, reason=f"{err.code.name}: {err.reason}")
        self._count_rejection(rec, err)

    def _count_rejection(self, rec: RequestRecord, err: KvfenceError) -> None:
        self.d.metrics.admission_rejections_total.labels(reason=err.reason).inc()
        if err.reason != admission.INVALID_PARAMETERS:
            self.d.events.emit(
                "admission_rejected",
                request_id=rec.request_id,
                tenant_id=rec.tenant_id,
                reason=err.reason,
                prompt_tokens=rec.prompt_tokens,
                max_new_tokens=rec.max_new_tokens,
                admissible_limit=self.d.registry.admissible_limit(),
            )

    # -- node work ---------------------------------------------------------------------------------

    async def _serve(self, run: Run, prompt: Prompt, deadline: float, emit: Emit) -> None:
        node, reservation, scrub = await self._reserve(run, prompt, deadline)
        self._transition(run.record, RequestState.RESERVED, decode_node=node.node_id)
        try:
            manifest = await self._prefill(run, prompt, reservation, deadline, scrub)
        except ResourceExhausted as err:
            # No prefill room in time: counted where a decode-side NO_CAPACITY is, or a
            # saturated prefill tier would refuse every request with no capacity alert.
            if err.reason == admission.NO_CAPACITY:
                self._count_rejection(run.record, err)
            raise
        await self._decode(run, prompt, node, reservation, manifest, deadline, emit)

    async def _reserve(
        self, run: Run, prompt: Prompt, deadline: float
    ) -> tuple[Node, prefill_pb2.Reservation, bool]:
        """Reserve decode pages, waiting in the admission queue while no node has room; the
        node, its reservation and whether the request's pages are zeroed when freed."""
        loop = asyncio.get_running_loop()
        pages = pages_needed(prompt.total_tokens, self.d.model.page_size)
        give_up = _give_up(deadline)
        started = loop.time()
        in_queue = False
        ticket = object()  # this request's place in the admission queue
        with contextlib.ExitStack() as queued:
            try:
                while True:
                    run.check()
                    self._check_serving()  # an operator's offline reaches queued requests here
                    # No decode node taking requests (none, or all draining): wait for one a
                    # while (module docstring), or fail, rather than wait out the deadline.
                    node_wait = self._node_wait_left((DECODE,), give_up)
                    if self.d.queue.may_try(ticket):
                        # Both nodes hold the tenant's KV: both zero it when freed, if the tenant
                        # asks (as it asks now: SetLimits may have changed it while this waited).
                        scrub_on_free = _tenant(run).limits.scrub_on_free or self.d.scrub_on_free
                        # A node whose Reserve for this request went unanswered goes last.
                        candidates = sorted(
                            decode_candidates(self.d.registry, pages, skip=set()),
                            key=lambda n: n.node_id in run.record.unanswered,
                        )
                        for node in candidates:
                            # Listed before the awaits of the earlier candidates: one lost or
                            # registered again since (a new process) is not this node any more.
                            if not self.d.registry.registered(node) or node.draining:
                                continue
                            res = await self._try_reserve(
                                run, node, prompt, scrub_on_free, pages, deadline
                            )
                            if res is not None:
                                return node, res, scrub_on_free
                    now = loop.time()
                    if now >= give_up:
                        raise ResourceExhausted(
                            f"no decode node had room for {pages} KV pages within the deadline "
                            f"(waited {now - started:.1f} s)",
                            reason=admission.NO_CAPACITY,
                        )
                    if not in_queue:  # first wait: take a place in the queue (or fail if full)
                        queued.enter_context(self.d.queue.slot(ticket, run.record.tenant_id))
                        in_queue = True
                        continue  # heading an empty queue: try again at once
                    wait = min(give_up - now, self.d.poll_s, node_wait or self.d.poll_s)
                    await run.guard(self.d.queue.changed(wait))
            except ResourceExhausted as err:
                if err.reason in (admission.NO_CAPACITY, admission.QUEUE_FULL):
                    self._count_rejection(run.record, err)
                raise

    async def _try_reserve(
        self,
        run: Run,
        node: Node,
        prompt: Prompt,
        scrub_on_free: bool,
        pages: int,
        deadline: float,
    ) -> prefill_pb2.Reservation | None:
        rec = run.record
        req = decode_pb2.ReserveRequest(
            request_id=rec.request_id,
            tenant_id=rec.tenant_id,
            prompt_tokens=len(prompt.token_ids),
            max_new_tokens=prompt.sampling.max_new_tokens,
            scrub_on_free=scrub_on_free,
        )
        # Its last Reserve for this request went unanswered and may have reserved late: decode
        # refuses a second reservation for one request (INVALID_ARGUMENT), which failed the
        # request. Release whatever that call left first; a node that does not answer the
        # Release either is skipped this round.
        retried = node.node_id in rec.unanswered
        if retried:
            held = await run.guard(
                self.d.clients.release(node, rec.request_id, "reserve retried after no answer")
            )
            # The node may have been lost, registered again by a new process or begun draining
            # while it answered: nothing of this request's is held there now, so the request
            # tries the next node. Calling a lost node's stub raised NODE_LOST, which failed a
            # request that holds nothing anywhere.
            if held is None or not self.d.registry.registered(node) or node.draining:
                return None
        # Recorded before the call: a call cut short may still have reserved on the node.
        first_contact = node.node_id not in rec.contacted
        rec.contacted[node.node_id] = DECODE
        self.d.clients.count(node, "Reserve")
        # Each Reserve is bounded by node_timeout_s (a node silent that long is lost), within the
        # deadline: only the head of the admission queue reserves, so a decode node that
        # heartbeats but does not answer held every tenant's admission for up to the head's
        # deadline (max_deadline_s), with other decode nodes idle.
        left = _left(deadline)
        node_bound = self.d.registry.node_timeout_s < left
        timeout = min(self.d.registry.node_timeout_s, left)
        try:
            res = await run.guard(self.d.clients.decode(node).Reserve(req, timeout=timeout))
        except Unavailable as err:
            if err.reason != "NODE_UNREACHABLE" or self.d.registry.registered(node):
                raise
            # The node was lost while it had the call (its channel closed under it): a request
            # that reserved nothing elsewhere tries the next node, as for one that refused to
            # connect; whatever the call reserved there went with the node.
            if first_contact:
                del rec.contacted[node.node_id]
            return None
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and node_bound:
                # No answer within node_timeout_s: a failed call on the node's side (its
                # cool-down counts it, as node_failed counts a fault), and the request goes on to
                # the next node. It may have reserved there late: the node stays contacted, so
                # the request's Release reaches it (_release_all), but losing it fails nothing
                # of the request (RequestRecord.unanswered).
                node_unanswered(self.d.registry, node, "RESERVE_TIMEOUT")
                rec.unanswered.add(node.node_id)
                log.warning(
                    "decode node did not answer reserve in time",
                    node_id=node.node_id,
                    timeout_s=timeout,
                    failures_in_a_row=node.failures,
                )
                return None
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED or refused_draining(
                self.d.registry, node, err
            ):
                # "No room now" (or "shutting down"): nothing held; skip the node until its next
                # heartbeat (a draining one for good).
                if first_contact:
                    del rec.contacted[node.node_id]
                node.reserved_since_heartbeat = node.free_pages
                return None
            if unreachable(err):
                if first_contact:
                    del rec.contacted[node.node_id]
                self.d.registry.lose(node, "refused connections")
                return None
            if retried and err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # The unanswered call reserved after the Release above was answered: the next
                # round releases it again.
                return None
            raise node_failed(self.d.registry, node, err) from None
        if not self.d.registry.registered(node):
            # Answered, then lost before this request went on: the lost node's requests are
            # left to their cut calls (service._node_lost), and this one's was not cut. Its pages
            # went with the node; it stays contacted, so a Release still reaches the node if the
            # same process registers again.
            # The node's id is the operator's (this log line), not the tenant's.
            log.warning("decode node lost after answering reserve", node_id=node.node_id)
            raise Unavailable("the decode node serving this request was lost", reason="NODE_LOST")
        node.reserved_since_heartbeat += pages
        rec.unanswered.discard(node.node_id)  # answered now: the request's node
        rec.decode_node, rec.reservation_id = node.node_id, res.reservation_id
        rec.reserved = CountedPages(node, pages, node.heartbeats)
        check_reservation(node.node_id, res, prompt, pages)
        check_reservation_node(node, res)
        return res

    async def _prefill(
        self,
        run: Run,
        prompt: Prompt,
        reservation: prefill_pb2.Reservation,
        deadline: float,
        scrub_on_free: bool,
    ) -> common_pb2.KvManifest:
        """Run the prompt on the least busy prefill node; wait and retry while all are full."""
        rec = run.record
        self._transition(rec, RequestState.PREFILLING)
        loop = asyncio.get_running_loop()
        give_up = _give_up(deadline)
        # Past this a prefill may not end (pass, transfer, Decode) before decode's reaper gives
        # the reservation back: the request would wait for room, spend a prefill pass, and
        # still fail. It fails now instead, NO_CAPACITY (retry), and its decode pages go back.
        expires = (
            loop.time() + RESERVATION_USE_FRACTION * self.d.reservation_timeout_s
            if self.d.reservation_timeout_s
            else float("inf")
        )
        req = prefill_pb2.PrefillRequest(
            request_id=rec.request_id,
            tenant_id=rec.tenant_id,
            prompt_token_ids=prompt.token_ids,
            sampling=prompt.sampling,
            reservation=reservation,
            scrub_on_free=scrub_on_free,
        )
        full: set[str] = set()
        while True:
            run.check()
            # A request waiting here for prefill room is as queued as one waiting for decode
            # pages: an operator's offline (or a shutdown) reaches it too.
            self._check_serving()
            # Only nodes whose estimate holds the prompt: waiters woken together when room
            # comes back each see the pages the ones before them sent (``_try_prefill``).
            candidates = prefill_candidates(self.d.registry, full, len(prompt.token_ids))
            if not candidates:
                # Wait (within the deadline) for room, or, with no prefill node taking requests
                # (none registered: one refused connections, restarted; or all draining), for one
                # to register as long as the no-node window allows: then NO_NODES, and the decode
                # pages held go back.
                node_wait = self._node_wait_left((PREFILL,), give_up)
                if loop.time() >= give_up:
                    raise ResourceExhausted(
                        "no prefill node had room within the deadline", reason=admission.NO_CAPACITY
                    )
                if loop.time() >= expires:
                    raise self._reservation_expiring(node_wait)
                full.clear()
                wait = min(
                    give_up - loop.time(),
                    expires - loop.time(),
                    self.d.poll_s,
                    node_wait or self.d.poll_s,
                )
                await run.guard(self.d.queue.changed(wait))
                continue
            if loop.time() >= expires:  # room came, too late for the reservation
                raise self._reservation_expiring(None)
            node = candidates[0]
            resp = await self._try_prefill(run, node, req, deadline)
            if resp is None:
                full.add(node.node_id)
                continue
            node_succeeded(node)  # its pass and its transfer
            check_manifest(rec, resp.manifest, len(prompt.token_ids))
            return resp.manifest

    async def _try_prefill(
        self, run: Run, node: Node, req: prefill_pb2.PrefillRequest, deadline: float
    ) -> prefill_pb2.PrefillResponse | None:
        rec = run.record
        first_contact = node.node_id not in rec.contacted
        rec.contacted[node.node_id] = PREFILL
        rec.prefill_node = node.node_id
        self.d.clients.count(node, "Prefill")
        node.in_flight += 1
        try:
            call = self.d.clients.prefill(node).Prefill(req, timeout=_left(deadline))
            # The prompt's pages come off the node's estimate now, before the first await: the
            # requests woken with this one for room (a release answered, a heartbeat) choose
            # after it, and with room for one only one sends its prompt, not every one of them.
            counted = CountedPages(
                node, prefill_pages(node, len(req.prompt_token_ids)), node.heartbeats
            )
            node.reserved_since_heartbeat += counted.pages
            rec.prefill_counted = counted
            return await run.guard(call)
        except grpc.aio.AioRpcError as err:
            gone = unreachable(err)
            if (
                err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                or gone
                or refused_draining(self.d.registry, node, err)
            ):
                if first_contact:
                    del rec.contacted[node.node_id]
                rec.prefill_node = ""
                # The node took nothing: its pages go back on the estimate.
                self._give_back(rec.prefill_counted, held=False)
                rec.prefill_counted = None
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # "No room now": left out until its next heartbeat or a release on it.
                    refuse_room(node, err)
                if gone:
                    self.d.registry.lose(node, "refused connections")
                return None
            decode = self.d.registry.get(rec.decode_node)
            raise node_failed(self.d.registry, node, err, decode) from None
        finally:
            node.in_flight -= 1

    async def _decode(
        self,
        run: Run,
        prompt: Prompt,
        node: Node,
        reservation: prefill_pb2.Reservation,
        manifest: common_pb2.KvManifest,
        deadline: float,
        emit: Emit,
    ) -> None:
        """Stream tokens from decode; the stream must start verified and end with a reason."""
        rec = run.record
        req = decode_pb2.DecodeRequest(
            request_id=rec.request_id,
            tenant_id=rec.tenant_id,
            reservation_id=reservation.reservation_id,
            manifest=manifest,
            sampling=prompt.sampling,
        )
        self.d.clients.count(node, "Decode")
        call = self.d.clients.decode(node).Decode(req, timeout=_left(deadline))
        detok = IncrementalDetokenizer(self.d.model.tokenizer)
        stream = DecodeStream(rec, manifest, prompt, detok, self.d.model.eos_ids)
        started = last = time.monotonic()
        try:
            async with contextlib.aclosing(run.read_stream(call)) as messages:
                async for msg in messages:
                    if not stream.verified and msg.verified:
                        self._transition(rec, RequestState.KV_VERIFIED)
                        self._release_prefill_early(run)
                        self._transition(rec, RequestState.DECODING)
                    out = stream.accept(msg)
                    if out is not None:
                        now = time.monotonic()
                        if stream.completion_tokens == len(out.token_ids):
                            self.d.metrics.ttft_seconds.observe(now - started)
                        else:  # per token of the message: decode may batch several in one
                            gap = (now - last) / len(out.token_ids)
                            for _ in out.token_ids:
                                self.d.metrics.inter_token_seconds.observe(gap)
                        last = now
                        emit(out)
        except grpc.aio.AioRpcError as err:
            raise node_failed(self.d.registry, node, err) from None
        finally:
            if not call.done():
                call.cancel()
        # The one point where a request that has its whole answer is decided finished or
        # interrupted: an interrupt accepted by now (an operator's abort answered aborted=True, a
        # deadline) wins, even if the end of the stream had already arrived; from FINISHED on,
        # Run.interrupt refuses. Nothing awaits between this check and the transition.
        run.check()
        final = stream.finish()
        node_succeeded(node)
        self._transition(rec, RequestState.FINISHED, completion_tokens=stream.completion_tokens)
        emit(final)

    # -- release -----------------------------------------------------------------------------------

    def _release_prefill_early(self, run: Run) -> None:
        """Once decode verified the KV, prefill's source pages are no longer needed: free them
        now rather than at the end of decoding (nothing can still write into decode's pages)."""
        rec = run.record
        node = self.d.registry.get(rec.prefill_node)
        rec.contacted.pop(rec.prefill_node, None)
        counted, rec.prefill_counted = rec.prefill_counted, None
        if node is None:
            return
        task = asyncio.create_task(
            self.d.clients.release(node, rec.request_id, "kv verified by decode")
        )
        self.d.background.add(task)
        task.add_done_callback(self.d.background.discard)
        sent_at = node.heartbeats
        task.add_done_callback(lambda t: self._prefill_room_back(node, counted, _held(t), sent_at))

    def _give_back(
        self, counted: CountedPages | None, held: bool | None, sent_at: int | None = None
    ) -> bool:
        """Take a request's prompt pages off its prefill node's estimate again, once nothing of
        the request holds them: a Prefill refused having taken nothing (``held`` False), or a
        release over (``held``: the node's answer, None when it did not answer; ``sent_at``: the
        node's heartbeat count when the Release was sent). Only on the node object they were
        counted on: one that replaced it (a restart) never had them.

        Each heartbeat resets the count to what the node saw, so they come off only if no
        heartbeat could have seen them free. Held (the node freed them answering this release):
        when no heartbeat came since the Release was sent, as one after that may have been taken
        after the node freed them. Not held, or not answered: when none came since they were
        counted, as one since saw them free already, or was taken while the node held them and
        reset the count. (A release not answered may leave them held: one Prefill refused then
        costs less than a node left idle until its next heartbeat.)

        A heartbeat in the way leaves them counted: the node looks fuller than it is until its
        next heartbeat. It can look emptier too, until then: after a release not answered that
        left them held, or when a heartbeat taken before the node allocated them reached this
        control plane after they were counted; a Prefill may then be refused for room. True
        when they came off."""
        if counted is None or not counted.pages:
            return False
        node = counted.node
        if not self.d.registry.registered(node):
            return False
        if node.heartbeats == (sent_at if held else counted.beats):
            node.reserved_since_heartbeat -= counted.pages
            return True
        return False

    def _prefill_room_back(
        self, node: Node, counted: CountedPages | None, held: bool | None, sent_at: int
    ) -> None:
        """A release on a prefill node is over (``held``: its answer, None when it did not
        answer). The request's counted pages come off the node's estimate (``_give_back``; not
        before the release is over: a Prefill sent on the strength of them could overtake the
        Release and be refused). Requests waiting for prefill room then try at once rather than
        at its next heartbeat, and a node that refused for room is tried again (it may have
        some now)."""
        room = self._give_back(counted, held, sent_at)
        if node.refused_room:
            node.refused_room = False
            room = True
        if room:
            self.d.queue.notify()

    async def _release_all(self, run: Run) -> None:
        rec = run.record
        if not rec.contacted:
            return
        reason = f"{rec.state}: {rec.reason}" if rec.reason else str(rec.state)
        calls: list[Coroutine[Any, Any, bool | None]] = []
        # Each prefill node (it may hold pages even if its Prefill failed), the index of its
        # Release in calls, and the pages the request counted on its estimate.
        prefill_nodes: list[tuple[Node, int, CountedPages | None, int]] = []
        for node_id in list(rec.contacted):
            node = self.d.registry.get(node_id)
            if node is None:  # lost: nothing to call, its pages went with it
                log.info("not releasing on lost node", node_id=node_id)
                continue
            if node.role == PREFILL:
                counted = rec.prefill_counted if node_id == rec.prefill_node else None
                prefill_nodes.append((node, len(calls), counted, node.heartbeats))
            if node_id == rec.decode_node:
                reserved, rec.reserved = rec.reserved, None
                if reserved is not None and self.d.registry.registered(reserved.node):
                    # Released pages make the count negative until the next heartbeat.
                    node.reserved_since_heartbeat -= reserved.pages
                if rec.state == RequestState.FINISHED:
                    # Decode gave the pages back as its stream ended (decode_svc/service.py):
                    # a Release would cost both sides an RPC per request for nothing.
                    continue
            calls.append(self.d.clients.release(node, rec.request_id, reason))
        rec.contacted.clear()
        rec.prefill_counted = None
        answers = await asyncio.gather(*calls, return_exceptions=True)
        for node, i, counted, sent_at in prefill_nodes:
            answer = answers[i]
            held = answer if isinstance(answer, bool) else None
            self._prefill_room_back(node, counted, held, sent_at)
        self.d.queue.notify()


def unreachable(err: grpc.aio.AioRpcError) -> bool:
    """True when a call never reached the node (connection refused: the process is gone or
    restarting). Nothing ran there, so the request may go to another node, or to this one once it
    has registered again; the caller drops the node from the registry until then. A call that
    broke after connecting is never retried: work may have started."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (
        err.details() or ""
    )


def _held(task: asyncio.Task[bool | None]) -> bool | None:
    """A ``NodeClients.release`` task's answer: whether the node held anything; None when it did
    not answer."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()


def _tenant(run: Run) -> Tenant:
    assert run.tenant is not None, "Generate gives every run its tenant"
    return run.tenant


def _give_up(deadline: float) -> float:
    """When a request stops waiting (for capacity, or for a node): just before its deadline, so
    the client gets our status rather than DEADLINE_EXCEEDED from its own timer."""
    loop = asyncio.get_running_loop()
    return deadline - min(QUEUE_MARGIN_S, (deadline - loop.time()) / 10)


def _left(deadline: float) -> float:
    """Seconds to the deadline, as a node RPC timeout (so the deadline reaches the node)."""
    return max(0.001, deadline - asyncio.get_running_loop().time())
