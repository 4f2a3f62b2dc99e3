"""Channels to the nodes, node choice, and the count of node RPCs (tests assert on it).

Decode nodes are chosen by estimated free pages (most first), prefill nodes by queue length
(shortest first) among those whose estimated free pages hold the prompt. The estimates only order
and pre-filter the candidates; the node's own answer to Reserve / Prefill (RESOURCE_EXHAUSTED =
"not now", and the node counts as full until its next heartbeat) is authoritative. A draining
node (shutting
down) is never a candidate; one that answers UNAVAILABLE with reason NODE_DRAINING took nothing for
the request, is marked draining at once (``refused_draining``) and the request tries another node
or waits, as after RESOURCE_EXHAUSTED.

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
from kvfence.errors import NODE_DRAINING, KvfenceError, Unavailable, error_info
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
    ):
        """``registered(node)``: whether ``node`` is its id's registered view now
        (Registry.registered)."""
        if not node_token:
            raise ValueError("the control plane calls nodes with the cluster node token")
        self._node_token = node_token
        self._credentials = credentials
        self._metrics = metrics
        self._registered = registered
        self._channels: dict[str, _NodeChannel] = {}
        self.rpc_counts: Counter[tuple[str, str]] = Counter()

    def _channel(self, node: Node) -> _NodeChannel:
        known = self._channels.get(node.node_id)
        if known is not None and known.address == node.grpc_address:
            return known
        if self._registered is not None and not self._registered(node):
            # An old view of the node (lost, or registered again by a new process since the
            # request chose it): opening its address in place of the registered node's channel
            # would close that channel and cut every call on it, other requests' included.
            raise Unavailable(
                f"{node.role} node {node.node_id} was lost or registered again since this "
                "request chose it",
                reason="NODE_LOST",
            )
        if known is not None:
            self.drop(node.node_id)
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(node.grpc_address, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(
                node.grpc_address, self._credentials, options=CHANNEL_OPTIONS
            )
        known = self._channels[node.node_id] = _NodeChannel(node.grpc_address, channel)
        return known

    def count(self, node: Node, method: str) -> None:
        self.rpc_counts[(node.node_id, method)] += 1
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
        return sum(n for (_, m), n in self.rpc_counts.items() if method in (None, m))

    def drop(self, node_id: str) -> None:
        known = self._channels.pop(node_id, None)
        if known is not None:
            # Closing cancels the calls still open on the channel: the node is gone.
            asyncio.get_running_loop().create_task(known.channel.close(grace=None))

    async def close(self) -> None:
        channels = [c.channel for c in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)

    async def release(self, node: Node, request_id: str, reason: str) -> None:
        """Release on one node; failures are logged and swallowed (the caller's status wins)."""
        req = prefill_pb2.ReleaseRequest(request_id=request_id, reason=reason)
        self.count(node, "Release")
        try:
            if node.role == DECODE:
                await self.decode(node).Release(req, timeout=RELEASE_TIMEOUT_S)
            else:
                await self.prefill(node).Release(req, timeout=RELEASE_TIMEOUT_S)
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


# A node whose call failed on its side (INTERNAL, UNKNOWN, UNAVAILABLE: a broken engine, its UCX
# path down) goes behind every other candidate for this long. It answers fast and heartbeats on,
# so by queue length or free pages it looked the best node and drew every request to fail.
FAILURE_COOLDOWN_S = 10.0
_NODE_FAULTS = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}
)


def node_failed(node: Node, err: grpc.aio.AioRpcError) -> KvfenceError:
    """``node_error``, and a failure on the node's side puts it behind the others for
    FAILURE_COOLDOWN_S (it is still chosen when it is the only candidate)."""
    if err.code() in _NODE_FAULTS:
        node.failed_at = time.monotonic()
    return node_error(node, err)


def _cooling(node: Node) -> bool:
    return bool(node.failed_at) and time.monotonic() - node.failed_at < FAILURE_COOLDOWN_S


def decode_candidates(registry: Registry, pages: int, skip: set[str]) -> list[Node]:
    """Decode nodes that could hold ``pages`` now, most free pages first (a node cooling down
    from a failure last); never a draining one."""
    nodes = [
        n
        for n in registry.taking_requests(DECODE)
        if n.node_id not in skip and n.total_pages >= pages and n.free_estimate >= pages
    ]
    return sorted(nodes, key=lambda n: (_cooling(n), -n.free_estimate, n.node_id))


def prefill_candidates(registry: Registry, pages: int, skip: set[str]) -> list[Node]:
    """Prefill nodes that could hold ``pages`` now, shortest queue first; never a draining one.
    One that refused for room counts as full until its next heartbeat (Pipeline._try_prefill):
    requests waiting for prefill room would otherwise send it their whole prompt again at
    every wake-up, each request's end being one."""
    nodes = [
        n
        for n in registry.taking_requests(PREFILL)
        if n.node_id not in skip and n.free_estimate >= pages
    ]
    return sorted(nodes, key=lambda n: (_cooling(n), n.queue_length + n.in_flight, n.node_id))


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
