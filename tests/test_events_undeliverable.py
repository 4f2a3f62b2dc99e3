"""EventBus and a message the broker always rejects, or that cannot be encoded.

Mosquitto drops the connection of an MQTT 3.1.1 client that sends a packet over its
``max_packet_size``. The bus re-sent its buffer from the oldest unacknowledged event after every
reconnect, with no bound, and started its backoff over at every CONNACK: one such event blocked
every event behind it for good, reconnecting ~20 times a second, with nothing counted as dropped.
An event that JSON cannot encode looped the same way. Controls: without such a message nothing
is dropped, and a connection that made progress still starts the backoff over.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import structlog
from fixtures_mqtt import Mosquitto, free_port
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from test_events import CLUSTER, make_bus, subscriber, wait_until

import kvfence.events as events_mod
from kvfence.events import BACKOFF_MIN_S, MAX_SEND_ATTEMPTS, node_topic
from kvfence.metrics import Metrics

EVENTS = f"kvfence/v1/{CLUSTER}/events/#"
MAX_PACKET = 300
POISON = "r" * 400  # an event with this field is over MAX_PACKET bytes


@contextmanager
def small_packet_broker() -> Iterator[Mosquitto]:
    """Mosquitto that disconnects an MQTT 3.1.1 client sending a packet over MAX_PACKET bytes."""
    with tempfile.TemporaryDirectory(prefix="kvfence-mqtt-") as tmp:
        Path(tmp).chmod(0o755)
        broker = Mosquitto(free_port(), Path(tmp))
        broker.conf.write_text(broker.conf.read_text() + f"max_packet_size {MAX_PACKET}\n")
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()


async def collect(sub: aiomqtt.Client, seqs: set[int], timeout: float = 5.0) -> list[int]:
    """The seqs ``sub`` receives until it has seen all of ``seqs`` (re-sends included)."""
    out: list[int] = []

    async def run() -> None:
        async for message in sub.messages:
            assert isinstance(message.payload, bytes)
            out.append(json.loads(message.payload)["seq"])
            if seqs <= set(out):
                return

    await asyncio.wait_for(run(), timeout)
    return out


def named(logs: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


def lost_connections(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The "event bus disconnected" lines of connections that were up (the same line also
    says that a connect attempt failed)."""
    out, up = [], False
    for entry in logs:
        if entry["event"] == "event bus connected":
            up = True
        elif entry["event"] == "event bus disconnected" and up:
            out.append(entry)
            up = False
    return out


def dropped_metric(metrics: Metrics) -> bytes:
    line = [
        ln for ln in metrics.render().splitlines() if ln.startswith(b"kvfence_events_dropped_total")
    ]
    assert len(line) == 1
    return line[0].split()[-1]


@pytest.mark.parametrize("poisoned", [True, False])
async def test_an_event_the_broker_rejects_is_dropped_and_the_ones_around_it_delivered(
    poisoned: bool,
) -> None:
    """The event over the broker's packet limit is dropped after MAX_SEND_ATTEMPTS failed
    connections, counted and logged once (kind and seq, not its payload); the events emitted
    before and after it are delivered, and the reconnects slow down meanwhile.
    Control (poisoned=False): the same events without it: one connection, nothing dropped."""
    metrics = Metrics("test")
    with small_packet_broker() as broker:
        async with subscriber(broker, EVENTS) as sub:
            bus = make_bus(broker, metrics=metrics)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    bus.publish_node_status({"role": "decode"})
                    assert await bus.wait_drained(5)
                    t0 = time.monotonic()
                    small = [bus.emit("node_joined", node="ok0")]
                    if poisoned:
                        poison = bus.emit("node_left", node="x", role="decode", reason=POISON)
                    small += [bus.emit("node_joined", node=f"ok{i}") for i in (1, 2, 3)]
                    got = await collect(sub, set(small))
                    assert await bus.wait_drained(5)
                    elapsed = time.monotonic() - t0
                finally:
                    await bus.stop()
    assert sorted(set(got)) == small and got == sorted(got)  # in order, re-sends included
    assert bus.pending == 0
    connects = named(logs, "event bus connected")
    disconnects = lost_connections(logs)
    errors = [entry for entry in logs if entry["log_level"] == "error"]
    if not poisoned:
        assert bus.dropped == 0 and dropped_metric(metrics) == b"0.0"
        assert len(connects) == 1 and not disconnects and not errors
        return
    assert bus.dropped == 1 and dropped_metric(metrics) == b"1.0"
    # one try per failed connection, then the events behind it went out on the next one
    assert len(connects) == MAX_SEND_ATTEMPTS + 1, connects
    # the backoff grew: no progress on those connections (was 0.05 s every time). (The first
    # two may both say 0.05: when ok0's PUBACK was lost with the connection, the second one
    # delivered it before it tried the big event alone, and that is progress.)
    retries = [d["retry_in_s"] for d in disconnects]
    assert retries in ([0.05, 0.1, 0.2], [0.05, 0.05, 0.1]), retries
    assert elapsed < 3.0
    (error,) = errors
    assert error["event"] == "event dropped undelivered"
    assert error["kind"] == "node_left" and error["seq"] == poison
    assert "rrrr" not in repr(error)  # never the payload


async def test_a_broker_that_rejects_an_event_is_retried_ever_more_slowly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(The backoff on its own: the event is never given up on here.) A connection that ends
    before the broker acknowledged anything new makes no progress, so the backoff keeps
    growing up to BACKOFF_MAX_S: the bus reconnected every 0.05 s, ~20 times a second."""
    monkeypatch.setattr(events_mod, "MAX_SEND_ATTEMPTS", 1000)
    monkeypatch.setattr(events_mod, "BACKOFF_MAX_S", 0.4)
    with small_packet_broker() as broker:
        bus = make_bus(broker)
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                await wait_until(lambda: bus.connected)
                bus.emit("node_left", node="x", role="decode", reason=POISON)
                await asyncio.sleep(1.5)
                before_stop = list(logs)  # (stop's offline status is progress)
            finally:
                await bus.stop(0.1)
    retries = [d["retry_in_s"] for d in lost_connections(before_stop)]
    assert retries[:4] == [0.05, 0.1, 0.2, 0.4], retries
    assert set(retries[3:]) == {0.4}
    assert len(retries) <= 7, retries  # 1.5 s: 0.05 + 0.1 + 0.2 + 0.4 + 0.4 + ...
    assert bus.pending == 1 and bus.dropped == 0


async def test_a_connection_that_made_progress_starts_the_backoff_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control for the above: after the backoff grew (the broker down), a connection on which the
    broker acknowledged an event, or that stayed up BACKOFF_RESET_AFTER_S, ends with the backoff
    at its minimum again, as before."""
    monkeypatch.setattr(events_mod, "BACKOFF_RESET_AFTER_S", 0.5)
    with small_packet_broker() as broker:
        broker.stop()
        bus = make_bus(broker)
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                for progress in ("ack", "uptime"):
                    await asyncio.sleep(0.6)  # connect attempts fail: the backoff grows
                    broker.start()
                    await wait_until(lambda: bus.connected)
                    if progress == "ack":
                        bus.emit("node_joined", node="ok")
                        assert await bus.wait_drained(5)
                    else:
                        await asyncio.sleep(0.7)  # nothing to acknowledge; up long enough
                    broker.stop()
                    await wait_until(lambda: not bus.connected)
            finally:
                await bus.stop(0.1)
    grown = [d["retry_in_s"] for d in named(logs, "event bus disconnected")]
    assert max(grown) >= 0.4, grown  # the backoff had grown while the broker was down
    retries = [d["retry_in_s"] for d in lost_connections(logs)]
    assert retries == [BACKOFF_MIN_S, BACKOFF_MIN_S], retries
    assert bus.dropped == 0


async def test_a_node_status_the_broker_rejects_is_given_up_and_events_flow() -> None:
    """The node status goes first on every connection: one over the broker's limit blocked every
    event. It is given up after MAX_SEND_ATTEMPTS (an error); the events are delivered, and the
    next status (a small one) is published again."""
    with small_packet_broker() as broker:
        async with subscriber(broker, EVENTS) as sub:
            bus = make_bus(broker)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    bus.publish_node_status({"role": "decode", "pad": POISON})
                    small = [bus.emit("node_joined", node=f"ok{i}") for i in range(3)]
                    await collect(sub, set(small))
                    assert await bus.wait_drained(5)
                    bus.publish_node_status({"role": "decode", "free_pages": 3})
                    assert await bus.wait_drained(5)
                    async with subscriber(broker, node_topic(CLUSTER, "node-a")) as nodes:
                        message = await asyncio.wait_for(anext(aiter(nodes.messages)), 5)
                finally:
                    await bus.stop()
    assert isinstance(message.payload, bytes) and b'"free_pages":3' in message.payload
    assert bus.dropped == 0 and bus.pending == 0
    (error,) = [entry for entry in logs if entry["log_level"] == "error"]
    assert error["event"] == "node status not delivered" and "rrrr" not in repr(error)
    assert len(named(logs, "event bus connected")) == MAX_SEND_ATTEMPTS + 1


async def test_an_event_that_cannot_be_encoded_is_dropped_at_once() -> None:
    """A payload JSON cannot encode (a key that is not a string), or a kind that cannot be a
    topic level, is dropped and counted at once: it raised in the publisher, which reconnected
    and tried again, forever. Control: values ``default=str`` encodes still go out."""
    metrics = Metrics("test")
    with small_packet_broker() as broker:
        async with subscriber(broker, EVENTS) as sub:
            bus = make_bus(broker, metrics=metrics)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    await wait_until(lambda: bus.connected)
                    bad = bus.emit("node_joined", pages={(1, 2): 3})
                    bad_kind = bus.emit("node+joined")
                    bus.publish_node_status({"pages": {(1, 2): 3}})
                    ok = bus.emit("node_joined", path=Path("/x"))
                    got = await collect(sub, {ok})
                    assert await bus.wait_drained(5)
                finally:
                    await bus.stop()
    assert got == [ok]
    assert bus.dropped == 2 and bus.pending == 0 and dropped_metric(metrics) == b"2.0"
    assert len(named(logs, "event bus connected")) == 1
    assert not named(logs, "event bus publisher failed")
    dropped = named(logs, "event dropped undelivered")
    assert [(d["seq"], d["kind"]) for d in dropped] == [
        (bad, "node_joined"),
        (bad_kind, "node+joined"),
    ]
    assert len(named(logs, "node status not delivered")) == 1


async def test_broker_restarts_with_events_in_flight_drop_nothing() -> None:
    """Control: a broker killed twice while a backlog is in flight is no reason to drop events
    (an event is given up only after MAX_SEND_ATTEMPTS failed connections, and after its first
    one it goes out alone); the whole backlog is delivered once the broker stays up."""
    with small_packet_broker() as broker:
        bus = make_bus(broker, buffer_size=50_000)
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                await wait_until(lambda: bus.connected)
                seqs = [bus.emit("node_joined", node=f"n{i}") for i in range(20_000)]
                for _ in range(MAX_SEND_ATTEMPTS - 1):
                    await wait_until(lambda: bus.connected)
                    await asyncio.sleep(0.05)  # the publisher is busy with the backlog
                    broker.stop()
                    await wait_until(lambda: not bus.connected)
                    broker.start()
                assert await bus.wait_drained(20)
            finally:
                await bus.stop()
    lost = lost_connections(logs)
    assert len(lost) == MAX_SEND_ATTEMPTS - 1 and all(d["pending"] > 0 for d in lost), lost
    assert seqs[-1] == 20_000 and bus.pending == 0 and bus.dropped == 0
    assert not [entry for entry in logs if entry["log_level"] == "error"]


async def test_a_security_event_the_broker_rejects_is_delivered_cut_to_its_header() -> None:
    """An integrity_violation over the broker's packet limit was dropped like any event: the
    audit trail lost the one kind of record it exists for. It is cut to its header (kind, seq,
    ts, node, ``truncated``) and delivered; the events around it too. The control is the test
    above: an ordinary event over the limit is dropped."""
    with small_packet_broker() as broker:
        async with subscriber(broker, EVENTS) as sub:
            bus = make_bus(broker)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    before = bus.emit("node_joined", node="ok0")
                    big = bus.emit("integrity_violation", check="MAC", detail=POISON)
                    after = bus.emit("node_joined", node="ok1")
                    received: dict[int, dict[str, Any]] = {}

                    async def run() -> None:
                        async for message in sub.messages:
                            assert isinstance(message.payload, bytes)
                            event = json.loads(message.payload)
                            received[event["seq"]] = event
                            if {before, big, after} <= set(received):
                                return

                    await asyncio.wait_for(run(), 10)
                    assert await bus.wait_drained(5)
                finally:
                    await bus.stop()
    stub = received[big]
    assert stub["kind"] == "integrity_violation" and stub["truncated"] is True
    assert stub["original_bytes"] > MAX_PACKET and "detail" not in stub
    assert bus.dropped == 0 and bus.pending == 0
    (error,) = [entry for entry in logs if entry["log_level"] == "error"]
    assert error["event"] == "event truncated undelivered" and error["seq"] == big


@pytest.mark.parametrize("broken", ["timed_out", "closed"])
async def test_only_a_connection_the_broker_closed_counts_against_what_was_in_flight(
    broken: str,
) -> None:
    """A publish that got no answer in time (a stalled broker or path) counted against every
    event in flight like a broker closing the connection on one: after three such stalls an
    integrity_violation, or any event, was dropped over an ordinary outage. A timeout counts
    against nothing now. Control: a connection the broker closed, each time with the event in
    flight, drops an ordinary event after MAX_SEND_ATTEMPTS."""
    bus = make_bus(port=1)  # never started: the bookkeeping alone
    bus._idle, bus._wake = asyncio.Event(), asyncio.Event()
    seq = bus.emit("node_joined", node="n")
    err = aiomqtt.MqttError(
        "Operation timed out" if broken == "timed_out" else "Disconnected during message iteration"
    )
    # The broker closing it says why (MQTT 5 DISCONNECT 0x95, Packet too large): only that drops.
    reason = None if broken == "timed_out" else 0x95
    for _ in range(MAX_SEND_ATTEMPTS):
        bus._in_flight.add(seq)
        bus._blame_in_flight(err, reason)
    if broken == "timed_out":
        assert bus.pending == 1 and bus.dropped == 0
    else:
        assert bus.pending == 0 and bus.dropped == 1


@pytest.mark.parametrize("acknowledged", [True, False])
async def test_a_node_status_the_broker_acknowledged_is_never_given_up(acknowledged: bool) -> None:
    """The status is re-sent at the start of every connection, acknowledged or not, and each
    failed connection counted against it: an acknowledged status was given up for good after
    three outages, and after a broker restart (no persistence) the node had none. Control: one
    never acknowledged is given up after MAX_SEND_ATTEMPTS."""
    bus = make_bus(port=1)
    bus._idle, bus._wake = asyncio.Event(), asyncio.Event()
    bus.publish_node_status({"role": "decode"})
    version = bus._status_version
    if acknowledged:
        bus._status_acked = bus._status_delivered = version
    err = aiomqtt.MqttError("Disconnected during message iteration")
    for _ in range(MAX_SEND_ATTEMPTS):
        bus._status_in_flight.add(version)
        bus._blame_in_flight(err, 0x95)  # the broker said the packet was at fault
    assert bus._status_given_up == (0 if acknowledged else version)


async def test_a_status_given_up_then_tried_again_does_not_block_the_events() -> None:
    """A status given up counted as acknowledged; tried again after a connection that made
    progress ended (a broker restart), its failures no longer counted: it was sent first on
    every connection, killing each, and no event got through again (19 reconnects in 20 s in a
    review's run). It is given up again now, and the events flow. (The control, a status the
    broker acknowledged, is test_a_node_status_the_broker_acknowledged_is_never_given_up.)"""
    with small_packet_broker() as broker:
        bus = make_bus(broker)
        await bus.start()
        try:
            bus.publish_node_status({"role": "decode", "pad": POISON})
            async with subscriber(broker, EVENTS) as sub:
                first = [bus.emit("node_joined", node=f"ok{i}") for i in range(3)]
                await collect(sub, set(first))
            assert await bus.wait_drained(5)
            broker.stop()  # the connection that made progress ends
            await wait_until(lambda: not bus.connected)
            broker.start()
            async with subscriber(broker, EVENTS) as sub:
                later = bus.emit("node_joined", node="later")
                assert later in await collect(sub, {later}, timeout=10)
        finally:
            await bus.stop()


# --- a PUBACK's reason code: a refusal from 0x80 up --------------------------------------------


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        (0x00, False),  # Success
        (0x10, False),  # No matching subscribers: taken all the same
        (0x7F, False),  # the highest success value (no PUBACK code of its own: paho's int)
        (0x80, True),  # Unspecified error: the lowest refusal
        (0x87, True),  # Not authorized (the broker's ACL)
    ],
    ids=["0x00", "0x10", "0x7f", "0x80", "0x87"],
)
async def test_a_puback_reason_code_from_0x80_up_is_a_refusal(
    monkeypatch: pytest.MonkeyPatch, code: int, refused: bool
) -> None:
    """MQTT 5: a PUBACK reason code below 0x80 says the broker took the message, 0x80 and up that
    it did not. A message acknowledged 0x80 counted as delivered would be lost with nothing held,
    counted or logged. ``_Client.publish`` is given each code as paho's on_publish reports it,
    with no broker (Mosquitto sends none but 0x87 of the refusals)."""
    client = events_mod._Client("127.0.0.1", free_port(), protocol=aiomqtt.ProtocolVersion.V5)
    assert client.puback_codes
    paho = client._client
    mid = 7
    reason = code if code == 0x7F else ReasonCode(PacketTypes.PUBACK, identifier=code)

    def publish(topic: str, payload: Any, qos: int, retain: bool, properties: Any) -> Any:
        # sent; its PUBACK comes in later, through paho's on_publish as when read off the socket
        asyncio.get_running_loop().call_soon(paho.on_publish, paho, None, mid, reason, None)
        return events_mod.paho_mqtt.MQTTMessageInfo(mid)

    monkeypatch.setattr(paho, "publish", publish)
    topic = f"kvfence/v1/{CLUSTER}/events/node_joined"
    if refused:
        with pytest.raises(events_mod.PublishRefused) as err:
            await client.publish(topic, b"{}", qos=1, timeout=5)
        assert err.value.reason_code == code and err.value.topic == topic
    else:
        await client.publish(topic, b"{}", qos=1, timeout=5)
    assert not client._kv_acks  # the waiter was answered and is gone
