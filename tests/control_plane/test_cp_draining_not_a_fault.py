"""A node whose drain timed out ends the calls it still runs with reason ``NODE_DRAINING``
(decode: UNAVAILABLE on its streams; prefill: UNAVAILABLE before its KV send began, CANCELLED
after). That is a node shutting down on purpose: the control plane marks it draining (nothing new
is routed to it ahead of its next heartbeat) and counts nothing towards its cool-down. Counted, a
decode node ending three streams logged "node cooling down after failures", reason NODE_DRAINING.
Its "node call failed" line is info, not a warning. Control: the same calls failing with a fault's
reason count, mark nothing, and warn."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from control_plane.registry import DECODE, PREFILL
from control_plane.routing import node_failed
from kvfence.errors import NODE_DRAINING, Cancelled, KvfenceError, Unavailable


def _rpc_error(err: KvfenceError) -> grpc.aio.AioRpcError:
    status = err.to_status()
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )


def _registry() -> SimpleNamespace:
    marked: list[str] = []
    return SimpleNamespace(
        failures_to_cool=3,
        failure_cooldown_s=10.0,
        marked=marked,
        mark_draining=lambda node: marked.append(node.node_id),
    )


def _node(role: str) -> SimpleNamespace:
    return SimpleNamespace(node_id=f"{role}-0", role=role, failures=0, failed_at=0.0)


def _levels(logs: list[dict[str, Any]]) -> list[str]:
    """The levels of the control plane's "node call failed" lines, in order."""
    return [e["log_level"] for e in logs if e["event"] == "node call failed"]


@pytest.mark.parametrize(
    "role, err",
    [
        (DECODE, Unavailable("the node is shutting down", reason=NODE_DRAINING)),
        (PREFILL, Unavailable("the node is shutting down", reason=NODE_DRAINING)),
        (PREFILL, Cancelled("the node is shutting down", reason=NODE_DRAINING)),
    ],
)
def test_calls_ended_by_a_timed_out_drain_mark_it_draining_and_count_nothing(
    role: str, err: KvfenceError
) -> None:
    registry, node = _registry(), _node(role)
    with capture_logs() as logs:
        for _ in range(3):
            failure = node_failed(registry, node, _rpc_error(err))  # type: ignore[arg-type]
            # CANCELLED included: the node's, never the client's, it reaches the client
            # UNAVAILABLE
            assert failure.reason == NODE_DRAINING and failure.code == grpc.StatusCode.UNAVAILABLE
    assert node.failures == 0
    assert registry.marked == [node.node_id] * 3  # mark_draining itself is idempotent
    assert _levels(logs) == ["info"] * 3


@pytest.mark.parametrize(
    "role, err",
    [
        (DECODE, Unavailable("engine failed", reason="ENGINE_FAILED")),
        (DECODE, KvfenceError("engine failed", reason="ENGINE_FAILED")),
        (PREFILL, Unavailable("KV transfer to decode failed", reason="TRANSFER_FAILED")),
    ],
)
def test_control_the_same_calls_failing_on_the_node_count_and_mark_nothing(
    role: str, err: KvfenceError
) -> None:
    registry, node = _registry(), _node(role)
    with capture_logs() as logs:
        for _ in range(3):
            node_failed(registry, node, _rpc_error(err))  # type: ignore[arg-type]
    assert node.failures == 3
    assert registry.marked == []
    assert _levels(logs) == ["warning"] * 3
