"""Cluster events over MQTT: a never-blocking emitter with an at-least-once buffer, and a follower.

Topics (DESIGN.md "Events and logs")::

    kvfence/v1/<cluster>/events/<kind>    QoS 1, JSON {"seq", "ts", "kind", "cluster", "node_id"..}
    kvfence/v1/<cluster>/nodes/<node_id>  QoS 1, retained: the node's latest status

``follow`` reads a cluster's events; ``clusters_seen`` reads the retained node statuses of every
cluster (``kvfence/v1/+/nodes/+``) to name the clusters a reader can see on a broker.

``EventBus.emit`` is called on request paths, so it only appends to a bounded in-memory buffer and
wakes the publisher task; it never blocks and never raises. The publisher removes an event from the
buffer only after the broker acknowledged it (PUBACK), so a broker restart loses nothing that was
still buffered: the whole buffer is re-sent after reconnecting. Consumers therefore see each event
at least once and dedupe by ``(node_id, seq, ts)`` (``follow`` does this).

A broker that requires an account gets ``MqttCredentials`` (``events.mqtt_username`` and the
password read from ``events.mqtt_password_file``: ``load_mqtt_credentials``). A broker that refuses
the connection (no, or wrong, credentials) is treated like an unreachable one: the events stay
buffered (bounded) and the publisher retries, and it logs the refusal as an error naming the
account, never the password. Nothing on the request path waits for the broker either way.

TLS to the broker (``events.mqtt_tls_ca_file``, and for a broker that requires client
certificates ``mqtt_tls_cert_file`` + ``mqtt_tls_key_file``: ``MqttTls``, ``load_mqtt_tls``): the
broker's certificate must be signed by that CA, the only one trusted, and name ``mqtt_host``. The
files are read at start (a ConfigError then) and again before every reconnect, so renewed
certificates are picked up. A handshake that fails (unknown CA, a certificate for another host, a
broker that serves no TLS on the port) is handled like a refused account, and so is a broker that
never answers a plain client's CONNECT (what a TLS listener does with one): the events stay
buffered, and the failure is logged as an error with a hint, once per reason and then at most
every ``REFUSAL_LOG_INTERVAL_S``.

The bus speaks MQTT 5 so that a broker that refuses a message can say so: over MQTT 3.1.1 a broker
whose ACL denies a publish (an external broker whose ACL names another cluster) acknowledges it as
usual and drops it, while over MQTT 5 its PUBACK carries a reason code >= 0x80 (0x87 Not
authorized); aiomqtt ignores that code, so ``_Client.publish`` reads it (``PublishRefused``). A
refused message is treated like a refused account: it stays buffered, the refusal is counted
(``events_refused_total``, each refused PUBACK) and logged as an error naming the topic (once per
topic and then at most every ``REFUSAL_LOG_INTERVAL_S``). Later events to that topic are held,
not sent, and one held event (each in turn, oldest first) is tried again every
``REFUSED_RETRY_S`` and on every new connection; once the broker takes one (its ACL was fixed)
the rest follow. Other topics flow meanwhile, and the retained node status is held and retried
the same way; the bus is not drained while anything is held. An event refused
``MAX_SEND_ATTEMPTS`` times while the broker took other events of its kind is rejected for itself
(not its topic) and dropped like one that keeps breaking the connection (below). A broker that
answers an MQTT 5 CONNECT with "unsupported protocol version" (one that speaks only 3.1.1) gets
3.1.1 from then on, with a warning: there, refusals cannot be seen. The broker's Receive Maximum
(CONNACK) bounds the messages in flight.

When the buffer is full the oldest non-security event goes first; security events (see
``SECURITY_KINDS``) are dropped only when the buffer holds nothing else. Every drop is counted.

One message the broker always rejects must not block the ones behind it: Mosquitto drops the
connection of a client that sends a packet over its ``max_packet_size``, so re-sending
the buffer from its oldest event would fail the same way on every connection. Each connection
that failed (not one that timed out: no answer, a stalled broker or path, counts against nothing)
therefore counts against every event (and node status not yet acknowledged) it had in flight,
and one that failed before is re-sent alone, acknowledged before anything else goes out. One in
flight on ``MAX_SEND_ATTEMPTS`` such connections is dropped when the last of them says the broker
rejects a packet: over MQTT 5 its DISCONNECT says so (0x95 Packet too large, 0x81 Malformed
packet, 0x99 Payload format invalid: ``REJECTED_PACKET_REASONS``), and a connection that ended
otherwise (a reset, a broker restart) is an outage that drops nothing, however often; over MQTT
3.1.1 a broker cannot say why, and any failed connection counts. (Mosquitto can lose that
DISCONNECT when more of our packets reach it after it closed the connection; the message alone
gets it.) A dropped event is counted (``events_dropped_total``) and logged as an error naming its
kind and seq, except a security event: that is cut to its header (kind, seq, ts, node,
``truncated: true``, ``original_bytes``) and sent so, and dropped only if that fails as often.
An event that cannot be encoded at all (JSON) is dropped and counted at once. The
reconnect backoff starts over only after a connection made progress (the broker acknowledged
something new, or it stayed up ``BACKOFF_RESET_AFTER_S``): a broker that drops every connection at
once is retried ever more slowly, up to ``BACKOFF_MAX_S``.

The node status (``publish_node_status``) is retained, and every connection leaves a will (the same
topic, retained: ``"online": false`` and no ``"ts"``, which every status the bus publishes carries)
that the broker publishes when the connection ends without a normal DISCONNECT (a crash, or
``KEEPALIVE_S`` x 1.5 without a packet: ``EventBus(keepalive_s=)``). The status is the first
message published on every connection, and one window slot is kept for it, so it never waits for
event acknowledgements. ``stop()`` publishes ``"online": false`` (with "ts") and waits up to its
flush timeout; when the broker has not acknowledged that by then (a slow broker), the connection
ends so that the broker publishes the will (MQTT 5: DISCONNECT 0x04 "Disconnect with will message";
MQTT 3.1.1: no DISCONNECT), since a normal DISCONNECT makes it discard the will. Each connection
subscribes to the node's own status topic (QoS 0; MQTT 5: No Local, no retained message) before it
publishes anything: an ``"online": false`` seen there while the bus runs with an online status is
the will of an older connection the broker ended late (a half-open path: the bus reconnected first,
with a new client id), or a stopping process with the same node id, and the bus publishes its
status again (a warning). An account that may not read that topic is warned about, once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiomqtt
import paho.mqtt.client as paho_mqtt
from aiomqtt.exceptions import MqttConnectError  # not re-exported by aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from kvfence.config import ConfigError
from kvfence.logging import get_logger
from kvfence.tls import TlsError, read_pem

if TYPE_CHECKING:
    from kvfence.config import ClusterConfig, EventsConfig
    from kvfence.metrics import Metrics

TOPIC_ROOT = "kvfence/v1"
EVENT_KINDS = (
    "admission_rejected",
    "integrity_violation",
    "transfer_failed",
    "node_joined",
    "node_lost",
    "node_refused",
    "model_access",
    "request_failed",
)
# Kept in preference to every other kind when the buffer overflows.
SECURITY_KINDS = frozenset({"integrity_violation", "transfer_failed", "node_refused"})
RECENT_SIZE = 1000
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
# A connection that ends without the broker acknowledging anything new (an event, a newer node
# status) sooner than this after its CONNACK made no progress: the backoff keeps growing.
BACKOFF_RESET_AFTER_S = 5.0
# An event (or node status) in flight on this many connections that each failed is dropped when
# the last one says the broker rejects it (Mosquitto disconnects a client whose packet exceeds
# its max_packet_size; see REJECTED_PACKET_REASONS).
MAX_SEND_ATTEMPTS = 3
PUBLISH_TIMEOUT_S = 5.0
# MQTT keepalive (s): a broker that hears nothing for 1.5 times this ends the connection and
# publishes its will (EventBus(keepalive_s=) overrides it).
KEEPALIVE_S = 10
MAX_IN_FLIGHT = 64
# MQTT 5 DISCONNECT reason codes by which a broker says it closed the connection over a packet
# the client sent: 0x81 Malformed packet, 0x95 Packet too large (Mosquitto's max_packet_size),
# 0x99 Payload format invalid. Only a connection that ended so can drop a message (MQTT 5); any
# other end (a reset, a restart, a keepalive timeout) is an outage and drops nothing.
REJECTED_PACKET_REASONS = frozenset({0x81, 0x95, 0x99})
# The MQTT 5 DISCONNECT reason code "Disconnect with will message": the broker publishes the will.
DISCONNECT_WITH_WILL = 0x04
# An MQTT 5 PUBACK reason code from this one up: the broker did not take the message (0x87 Not
# authorized: its ACL; 0x97 Quota exceeded, 0x99 Payload format invalid...). Below it (0x00
# Success, 0x10 No matching subscribers) it did.
PUBACK_REFUSED_FROM = 0x80
# A topic the broker refused a message to is tried again (with one message held for it, each in
# turn) this often, so that fixing the broker's ACL lets the held messages through, no restart.
REFUSED_RETRY_S = 10.0
# The CONNACK reason code "Unsupported protocol version" (MQTT 5; paho reports an MQTT 3.1.1
# broker's return code 1, "unacceptable protocol version", as this one too).
UNSUPPORTED_PROTOCOL_CODE = 0x84
# Characters a topic level (cluster, node id) must not contain: the separator, the wildcards, NUL.
TOPIC_RESERVED = "/+#\x00"
# CONNACK codes of a broker that refused the account: MQTT 3.1.1 "bad username or password" (4)
# and "not authorized" (5), and their MQTT 5 reason codes (134, 135).
AUTH_REFUSED_CODES = frozenset({4, 5, 134, 135})
# A broker that keeps refusing the account (or the TLS handshake, or never answers) is logged
# as an error at most this often (and at once whenever the reason changes); the retries in between
# log at debug level.
REFUSAL_LOG_INTERVAL_S = 60.0
# clusters_seen: the retained node statuses a broker sends after the SUBACK count as all there is
# once this long passes without one (they come back to back), and it stops after SEEN_MAX_S.
SEEN_SETTLE_S = 0.5
SEEN_MAX_S = 3.0
# The settings of EventsConfig that MqttTls's files come from (error messages name them).
TLS_SETTINGS = ("events.mqtt_tls_ca_file", "events.mqtt_tls_cert_file", "events.mqtt_tls_key_file")

log = get_logger("events")


@dataclasses.dataclass(frozen=True)
class MqttCredentials:
    """A broker account. The password is left out of ``repr`` (and so of any log line)."""

    username: str
    password: str = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        if not self.username:
            raise ValueError("MQTT username is empty")
        if not self.password:
            raise ValueError(f"MQTT password of {self.username!r} is empty")


def read_mqtt_password(path: Path, what: str = "events.mqtt_password_file") -> str:
    """The password in ``path``: its content without trailing newlines (as a shell's ``$(cat
    path)`` reads it, which is how the Helm chart hashes it for Mosquitto). Raises ConfigError
    naming ``what`` (where the path came from), whose message never holds the file's content."""
    try:
        password = Path(path).read_text().rstrip("\n")
    except OSError as err:
        raise ConfigError(f"{what} {path}: cannot read it: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: not UTF-8 text") from None
    if not password:
        raise ConfigError(f"{what} {path} is empty")
    return password


def load_mqtt_credentials(events: EventsConfig) -> MqttCredentials | None:
    """The broker account of ``events`` (the config validated that username and password file
    come together); None without one, or without a broker (then nothing is read)."""
    if events.mqtt_host is None or events.mqtt_username is None:
        return None
    assert events.mqtt_password_file is not None
    return MqttCredentials(events.mqtt_username, read_mqtt_password(events.mqtt_password_file))


class _ClosingSSLSocket(ssl.SSLSocket):
    """An SSLSocket that closes itself when its handshake fails. paho (2.2.0) wraps the socket
    and calls ``do_handshake`` without closing it on error, so every refused handshake (an
    unknown CA, a wrong host name: retried every few seconds) left an open socket for the
    garbage collector, and a ``ResourceWarning``."""

    def do_handshake(self, block: bool = False) -> None:
        try:
            super().do_handshake(block)
        except BaseException:
            self.close()
            raise

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        # The alert a broker ends the connection with after the handshake (TLS 1.3 checks the
        # client's certificate only then: "certificate required") reaches paho here, which logs
        # it and drops it; aiomqtt would then just time out waiting for the CONNACK. Noted on
        # the context (one per connection attempt) for _Client to report.
        try:
            return super().recv(buflen, flags)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as err:
            with contextlib.suppress(Exception):
                self.context.kvfence_alert = _ssl_reason(err)  # type: ignore[attr-defined]
            raise


class _ServerNameContext(ssl.SSLContext):
    """A client context that checks (and asks by SNI for) ``server_name`` whatever the host
    connected to: paho passes its host to ``wrap_socket``."""

    server_name: str

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        kwargs["server_hostname"] = self.server_name
        return super().wrap_socket(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class MqttTls:
    """TLS to the broker: its certificate verified against ``ca_file`` (PEM; the only CA
    trusted) and its host name checked; with ``cert_file`` and ``key_file`` (both or neither) a
    client certificate. ``server_name``: the name the certificate must carry when it is not the
    host connected to (``kvfence events`` through a port-forward). ``settings`` names where each
    path came from, for error messages."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    settings: tuple[str, str, str] = dataclasses.field(default=TLS_SETTINGS, compare=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if self.server_name is not None and not self.server_name.strip():
            raise ValueError("the TLS server name is empty")

    def context(self) -> ssl.SSLContext:
        """A client context from the files as they are now. Raises TlsError (a ConfigError)
        naming the setting and the file: missing, unreadable, not PEM, no certificate in the CA
        file, a key that is not the certificate's or is encrypted."""
        ca_what, cert_what, key_what = self.settings
        ca = read_pem(self.ca_file, ca_what).decode("utf-8", "replace")
        # PROTOCOL_TLS_CLIENT: certificate verification and host name check on, TLS >= 1.2
        ctx: ssl.SSLContext
        if self.server_name is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        else:
            ctx = named = _ServerNameContext(ssl.PROTOCOL_TLS_CLIENT)
            named.server_name = self.server_name
        ctx.sslsocket_class = _ClosingSSLSocket
        try:
            ctx.load_verify_locations(cadata=ca)  # only this CA: no system CAs
        except (ssl.SSLError, ValueError) as err:
            reason = _ssl_reason(err)
            raise TlsError(
                f"{ca_what} file {self.ca_file}: no usable CA certificate in it ({reason})"
            ) from None
        if self.cert_file is not None and self.key_file is not None:
            read_pem(self.cert_file, cert_what)
            read_pem(self.key_file, key_what)

            def encrypted() -> bytes:  # without it OpenSSL would prompt on the terminal
                raise TlsError(
                    f"{key_what} file {self.key_file} is encrypted: give an unencrypted key"
                )

            try:
                ctx.load_cert_chain(self.cert_file, self.key_file, password=encrypted)
            except (ssl.SSLError, OSError) as err:
                raise TlsError(
                    f"{cert_what} {self.cert_file} and {key_what} {self.key_file}: not a "
                    f"certificate and its key ({_ssl_reason(err)})"
                ) from None
        return ctx


def _ssl_reason(err: BaseException) -> str:
    return str(getattr(err, "reason", None) or err)


def load_mqtt_tls(events: EventsConfig) -> MqttTls | None:
    """The TLS settings of ``events``; None without a CA (plain TCP) or without a broker. The
    files are read once here, so that a missing or wrong one is a ConfigError at start."""
    if events.mqtt_host is None or events.mqtt_tls_ca_file is None:
        return None
    tls = MqttTls(events.mqtt_tls_ca_file, events.mqtt_tls_cert_file, events.mqtt_tls_key_file)
    tls.context()
    return tls


def is_tls_failure(err: BaseException) -> bool:
    """True when ``err``, a failed connection attempt of a client that uses TLS, is its TLS
    handshake failing: the broker's certificate not signed by the CA or not naming the host (an
    SSL error), a broker that serves no TLS on the port dropping the handshake, or the broker
    ending the connection with a TLS alert before its CONNACK (``MqttTlsAlert``: TLS 1.3's
    "certificate required")."""
    cause: BaseException | None = err
    for _ in range(5):  # aiomqtt raises MqttError(str(exc)) from None: exc is the context
        if cause is None:
            return False
        if isinstance(
            cause, ssl.SSLError | ConnectionResetError | ConnectionAbortedError | MqttTlsAlert
        ):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def is_no_answer(err: BaseException) -> bool:
    """True when ``err`` is aiomqtt giving up waiting for the broker (``Operation timed out``):
    at connect time, what a plain client gets from a broker that serves TLS on the port (it drops
    the connection, which aiomqtt notices only when its timeout ends)."""
    return isinstance(err, aiomqtt.MqttError) and isinstance(err.__context__, TimeoutError)


class PublishRefused(aiomqtt.MqttError):
    """The broker acknowledged a message with a failure (an MQTT 5 PUBACK reason code >=
    ``PUBACK_REFUSED_FROM``, e.g. 0x87 Not authorized: its ACL): it did not take it. The
    connection is fine; other messages are not affected."""

    def __init__(self, topic: str, reason_code: int, reason: str):
        self.topic = topic
        self.reason_code = reason_code
        self.reason = reason
        super().__init__(
            f"the broker refused the message to {topic}: {reason} (0x{reason_code:02x})"
        )


class MqttTlsAlert(aiomqtt.MqttError):
    """The broker ended the TLS connection with an alert after the handshake, before it answered
    CONNECT (TLS 1.3 checks a client certificate then): ``alert`` is OpenSSL's reason, e.g.
    ``TLSV13_ALERT_CERTIFICATE_REQUIRED``."""

    def __init__(self, alert: str):
        self.alert = alert
        super().__init__(f"the broker ended the TLS connection: {alert}")


def is_client_certificate_required(err: BaseException) -> bool:
    """True when ``err`` is a broker that requires a client certificate ending the TLS
    connection of a client that gave none (TLS 1.3's "certificate required" alert)."""
    return isinstance(err, MqttTlsAlert) and "CERTIFICATE_REQUIRED" in err.alert.upper()


def is_unsupported_protocol(err: BaseException) -> bool:
    """True when ``err`` is a broker refusing the connection for its MQTT version (a broker that
    speaks only MQTT 3.1.1, asked for MQTT 5)."""
    if not isinstance(err, MqttConnectError):
        return False
    return getattr(err.rc, "value", err.rc) == UNSUPPORTED_PROTOCOL_CODE


def is_auth_refusal(err: BaseException) -> bool:
    """True when ``err`` is a broker refusing the connection for its credentials."""
    # The CONNACK's code only: other MqttCodeErrors carry paho's own error numbers, where 4 and 5
    # mean "no connection" and "connection refused" (at the TCP level).
    if not isinstance(err, MqttConnectError):
        return False
    code = getattr(err.rc, "value", err.rc)
    return code in AUTH_REFUSED_CODES


class _Client(aiomqtt.Client):
    """An ``aiomqtt.Client`` that leaves nothing behind when its connection attempt fails, is
    cancelled, or the connection ends.

    aiomqtt (2.5.1) opens paho's socket in an executor thread and registers it with the loop (a
    reader, a writer while output is queued, and a ``_misc_loop`` keep-alive task), then waits for
    the CONNACK. When that wait times out ("Operation timed out", a slow broker) or the attempt
    is cancelled (``EventBus.stop``), ``__aenter__`` just raises: the socket stays open and
    registered, so a late CONNACK makes the abandoned attempt a live connection that keeps
    pinging and holds its client id and will; with a slow broker, one more per retry. And a
    cancel while paho's blocking connect still runs leaves the thread to open and register the
    socket after we gave up. ``__aexit__`` can leave the socket open too: when its DISCONNECT
    times out (a hung broker), or when aiomqtt saw the connection break in its reader callback.

    So after a failed or cancelled ``__aenter__`` (once the connect thread is done, not before:
    the loop must not be handed a closed fd) and after every ``__aexit__``, ``_close`` removes
    the socket's reader and writer from the loop, closes it and cancels the keep-alive task. It
    reaches into aiomqtt's private ``_client`` (the paho client, and its ``_sock_close``),
    ``_misc_task`` and ``_client_connect`` (aiomqtt 2.5.1), each looked up with a default so a
    later aiomqtt without them degrades to its own behaviour instead of failing.

    It also reads what aiomqtt (2.5.1) drops: the PUBACK's reason code (``publish`` raises
    ``PublishRefused`` for a refusal) and the CONNACK's Receive Maximum (``receive_maximum``).
    aiomqtt has no hook for either, so both chain paho's documented callbacks (``on_publish``,
    ``on_connect``, VERSION2 signatures) in front of aiomqtt's own; ``publish`` then publishes
    through paho (``Client.publish``, its ``MQTTMessageInfo``) and waits for the reason code. When
    that chain is not in place (a later aiomqtt without ``_client``, or one that sets paho's
    ``on_publish`` again after ``__init__``) ``puback_codes`` is False and ``publish`` is aiomqtt's,
    as before: a refused message then counts as delivered (``EventBus`` warns once).
    Finally, a TLS alert that ended the connection before the CONNACK (TLS 1.3's "certificate
    required") fails the attempt at once with ``MqttTlsAlert``, where aiomqtt waited out its
    timeout and said "Operation timed out".

    Two more for ``EventBus``: ``broker_disconnect_reason`` is the reason code of a DISCONNECT the
    broker sent (MQTT 5; paho's ``on_disconnect`` flags tell it from a connection that just broke,
    which aiomqtt reports alike), and ``leave_will``, set before ``__aexit__``, ends the connection
    so that the broker publishes the will instead of discarding it as a normal DISCONNECT makes
    it: over MQTT 5 a DISCONNECT with reason 0x04 "Disconnect with will message" (paho's
    ``disconnect``, which aiomqtt calls, is wrapped to add it), over MQTT 3.1.1 (no reason codes)
    by closing the socket without a DISCONNECT.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv_loop = asyncio.get_running_loop()
        # Set from both the loop and aiomqtt's connect thread: whether the attempt was given up,
        # whether paho's connect() is running in that thread.
        self._kv_guard = threading.Lock()
        self._kv_abandoned = False
        self._kv_connecting = False
        self._kv_tls_context: ssl.SSLContext | None = kwargs.get("tls_context")
        self._kv_protocol = kwargs.get("protocol")
        # The reason code of the DISCONNECT the broker sent (MQTT 5) before this connection
        # ended; None while it is up, and when it just broke (a reset, a keepalive timeout).
        self.broker_disconnect_reason: int | None = None
        # Set: __aexit__ leaves the will to the broker (see the class docstring).
        self.leave_will = False
        # The Receive Maximum of the broker's CONNACK (MQTT 5): at most this many QoS 1 messages
        # unacknowledged at a time. None: the broker set none (or MQTT 3.1.1).
        self.receive_maximum: int | None = None
        # mid -> the future of a publish() waiting for its PUBACK's reason code
        self._kv_acks: dict[int, asyncio.Future[Any]] = {}
        self._kv_on_publish: Callable[..., None] | None = None
        paho = getattr(self, "_client", None)
        aiomqtt_on_publish = getattr(paho, "on_publish", None)
        if paho is not None and callable(aiomqtt_on_publish):

            def on_publish(
                client: Any, userdata: Any, mid: int, reason_code: Any, props: Any
            ) -> None:
                waiter = self._kv_acks.pop(mid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reason_code)
                aiomqtt_on_publish(client, userdata, mid, reason_code, props)

            paho.on_publish = on_publish
            self._kv_on_publish = on_publish
        aiomqtt_on_connect = getattr(paho, "on_connect", None)
        if paho is not None and callable(aiomqtt_on_connect):

            def on_connect(
                client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any = None
            ) -> None:
                receive_maximum = getattr(props, "ReceiveMaximum", None)
                if isinstance(receive_maximum, int) and receive_maximum > 0:
                    self.receive_maximum = receive_maximum
                aiomqtt_on_connect(client, userdata, flags, reason_code, props)

            paho.on_connect = on_connect
        aiomqtt_on_disconnect = getattr(paho, "on_disconnect", None)
        if paho is not None and callable(aiomqtt_on_disconnect):

            def on_disconnect(
                client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any = None
            ) -> None:
                if getattr(flags, "is_disconnect_packet_from_server", False):
                    code = getattr(reason_code, "value", reason_code)
                    if isinstance(code, int):
                        self.broker_disconnect_reason = code
                self._fail_on_alert()
                aiomqtt_on_disconnect(client, userdata, flags, reason_code, props)

            paho.on_disconnect = on_disconnect
        paho_disconnect = getattr(paho, "disconnect", None)
        if paho is not None and callable(paho_disconnect):

            def disconnect(reasoncode: Any = None, properties: Any = None) -> Any:
                if reasoncode is None and self.leave_will and self._speaks_v5:
                    reasoncode = ReasonCode(PacketTypes.DISCONNECT, identifier=DISCONNECT_WITH_WILL)
                return paho_disconnect(reasoncode, properties)

            paho.disconnect = disconnect

    def _fail_on_alert(self) -> None:
        """The connection ended before the CONNACK with a TLS alert: fail the attempt now. aiomqtt
        (2.5.1) would wait out its whole timeout (10 s by default) for a CONNACK that cannot
        come, and only then would ``__aenter__`` report the alert; ``kvfence events`` against a
        broker that requires a client certificate took 10 s to say so."""
        try:
            on_loop = asyncio.get_running_loop() is self._kv_loop
        except RuntimeError:
            on_loop = False
        if not on_loop:  # paho's callback on another thread: futures are the loop's
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._kv_loop.call_soon_threadsafe(self._fail_on_alert)
            return
        alert = getattr(self._kv_tls_context, "kvfence_alert", None)
        connected = getattr(self, "_connected", None)
        if not alert or not isinstance(connected, asyncio.Future) or connected.done():
            return
        with self._kv_guard:
            if self._kv_abandoned:  # given up already: nobody would retrieve the exception
                return
        connected.set_exception(MqttTlsAlert(alert))

    @property
    def _speaks_v5(self) -> bool:
        return self._kv_protocol == aiomqtt.ProtocolVersion.V5

    @property
    def puback_codes(self) -> bool:
        """Whether ``publish`` sees the PUBACK's reason code (a refusal raises PublishRefused);
        False: aiomqtt's own publish, where a refused message counts as delivered."""
        paho = getattr(self, "_client", None)
        return self._kv_on_publish is not None and getattr(paho, "on_publish", None) is (
            self._kv_on_publish
        )

    async def publish(  # type: ignore[override]
        self,
        topic: str,
        payload: Any = None,
        qos: int = 0,
        retain: bool = False,
        properties: Any = None,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        """aiomqtt's publish, but a QoS 1 or 2 message the broker refuses (MQTT 5) raises
        PublishRefused instead of counting as delivered."""
        if qos == 0 or args or kwargs or not self.puback_codes:
            await super().publish(
                topic, payload, qos, retain, properties, *args, timeout=timeout, **kwargs
            )
            return
        info = self._client.publish(topic, payload, qos, retain, properties)
        if info.rc != paho_mqtt.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "Could not publish message")
        if info.is_published():  # acknowledged before we could wait (it cannot be, on this loop)
            return
        ack: asyncio.Future[Any] = self._kv_loop.create_future()
        self._kv_acks[info.mid] = ack
        limit = self.timeout if timeout is None else timeout
        try:
            reason_code = await asyncio.wait_for(ack, None if limit == math.inf else limit)
        except TimeoutError:
            raise aiomqtt.MqttError("Operation timed out") from None  # as aiomqtt says it
        finally:
            if self._kv_acks.get(info.mid) is ack:
                del self._kv_acks[info.mid]
        code = getattr(reason_code, "value", reason_code)
        if isinstance(code, int) and code >= PUBACK_REFUSED_FROM:
            raise PublishRefused(topic, code, _reason_name(reason_code))

    def _client_connect(self) -> None:
        # aiomqtt 2.5.1 runs this (paho's blocking connect) in an executor thread. The socket
        # callbacks it triggers are queued on the loop (call_soon_threadsafe) before it returns,
        # so a close queued after it returns runs after them.
        with self._kv_guard:
            if self._kv_abandoned:  # given up before the thread even started
                raise aiomqtt.MqttError("connection attempt abandoned")
            self._kv_connecting = True
        try:
            super_connect = getattr(super(), "_client_connect", None)
            if super_connect is not None:
                super_connect()
        finally:
            with self._kv_guard:
                self._kv_connecting = False
                late = self._kv_abandoned
            if late:  # given up while we connected: close what we just opened
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to undo
                    self._kv_loop.call_soon_threadsafe(self._close)

    async def __aenter__(self) -> _Client:
        with self._kv_guard:
            self._kv_abandoned = False
        self.broker_disconnect_reason = None
        if self._kv_tls_context is not None:
            self._kv_tls_context.kvfence_alert = None  # type: ignore[attr-defined]
        try:
            await super().__aenter__()
        except BaseException as err:
            with self._kv_guard:
                self._kv_abandoned = True
                connecting = self._kv_connecting
            if not connecting:  # else the connect thread closes it when it is done
                self._close()
            alert = getattr(self._kv_tls_context, "kvfence_alert", None)
            if isinstance(err, aiomqtt.MqttError) and alert:
                raise MqttTlsAlert(alert) from err
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            if self.leave_will and not self._speaks_v5:
                # MQTT 3.1.1 has no "disconnect with will": a connection that ends without a
                # DISCONNECT is one the broker publishes the will of. aiomqtt (2.5.1) skips its
                # own DISCONNECT once its private ``_disconnected`` future is done.
                self._close()
                disconnected = getattr(self, "_disconnected", None)
                if isinstance(disconnected, asyncio.Future) and not disconnected.done():
                    disconnected.set_result(None)
            await super().__aexit__(*exc_info)
        finally:
            self._close()

    def _close(self) -> None:
        """Unregister and close paho's socket, cancel aiomqtt's keep-alive task (idempotent; on
        the loop's thread, with the connect thread done)."""
        # paho's own close: aiomqtt's socket callbacks take the socket off the loop (reader and
        # writer) and cancel the keep-alive task, and paho forgets the socket, so that its
        # __del__ does not try again later, on a loop that may be gone by then.
        sock_close = getattr(getattr(self, "_client", None), "_sock_close", None)
        if sock_close is not None:
            sock_close()
        misc = getattr(self, "_misc_task", None)
        if isinstance(misc, asyncio.Task) and not misc.done():
            misc.cancel()


def _reason_name(reason_code: Any) -> str:
    try:
        return str(reason_code.getName())
    except Exception:
        return str(reason_code)


def _protocol_name(protocol: aiomqtt.ProtocolVersion) -> str:
    return "5" if protocol == aiomqtt.ProtocolVersion.V5 else "3.1.1"


def _username(credentials: MqttCredentials | None) -> str | None:
    return None if credentials is None else credentials.username


def _password(credentials: MqttCredentials | None) -> str | None:
    return None if credentials is None else credentials.password


def event_topic(cluster: str, kind: str) -> str:
    return f"{TOPIC_ROOT}/{cluster}/events/{kind}"


def node_topic(cluster: str, node_id: str) -> str:
    return f"{TOPIC_ROOT}/{cluster}/nodes/{node_id}"


class EventLimiter:
    """At most ``burst`` events per ``interval_s`` for each key; the rest are counted, not sent.

    For events that whoever reaches a port can cause at will (decode's UCX hellos: a forged hello
    is an integrity violation): without a bound, a flood of them is a flood of log lines and MQTT
    messages, and fills the event buffer, which evicts other events to keep the security ones. A
    key's window opens with its first event; ``flush`` returns, once a window has closed, how many
    of that key's events it held back, which the caller reports as one summary event (``Metrics``
    still count every one).
    """

    def __init__(
        self, burst: int, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if burst < 1 or interval_s <= 0:
            raise ValueError("burst must be >= 1 and interval_s > 0")
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        # key -> [window start, events let through in it, events held back in it]
        self._windows: dict[Hashable, list[float]] = {}
        # held-back counts of windows that closed before flush() took them
        self._pending: list[tuple[Hashable, int]] = []

    def allow(self, key: Hashable) -> bool:
        """Whether this event of ``key`` may be sent (else it is counted as held back)."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.interval_s:
            if window is not None and window[2]:
                self._pending.append((key, int(window[2])))
            self._windows[key] = [now, 1, 0]
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        return False

    def flush(self, force: bool = False) -> list[tuple[Hashable, int]]:
        """(key, held back) for every window that has closed (all of them with ``force``) and
        held some back; those windows are forgotten."""
        now = self._clock()
        out, self._pending = self._pending, []
        for key, window in list(self._windows.items()):
            if force or now - window[0] >= self.interval_s:
                if window[2]:
                    out.append((key, int(window[2])))
                del self._windows[key]
        return out


class _Buffer:
    """Events not yet acknowledged by the broker, in seq order, bounded to ``capacity``.

    Not thread-safe on its own; ``EventBus`` guards it with a lock.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.events: dict[int, dict[str, Any]] = {}  # seq -> event; insertion order == seq order
        self._plain: collections.deque[int] = collections.deque()  # non-security seqs, may be stale
        # seq -> failed connections the event was in flight on (only events that had one)
        self.failures: dict[int, int] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.events)

    def add(self, event: dict[str, Any]) -> int:
        """Store ``event``; returns how many events were dropped to make room (0 or 1)."""
        security = event["kind"] in SECURITY_KINDS
        if len(self.events) >= self.capacity:
            victim = self._oldest_plain()
            if victim is None and not security:
                self.dropped += 1  # the buffer holds only security events: drop the newcomer
                return 1
            if victim is None:
                victim = next(iter(self.events))
            del self.events[victim]
            self.failures.pop(victim, None)
            self.dropped += 1
            dropped = 1
        else:
            dropped = 0
        self.events[event["seq"]] = event
        if not security:
            self._plain.append(event["seq"])
        return dropped

    def ack(self, seq: int) -> bool:
        """Forget ``seq`` (acknowledged); False when it was not buffered (any more)."""
        found = self.events.pop(seq, None) is not None
        self.failures.pop(seq, None)
        # Drop index entries of events no longer buffered from the front (acks come in about
        # seq order), or the index would grow by one per event for the life of the process.
        while self._plain and self._plain[0] not in self.events:
            self._plain.popleft()
        # An event that stays at the front (held: its topic refused by the broker's ACL) stops
        # that trim; then rebuild the index once it is mostly stale (amortized O(1) per ack).
        if len(self._plain) > 2 * len(self.events) + 16:
            self._plain = collections.deque(s for s in self._plain if s in self.events)
        return found

    def discard(self, seq: int) -> bool:
        """Drop ``seq`` undelivered and count it; False when it was not buffered (any more)."""
        if not self.ack(seq):
            return False
        self.dropped += 1
        return True

    def next_from(self, seq: int, end: int) -> dict[str, Any] | None:
        """The first buffered event with ``seq <= event.seq < end``."""
        for s in range(seq, end):
            event = self.events.get(s)
            if event is not None:
                return event
        return None

    def first_seq(self) -> int | None:
        return next(iter(self.events), None)

    def _oldest_plain(self) -> int | None:
        while self._plain:
            seq = self._plain.popleft()
            if seq in self.events:
                return seq
        return None


class EventBus:
    """Emits cluster events to MQTT (or only to the log when ``mqtt_host`` is None).

    ``emit`` may be called from any thread, before ``start`` and after ``stop``; events emitted
    while the bus is not running wait in the buffer (bounded) until it runs.
    """

    def __init__(
        self,
        cluster: str,
        node_id: str,
        mqtt_host: str | None,
        mqtt_port: int = 1883,
        buffer_size: int = 10_000,
        *,
        metrics: Metrics | None = None,
        credentials: MqttCredentials | None = None,
        tls: MqttTls | None = None,
        keepalive_s: int = KEEPALIVE_S,
    ):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if keepalive_s < 1:
            raise ValueError(f"keepalive_s must be >= 1, got {keepalive_s}")
        for what, name in (("cluster", cluster), ("node_id", node_id)):
            # a topic level: "/" would split it, and a broker refuses "+" / "#" in a published
            # topic (it drops the message or the connection), so nothing would ever be delivered
            if not name or any(c in name for c in TOPIC_RESERVED):
                raise ValueError(f"{what} {name!r} cannot be an MQTT topic level")
        if mqtt_host is not None and not mqtt_host.strip():
            raise ValueError("mqtt_host is empty: give a broker host, or None for log-only events")
        self.cluster = cluster
        self.node_id = node_id
        self.mqtt_host = mqtt_host
        self.mqtt_port = mqtt_port
        self.credentials = credentials
        self.tls = tls
        self.keepalive_s = keepalive_s
        self.metrics = metrics
        # The last RECENT_SIZE events emitted, for in-process checks ("was an event emitted?").
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_SIZE)
        self.connected = False
        # Why the last connection attempt failed or the connection ended; None while connected.
        self.last_error: str | None = None
        # (what, reason, monotonic time) of the last connect failure logged as an error
        self._refusal_logged: tuple[str, str, float] | None = None
        self._buffer = _Buffer(buffer_size)
        self._lock = threading.Lock()
        self._seq = 0
        self._status: dict[str, Any] | None = None
        self._status_dirty = False  # set: the status must be (re)published
        self._status_version = 0  # bumped on every change of _status
        # The newest version done with: acknowledged, or given up (drained either way).
        self._status_acked = 0
        self._status_delivered = 0  # the newest version the broker really acknowledged
        # failed connections the current status version was in flight on
        self._status_failures = 0
        self._status_given_up = 0  # a version dropped after MAX_SEND_ATTEMPTS: not re-sent
        # On the current connection: event seqs and status versions published and not yet
        # acknowledged, and whether the broker acknowledged anything new (see _run's backoff).
        self._in_flight: set[int] = set()
        self._status_in_flight: set[int] = set()
        self._progressed = False
        # MQTT 5 until the broker says it speaks only 3.1.1 (then for the life of the bus)
        self._protocol = aiomqtt.ProtocolVersion.V5
        self._puback_warned = False  # warned that refusals cannot be seen (3.1.1, or aiomqtt)
        # Topics the broker refused a message to -> when the next try may go out (monotonic;
        # math.inf while one is in flight). These four: under the lock, on the loop's thread.
        self._refused: dict[str, float] = {}
        # topic -> seqs of the events held for it, in the order they are tried (some may be gone
        # since: acknowledged or dropped); a try the broker refuses goes to the back
        self._held: dict[str, collections.deque[int]] = {}
        # seq -> times the broker refused the event while it took messages to the same topic:
        # then it rejects this message (not the topic), and MAX_SEND_ATTEMPTS drop it
        self._strikes: dict[int, int] = {}
        # seqs of held events whose topic was accepted again: sent before new events
        self._released: collections.deque[int] = collections.deque()
        self._refused_logged: dict[str, float] = {}  # topic -> monotonic time of its last error
        self._refused_total = metrics.events_refused_total if metrics is not None else None
        # The live connection's client (None between connections): stop() may leave it the will.
        self._client: _Client | None = None
        self._watch_warned = False  # warned that the broker refused the own-status subscription
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(
        cls, cfg: ClusterConfig, node_id: str, *, metrics: Metrics | None = None
    ) -> EventBus:
        """The bus ``cfg.events`` describes, with its broker account and TLS (ConfigError when
        the password file or a TLS file cannot be used: a deployment mistake, reported at start)."""
        events = cfg.events
        return cls(
            cfg.cluster,
            node_id,
            events.mqtt_host,
            events.mqtt_port,
            events.buffer_size,
            metrics=metrics,
            credentials=load_mqtt_credentials(events),
            tls=load_mqtt_tls(events),
        )

    # -- caller side -------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Events dropped undelivered: the buffer was full, the broker kept rejecting them
        (``MAX_SEND_ATTEMPTS``), or they could not be encoded."""
        return self._buffer.dropped

    @property
    def pending(self) -> int:
        """Events emitted but not yet acknowledged by the broker."""
        return len(self._buffer)

    def emit(self, kind: str, **payload: Any) -> int:
        """Record one event and return its sequence number (-1 if it could not be recorded).

        Never blocks and never raises: an event must not break the request that emits it.
        """
        try:
            event = self._record(kind, payload)
        except Exception:
            with contextlib.suppress(Exception):
                log.exception("event emit failed", kind=kind)
            return -1
        with contextlib.suppress(Exception):
            self._log(event)
        self._poke()
        return int(event["seq"])

    def _record(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            event: dict[str, Any] = {
                "seq": self._seq,
                "ts": time.time(),
                "kind": kind,
                "cluster": self.cluster,
                "node_id": self.node_id,
            }
            for key, value in payload.items():  # the header wins; a clashing field is renamed
                event[f"payload_{key}" if key in event else key] = value
            self.recent.append(event)
            if self.mqtt_host is not None:
                dropped = self._buffer.add(event)
                if dropped and self.metrics is not None:
                    self.metrics.events_dropped_total.inc(dropped)
        return event

    def publish_node_status(self, status: dict[str, Any]) -> None:
        """Set this node's retained status (latest wins); never blocks, never raises."""
        try:
            with self._lock:
                self._status = {
                    "cluster": self.cluster,
                    "node_id": self.node_id,
                    "ts": time.time(),
                    "online": True,
                    **status,
                }
                self._status_version += 1
                self._status_failures = 0  # a new status: its own attempts
                self._status_dirty = self.mqtt_host is not None
            log.debug("node status", **_log_fields(self._status))
            self._poke()
        except Exception:
            with contextlib.suppress(Exception):
                log.exception("node status publish failed")

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the publisher task (no-op without a broker); returns without waiting to connect."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        if self.mqtt_host is not None:
            self._task = asyncio.create_task(self._run(), name=f"kvfence-events-{self.node_id}")
        self._poke()

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Wait up to ``flush_timeout`` s for the buffer to drain, then disconnect."""
        task, self._task = self._task, None
        if task is None:
            return
        with self._lock:  # a graceful stop says so; the MQTT will covers the ungraceful one
            self._status = {**json.loads(self._offline_payload()), "ts": time.time()}
            self._status_version += 1
            self._status_failures = 0
            self._status_dirty = True
            offline_version = self._status_version
        self._poke()
        await self.wait_drained(flush_timeout)
        with self._lock:
            offline_delivered = self._status_delivered >= offline_version
        client = self._client
        if not offline_delivered and client is not None:
            # The broker has not confirmed the offline status (a slow broker, a backlog): the
            # normal DISCONNECT that cancelling sends would make it discard the will, and the
            # retained status would say online for good. Leave the will to it instead.
            client.leave_will = True
            log.info(
                "event bus stops before the broker acknowledged the offline status: it "
                "publishes the will",
                pending=self.pending,
            )
        task.cancel()
        # Bounded: a broker that hangs can hold aiomqtt's disconnect for its whole timeout.
        # (asyncio.wait, not a suppressed await: a cancel aimed at stop() itself must stand.)
        await asyncio.wait({task}, timeout=PUBLISH_TIMEOUT_S + 1)
        if not task.done():
            log.warning("event bus publisher still disconnecting at stop")
        elif not task.cancelled() and task.exception() is not None:
            log.warning("event bus publisher ended with an error", error=str(task.exception()))
        if self.pending:
            log.warning("events not delivered at stop", pending=self.pending)

    async def wait_drained(self, timeout: float) -> bool:
        """True once every event and the node status are acknowledged within ``timeout`` s."""
        if self._idle is None:  # not started: nothing will drain
            return self._is_drained()
        try:
            # asyncio.timeout: wait_for (3.11) swallows a cancel of stop() that lands in the
            # turn the buffer drains, and a cancel aimed at stop() must stand.
            async with asyncio.timeout(timeout):
                await self._wait_drained()
            return True
        except TimeoutError:
            return False

    async def _wait_drained(self) -> None:
        assert self._idle is not None
        while not self._is_drained():
            self._idle.clear()
            if self._is_drained():
                return
            await self._idle.wait()

    def _is_drained(self) -> bool:
        with self._lock:
            if self.mqtt_host is None:
                return True
            status_done = not self._status_dirty and self._status_acked == self._status_version
            return not self._buffer.events and status_done

    # -- publisher ---------------------------------------------------------------------------------

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            if running is loop:
                wake.set()
            else:
                loop.call_soon_threadsafe(wake.set)

    async def _run(self) -> None:
        assert self.mqtt_host is not None
        backoff = BACKOFF_MIN_S
        while True:
            entered = False  # past the CONNACK: a failure now is a lost connection
            retry_now = False  # the broker asked for another MQTT version: no backoff
            try:
                # the TLS files as they are now: a renewed certificate counts from this reconnect
                tls_context = None if self.tls is None else self.tls.context()
                client = _Client(
                    self.mqtt_host,
                    self.mqtt_port,
                    identifier=f"kvfence-{self.node_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                    timeout=PUBLISH_TIMEOUT_S,
                    keepalive=self.keepalive_s,
                    will=aiomqtt.Will(
                        node_topic(self.cluster, self.node_id),
                        self._offline_payload(),
                        qos=1,
                        retain=True,
                    ),
                    max_inflight_messages=MAX_IN_FLIGHT,
                    username=_username(self.credentials),
                    password=_password(self.credentials),
                    tls_context=tls_context,
                    protocol=self._protocol,
                )
                async with client:
                    entered = True
                    connected_at = time.monotonic()
                    self._client = client
                    with self._lock:
                        self._in_flight.clear()
                        self._status_in_flight.clear()
                        self._progressed = False
                        # a refused topic is tried again at once (the ACL may have changed); what
                        # was held for it is found again as the whole buffer is re-sent
                        self._refused = dict.fromkeys(self._refused, connected_at)
                        self._held.clear()
                        self._released.clear()
                    self.connected = True
                    self.last_error = None
                    self._refusal_logged = None
                    log.info(
                        "event bus connected",
                        host=self.mqtt_host,
                        port=self.mqtt_port,
                        username=_username(self.credentials),
                        tls=self.tls is not None,
                        mqtt=_protocol_name(self._protocol),
                    )
                    self._warn_if_blind(client)
                    try:
                        await self._serve_connection(client)
                    finally:
                        # Start the backoff over only after progress: a broker that drops every
                        # connection at once (on one message) must not be retried 20 times a s.
                        up_s = time.monotonic() - connected_at
                        if self._progressed or up_s >= BACKOFF_RESET_AFTER_S:
                            backoff = BACKOFF_MIN_S
                            # A status given up on is tried again once the broker works: it
                            # may have failed only because of what was sent alongside it.
                            with self._lock:
                                self._status_given_up = 0
                                self._status_failures = 0
            except TlsError as err:  # a TLS file went missing or bad since the start
                self.last_error = str(err)
                self._log_refusal("tls_files", err, backoff)
            except aiomqtt.MqttError as err:
                self.last_error = str(err)
                failure = None if entered else self._connect_failure(err)
                if (
                    failure is None
                    and not entered
                    and self._protocol != aiomqtt.ProtocolVersion.V311
                    and is_unsupported_protocol(err)
                ):
                    self._protocol = aiomqtt.ProtocolVersion.V311
                    log.warning(
                        "event bus broker does not speak MQTT 5: using MQTT 3.1.1",
                        host=self.mqtt_host,
                        port=self.mqtt_port,
                        error=str(err),
                        consequence="a message the broker refuses (its ACL) is acknowledged as "
                        "if delivered and lost unseen",
                    )
                    self._puback_warned = True
                    retry_now = True
                elif failure is not None:
                    self._log_refusal(failure, err, backoff)
                else:
                    log.warning(
                        "event bus disconnected",
                        host=self.mqtt_host,
                        port=self.mqtt_port,
                        error=str(err),
                        retry_in_s=backoff,
                        pending=self.pending,
                    )
            except Exception as err:  # a bug must not silence the bus for good: log, reconnect
                self.last_error = repr(err)
                log.exception("event bus publisher failed", retry_in_s=backoff)
            finally:
                self.connected = False
                self._client = None
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # stop() cancelled us, and aiomqtt's disconnect turned the cancellation into an
                # MqttError on the way out: do not reconnect.
                raise asyncio.CancelledError
            if retry_now:
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _serve_connection(self, client: aiomqtt.Client) -> None:
        """Publish until the connection breaks (raises MqttError) or the task is cancelled.

        Plain tasks and ``asyncio.wait`` rather than a TaskGroup: on Python 3.11 a TaskGroup can
        leave its parent's cancel count raised, and stop() must always be able to cancel us.
        """
        with self._lock:  # the broker may have lost it (unless we gave up on this version)
            self._status_dirty = (
                self._status is not None and self._status_given_up != self._status_version
            )
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        publishers: set[asyncio.Task[None]] = set()
        watch = asyncio.create_task(self._watch(client))
        subscribe = asyncio.create_task(self._watch_own_status(client))
        send: asyncio.Task[None] | None = None
        try:
            # Nothing is published before the broker answered the SUBSCRIBE (or a timeout):
            # Mosquitto closes the connection of a packet too large with the rest of it unread,
            # which resets it, and what it had not sent yet is lost, the DISCONNECT that says why
            # (see _blame_in_flight) included. (Seen with its SUBACK and a retained message.)
            await asyncio.wait(
                {watch, subscribe}, timeout=PUBLISH_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
            send = asyncio.create_task(self._send_loop(client, publishers, failed))
            done, _ = await asyncio.wait({watch, send, failed}, return_when="FIRST_COMPLETED")
            for fut in done:
                fut.result()  # raises the MqttError that ended the connection
        except Exception as err:
            # not on a cancel (stop()): that is no failed attempt
            self._blame_in_flight(err, getattr(client, "broker_disconnect_reason", None))
            raise
        finally:
            tasks = [subscribe, watch, *([] if send is None else [send]), *publishers]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if failed.done() and not failed.cancelled():
                failed.exception()  # retrieved: no "never retrieved" warning
            failed.cancel()

    async def _send_loop(
        self,
        client: aiomqtt.Client,
        publishers: set[asyncio.Task[None]],
        failed: asyncio.Future[None],
    ) -> None:
        assert self._wake is not None and self._idle is not None
        # The broker's Receive Maximum (MQTT 5) bounds what may be unacknowledged at once.
        receive_maximum = getattr(client, "receive_maximum", None)
        window = _Window(min(MAX_IN_FLIGHT, receive_maximum or MAX_IN_FLIGHT))

        def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
            task = asyncio.create_task(coro)
            publishers.add(task)
            task.add_done_callback(lambda t: _on_publish_done(t, publishers, failed))
            return task

        async def send(
            publish: Callable[[], Coroutine[Any, Any, None]], alone: bool, status: bool
        ) -> None:
            """Publish in a slot of the window (one the caller saw free, unless ``alone``).
            ``alone`` (it was in flight on a connection that failed): once nothing else is in
            flight, and nothing else goes out before its acknowledgement, so that a failure
            now is blamed on it only, not on the events sent with it."""
            if alone:
                while publishers:
                    await asyncio.wait(set(publishers))
            window.take(status)
            task = spawn(publish())
            if alone:
                await asyncio.wait({task})
                if failed.done():
                    await failed  # raises what ended the connection

        async def send_status() -> None:
            with self._lock:
                status = self._status if self._status_dirty else None
                version = self._status_version
                alone = self._status_failures > 0
                if status is not None and not alone and not window.status_free():
                    # the previous version is still unacknowledged: this one goes out when that
                    # is answered (its end wakes the loop), and events flow meanwhile
                    status = None
                elif status is not None and not self._may_send(self._status_topic):
                    status = None  # refused by the broker: held (still dirty) until its next try
                elif status is not None:
                    self._status_dirty = False
            if status is not None:
                await send(
                    lambda: self._publish_status(client, status, version, window), alone, True
                )

        cursor = self._buffer.first_seq() or self._seq + 1  # everything unacked is re-sent
        while True:
            self._wake.clear()
            while True:
                # The status goes first, and before the rest of a backlog: stop()'s offline status
                # must not wait behind thousands of events and then be cut off by the flush timeout.
                await send_status()
                if not window.event_free(self._status is not None):
                    # No event slot free: wait for one (a publish that ends wakes the loop) here,
                    # not in send(), so that a new status (stop()'s) still goes out at once.
                    break
                with self._lock:
                    event = self._next_held()  # accepted again, or a refused topic's next try
                    if event is None:
                        first = self._buffer.first_seq()
                        cursor = max(cursor, first) if first is not None else self._seq + 1
                        event = self._buffer.next_from(cursor, self._seq + 1)
                        if event is not None:
                            cursor = event["seq"] + 1
                            topic = self._topic_of(event)
                            if topic is not None and not self._may_send(topic):
                                # its topic is refused: held, with what else was held for it
                                self._hold(topic, event["seq"])
                                continue
                    alone = event is not None and event["seq"] in self._buffer.failures
                if event is None:
                    break
                await send(partial(self._publish_event, client, event, window), alone, False)
            if self._is_drained():
                self._idle.set()
            retry_in = self._next_try_in()
            if retry_in is None:
                await self._wake.wait()
            else:  # a refused topic's next try is due then (or something new comes first)
                # asyncio.timeout: wait_for (3.11) swallows the cancel that ends this loop when
                # it lands in the turn something wakes it, and the loop then runs on.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(retry_in):
                        await self._wake.wait()

    async def _watch(self, client: aiomqtt.Client) -> None:
        """Read the connection's messages until it drops (the iterator raises MqttError: the
        public way to learn of a disconnect while no publish is outstanding): those of this
        node's own status topic (``_watch_own_status``), see ``_status_seen``."""
        async for message in client.messages:
            self._status_seen(message)

    async def _watch_own_status(self, client: aiomqtt.Client) -> None:
        """Subscribe to this node's status topic. Without an answer in time it keeps waiting (a
        slow broker is no reason to end the connection); a refusal (the account may not read it)
        is a warning, once: the node then cannot notice a stale will.

        QoS 0, and over MQTT 5 neither its own messages (No Local) nor the retained one (Retain
        Handling 2): the broker then has nothing to send after its SUBACK, which _serve_connection
        waits for before it publishes anything (see there). A will that was retained before the
        SUBACK is overwritten by the status this connection publishes first anyway; one published
        after it arrives live. (QoS 1 would add a PUBACK of ours that can reach the broker after
        it closed the connection.)"""
        topic = self._status_topic
        try:
            if self._protocol == aiomqtt.ProtocolVersion.V5:
                options = SubscribeOptions(
                    qos=0, noLocal=True, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND
                )
                granted = await client.subscribe(topic, options=options, timeout=math.inf)
            else:
                granted = await client.subscribe(topic, qos=0, timeout=math.inf)
        except aiomqtt.MqttError:
            return  # the connection broke: the message iterator says so
        codes = [getattr(code, "value", code) for code in (granted or ())]
        refused = any(isinstance(code, int) and code >= PUBACK_REFUSED_FROM for code in codes)
        if refused and not self._watch_warned:
            self._watch_warned = True
            log.warning(
                "event bus cannot read its own node status",
                topic=topic,
                username=_username(self.credentials),
                consequence="the will of a connection the broker ends late (a half-open "
                "path) can show this node offline until its next status",
                hint=f"let the account read {TOPIC_ROOT}/{self.cluster}/nodes/<node_id>",
            )

    def _status_seen(self, message: aiomqtt.Message) -> None:
        """A message on this node's status topic: an "online": false while this bus runs with
        an online status (not stopping, which sets its own offline status) is not this
        connection's, and overwrote the retained status: the will of an older connection that
        the broker ended late (after the bus had reconnected: a half-open path), or a stopping
        process with the same node id. The current status is published again."""
        if str(message.topic) != self._status_topic or message.retain:
            # Retained: the broker's stored status, sent on subscribe (MQTT 3.1.1 has no way to
            # ask it not to): old news, which this connection's own status replaces anyway. A
            # will the broker publishes now reaches a subscriber with the retain flag clear.
            return
        raw = message.payload
        try:
            seen = json.loads(raw if isinstance(raw, bytes | bytearray | str) else str(raw))
        except (ValueError, RecursionError):
            return
        if not isinstance(seen, dict) or seen.get("online") is not False:
            return
        with self._lock:
            status = self._status
            if (
                self._task is None  # stopping
                or status is None
                or status.get("online") is not True
                or self._status_given_up == self._status_version
            ):
                return
            self._status_dirty = True
        log.warning(
            "node status overwritten as offline: publishing it again",
            topic=self._status_topic,
            will="ts" not in seen,
        )
        self._poke()

    # -- messages the broker refused (MQTT 5 PUBACK >= 0x80) ----------------------------------

    @property
    def _status_topic(self) -> str:
        return node_topic(self.cluster, self.node_id)

    def _topic_of(self, event: dict[str, Any]) -> str | None:
        kind = event.get("kind")
        if not isinstance(kind, str) or any(c in kind for c in TOPIC_RESERVED):
            return None  # _publish_event drops it
        return event_topic(self.cluster, kind)

    def _may_send(self, topic: str) -> bool:
        """Whether a message to ``topic`` may go out now: the broker has not refused the topic,
        or its next try is due (then this message is that try). Under the lock."""
        at = self._refused.get(topic)
        if at is None:
            return True
        if at > time.monotonic():
            return False
        self._refused[topic] = math.inf  # this try is in flight: no other until it is answered
        return True

    def _next_held(self) -> dict[str, Any] | None:
        """The next held event to send (under the lock): one whose topic the broker accepts
        again, else the next in turn held for a refused topic whose next try is due."""
        while self._released:
            seq = self._released.popleft()
            event = self._buffer.events.get(seq)
            if event is not None and seq not in self._in_flight:
                return event
        now = time.monotonic()
        for topic, at in self._refused.items():
            held = self._held.get(topic)
            while held and held[0] not in self._buffer.events:  # acknowledged or dropped since
                held.popleft()
            if at <= now and held:
                self._refused[topic] = math.inf
                return self._buffer.events[held.popleft()]
        return None

    def _hold(self, topic: str, seq: int) -> None:
        """Hold event ``seq`` until ``topic`` is tried again (under the lock)."""
        held = self._held.setdefault(topic, collections.deque())
        held.append(seq)
        if len(held) > 2 * self._buffer.capacity:  # mostly gone (dropped from a full buffer)
            self._held[topic] = collections.deque(s for s in held if s in self._buffer.events)

    def _next_try_in(self) -> float | None:
        """Seconds until the next try of a refused topic with something held for it; None when
        there is none."""
        with self._lock:
            waiting = [
                at
                for topic, at in self._refused.items()
                if at != math.inf
                and (self._held.get(topic) or (topic == self._status_topic and self._status_dirty))
            ]
        return None if not waiting else max(0.0, min(waiting) - time.monotonic())

    def _refused_message(
        self, topic: str, seq: int | None, err: PublishRefused, **fields: Any
    ) -> None:
        """The broker refused the message to ``topic`` (the event ``seq``, or the node status
        when None): it stays buffered, held with the rest for the topic until the topic's next
        try; counted, and logged as an error once per topic and then at most every
        REFUSAL_LOG_INTERVAL_S. An event refused MAX_SEND_ATTEMPTS times while the broker took
        other messages to its topic is one the broker rejects for itself (its size, say), not
        for its topic: it is dropped (a security event cut to its header first), as one that
        keeps breaking the connection is."""
        now = time.monotonic()
        cut: dict[str, Any] | None = None
        given_up: dict[str, Any] | None = None
        with self._lock:
            at = self._refused.get(topic)
            if at is None or at == math.inf:  # the first refusal, or the answer to a try
                self._refused[topic] = now + REFUSED_RETRY_S
            event = None if seq is None else self._buffer.events.get(seq)
            if seq is not None and event is not None:
                # a strike when the topic was not refused: the broker took the messages before
                strikes = self._strikes.pop(seq, 0) + (at is None)
                if strikes < MAX_SEND_ATTEMPTS:
                    if strikes:
                        self._strikes[seq] = strikes
                    self._hold(topic, seq)
                elif event["kind"] in SECURITY_KINDS and not event.get("truncated"):
                    self._buffer.events[seq] = cut = _truncated(event)
                    self._hold(topic, seq)
                else:
                    given_up = event
                if len(self._strikes) > self._buffer.capacity:  # some dropped from a full buffer
                    events = self._buffer.events
                    self._strikes = {s: n for s, n in self._strikes.items() if s in events}
        self._poke()  # the send loop's wait now ends at this topic's next try
        if self._refused_total is not None:
            self._refused_total.inc()
        last = self._refused_logged.get(topic)
        fields = {
            "topic": topic,
            **({} if seq is None else {"seq": seq}),
            "reason": err.reason,
            "reason_code": f"0x{err.reason_code:02x}",
            "username": _username(self.credentials),
            "retry_in_s": REFUSED_RETRY_S,
            "pending": self.pending,
            **fields,
        }
        if last is None or now - last >= REFUSAL_LOG_INTERVAL_S:
            self._refused_logged[topic] = now
            log.error(
                "event bus message refused by the broker",
                hint=f"the broker's ACL must let this account publish to {TOPIC_ROOT}/"
                f"{self.cluster}/# (events/<kind> and nodes/<node_id>); the messages stay "
                "buffered and are retried",
                **fields,
            )
        else:
            log.debug("event bus message refused by the broker", **fields)
        why = (
            f"the broker refused it each of the {MAX_SEND_ATTEMPTS} times it was sent while it "
            f"took other messages to {topic}: it rejects this message"
        )
        if cut is not None:
            log.error(
                "event truncated undelivered",
                kind=str(cut.get("kind")),
                seq=cut["seq"],
                reason=why,
                error=str(err),
            )
        if given_up is not None:
            self._drop(given_up, why, error=str(err))

    def _accepted(self, topic: str) -> None:
        """The broker took a message to ``topic``: if it had refused the topic, what was held
        for it goes out now."""
        with self._lock:
            if self._refused.pop(topic, None) is None:
                return
            held = sorted(self._held.pop(topic, ()))
            self._released.extend(held)
            self._refused_logged.pop(topic, None)
        log.info("event bus message accepted by the broker again", topic=topic, held=len(held))
        self._poke()

    def _warn_if_blind(self, client: aiomqtt.Client) -> None:
        """Warn once when this connection cannot see a refused message (aiomqtt changed)."""
        if self._puback_warned or getattr(client, "puback_codes", False):
            return
        self._puback_warned = True
        log.warning(
            "event bus cannot read the broker's PUBACK reason codes",
            aiomqtt=getattr(aiomqtt, "__version__", "?"),
            consequence="a message the broker refuses (its ACL) is acknowledged as if delivered "
            "and lost unseen",
        )

    async def _publish_event(
        self, client: aiomqtt.Client, event: dict[str, Any], window: _Window
    ) -> None:
        seq = event["seq"]
        try:
            try:
                topic, payload = self._event_message(event)
            except Exception as err:  # it never will be: drop it now, not on every reconnect
                self._drop(event, "it cannot be encoded", error=type(err).__name__)
                return
            with self._lock:
                self._in_flight.add(seq)
            try:
                await client.publish(topic, payload, qos=1)
            except PublishRefused as err:
                refused: PublishRefused | None = err
            else:
                refused = None
        finally:
            window.release(status=False)
            self._poke()  # the send loop may wait for this slot
        with self._lock:
            self._in_flight.discard(seq)
            if refused is None:
                self._strikes.pop(seq, None)
                if self._buffer.ack(seq):
                    self._progressed = True
        if refused is not None:
            self._refused_message(topic, seq, refused, kind=str(event.get("kind")))
            return
        self._accepted(topic)
        self._mark_progress()

    def _event_message(self, event: dict[str, Any]) -> tuple[str, bytes]:
        kind = event["kind"]
        if not isinstance(kind, str) or any(c in kind for c in TOPIC_RESERVED):
            raise ValueError("the kind cannot be an MQTT topic level")  # paho would refuse it
        return event_topic(self.cluster, kind), _encode(event)

    def _drop(self, event: dict[str, Any], why: str, **fields: Any) -> None:
        """Drop ``event`` undelivered (if still buffered): counted, and one error naming its
        kind and seq (none of its payload)."""
        with self._lock:
            dropped = self._buffer.discard(event["seq"])
            self._in_flight.discard(event["seq"])
        if not dropped:
            return
        if self.metrics is not None:
            self.metrics.events_dropped_total.inc()
        log.error(
            "event dropped undelivered",
            kind=str(event.get("kind")),
            seq=event["seq"],
            reason=why,
            pending=self.pending,
            **fields,
        )
        self._mark_progress()

    def _blame_in_flight(self, err: Exception, broker_reason: int | None = None) -> None:
        """The connection failed (``broker_reason``: the reason code of the DISCONNECT the
        broker sent, MQTT 5): count it against every event and status it had in flight, which
        are re-sent alone on the next connection (see _send_loop). One that reached
        MAX_SEND_ATTEMPTS is dropped (a security event cut to its header first) when this
        failure says the broker rejects a packet it was sent.

        Over MQTT 5 the broker says so (``REJECTED_PACKET_REASONS``: 0x95 Packet too large...);
        a connection that ended otherwise (a reset, a broker restart, a keepalive timeout) is an
        outage, and dropping on it dropped innocent events (security ones cut to their header)
        after three. It still counts, and so isolates what was in flight: Mosquitto loses its
        DISCONNECT at times when packets we sent after the one too large reach it after it
        closed the connection (it resets it), and the message it rejected, re-sent alone, gets
        the DISCONNECT that says so, which then drops it on its MAX_SEND_ATTEMPTS-th failed
        connection. (Alone, only it was in flight when the broker said so.) Over MQTT 3.1.1 a
        broker cannot say why it closed a connection, so any close that was not a timeout
        counts in full there. A timeout (no answer in time: a slow or stalled broker, a lossy
        path) counts against nothing."""
        doomed: list[dict[str, Any]] = []
        cut: list[dict[str, Any]] = []
        status_given_up = None
        v5 = self._protocol == aiomqtt.ProtocolVersion.V5
        rejected = not v5 or broker_reason in REJECTED_PACKET_REASONS
        with self._lock:
            if _timed_out(err):
                self._in_flight.clear()
                self._status_in_flight.clear()
                return
            for seq in sorted(self._in_flight):
                event = self._buffer.events.get(seq)
                if event is None:
                    continue
                failures = self._buffer.failures.get(seq, 0) + 1
                self._buffer.failures[seq] = failures
                if failures < MAX_SEND_ATTEMPTS or not rejected:
                    continue
                if event["kind"] in SECURITY_KINDS and not event.get("truncated"):
                    # The audit trail keeps a record of it: its header, marked truncated, with
                    # attempts of its own; only that failing too drops it.
                    stub = _truncated(event)
                    self._buffer.events[seq] = stub
                    self._buffer.failures[seq] = 0
                    cut.append(stub)
                else:
                    doomed.append(event)
            self._in_flight.clear()
            if (
                self._status_version in self._status_in_flight
                # one the broker acknowledged, re-sent, is not to blame (a given-up one, tried
                # again after progress, is)
                and self._status_version > self._status_delivered
            ):
                self._status_failures += 1
                if self._status_failures >= MAX_SEND_ATTEMPTS and rejected:
                    status_given_up = self._status_version
                    self._status_given_up = status_given_up
                    self._status_acked = max(self._status_acked, status_given_up)
                    self._status_dirty = False
            self._status_in_flight.clear()
        if not cut and not doomed and status_given_up is None:
            return
        if v5:
            assert broker_reason is not None  # else nothing was rejected
            code = ReasonCode(PacketTypes.DISCONNECT, identifier=broker_reason)
            why = (
                f"the connection failed each of the {MAX_SEND_ATTEMPTS} times it was sent, the "
                f"last time closed by the broker saying {_reason_name(code)} "
                f"(0x{broker_reason:02x}): it rejects it"
            )
        else:
            why = (
                f"the connection failed each of the {MAX_SEND_ATTEMPTS} times it was sent "
                "(MQTT 3.1.1: the broker cannot say why; one that rejects a packet over its "
                "max_packet_size closes the connection, but so does a broker restart)"
            )
        # an MqttError says nothing of the payload; another exception's message might
        error = str(err) if isinstance(err, aiomqtt.MqttError) else type(err).__name__
        for event in cut:
            log.error(
                "event truncated undelivered",
                kind=str(event.get("kind")),
                seq=event["seq"],
                reason=why,
                error=error,
            )
        for event in doomed:
            self._drop(event, why, error=error)
        if status_given_up is not None:
            log.error(
                "node status not delivered",
                version=status_given_up,
                reason=why,
                error=error,
            )
            self._mark_progress()

    async def _publish_status(
        self,
        client: aiomqtt.Client,
        status: dict[str, Any],
        version: int,
        window: _Window,
    ) -> None:
        try:
            try:
                payload = _encode(status)
            except Exception as err:  # it never will be: give this version up now
                with self._lock:
                    self._status_given_up = max(self._status_given_up, version)
                    self._status_acked = max(self._status_acked, version)
                log.error(
                    "node status not delivered",
                    version=version,
                    reason="it cannot be encoded",
                    error=type(err).__name__,
                )
                self._mark_progress()
                return
            with self._lock:
                self._status_in_flight.add(version)
            await client.publish(self._status_topic, payload, qos=1, retain=True)
        except PublishRefused as err:
            with self._lock:
                self._status_in_flight.discard(version)
                self._status_dirty = self._status_given_up != self._status_version
            self._refused_message(self._status_topic, None, err, version=version)
            return
        except BaseException:
            with self._lock:
                self._status_dirty = self._status_given_up != self._status_version
            raise
        finally:
            window.release(status=True)
            self._poke()  # a newer status may wait for this slot
        self._accepted(self._status_topic)
        with self._lock:
            self._status_in_flight.discard(version)
            if version > self._status_delivered:
                self._progressed = True
            self._status_acked = max(self._status_acked, version)
            self._status_delivered = max(self._status_delivered, version)
            if version == self._status_version:
                self._status_failures = 0
        self._mark_progress()

    def _mark_progress(self) -> None:
        assert self._idle is not None and self._wake is not None
        if self._is_drained():
            self._idle.set()

    def _connect_failure(self, err: aiomqtt.MqttError) -> str | None:
        """What a failed connection attempt says about our settings: "auth" (the broker refused
        the account), "tls" (the TLS handshake failed, or the broker ended the TLS connection
        with an alert), "no_answer" (the broker never answered: what a TLS listener does with a
        plain client, and what one that requires client certificates may do with a TLS client
        that has none); None for anything else."""
        if is_auth_refusal(err):
            return "auth"
        if self.tls is not None and is_tls_failure(err):
            return "tls"
        if (self.tls is None or self.tls.cert_file is None) and is_no_answer(err):
            return "no_answer"
        return None

    def _log_refusal(self, what: str, err: Exception, backoff: float) -> None:
        """A connection attempt failed for our settings (``what``: see ``_connect_failure``; or
        "tls_files", a TLS file unusable at a reconnect): an error with a hint, once per reason
        and then at most every REFUSAL_LOG_INTERVAL_S; the events stay buffered meanwhile."""
        reason, now = str(err), time.monotonic()
        last = self._refusal_logged
        fields = {
            "host": self.mqtt_host,
            "port": self.mqtt_port,
            "username": _username(self.credentials),
            "error": reason,
            "retry_in_s": backoff,
            "pending": self.pending,
        }
        message = {
            "auth": "event bus refused by the broker",
            "tls": "event bus TLS handshake with the broker failed",
            "tls_files": "event bus cannot use its TLS files",
            "no_answer": "event bus got no answer from the broker",
        }[what]
        if last is None or last[:2] != (what, reason) or now - last[2] >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged = (what, reason, now)
            log.error(message, hint=self._hint(what, err), **fields)
        else:
            log.debug(message, **fields)

    def _hint(self, what: str, err: Exception | None = None) -> str:
        if what == "auth":
            return (
                "the broker requires an account: set events.mqtt_username and "
                "events.mqtt_password_file"
                if self.credentials is None
                else "check events.mqtt_username and the password in events.mqtt_password_file"
            )
        if what == "tls":
            assert self.tls is not None
            if err is not None and is_client_certificate_required(err):
                return f"the broker requires a client certificate: {self._client_cert_settings()}"
            hint = (
                f"the broker's certificate must be signed by the CA in {self.tls.settings[0]} "
                f"({self.tls.ca_file}) and name {self.mqtt_host} (subjectAltName), and the "
                f"broker must serve TLS on port {self.mqtt_port}"
            )
            if self.tls.cert_file is None:
                hint += (
                    "; a broker that requires client certificates refuses a client without "
                    f"one: {self._client_cert_settings()}"
                )
            return hint
        if what == "tls_files":
            return "they were usable at start: restore the file the error names"
        if self.tls is not None:
            return (
                "no CONNACK in time over TLS: a broker that requires client certificates may "
                f"drop a client without one ({self._client_cert_settings()}), or it is overloaded"
            )
        return (
            "no CONNACK in time: a broker that serves TLS on this port drops plain clients "
            "(set events.mqtt_tls_ca_file), or it is overloaded"
        )

    def _client_cert_settings(self) -> str:
        assert self.tls is not None
        _, cert, key = self.tls.settings
        return f"set {cert} and {key} (a certificate the broker's CA signed, and its key)"

    def _offline_payload(self) -> bytes:
        """The will: this node offline. Without "ts", which every status the bus publishes
        carries (stop()'s offline one too), so that a reader can tell the two apart."""
        return _encode({"cluster": self.cluster, "node_id": self.node_id, "online": False})

    def _log(self, event: dict[str, Any]) -> None:
        fields = _log_fields(event)
        if event["kind"] in SECURITY_KINDS:
            log.warning("cluster event", **fields)
        else:
            log.info("cluster event", **fields)


class _Window:
    """The messages a connection may have unacknowledged at once (the broker's Receive Maximum):
    ``size`` slots. While the bus has a node status and none of its versions is in flight, one
    slot is kept free for it: the status (stop()'s offline one above all) never waits for event
    acknowledgements, which a slow broker with a backlog holds for longer than stop()'s flush
    timeout. One status version is in flight at a time. With a single slot they share it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.events = 0
        self.status = 0

    def event_free(self, keep_for_status: bool) -> bool:
        keep = 1 if keep_for_status and self.status == 0 and self.size > 1 else 0
        return self.events + self.status + keep < self.size

    def status_free(self) -> bool:
        return self.status == 0 and self.events < self.size

    def take(self, status: bool) -> None:
        if status:
            self.status += 1
        else:
            self.events += 1

    def release(self, status: bool) -> None:
        if status:
            self.status -= 1
        else:
            self.events -= 1


def _on_publish_done(
    task: asyncio.Task[None], publishers: set[asyncio.Task[None]], failed: asyncio.Future[None]
) -> None:
    publishers.discard(task)
    if task.cancelled():
        return
    err = task.exception()
    if err is not None and not failed.done():
        failed.set_exception(err)


def _timed_out(err: BaseException) -> bool:
    """aiomqtt's "no answer in time" (a publish or the CONNACK not acknowledged within its
    timeout), as opposed to the broker closing the connection."""
    return isinstance(err, aiomqtt.MqttError) and str(err) == "Operation timed out"


def _truncated(event: dict[str, Any]) -> dict[str, Any]:
    """A security event the broker kept rejecting, cut to its header: what happened, where and
    when, without the fields that made it too large."""
    stub: dict[str, Any] = {
        k: event[k] for k in ("seq", "ts", "kind", "cluster", "node_id") if k in event
    }
    stub["truncated"] = True
    try:
        stub["original_bytes"] = len(_encode(event))
    except Exception:  # an event that cannot be encoded at all: its size is unknown
        stub["original_bytes"] = -1
    return stub


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, default=str, separators=(",", ":")).encode()


def _log_fields(event: dict[str, Any]) -> dict[str, Any]:
    # "event" is structlog's message key; a payload field of that name must not collide with it.
    return {("event_" if k == "event" else k): v for k, v in event.items()}


async def follow(
    cluster: str,
    host: str,
    port: int = 1883,
    kinds: Iterable[str] | None = None,
    *,
    dedupe: bool = True,
    credentials: MqttCredentials | None = None,
    tls: MqttTls | None = None,
    on_subscribed: Callable[[], None] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Yield events of ``cluster`` (only ``kinds`` when given) as they arrive.

    Raises ``aiomqtt.MqttError`` when the broker cannot be reached, refuses the connection
    (``is_auth_refusal`` tells a refused account; ``is_tls_failure`` a failed TLS handshake) or
    the connection drops, and TlsError when a file of ``tls`` cannot be used.
    Re-sent duplicates (same node, seq and ts) are skipped unless ``dedupe`` is False.
    ``on_subscribed`` is called once the broker acknowledged the subscriptions (from then on,
    silence means nothing was published there that this account may read).
    """
    wanted = sorted(set(kinds)) if kinds else ["+"]
    seen: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    async with contextlib.AsyncExitStack() as stack:
        c = await _enter_reader(stack, host, port, credentials, tls)
        for kind in wanted:
            await c.subscribe(event_topic(cluster, kind), qos=1)
        if on_subscribed is not None:
            on_subscribed()
        async for message in c.messages:
            raw = message.payload
            try:
                event = json.loads(raw if isinstance(raw, bytes | bytearray | str) else str(raw))
            except (ValueError, RecursionError):  # not JSON, or nested deeper than Python goes
                log.warning("undecodable event", topic=str(message.topic))
                continue
            if not isinstance(event, dict):
                continue
            if dedupe:
                key = _dedupe_key(event)
                if key is not None and key in seen:
                    continue
                if key is not None:
                    seen[key] = None
                    if len(seen) > 10 * RECENT_SIZE:
                        seen.popitem(last=False)
            yield event


def _dedupe_key(event: dict[str, Any]) -> Hashable | None:
    """What tells a re-sent event from a new one: (node_id, seq, ts), as JSON text when one of
    them is a list or object (unhashable: anyone may publish anything under the topic); None
    (not deduped) when even that fails."""
    key = (event.get("node_id"), event.get("seq"), event.get("ts"))
    try:
        hash(key)
        return key
    except TypeError:
        pass
    try:
        return json.dumps(key, sort_keys=True, default=str)
    except (ValueError, TypeError, RecursionError):
        return None


async def _enter_reader(
    stack: contextlib.AsyncExitStack,
    host: str,
    port: int,
    credentials: MqttCredentials | None,
    tls: MqttTls | None,
) -> _Client:
    """A subscriber's connection, entered on ``stack``: MQTT 5, or 3.1.1 for a broker that
    answers "unsupported protocol version"."""

    def client(protocol: aiomqtt.ProtocolVersion) -> _Client:
        return _Client(
            host,
            port,
            identifier=f"kvfence-follow-{uuid.uuid4().hex[:8]}",
            username=_username(credentials),
            password=_password(credentials),
            tls_context=None if tls is None else tls.context(),
            protocol=protocol,
        )

    try:
        return await stack.enter_async_context(client(aiomqtt.ProtocolVersion.V5))
    except MqttConnectError as err:
        if not is_unsupported_protocol(err):
            raise
        log.warning("broker does not speak MQTT 5: using MQTT 3.1.1", host=host, port=port)
        return await stack.enter_async_context(client(aiomqtt.ProtocolVersion.V311))


async def clusters_seen(
    host: str,
    port: int = 1883,
    *,
    credentials: MqttCredentials | None = None,
    tls: MqttTls | None = None,
    settle_s: float = SEEN_SETTLE_S,
    max_s: float = SEEN_MAX_S,
) -> dict[str, dict[str, bool]]:
    """The clusters whose retained node status (``node_topic``) this account may read on the
    broker: {cluster: {node_id: online}}, ``online`` True only for a status that says so (the
    will and a graceful stop leave ``"online": false``). Reads only, publishes nothing.

    A broker sends the retained messages right after its SUBACK and marks no end, so this
    collects until ``settle_s`` passes without one (at most ``max_s``). A broker's ACL usually
    filters what it delivers rather than refusing the subscription (Mosquitto), so an empty
    answer can also mean this account may read no node status. Raises like ``follow``, and
    ``aiomqtt.MqttError`` when the broker refuses the subscription (an MQTT 5 SUBACK >= 0x80).
    """
    seen: dict[str, dict[str, bool]] = {}
    topic = node_topic("+", "+")
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        c = await _enter_reader(stack, host, port, credentials, tls)
        granted = await c.subscribe(topic, qos=1)
        for code in granted or ():
            value = getattr(code, "value", code)
            if isinstance(value, int) and value >= PUBACK_REFUSED_FROM:  # as for a PUBACK
                raise aiomqtt.MqttError(
                    f"the broker refused the subscription to {topic}: {_reason_name(code)}"
                )
        deadline = loop.time() + max_s
        messages = c.messages
        while (left := min(settle_s, deadline - loop.time())) > 0:
            try:
                # asyncio.timeout: wait_for (3.11) swallows a cancel (the live view's end) that
                # lands in the turn a message comes, and this read would go on to max_s.
                async with asyncio.timeout(left):
                    message = await messages.__anext__()
            except TimeoutError:
                break
            levels = str(message.topic).split("/")
            if len(levels) != 5 or not message.payload:  # an empty payload clears a status
                continue
            try:
                status = json.loads(message.payload)  # type: ignore[arg-type]
            except (ValueError, TypeError, RecursionError):
                status = None
            online = isinstance(status, dict) and status.get("online") is True
            seen.setdefault(levels[2], {})[levels[4]] = online
    return seen
