"""EventBus and a broker that refuses its messages (its ACL), or speaks only MQTT 3.1.1; a TLS
broker that requires a client certificate the bus (or ``kvfence events``) has none of.

Over MQTT 3.1.1 Mosquitto answers a QoS 1 PUBLISH its ACL denies with an ordinary PUBACK and
drops the message: the bus counted every event (security ones included) and the retained node
status delivered, with nothing logged or counted. The bus now speaks MQTT 5, whose PUBACK says
0x87 Not authorized, and keeps a refused message buffered, counted and logged; aiomqtt (2.5.1)
ignores that reason code, so ``_Client`` reads it (tests here fail if aiomqtt changes under it).
A broker that requires a client certificate showed as a bare "Operation timed out". Controls: an
allowed topic still delivers, a broker without the requirement still connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import aiomqtt
import pytest
import structlog
from fixtures_mqtt import Mosquitto, free_port, start_mosquitto
from test_events import (  # noqa: F401  (pki: a fixture)
    ACCOUNTS,
    CLUSTER,
    PUBLISHER,
    WATCHER,
    broker_tls,
    cli_while_emitting,
    make_bus,
    pki,
    receive,
    run_cli,
    subscriber,
    trust,
    wait_until,
)

import kvfence.events as events_mod
from kvfence.events import (
    MAX_SEND_ATTEMPTS,
    EventBus,
    MqttTls,
    PublishRefused,
    _Client,
    event_topic,
    follow,
    is_client_certificate_required,
    is_tls_failure,
    node_topic,
)
from kvfence.metrics import Metrics

# The publisher may write under another cluster's prefix only (an external broker's ACL written
# for "prod"); the watcher reads everything.
OTHER_CLUSTER_ACL = (
    "user kvfence\ntopic readwrite kvfence/v1/prod/#\nuser watcher\ntopic read kvfence/v1/#\n"
)
OWN_CLUSTER_ACL = (
    f"user kvfence\ntopic readwrite kvfence/v1/{CLUSTER}/#\nuser watcher\ntopic read kvfence/v1/#\n"
)
REFUSED = "event bus message refused by the broker"
# what the bus logs for a failed connection attempt
FAILURES = {
    "event bus TLS handshake with the broker failed",
    "event bus got no answer from the broker",
    "event bus disconnected",
}


def refused_total(metrics: Metrics) -> float:
    """kvfence_events_refused_total of ``metrics`` as exported (0 when it is not there)."""
    for line in metrics.render().decode().splitlines():
        if line.startswith("kvfence_events_refused_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def dropped_total(metrics: Metrics) -> float:
    return float(metrics.events_dropped_total._value.get())


# --- the PUBACK's reason code ----------------------------------------------------------------


def publisher(broker: Any, tls: MqttTls | None = None, timeout: float = 5) -> _Client:
    """The bus's own client class, logged in as the publishing account, over MQTT 5."""
    return _Client(
        broker.host,
        broker.port,
        username=PUBLISHER.username,
        password=PUBLISHER.password,
        tls_context=None if tls is None else tls.context(),
        protocol=aiomqtt.ProtocolVersion.V5,
        timeout=timeout,
    )


async def test_the_client_reads_the_pubacks_reason_code() -> None:
    """What the bus relies on, against aiomqtt and paho as installed: ``_Client`` chains paho's
    on_publish (aiomqtt 2.5.1 drops the reason code), and its publish raises PublishRefused for
    a message the ACL denies; an allowed one (0x10 No matching subscribers, a success) returns."""
    with start_mosquitto(users=ACCOUNTS, acl=OTHER_CLUSTER_ACL) as broker:
        client = publisher(broker)
        assert client.puback_codes  # the chain is in place after __init__ ...
        async with client:
            assert client.puback_codes  # ... and after the CONNECT (aiomqtt did not reset it)
            await client.publish("kvfence/v1/prod/events/node_joined", b"{}", qos=1)  # control
            with pytest.raises(PublishRefused) as err:
                await client.publish("kvfence/v1/staging/events/node_joined", b"{}", qos=1)
            assert err.value.reason_code == 0x87 and err.value.reason == "Not authorized"
            assert err.value.topic == "kvfence/v1/staging/events/node_joined"
            with pytest.raises(PublishRefused):  # the retained status alike
                await client.publish("kvfence/v1/staging/nodes/a", b"{}", qos=1, retain=True)
            await client.publish("kvfence/v1/prod/nodes/a", b"{}", qos=1, retain=True)
            assert client.receive_maximum == 20  # Mosquitto's default, from the CONNACK
            assert not client._kv_acks  # every waiter answered and gone


async def test_without_the_chain_publish_is_aiomqtts_and_the_bus_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fallback when aiomqtt changes (its paho client gone, or on_publish set again later):
    publish is aiomqtt's own, as before (a refused message counts as delivered), and the bus
    warns once that it cannot see refusals."""
    with start_mosquitto(users=ACCOUNTS, acl=OTHER_CLUSTER_ACL) as broker:
        client = publisher(broker)
        client._client.on_publish = client._on_publish  # what a later aiomqtt might do
        assert not client.puback_codes
        async with client:
            await client.publish("kvfence/v1/staging/events/node_joined", b"{}", qos=1)

        monkeypatch.setattr(_Client, "puback_codes", property(lambda self: False))
        bus = make_bus(broker, credentials=PUBLISHER)
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                bus.emit("node_joined")
                assert await bus.wait_drained(5)  # "delivered": today's behaviour
            finally:
                await bus.stop()
    blind = [
        e for e in logs if e["event"] == "event bus cannot read the broker's PUBACK reason codes"
    ]
    assert len(blind) == 1 and blind[0]["log_level"] == "warning"


# --- a refused event and node status ---------------------------------------------------------


async def test_a_message_the_acl_refuses_stays_buffered_counted_and_said() -> None:
    """A bus whose cluster the broker's ACL does not grant: its events (security ones included)
    and its retained status stay buffered, the refusals are counted (an alert can see them) and
    logged as an error per topic, and later events to a refused topic are held, not sent again
    and again. Control: a bus of the cluster the ACL grants, on the same broker, delivers."""
    with start_mosquitto(users=ACCOUNTS, acl=OTHER_CLUSTER_ACL) as broker:
        metrics = Metrics("decode")
        bus = make_bus(broker, credentials=PUBLISHER, metrics=metrics)
        assert 'kvfence_events_refused_total{service="decode"} 0.0' in metrics.render().decode()
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                bus.publish_node_status({"role": "decode"})
                for _ in range(3):
                    bus.emit("integrity_violation", check="mac")
                for _ in range(2):
                    bus.emit("node_joined")
                await wait_until(lambda: refused_total(metrics) >= 6)
                assert not await bus.wait_drained(0.5)
                refusals = refused_total(metrics)
                for _ in range(50):  # to a refused topic: held, not sent
                    bus.emit("node_joined")
                await asyncio.sleep(0.5)
                assert refused_total(metrics) == refusals <= 6
                assert bus.connected and bus.pending == 55 and bus.dropped == 0
                assert dropped_total(metrics) == 0
            finally:
                await bus.stop(flush_timeout=0.2)

        # control: the cluster the ACL grants
        prod_metrics = Metrics("decode")
        prod = EventBus(
            "prod",
            "node-b",
            "127.0.0.1",
            broker.port,
            credentials=PUBLISHER,
            metrics=prod_metrics,
        )
        async with subscriber(broker, "kvfence/v1/prod/#", WATCHER) as sub:
            await prod.start()
            try:
                prod.publish_node_status({"role": "decode"})
                seq = prod.emit("integrity_violation", check="mac")
                got = await receive(sub, 2)
                assert await prod.wait_drained(5)
            finally:
                await prod.stop()
        assert {g["_topic"] for g in got} == {
            "kvfence/v1/prod/nodes/node-b",
            "kvfence/v1/prod/events/integrity_violation",
        }
        assert seq in [g.get("seq") for g in got]
        assert refused_total(prod_metrics) == 0

    errors = [e for e in logs if e["event"] == REFUSED and e["log_level"] == "error"]
    assert {e["topic"] for e in errors} == {
        node_topic(CLUSTER, "node-a"),
        event_topic(CLUSTER, "integrity_violation"),
        event_topic(CLUSTER, "node_joined"),
    }
    assert len(errors) == 3  # once per topic: the rest at debug level
    for e in errors:
        assert e["reason"] == "Not authorized" and e["reason_code"] == "0x87"
        assert e["username"] == "kvfence" and f"kvfence/v1/{CLUSTER}/#" in e["hint"]
    assert not [e for e in logs if e["event"] == "event dropped undelivered"]
    assert [e for e in logs if e["event"] == "events not delivered at stop"]


async def test_refused_messages_are_delivered_once_the_acl_lets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator fixes the ACL (Mosquitto rereads it on SIGHUP): the held events and the
    retained status go out without a restart or a reconnect, within REFUSED_RETRY_S."""
    monkeypatch.setattr(events_mod, "REFUSED_RETRY_S", 0.2)
    with start_mosquitto(users=ACCOUNTS, acl=OTHER_CLUSTER_ACL) as broker:
        metrics = Metrics("decode")
        bus = make_bus(broker, credentials=PUBLISHER, metrics=metrics)
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                bus.publish_node_status({"role": "decode"})
                seqs = [bus.emit("integrity_violation", check="mac") for _ in range(5)]
                seqs += [bus.emit("node_joined") for _ in range(5)]
                await wait_until(lambda: refused_total(metrics) >= 3)
                await asyncio.sleep(0.5)  # a few retries, still refused
                assert not await bus.wait_drained(0.1) and bus.pending == 10

                (broker.conf.parent / "acl").write_text(OWN_CLUSTER_ACL)
                assert broker.proc is not None
                broker.proc.send_signal(signal.SIGHUP)
                assert await bus.wait_drained(10)
                async with subscriber(broker, f"kvfence/v1/{CLUSTER}/nodes/#", WATCHER) as sub:
                    (status,) = await receive(sub, 1)  # the retained status is there now
            finally:
                await bus.stop()
    assert status["role"] == "decode" and status["online"] is True
    assert bus.dropped == 0 and dropped_total(metrics) == 0
    accepted = [e for e in logs if e["event"] == "event bus message accepted by the broker again"]
    assert {e["topic"] for e in accepted} >= {
        event_topic(CLUSTER, "integrity_violation"),
        event_topic(CLUSTER, "node_joined"),
    }
    assert not [e for e in logs if e["event"] == "event bus disconnected"]  # no reconnect


async def test_a_refused_topic_holds_up_no_other() -> None:
    """An ACL that grants the events but not the nodes topic, and denies one kind: the other
    kinds are delivered, in order, while the status and the denied kind stay held."""
    acl = (
        f"user kvfence\ntopic write kvfence/v1/{CLUSTER}/events/#\n"
        f"topic deny kvfence/v1/{CLUSTER}/events/model_access\n"
        "user watcher\ntopic read kvfence/v1/#\n"
    )
    with start_mosquitto(users=ACCOUNTS, acl=acl) as broker:
        metrics = Metrics("prefill")
        bus = make_bus(broker, credentials=PUBLISHER, metrics=metrics)
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/#", WATCHER) as sub:
            await bus.start()
            try:
                await wait_until(lambda: bus.connected)
                bus.publish_node_status({"role": "prefill"})
                bus.emit("model_access", model="m")
                await wait_until(lambda: refused_total(metrics) == 2)
                sent = []
                for i in range(20):
                    bus.emit("model_access", model="m")
                    sent.append(bus.emit("integrity_violation", check="mac", i=i))
                got = await receive(sub, 20)
                await wait_until(lambda: bus.pending == 21)
                assert not await bus.wait_drained(0.3)
            finally:
                await bus.stop(flush_timeout=0.2)
    assert [g["seq"] for g in got] == sent
    assert {g["_topic"] for g in got} == {event_topic(CLUSTER, "integrity_violation")}
    assert refused_total(metrics) == 2  # the status and model_access once: the rest held


async def test_an_event_the_broker_rejects_for_itself_is_dropped_not_held_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker may refuse one message (its payload: 0x99 Payload format invalid) and take the
    others to the same topic: held with them, it would block its kind for good. Refused
    MAX_SEND_ATTEMPTS times while the topic took other messages, it is dropped and counted (a
    security event cut to its header first, which then goes through)."""
    monkeypatch.setattr(events_mod, "REFUSED_RETRY_S", 0.05)
    publish = _Client.publish

    async def picky(self: _Client, topic: str, payload: Any = None, *a: Any, **kw: Any) -> None:
        if b"POISON" in (payload or b""):
            raise PublishRefused(topic, 0x99, "Payload format invalid")
        await publish(self, topic, payload, *a, **kw)

    monkeypatch.setattr(_Client, "publish", picky)
    with start_mosquitto() as broker:
        metrics = Metrics("decode")
        bus = make_bus(broker, metrics=metrics)
        async with subscriber(broker, f"kvfence/v1/{CLUSTER}/events/#") as sub:
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    poison_plain = bus.emit("node_joined", note="POISON")
                    poison_security = bus.emit("integrity_violation", note="POISON")
                    fine: list[int] = []
                    for _ in range(3 * MAX_SEND_ATTEMPTS):  # the topics keep taking others
                        fine.append(bus.emit("node_joined"))
                        fine.append(bus.emit("integrity_violation", check="mac"))
                        await asyncio.sleep(0.1)
                    assert await bus.wait_drained(10)
                    got = await receive(sub, len(fine) + 1, timeout=5)
                finally:
                    await bus.stop()
    seqs = [g["seq"] for g in got]
    assert set(fine) <= set(seqs) and poison_plain not in seqs
    (stub,) = [g for g in got if g["seq"] == poison_security]
    assert stub["truncated"] is True and "note" not in stub
    assert bus.dropped == 1 and dropped_total(metrics) == 1
    (dropped,) = [e for e in logs if e["event"] == "event dropped undelivered"]
    assert dropped["seq"] == poison_plain and "Payload format invalid" in dropped["error"]


# --- MQTT versions and the broker's limits ---------------------------------------------------


class Mqtt311OnlyBroker:
    """A proxy in front of Mosquitto that answers an MQTT 5 CONNECT as an MQTT 3.1.1-only broker
    must ([MQTT-3.1.2-2]: CONNACK return code 1, unacceptable protocol level, then close) and
    passes an MQTT 3.1.1 client through."""

    def __init__(self, broker: Mosquitto):
        self.broker = broker
        self.port = free_port()
        self.levels: list[int] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Mqtt311OnlyBroker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:  # ends the pipes: their tasks return
            writer.close()
        await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.append(writer)
        try:
            head = await reader.readexactly(2)  # CONNECT, remaining length (< 128 here)
            body = await reader.readexactly(head[1])
            level = body[6]  # after the protocol name: 00 04 "MQTT"
            self.levels.append(level)
            if level == 5:
                writer.write(b"\x20\x02\x00\x01")
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection(self.broker.host, self.broker.port)
            self._writers.append(up_writer)
            up_writer.write(head + body)

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                with contextlib.suppress(ConnectionError):
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                dst.close()

            try:
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            finally:
                up_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)


async def follow_one_while_emitting(bus: EventBus, port: int) -> dict[str, Any]:
    """The first event ``follow`` gets from 127.0.0.1:``port`` while ``bus`` keeps emitting."""
    stream = cast(AsyncGenerator[dict[str, Any], None], follow(CLUSTER, "127.0.0.1", port))
    try:
        first = asyncio.ensure_future(anext(stream))
        while not first.done():
            bus.emit("node_joined")
            await asyncio.sleep(0.05)
        return await first
    finally:
        await stream.aclose()


async def test_a_broker_that_speaks_only_mqtt_311_gets_it() -> None:
    """Such a broker refuses the MQTT 5 CONNECT ("unsupported protocol version"): the bus and
    ``follow`` connect again with MQTT 3.1.1 and deliver, and the bus warns (once) that there
    a refused message cannot be seen. Control: Mosquitto itself gets MQTT 5 from both."""
    with start_mosquitto() as broker:
        async with Mqtt311OnlyBroker(broker) as old:
            bus = EventBus(CLUSTER, "node-a", "127.0.0.1", old.port)
            with structlog.testing.capture_logs() as logs:
                await bus.start()
                try:
                    event = await follow_one_while_emitting(bus, old.port)
                    assert event["kind"] == "node_joined"
                    assert await bus.wait_drained(5)
                finally:
                    await bus.stop()
            # the bus and follow: MQTT 5 once each, then 3.1.1 (the bus for good)
            assert old.levels[0] == 5 and old.levels.count(5) == 2 and old.levels.count(4) >= 2
            fallback = [
                e
                for e in logs
                if e["event"] == "event bus broker does not speak MQTT 5: using MQTT 3.1.1"
            ]
            assert len(fallback) == 1 and fallback[0]["log_level"] == "warning"
            connected = [e for e in logs if e["event"] == "event bus connected"]
            assert connected and all(e["mqtt"] == "3.1.1" for e in connected)

        # control: straight to Mosquitto, MQTT 5 (its log: "p5"; "p2" is 3.1.1)
        before = len(broker.log_text())
        bus = make_bus(broker)
        await bus.start()
        try:
            await follow_one_while_emitting(bus, broker.port)
        finally:
            await bus.stop()
        log = broker.log_text()[before:]
        assert "as kvfence-node-a-" in log and "as kvfence-follow-" in log
        for line in log.splitlines():
            if "New client connected" in line and " as kvfence-" in line:
                assert "(p5," in line, line


async def test_cli_events_follow_over_mqtt5(tmp_path: Path) -> None:
    """``kvfence events --follow`` connects with MQTT 5 (Mosquitto's log: p5) and shows events."""
    with start_mosquitto(users=ACCOUNTS) as broker:
        bus = make_bus(broker, credentials=PUBLISHER)
        await bus.start()
        try:
            result = await cli_while_emitting(
                ["--json", "--mqtt-port", str(broker.port), "--cluster", CLUSTER,
                 "--mqtt-username", "watcher"],
                bus,
                {"KVFENCE_MQTT_PASSWORD": WATCHER.password},
            )  # fmt: skip
        finally:
            await bus.stop()
        log = broker.log_text()
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("{")]
    assert json.loads(line)["kind"] == "node_joined"
    (follower,) = [ln for ln in log.splitlines() if "as kvfence-follow-" in ln]
    assert "(p5," in follower and "u'watcher'" in follower


@contextlib.contextmanager
def broker_with(conf: str) -> Iterator[Mosquitto]:
    with tempfile.TemporaryDirectory(prefix="kvfence-mqtt-") as tmp:
        Path(tmp).chmod(0o755)
        broker = Mosquitto(free_port(), Path(tmp))
        broker.conf.write_text(broker.conf.read_text() + conf)
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()


@pytest.mark.parametrize("receive_maximum", [5, None], ids=["receive-maximum-5", "default"])
async def test_the_brokers_receive_maximum_bounds_what_is_in_flight(
    monkeypatch: pytest.MonkeyPatch, receive_maximum: int | None
) -> None:
    """MQTT 5: a client must not have more unacknowledged QoS 1 messages than the CONNACK's
    Receive Maximum (a broker may disconnect it); paho does not keep to it, the bus does.
    Control: Mosquitto's default (20) still lets 20 go at once."""
    publish = _Client.publish
    now = most = 0

    async def counting(self: _Client, *a: Any, **kw: Any) -> None:
        nonlocal now, most
        now += 1
        most = max(most, now)
        try:
            await publish(self, *a, **kw)
        finally:
            now -= 1

    monkeypatch.setattr(_Client, "publish", counting)
    conf = "" if receive_maximum is None else f"max_inflight_messages {receive_maximum}\n"
    with broker_with(conf) as broker:
        bus = make_bus(broker)
        await bus.start()
        try:
            for _ in range(500):
                bus.emit("node_joined", pad="x" * 500)
            assert await bus.wait_drained(10)
        finally:
            await bus.stop()
    assert most == (receive_maximum or 20)


# --- a TLS broker that requires a client certificate -----------------------------------------


async def test_a_broker_that_requires_a_client_certificate_says_so(
    pki: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TLS 1.3 checks the client's certificate after the handshake: the broker ends the
    connection with an alert, which aiomqtt reported as "Operation timed out", a warning every
    few seconds. Now: an error that says the broker requires a client certificate and names the
    settings, once (then debug); events stay buffered. Controls: with the client certificate the
    bus delivers; without one, a broker that does not require it still takes the bus."""
    monkeypatch.setattr(events_mod, "PUBLISH_TIMEOUT_S", 1.0)
    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki, require_certificate=True)) as broker:
        bus = make_bus(broker, credentials=PUBLISHER, tls=trust(pki))  # the CA only
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                bus.emit("integrity_violation", check="mac")
                await wait_until(
                    lambda: len([e for e in logs if e["event"] in FAILURES]) >= 3, timeout=15
                )
                assert not bus.connected and bus.pending == 1
            finally:
                await bus.stop(flush_timeout=0.1)
        with_cert = make_bus(broker, credentials=PUBLISHER, tls=trust(pki, client="client"))
        assert await delivers(broker, pki, with_cert)
    failed = [e for e in logs if e["event"] in FAILURES]
    assert {e["event"] for e in failed} == {"event bus TLS handshake with the broker failed"}
    assert [e["log_level"] for e in failed].count("error") == 1, failed
    error = next(e for e in failed if e["log_level"] == "error")
    assert "TLSV13_ALERT_CERTIFICATE_REQUIRED" in error["error"]
    assert "requires a client certificate" in error["hint"]
    assert "events.mqtt_tls_cert_file and events.mqtt_tls_key_file" in error["hint"]
    assert "timed out" not in (bus.last_error or "")

    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki)) as broker:  # no requirement
        assert await delivers(broker, pki, make_bus(broker, credentials=PUBLISHER, tls=trust(pki)))


async def delivers(broker: Mosquitto, pki_dir: Path, bus: EventBus) -> bool:
    sub_tls = trust(pki_dir, client="client")
    async with subscriber(broker, f"kvfence/v1/{CLUSTER}/#", WATCHER, sub_tls) as sub:
        await bus.start()
        try:
            seq = bus.emit("integrity_violation", check="mac")
            (got,) = await receive(sub, 1)
            return got["seq"] == seq and await bus.wait_drained(5)
        finally:
            await bus.stop()


async def test_the_alert_fails_the_attempt_without_waiting_for_a_connack(
    pki: Path,  # noqa: F811
) -> None:
    """The broker's "certificate required" alert ends the attempt at once: aiomqtt waited out
    its timeout (10 s by default) for the CONNACK, then said "Operation timed out". With a
    timeout far longer than the test's bound, the alert must be what ends it. Control: with the
    client certificate, the same client connects."""
    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki, require_certificate=True)) as broker:
        with pytest.raises(events_mod.MqttTlsAlert) as refused:
            async with asyncio.timeout(60):
                async with publisher(broker, trust(pki), timeout=600):
                    pass
        assert is_client_certificate_required(refused.value)
        async with asyncio.timeout(60):
            async with publisher(broker, trust(pki, client="client"), timeout=600) as good:
                await good.publish(event_topic(CLUSTER, "node_joined"), b"{}", qos=1)


@asynccontextmanager
async def silent_tls_server(pki_dir: Path) -> AsyncIterator[int]:
    """A TLS listener that completes the handshake (no client certificate asked) and never
    answers: what a client without a certificate may get from some brokers and proxies."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki_dir / "server.pem", pki_dir / "server.key")
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(Exception):
            await reader.read()

    server = await asyncio.start_server(hold, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()


async def test_no_answer_over_tls_without_a_client_certificate_hints_at_one(
    pki: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No alert, no CONNACK: with TLS on and no client certificate configured, the error hints
    that the broker may require one (the config's setting names), once."""
    monkeypatch.setattr(events_mod, "PUBLISH_TIMEOUT_S", 0.5)
    async with silent_tls_server(pki) as port:
        bus = EventBus(CLUSTER, "node-a", "127.0.0.1", port, tls=trust(pki))
        with structlog.testing.capture_logs() as logs:
            await bus.start()
            try:
                bus.emit("node_joined")
                await wait_until(
                    lambda: len([e for e in logs if e["event"] in FAILURES]) >= 3, timeout=10
                )
            finally:
                await bus.stop(flush_timeout=0.1)
    failed = [e for e in logs if e["event"] in FAILURES]
    assert {e["event"] for e in failed} == {"event bus got no answer from the broker"}
    (error,) = [e for e in failed if e["log_level"] == "error"]
    assert "may drop a client without one" in error["hint"]
    assert "events.mqtt_tls_cert_file and events.mqtt_tls_key_file" in error["hint"]


async def test_cli_events_against_a_broker_that_requires_a_client_certificate(
    pki: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``kvfence events -f`` with the CA only: exit 1 with "requires a client certificate" and
    the flags (or, from --config, the settings) to give; over TLS to a broker that never
    answers, the same hint as a maybe. Control: with --mqtt-tls-cert/--mqtt-tls-key it follows."""
    env = {"KVFENCE_MQTT_PASSWORD": WATCHER.password}
    config = tmp_path / "config.yaml"
    pw_file = tmp_path / "pw"
    pw_file.write_text(WATCHER.password)
    with start_mosquitto(users=ACCOUNTS, tls=broker_tls(pki, require_certificate=True)) as broker:
        target = [
            "--mqtt-port",
            str(broker.port),
            "--cluster",
            CLUSTER,
            "--mqtt-username",
            "watcher",
        ]
        ca_only = ["events", "-f", *target, "--mqtt-tls-ca", str(pki / "ca.pem")]
        flags = await asyncio.to_thread(run_cli, ca_only, env)
        config.write_text(
            f"cluster: {CLUSTER}\nevents:\n  mqtt_host: 127.0.0.1\n  mqtt_port: {broker.port}\n"
            f"  mqtt_username: watcher\n  mqtt_password_file: {pw_file}\n"
            f"  mqtt_tls_ca_file: {pki / 'ca.pem'}\n"
        )
        from_config = await asyncio.to_thread(run_cli, ["events", "-f", "--config", str(config)])
        bus = make_bus(broker, credentials=PUBLISHER, tls=trust(pki, client="client"))
        await bus.start()
        try:
            cert = [
                "--mqtt-tls-cert",
                str(pki / "client.pem"),
                "--mqtt-tls-key",
                str(pki / "client.key"),
            ]
            good = await cli_while_emitting(
                ["--json", *target, "--mqtt-tls-ca", str(pki / "ca.pem"), *cert], bus, env
            )
        finally:
            await bus.stop()
    assert good.exit_code == 0, good.output
    assert flags.exit_code == 1 and from_config.exit_code == 1
    assert f"MQTT broker 127.0.0.1:{broker.port} requires a client certificate" in flags.output
    assert "give --mqtt-tls-cert and --mqtt-tls-key" in flags.output
    assert "give events.mqtt_tls_cert_file and events.mqtt_tls_key_file" in from_config.output

    async with silent_tls_server(pki) as port:
        silent = await asyncio.to_thread(
            run_cli,
            ["events", "-f", "--mqtt-port", str(port), "--mqtt-tls-ca", str(pki / "ca.pem")],
        )
    assert silent.exit_code == 1
    assert "unreachable or lost: Operation timed out" in silent.output
    assert "may drop a client without one; give --mqtt-tls-cert and --mqtt-tls-key" in silent.output


def test_the_certificate_required_alert_is_a_tls_failure() -> None:
    alert = events_mod.MqttTlsAlert("TLSV13_ALERT_CERTIFICATE_REQUIRED")
    assert is_tls_failure(alert) and is_client_certificate_required(alert)
    other = events_mod.MqttTlsAlert("SSLV3_ALERT_BAD_CERTIFICATE")
    assert is_tls_failure(other) and not is_client_certificate_required(other)
    assert not is_client_certificate_required(aiomqtt.MqttError("Operation timed out"))
