"""Process entry points for prefill and decode nodes: ``kvfence serve prefill|decode``.

With ``tls.internal_*`` set, a node's gRPC server requires client certificates signed by the
internal CA (mutual TLS: only the control plane calls nodes), and the node reaches the control
plane's registry over TLS trusting the internal CA (sign the public certificate with it): a config
with ``tls.internal_*`` but no ``tls.public_*`` is refused, since the node token would go to the
registry in clear.

Whatever the TLS settings, every Prefill / Decode RPC must carry the cluster node token
(``control_plane.node_token_file``, else ``<state_dir>/node_token``, created there if this node
starts before the control plane; ``kvfence.auth``), the same token the node registers with: only
the control plane holds it. Health and reflection need none (Kubernetes probes).

One token per process: the token read at start is both what the node registers and heartbeats
with and what its RPCs require, however the file changes later (``kvfence.node``): a rotated
token takes a restart. A control plane that refuses the node while it runs (a heartbeat refused
UNAUTHENTICATED: it restarted on another token; a re-registration refused: another model or
release) is as fatal as a refusal at start: the node drains and stops as on SIGTERM, then
``serve_node`` raises ``RegistrationRefused`` and ``kvfence serve`` exits 1, so the pod restarts.

Start-up order: read the token and the TLS credentials (a bad TLS setting fails here, before
anything starts), load the model and pool, start the metrics endpoint, the UCX listener (decode) and
the gRPC server (health, reflection), register with the control plane, then connect the event bus
and publish the node's retained status (``kvfence/v1/<cluster>/nodes/<node_id>``: online, role,
addresses). A node that fails to start (its port taken, registration refused) stops whatever it
had started and never reaches the broker, so it cannot overwrite the status of a node that runs
under the same id; events emitted before the bus connects wait in its buffer. SIGTERM during
start-up (``serve_node``; e.g. while registration is retried, the control plane not up yet)
cancels it: what had started is stopped, the node does not register, and the process exits 0.
Shutdown (SIGTERM/SIGINT: ``serve_node``) drains first (``RunningNode.drain``): the node refuses
new Reserve (decode) / Prefill (prefill) calls with UNAVAILABLE, reason ``NODE_DRAINING`` (it took
nothing, so the control plane tries another node), heartbeats ``draining`` at once and on (the
control plane routes no new request to it, and keeps it registered, its requests running), and
goes on serving Decode, Release and the KV transfers of what it already holds, until it holds
nothing (decode: no reservation, so no stream either; prefill: no call in flight and no source
pages awaiting their transfer or Release) or ``node.drain_timeout_s`` passes. A drain that times
out first ends the calls the node still runs, UNAVAILABLE with reason ``NODE_DRAINING`` (the
servicer's ``end_in_flight``: decode's Decode streams; prefill's Prefill calls, CANCELLED with that
reason once their KV send began, prefill_svc/service.py says why), rather than leave them to be cut
by the stop, which reached the control plane as NODE_UNREACHABLE. Then the plain stop
(``RunningNode.stop``): heartbeats end (the control plane drops the node after
``node_timeout_s``; with nothing left on it, nothing fails), health NOT_SERVING, stop accepting,
give in-flight RPCs a short grace (``STOP_GRACE_S``: the drain already waited; what still runs
fails, as without a drain), release every page, stop the engine thread, then publish the offline
status (the broker publishes it too, as the connection's will, if the process dies). Every step
runs even if an earlier one fails (each failure is logged; the first is raised at the end), so a
failed step cannot leave the port served or the engine thread running.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvfence import logging as kvlog
from kvfence.auth import load_node_token
from kvfence.config import ClusterConfig, Role
from kvfence.errors import NODE_DRAINING, Unavailable
from kvfence.events import EventBus
from kvfence.metrics import Metrics
from kvfence.node import NodeAgent, NodeRuntime, RegistrationRefused, model_dir
from kvfence.proto.kvfence.v1 import control_pb2, decode_pb2_grpc, prefill_pb2_grpc
from kvfence.server import GrpcServer, host_of
from kvfence.tls import internal_server_credentials, registry_channel_credentials

log = kvlog.get_logger("node")

# What in-flight RPCs get once a stopping node's listener closes: short, since the drain before
# it already waited for them (node.drain_timeout_s).
STOP_GRACE_S = 1.0
DRAIN_POLL_S = 0.05
# How long the event bus may take to deliver what is left at stop (its disconnect from a broker
# that does not answer takes up to events.PUBLISH_TIMEOUT_S + 1 more).
STOP_FLUSH_S = 1.0
# What stop() may take beyond node.drain_timeout_s: the listener's close (STOP_GRACE_S), the engine
# thread's current pass, decode's receiver connections (transfer.HANDLERS_STOP_S and half a second)
# or prefill's sends a timed-out drain ended (prefill_svc WINDING_STOP_S), the bus (STOP_FLUSH_S and
# its disconnect). The chart's default terminationGracePeriodSeconds is drainTimeoutS plus this; a
# pod killed mid-stop is not drained cleanly (its status goes offline by the broker's will, its
# requests fail NODE_LOST).
STOP_TAIL_S = 15.0

T = TypeVar("T")


@dataclass
class RunningNode:
    """A started node; ``stop()`` shuts it down gracefully."""

    rt: NodeRuntime
    server: GrpcServer
    servicer: Any
    agent: NodeAgent | None
    bus: EventBus
    metrics: Metrics
    receiver: Any = None
    node_token: str = ""  # what its RPCs require (tests call the node with it)
    # Why the control plane refused this node while it ran ("" while it has not; module
    # docstring): serve_node then stops it, and fails.
    refusal: str = ""
    _refused: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def draining(self) -> bool:
        return bool(self.servicer.draining)

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking new work and wait until the node holds none, ``timeout_s`` at most (module
        docstring); True when it emptied. The node keeps serving what it holds meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.servicer.draining = True  # new Reserve / Prefill calls are refused from now on
        log.info(
            "node draining",
            node_id=self.rt.node_id,
            timeout_s=timeout_s,
            **self.servicer.held_counts(),
        )
        if self.agent is not None:
            await self.agent.heartbeat()  # draining=true reaches the control plane at once
        while self.servicer.busy():
            if loop.time() >= deadline:
                log.warning(
                    "drain timed out; stopping with work still held",
                    node_id=self.rt.node_id,
                    timeout_s=timeout_s,
                    **self.servicer.held_counts(),
                )
                # What the node still runs (decode: its Decode streams; prefill: its Prefill
                # calls) ends now, saying why. Left to the server's stop below, it was cut, and
                # reached the control plane as a lost connection (NODE_UNREACHABLE, "became
                # unreachable"), though the node had stopped on purpose.
                self.servicer.end_in_flight(
                    Unavailable(
                        f"the node stopped before this request finished: its drain timed "
                        f"out after {timeout_s:g} s",
                        reason=NODE_DRAINING,
                    )
                )
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("node drained", node_id=self.rt.node_id)
        return True

    def refuse(self, reason: str) -> None:
        """The control plane refused this node while it ran (``NodeAgent.on_refused``)."""
        if not self.refusal:
            self.refusal = reason
        self._refused.set()

    async def run_until(self, stop: asyncio.Event) -> str:
        """Wait until ``stop`` is set or the control plane refuses this node; the refusal's
        reason, or "" when ``stop`` came first."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._refused.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return "" if stop.is_set() else self.refusal

    async def stop(self, grace: float = STOP_GRACE_S, *, drain_timeout_s: float = 0.0) -> None:
        """Shut down; with ``drain_timeout_s`` > 0, drain first (``drain``). ``grace`` is what
        in-flight RPCs get once the listener stops accepting. Every step runs, whatever an
        earlier one raised: each failure is logged, and the first raised once all have run."""
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if drain_timeout_s > 0:
            steps.append(("drain", lambda: self.drain(drain_timeout_s)))
        if self.agent is not None:
            steps.append(("heartbeats", self.agent.stop))
        steps.append(("grpc server", lambda: self.server.stop(grace)))
        steps.append(("servicer", self.servicer.close))
        if self.receiver is not None:
            steps.append(("ucx receiver", self.receiver.stop))
        steps.append(("metrics", _async(self.metrics.stop)))
        steps.append(("event bus", lambda: self.bus.stop(flush_timeout=STOP_FLUSH_S)))
        first: Exception | None = None
        for name, step in steps:
            try:
                await step()
            except Exception as err:
                log.exception("node stop step failed", node_id=self.rt.node_id, step=name)
                first = first or err
        if first is not None:
            raise first


def _async(fn: Callable[[], object]) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        fn()

    return call


def _control_plane_address(cfg: ClusterConfig) -> str:
    return cfg.control_plane.address or cfg.control_plane.listen


async def start_node(cfg: ClusterConfig, role: Role, *, register: bool = True) -> RunningNode:
    """Build and start a prefill or decode node in this event loop."""
    if role not in (Role.PREFILL, Role.DECODE):
        raise ValueError(f"not a node role: {role}")
    loop = asyncio.get_running_loop()
    cp = cfg.control_plane
    node_token = load_node_token(cp.node_token_file, cp.state_dir)
    # Before anything starts: a TLS setting that fails (TlsError) leaves nothing running.
    server_credentials = internal_server_credentials(cfg.tls)
    channel_credentials = registry_channel_credentials(cfg.tls) if register else None
    rt = await loop.run_in_executor(None, NodeRuntime.build, cfg, role)
    metrics = Metrics(role.value)
    # At 0 from the start, as on the control plane (an alert's increase() sees the first stall).
    stalled = metrics.stalled_seconds_total.labels(model=cfg.model.name)
    bus = EventBus.from_config(cfg, rt.node_id, metrics=metrics)
    # Whatever starts below is stopped, in reverse, if a later step fails or start-up is
    # cancelled (SIGTERM during it: serve_node); on success the RunningNode owns it all.
    async with contextlib.AsyncExitStack() as started:
        if cfg.node.metrics_port is not None:
            started.callback(metrics.stop)
            # the port actually bound, which is how port 0 (any free port) can be found
            port = metrics.serve(cfg.node.metrics_port, cfg.node.metrics_host)
            log.info("metrics served", port=port)
        receiver = None
        if role == Role.DECODE:
            from decode_svc.service import DecodeServicer
            from kvfence.tokenizer import load_tokenizer
            from kvfence.transfer import KvReceiver, bind_host_of

            rejected = metrics.transfer_connections_rejected_total
            receiver = KvReceiver(
                rt.pool,
                # its reservation ids name this node: only an id of this node's previous process
                # is NODE_RESTARTED, one of another (live) node stays an integrity violation
                node_id=rt.node_id,
                host=cfg.node.ucx_host,
                port=cfg.node.ucx_port,
                max_batch_bytes=cfg.transfer.max_batch_bytes,
                batch_timeout_s=cfg.transfer.batch_timeout_s,
                report=lambda kind, payload: servicer.report_transfer(kind, payload),
                # the interface the gRPC server binds (ucxx cannot bind to it: it warns at start)
                bind_host=bind_host_of(cfg.node.listen),
                max_unverified=cfg.transfer.max_unverified_connections,
                on_reject=lambda reason: rejected.labels(reason=reason).inc(),
            )
            servicer: Any = DecodeServicer(
                cfg, rt, bus, metrics, receiver, load_tokenizer(model_dir(cfg)), node_token
            )
            registrar: Any = decode_pb2_grpc.add_DecodeServicer_to_server
            service_name = "kvfence.v1.Decode"
        else:
            from prefill_svc.service import PrefillServicer

            servicer = PrefillServicer(cfg, rt, bus, metrics, node_token)
            registrar = prefill_pb2_grpc.add_PrefillServicer_to_server
            service_name = "kvfence.v1.Prefill"
        if receiver is not None:
            started.push_async_callback(receiver.stop)
            await receiver.start()
        # Unwound after the gRPC server's stop, as in RunningNode.stop (close is safe unstarted).
        started.push_async_callback(servicer.close)
        server = await _start_then_keep(
            started,
            GrpcServer.start(
                cfg.node.listen,
                [(registrar, servicer)],
                [service_name],
                credentials=server_credentials,
            ),
            lambda s: s.stop(0),
        )
        servicer.start()
        node = RunningNode(rt, server, servicer, None, bus, metrics, receiver, node_token)
        grpc_address = cfg.node.advertise or f"{host_of(cfg.node.listen)}:{server.port}"
        ucx_address = receiver.address if receiver is not None else ""
        instance_id = uuid.uuid4().hex
        if register:
            request = control_pb2.RegisterRequest(
                node_id=rt.node_id,
                role=role.value,
                grpc_address=grpc_address,
                ucx_address=ucx_address,
                model_fingerprint=rt.fingerprint,
                text_fingerprint=rt.text_fingerprint,
                layout=rt.layout,
                pool_tokens=rt.pool.pool_tokens,
                total_pages=rt.pool.num_pages,
                instance_id=instance_id,
            )

            def load() -> control_pb2.HeartbeatRequest:
                s = rt.pool.stats()
                return control_pb2.HeartbeatRequest(
                    node_id=rt.node_id,
                    free_pages=s.free,
                    quarantined_pages=s.quarantined,
                    queue_length=getattr(servicer, "queue_length", 0),
                    draining=servicer.draining,
                    instance_id=instance_id,
                )

            agent = NodeAgent(
                _control_plane_address(cfg),
                request,
                load,
                cfg.control_plane.heartbeat_interval_s,
                credentials=channel_credentials,
                on_forgotten=servicer.release_all,
                token=node_token,  # the one the node's own RPCs require (kvfence.node)
                on_refused=node.refuse,
                on_stall=stalled.inc,
            )
            started.push_async_callback(agent.stop)
            await agent.register()
            agent.start_heartbeats()
            node.agent = agent
        started.pop_all()  # started: the node's stop() owns it all now
    await bus.start()
    bus.publish_node_status(
        {
            "role": role.value,
            "grpc_address": grpc_address,
            "ucx_address": ucx_address,
            "instance_id": instance_id,
            "model_fingerprint": rt.fingerprint,
            "total_pages": rt.pool.num_pages,
            "pool_tokens": rt.pool.pool_tokens,
        }
    )
    log.info("node ready", role=role.value, node_id=rt.node_id, address=grpc_address)
    return node


async def _start_then_keep(
    started: contextlib.AsyncExitStack,
    start: Awaitable[T],
    stop: Callable[[T], Awaitable[object]],
) -> T:
    """Await ``start`` and push ``stop`` of what it returns onto ``started``. A cancel that comes
    meanwhile (SIGTERM during start-up) lets ``start`` finish first, so that what it started is
    stopped with the rest instead of left running, and is then raised."""
    task = asyncio.ensure_future(start)
    try:
        result = await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            started.push_async_callback(stop, await task)
        raise
    started.push_async_callback(stop, result)
    return result


async def serve_node(cfg: ClusterConfig, role: Role, stop: asyncio.Event) -> None:
    """Run a node until ``stop`` is set, then drain it (``node.drain_timeout_s``) and stop it.
    ``stop`` set during start-up cancels the start (nothing is left running; returns). Raises
    ``RegistrationRefused`` when the control plane refused the node, at start or later (module
    docstring); a later refusal drains and stops the node first."""
    # The start is cancelled, not told to stop: a cancel also ends a wait for the model to load
    # or a Register call in flight, not only the retries between attempts.
    starting = asyncio.ensure_future(start_node(cfg, role))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not starting.done():
            # SIGTERM before the node started (e.g. while registration is retried): it must
            # not join a cluster it is leaving, nor hold the process for the registration
            # timeout. start_node stops what it started as it unwinds.
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("stopped during start-up", role=role.value)
    if starting.cancelled():
        return
    node = starting.result()  # a failed start (refused, port taken) raises here
    refusal = ""
    try:
        if not stop.is_set():
            refusal = await node.run_until(stop)
    finally:
        try:
            await node.stop(drain_timeout_s=cfg.node.drain_timeout_s)
        except Exception:  # the process exits anyway; an operator should see why it was unclean
            log.exception("node stop failed")
    if refusal:
        raise RegistrationRefused(refusal)
