"""EventBus against a real Mosquitto: ordering, broker restarts, buffer bounds, retained status."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiomqtt
import typer
from fixtures_mqtt import Mosquitto, free_port, start_mosquitto
from typer.testing import CliRunner

from kvfence.cli.events import register
from kvfence.events import EVENT_KINDS, SECURITY_KINDS, EventBus, follow, node_topic
from kvfence.metrics import Metrics

CLUSTER = "t1"


def make_bus(broker: Mosquitto | None = None, port: int | None = None, **kw: Any) -> EventBus:
    host = None if broker is None and port is None else "127.0.0.1"
    return EventBus(CLUSTER, "node-a", host, port or (broker.port if broker else 1883), **kw)


@asynccontextmanager
async def subscriber(broker: Mosquitto, topic: str) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(broker.host, broker.port) as client:
        await client.subscribe(topic, qos=1)
        yield client


async def receive(client: aiomqtt.Client, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The next ``n`` messages as (topic-annotated) decoded JSON dicts."""
    out: list[dict[str, Any]] = []

    async def collect() -> None:
        async for message in client.messages:
            assert isinstance(message.payload, bytes)
            out.append({"_topic": str(message.topic), **json.loads(message.payload)})
            if len(out) == n:
                return

    await asyncio.wait_for(collect(), timeout)
    return out


async def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def emit_all_kinds(bus: EventBus) -> list[int]:
    seqs = []
    for kind in EVENT_KINDS:
        payload = {"check": "mac"} if kind == "integrity_violation" else {"request_id": f"r-{kind}"}
        seqs.append(bus.emit(kind, **payload))
    return seqs


async def test_every_kind_arrives_in_order_with_seq() -> None:
    with start_mosquitto() as broker:
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
            bus = make_bus(broker)
            await bus.start()
            try:
                seqs = emit_all_kinds(bus)
                got = await receive(sub, len(EVENT_KINDS))
            finally:
                await bus.stop()
    assert seqs == list(range(1, len(EVENT_KINDS) + 1))
    assert [e["seq"] for e in got] == seqs
    assert [e["kind"] for e in got] == list(EVENT_KINDS)
    assert [e["_topic"] for e in got] == [f"kvfence/v1/{CLUSTER}/events/{k}" for k in EVENT_KINDS]
    for event in got:
        assert event["cluster"] == CLUSTER and event["node_id"] == "node-a"
        assert isinstance(event["ts"], float)
    assert got[1]["check"] == "mac"
    assert got[0]["request_id"] == "r-admission_rejected"
    assert [e["seq"] for e in bus.recent] == seqs
    assert bus.pending == 0 and bus.dropped == 0


async def test_broker_restart_loses_no_security_event() -> None:
    with start_mosquitto() as broker:
        bus = make_bus(broker)
        await bus.start()
        try:
            await wait_until(lambda: bus.connected)
            before = [bus.emit("node_joined") for _ in range(3)]
            assert await bus.wait_drained(5)

            broker.stop()
            await wait_until(lambda: not bus.connected)
            security = [bus.emit("integrity_violation", check="checksum") for _ in range(5)]
            security += [bus.emit("transfer_failed", reason="timeout") for _ in range(5)]
            plain = bus.emit("request_failed")
            assert bus.pending == 11
            # Let reconnects fail a few times: the backoff grows to >= 0.4 s, so the subscriber
            # below is in place before the bus reconnects and re-sends.
            await asyncio.sleep(1.0)

            broker.start()
            async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
                got = await receive(sub, 11)
                assert await bus.wait_drained(5)
        finally:
            await bus.stop()
    seqs = [e["seq"] for e in got]
    assert sorted(set(seqs)) == [*security, plain]
    assert seqs == sorted(seqs)  # re-sent in order
    assert not set(before) & set(seqs)  # acknowledged events are not re-sent
    assert {e["kind"] for e in got if e["seq"] in security} == {
        "integrity_violation",
        "transfer_failed",
    }


async def test_no_broker_emit_does_not_block_and_keeps_recent() -> None:
    bus = make_bus()  # mqtt_host None: log only
    await bus.start()
    start = time.perf_counter()
    seqs = [bus.emit("model_access", model="tiny", action="offline") for _ in range(500)]
    elapsed = time.perf_counter() - start
    await bus.stop()
    assert elapsed < 1.0
    assert seqs == list(range(1, 501))
    assert [e["seq"] for e in bus.recent] == seqs
    assert bus.recent[-1]["model"] == "tiny" and bus.pending == 0  # nothing buffered without MQTT
    # Awkward payloads (a structlog keyword, a non-JSON value) are still recorded, not raised.
    assert bus.emit("request_failed", event="x", obj=object()) == 501
    # A payload field named like a header field cannot forge the header.
    assert bus.emit("request_failed", seq=7, node_id="other") == 502
    assert bus.recent[-1]["seq"] == 502 and bus.recent[-1]["node_id"] == "node-a"
    assert bus.recent[-1]["payload_seq"] == 7 and bus.recent[-1]["payload_node_id"] == "other"


async def test_unreachable_broker_emit_does_not_block() -> None:
    bus = make_bus(port=free_port())  # nothing listens there
    await bus.start()
    start = time.perf_counter()
    seqs = [bus.emit("node_lost", node="n2") for _ in range(500)]
    emitted_in = time.perf_counter() - start
    stop_start = time.perf_counter()
    await bus.stop(flush_timeout=0.2)
    assert emitted_in < 1.0 and time.perf_counter() - stop_start < 2.0
    assert len(seqs) == 500 and bus.pending == 500 and not bus.connected


def emit_mixed(bus: EventBus) -> tuple[list[int], list[int]]:
    security, plain = [], []
    for i in range(25):
        if i % 5 == 0:
            security.append(bus.emit("integrity_violation", check="tag"))
        else:
            plain.append(bus.emit("admission_rejected", reason="too_long"))
    return security, plain


def test_buffer_under_bound_drops_nothing() -> None:
    bus = make_bus(port=free_port(), buffer_size=25)  # control: exactly fits
    security, plain = emit_mixed(bus)
    assert bus.pending == 25 and bus.dropped == 0
    assert list(bus._buffer.events) == sorted([*security, *plain])


def test_buffer_bound_drops_oldest_plain_first_and_counts() -> None:
    metrics = Metrics("test")
    bus = make_bus(port=free_port(), buffer_size=10, metrics=metrics)
    security, plain = emit_mixed(bus)
    assert bus.pending == 10 and bus.dropped == 15
    kept = list(bus._buffer.events)
    assert kept == sorted([*security, *plain[-5:]])  # all 5 security + the 5 newest others
    assert b'kvfence_events_dropped_total{service="test"} 15.0' in metrics.render()


def test_buffer_full_of_security_events() -> None:
    bus = make_bus(port=free_port(), buffer_size=3)
    security = [bus.emit("transfer_failed") for _ in range(3)]
    bus.emit("node_joined")  # the newcomer is the only non-security event: it goes
    assert list(bus._buffer.events) == security and bus.dropped == 1
    newest = bus.emit("integrity_violation", check="mac")  # only then the oldest security event
    assert list(bus._buffer.events) == [*security[1:], newest] and bus.dropped == 2
    assert {"transfer_failed", "integrity_violation", "node_refused"} == SECURITY_KINDS


async def test_buffered_before_start_then_delivered() -> None:
    port = free_port()
    bus = make_bus(port=port, buffer_size=10)
    security, plain = emit_mixed(bus)  # before start: buffered (bounded), nothing lost or blocked
    with start_mosquitto(port) as broker:
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
            await bus.start()
            try:
                got = await receive(sub, 10)
                assert await bus.wait_drained(5)
            finally:
                await bus.stop()
    assert [e["seq"] for e in got] == sorted([*security, *plain[-5:]])


async def test_emit_from_another_thread_is_delivered() -> None:
    with start_mosquitto() as broker:
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
            bus = make_bus(broker)
            await bus.start()
            try:
                thread = threading.Thread(
                    target=lambda: [bus.emit("node_joined") for _ in range(5)]
                )
                thread.start()
                thread.join()
                got = await receive(sub, 5)
            finally:
                await bus.stop()
    assert [e["seq"] for e in got] == [1, 2, 3, 4, 5]


async def test_node_status_is_retained_for_late_subscribers() -> None:
    with start_mosquitto() as broker:
        bus = make_bus(broker)
        await bus.start()
        try:
            bus.publish_node_status({"role": "decode", "free_pages": 7})
            assert await bus.wait_drained(5)
            async with subscriber(broker, f"kvfence/v1/{CLUSTER}/nodes/#") as late:
                (status,) = await receive(late, 1)
        finally:
            await bus.stop()
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/nodes/#") as after_stop:
            (offline,) = await receive(after_stop, 1)
    assert status["_topic"] == node_topic(CLUSTER, "node-a")
    assert status["free_pages"] == 7 and status["role"] == "decode" and status["online"] is True
    assert offline["online"] is False and offline["node_id"] == "node-a"


async def test_follow_filters_kinds_and_dedupes() -> None:
    with start_mosquitto() as broker:
        got: list[dict[str, Any]] = []

        async def run_follow() -> None:
            async for event in follow(CLUSTER, broker.host, broker.port, kinds=["node_lost"]):
                got.append(event)
                if len(got) == 2:
                    return

        task = asyncio.create_task(run_follow())
        async with aiomqtt.Client(broker.host, broker.port) as pub:
            first = {"seq": 1, "ts": 1.5, "kind": "node_lost", "cluster": CLUSTER, "node_id": "x"}
            second = {**first, "seq": 2}

            async def send(event: dict[str, Any]) -> None:
                topic = f"kvfence/v1/{CLUSTER}/events/{event['kind']}"
                await pub.publish(topic, json.dumps(event), qos=1)

            # The follower subscribes asynchronously: repeat the first event until it is seen.
            while not got:
                await send(first)
                await send({**first, "kind": "node_joined", "seq": 99})  # filtered out
                await asyncio.sleep(0.05)
            await send(first)  # a re-sent duplicate
            await send(second)
            await asyncio.wait_for(task, 5)
    assert got == [first, second]


def make_cli() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)  # keep "events" a subcommand
    register(app, {})
    return app


def test_cli_events_unreachable_broker_exits_1() -> None:
    port = free_port()
    result = CliRunner().invoke(make_cli(), ["events", "--follow", "--mqtt-port", str(port)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "unreachable" in lines[0]


def test_cli_events_requires_follow() -> None:
    result = CliRunner().invoke(make_cli(), ["events"])
    assert result.exit_code == 2 and "--follow" in result.output


async def test_cli_events_follow_json() -> None:
    with start_mosquitto() as broker:
        args = ["events", "-f", "--mqtt-port", str(broker.port), "--cluster", CLUSTER]
        args += ["--json", "--limit", "1", "--kind", "integrity_violation"]
        cli = asyncio.create_task(asyncio.to_thread(CliRunner().invoke, make_cli(), args))
        bus = make_bus(broker)
        await bus.start()
        try:
            # The CLI subscribes at its own pace: keep emitting until it exits.
            while not cli.done():
                bus.emit("node_joined")
                bus.emit("integrity_violation", check="checksum", request_id="r1")
                await asyncio.sleep(0.05)
            result = await cli
        finally:
            await bus.stop()
    assert result.exit_code == 0, result.output
    # CliRunner swaps sys.stdout process-wide, so the bus's own log lines land there too.
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("{")]
    event = json.loads(line)
    assert event["kind"] == "integrity_violation" and event["check"] == "checksum"
    assert event["node_id"] == "node-a" and event["cluster"] == CLUSTER


def test_names_that_cannot_be_topic_levels_are_refused() -> None:
    for node_id in ("bad+node", "#", "a/b", ""):
        try:
            EventBus(CLUSTER, node_id, "127.0.0.1")
        except ValueError as err:
            assert "node_id" in str(err)
        else:
            raise AssertionError(f"node_id {node_id!r} accepted")
    for cluster in ("c/1", "c+"):
        try:
            EventBus(cluster, "node-a", None)  # refused even without a broker: fail early
        except ValueError as err:
            assert "cluster" in str(err)
        else:
            raise AssertionError(f"cluster {cluster!r} accepted")
    try:
        EventBus(CLUSTER, "node-a", "")
    except ValueError as err:
        assert "mqtt_host" in str(err)
    else:
        raise AssertionError("empty mqtt_host accepted")
    # control: the names the config allows, and no broker (None), are fine
    assert EventBus("prod.eu-1", "decode-0.zone_a", "127.0.0.1").node_id == "decode-0.zone_a"
    assert EventBus(CLUSTER, "node-a", None).mqtt_host is None


def test_the_buffer_index_stays_small_while_every_event_is_acknowledged() -> None:
    """The index of plain events only shrank when the buffer was full: with a healthy broker it
    grew by one entry per event for the life of the process. (That the index still finds the
    oldest plain event when the buffer fills: test_buffer_bound_drops_oldest_plain_first...)"""
    from kvfence.events import _Buffer

    buf = _Buffer(capacity=10)
    for seq in range(1, 100_001):
        buf.add({"seq": seq, "kind": "node_joined"})
        buf.ack(seq)
    assert len(buf) == 0 and len(buf._plain) == 0


async def test_stop_with_a_backlog_still_leaves_the_node_offline() -> None:
    """stop() queued the offline status behind every buffered event; when the flush timed out
    first, the clean disconnect also suppressed the will, and the retained status said online
    for good. (A stop without a backlog: test_node_status_is_retained_for_late_subscribers.)"""
    with start_mosquitto() as broker:
        bus = make_bus(broker, buffer_size=100_000)
        await bus.start()
        bus.publish_node_status({"role": "decode"})
        assert await bus.wait_drained(5)
        for _ in range(80_000):
            bus.emit("node_joined", pad="x" * 200)
        await asyncio.sleep(0.05)  # the publisher is busy with the backlog
        await bus.stop(flush_timeout=0.2)
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/nodes/#") as after_stop:
            (status,) = await receive(after_stop, 1)
    assert status["online"] is False and status["node_id"] == "node-a"


async def test_stop_returns_when_the_broker_hangs() -> None:
    """A broker frozen mid-backlog held stop() for good: aiomqtt's disconnect timed out, its
    MqttError replaced the cancellation, and the publisher reconnected. Control: the same
    stop against a healthy broker is quick."""
    import os
    import signal

    with start_mosquitto() as broker:
        for frozen in (False, True):
            bus = make_bus(broker, buffer_size=10_000)
            await bus.start()
            t0 = time.monotonic()
            while not bus.connected:
                assert time.monotonic() - t0 < 5
                await asyncio.sleep(0.01)
            assert broker.proc is not None
            if frozen:
                os.kill(broker.proc.pid, signal.SIGSTOP)
            try:
                for _ in range(400 if frozen else 10):
                    bus.emit("node_joined", pad="x" * 200_000)  # more than the socket buffers
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                await asyncio.wait_for(bus.stop(flush_timeout=0.5), 15)
                elapsed = time.monotonic() - t0
            finally:
                if frozen:
                    os.kill(broker.proc.pid, signal.SIGCONT)
            assert elapsed < (7.5 if frozen else 1.5), (frozen, elapsed)
