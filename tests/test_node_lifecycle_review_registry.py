"""What the control plane's registry remembers of replaced node processes: each is warned about
once, and nothing is left behind once the node id is gone (``control_plane.registry``)."""

from __future__ import annotations

import pytest
import structlog

from control_plane.model_info import ByteTokenizer, ModelInfo
from control_plane.registry import Registry
from kvfence import PROTOCOL_VERSION
from kvfence.proto.kvfence.v1 import common_pb2, control_pb2

LAYOUT = common_pb2.KvLayout(
    page_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8
)
WARNING = "heartbeat from a replaced process ignored"


@pytest.fixture(autouse=True)
def _default_structlog() -> None:
    structlog.reset_defaults()


def new_registry(heartbeat_s: float = 1.0, timeout_s: float = 2.0) -> Registry:
    model = ModelInfo(
        name="m",
        context_window=256,
        fingerprint="sha256:m",
        layout=LAYOUT,
        vocab_size=384,
        tokenizer=ByteTokenizer(),
    )
    return Registry(
        model,
        heartbeat_s,
        timeout_s,
        failures_to_cool=3,
        failure_cooldown_s=10.0,
        refused_room_max_s=5.0,
    )


@pytest.fixture
def registry() -> Registry:
    return new_registry()


def register(registry: Registry, node_id: str, instance: str, address: str) -> None:
    request = control_pb2.RegisterRequest(
        node_id=node_id,
        role="decode",
        grpc_address=address,
        model_fingerprint="sha256:m",
        layout=LAYOUT,
        pool_tokens=384,
        total_pages=24,
        instance_id=instance,
        protocol_version=PROTOCOL_VERSION,
    )
    assert registry.register(request).accepted


def beat(registry: Registry, node_id: str, instance: str) -> control_pb2.HeartbeatResponse:
    return registry.heartbeat(control_pb2.HeartbeatRequest(node_id=node_id, instance_id=instance))


def test_node_ids_that_come_and_go_leave_nothing_behind(registry: Registry) -> None:
    """Every replaced process that heartbeat was remembered by node id for good: 1000 pods of
    rolling updates, 1000 entries. Now a node id's entry goes with the node. Control: while the
    node is registered the replaced process is remembered (its beats are not warned about
    again)."""
    for i in range(1000):
        node_id = f"decode-{i}"
        register(registry, node_id, "old", "10.0.0.1:1")
        register(registry, node_id, "new", "10.0.0.2:1")  # its replacement, same id
        assert beat(registry, node_id, "old").superseded
        assert len(registry._superseded_warned) == 1  # control: remembered while registered
        node = registry.get(node_id)
        assert node is not None
        registry.lose(node, "gone")
    assert registry.nodes() == []
    assert registry._superseded_warned == {}


def test_each_replaced_process_is_warned_about_once(registry: Registry) -> None:
    """Two old processes beating under one id (one remembered at a time) were warned about at
    every beat, turn by turn; each is warned about once now. A replacement that is lost and
    replaced again makes a process still beating a new case, warned about once more."""
    register(registry, "decode-0", "a", "10.0.0.1:1")
    register(registry, "decode-0", "b", "10.0.0.2:1")
    register(registry, "decode-0", "c", "10.0.0.3:1")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert beat(registry, "decode-0", "a").superseded
            assert beat(registry, "decode-0", "b").superseded
            assert beat(registry, "decode-0", "c").known  # the registered one: no warning
    assert len([e for e in logs if e["event"] == WARNING]) == 2
    node = registry.get("decode-0")
    assert node is not None
    registry.lose(node, "drained")
    register(registry, "decode-0", "d", "10.0.0.4:1")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert beat(registry, "decode-0", "a").superseded
    assert len([e for e in logs if e["event"] == WARNING]) == 1


@pytest.mark.parametrize("draining", [True, False], ids=["drained", "control"])
def test_a_drained_node_leaving_is_no_warning(registry: Registry, draining: bool) -> None:
    """A node that drained and stopped (every rolling upgrade) was logged as a warning, "node
    lost", like a crashed one. It is "drained node left" at info now. Control: a node that was
    not draining when its heartbeats stopped is still "node lost", a warning."""
    register(registry, "decode-0", "a", "10.0.0.1:1")
    node = registry.get("decode-0")
    assert node is not None
    node.draining = draining
    node.last_heartbeat -= 10.0  # silent for longer than node_timeout_s (2 s)
    with structlog.testing.capture_logs() as logs:
        assert registry.reap() == [node]
    [line] = [e for e in logs if e["event"] in ("node lost", "drained node left")]
    if draining:
        assert (line["event"], line["log_level"]) == ("drained node left", "info")
        assert line["why"].endswith("after draining")
    else:
        assert (line["event"], line["log_level"]) == ("node lost", "warning")
    assert registry.nodes() == []
