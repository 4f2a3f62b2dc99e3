"""Channels to the nodes, node choice, and the count of node RPCs (tests assert on it).

Decode nodes are chosen by estimated free pages (most first), prefill nodes by queue length
(shortest first) among those whose estimated free pages hold the prompt; a node whose calls
failed on its side ``control_plane.failures_to_cool`` times in a row (default 3) is left out for
``control_plane.failure_cooldown_s`` (default 10 s; 0 = never) while another of its role takes
requests (logged: "node cooling down after failures"). The estimates only order and pre-filter
the candidates; the node's own answer to Reserve / Prefill (RESOURCE_EXHAUSTED = "not now": a
decode node's estimate drops to 0, a prefill node is left out as ``refuse_room`` says, at most
``control_plane.refused_room_max_s``, default 5 s) is authoritative. These three settings are the
``Registry``'s (from its control plane's config), passed with it to every function here that
needs them: no module state, so two control planes in one process route by their own.

A node's estimate (``Node.free_estimate``) is its last heartbeat's free pages less the pages this
control plane took on it since: a decode reservation once answered; a Prefill's prompt pages as
the call goes out, before it is awaited, so that requests woken together for prefill room (a
release answered, a heartbeat) do not all send their whole prompt to a node with room for one
(pipeline ``_try_prefill``). Pages come off the count as the request ends (decode), or, for a
prefill node, when a Prefill is refused having taken nothing or a release there is over, only if
no heartbeat can have seen them free since (``Pipeline._give_back``), and only on the node
object they were counted on, not one that replaced it: where a heartbeat is in the way the
estimate errs towards a fuller node (it can still err emptier: ``Pipeline._give_back``).
Every heartbeat resets it, so an estimate that went wrong lasts one heartbeat interval at most.

A draining node (shutting down) is never a candidate; one that answers UNAVAILABLE with reason
NODE_DRAINING took nothing for the request, is marked draining at once (``refused_draining``) and
the request tries another node or waits, as after RESOURCE_EXHAUSTED.

Every call to a node carries the cluster node token (the nodes refuse calls without it): the stubs
``NodeClients`` hands out add it themselves, so a caller cannot forget it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from control_plane.registry import DECODE, PREFILL, Node, Registry
from control_plane.verify import node_error
from kvfence.auth import with_token
from kvfence.config import pages_needed
from kvfence.errors import (
    NODE_DRAINING,
    NODE_RESTARTED,
    RESERVATION_RELEASED,
    KvfenceError,
    Unavailable,
    error_info,
)
from kvfence.logging import get_logger
from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvfence.server import CHANNEL_OPTIONS

log = get_logger("routing")
RELEASE_TIMEOUT_S = 5.0


@dataclass
class _NodeChannel:
    address: str
    channel: grpc.aio.Channel
    decode: decode_pb2_grpc.DecodeStub | None = None
    prefill: prefill_pb2_grpc.PrefillStub | None = None


class NodeClients:
    """One channel per registered node, its stubs sending the node token on every call; counts
    every RPC sent, by (node_id, method)."""

    def __init__(
        self,
        node_token: str,
        credentials: grpc.ChannelCredentials | None = None,
        metrics: Metrics | None = None,
        registered: Callable[[Node], bool] | None = None,
        tls_server_name: str | None = None,
    ):
        """``registered(node)``: whether ``node`` is its id's registered view now
        (Registry.registered). ``tls_server_name`` (tls.internal_server_name): the name every
        node's certificate is verified against, in place of the host of its advertised address."""
        if not node_token:
            raise ValueError("the control plane calls nodes with the cluster node token")
        self._node_token = node_token
        self._credentials = credentials
        # A node advertises its pod IP, which a certificate shared by every node (one Secret)
        # cannot name: verify the name it does carry instead.
        self._secure_options = (
            CHANNEL_OPTIONS
            if tls_server_name is None
            else [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", tls_server_name)]
        )
        self._metrics = metrics
        self._registered = registered
        self._channels: dict[str, _NodeChannel] = {}
        # By (node_id, method) for the nodes registered, and by method for those lost since
        # (``forget``): kept per node id for good, it grew with every node that ever came and went.
        self.rpc_counts: Counter[tuple[str, str]] = Counter()
        self._lost_rpc_counts: Counter[str] = Counter()

    def _channel(self, node: Node) -> _NodeChannel:
        known = self._channels.get(node.node_id)
        if known is not None and known.address == node.grpc_address:
            return known
        if self._registered is not None and not self._registered(node):
            # An old view of the node (lost, or registered again by a new process since the
            # request chose it): opening its address in place of the registered node's channel
            # would close that channel and cut every call on it, other requests' included.
            # The node's id is the operator's (this log line), not the tenant's.
            log.warning("node lost or registered again since chosen", node_id=node.node_id)
            raise Unavailable(
                f"the {node.role} node chosen for this request was lost or registered again since",
                reason="NODE_LOST",
            )
        if known is not None:
            self.drop(node.node_id)
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(node.grpc_address, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(
                node.grpc_address, self._credentials, options=self._secure_options
            )
        known = self._channels[node.node_id] = _NodeChannel(node.grpc_address, channel)
        return known

    def count(self, node: Node, method: str) -> None:
        if self._registered is None or self._registered(node):
            self.rpc_counts[(node.node_id, method)] += 1
        else:  # lost (forgotten) already: by method only, or its key would come back for good
            self._lost_rpc_counts[method] += 1
        if self._metrics is not None:
            self._metrics.rpcs_total.labels(method=f"client:{method}").inc()

    def decode(self, node: Node) -> decode_pb2_grpc.DecodeStub:
        """The node's Decode stub (every call carries the node token)."""
        known = self._channel(node)
        if known.decode is None:
            known.decode = with_token(decode_pb2_grpc.DecodeStub(known.channel), self._node_token)
        return known.decode

    def prefill(self, node: Node) -> prefill_pb2_grpc.PrefillStub:
        """The node's Prefill stub (every call carries the node token)."""
        known = self._channel(node)
        if known.prefill is None:
            known.prefill = with_token(
                prefill_pb2_grpc.PrefillStub(known.channel), self._node_token
            )
        return known.prefill

    def total(self, method: str | None = None) -> int:
        lost = sum(n for m, n in self._lost_rpc_counts.items() if method in (None, m))
        return lost + sum(n for (_, m), n in self.rpc_counts.items() if method in (None, m))

    def forget(self, node_id: str) -> None:
        """A node lost: its channel closed (``drop``), and its calls counted by method only."""
        self.drop(node_id)
        for key in [k for k in self.rpc_counts if k[0] == node_id]:
            self._lost_rpc_counts[key[1]] += self.rpc_counts.pop(key)

    def drop(self, node_id: str) -> None:
        known = self._channels.pop(node_id, None)
        if known is not None:
            # Closing cancels the calls still open on the channel: the node is gone.
            asyncio.get_running_loop().create_task(known.channel.close(grace=None))

    async def close(self) -> None:
        channels = [c.channel for c in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)

    async def release(self, node: Node, request_id: str, reason: str) -> bool | None:
        """Release on one node; failures are logged and swallowed (the caller's status wins).
        The node's answer: whether it held anything for the request; None when it did not
        answer."""
        req = prefill_pb2.ReleaseRequest(request_id=request_id, reason=reason)
        self.count(node, "Release")
        try:
            if node.role == DECODE:
                resp = await self.decode(node).Release(req, timeout=RELEASE_TIMEOUT_S)
            else:
                resp = await self.prefill(node).Release(req, timeout=RELEASE_TIMEOUT_S)
            return bool(resp.held)
        except grpc.aio.AioRpcError as err:
            log.warning(
                "release failed",
                node_id=node.node_id,
                role=node.role,
                code=err.code().name,
                details=err.details(),
            )
        except Exception:  # e.g. the node's channel closed under the call: say so, still go on
            log.exception("release failed", node_id=node.node_id, role=node.role)
        return None


# A node whose calls failed on its side (INTERNAL, UNKNOWN, UNAVAILABLE: a broken engine, its UCX
# path down; a prefill node's transfer timing out) registry.failures_to_cool times in a row, no
# success between, is left out of routing for registry.failure_cooldown_s while another node of its
# role takes requests; then one request probes it (a failure cools it again, a success clears it).
# It answers fast and heartbeats on, so by queue length or free pages it looked the best node and
# drew every request to fail. With the default of 3, one failure alone (a transient error, a peer
# restarting) costs no capacity. A cool-down of 0 leaves every node in (the count and the log go
# on).
_NODE_FAULTS = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}
)
# A prefill node's UNAVAILABLE with one of these reasons is its KV transfer to decode failing:
# either side may be the broken one, so it counts against both; the healthy side's successes
# with other peers clear its count, the broken side's do not come.
_TRANSFER_TO_DECODE = frozenset({"TRANSFER_FAILED", "UNREACHABLE"})
# A prefill node's DEADLINE_EXCEEDED with reason TIMEOUT is its transfer timing out (a batch, or
# the endpoint, that decode never answered: prefill raises DEADLINE_EXCEEDED for nothing else).
# It counts like a failed transfer: a decode node whose UCX listener accepts and then hangs costs
# every request sent to it the whole transfer timeout, and looked the best node all the while.
# The request's own deadline is not a node's fault: it carries no such reason.
_TRANSFER_TIMEOUT = "TIMEOUT"
_NOT_A_FAULT = frozenset({RESERVATION_RELEASED, NODE_RESTARTED})


def node_failed(
    registry: Registry, node: Node, err: grpc.aio.AioRpcError, decode: Node | None = None
) -> KvfenceError:
    """``node_error``, and a failure on the node's side counts towards its cool-down (the
    registry's settings). ``decode``: the request's decode node, which a failed transfer counts
    against too."""
    failure = node_error(node, err)
    timed_out = (
        err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        and node.role == PREFILL
        and failure.reason == _TRANSFER_TIMEOUT
    )
    # RESERVATION_RELEASED is load (a queue that outlasted the reservation), not a broken node;
    # NODE_RESTARTED is decode's previous process gone (the new one serves): neither node is
    # broken now. NODE_DRAINING is a node shutting down on purpose, whose drain timed out and
    # ended the calls it still ran: route nothing new to it, but it is no fault (counted, a decode
    # node ending its streams logged "node cooling down after failures", reason NODE_DRAINING).
    if failure.reason == NODE_DRAINING:  # UNAVAILABLE, or CANCELLED once prefill's send began
        registry.mark_draining(node)
    elif timed_out or (err.code() in _NODE_FAULTS and failure.reason not in _NOT_A_FAULT):
        _count_failure(registry, node, failure.reason)
        if decode is not None and (timed_out or failure.reason in _TRANSFER_TO_DECODE):
            _count_failure(registry, decode, failure.reason)
    return failure


def node_unanswered(registry: Registry, node: Node, reason: str) -> None:
    """A call the node did not answer within its own bound (not the request's deadline) counts
    towards its cool-down, as a fault it answered does (``node_failed``)."""
    _count_failure(registry, node, reason)


def node_succeeded(node: Node) -> None:
    """A call on ``node`` did its work (a Prefill and its transfer; a whole decode stream)."""
    node.failures = 0


def _count_failure(registry: Registry, node: Node, reason: str) -> None:
    node.failures += 1
    node.failed_at = time.monotonic()
    to_cool = registry.failures_to_cool
    # At the count that cools it, then at every 10x that count: a node that keeps failing stays
    # visible in the log without a line per request.
    if node.failures == to_cool or node.failures % (10 * to_cool) == 0:
        log.warning(
            "node cooling down after failures",
            node_id=node.node_id,
            role=node.role,
            reason=reason,
            failures_in_a_row=node.failures,
            seconds=registry.failure_cooldown_s,  # 0: cool-down off, the node stays in
        )


def _cooling(registry: Registry, node: Node) -> bool:
    return (
        node.failures >= registry.failures_to_cool
        and time.monotonic() - node.failed_at < registry.failure_cooldown_s
    )


def _unless_cooling(registry: Registry, role: str, nodes: list[Node]) -> list[Node]:
    """``nodes`` less the cooling ones, while a node of ``role`` that is not cooling takes
    requests (full or not: a request waits for its room rather than go to a node that keeps
    failing); all of them when every node of the role is cooling."""
    if any(not _cooling(registry, n) for n in registry.taking_requests(role)):
        return [n for n in nodes if not _cooling(registry, n)]
    return nodes


def decode_candidates(registry: Registry, pages: int, skip: set[str]) -> list[Node]:
    """Decode nodes that could hold ``pages`` now, most free pages first; never a draining one,
    nor a cooling one while another takes requests (``node_failed``)."""
    nodes = [
        n
        for n in registry.taking_requests(DECODE)
        if n.node_id not in skip and n.total_pages >= pages and n.free_estimate >= pages
    ]
    return sorted(
        _unless_cooling(registry, DECODE, nodes), key=lambda n: (-n.free_estimate, n.node_id)
    )


# A prefill node that refused for room is left out at most registry.refused_room_max_s whatever
# its heartbeats say: pages can come back in a way neither reopening path sees (a pass cancelled
# mid-way frees its pages after the Release was answered, to exactly the count the last heartbeat
# showed), and a node left out for good while empty fails every request NO_CAPACITY.
def refuse_room(node: Node, err: grpc.aio.AioRpcError) -> None:
    """``node`` refused a Prefill for room: left out of routing until a heartbeat shows more free
    pages than it had (the count its refusal gave, else its last heartbeat's), a release on it is
    answered, or the registry's ``refused_room_max_s`` pass (``room_refused``)."""
    info = error_info(err)
    free = node.free_pages
    if info is not None and info.metadata.get("free_pages", "").isdigit():
        free = min(free, int(info.metadata["free_pages"]))
    node.refused_room = True
    node.refused_free = free
    node.refused_at = time.monotonic()


def room_refused(registry: Registry, node: Node) -> bool:
    """Whether ``node`` is still left out after refusing for room (``refuse_room``)."""
    return node.refused_room and time.monotonic() - node.refused_at < registry.refused_room_max_s


def prefill_pages(node: Node, prompt_tokens: int) -> int:
    """The pages a prompt of ``prompt_tokens`` tokens takes in ``node``'s pool while it is
    prefilled and until it is released (what the prefill node allocates)."""
    return pages_needed(prompt_tokens, node.layout.page_size)


def prefill_candidates(registry: Registry, skip: set[str], prompt_tokens: int = 0) -> list[Node]:
    """Prefill nodes, shortest queue first; never a draining one, nor a cooling one while
    another takes requests (``node_failed``), nor one left out after refusing for room
    (``refuse_room``): requests waiting for prefill room would otherwise send it their whole
    prompt again at every wake-up, each request's end being one. Nor one whose estimated free
    pages (module docstring) cannot hold a prompt of ``prompt_tokens`` tokens: when room comes
    back, as many waiters send their prompt as the estimate has room for, not every one."""
    nodes = [
        n
        for n in registry.taking_requests(PREFILL)
        if n.node_id not in skip
        and not room_refused(registry, n)
        and n.free_estimate >= prefill_pages(n, prompt_tokens)
    ]
    return sorted(
        _unless_cooling(registry, PREFILL, nodes),
        key=lambda n: (n.queue_length + n.in_flight, n.node_id),
    )


def refused_draining(registry: Registry, node: Node, err: grpc.aio.AioRpcError) -> bool:
    """True when ``node`` refused a Reserve / Prefill because it is draining (UNAVAILABLE, reason
    NODE_DRAINING): it took nothing, so the caller goes on to another node, or waits, as after
    RESOURCE_EXHAUSTED, rather than failing the request. The node is marked draining now, ahead of
    its next heartbeat; its other requests go on."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    info = error_info(err)
    if info is None or info.reason != NODE_DRAINING:
        return False
    registry.mark_draining(node)
    return True
