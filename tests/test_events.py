"""EventBus against a real Mosquitto: ordering, broker restarts, buffer bounds, retained status,
and brokers that require an account."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import queue
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import aiomqtt
import pytest
import structlog
import typer
from fixtures_mqtt import BrokerTls, Mosquitto, free_port, start_mosquitto
from test_tls import make_ca, make_leaf
from typer.testing import CliRunner

from kvfence.cli.events import register
from kvfence.config import ConfigError, parse_config
from kvfence.events import (
    EVENT_KINDS,
    PUBLISH_TIMEOUT_S,
    SECURITY_KINDS,
    EventBus,
    MqttCredentials,
    MqttTls,
    follow,
    is_auth_refusal,
    is_tls_failure,
    load_mqtt_credentials,
    load_mqtt_tls,
    node_topic,
)
from kvfence.metrics import Metrics

CLUSTER = "t1"


def make_bus(broker: Mosquitto | None = None, port: int | None = None, **kw: Any) -> EventBus:
    host = None if broker is None and port is None else "127.0.0.1"
    return EventBus(CLUSTER, "node-a", host, port or (broker.port if broker else 1883), **kw)


@asynccontextmanager
async def subscriber(
    broker: Mosquitto,
    topic: str,
    account: MqttCredentials | None = None,
    tls: MqttTls | None = None,
) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(
        broker.host,
        broker.port,
        username=None if account is None else account.username,
        password=None if account is None else account.password,
        tls_context=None if tls is None else tls.context(),
    ) as client:
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


# Calls that wait: on the clock, on the network, on another thread. emit runs inside request
# handlers on the event loop, so one of these in it stalls every request of the node while the
# broker is slow, down or refusing ("never blocks": EventBus.emit). Asserted by watching every
# call emit makes (emit_without_waiting), not by timing it, which a loaded machine would flake.
_WAITING_BUILTINS = (time.sleep, select.select)
_POLLERS = (select.epoll, type(select.poll()))
_WAITING_CODE = {
    threading.Event.wait.__code__,
    threading.Condition.wait.__code__,
    threading.Thread.join.__code__,
    concurrent.futures.Future.result.__code__,
    queue.Queue.get.__code__,
    queue.Queue.put.__code__,
    socket.create_connection.__code__,
}
# socket methods that wait for the peer or the network unless the socket is non-blocking (the
# event loop's own wake-up socket is, so a cross-thread emit's poke is no wait)
_SOCKET_WAITS = {
    "accept",
    "connect",
    "connect_ex",
    "recv",
    "recv_into",
    "recvfrom",
    "recvfrom_into",
    "recvmsg",
    "send",
    "sendall",
    "sendmsg",
    "sendto",
}


def _waiting_call(frame: FrameType, event: str, arg: Any) -> str | None:
    """What the call a profile hook was told about waits on, or None when it does not wait."""
    if event == "call" and frame.f_code in _WAITING_CODE:
        return frame.f_code.co_qualname
    if event != "c_call":
        return None
    if any(arg is f for f in _WAITING_BUILTINS):
        return f"{arg.__module__}.{arg.__name__}"
    owner = getattr(arg, "__self__", None)
    if isinstance(owner, _POLLERS) and arg.__name__ == "poll":
        return f"{type(owner).__name__}.poll"
    if (
        isinstance(owner, socket.socket)
        and arg.__name__ in _SOCKET_WAITS
        and owner.gettimeout() != 0.0
    ):
        return f"socket.{arg.__name__}"
    return None


def emit_without_waiting(bus: EventBus, n: int, kind: str, **payload: Any) -> list[int]:
    """``n`` emits of ``kind``, their seqs; fails if any of them made a call that waits
    (``_waiting_call``). emit is a plain function, so it cannot await either: the event loop
    does not run between the calls, and nothing else (the publisher) can make progress."""
    waits: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if (what := _waiting_call(frame, event, arg)) is not None:
            waits.append(what)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        seqs = [bus.emit(kind, **payload) for _ in range(n)]
    finally:
        sys.setprofile(previous)
    assert waits == [], f"emit waited: {sorted(set(waits))}"
    assert all(isinstance(s, int) and s > 0 for s in seqs), seqs  # recorded, not a coroutine
    return seqs


def emit_all_kinds(bus: EventBus) -> list[int]:
    seqs = []
    for kind in EVENT_KINDS:
        payload = {"check": "mac"} if kind == "integrity_violation" else {"request_id": f"r-{kind}"}
        seqs.append(bus.emit(kind, **payload))
    return seqs


async def deliver_all_kinds(
    bus: EventBus, sub: aiomqtt.Client
) -> tuple[list[int], list[dict[str, Any]]]:
    """Start ``bus``, emit one event of every kind, and return their seqs and what ``sub`` got
    (the bus drained, then stopped)."""
    await bus.start()
    try:
        seqs = emit_all_kinds(bus)
        got = await receive(sub, len(EVENT_KINDS))
        assert await bus.wait_drained(5)
    finally:
        await bus.stop()
    return seqs, got


async def test_every_kind_arrives_in_order_with_seq() -> None:
    with start_mosquitto() as broker:
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
            bus = make_bus(broker)
            seqs, got = await deliver_all_kinds(bus, sub)
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
    seqs = emit_without_waiting(bus, 500, "model_access", model="tiny", action="offline")
    await bus.stop()
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
    seqs = emit_without_waiting(bus, 500, "node_lost", node="n2")
    assert seqs == list(range(1, 501)) and bus.pending == 500 and not bus.connected
    with structlog.testing.capture_logs() as logs:
        # stop's own bound (the flush timeout, then PUBLISH_TIMEOUT_S + 1 for the disconnect),
        # some thirty times what it takes: a stop that waited for the unreachable broker would
        # never end. The logs tell a publisher that ended on the cancel from one that only the
        # bounded wait got past.
        await asyncio.wait_for(bus.stop(flush_timeout=0.2), 0.2 + PUBLISH_TIMEOUT_S + 1)
    assert not bus.connected and bus.pending == 500
    undelivered = [e for e in logs if e["event"] == "events not delivered at stop"]
    assert [e["pending"] for e in undelivered] == [500]
    assert not [e for e in logs if e["event"] == "event bus publisher still disconnecting at stop"]


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


# --- a broker that requires an account ------------------------------------------------------------

PUBLISHER = MqttCredentials("kvfence", "pub-Secret-7f3a")
WATCHER = MqttCredentials("watcher", "watch-Secret-91c2")
ACCOUNTS = {PUBLISHER.username: PUBLISHER.password, WATCHER.username: WATCHER.password}
SECRETS = (PUBLISHER.password, WATCHER.password, "wrong-Secret-0000")


def assert_no_password(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


async def test_publisher_with_the_broker_account_delivers() -> None:
    """Positive control for the refusals below: the same broker (anonymous clients refused),
    with the right account, gets every event, and so does an authenticated subscriber."""
    with start_mosquitto(users=ACCOUNTS) as broker:
        topic = f"kvfence/v1/{CLUSTER}/events/#"
        async with subscriber(broker, topic, WATCHER) as sub:
            bus = make_bus(broker, credentials=PUBLISHER)
            with structlog.testing.capture_logs() as logs:
                seqs, got = await deliver_all_kinds(bus, sub)
    assert [e["seq"] for e in got] == seqs
    assert bus.last_error is None and bus.pending == 0
    connected = [e for e in logs if e["event"] == "event bus connected"]
    assert connected and connected[0]["username"] == "kvfence"
    assert_no_password(repr(logs) + repr(bus.credentials))


@pytest.mark.parametrize(
    "account",
    [None, MqttCredentials("kvfence", "wrong-Secret-0000"), MqttCredentials("nobody", "x")],
    ids=["anonymous", "wrong-password", "unknown-user"],
)
async def test_broker_refuses_the_publisher_without_the_right_account(
    account: MqttCredentials | None, capfd: pytest.CaptureFixture[str]
) -> None:
    """The broker refuses the connection; the publisher says so as an error naming the account
    (never a password) and keeps the events buffered; emit neither blocks nor raises, and no
    event reaches the broker's subscribers."""
    with start_mosquitto(users=ACCOUNTS) as broker:
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/#", WATCHER) as sub:
            bus = make_bus(broker, credentials=account)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    seqs = emit_without_waiting(bus, 200, "integrity_violation", check="mac")
                    await wait_until(lambda: bus.last_error is not None)
                    await asyncio.sleep(0.3)  # a few refused reconnects
                    with pytest.raises(TimeoutError):
                        await receive(sub, 1, timeout=0.5)
                    assert not bus.connected and bus.pending == len(seqs)
                    assert not await bus.wait_drained(0.1)
                finally:
                    await bus.stop(flush_timeout=0.1)
    assert seqs == list(range(1, 201))
    assert "not authori" in (bus.last_error or "").lower()
    refused = [e for e in logs if e["event"] == "event bus refused by the broker"]
    assert refused and refused[0]["log_level"] == "error"
    assert refused[0]["username"] == (None if account is None else account.username)
    hint = refused[0]["hint"]
    assert "events.mqtt_username" in hint and "events.mqtt_password_file" in hint
    # Retried every backoff step but said once as an error (same reason, within the interval).
    assert [e["log_level"] for e in refused].count("error") == 1
    assert not [e for e in logs if e["event"] == "event bus connected"]
    out, err = capfd.readouterr()
    assert_no_password(repr(logs) + out + err + repr(bus.credentials))


def test_auth_refusal_is_told_from_other_mqtt_errors() -> None:
    from aiomqtt.exceptions import MqttConnectError
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    assert is_auth_refusal(MqttConnectError(ReasonCode(PacketTypes.CONNACK, "Not authorized")))
    assert is_auth_refusal(MqttConnectError(4)) and is_auth_refusal(MqttConnectError(5))
    # paho's own error numbers 4 and 5 ("no connection", TCP "connection refused") are not it
    assert not is_auth_refusal(aiomqtt.MqttCodeError(4)) and not is_auth_refusal(
        aiomqtt.MqttCodeError(5)
    )
    assert not is_auth_refusal(MqttConnectError(3))  # server unavailable
    assert not is_auth_refusal(aiomqtt.MqttError("[Errno 111] Connection refused"))


def test_credentials_never_show_their_password() -> None:
    assert "pub-Secret" not in repr(PUBLISHER) and "kvfence" in repr(PUBLISHER)
    with pytest.raises(ValueError, match="empty"):
        MqttCredentials("kvfence", "")
    with pytest.raises(ValueError, match="empty"):
        MqttCredentials("", "x")


def events_config(tmp_path: Path, password: str | None, **events: Any) -> Any:
    pw_file = tmp_path / "mqtt-password"
    if password is not None:
        pw_file.write_text(password)
    data = {"mqtt_host": "127.0.0.1", "mqtt_username": "kvfence", "mqtt_password_file": pw_file}
    return parse_config({"cluster": CLUSTER, "events": {**data, **events}}, environ={})


def test_credentials_come_from_the_password_file(tmp_path: Path) -> None:
    # a Secret written with `echo` ends with a newline: not part of the password
    cfg = events_config(tmp_path, PUBLISHER.password + "\n")
    assert load_mqtt_credentials(cfg.events) == PUBLISHER
    bus = EventBus.from_config(cfg, "node-a")
    assert bus.credentials == PUBLISHER and bus.mqtt_host == "127.0.0.1"
    assert (bus.cluster, bus.node_id) == (CLUSTER, "node-a")
    # no broker: nothing to authenticate to, the file is not read (it need not exist)
    no_broker = events_config(tmp_path / "nowhere", None, mqtt_host=None)
    assert load_mqtt_credentials(no_broker.events) is None
    assert EventBus.from_config(no_broker, "node-a").credentials is None
    # no account: anonymous
    plain = parse_config({"events": {"mqtt_host": "127.0.0.1"}}, environ={})
    assert load_mqtt_credentials(plain.events) is None


@pytest.mark.parametrize(
    ("password", "message"),
    [(None, "cannot read it"), ("", "is empty"), ("\n\n", "is empty")],
    ids=["missing", "empty", "only-newlines"],
)
def test_an_unusable_password_file_is_a_clear_config_error(
    tmp_path: Path, password: str | None, message: str
) -> None:
    cfg = events_config(tmp_path, password)
    with pytest.raises(ConfigError) as err:
        EventBus.from_config(cfg, "node-a")
    assert "events.mqtt_password_file" in str(err.value) and message in str(err.value)
    assert str(tmp_path / "mqtt-password") in str(err.value)


async def follow_one(broker: Mosquitto, account: MqttCredentials | None) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in follow(CLUSTER, broker.host, broker.port, credentials=account):
            return event
        raise AssertionError("follow ended")

    task = asyncio.create_task(first())
    bus = make_bus(broker, credentials=PUBLISHER)
    await bus.start()
    try:
        while not task.done():  # follow subscribes at its own pace
            bus.emit("node_lost", node="n2")
            await asyncio.sleep(0.05)
        return await task
    finally:
        await bus.stop()


async def test_follow_with_and_without_the_account() -> None:
    with start_mosquitto(users=ACCOUNTS) as broker:
        event = await asyncio.wait_for(follow_one(broker, WATCHER), 10)  # positive control
        assert event["kind"] == "node_lost" and event["node_id"] == "node-a"
        for account in (None, MqttCredentials("watcher", "wrong-Secret-0000")):
            with pytest.raises(aiomqtt.MqttError) as err:
                await asyncio.wait_for(follow_one(broker, account), 10)
            assert is_auth_refusal(err.value), err.value


def run_cli(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(make_cli(), args, env=env)


async def cli_while_emitting(
    args: list[str], bus: EventBus, env: dict[str, str] | None = None
) -> Any:
    """Run ``kvfence events -f --limit 1 ARGS`` while ``bus`` keeps emitting: a CLI that
    connects gets an event and exits 0 (instead of following forever), one that cannot exits 1."""
    command = ["events", "-f", "--limit", "1", *args]
    cli = asyncio.create_task(asyncio.to_thread(run_cli, command, env))
    while not cli.done():
        bus.emit("node_joined")
        await asyncio.sleep(0.05)
    return await cli


async def test_cli_events_follow_with_an_account(tmp_path: Path) -> None:
    """Positive control for the refusal below: the account from the flags, from the env, or
    from the config file's events section."""
    pw_file = tmp_path / "pw"
    pw_file.write_text(WATCHER.password + "\n")
    config = tmp_path / "config.yaml"
    with start_mosquitto(users=ACCOUNTS) as broker:
        config.write_text(
            f"cluster: {CLUSTER}\nevents:\n  mqtt_host: 127.0.0.1\n  mqtt_port: {broker.port}\n"
            f"  mqtt_username: watcher\n  mqtt_password_file: {pw_file}\n"
        )
        target = ["--mqtt-port", str(broker.port), "--cluster", CLUSTER]
        ways: list[tuple[list[str], dict[str, str] | None]] = [
            ([*target, "--mqtt-username", "watcher", "--mqtt-password-file", str(pw_file)], None),
            (
                target,
                {"KVFENCE_MQTT_USERNAME": "watcher", "KVFENCE_MQTT_PASSWORD": "watch-Secret-91c2"},
            ),
            (["--config", str(config)], None),
        ]
        bus = make_bus(broker, credentials=PUBLISHER)
        await bus.start()
        try:
            for extra, env in ways:
                result = await cli_while_emitting(["--json", *extra], bus, env)
                assert result.exit_code == 0, result.output
                (line,) = [ln for ln in result.output.splitlines() if ln.startswith("{")]
                assert json.loads(line)["kind"] == "node_joined"
                assert_no_password(result.output)
        finally:
            await bus.stop()


def test_cli_events_refused_account_exits_1_and_says_so(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-Secret-0000")
    with start_mosquitto(users=ACCOUNTS) as broker:
        target = ["events", "-f", "--mqtt-port", str(broker.port)]
        anonymous = run_cli(target)
        bad = run_cli([*target, "--mqtt-username", "watcher", "--mqtt-password-file", str(wrong)])
    assert anonymous.exit_code == 1 and bad.exit_code == 1
    assert f"127.0.0.1:{broker.port} refused a connection without an account" in anonymous.output
    assert "--mqtt-username" in anonymous.output
    assert f"127.0.0.1:{broker.port} refused the account 'watcher'" in bad.output
    assert "Not authorized" in bad.output
    assert_no_password(anonymous.output + bad.output)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--mqtt-username", "watcher"], None, "--mqtt-username without a password"),
        (["--mqtt-password-file", "PW"], None, "a password without --mqtt-username"),
        ([], {"KVFENCE_MQTT_PASSWORD": "x"}, "a password without --mqtt-username"),
        (["--mqtt-username", " ", "--mqtt-password-file", "PW"], None, "is empty"),
        (
            ["--mqtt-username", "watcher", "--mqtt-password-file", "PW"],
            {"KVFENCE_MQTT_PASSWORD": "x"},
            "give the password once",
        ),
        (["--mqtt-username", "watcher", "--mqtt-password-file", "NOPE"], None, "cannot read"),
    ],
)
def test_cli_events_account_usage_errors_exit_2(
    tmp_path: Path, args: list[str], env: dict[str, str] | None, message: str
) -> None:
    pw = tmp_path / "pw"
    pw.write_text("x")
    args = [str(pw) if a == "PW" else str(tmp_path / "nope") if a == "NOPE" else a for a in args]
    result = run_cli(["events", "-f", "--mqtt-port", str(free_port()), *args], env)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_the_event_limiter_lets_a_burst_through_per_window_and_counts_the_rest() -> None:
    from kvfence.events import EventLimiter

    now = [0.0]
    lim = EventLimiter(burst=3, interval_s=10.0, clock=lambda: now[0])
    assert [lim.allow("a") for _ in range(5)] == [True, True, True, False, False]
    assert lim.allow("b")  # control: another key has a window of its own
    assert lim.flush() == []  # no window has closed yet
    now[0] = 10.0
    assert lim.flush() == [("a", 2)]  # "b" held nothing back: nothing to say
    assert [lim.allow("a") for _ in range(4)] == [True, True, True, False]
    now[0] = 25.0
    # a window that closed before flush() took it: counted once the next one opens
    assert lim.allow("a") and lim.flush() == [("a", 1)]
    assert [lim.allow("a") for _ in range(3)] == [True, True, False]
    assert lim.flush() == [] and lim.flush(force=True) == [("a", 1)]
    with pytest.raises(ValueError):
        EventLimiter(burst=0, interval_s=1.0)


# --- TLS to the broker ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca signs server (127.0.0.1, localhost), elsewhere (another host only) and client;
    other-ca is unrelated."""
    d = tmp_path_factory.mktemp("mqtt-pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", "serverAuth")
    make_leaf(d, "elsewhere", "ca", "serverAuth", san="DNS:broker.elsewhere.example")
    make_leaf(d, "client", "ca", "clientAuth")
    return d


def broker_tls(pki: Path, cert: str = "server", **kw: Any) -> BrokerTls:
    return BrokerTls(pki / f"{cert}.pem", pki / f"{cert}.key", pki / "ca.pem", **kw)


def trust(pki: Path, ca: str = "ca", client: str | None = None) -> MqttTls:
    if client is None:
        return MqttTls(pki / f"{ca}.pem")
    return MqttTls(pki / f"{ca}.pem", pki / f"{client}.pem", pki / f"{client}.key")


@asynccontextmanager
async def tls_subscriber(broker: Mosquitto, pki: Path) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(
        broker.host,
        broker.port,
        username=WATCHER.username,
        password=WATCHER.password,
        tls_context=trust(pki).context(),
    ) as client:
        await client.subscribe(f"kvfence/v1/{CLUSTER}/#", qos=1)
        yield client


def tls_events_config(pki: Path, port: int, pw_file: Path, **tls: Any) -> Any:
    pw_file.write_text(PUBLISHER.password)
    events = {
        "mqtt_host": "127.0.0.1",
        "mqtt_port": port,
        "mqtt_username": PUBLISHER.username,
        "mqtt_password_file": pw_file,
        "mqtt_tls_ca_file": pki / "ca.pem",
        **tls,
    }
    return parse_config({"cluster": CLUSTER, "events": events}, environ={})


@pytest.mark.parametrize("client_cert", [False, True], ids=["server-cert", "client-cert-too"])
async def test_publisher_over_tls_with_the_right_ca_delivers(
    pki: Path, tmp_path: Path, client_cert: bool
) -> None:
    """Positive control for the TLS failures below: a broker with a TLS listener (and accounts,
    as the chart runs it; requiring a client certificate too in the second case); kvfence,
    configured with the CA (and its client certificate), delivers every event to a subscriber
    that also speaks TLS."""
    tls = broker_tls(pki, require_certificate=client_cert)
    with start_mosquitto(users=ACCOUNTS, tls=tls) as broker:
        extra = (
            {"mqtt_tls_cert_file": pki / "client.pem", "mqtt_tls_key_file": pki / "client.key"}
            if client_cert
            else {}
        )
        cfg = tls_events_config(pki, broker.port, tmp_path / "pw", **extra)
        bus = EventBus.from_config(cfg, "node-a")
        assert bus.tls == MqttTls(pki / "ca.pem", extra.get("mqtt_tls_cert_file"),
                                  extra.get("mqtt_tls_key_file"))  # fmt: skip
        sub_tls = trust(pki, client="client" if client_cert else None)
        topic = f"kvfence/v1/{CLUSTER}/events/#"
        async with subscriber(broker, topic, WATCHER, tls=sub_tls) as sub:
            with structlog.testing.capture_logs() as logs:
                seqs, got = await deliver_all_kinds(bus, sub)
    assert [e["seq"] for e in got] == seqs
    assert bus.last_error is None and bus.pending == 0
    (connected,) = [e for e in logs if e["event"] == "event bus connected"]
    assert connected["tls"] is True
    assert not [e for e in logs if e["log_level"] == "error"]


async def watch_failures(bus: EventBus, message: str, logs: list[dict[str, Any]]) -> None:
    """Wait for two failed connection attempts that ``message`` names."""
    await wait_until(lambda: len([e for e in logs if e["event"] == message]) >= 2, timeout=10)


@pytest.mark.parametrize(
    ("broker_cert", "client_tls", "message", "error"),
    [
        (
            "server",
            "other-ca",
            "event bus TLS handshake with the broker failed",
            "certificate verify failed",
        ),
        (
            "elsewhere",
            "ca",
            "event bus TLS handshake with the broker failed",
            "not valid for '127.0.0.1'",
        ),
        ("server", None, "event bus got no answer from the broker", "timed out"),
        (None, "ca", "event bus TLS handshake with the broker failed", "Connection reset"),
    ],
    ids=["unknown-ca", "wrong-host", "plain-client-tls-broker", "tls-client-plain-broker"],
)
async def test_a_failed_tls_handshake_keeps_events_buffered_and_says_so(
    pki: Path,
    monkeypatch: pytest.MonkeyPatch,
    broker_cert: str | None,
    client_tls: str | None,
    message: str,
    error: str,
) -> None:
    """The broker's certificate is signed by a CA kvfence does not trust, or names another host;
    or kvfence speaks plain MQTT to a TLS listener (which never answers it), or TLS to a plain
    one. Each time: emit neither blocks nor raises, the events stay buffered, nothing reaches
    the broker's subscribers, and the failure is an error (with a hint) once, then debug."""
    monkeypatch.setattr("kvfence.events.PUBLISH_TIMEOUT_S", 0.5)  # the no-answer wait
    tls = None if broker_cert is None else broker_tls(pki, broker_cert)
    with start_mosquitto(users=ACCOUNTS, tls=tls) as broker:
        bus = make_bus(
            broker,
            credentials=PUBLISHER,
            tls=None if client_tls is None else trust(pki, client_tls),
        )
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                seqs = emit_without_waiting(bus, 200, "integrity_violation", check="mac")
                await watch_failures(bus, message, logs)
                assert not bus.connected and bus.pending == len(seqs)
                assert not await bus.wait_drained(0.1)
                if tls is not None and broker_cert == "server":
                    async with tls_subscriber(broker, pki) as sub:  # a client that can connect
                        with pytest.raises(TimeoutError):
                            await receive(sub, 1, timeout=0.5)
            finally:
                await bus.stop(flush_timeout=0.1)
    assert seqs == list(range(1, 201))
    assert error in (bus.last_error or "")
    failed = [e for e in logs if e["event"] == message]
    assert [e["log_level"] for e in failed].count("error") == 1, failed
    assert failed[0]["log_level"] == "error" and failed[0]["host"] == "127.0.0.1"
    hint = failed[0]["hint"]
    if client_tls is None:
        assert "events.mqtt_tls_ca_file" in hint and "TLS" in hint
    else:
        assert f"CA in events.mqtt_tls_ca_file ({pki / f'{client_tls}.pem'})" in hint
        assert "name 127.0.0.1" in hint
    assert not [e for e in logs if e["event"] == "event bus connected"]


@pytest.mark.parametrize("ca", ["other-ca", "ca"], ids=["refused", "accepted"])
def test_a_refused_tls_handshake_closes_its_socket(pki: Path, ca: str) -> None:
    """paho wraps the socket and calls ``do_handshake`` without closing it when that fails, so
    each refused attempt (retried every few seconds) left an open socket to the collector. The
    client context's sockets close themselves; one whose handshake succeeds stays open."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            conn, _ = listener.accept()
            with (
                contextlib.suppress(ssl.SSLError, OSError),
                server_ctx.wrap_socket(conn, server_side=True) as tls_conn,
            ):
                tls_conn.recv(1)  # until the client closes
            conn.close()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        tcp = socket.create_connection(listener.getsockname(), timeout=5)
        # as paho 2.2.0's _ssl_wrap_socket does it
        ctx = trust(pki, ca).context()
        sock = ctx.wrap_socket(tcp, server_hostname="127.0.0.1", do_handshake_on_connect=False)
        try:
            if ca == "ca":
                sock.do_handshake()
                assert sock.fileno() != -1
            else:
                with pytest.raises(ssl.SSLCertVerificationError):
                    sock.do_handshake()
                assert sock.fileno() == -1  # closed, not left to the garbage collector
        finally:
            sock.close()
            server.join(timeout=5)
    assert not server.is_alive()


async def test_a_tls_file_gone_at_reconnect_keeps_events_buffered_and_says_so(
    pki: Path, tmp_path: Path
) -> None:
    """The files are reread at every connection attempt (renewed certificates count): one that
    cannot be read then is an error (once), not a crash of the publisher; control: the same bus
    delivers once the file is back."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes((pki / "ca.pem").read_bytes())
    with start_mosquitto(tls=broker_tls(pki)) as broker:
        bus = make_bus(broker, tls=MqttTls(ca))
        ca.unlink()
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                seq = bus.emit("node_lost", node="n2")
                message = "event bus cannot use its TLS files"
                await watch_failures(bus, message, logs)
                assert bus.pending == 1 and "does not exist" in (bus.last_error or "")
                ca.write_bytes((pki / "ca.pem").read_bytes())
                assert await bus.wait_drained(5), bus.last_error
            finally:
                await bus.stop()
    failed = [e for e in logs if e["event"] == message]
    assert [e["log_level"] for e in failed].count("error") == 1
    assert seq == 1 and bus.pending == 0


def test_tls_files_that_cannot_be_used_are_clear_config_errors(pki: Path, tmp_path: Path) -> None:
    """from_config reads the TLS files at start: a deployment mistake is a ConfigError naming
    the setting and the file, never a handshake failure later (or an OpenSSL prompt)."""
    (tmp_path / "not-pem").write_text("hello")
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki / "client.key"), "-aes256", "-passout", "pass:x",
         "-out", str(tmp_path / "encrypted.key")],
        check=True, capture_output=True,
    )  # fmt: skip
    ca, cert, key = "mqtt_tls_ca_file", "mqtt_tls_cert_file", "mqtt_tls_key_file"
    cases: list[tuple[dict[str, Path], str, str]] = [
        ({ca: tmp_path / "missing.pem"}, ca, "does not exist"),
        ({ca: tmp_path / "not-pem"}, ca, "is not PEM"),
        ({ca: pki / "ca.key"}, ca, "no usable CA certificate"),  # a key, not a certificate
        (
            {cert: pki / "client.pem", key: pki / "server.key"},
            cert,
            "not a certificate and its key",
        ),
        ({cert: pki / "client.pem", key: tmp_path / "encrypted.key"}, key, "is encrypted"),
        ({cert: pki / "client.pem", key: tmp_path / "missing.key"}, key, "does not exist"),
    ]
    for files, setting, message in cases:
        events = {"mqtt_host": "127.0.0.1", ca: pki / "ca.pem", **files}
        cfg = parse_config({"cluster": CLUSTER, "events": events}, environ={})
        with pytest.raises(ConfigError) as err:
            EventBus.from_config(cfg, "node-a")
        assert f"events.{setting}" in str(err.value) and message in str(err.value), err.value
    # control: the same files, right; and no broker: nothing is read
    good = {ca: pki / "ca.pem", cert: pki / "client.pem", key: pki / "client.key"}
    cfg = parse_config({"events": {"mqtt_host": "127.0.0.1", **good}}, environ={})
    assert EventBus.from_config(cfg, "node-a").tls == MqttTls(*good.values())
    cfg = parse_config({"events": {"mqtt_host": None, ca: tmp_path / "missing"}}, environ={})
    assert load_mqtt_tls(cfg.events) is None
    assert load_mqtt_tls(parse_config({}, environ={}).events) is None
    with pytest.raises(ValueError, match="needs its key"):
        MqttTls(pki / "ca.pem", pki / "client.pem")


async def follow_one_tls(broker: Mosquitto, pki: Path, tls: MqttTls | None) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in follow(CLUSTER, broker.host, broker.port, credentials=WATCHER, tls=tls):
            return event
        raise AssertionError("follow ended")

    task = asyncio.create_task(first())
    bus = make_bus(broker, credentials=PUBLISHER, tls=trust(pki))
    await bus.start()
    try:
        while not task.done():
            bus.emit("node_lost", node="n2")
            await asyncio.sleep(0.05)
        return await task
    finally:
        await bus.stop()


async def test_follow_over_tls_with_the_right_ca_only(pki: Path) -> None:
    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki)) as broker:
        event = await asyncio.wait_for(follow_one_tls(broker, pki, trust(pki)), 10)  # control
        assert event["kind"] == "node_lost"
        with pytest.raises(aiomqtt.MqttError) as err:
            await asyncio.wait_for(follow_one_tls(broker, pki, trust(pki, "other-ca")), 10)
        assert is_tls_failure(err.value) and "certificate verify failed" in str(err.value)
    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki, "elsewhere")) as broker:
        with pytest.raises(aiomqtt.MqttError) as err:
            await asyncio.wait_for(follow_one_tls(broker, pki, trust(pki)), 10)
        assert is_tls_failure(err.value) and "not valid for '127.0.0.1'" in str(err.value)


async def test_cli_events_follow_over_tls(pki: Path, tmp_path: Path) -> None:
    """Positive control for the failure below: the CA from --mqtt-tls-ca, from the env, or
    from the config file's events section."""
    pw_file = tmp_path / "pw"
    pw_file.write_text(WATCHER.password)
    config = tmp_path / "config.yaml"
    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki)) as broker:
        config.write_text(
            f"cluster: {CLUSTER}\nevents:\n  mqtt_host: 127.0.0.1\n  mqtt_port: {broker.port}\n"
            f"  mqtt_username: watcher\n  mqtt_password_file: {pw_file}\n"
            f"  mqtt_tls_ca_file: {pki / 'ca.pem'}\n"
        )
        target = ["--mqtt-port", str(broker.port), "--cluster", CLUSTER]
        target += ["--mqtt-username", "watcher", "--mqtt-password-file", str(pw_file)]
        ways: list[tuple[list[str], dict[str, str] | None]] = [
            ([*target, "--mqtt-tls-ca", str(pki / "ca.pem")], None),
            (target, {"KVFENCE_MQTT_TLS_CA": str(pki / "ca.pem")}),
            (["--config", str(config)], None),
        ]
        bus = make_bus(broker, credentials=PUBLISHER, tls=trust(pki))
        await bus.start()
        try:
            for extra, env in ways:
                result = await cli_while_emitting(["--json", *extra], bus, env)
                assert result.exit_code == 0, (extra, result.output)
                (line,) = [ln for ln in result.output.splitlines() if ln.startswith("{")]
                assert json.loads(line)["kind"] == "node_joined"
        finally:
            await bus.stop()


async def test_cli_events_failed_tls_handshake_exits_1_and_says_so(
    pki: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    with start_mosquitto(tls=broker_tls(pki)) as broker:
        bus = make_bus(broker, tls=trust(pki))  # events to receive, for a CLI that connects
        await bus.start()
        try:
            target = ["--mqtt-port", str(broker.port), "--cluster", CLUSTER]
            wrong_ca = await cli_while_emitting(
                [*target, "--mqtt-tls-ca", str(pki / "other-ca.pem")], bus
            )
            config.write_text(
                f"cluster: {CLUSTER}\nevents:\n  mqtt_host: 127.0.0.1\n"
                f"  mqtt_port: {broker.port}\n  mqtt_tls_ca_file: {pki / 'other-ca.pem'}\n"
            )
            from_config = await cli_while_emitting(["--config", str(config)], bus)
        finally:
            await bus.stop()
    with start_mosquitto(tls=broker_tls(pki, "elsewhere")) as broker:
        bus = make_bus(broker, tls=MqttTls(pki / "ca.pem", server_name="broker.elsewhere.example"))
        await bus.start()
        try:
            target = ["--mqtt-port", str(broker.port), "--cluster", CLUSTER]
            wrong_host = await cli_while_emitting(
                [*target, "--mqtt-tls-ca", str(pki / "ca.pem")], bus
            )
        finally:
            await bus.stop()
    for result, ca_setting, reason in (
        (wrong_ca, "--mqtt-tls-ca", "certificate verify failed"),
        (from_config, "events.mqtt_tls_ca_file", "certificate verify failed"),
        (wrong_host, "--mqtt-tls-ca", "IP address mismatch"),
    ):
        assert result.exit_code == 1, result.output
        lines = [ln for ln in result.output.splitlines() if ln.startswith("events:")]
        assert len(lines) == 1, result.output
        assert "TLS handshake with MQTT broker 127.0.0.1:" in lines[0]
        assert reason in lines[0] and f"the CA in {ca_setting}" in lines[0]


async def test_cli_events_over_a_port_forward_checks_the_brokers_own_name(pki: Path) -> None:
    """Through a port-forward kvfence events connects to 127.0.0.1, which the broker's
    certificate (made for its Service name) does not name: --mqtt-tls-server-name says which
    name to check instead. Another name still fails (the check is not switched off)."""
    with start_mosquitto(tls=broker_tls(pki, "elsewhere")) as broker:
        target = ["--json", "--cluster", CLUSTER, "--mqtt-port", str(broker.port)]
        target += ["--mqtt-tls-ca", str(pki / "ca.pem"), "--mqtt-tls-server-name"]
        bus = make_bus(broker, tls=MqttTls(pki / "ca.pem", server_name="broker.elsewhere.example"))
        await bus.start()
        try:
            result = await cli_while_emitting([*target, "broker.elsewhere.example"], bus)
            other = await cli_while_emitting([*target, "other.elsewhere.example"], bus)
            assert bus.last_error is None
        finally:
            await bus.stop()
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("{")]
    assert json.loads(line)["kind"] == "node_joined"
    assert other.exit_code == 1, other.output
    assert "Hostname mismatch" in other.output and "name other.elsewhere.example" in other.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mqtt-tls-ca", "CA", "--mqtt-tls-cert", "CERT"],
            "--mqtt-tls-cert without --mqtt-tls-key",
        ),
        (
            ["--mqtt-tls-ca", "CA", "--mqtt-tls-key", "KEY"],
            "--mqtt-tls-key without --mqtt-tls-cert",
        ),
        (["--mqtt-tls-cert", "CERT", "--mqtt-tls-key", "KEY"], "need --mqtt-tls-ca"),
        (["--mqtt-tls-server-name", "b.example"], "--mqtt-tls-server-name needs --mqtt-tls-ca"),
        (["--mqtt-tls-ca", "CA", "--mqtt-tls-server-name", " "], "is empty"),
        (["--mqtt-tls-ca", "NOPE"], "does not exist"),
        (["--mqtt-tls-ca", "KEY"], "no usable CA certificate"),
    ],
)
def test_cli_events_tls_usage_errors_exit_2(pki: Path, args: list[str], message: str) -> None:
    files = {"CA": "ca.pem", "CERT": "client.pem", "KEY": "client.key", "NOPE": "nope.pem"}
    args = [str(pki / files[a]) if a in files else a for a in args]
    result = run_cli(["events", "-f", "--mqtt-port", str(free_port()), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


# --- abandoned connection attempts leave nothing behind -------------------------------------------


class SlowBrokerProxy:
    """A TCP proxy in front of ``broker`` that holds the broker's first bytes to each client (its
    CONNACK) for ``delay`` s. ``open`` counts the client connections still open: a client that
    gave up on its attempt but left its socket open (aiomqtt does: it then gets the CONNACK late
    and stays connected, pinging, with its will) keeps counting."""

    def __init__(self, broker: Mosquitto, delay: float) -> None:
        self.broker = broker
        self.delay = delay
        self.open = 0
        self.accepted = 0
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> SlowBrokerProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):  # ends the handlers' reads (no cancel: 3.11's streams
            writer.close()  # log a cancelled client_connected_cb as an error)
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.accepted += 1
        self.open += 1
        delay = self.delay
        broker_w: asyncio.StreamWriter | None = None

        async def down(broker_r: asyncio.StreamReader) -> None:  # broker -> client
            first = True
            while data := await broker_r.read(65536):
                if first:
                    first = False
                    await asyncio.sleep(delay)
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        down_task: asyncio.Task[None] | None = None
        try:
            self._writers.add(client_w)
            broker_r, broker_w = await asyncio.open_connection(self.broker.host, self.broker.port)
            self._writers.add(broker_w)
            down_task = asyncio.create_task(down(broker_r))
            with contextlib.suppress(OSError):
                while data := await client_r.read(65536):  # until the client closes its socket
                    broker_w.write(data)
                    await broker_w.drain()
        finally:
            self.open -= 1
            if down_task is not None:
                down_task.cancel()
                await asyncio.gather(down_task, return_exceptions=True)
            for writer in (client_w, broker_w):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
            self._handlers.discard(task)


def aiomqtt_misc_tasks() -> int:
    """aiomqtt's keep-alive tasks (one per client whose socket it opened) in this loop."""
    return sum("_misc_loop" in t.get_coro().__qualname__ for t in asyncio.all_tasks())


async def test_connect_attempts_that_time_out_leave_no_live_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker slower to send its CONNACK than the bus waits for it: aiomqtt gave up on the
    attempt ("Operation timed out") but left its socket open and its keep-alive task running, so
    each late CONNACK turned an abandoned attempt into a live connection that kept pinging and
    held its will: they piled up, one per retry. Now at most the attempt in progress is open, and
    nothing after stop(). Control: the same proxy without the delay connects and delivers."""
    monkeypatch.setattr("kvfence.events.PUBLISH_TIMEOUT_S", 0.3)  # the CONNACK wait
    with start_mosquitto() as broker:
        async with SlowBrokerProxy(broker, delay=1.2) as proxy:
            bus = make_bus(port=proxy.port)
            await bus.start()
            bus.emit("node_joined")
            seen_open, seen_misc = 0, 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.5:  # attempts at ~0, 0.35, 0.75, 1.25, 1.95, 3.05 s
                seen_open = max(seen_open, proxy.open)
                seen_misc = max(seen_misc, aiomqtt_misc_tasks())
                await asyncio.sleep(0.02)
            assert not bus.connected and bus.last_error == "Operation timed out"
            assert proxy.accepted >= 4, proxy.accepted
            assert seen_open <= 1 and seen_misc <= 1, (proxy.accepted, seen_open, seen_misc)
            t0 = time.monotonic()
            await bus.stop(flush_timeout=0.1)
            assert time.monotonic() - t0 < 1.5
            await wait_until(lambda: proxy.open == 0, 2)
            assert aiomqtt_misc_tasks() == 0

            # Control: no delay, the same path connects and delivers, one connection.
            proxy.delay = 0
            monkeypatch.setattr("kvfence.events.PUBLISH_TIMEOUT_S", 5.0)
            async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
                bus = make_bus(port=proxy.port)
                await bus.start()
                seq = bus.emit("node_joined")
                (got,) = await receive(sub, 1)
                assert got["seq"] == seq and bus.connected
                assert proxy.open == 1 and aiomqtt_misc_tasks() == 2  # the bus and the subscriber
                await bus.stop()
            await wait_until(lambda: proxy.open == 0 and aiomqtt_misc_tasks() == 0, 2)


async def test_stop_while_the_connack_is_on_its_way_leaves_no_live_connection() -> None:
    """stop() during the CONNACK wait cancelled aiomqtt's connect, which left the socket open:
    the late CONNACK made it a live connection after stop() returned, pinging for good."""
    with start_mosquitto() as broker:
        async with SlowBrokerProxy(broker, delay=0.8) as proxy:
            bus = make_bus(port=proxy.port)
            await bus.start()
            bus.emit("node_joined")
            await wait_until(lambda: proxy.accepted == 1, 2)
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await bus.stop(flush_timeout=0.1)
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(1.2)  # past the CONNACK's arrival
            assert proxy.open == 0 and aiomqtt_misc_tasks() == 0
            assert proxy.accepted == 1


async def test_stop_during_the_tcp_connect_leaves_no_live_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """stop() while paho's blocking connect still runs in aiomqtt's executor thread: the thread
    goes on, opens the socket and registers it with the loop after the attempt was given up. It
    must be closed once the thread is done, not before (the loop would be given a closed fd)."""
    import socket

    real = socket.create_connection

    def slow_create_connection(*args: Any, **kwargs: Any) -> socket.socket:
        time.sleep(0.5)  # a slow TCP handshake (paho's connect runs in a thread)
        return real(*args, **kwargs)

    with start_mosquitto() as broker:
        async with SlowBrokerProxy(broker, delay=0) as proxy:
            monkeypatch.setattr(socket, "create_connection", slow_create_connection)
            bus = make_bus(port=proxy.port)
            await bus.start()
            bus.emit("node_joined")
            await asyncio.sleep(0.1)  # the thread is in create_connection
            t0 = time.monotonic()
            await bus.stop(flush_timeout=0.05)
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(1.0)  # the thread connected at 0.5 s, the CONNACK came at once
            monkeypatch.undo()
            assert proxy.accepted == 1
            assert proxy.open == 0 and aiomqtt_misc_tasks() == 0
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


async def test_follow_cancelled_while_the_connack_is_on_its_way_leaves_no_live_connection() -> None:
    """The same for ``follow`` (``kvfence events --follow`` interrupted while connecting)."""

    async def run_follow(port: int) -> None:
        async for _ in follow(CLUSTER, "127.0.0.1", port):
            pass

    with start_mosquitto() as broker:
        async with SlowBrokerProxy(broker, delay=0.8) as proxy:
            task = asyncio.create_task(run_follow(proxy.port))
            await wait_until(lambda: proxy.accepted == 1, 2)
            await asyncio.sleep(0.1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(1.2)  # past the CONNACK's arrival
            assert proxy.open == 0 and aiomqtt_misc_tasks() == 0
