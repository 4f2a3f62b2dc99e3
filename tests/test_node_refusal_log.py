"""A node's refused calls (no or wrong node token) are counted one by one but logged at most once
per interval: whoever reaches a node's gRPC port must not set how much the node logs.

``NodeTokenCheck`` is driven directly with a stand-in gRPC context: the check only reads the
context's metadata and peer and aborts through it.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from asyncwait import eventually
from structlog.testing import capture_logs

from kvfence.auth import bearer_metadata
from kvfence.metrics import Metrics
from kvfence.node import REFUSAL_LOG_INTERVAL_S, NodeTokenCheck

TOKEN = "kvfn_" + "r" * 43
WRONG = "kvfn_" + "w" * 43


class Aborted(Exception):
    pass


class Context:
    """What the check uses of a grpc.aio.ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()):
        self._metadata = metadata
        self.aborted: Any = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:10.0.0.9:5555"

    async def abort_with_status(self, status: Any) -> None:
        self.aborted = status
        raise Aborted


def refused_metric(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value(
        "kvfence_requests_total", {"service": "decode", "status": "UNAUTHENTICATED"}
    )
    return value or 0.0


def refusal_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "node rpc refused"]


async def refuse(check: NodeTokenCheck, method: str, metadata=()) -> None:
    ctx = Context(metadata)
    with pytest.raises(Aborted):
        await check(ctx, method)  # type: ignore[arg-type]
    assert ctx.aborted.code == grpc.StatusCode.UNAUTHENTICATED


async def test_a_burst_of_refusals_is_logged_once_then_summed():
    metrics = Metrics("decode")
    check = NodeTokenCheck(TOKEN, metrics)
    assert REFUSAL_LOG_INTERVAL_S >= 1.0  # 200 calls here take far less than the interval
    with capture_logs() as logs:
        await refuse(check, "Reserve")
        first = refusal_lines(logs)
        # the first refusal is logged at once
        assert len(first) == 1 and first[0]["refused"] == 1 and first[0]["method"] == "Reserve"
        assert first[0]["reason"] == "no node token"
        for i in range(199):
            await refuse(check, "Stats", bearer_metadata(WRONG) if i % 2 == 0 else ())
        # the rest of the burst is not logged call by call...
        assert len(refusal_lines(logs)) == 1
        # ...but counted, every one
        assert refused_metric(metrics) == 200
        check.flush_log()  # what the timer does when the interval is over
        check.flush_log()  # nothing new since: no line
    lines = refusal_lines(logs)
    assert [e["refused"] for e in lines] == [1, 199]
    assert lines[1]["method"] == "Stats" and lines[1]["reason"] == "wrong node token"
    assert lines[1]["peer"] == "ipv4:10.0.0.9:5555" and lines[1]["log_level"] == "warning"
    assert all(TOKEN not in str(e) and WRONG not in str(e) for e in logs)


async def test_the_rest_of_a_burst_is_logged_by_the_timer():
    """No later refusal is needed to log the rest of a burst: a timer writes it."""
    metrics = Metrics("decode")
    check = NodeTokenCheck(TOKEN, metrics, interval_s=0.2)
    with capture_logs() as logs:
        for _ in range(200):
            await refuse(check, "Decode")
        assert await eventually(lambda: sum(e["refused"] for e in refusal_lines(logs)) >= 200)
    lines = refusal_lines(logs)
    assert sum(e["refused"] for e in lines) == 200
    assert 2 <= len(lines) <= 3 and lines[0]["refused"] == 1
    assert refused_metric(metrics) == 200


async def test_a_call_with_the_node_token_is_served_and_logs_no_refusal():
    """Control: the same check lets the token through, counts and logs nothing; a refusal after
    it is still logged at once."""
    metrics = Metrics("decode")
    check = NodeTokenCheck(TOKEN, metrics)
    with capture_logs() as logs:
        for _ in range(3):
            ctx = Context(bearer_metadata(TOKEN))
            assert await check(ctx, "Reserve") is None  # type: ignore[arg-type]
            assert ctx.aborted is None
        assert refusal_lines(logs) == [] and refused_metric(metrics) == 0
        await refuse(check, "Reserve", bearer_metadata(WRONG))
    assert [e["refused"] for e in refusal_lines(logs)] == [1]
    assert refused_metric(metrics) == 1
