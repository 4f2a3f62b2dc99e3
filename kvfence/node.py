"""What prefill and decode nodes share: the loaded model on a page pool, registration, and the
node token check on their RPCs.

``NodeRuntime`` loads the checkpoint (the embedded tiny model when the config names none), sizes the
pool for the node's role and builds the engine. ``NodeAgent`` registers the node with the control
plane and heartbeats (with ``draining`` set once the node shuts down: ``kvfence.node_main``); a
refusal (fingerprint, protocol or layout mismatch, the wrong node token) is fatal for the node,
at start and later alike: a heartbeat refused UNAUTHENTICATED, or a re-registration refused after
the control plane forgot the node, ends the heartbeats and calls ``on_refused`` (the node drains,
stops and exits non-zero: ``kvfence.node_main.serve_node``).

One node token per process: the one read at start is what the node presents to the control plane
and what it requires of the control plane's calls. A rotated token therefore takes a restart of
the node (and the control plane): a node that kept registering with a new token while refusing
the calls that carry it would stay registered and SERVING and fail every request sent to it;
instead its heartbeat is refused UNAUTHENTICATED by a control plane restarted on the new token,
which is fatal, and the pod restarts on the new one.
``NodeTokenCheck`` refuses every Prefill / Decode service call that does not carry the cluster node
token (only the control plane holds it); gRPC health and reflection are other services and stay
open.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvfence import PROTOCOL_VERSION, __version__
from kvfence import logging as kvlog
from kvfence.auth import bearer_metadata, read_token, token_matches
from kvfence.config import NAME_CHARS, ClusterConfig, Role
from kvfence.errors import IntegrityError, Unauthenticated
from kvfence.kv.pool import PagePool
from kvfence.metrics import Metrics

# Torch-free (the control plane resolves the same folder and layout); still importable from here.
from kvfence.model.served import kv_layout as kv_layout
from kvfence.model.served import model_dir as model_dir
from kvfence.proto.kvfence.v1 import common_pb2, control_pb2, control_pb2_grpc
from kvfence.server import CHANNEL_OPTIONS, abort, bearer_token

if TYPE_CHECKING:
    from kvfence.events import EventBus
    from kvfence.model.engine import Engine

log = kvlog.get_logger("node")


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
        node_id = cfg.node.node_id or default_node_id(role)
        engine = Engine(loaded.model, pool)
        return cls(
            role, node_id, loaded.fingerprint, layout, pool, engine, loaded, loaded.text_fingerprint
        )


def default_node_id(role: Role) -> str:
    """The id of a node whose config names none: ``<role>-<host>-<pid>``. The pid alone is not
    enough: in containers every node is pid 1, and two nodes with one id supersede each other
    (the control plane routes to the last one registered, the other takes no work), so two
    containers of a role would serve as one. The host name (the container's, in Docker or a
    pod) tells them apart; characters a node id may not hold (it is a level of the node's MQTT
    topics) become ``_``."""
    host = re.sub(rf"[^{NAME_CHARS}]", "_", socket.gethostname()) or "host"
    return f"{role.value}-{host}-{os.getpid()}"


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
    """The control plane refused this node (e.g. a different model fingerprint, the wrong node
    token), or, as ``RegistrationAbandoned``, the node gave up registering."""


class RegistrationAbandoned(RegistrationRefused):
    """Registration given up without a refusal: the control plane stayed unreachable, or the node
    started draining. Fatal at start (the node never joined); a running node's heartbeats go on."""


# A heartbeat that raised something unexpected (its load, a callback) is logged with its
# traceback, at most once per this interval if it repeats every beat: the beats go on regardless.
HEARTBEAT_ERROR_LOG_INTERVAL_S = 10.0
# The heartbeat RPC's timeout is the interval, but never under this: a busy control plane answers
# late, and a beat given up before it is read never counts (grpc-aio drops the call unread), so a
# shorter bound (half the interval, tried once) dropped healthy nodes from a loaded control plane.
MIN_HEARTBEAT_TIMEOUT_S = 1.0
# gRPC's reconnect backoff grows to 120 s by default: after a long control plane outage a node
# would register again up to two minutes after it is back, while the registry counts on every node
# registering within a heartbeat or so (control_plane.no_node_wait_s). Capped at the heartbeat
# interval (a second at least, so an unreachable control plane is not dialled in a tight loop).
MIN_RECONNECT_CAP_S = 1.0
INITIAL_RECONNECT_BACKOFF_MS = 200


def reconnect_options(interval_s: float) -> list[tuple[str, int]]:
    """Channel options that keep the agent's reconnect attempts within ``max(interval_s, 1 s)`` of
    each other (gRPC's backoff would grow to 120 s), and give up an attempt that gets no answer at
    all (an address whose packets are dropped) after as long, instead of gRPC's 20 s."""
    cap_ms = int(max(interval_s, MIN_RECONNECT_CAP_S) * 1000)
    return [
        ("grpc.initial_reconnect_backoff_ms", min(INITIAL_RECONNECT_BACKOFF_MS, cap_ms)),
        ("grpc.max_reconnect_backoff_ms", cap_ms),
        ("grpc.min_reconnect_backoff_ms", cap_ms),
    ]


class NodeAgent:
    """Registers a node with the control plane and keeps it alive with heartbeats.

    Heartbeats go on a fixed cadence, one every ``interval_s`` from the start of the last, each
    RPC bounded by ``beat_timeout_s`` (the interval, 1 s at least: a loaded control plane answers
    late, and a beat given up before it was read never counts); a beat without an answer is
    followed by the next one at once when it took that long, half an interval after it when it
    failed fast (the control plane down). So one lost beat leaves the control plane without news
    for about ``interval_s + beat_timeout_s``: 2 s at the default 1 s interval, within the default
    ``node_timeout_s`` of 5 s; a node timeout at its minimum (2 intervals, ``kvfence.config``) is
    not enough for that. (The cadence was once "a full interval after the last beat ended", which
    added a third interval.)

    The token is the one the process read at start (``token``; or ``token_path``, read once here):
    see the module docstring. ``on_refused(reason)`` is called once when the control plane refuses
    this node at runtime (its heartbeat UNAUTHENTICATED, a re-registration refused); the heartbeats
    end then. Anything else a heartbeat raises is logged and the beats go on."""

    def __init__(
        self,
        control_plane: str,
        register: control_pb2.RegisterRequest,
        load: Callable[[], control_pb2.HeartbeatRequest],
        interval_s: float = 1.0,
        token_path: Path | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        on_forgotten: Callable[[], None] | None = None,
        *,
        token: str | None = None,
        on_refused: Callable[[str], None] | None = None,
        on_stall: Callable[[float], None] | None = None,
    ):
        self.control_plane = control_plane
        self.on_stall = on_stall  # told the seconds of each stall of the heartbeat loop
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
        options = [*CHANNEL_OPTIONS, *reconnect_options(interval_s)]
        self._channel = (
            grpc.aio.insecure_channel(control_plane, options=options)
            if credentials is None
            else grpc.aio.secure_channel(control_plane, credentials, options=options)
        )
        self._stub = control_pb2_grpc.NodeRegistryStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        if token is None and token_path is not None and token_path.exists():
            token = read_token(token_path)
        # Read once, never again (module docstring): what the node's own RPC check requires too.
        self._token_metadata = bearer_metadata(token) if token else ()
        # Called when the control plane no longer knows this node: it has failed every request
        # that used the node, so whatever the node still holds for them must go.
        self.on_forgotten = on_forgotten
        self.on_refused = on_refused
        # Why the control plane refused this node at runtime ("" while it has not): no heartbeat
        # is sent after that.
        self.refused = ""
        self._error: BaseException | None = None  # the latest unexpected heartbeat error
        self._error_log = kvlog.BurstLog(self._log_error, HEARTBEAT_ERROR_LOG_INTERVAL_S)
        # Heartbeats the control plane did not answer (it is down, restarting, unreachable), in a
        # row: logged at most once per interval, as every beat of every node would be a line (4
        # a second per node at a 0.5 s interval), and once more when one is answered again.
        self._failed = 0
        self._failed_code = ""
        self._failed_draining = False
        self._failed_log = kvlog.BurstLog(self._log_failed, HEARTBEAT_ERROR_LOG_INTERVAL_S)

    @property
    def beat_timeout_s(self) -> float:
        """A heartbeat RPC's timeout (class docstring)."""
        return max(self.interval_s, MIN_HEARTBEAT_TIMEOUT_S)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._token_metadata

    async def register(self, timeout_s: float = 30.0) -> None:
        """Register, retrying while the control plane is not up yet; raise when refused
        (``RegistrationAbandoned`` when it gave up: unreachable, or draining)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self.load().draining:
                # A node shutting down must not join again: registered after its replacement
                # (a retry that outlasted a control plane restart), it would supersede that one.
                raise RegistrationAbandoned("this node is draining: it does not register again")
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
                    raise RegistrationAbandoned(
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
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.interval_s
        while not self.refused:
            wait = max(0.0, next_at - loop.time())
            due = loop.time() + wait
            await asyncio.sleep(wait)
            sent = loop.time()
            if sent - due > self.interval_s:
                # This process stood still (CPU-throttled, descheduled, a long pause) and its
                # heartbeats with it: past the control plane's node_timeout_s, it dropped this
                # node as lost (failing its requests NODE_LOST) although it never stopped. Said
                # here, where the cause is; the next beat, answered unknown, registers it again.
                log.warning(
                    "node stalled; its heartbeats were late",
                    stalled_s=round(sent - due, 3),
                    interval_s=self.interval_s,
                )
                if self.on_stall is not None:
                    self.on_stall(sent - due)
            answered = await self.heartbeat()
            # From this beat's start, not its end; an unanswered one is tried again at once when
            # it waited out its timeout, after half an interval when it failed fast (class
            # docstring).
            next_at = sent + (self.interval_s if answered else self.interval_s / 2)

    async def heartbeat(self) -> bool:
        """``_heartbeat``; a beat answered after failed ones says so in the log."""
        answered = await self._heartbeat()
        if answered and self._failed:
            self._failed_log.flush()
            log.info("heartbeats answered again", failed_in_a_row=self._failed)
            self._failed = 0
        return answered

    async def _heartbeat(self) -> bool:
        """One heartbeat with the node's load (``load()``), its draining flag included; True when
        the control plane answered it. Never raises: failures are logged, a refusal ends the
        heartbeats (``on_refused``). Called by the heartbeat loop, and at once when the node
        starts draining, so the control plane stops routing to it without waiting for the next
        beat."""
        if self.refused:
            return False  # the control plane refused this node: nothing more to tell it
        draining = False
        try:
            req = self.load()
            draining = req.draining
            resp = await self._stub.Heartbeat(
                req, timeout=self.beat_timeout_s, metadata=self._metadata()
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
                return True
            self.superseded = False
            if not resp.known:
                if self.on_forgotten is not None:
                    self.on_forgotten()
                if req.draining:
                    # Shutting down: it holds nothing now, and must not join again.
                    log.warning("control plane forgot this draining node; released everything")
                    return True
                log.warning("control plane forgot this node; releasing and re-registering")
                await self.register()
            return True
        except RegistrationAbandoned as err:
            # Not a refusal: the next heartbeat, answered "unknown" again, retries.
            log.warning("re-registration given up", reason=str(err))
        except RegistrationRefused as err:
            # A fingerprint, protocol or layout the control plane refuses (it restarted on another
            # model or release), or its token: at start the same refusal is fatal, and it is now.
            self._refuse(str(err), "re-registration refused")
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                # The control plane holds another node token (restarted on a rotated one): this
                # process keeps the one it started with (module docstring), so it must restart.
                self._refuse(
                    f"{err.details()} (the control plane's node token differs from the one this "
                    "node started with: restart the node on the current token)",
                    "heartbeat refused",
                )
            else:
                self._failed += 1
                self._failed_code, self._failed_draining = err.code().name, draining
                self._failed_log.note()
        except Exception as err:  # its load() or a callback: must not end the heartbeats
            self._error = err
            self._error_log.note()
        return False

    def _refuse(self, reason: str, what: str) -> None:
        if self.refused:
            return
        self.refused = reason
        log.error(f"{what}: the node stops", node_id=self.register_request.node_id, reason=reason)
        if self.on_refused is not None:
            self.on_refused(reason)

    def _log_failed(self, failures: int) -> None:
        log.warning(
            "heartbeat failed",
            code=self._failed_code,
            draining=self._failed_draining,
            failures=failures,
            next_line_after_s=self._failed_log.interval_s,
        )

    def _log_error(self, errors: int) -> None:
        log.error(
            "heartbeat raised; the heartbeats go on",
            errors=errors,
            next_line_after_s=self._error_log.interval_s,
            exc_info=self._error,
        )

    async def stop(self) -> None:
        """Stop heartbeating and close the channel; never raises what the heartbeat task did (it
        is logged)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("heartbeat task had failed")
        self._error_log.flush()
        self._failed_log.flush()  # the beats left unanswered since its last line
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
