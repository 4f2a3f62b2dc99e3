"""EventBus review: the node status after a stop against a slow broker and after a half-open
connection, broker resets with an event in flight, the buffer's eviction index, and
``kvfence events --cluster`` values that cannot be a topic level.

1. stop() queued the offline status behind a full in-flight window; the flush timed out and the
   cancel sent a normal DISCONNECT, which makes the broker discard the will: the retained status
   said "online" for good. The status now has a window slot of its own, and a stop that gives up
   before the broker acknowledged the offline status leaves the will to the broker (MQTT 5
   DISCONNECT 0x04; MQTT 3.1.1: the socket closed without a DISCONNECT).
2. After a half-open connection the bus reconnected and republished its status; the broker timed
   the old connection out later and published its will over it. The bus now watches its own
   status topic and publishes the status again.
3. Every connection that ended (not a timeout) counted against the events in flight: three
   resets dropped an innocent event. Over MQTT 5 only a broker's DISCONNECT naming a packet at
   fault (0x95 Packet too large...) counts.
4. ``_Buffer.ack`` trimmed its eviction index only at the front: behind one held event it grew by
   one entry per delivered event.
5. ``kvfence events --cluster`` took "+", "#", "a/b" and "" (streamed every cluster, crashed,
   waited forever, or became "local").

The slow or frozen path is a TCP proxy between the bus and a real Mosquitto.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiomqtt
import pytest
import structlog
from fixtures_mqtt import Mosquitto, start_mosquitto
from test_events import CLUSTER, make_bus, make_cli, subscriber
from test_events_cli_hint import run_cli
from test_events_undeliverable import EVENTS, MAX_PACKET, POISON, named, small_packet_broker
from typer.testing import CliRunner

import kvfence.events as events_mod
from kvfence.events import MAX_SEND_ATTEMPTS, EventBus, _Buffer, node_topic

NODE_TOPIC = node_topic(CLUSTER, "node-a")
DEADLINE_S = 15.0


class Proxy:
    """A TCP proxy to the broker: ``down_delay`` delays what the broker sends (its
    acknowledgements: a slow path or a busy broker); ``freeze_all`` blackholes the live
    connections both ways and keeps the broker's side open when the client closes (a half-open
    path); ``reset_all`` aborts them both sides (a broker restart, as the client sees it)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.down_delay = 0.0
        self.conns: list[dict[str, Any]] = []
        self.accepted = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.reset_all()

    def freeze_all(self) -> None:
        for conn in self.conns:
            conn["frozen"] = True

    def reset_all(self) -> None:
        for conn in self.conns:
            for writer in conn["writers"]:
                with contextlib.suppress(Exception):
                    writer.transport.abort()
        self.conns.clear()

    async def _pipe(
        self,
        conn: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        delayed: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                if conn["frozen"]:
                    continue  # blackholed
                if delayed and self.down_delay:
                    loop.call_later(self.down_delay, self._write_late, conn, writer, data)
                else:
                    writer.write(data)
        if not conn["frozen"]:
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    def _write_late(conn: dict[str, Any], writer: asyncio.StreamWriter, data: bytes) -> None:
        if not conn["frozen"] and not writer.is_closing():
            writer.write(data)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        broker_r, broker_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        conn: dict[str, Any] = {"frozen": False, "writers": (client_w, broker_w)}
        self.conns.append(conn)
        self.accepted += 1
        await asyncio.gather(
            self._pipe(conn, client_r, broker_w, False),
            self._pipe(conn, broker_r, client_w, True),
        )


class Watcher:
    """Every message on the node's status topic, as the broker delivers it (retained first)."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.seen: list[dict[str, Any]] = []
        self._task = asyncio.create_task(self._read(client))

    async def _read(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            assert isinstance(message.payload, bytes)
            self.seen.append(json.loads(message.payload) if message.payload else {})

    async def wait_for(self, predicate: Any, after: int = 0) -> int:
        """The index of the first status from ``after`` on that ``predicate`` accepts."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            for i in range(after, len(self.seen)):
                if predicate(self.seen[i]):
                    return i
            assert time.monotonic() < deadline, f"not seen in time: {self.seen}"
            await asyncio.sleep(0.02)


@asynccontextmanager
async def watching(broker: Mosquitto) -> AsyncIterator[Watcher]:
    async with subscriber(broker, NODE_TOPIC) as client:
        watcher = Watcher(client)
        try:
            yield watcher
        finally:
            watcher._task.cancel()
            with contextlib.suppress(BaseException):
                await watcher._task


async def retained_status(broker: Mosquitto) -> dict[str, Any]:
    async with watching(broker) as watcher:
        at = await watcher.wait_for(lambda status: True)
        return watcher.seen[at]


async def wait_until(predicate: Any) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- 1. stop() against a slow broker ------------------------------------------------------------


@pytest.mark.parametrize("backlog", [100, 0])
async def test_the_offline_status_does_not_wait_behind_event_acknowledgements(backlog: int) -> None:
    """The broker's acknowledgements take 2 s; a backlog fills the in-flight window when stop()
    is called with a 3 s flush. The offline status has a slot of its own: it goes out at once
    and is acknowledged within the flush, so the retained status is stop()'s own (with its "ts"),
    not the will. (It waited for the window: sent after the first acknowledgements, 2 s in, and
    acknowledged after the flush.) Control (no backlog): the same, as before."""
    with start_mosquitto() as broker:
        async with Proxy(broker.port) as proxy:
            bus = EventBus(CLUSTER, "node-a", "127.0.0.1", proxy.port)
            bus._log = lambda event: None  # no log line per event
            await bus.start()
            bus.publish_node_status({"role": "decode"})
            assert await bus.wait_drained(5)
            proxy.down_delay = 2.0
            for i in range(backlog):
                bus.emit("request_failed", i=i)
            await asyncio.sleep(0.2)  # the backlog is on the wire
            await bus.stop(flush_timeout=3.0)
            status = await retained_status(broker)
    assert status["online"] is False and status["node_id"] == "node-a"
    assert "ts" in status, status  # stop()'s offline status, acknowledged in time
    assert (bus.pending > 0) if backlog else (bus.pending == 0)  # the flush gave up on events


@pytest.mark.parametrize("protocol", [aiomqtt.ProtocolVersion.V5, aiomqtt.ProtocolVersion.V311])
@pytest.mark.parametrize("slow", [True, False])
async def test_a_stop_that_gives_up_on_the_offline_status_leaves_the_will(
    protocol: aiomqtt.ProtocolVersion, slow: bool
) -> None:
    """A status update is in flight and its acknowledgement takes 3 s when stop() (1 s flush) is
    called: the offline status waits for it and is not sent in time. The connection now ends so
    that the broker publishes the will (MQTT 5: DISCONNECT 0x04; MQTT 3.1.1: no DISCONNECT), and
    the retained status says offline; a normal DISCONNECT made the broker discard the will and
    it said "online" for good. Control (slow=False): the offline status is acknowledged within the
    flush and is the retained one (with its "ts"), as before."""
    with start_mosquitto() as broker:
        async with Proxy(broker.port) as proxy:
            bus = EventBus(CLUSTER, "node-a", "127.0.0.1", proxy.port)
            bus._protocol = protocol
            await bus.start()
            bus.publish_node_status({"role": "decode"})
            assert await bus.wait_drained(5)
            async with watching(broker) as watcher:
                await watcher.wait_for(lambda s: s.get("role") == "decode")
                if slow:
                    proxy.down_delay = 3.0
                bus.publish_node_status({"role": "decode", "free_pages": 1})
                # the update reached the broker (its PUBACK is what is slow)
                at = await watcher.wait_for(lambda s: s.get("free_pages") == 1)
                with structlog.testing.capture_logs() as logs:
                    await bus.stop(flush_timeout=1.0)
                last = await watcher.wait_for(lambda s: s.get("online") is False, after=at)
            status = await retained_status(broker)
    assert status == watcher.seen[last]
    assert status["online"] is False and status["node_id"] == "node-a"
    gave_up = (
        "event bus stops before the broker acknowledged the offline status: it publishes the will"
    )
    if slow:
        assert "ts" not in status, status  # the will
        assert len(named(logs, gave_up)) == 1
    else:
        assert "ts" in status, status  # stop()'s own
        assert not named(logs, gave_up)


# -- 2. the will of a connection the broker ends late ----------------------------------------


async def test_a_late_will_of_an_old_connection_is_overwritten_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The path to the broker goes half-open: the bus gives the connection up (a publish timed
    out) and reconnects with a new client id, while the broker still holds the old one until its
    keepalive (2 s, times 1.5) ends it, and then publishes its will ("online": false, retained)
    over the status the new connection published. The bus sees it on its own status topic and
    publishes its status again. (A will has no "ts"; every status the bus publishes has one.)
    Control: after stop() the retained status is offline (the bus does not fight its own
    stop)."""
    monkeypatch.setattr(events_mod, "PUBLISH_TIMEOUT_S", 0.5)  # gives up before the broker does
    with start_mosquitto() as broker:
        async with Proxy(broker.port) as proxy, watching(broker) as watcher:
            bus = EventBus(CLUSTER, "node-a", "127.0.0.1", proxy.port, keepalive_s=2)
            await bus.start()
            try:
                bus.publish_node_status({"role": "decode"})
                assert await bus.wait_drained(5)
                first = await watcher.wait_for(lambda s: s.get("online") is True)
                proxy.freeze_all()
                bus.emit("node_lost", node="x")
                await wait_until(lambda: proxy.accepted >= 2 and bus.connected)
                # the new connection's status, then the old connection's will over it
                reconnected = await watcher.wait_for(lambda s: s.get("online") is True, first + 1)
                will = await watcher.wait_for(
                    lambda s: s.get("online") is False and "ts" not in s, reconnected + 1
                )
                again = await watcher.wait_for(lambda s: s.get("online") is True, will + 1)
                assert await bus.wait_drained(5)
                assert watcher.seen[again]["role"] == "decode"
                assert (await retained_status(broker))["online"] is True
            finally:
                await bus.stop()
            stopped = await retained_status(broker)
    assert stopped["online"] is False and "ts" in stopped


# -- 3. resets with an event in flight ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["request_failed", "integrity_violation"])
async def test_broker_resets_with_an_event_in_flight_drop_nothing(kind: str) -> None:
    """Three connection resets, each while the event waits for its PUBACK (a slow path), counted
    against it as if the broker rejected it: it was dropped (a security event cut to its header
    and re-sent so) with an error blaming max_packet_size. A reset is an outage now: once the
    path is back the broker acknowledges the event, nothing is dropped or cut, no error is
    logged, and subscribers got it whole. (Control, a broker that says the packet is too large:
    test_an_event_over_the_brokers_limit_is_still_dropped_or_cut.)"""
    with start_mosquitto() as broker:
        async with Proxy(broker.port) as proxy, subscriber(broker, EVENTS) as sub:
            proxy.down_delay = 1.0
            bus = EventBus(CLUSTER, "node-a", "127.0.0.1", proxy.port)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    await wait_until(lambda: bus.connected)
                    seq = bus.emit(kind, request_id="r1", check="mac", detail="d" * 50)
                    for _ in range(MAX_SEND_ATTEMPTS):
                        await wait_until(lambda: seq in bus._in_flight)
                        proxy.reset_all()
                        await wait_until(lambda: not bus.connected)
                        await wait_until(lambda: bus.connected)
                    proxy.down_delay = 0.0
                    message = await asyncio.wait_for(anext(aiter(sub.messages)), DEADLINE_S)
                    assert await bus.wait_drained(5)
                finally:
                    await bus.stop()
    assert isinstance(message.payload, bytes)
    event = json.loads(message.payload)
    assert event["seq"] == seq and event["detail"] == "d" * 50 and "truncated" not in event
    assert bus.dropped == 0 and bus.pending == 0
    assert not [entry for entry in logs if entry["log_level"] == "error"]
    assert len(named(logs, "event bus connected")) >= MAX_SEND_ATTEMPTS + 1


@pytest.mark.parametrize("protocol", [aiomqtt.ProtocolVersion.V5, aiomqtt.ProtocolVersion.V311])
async def test_an_event_over_the_brokers_limit_is_still_dropped_or_cut(
    protocol: aiomqtt.ProtocolVersion,
) -> None:
    """Control for the above: Mosquitto closes the connection of a client whose packet exceeds
    its max_packet_size. Over MQTT 5 it says so (DISCONNECT 0x95 Packet too large), which counts
    against what was in flight; over MQTT 3.1.1 it cannot say, and any close still counts. An
    ordinary event over the limit is dropped and a security event cut to its header, as before;
    the log says why."""
    with small_packet_broker() as broker:
        async with subscriber(broker, EVENTS) as sub:
            bus = make_bus(broker)
            bus._protocol = protocol
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    big = bus.emit("node_left", node="x", reason=POISON)
                    stub = bus.emit("integrity_violation", check="MAC", detail=POISON)
                    after = bus.emit("node_joined", node="ok")
                    received: dict[int, dict[str, Any]] = {}
                    async with asyncio.timeout(DEADLINE_S):
                        async for message in sub.messages:
                            assert isinstance(message.payload, bytes)
                            event = json.loads(message.payload)
                            received[event["seq"]] = event
                            if {stub, after} <= set(received):
                                break
                    assert await bus.wait_drained(5)
                finally:
                    await bus.stop()
    assert big not in received and bus.dropped == 1
    assert received[stub]["truncated"] is True and received[stub]["original_bytes"] > MAX_PACKET
    (dropped,) = named(logs, "event dropped undelivered")
    (cut,) = named(logs, "event truncated undelivered")
    assert dropped["seq"] == big and cut["seq"] == stub
    if protocol == aiomqtt.ProtocolVersion.V5:
        assert "Packet too large (0x95)" in dropped["reason"]
    else:
        assert "MQTT 3.1.1: the broker cannot say why" in dropped["reason"]


# -- 4. the buffer's eviction index ----------------------------------------------------------


def test_the_eviction_index_stays_bounded_behind_a_held_event() -> None:
    """One event that stays buffered at the front (held: its topic refused) stopped the index's
    trim at the front: it grew by one entry per delivered event, for good. It is rebuilt once
    mostly stale now."""
    buf = _Buffer(capacity=10_000)
    buf.add({"seq": 1, "kind": "model_access"})  # held, never acknowledged
    for seq in range(2, 20_002):
        buf.add({"seq": seq, "kind": "admission_rejected"})
        assert buf.ack(seq)
        assert len(buf._plain) <= 2 * len(buf) + 16, seq
    assert list(buf.events) == [1] and buf._plain[0] == 1


def test_eviction_order_is_unchanged_after_the_index_is_rebuilt() -> None:
    """Control: a full buffer still evicts the oldest non-security event first (the held one,
    then in seq order), and a security event only when nothing else is left."""
    buf = _Buffer(capacity=4)
    buf.add({"seq": 1, "kind": "model_access"})
    for seq in range(2, 102):
        buf.add({"seq": seq, "kind": "node_joined"})
        buf.ack(seq)
    buf.add({"seq": 102, "kind": "node_joined"})
    buf.add({"seq": 103, "kind": "integrity_violation"})
    buf.add({"seq": 104, "kind": "node_joined"})
    assert buf.add({"seq": 105, "kind": "node_joined"}) == 1
    assert list(buf.events) == [102, 103, 104, 105]  # the held one went first
    assert buf.add({"seq": 106, "kind": "integrity_violation"}) == 1
    assert list(buf.events) == [103, 104, 105, 106]
    assert buf.add({"seq": 107, "kind": "integrity_violation"}) == 1
    assert list(buf.events) == [103, 105, 106, 107]
    assert buf.add({"seq": 108, "kind": "integrity_violation"}) == 1
    assert buf.add({"seq": 109, "kind": "integrity_violation"}) == 1
    assert list(buf.events) == [106, 107, 108, 109]  # then the oldest security events
    assert buf.dropped == 5


# -- 5. kvfence events --cluster ---------------------------------------------------------------


@pytest.mark.parametrize("cluster", ["+", "#", "prod/x", "", "pr\x00od", "a+"])
def test_a_cluster_that_cannot_be_a_topic_level_is_refused(cluster: str) -> None:
    """ "+" streamed every cluster's events, "#" crashed with a traceback (exit 1), "prod/x"
    waited forever, "" became "local". Each is bad usage now: exit 2 with a message, before any
    connection (the port is closed: it would exit 1)."""
    args = ["events", "--follow", "--mqtt-port", "1", "--cluster", cluster]
    result = CliRunner().invoke(make_cli(), args)
    assert result.exit_code == 2, result.output
    assert f"--cluster {cluster!r} cannot be a cluster name" in result.output
    assert "Traceback" not in result.output


async def test_a_valid_cluster_still_streams() -> None:
    """Control: a valid --cluster streams its events."""
    with start_mosquitto() as broker:
        bus = EventBus("prod-1.eu_west", "node-a", broker.host, broker.port)
        await bus.start()
        try:
            async with run_cli(broker, "prod-1.eu_west", "--limit", "1") as cli:
                while cli.proc.returncode is None and not cli.stdout:
                    bus.emit("request_failed", request_id="r1", tenant_id="t")
                    await asyncio.sleep(0.1)
                assert await cli.exit_code() == 0, cli.stderr
        finally:
            await bus.stop()
    event = json.loads(cli.stdout[0])
    assert event["cluster"] == "prod-1.eu_west" and event["request_id"] == "r1"
