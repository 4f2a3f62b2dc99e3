"""The node registry: which prefill and decode nodes serve the model, their pools and liveness.

A node registers once (role, addresses, fingerprint, layout, pool, protocol version) and then
heartbeats. A node whose fingerprint or layout differs from the model's is refused: its KV pages
would not mean the same thing on the other side of a transfer. So is one that speaks another
control-plane/node protocol (``kvfence.PROTOCOL_VERSION``: a control plane and nodes of releases
that would misread each other, e.g. halfway through an upgrade), with both releases in the reason.
A node silent for ``node_timeout_s`` of the control plane's running time (a stall of the control
plane's own process is not counted: ``Registry.run_reaper``) is lost; the registry drops it and
tells the control plane, which fails every request that used it, but for one whose only call there
was a Reserve still in flight: that call is cut, and the request tries another node.

A node that heartbeats ``draining`` is shutting down (``kvfence.node_main``): it stays registered,
and its requests run on, but routing sends it no new one (``control_plane.routing``). Draining is
one way: a later heartbeat without the flag does not undo it (only a new registration, a new
process, does). Once drained the node stops heartbeating and is dropped as lost, with nothing on it.

The registry also remembers since when a role has had no node that takes requests (``vacant_for``):
none registered, or every registered one draining. That began when the role's last such node
started draining or left; a draining node leaving later does not restart it, since requests have
had nowhere to go since the drain. The replacement of a role's last node usually registers
seconds after the old one starts draining (its Deployment starts it as the old pod terminates),
and every node registers again within about a heartbeat interval (at least 1 s: its reconnect
backoff is capped there) and one heartbeat of a control plane's restart, so the pipeline
lets a request wait that long for one (``control_plane.no_node_wait_s``) instead of failing it
NO_NODES at once, or letting it wait out its deadline for a draining node and fail NO_CAPACITY as
if the pool were merely full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from control_plane.model_info import ModelInfo, layout_text
from kvfence import PROTOCOL_VERSION, __version__
from kvfence.auth import token_matches
from kvfence.errors import Unauthenticated
from kvfence.logging import get_logger
from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import common_pb2, control_pb2, control_pb2_grpc
from kvfence.server import abort, bearer_token

log = get_logger("registry")

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


@dataclass
class Node:
    """A registered node and its latest heartbeat."""

    node_id: str
    role: str
    grpc_address: str
    ucx_address: str
    fingerprint: str
    layout: common_pb2.KvLayout
    pool_tokens: int
    total_pages: int
    free_pages: int
    quarantined_pages: int = 0
    queue_length: int = 0
    last_heartbeat: float = 0.0
    # Heartbeats received (only Registry.heartbeat counts one; a repeated registration does
    # not): the stamp that tells whether a heartbeat reset reserved_since_heartbeat since a
    # given moment (pipeline.Pipeline._give_back).
    heartbeats: int = 0
    # Pages this control plane took on the node since the last heartbeat (decode reservations,
    # prefill prompts sent: control_plane.routing), less those it saw freed: the heartbeat's
    # free count does not know about them yet, and routing should not pick a node it has just
    # filled. Each heartbeat resets it, so an error in it lasts one heartbeat interval at most.
    reserved_since_heartbeat: int = 0
    # Prefill calls this control plane has in flight on the node (added to its queue length).
    in_flight: int = 0
    instance_id: str = ""  # the registering process's (RegisterRequest.instance_id)
    kvfence_version: str = ""  # the node's release, as registered
    # Shutting down: finishing what it holds, sent no new Reserve / Prefill (module docstring).
    draining: bool = False
    # Its calls that failed on its side in a row, and when the last did (routing.node_failed).
    failures: int = 0
    failed_at: float = 0.0
    # A prefill node that refused a Prefill for room (routing.refuse_room): left out of routing
    # until a heartbeat shows more free pages than refused_free (its refusal's count, then the
    # fewest seen), a release on it is answered, or Registry.refused_room_max_s after refused_at.
    refused_room: bool = False
    refused_free: int = 0
    refused_at: float = 0.0

    @property
    def free_estimate(self) -> int:
        # Released pages make the count negative until the next heartbeat; never above the pool.
        return min(self.total_pages, max(0, self.free_pages - self.reserved_since_heartbeat))

    @property
    def heartbeat_age_s(self) -> float:
        return time.monotonic() - self.last_heartbeat


NodeCallback = Callable[[Node], None]


class Registry:
    """Nodes by id; refuses nodes that do not match the model and detects lost ones."""

    def __init__(
        self,
        model: ModelInfo,
        heartbeat_interval_s: float,
        node_timeout_s: float,
        *,
        on_joined: NodeCallback | None = None,
        on_lost: NodeCallback | None = None,
        on_refused: Callable[[control_pb2.RegisterRequest, str], None] | None = None,
        on_capacity: Callable[[], None] | None = None,
        on_stall: Callable[[float], None] | None = None,
        failures_to_cool: int,
        failure_cooldown_s: float,
        refused_room_max_s: float,
    ):
        """``failures_to_cool``, ``failure_cooldown_s``, ``refused_room_max_s``: how routing
        leaves failing or full nodes out (``control_plane.routing``; the control_plane config keys
        of the same names). Kept here, not in module globals, so that each control plane routes by
        its own config (two in one process, as in tests, do not share them). ``on_stall``: told
        the seconds of each stall of this process the reaper excused (``run_reaper``)."""
        self.model = model
        self.heartbeat_interval_s = heartbeat_interval_s
        self.node_timeout_s = node_timeout_s
        self.failures_to_cool = failures_to_cool
        self.failure_cooldown_s = failure_cooldown_s
        self.refused_room_max_s = refused_room_max_s
        self._nodes: dict[str, Node] = {}
        # node_id -> the replaced processes (instance ids) already warned about: their heartbeats
        # go on every beat, and each is logged once. Dropped with the node (_lose), so ids that
        # come and go (every pod of a rolling update has a new one) leave nothing behind.
        self._superseded_warned: dict[str, set[str]] = {}
        # When each role last went without a node that takes requests (monotonic): its last one
        # started draining or left. A new registry has none yet.
        self._vacant_since: dict[str, float] = dict.fromkeys(ROLES, time.monotonic())
        self._on_joined = on_joined or (lambda n: None)
        self._on_lost = on_lost or (lambda n: None)
        self._on_refused = on_refused or (lambda r, why: None)
        self._on_capacity = on_capacity or (lambda: None)
        self._on_stall = on_stall or (lambda s: None)

    # -- membership --------------------------------------------------------------------------------

    def register(self, req: control_pb2.RegisterRequest) -> control_pb2.RegisterResponse:
        reason = self._refusal(req)
        if reason:
            log.warning("node refused", node_id=req.node_id, role=req.role, reason=reason)
            self._on_refused(req, reason)
            return control_pb2.RegisterResponse(accepted=False, reason=reason)
        node = Node(
            node_id=req.node_id,
            role=req.role,
            grpc_address=req.grpc_address,
            ucx_address=req.ucx_address,
            fingerprint=req.model_fingerprint,
            layout=req.layout,
            pool_tokens=req.pool_tokens,
            total_pages=req.total_pages,
            free_pages=req.total_pages,
            last_heartbeat=time.monotonic(),
            instance_id=req.instance_id,
            kvfence_version=req.kvfence_version,
        )
        previous = self._nodes.get(req.node_id)
        # Same id, new process (a new address, or a restart in place: a container restarted in
        # its pod keeps both): whatever the old one held is gone with it. A node that repeats
        # its own registration (a reply lost) is the same process and keeps its requests.
        restarted = previous is not None and (
            previous.grpc_address != node.grpc_address or previous.instance_id != node.instance_id
        )
        if restarted:
            assert previous is not None
            self._lose(previous, "registered again as a new process")
        if previous is not None and not restarted:
            # The same process: the same Node, so that requests holding it (routing compares
            # by identity: pipeline, NodeClients) still hold the registered node.
            previous.last_heartbeat = node.last_heartbeat
            node = previous
        self._nodes[node.node_id] = node
        log.info(
            "node registered",
            node_id=node.node_id,
            role=node.role,
            address=node.grpc_address,
            pool_tokens=node.pool_tokens,
            total_pages=node.total_pages,
        )
        if previous is None or restarted:
            self._on_joined(node)
        self._on_capacity()
        return control_pb2.RegisterResponse(
            accepted=True, heartbeat_interval_ms=int(self.heartbeat_interval_s * 1000)
        )

    def _refusal(self, req: control_pb2.RegisterRequest) -> str:
        model = self.model
        if req.role not in ROLES:
            return f"role {req.role!r} is not one of {', '.join(ROLES)}"
        if not req.node_id or not req.grpc_address:
            return "node_id and grpc_address are required"
        if req.protocol_version != PROTOCOL_VERSION:
            theirs = (
                f"protocol {req.protocol_version} (kvfence {req.kvfence_version or 'unknown'})"
                if req.protocol_version
                else "no protocol version (a kvfence release older than the check)"
            )
            return (
                f"the node speaks {theirs}, this control plane protocol {PROTOCOL_VERSION} "
                f"(kvfence {__version__}): run the same kvfence release on the control plane "
                "and the nodes"
            )
        if req.model_fingerprint != model.fingerprint:
            return (
                f"model fingerprint {req.model_fingerprint or '<empty>'} differs from the model's "
                f"{model.fingerprint} ({model.name})"
            )
        if (
            req.text_fingerprint
            and model.text_fingerprint
            and (req.text_fingerprint != model.text_fingerprint)
        ):
            return (
                "the node's EOS ids or tokenizer differ from the control plane's (same weights, "
                "another generation_config.json or tokenizer.json: a model folder changed under "
                "running pods?); restart them all on the same folder"
            )
        if req.layout != model.layout:
            return (
                f"KV layout ({layout_text(req.layout)}) differs from the model's "
                f"({layout_text(model.layout)})"
            )
        if req.total_pages == 0 or req.pool_tokens == 0:
            return "a node must have a non-empty KV pool"
        return ""

    def heartbeat(self, req: control_pb2.HeartbeatRequest) -> control_pb2.HeartbeatResponse:
        node = self._nodes.get(req.node_id)
        if node is None:
            return control_pb2.HeartbeatResponse(known=False)
        if req.instance_id and node.instance_id and req.instance_id != node.instance_id:
            # The process this node_id named before its replacement registered (a pod replaced
            # while the old one still drains): its load and its draining flag are not the
            # replacement's. Marking the replacement draining took it out of routing for good.
            warned = self._superseded_warned.setdefault(node.node_id, set())
            if req.instance_id not in warned:  # once per replaced process, not per beat
                warned.add(req.instance_id)
                log.warning(
                    "heartbeat from a replaced process ignored",
                    node_id=node.node_id,
                    draining=req.draining,
                )
            return control_pb2.HeartbeatResponse(known=False, superseded=True)
        grew = req.free_pages > node.free_estimate
        if node.refused_room:
            # A heartbeat from a node still full must not reopen it: every request waiting for
            # prefill room would send it its prompt again, each heartbeat.
            grew = req.free_pages > node.refused_free
            node.refused_room = not grew
            node.refused_free = min(node.refused_free, req.free_pages)
        node.free_pages = req.free_pages
        node.quarantined_pages = req.quarantined_pages
        node.queue_length = req.queue_length
        node.reserved_since_heartbeat = 0
        node.last_heartbeat = time.monotonic()
        node.heartbeats += 1
        if req.draining:
            self.mark_draining(node)
        if grew:
            self._on_capacity()
        return control_pb2.HeartbeatResponse(known=True)

    def mark_draining(self, node: Node) -> None:
        """The node is shutting down (its heartbeat, or its answer to a Reserve / Prefill, said
        so): route nothing new to it. Its requests are not touched."""
        if node.draining:
            return
        node.draining = True
        log.info("node draining", node_id=node.node_id, role=node.role)
        # A node dropped meanwhile (a late refusal) was not among those taking requests.
        if self.registered(node) and not self.taking_requests(node.role):
            self._vacant_since[node.role] = time.monotonic()
            # Waiters for room on this role wake to start (or, with no wait, end) the no-node wait.
            self._on_capacity()

    def reap(self) -> list[Node]:
        """Drop every node silent for longer than ``node_timeout_s``; returns them."""
        lost = [n for n in self._nodes.values() if n.heartbeat_age_s > self.node_timeout_s]
        for node in lost:
            drained = " after draining" if node.draining else ""
            self._lose(node, f"no heartbeat for {node.heartbeat_age_s:.1f} s{drained}")
        return lost

    def lose(self, node: Node, why: str) -> None:
        """Drop a node now (e.g. it refused connections); it joins again by re-registering."""
        self._lose(node, why)

    def _lose(self, node: Node, why: str) -> None:
        if not self.registered(node):
            # Already gone, or registered again since (a new process under the same id): losing
            # an old view of it must not fail the requests running on its successor.
            return
        del self._nodes[node.node_id]
        # Forget which replaced processes were warned about: one still beating is answered
        # "unknown" now (it may register again), and warned about anew only if a later
        # registration supersedes it again.
        self._superseded_warned.pop(node.node_id, None)
        # A draining node leaving ends nothing that took requests: the vacancy, if any, began
        # when the role's last non-draining node drained.
        if not node.draining and not self.taking_requests(node.role):
            self._vacant_since[node.role] = time.monotonic()
        if node.draining:
            # A node that drained and stopped (a rolling upgrade, a pod deleted) leaving is what
            # was meant to happen: not a warning at every rollout. Its node_lost event stays.
            log.info("drained node left", node_id=node.node_id, role=node.role, why=why)
        else:
            log.warning("node lost", node_id=node.node_id, role=node.role, why=why)
        self._on_lost(node)

    async def run_reaper(self) -> None:
        """Check liveness a few times per timeout until cancelled.

        A tick that comes late by more than a quarter of ``node_timeout_s`` means this process
        stalled (CPU throttled under a container limit, descheduled on a busy host, a long GC):
        the heartbeats the nodes sent meanwhile wait unread in its sockets, so the stall is not
        counted against them (``excuse``): without that, one stall past ``node_timeout_s``
        dropped every node and failed every request in flight NODE_LOST, with the nodes healthy.
        A node that did die is then lost that much later. A shorter stall is counted: a healthy
        node's last heartbeat is at most an interval (half the timeout, the config's bound) old,
        so it cannot reach the timeout with it. A loop that stalls at every tick still loses a
        silent node: each tick adds a period to its silence, whatever the stall."""
        period = min(self.heartbeat_interval_s, self.node_timeout_s / 4)
        while True:
            asleep = time.monotonic()
            await asyncio.sleep(period)
            late = time.monotonic() - asleep - period
            if late > self.node_timeout_s / 4:
                self.excuse(late)
            self.reap()

    def excuse(self, stalled_s: float) -> None:
        """Do not count ``stalled_s`` seconds of this process's stall as the nodes' silence."""
        log.warning(
            "control plane stalled; not counted as node silence",
            stalled_s=round(stalled_s, 3),
            nodes=len(self._nodes),
        )
        now = time.monotonic()
        for node in self._nodes.values():
            node.last_heartbeat = min(now, node.last_heartbeat + stalled_s)
        self._on_stall(stalled_s)

    # -- queries -----------------------------------------------------------------------------------

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def registered(self, node: Node) -> bool:
        """Whether ``node`` is the registered view of its id: not lost, and not replaced by a
        new process registering under it (a request may hold an older view across awaits)."""
        return self._nodes.get(node.node_id) is node

    def nodes(self, role: str | None = None) -> list[Node]:
        # list(): a copy made at once under the GIL; metrics read this from the scrape thread
        return [n for n in list(self._nodes.values()) if role is None or n.role == role]

    def taking_requests(self, role: str) -> list[Node]:
        """Registered nodes of ``role`` that routing may send a new request to (not draining)."""
        return [n for n in self.nodes(role) if not n.draining]

    def vacant_for(self, role: str) -> float | None:
        """Seconds since ``role`` last had a node that takes requests: since its last one started
        draining or left (or since the registry started, if none ever registered). None while a
        registered node of the role is not draining."""
        if self.taking_requests(role):
            return None
        return time.monotonic() - self._vacant_since[role]

    def admissible_limit(self) -> int:
        """min(context window, pool tokens of every node that could serve the model)."""
        return min([self.model.context_window, *(n.pool_tokens for n in self._nodes.values())])


class NodeRegistryServicer(control_pb2_grpc.NodeRegistryServicer):
    """gRPC face of :class:`Registry`.

    A Register or Heartbeat without the cluster node token is refused UNAUTHENTICATED before it
    touches the registry, counted in ``metrics``' ``auth_failures_total{listener="public"}`` and
    logged without the token, throttled (``Metrics.credential_refused``)."""

    def __init__(self, registry: Registry, node_token: str, metrics: Metrics):
        """``metrics``: the control plane's, where refusals are counted."""
        self.registry = registry
        self.node_token = node_token
        self.metrics = metrics

    async def _authenticate(self, context: grpc.aio.ServicerContext, method: str) -> None:
        # Only holders of the cluster's node token may join: a registered decode node is sent
        # tenants' KV.
        presented = bearer_token(context)
        if token_matches(presented, self.node_token):
            return
        err = Unauthenticated("node registration needs the cluster node token")
        self.metrics.credential_refused(
            listener="public",
            method=method,
            status=err.code.name,
            reason="no node token" if presented is None else "wrong node token",
            peer=context.peer(),
        )
        await abort(context, err)

    async def Register(
        self, request: control_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.RegisterResponse:
        await self._authenticate(context, "Register")
        return self.registry.register(request)

    async def Heartbeat(
        self, request: control_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.HeartbeatResponse:
        await self._authenticate(context, "Heartbeat")
        return self.registry.heartbeat(request)
