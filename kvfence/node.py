"""What prefill and decode nodes share: the loaded model on a page pool, registration, and the
node token check on their RPCs.

``NodeRuntime`` loads the checkpoint (the embedded tiny model when the config names none), sizes the
pool for the node's role and builds the engine. ``NodeAgent`` registers the node with the control
plane and heartbeats (with ``draining`` set once the node shuts down: ``kvfence.node_main``); a
refusal (fingerprint or layout mismatch) is fatal for the node.
``NodeTokenCheck`` refuses every Prefill / Decode service call that does not carry the cluster node
token (only the control plane holds it); gRPC health and reflection are other services and stay
open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvfence import PROTOCOL_VERSION, __version__
from kvfence import logging as kvlog
from kvfence.auth import bearer_metadata, read_token, token_matches
from kvfence.config import ClusterConfig, ModelShape, Role
from kvfence.errors import IntegrityError, Unauthenticated
from kvfence.kv.pool import PagePool
from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import common_pb2, control_pb2, control_pb2_grpc
from kvfence.server import CHANNEL_OPTIONS, abort, bearer_token

if TYPE_CHECKING:
    from kvfence.events import EventBus
    from kvfence.model.engine import Engine

log = kvlog.get_logger("node")


def model_dir(cfg: ClusterConfig) -> Path:
    """The checkpoint folder: the configured one, or the embedded tiny model under state_dir."""
    if cfg.model.path is not None:
        return cfg.model.path
    from kvfence.model.tiny import ensure_tiny_model

    return ensure_tiny_model(cfg.control_plane.state_dir / "models" / "tiny-llama")


def kv_layout(cfg: ClusterConfig, shape: ModelShape) -> common_pb2.KvLayout:
    """The KV layout every node of the cluster must share (manifest check 6, registration)."""
    return common_pb2.KvLayout(
        page_size=cfg.kv.page_size,
        dtype=cfg.model.dtype,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
    )


@dataclass
class NodeRuntime:
    """A node's model, pool and engine."""

    role: Role
    node_id: str
    fingerprint: str
    layout: common_pb2.KvLayout
    pool: PagePool
    engine: Engine
    loaded: object
    text_fingerprint: str = ""  # kvfence.model.loader.text_fingerprint: EOS ids and tokenizer

    @classmethod
    def build(cls, cfg: ClusterConfig, role: Role) -> NodeRuntime:
        from kvfence.model.engine import Engine
        from kvfence.model.loader import load_model

        loaded = load_model(model_dir(cfg), dtype=cfg.model.dtype)
        shape = loaded.shape
        page_bytes = cfg.page_bytes(shape)
        pages = cfg.pool_for(role).pages_for(page_bytes)
        pool = PagePool(
            pages,
            num_layers=shape.num_layers,
            page_size=cfg.kv.page_size,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=cfg.model.dtype,
            scrub_on_free=cfg.kv.scrub_on_free,
        )
        layout = kv_layout(cfg, shape)
        node_id = cfg.node.node_id or f"{role.value}-{os.getpid()}"
        engine = Engine(loaded.model, pool)
        return cls(
            role, node_id, loaded.fingerprint, layout, pool, engine, loaded, loaded.text_fingerprint
        )


# A refused node call is logged at most once per this interval (the line counts the refusals since
# the last one): whoever reaches a node's port must not set how much the node logs.
REFUSAL_LOG_INTERVAL_S = 10.0


class NodeTokenCheck:
    """Refuses a node RPC without the cluster node token: UNAUTHENTICATED, before the call
    touches anything (it is not counted as served: ``rpc_count`` and ``rpcs_total`` stay), counted
    in ``requests_total{status="UNAUTHENTICATED"}`` (every refusal) and logged without the token:
    the first refusal at once, later ones at most one line per ``interval_s``
    (``REFUSAL_LOG_INTERVAL_S``), which says how many were refused since the last line
    (``refused``) and the latest one's method, peer and reason; the rest of a burst is logged by a
    timer when the interval is over, not at the next refusal, which may never come. One
    constant-time compare per call; a ``Decode`` stream is checked once, when it opens."""

    def __init__(self, token: str, metrics: Metrics, interval_s: float = REFUSAL_LOG_INTERVAL_S):
        if not token:
            raise ValueError("a node needs the cluster node token")
        self._token = token
        self._metrics = metrics
        self._latest: dict[str, str] = {}  # the latest refusal's method, peer and reason
        self._log = kvlog.BurstLog(self._log_line, interval_s)

    async def __call__(self, context: grpc.aio.ServicerContext, method: str) -> None:
        presented = bearer_token(context)
        if token_matches(presented, self._token):
            return
        self._metrics.requests_total.labels(status="UNAUTHENTICATED").inc()
        self._latest = {
            "method": method,
            "peer": context.peer(),
            "reason": "no node token" if presented is None else "wrong node token",
        }
        self._log.note()
        await abort(context, Unauthenticated(f"{method} needs the cluster node token"))

    def flush_log(self) -> None:
        """Log the refusals since the last line, if any: the timer's job (nothing calls it at
        shutdown yet, so refusals of the last interval before a stop are counted, not logged)."""
        self._log.flush()

    def _log_line(self, refused: int) -> None:
        log.warning(
            "node rpc refused",
            refused=refused,
            next_line_after_s=self._log.interval_s,
            **self._latest,
        )


class RegistrationRefused(RuntimeError):
    """The control plane refused this node (e.g. a different model fingerprint)."""


class NodeAgent:
    """Registers a node with the control plane and keeps it alive with heartbeats."""

    def __init__(
        self,
        control_plane: str,
        register: control_pb2.RegisterRequest,
        load: Callable[[], control_pb2.HeartbeatRequest],
        interval_s: float = 1.0,
        token_path: Path | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        on_forgotten: Callable[[], None] | None = None,
    ):
        self.control_plane = control_plane
        # Every registration says which control-plane/node contract and release this node runs
        # (a control plane refuses another protocol: kvfence.PROTOCOL_VERSION).
        self.register_request = control_pb2.RegisterRequest()
        self.register_request.CopyFrom(register)
        self.register_request.protocol_version = PROTOCOL_VERSION
        self.register_request.kvfence_version = __version__
        self.load = load
        self.interval_s = interval_s
        # Another process registered with this node_id since (HeartbeatResponse.superseded).
        self.superseded = False
        self._channel = (
            grpc.aio.insecure_channel(control_plane, options=CHANNEL_OPTIONS)
            if credentials is None
            else grpc.aio.secure_channel(control_plane, credentials, options=CHANNEL_OPTIONS)
        )
        self._stub = control_pb2_grpc.NodeRegistryStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self.token_path = token_path
        # Called when the control plane no longer knows this node: it has failed every request
        # that used the node, so whatever the node still holds for them must go.
        self.on_forgotten = on_forgotten

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self.token_path is None or not self.token_path.exists():
            return ()
        return bearer_metadata(read_token(self.token_path))

    async def register(self, timeout_s: float = 30.0) -> None:
        """Register, retrying while the control plane is not up yet; raise when refused."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self.load().draining:
                # A node shutting down must not join again: registered after its replacement
                # (a retry that outlasted a control plane restart), it would supersede that one.
                raise RegistrationRefused("this node is draining: it does not register again")
            try:
                resp = await self._stub.Register(
                    self.register_request, timeout=5, metadata=self._metadata()
                )
                break
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise RegistrationRefused(
                        f"{err.details()} (wrong or missing node token)"
                    ) from None
                if asyncio.get_running_loop().time() > deadline:
                    raise RegistrationRefused(
                        f"control plane {self.control_plane} unreachable: {err.code().name}"
                    ) from None
                await asyncio.sleep(0.2)
        if not resp.accepted:
            raise RegistrationRefused(resp.reason)
        if resp.heartbeat_interval_ms:
            self.interval_s = resp.heartbeat_interval_ms / 1000
        log.info("registered", node_id=self.register_request.node_id, cp=self.control_plane)

    def start_heartbeats(self) -> None:
        self._task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.heartbeat()

    async def heartbeat(self) -> None:
        """One heartbeat with the node's load (``load()``), its draining flag included; failures
        are logged. Called by the heartbeat loop, and at once when the node starts draining, so
        the control plane stops routing to it without waiting for the next beat."""
        req = self.load()
        try:
            resp = await self._stub.Heartbeat(
                req, timeout=max(self.interval_s, 1.0), metadata=self._metadata()
            )
            if resp.superseded:
                # Another process registered with this node_id: it is this node now. Joining
                # again would make the control plane drop that one, and so on, turn by turn. The
                # heartbeats go on: once that process has gone (answered unknown, not
                # superseded), this one, unless draining, registers again.
                if not self.superseded:
                    self.superseded = True
                    if self.on_forgotten is not None:
                        self.on_forgotten()
                    log.error(
                        "another process registered as this node; this one takes no work while "
                        "that one is registered: stop one of them",
                        node_id=self.register_request.node_id,
                        draining=req.draining,
                    )
                return
            self.superseded = False
            if not resp.known:
                if self.on_forgotten is not None:
                    self.on_forgotten()
                if req.draining:
                    # Shutting down: it holds nothing now, and must not join again.
                    log.warning("control plane forgot this draining node; released everything")
                    return
                log.warning("control plane forgot this node; releasing and re-registering")
                await self.register()
        except RegistrationRefused as err:
            log.error("re-registration refused", reason=str(err))
        except grpc.aio.AioRpcError as err:
            log.warning("heartbeat failed", code=err.code().name, draining=req.draining)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close(None)


def report_integrity(
    metrics: Metrics,
    bus: EventBus,
    logger: Any,
    err: IntegrityError,
    stage: str,
    request_id: str,
    tenant_id: str,
) -> None:
    """A check this node made failed: counted here, where it ran (the control plane counts only
    its own), an ``integrity_violation`` event and an error line on the node's ``logger``."""
    metrics.integrity_failures_total.labels(check=err.reason).inc()
    bus.emit(
        "integrity_violation",
        check=err.reason,
        stage=stage,
        request_id=request_id,
        tenant_id=tenant_id,
    )
    logger.error("integrity check failed", check=err.reason, stage=stage, detail=err.message)


def sampling_from_proto(p: common_pb2.SamplingParams) -> object:
    """The engine's SamplingParams from the wire message (ValueError on bad values)."""
    from kvfence.model.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=p.max_new_tokens or 1,
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )
