"""A node whose control plane is down logs its unanswered heartbeats at most once per
``HEARTBEAT_ERROR_LOG_INTERVAL_S`` (a line per beat was 4 a second per node at a 0.5 s
interval), and says when they are answered again (kvfence/node.py, ``NodeAgent.heartbeat``)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
import structlog
from asyncwait import eventually
from fixtures_mqtt import free_port

from kvfence.node import NodeAgent
from kvfence.proto.kvfence.v1 import control_pb2


class FlakyRegistry:
    """Heartbeat answered UNAVAILABLE ``down`` times, then known."""

    def __init__(self, down: int):
        self.down = down
        self.calls = 0

    async def Heartbeat(self, request: Any, **_: Any) -> control_pb2.HeartbeatResponse:
        self.calls += 1
        if self.calls <= self.down:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )
        return control_pb2.HeartbeatResponse(known=True)


@pytest.mark.parametrize("down", [30, 1], ids=["outage", "one-beat"])
async def test_unanswered_heartbeats_are_logged_once_per_interval(down: int) -> None:
    """30 unanswered beats (an outage of ~0.8 s at a 0.05 s interval) are two lines: the first
    at once, the rest when the beats are answered again, with their count; then one line says
    they are. Control: one unanswered beat is one line, at once, and the same recovery line."""
    agent = NodeAgent(
        f"127.0.0.1:{free_port()}",
        control_pb2.RegisterRequest(node_id="n"),
        lambda: control_pb2.HeartbeatRequest(node_id="n"),
        0.05,
    )
    registry = FlakyRegistry(down)
    agent._stub = registry  # type: ignore[assignment]
    try:
        with structlog.testing.capture_logs() as logs:
            agent.start_heartbeats()
            assert await eventually(lambda: registry.calls > down + 2, 30)
    finally:
        await agent.stop()
    failed = [e for e in logs if e["event"] == "heartbeat failed"]
    back = [e for e in logs if e["event"] == "heartbeats answered again"]
    assert failed[0]["failures"] == 1 and failed[0]["code"] == "UNAVAILABLE"
    assert sum(e["failures"] for e in failed) == down
    assert len(failed) == (1 if down == 1 else 2)
    assert [e["failed_in_a_row"] for e in back] == [down]


async def test_beats_unanswered_when_the_node_stops_are_logged_at_its_stop() -> None:
    """A node stopped while its control plane is down: the unanswered beats since the last line
    were logged by a timer up to 10 s after the agent had stopped, or never (its loop gone). Its
    stop logs them. Control: the first failure is logged at once, as before."""
    agent = NodeAgent(
        f"127.0.0.1:{free_port()}",
        control_pb2.RegisterRequest(node_id="n"),
        lambda: control_pb2.HeartbeatRequest(node_id="n"),
        0.05,
    )
    registry = FlakyRegistry(10**6)  # never answers
    agent._stub = registry  # type: ignore[assignment]
    with structlog.testing.capture_logs() as logs:
        agent.start_heartbeats()
        assert await eventually(lambda: registry.calls >= 10, 30)
        first = [e for e in logs if e["event"] == "heartbeat failed"]
        assert [e["failures"] for e in first] == [1]  # control
        await agent.stop()
        failed = [e["failures"] for e in logs if e["event"] == "heartbeat failed"]
    assert len(failed) == 2 and sum(failed) == registry.calls
    assert agent._failed_log._timer is None


@pytest.mark.parametrize("stall_s", [1.5, 0.0], ids=["stalled", "control-no-stall"])
async def test_a_node_that_stalled_says_its_heartbeats_were_late(stall_s: float) -> None:
    """A node process that stood still (its control plane then drops it as lost, though it never
    stopped) says so in its own log, with how long. Control: beats on time log no such line."""
    agent = NodeAgent(
        f"127.0.0.1:{free_port()}",
        control_pb2.RegisterRequest(node_id="n"),
        lambda: control_pb2.HeartbeatRequest(node_id="n"),
        0.5,
    )
    registry = FlakyRegistry(0)
    agent._stub = registry  # type: ignore[assignment]
    counted: list[float] = []
    agent.on_stall = counted.append  # what the node counts in kvfence_stalled_seconds_total
    try:
        with structlog.testing.capture_logs() as logs:
            agent.start_heartbeats()
            assert await eventually(lambda: registry.calls >= 1, 30)
            time.sleep(stall_s)  # the whole process stops, the heartbeat loop with it
            calls = registry.calls
            assert await eventually(lambda: registry.calls >= calls + 2, 30)
    finally:
        await agent.stop()
    stalls = [e for e in logs if e["event"] == "node stalled; its heartbeats were late"]
    if stall_s:
        assert {e["log_level"] for e in stalls} == {"warning"}
        assert [e for e in stalls if stall_s - 0.5 <= e["stalled_s"] <= stall_s + 1.0], stalls
        assert len(counted) == len(stalls)
    else:
        assert stalls == [] and counted == []
