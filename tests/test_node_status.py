"""A running node's retained status on MQTT, its event buffer settings, and a failed start."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import aiomqtt
import pytest
from fixtures_mqtt import free_port, start_mosquitto

from kvfence.config import Role, parse_config
from kvfence.events import node_topic
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node
from kvfence.server import BindError

CLUSTER = "t-status"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def make_cfg(tiny_dir, tmp_path, node_id: str, port: int, **over: Any):
    data: dict[str, Any] = {
        "cluster": CLUSTER,
        "model": {"path": str(tiny_dir)},
        "kv": {"page_size": 16, "prefill_pool": {"num_pages": 8}, "decode_pool": {"num_pages": 8}},
        "node": {"node_id": node_id},
        "control_plane": {"state_dir": str(tmp_path)},
        "events": {"mqtt_host": "127.0.0.1", "mqtt_port": port},
    }
    for key, value in over.items():
        data.setdefault(key, {}).update(value)
    return parse_config(data, environ={})


async def retained(
    port: int, node_id: str, timeout: float = 5.0, **account: str
) -> dict[str, Any] | None:
    """The retained status of ``node_id`` as a new subscriber sees it (None: nothing retained);
    ``account``: username= and password= for a broker that wants them."""
    async with aiomqtt.Client("127.0.0.1", port, **account) as client:
        await client.subscribe(node_topic(CLUSTER, node_id), qos=1)

        async def first() -> dict[str, Any]:
            async for message in client.messages:
                if not message.retain:  # published live after we subscribed: not what we ask
                    continue
                assert isinstance(message.payload, bytes)
                return dict(json.loads(message.payload))
            raise AssertionError("subscription ended")

        try:
            return await asyncio.wait_for(first(), timeout)
        except TimeoutError:
            return None


async def wait_status(port: int, node_id: str, online: bool) -> dict[str, Any]:
    """Poll until the retained status says ``online`` (the bus publishes asynchronously)."""
    status = None
    for _ in range(50):
        status = await retained(port, node_id, timeout=0.5)
        if status is not None and status.get("online") is online:
            return status
    raise AssertionError(f"retained status of {node_id} never became online={online}: {status}")


async def test_node_publishes_retained_online_status_and_offline_at_stop(tiny_dir, tmp_path):
    with start_mosquitto() as broker:
        assert await retained(broker.port, "decode-s1", timeout=0.5) is None  # nothing yet
        node = await start_node(
            make_cfg(tiny_dir, tmp_path, "decode-s1", broker.port), Role.DECODE, register=False
        )
        try:
            online = await wait_status(broker.port, "decode-s1", online=True)
        finally:
            await node.stop(grace=0)
        offline = await wait_status(broker.port, "decode-s1", online=False)
    assert online["role"] == "decode" and online["node_id"] == "decode-s1"
    assert online["cluster"] == CLUSTER
    assert online["grpc_address"] == node.address
    assert online["ucx_address"] == node.receiver.address and online["ucx_address"]
    assert online["model_fingerprint"] == node.rt.fingerprint
    assert online["total_pages"] == 8 and online["instance_id"]
    assert offline["node_id"] == "decode-s1" and offline["online"] is False


@pytest.mark.parametrize("password", ["node-secret", "wrong", None])
async def test_a_node_publishes_with_its_broker_account(tiny_dir, tmp_path, password) -> None:
    """A broker that refuses anonymous clients (the chart's default): a node configured with its
    account publishes its status; with a wrong password, or none, it is refused, says so, and
    publishes nothing (and still starts: events never stop a service)."""
    reader = {"username": "reader", "password": "reader-secret"}
    users = {"kvfence": "node-secret", "reader": "reader-secret"}
    with start_mosquitto(users=users) as broker:
        events: dict[str, Any] = {}
        if password is not None:
            (tmp_path / "mqtt-password").write_text(password + "\n")
            events = {
                "mqtt_username": "kvfence",
                "mqtt_password_file": str(tmp_path / "mqtt-password"),
            }
        cfg = make_cfg(tiny_dir, tmp_path, "decode-acct", broker.port, events=events)
        node = await start_node(cfg, Role.DECODE, register=False)
        try:
            if password == "node-secret":
                for _ in range(50):
                    status = await retained(broker.port, "decode-acct", timeout=0.5, **reader)
                    if status is not None:
                        break
                assert status is not None and status["online"] is True
                assert node.bus.last_error is None
            else:
                for _ in range(50):
                    if node.bus.last_error is not None:
                        break
                    await asyncio.sleep(0.1)
                assert "not authorized" in (node.bus.last_error or "").lower()
                assert await retained(broker.port, "decode-acct", timeout=0.5, **reader) is None
        finally:
            await node.stop(grace=0)


async def test_node_event_bus_uses_buffer_size_and_counts_drops(tiny_dir, tmp_path):
    # a broker that is never reachable: every event stays buffered until the buffer is full
    cfg = make_cfg(tiny_dir, tmp_path, "prefill-s2", free_port(), events={"buffer_size": 5})
    node = await start_node(cfg, Role.PREFILL, register=False)
    try:
        assert node.bus.metrics is node.metrics
        for _ in range(5):
            node.bus.emit("node_joined")
        # control: up to buffer_size nothing is dropped
        assert node.bus.pending == 5 and node.bus.dropped == 0
        assert b'kvfence_events_dropped_total{service="prefill"} 0.0' in node.metrics.render()
        for _ in range(3):
            node.bus.emit("node_joined")
        assert node.bus.pending == 5 and node.bus.dropped == 3
        assert b'kvfence_events_dropped_total{service="prefill"} 3.0' in node.metrics.render()
    finally:
        await node.stop(grace=0)


async def test_node_that_cannot_bind_leaves_the_running_nodes_status_alone(tiny_dir, tmp_path):
    with start_mosquitto() as broker:
        first = await start_node(
            make_cfg(tiny_dir, tmp_path, "prefill-s3", broker.port), Role.PREFILL, register=False
        )
        try:
            before = await wait_status(broker.port, "prefill-s3", online=True)
            # the same id on the same port: the bind fails, with the address in the message
            taken = first.address
            twin = make_cfg(tiny_dir, tmp_path, "prefill-s3", broker.port, node={"listen": taken})
            with pytest.raises(BindError, match=f"cannot listen on {taken}"):
                await start_node(twin, Role.PREFILL, register=False)
            after = await retained(broker.port, "prefill-s3")
            assert after == before  # still the running node's online status
        finally:
            await first.stop(grace=0)


@pytest.mark.parametrize("fails", [True, False])
async def test_a_node_stop_that_fails_is_logged(monkeypatch, fails: bool) -> None:
    """serve_node used to swallow whatever node.stop() raised: an unclean shutdown left no
    trace. The control: a clean stop logs nothing of the kind."""
    import structlog

    from kvfence import node_main

    drains: list[float] = []

    class Node:
        async def stop(self, *, drain_timeout_s: float) -> None:
            drains.append(drain_timeout_s)
            if fails:
                raise RuntimeError("a receiver would not stop")

    async def start(cfg: Any, role: Any) -> Node:
        return Node()

    monkeypatch.setattr(node_main, "start_node", start)
    stop = asyncio.Event()
    stop.set()
    cfg = SimpleNamespace(node=SimpleNamespace(drain_timeout_s=7.0))
    with structlog.testing.capture_logs() as logs:
        await node_main.serve_node(cfg, Role.DECODE, stop)  # type: ignore[arg-type]
    failed = [e for e in logs if e["event"] == "node stop failed"]
    assert len(failed) == (1 if fails else 0)
    assert drains == [7.0]  # SIGTERM's stop drains first, for node.drain_timeout_s
