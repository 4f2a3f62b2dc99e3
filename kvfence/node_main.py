"""Process entry points for prefill and decode nodes: ``kvfence serve prefill|decode``.

With ``tls.internal_*`` set, a node's gRPC server requires client certificates signed by the
internal CA (mutual TLS: only the control plane calls nodes), and the node reaches the control
plane's registry over TLS trusting the internal CA (sign the public certificate with it, or serve
the public endpoint without TLS inside the cluster).

Whatever the TLS settings, every Prefill / Decode RPC must carry the cluster node token
(``control_plane.node_token_file``, else ``<state_dir>/node_token``, created there if this node
starts before the control plane; ``kvfence.auth``), the same token the node registers with: only
the control plane holds it. Health and reflection need none (Kubernetes probes).

Start-up order: load the model and pool, start the metrics endpoint, the UCX listener (decode) and
the gRPC server (health, reflection), register with the control plane, then connect the event bus
and publish the node's retained status (``kvfence/v1/<cluster>/nodes/<node_id>``: online, role,
addresses). A node that fails to start (its port taken, registration refused) never reaches the
broker, so it cannot overwrite the status of a node that runs under the same id; events emitted
before the bus connects wait in its buffer.
Shutdown (SIGTERM/SIGINT: ``serve_node``) drains first (``RunningNode.drain``): the node refuses
new Reserve (decode) / Prefill (prefill) calls with UNAVAILABLE, reason ``NODE_DRAINING`` (it took
nothing, so the control plane tries another node), heartbeats ``draining`` at once and on (the
control plane routes no new request to it, and keeps it registered, its requests running), and
goes on serving Decode, Release and the KV transfers of what it already holds, until it holds
nothing (decode: no reservation, so no stream either; prefill: no call in flight and no source
pages awaiting their transfer or Release) or ``node.drain_timeout_s`` passes. Then the plain stop
(``RunningNode.stop``): heartbeats end (the control plane drops the node after
``node_timeout_s``; with nothing left on it, nothing fails), health NOT_SERVING, stop accepting,
give in-flight RPCs a short grace (``STOP_GRACE_S``: the drain already waited; what still runs
fails, as without a drain), release every page, stop the engine thread, then publish the offline
status (the broker publishes it too, as the connection's will, if the process dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

from kvfence import logging as kvlog
from kvfence.auth import load_node_token, node_token_path
from kvfence.config import ClusterConfig, Role
from kvfence.events import EventBus
from kvfence.metrics import Metrics
from kvfence.node import NodeAgent, NodeRuntime, model_dir
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
# What stop() may take beyond node.drain_timeout_s: the listener's close (STOP_GRACE_S), the
# engine thread's current pass, the receiver's connections (transfer.HANDLERS_STOP_S and half a
# second), the bus (STOP_FLUSH_S and its disconnect). The chart's default
# terminationGracePeriodSeconds is drainTimeoutS plus this; a pod killed mid-stop is not drained
# cleanly (its status goes offline by the broker's will, its requests fail NODE_LOST).
STOP_TAIL_S = 15.0


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
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("node drained", node_id=self.rt.node_id)
        return True

    async def stop(self, grace: float = STOP_GRACE_S, *, drain_timeout_s: float = 0.0) -> None:
        """Shut down; with ``drain_timeout_s`` > 0, drain first (``drain``). ``grace`` is what
        in-flight RPCs get once the listener stops accepting."""
        if drain_timeout_s > 0:
            await self.drain(drain_timeout_s)
        if self.agent is not None:
            await self.agent.stop()
        await self.server.stop(grace)
        await self.servicer.close()
        if self.receiver is not None:
            await self.receiver.stop()
        self.metrics.stop()
        await self.bus.stop(flush_timeout=STOP_FLUSH_S)


def _control_plane_address(cfg: ClusterConfig) -> str:
    return cfg.control_plane.address or cfg.control_plane.listen


async def start_node(cfg: ClusterConfig, role: Role, *, register: bool = True) -> RunningNode:
    """Build and start a prefill or decode node in this event loop."""
    if role not in (Role.PREFILL, Role.DECODE):
        raise ValueError(f"not a node role: {role}")
    loop = asyncio.get_running_loop()
    cp = cfg.control_plane
    node_token = load_node_token(cp.node_token_file, cp.state_dir)
    rt = await loop.run_in_executor(None, NodeRuntime.build, cfg, role)
    metrics = Metrics(role.value)
    bus = EventBus.from_config(cfg, rt.node_id, metrics=metrics)
    if cfg.node.metrics_port is not None:
        # the port actually bound, which is how port 0 (any free port) can be found
        log.info("metrics served", port=metrics.serve(cfg.node.metrics_port, cfg.node.metrics_host))
    receiver = None
    if role == Role.DECODE:
        from decode_svc.service import DecodeServicer
        from kvfence.tokenizer import load_tokenizer
        from kvfence.transfer import KvReceiver, bind_host_of

        rejected = metrics.transfer_connections_rejected_total
        receiver = KvReceiver(
            rt.pool,
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
    try:
        if receiver is not None:
            await receiver.start()
        server = await GrpcServer.start(
            cfg.node.listen,
            [(registrar, servicer)],
            [service_name],
            credentials=internal_server_credentials(cfg.tls),
        )
    except BaseException:  # e.g. the port is taken (BindError): free what was started
        if receiver is not None:
            with contextlib.suppress(Exception):
                await receiver.stop()
        metrics.stop()
        raise
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

        token = node_token_path(cfg.control_plane.node_token_file, cfg.control_plane.state_dir)
        agent = NodeAgent(
            _control_plane_address(cfg),
            request,
            load,
            cfg.control_plane.heartbeat_interval_s,
            token_path=token,
            credentials=registry_channel_credentials(cfg.tls),
            on_forgotten=servicer.release_all,
        )
        try:
            await agent.register()
        except BaseException:
            await node.stop(grace=0)
            await agent.stop()
            raise
        agent.start_heartbeats()
        node.agent = agent
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


async def serve_node(cfg: ClusterConfig, role: Role, stop: asyncio.Event) -> None:
    """Run a node until ``stop`` is set, then drain it (``node.drain_timeout_s``) and stop it."""
    node = await start_node(cfg, role)
    try:
        await stop.wait()
    finally:
        try:
            await node.stop(drain_timeout_s=cfg.node.drain_timeout_s)
        except Exception:  # the process exits anyway; an operator should see why it was unclean
            log.exception("node stop failed")
