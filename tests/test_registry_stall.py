"""A stall of the control plane's own process is not counted as its nodes' silence
(``Registry.run_reaper``): a CI run's in-process cluster lost both of its healthy nodes
("no heartbeat for 0.6 s", node_timeout_s 0.5) when its event loop stalled, and failed the
request in flight NODE_LOST. Control: a node that stopped heartbeating is still lost, after
node_timeout_s of the control plane's running time."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from control_plane.model_info import ByteTokenizer, ModelInfo
from control_plane.registry import Registry
from kvfence import PROTOCOL_VERSION
from kvfence.proto.kvfence.v1 import common_pb2, control_pb2

HEARTBEAT_S = 0.05
TIMEOUT_S = 0.5
STALL_S = 1.0  # twice node_timeout_s


@pytest.fixture(autouse=True)
def _default_structlog() -> None:
    structlog.reset_defaults()


@pytest.fixture
def registry() -> Registry:
    layout = common_pb2.KvLayout(
        page_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8
    )
    model = ModelInfo(
        name="m",
        context_window=256,
        fingerprint="sha256:m",
        layout=layout,
        vocab_size=384,
        tokenizer=ByteTokenizer(),
    )
    reg = Registry(
        model,
        HEARTBEAT_S,
        TIMEOUT_S,
        failures_to_cool=3,
        failure_cooldown_s=10.0,
        refused_room_max_s=5.0,
    )
    request = control_pb2.RegisterRequest(
        node_id="decode-0",
        role="decode",
        grpc_address="10.0.0.1:1",
        model_fingerprint="sha256:m",
        layout=layout,
        pool_tokens=384,
        total_pages=24,
        instance_id="i",
        protocol_version=PROTOCOL_VERSION,
    )
    assert reg.register(request).accepted
    return reg


async def heartbeats(registry: Registry) -> None:
    while True:
        registry.heartbeat(control_pb2.HeartbeatRequest(node_id="decode-0", instance_id="i"))
        await asyncio.sleep(HEARTBEAT_S)


async def stall_with(registry: Registry, beating: bool) -> tuple[asyncio.Task[None], list[dict]]:
    """Runs the reaper (and the node's heartbeats, if ``beating``) a while, then blocks the event
    loop for STALL_S as a throttled or descheduled process would be; returns the reaper's task and
    the logs captured meanwhile."""
    reaper = asyncio.create_task(registry.run_reaper())
    beats = asyncio.create_task(heartbeats(registry)) if beating else None
    await asyncio.sleep(4 * HEARTBEAT_S)
    with structlog.testing.capture_logs() as logs:
        time.sleep(STALL_S)  # the whole process stops: no heartbeat read, no reaper tick
        await asyncio.sleep(4 * HEARTBEAT_S)  # the reaper's late tick, then the heartbeats'
    if beats is not None:
        await stop(beats)
    return reaper, logs


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_stall_of_the_control_plane_does_not_lose_a_beating_node(
    registry: Registry,
) -> None:
    reaper, logs = await stall_with(registry, beating=True)
    try:
        assert registry.get("decode-0") is not None
        stalls = [e for e in logs if e["event"].startswith("control plane stalled")]
        assert stalls and stalls[0]["log_level"] == "warning"
        assert stalls[0]["stalled_s"] >= STALL_S - 2 * HEARTBEAT_S
        assert not [e for e in logs if e["event"] == "node lost"]
    finally:
        await stop(reaper)


async def test_a_silent_node_is_still_lost_after_the_timeout_of_running_time(
    registry: Registry,
) -> None:
    """Control: no heartbeat at all; the stall delays the loss, does not prevent it."""
    reaper, _ = await stall_with(registry, beating=False)
    try:
        lost_by = asyncio.get_running_loop().time() + 3.0
        while registry.get("decode-0") is not None:
            assert asyncio.get_running_loop().time() < lost_by, "a silent node was never lost"
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        await stop(reaper)
