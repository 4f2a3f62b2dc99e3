"""The control plane process: both listeners, the registry reaper, events, metrics, shutdown.

In-process use (tests, the local stack)::

    cp = ControlPlane(cfg, model_info=info)        # model_info=None loads it from cfg
    ports = await cp.start()                        # ports.public, ports.admin
    ...
    await cp.stop()

As a service: ``await serve(cfg, stop_event)`` runs until ``stop_event`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from control_plane.admin import AdminServicer, load_admin_token
from control_plane.admission import AdmissionQueue
from control_plane.generation import GenerationServicer
from control_plane.lifecycle import RequestState, RequestTable
from control_plane.model_info import ModelAccess, ModelInfo, load_model_info
from control_plane.pipeline import SHUTTING_DOWN, EventSink, Pipeline, PipelineDeps
from control_plane.registry import ROLES, Node, NodeRegistryServicer, Registry
from control_plane.routing import NodeClients
from control_plane.tenants import TENANTS_DB, TenantStore, utc_now, utc_seconds
from control_plane.verify import client_message
from kvfence import tls
from kvfence.auth import load_node_token
from kvfence.config import ClusterConfig
from kvfence.errors import KvfenceError, Unavailable
from kvfence.events import EventBus
from kvfence.logging import get_logger
from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc, control_pb2, control_pb2_grpc
from kvfence.server import GrpcServer, host_of

log = get_logger("control_plane")

PUBLIC_SERVICES = ["kvfence.v1.Generation", "kvfence.v1.NodeRegistry"]
ADMIN_SERVICES = ["kvfence.v1.Admin"]

# What stop() may take beyond max(shutdown_grace_s, shutdown_refuse_s), whatever hangs: the
# interrupted requests' ends and releases (STOP_INTERRUPTED_S), the listeners' close
# (STOP_LISTENERS_S, both at once), the event bus's flush (STOP_FLUSH_S) and its disconnect
# from a broker that does not answer (events.PUBLISH_TIMEOUT_S + 1), with a second to spare. The
# chart's default terminationGracePeriodSeconds is max(shutdownGraceS, shutdownRefuseS) plus
# this (tests/helm keeps the two in step).
STOP_INTERRUPTED_S = 5.5
STOP_LISTENERS_S = 1.0
STOP_FLUSH_S = 1.0
STOP_TAIL_S = 15.0


@dataclass(frozen=True)
class Ports:
    public: int
    admin: int
    metrics: int | None = None


class ControlPlane:
    """Public API + node registry on ``listen``, admin API on ``admin_listen``; both accept
    messages of up to control_plane.max_request_bytes (refused RESOURCE_EXHAUSTED by gRPC, before
    any handler or credential check, above it)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        *,
        model_info: ModelInfo | None = None,
        events: EventSink | None = None,
        metrics: Metrics | None = None,
    ):
        self.cfg = cfg
        cp = cfg.control_plane
        self.model = model_info or load_model_info(cfg)
        self.metrics = metrics or Metrics("control-plane")
        self.bus: EventBus | None = None
        if events is None:
            self.bus = EventBus.from_config(
                cfg, cfg.node.node_id or "control-plane", metrics=self.metrics
            )
            events = self.bus
        self.events: EventSink = events
        self.tenants = TenantStore(cp.state_dir / TENANTS_DB)
        # It holds the state directory's lock from here on: a failure below must let go of it
        # (a process that goes on, a test, could not start a control plane there again).
        try:
            self.admin_token = load_admin_token(cp)
            self.node_token = load_node_token(cp.node_token_file, cp.state_dir)
            self.table = RequestTable()
            self.queue = AdmissionQueue(cp.admission_queue, cp.admission_queue_per_tenant)
            self.access = self._saved_access()
            # Read from the switch at each scrape: nothing to keep in step with it.
            self.metrics.model_online.labels(model=self.model.name).set_function(
                lambda: 1.0 if self.access.online else 0.0
            )
            # The time it went offline, not just that it is: KvfenceModelOffline's `for` starts
            # over with every restart (the pod's series go stale), this does not.
            self.metrics.model_offline_since.labels(model=self.model.name).set_function(
                lambda: 0.0 if self.access.online else utc_seconds(self.access.since)
            )
            self.registry = Registry(
                self.model,
                cp.heartbeat_interval_s,
                cp.node_timeout_s,
                on_joined=self._node_joined,
                on_lost=self._node_lost,
                on_refused=self._node_refused,
                on_capacity=self.queue.notify,
                on_stall=self.metrics.stalled_seconds_total.labels(model=self.model.name).inc,
                failures_to_cool=cp.failures_to_cool,
                failure_cooldown_s=cp.failure_cooldown_s,
                refused_room_max_s=cp.refused_room_max_s,
            )
            for role in ROLES:
                self.metrics.nodes.labels(role=role).set_function(
                    functools.partial(self._nodes_taking_requests, role)
                )
            # The admissible limit is exported from node_timeout_s after start (_publish_limit).
            self._limit_settles_at = math.inf
            self._limit_timer: asyncio.TimerHandle | None = None
            self._publish_limit()
            self.clients = NodeClients(
                self.node_token,
                tls.internal_channel_credentials(cfg.tls),
                self.metrics,
                registered=self.registry.registered,
                tls_server_name=cfg.tls.internal_server_name,
            )
            self.deps = PipelineDeps(
                model=self.model,
                access=self.access,
                registry=self.registry,
                clients=self.clients,
                queue=self.queue,
                table=self.table,
                events=self.events,
                metrics=self.metrics,
                scrub_on_free=cfg.kv.scrub_on_free,
                poll_s=cp.heartbeat_interval_s,
                no_node_wait_s=cp.no_node_wait_s,
                reservation_timeout_s=cfg.transfer.reservation_timeout_s,
            )
            self.generation = GenerationServicer(
                Pipeline(self.deps),
                self.tenants,
                self.table,
                self.metrics,
                cp.default_deadline_s,
                self.list_models,
                max_deadline_s=cp.max_deadline_s,
            )
            self.admin = AdminServicer(
                self.admin_token, self.tenants, self.deps, cfg.model.clamp_context, self.set_access
            )
            self._public: GrpcServer | None = None
            self._admin: GrpcServer | None = None
            self._reaper: asyncio.Task[None] | None = None
        except BaseException:
            self.tenants.close()
            raise

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, listen: str | None = None, admin_listen: str | None = None) -> Ports:
        """Start both listeners (addresses default to the config's); returns the bound ports."""
        cp = self.cfg.control_plane
        try:
            public_creds = tls.public_server_credentials(self.cfg.tls)
            self._public = await GrpcServer.start(
                listen or cp.listen,
                [
                    (client_pb2_grpc.add_GenerationServicer_to_server, self.generation),
                    (
                        control_pb2_grpc.add_NodeRegistryServicer_to_server,
                        NodeRegistryServicer(self.registry, self.node_token, self.metrics),
                    ),
                ],
                PUBLIC_SERVICES,
                credentials=public_creds,
                max_receive_bytes=cp.max_request_bytes,
            )
        except BaseException:
            self.tenants.close()  # a control plane that cannot start lets go of the state dir
            raise
        try:
            self._admin = await GrpcServer.start(
                admin_listen or cp.admin_listen,
                [(control_pb2_grpc.add_AdminServicer_to_server, self.admin)],
                ADMIN_SERVICES,
                credentials=public_creds,
                max_receive_bytes=cp.max_request_bytes,
            )
        except BaseException:
            await self._public.stop(0)
            self._public = None
            self.tenants.close()  # a control plane that cannot start lets go of the state dir
            raise
        # Only once both ports are ours: a second control plane that cannot bind must not reach
        # the broker, where its status (and, at exit, its "offline") would be this one's.
        if self.bus is not None:
            await self.bus.start()
            self.bus.publish_node_status(
                {
                    "role": "control-plane",
                    "grpc_address": f"{host_of(listen or cp.listen)}:{self._public.port}",
                    "admin_address": f"{host_of(admin_listen or cp.admin_listen)}:"
                    f"{self._admin.port}",
                    "model": self.model.name,
                }
            )
        if not self.access.online:
            # As when it was taken offline: consumers of the events (and the alert on the gauge)
            # see the same state after a restart as before it.
            self._emit_access(self.access.reason)
        self._reaper = asyncio.create_task(self.registry.run_reaper(), name="kvfence-reaper")
        loop = asyncio.get_running_loop()
        self._limit_settles_at = time.monotonic() + cp.node_timeout_s
        self._limit_timer = loop.call_later(cp.node_timeout_s, self._publish_limit)
        log.info(
            "control plane started",
            public_port=self._public.port,
            admin_port=self._admin.port,
            model=self.model.name,
            context_window=self.model.context_window,
        )
        return Ports(self._public.port, self._admin.port)

    async def stop(self, grace: float = 5.0, refuse_s: float = 0.0) -> None:
        """Drain: stop taking requests, fail queued ones (and those waiting for prefill room),
        give running ones ``grace`` seconds (answers still being written to their clients
        included), then fail the rest; every request releases what it holds before the listeners
        close.

        The listeners close no sooner than ``refuse_s`` after draining began (serve passes
        control_plane.shutdown_refuse_s), however soon the running requests end: meanwhile new
        requests reach the handler and fail UNAVAILABLE, reason SHUTTING_DOWN (retry
        elsewhere). Closing them at once has grpc cancel the calls it has accepted but not yet
        handed to a handler (CANCELLED, no ErrorInfo: grpc/grpc#41785, whatever the grace of
        ``server.stop``), and a load balancer still sends new connections for a moment after
        health goes NOT_SERVING.

        Returns within ``max(grace, refuse_s) + STOP_TAIL_S`` whatever hangs (a node that does
        not answer a Release, a broker that does not answer): the chart's pod grace period is
        sized from that bound, and a pod killed mid-stop fails its requests with no status.
        """
        loop = asyncio.get_running_loop()
        close_at = loop.time() + refuse_s
        self.deps.draining = True
        servers = [s for s in (self._public, self._admin) if s is not None]
        for server in servers:  # load balancers drain first
            for name in ["", *server.service_names]:
                await server.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._interrupt_queued("the control plane is shutting down")
        # Requests waiting for prefill room (PREFILLING, holding decode pages) are not among
        # those: woken, they see the drain (pipeline's _check_serving) and end SHUTTING_DOWN now,
        # not at their next poll, up to a heartbeat interval later.
        self.queue.notify()
        # The grace covers a request until its answer is written, not only until its pipeline
        # ends: a finished answer its client is still reading has no task left, and was cut at
        # once (below) however long the grace.
        await self.generation.settle(grace)
        for run in self.table:  # whatever is still running after the grace period
            run.interrupt(Unavailable("the control plane is shutting down", reason=SHUTTING_DOWN))
        # The interrupted requests' answers and releases, and the early releases still on their
        # way, share one wait: each Release is bounded by RELEASE_TIMEOUT_S, fewer seconds.
        ending = set(self.generation.tasks) | set(self.deps.background)
        if ending:
            await asyncio.wait(ending, timeout=STOP_INTERRUPTED_S)
        if (left := close_at - loop.time()) > 0:
            log.info("refusing new requests before closing the listeners", seconds=round(left, 3))
            await asyncio.sleep(left)
        # Requests refused in the window may still be answering: they end within the grace.
        await asyncio.gather(*(server.stop(grace=STOP_LISTENERS_S) for server in servers))
        if self._limit_timer is not None:
            self._limit_timer.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.clients.close()
        if self.bus is not None:
            await self.bus.stop(flush_timeout=STOP_FLUSH_S)
        self.tenants.close()
        log.info("control plane stopped")

    # -- model access and nodes --------------------------------------------------------------------

    def set_access(self, online: bool, reason: str) -> None:
        """The operator's switch; going offline fails queued requests at once.

        Saved in the state database before it returns (before the admin RPC answers), so a
        restart keeps it. Raises KvfenceError when it could not be saved: going offline then
        still holds in this process (a kill switch must work when the disk does not), going
        online does not happen (a restart would take the model offline again).
        """
        access = self.access
        # Said again (a new reason), the switch keeps the time it was first thrown.
        since = access.since if online == access.online and access.since else utc_now()
        effective = "" if online else (reason or "taken offline by an operator")
        if not online:
            # online last: a scrape (another thread) that sees it offline reads its time too.
            access.since, access.reason, access.online = since, effective, False
        unsaved: KvfenceError | None = None
        try:
            self.tenants.save_model_access(self.model.name, online, effective, since)
        except KvfenceError as err:
            log.error(
                "model access not saved", model=self.model.name, online=online, error=str(err)
            )
            if online:
                raise KvfenceError(
                    f"model {self.model.name}: the switch was not changed, as it could not be "
                    f"saved: {err.message}",
                    reason=err.reason,
                ) from None
            unsaved = err
        if online:
            access.online, access.reason, access.since = True, "", since
        log.warning("model access changed", model=self.model.name, online=online, reason=reason)
        self._emit_access(reason)
        if not online:
            self._interrupt_queued(
                f"model {self.model.name} is offline: {self.access.reason}", "MODEL_OFFLINE"
            )
        self.queue.notify()
        if unsaved is not None:
            raise KvfenceError(
                f"model {self.model.name} is offline, but only until this control plane stops: "
                f"{unsaved.message}",
                reason=unsaved.reason,
            )

    def _emit_access(self, reason: str) -> None:
        self.events.emit(
            "model_access",
            model=self.model.name,
            online=self.access.online,
            reason=reason,
            since=self.access.since,
        )

    def _saved_access(self) -> ModelAccess:
        """The switch as the last control plane on this state directory left it. Switches are
        saved by model name: one saved for another model (the directory served it before) is
        not this model's, and is left for that model."""
        access = ModelAccess()
        for saved in self.tenants.model_access():
            if saved.model == self.model.name:
                access = ModelAccess(saved.online, saved.reason, saved.since)
            elif not saved.online:
                log.warning(
                    "ignoring the kill switch saved for another model",
                    model=self.model.name,
                    switched_model=saved.model,
                    reason=saved.reason,
                    since=saved.since,
                )
        if not access.online:
            log.warning(
                "model offline since before this start: the kill switch stays on until "
                "`kvfence model online`",
                model=self.model.name,
                reason=access.reason,
                since=access.since,
            )
        return access

    def _interrupt_queued(self, message: str, reason: str = SHUTTING_DOWN) -> None:
        for run in self.table.in_state(RequestState.RECEIVED, RequestState.ADMITTED):
            run.interrupt(Unavailable(message, reason=reason))

    def list_models(self) -> client_pb2.ListModelsResponse:
        return client_pb2.ListModelsResponse(
            models=[
                client_pb2.ModelInfo(
                    name=self.model.name,
                    context_window=self.model.context_window,
                    admissible_limit=self.registry.admissible_limit(),
                    online=self.access.online,
                    fingerprint=self.model.fingerprint,
                    page_size=self.model.page_size,
                )
            ]
        )

    def _nodes_taking_requests(self, role: str) -> float:
        # kvfence_nodes{role}, read at each scrape: the nodes a new request can be sent to, from
        # registration until draining or lost. KvfenceNoNodes fires at zero of a role; draining
        # nodes used to count, and kept it quiet while every node of a role drained.
        return float(len(self.registry.taking_requests(role)))

    def _publish_limit(self) -> None:
        # The admissible limit (a node with a smaller pool lowers it for every request: an alert
        # fires when it drops), set on every join and loss; exported only while every role has a
        # node registered, and from node_timeout_s after start. Until then the figure (the
        # context window, or the pools of the nodes that registered first) is none that requests
        # get: a control plane starting before its nodes re-register, or one that lost them all,
        # showed a rise, and the alert read their return to the real limit as a drop, for an
        # hour. Every live node has registered again within node_timeout_s of a restart.
        limit = self.registry.admissible_limit()
        settled = time.monotonic() >= self._limit_settles_at
        if settled and all(self.registry.nodes(role) for role in ROLES):
            self.metrics.admissible_limit.labels(model=self.model.name).set(limit)
        else:
            self.metrics.admissible_limit.clear()
        if limit < self.model.context_window:
            # Expected with model.clamp_context; a surprise (and a drop for tenants) without it.
            say = log.info if self.cfg.model.clamp_context else log.warning
            say(
                "admissible limit below the context window",
                admissible_limit=limit,
                context_window=self.model.context_window,
                smallest_pools={
                    n.node_id: n.pool_tokens
                    for n in self.registry.nodes()
                    if n.pool_tokens == limit
                },
            )

    def _node_joined(self, node: Node) -> None:
        self._publish_limit()
        self.events.emit(
            "node_joined", node=node.node_id, role=node.role, pool_tokens=node.pool_tokens
        )

    def _node_refused(self, req: control_pb2.RegisterRequest, reason: str) -> None:
        # Not one of the lifecycle kinds: a refused node never joined, and operators want to see it.
        self.events.emit("node_refused", node=req.node_id, role=req.role, reason=reason)

    def _node_lost(self, node: Node) -> None:
        self._publish_limit()
        failed = 0
        for run in self.table.using_node(node.node_id):
            rec = run.record
            if rec.state in (RequestState.RECEIVED, RequestState.ADMITTED):
                # Its Reserve is in flight there, and nothing is reserved for it anywhere: the
                # channel's close below cuts the call, and the request tries the next node.
                continue
            # The node's id is internal topology: the node_lost event (below) names it, with
            # how many requests failed with it; the client hears the role only.
            failed += run.interrupt(
                Unavailable(
                    client_message(node.role, grpc.StatusCode.UNAVAILABLE, "NODE_LOST"),
                    reason="NODE_LOST",
                )
            )
        self.clients.forget(node.node_id)
        self.events.emit("node_lost", node=node.node_id, role=node.role, failed_requests=failed)
        self.queue.notify()

    # -- test hooks --------------------------------------------------------------------------------

    @property
    def node_rpc_counts(self) -> dict[tuple[str, str], int]:
        """RPCs this control plane sent to nodes, by (node_id, method)."""
        return dict(self.clients.rpc_counts)

    def node_rpcs(self, method: str | None = None) -> int:
        return self.clients.total(method)


async def serve(cfg: ClusterConfig, stop_event: asyncio.Event, **kwargs: Any) -> None:
    """Run the control plane until ``stop_event`` is set, then shut down gracefully.

    The metrics endpoint (node.metrics_port) is bound before the listeners start: a port that
    cannot be bound fails the start (BindError naming the address and the setting) with nothing
    started, no listener left serving and nothing published to the broker, and the state
    directory let go of. A listener that cannot start stops the metrics endpoint again.
    """
    cp = ControlPlane(cfg, **kwargs)
    if cfg.node.metrics_port is not None:
        try:
            metrics_port = cp.metrics.serve(cfg.node.metrics_port, cfg.node.metrics_host)
        except BaseException:
            cp.tenants.close()  # as start() does when it fails: another process may take it
            raise
        log.info("metrics served", port=metrics_port)
    try:
        await cp.start()
    except BaseException:
        cp.metrics.stop()
        raise
    try:
        await stop_event.wait()
    finally:
        await cp.stop(cfg.control_plane.shutdown_grace_s, cfg.control_plane.shutdown_refuse_s)
        cp.metrics.stop()
