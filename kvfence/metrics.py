"""Prometheus metrics of one kvfence service, in a registry of its own.

Every metric is named ``kvfence_*`` and every sample carries a ``service`` label (a constant label
added at collection time, so code increments ``requests_total.labels(status="ok")`` without it).
A registry per instance keeps several services in one process (tests, the local stack) apart.

``Metrics.credential_refused`` is the control plane's record of a call refused for its credential
(no token, a wrong one, or a tenant API key on the admin API): counted in ``auth_failures_total``
and logged without the credential, at most one line per listener per ``auth_log_interval_s``.
"""

from __future__ import annotations

import errno
import functools
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvfence import PROTOCOL_VERSION, __version__
from kvfence import logging as kvlog
from kvfence.errors import INTEGRITY_CHECKS
from kvfence.server import BindError

NAMESPACE = "kvfence"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PASS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Time in one request state: from well under a millisecond (a transition the control plane makes
# at once) to minutes (a long generation in DECODING).
STATE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
)  # fmt: skip
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0)
# The control plane's listeners, the values of auth_failures_total's `listener` label: a fixed set,
# so that the label (and the log throttles kept per listener) stay bounded whoever calls.
AUTH_LISTENERS = ("public", "admin")
# A refused credential is logged at most once per this interval and listener (the line counts the
# refusals since the last one): whoever reaches a port must not set how much the control plane
# logs. The same interval as a node's refusals (kvfence.node.REFUSAL_LOG_INTERVAL_S).
AUTH_FAILURE_LOG_INTERVAL_S = 10.0
# The setting that asks a service (control plane or node alike) to serve its metrics; a bind
# failure names it, so the operator knows what to change.
METRICS_PORT_SETTING = "node.metrics_port"

log = kvlog.get_logger("auth")


if TYPE_CHECKING:
    from kvfence.kv.pool import PagePool


class _ConstLabels(Collector):
    """Re-exposes every metric of ``inner`` with ``labels`` added to each sample."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]):
        self._inner = inner
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples]
            yield out


class Metrics:
    """The metrics every kvfence service exposes; attribute names are the contract."""

    def __init__(self, service: str, *, auth_log_interval_s: float = AUTH_FAILURE_LOG_INTERVAL_S):
        self.service = service
        self.auth_log_interval_s = auth_log_interval_s
        # credential_refused's log throttle per listener and method, and its latest refusal's
        # details: per method, so that junk API keys on Generate (anyone can send them) cannot
        # keep the public listener's one line busy and hide a wrong node token on Register
        self._auth_logs: dict[tuple[str, str], kvlog.BurstLog] = {}
        self._auth_latest: dict[tuple[str, str], dict[str, str]] = {}
        self._inner = CollectorRegistry(auto_describe=True)
        # What render() and the HTTP endpoint expose: the inner metrics plus the service label.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ConstLabels(self._inner, {"service": service}))
        r = self._inner

        # Always 1: which release and control-plane/node protocol this process runs, so that a
        # dashboard (or `count by (version)`) shows a half-finished upgrade.
        self.build_info = Gauge(
            "build_info",
            "The kvfence release and control-plane/node protocol this process runs (always 1).",
            ["version", "protocol"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.build_info.labels(version=__version__, protocol=str(PROTOCOL_VERSION)).set(1)

        self.requests_total = Counter(
            "requests_total",
            "Requests finished, by final status.",
            ["status"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.admission_rejections_total = Counter(
            "admission_rejections_total",
            "Requests rejected at admission.",
            ["reason"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.integrity_failures_total = Counter(
            "integrity_failures_total",
            "KV integrity checks that failed (manifest, tag, checksum, count, MAC; on the control "
            "plane its checks of prefill's answer and of decode's stream).",
            ["check"],
            namespace=NAMESPACE,
            registry=r,
        )
        for check in INTEGRITY_CHECKS:  # at 0 from the start (kvfence.errors.INTEGRITY_CHECKS)
            self.integrity_failures_total.labels(check=check)
        self.transfer_bytes_total = Counter(
            "transfer_bytes_total",
            "KV bytes moved from prefill to decode.",
            namespace=NAMESPACE,
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "transfer_seconds",
            "Duration of one KV transfer.",
            buckets=TRANSFER_BUCKETS,
            namespace=NAMESPACE,
            registry=r,
        )
        # Decode only (labelled, so the other services, which never set it, expose no sample).
        self.transfer_connections_rejected_total = Counter(
            "transfer_connections_rejected_total",
            "UCX connections to decode's KV transfer listener closed at once, unserved, by "
            "reason (unverified_limit: transfer.max_unverified_connections connections were "
            "already waiting for their hello to be verified).",
            ["reason"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.pages = Gauge(
            "pages",
            "KV pages by state (free, held, quarantined).",
            ["state"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "ttft_seconds",
            "Control plane: seconds from a request's Decode call to decode's first tokens (its "
            "check of the transferred KV, then prefill's first token). Not a tenant's time to "
            "first token: the admission queue, Reserve, prefill and the KV transfer come before "
            "it (request_state_seconds shows them).",
            buckets=LATENCY_BUCKETS,
            namespace=NAMESPACE,
            registry=r,
        )
        self.inter_token_seconds = Histogram(
            "inter_token_seconds",
            "Time between consecutive tokens (a message of several counts each at its gap "
            "divided by their number).",
            buckets=TOKEN_BUCKETS,
            namespace=NAMESPACE,
            registry=r,
        )
        self.prefill_pass_prompts = Histogram(
            "prefill_pass_prompts",
            "Prompts in each prefill forward pass that gave them their results (a batched pass "
            "that failed is not counted; its prompts are, in their one-prompt reruns). "
            "prefill.max_batch_tokens bounds their tokens.",
            buckets=PASS_BUCKETS,
            namespace=NAMESPACE,
            registry=r,
        )
        self.decode_step_rows = Histogram(
            "decode_step_rows",
            "Sequences in one decode step (decode.max_batch bounds them): far fewer rows than "
            "requests in flight means they spend their time before decode "
            "(request_state_seconds says where).",
            buckets=PASS_BUCKETS,
            namespace=NAMESPACE,
            registry=r,
        )
        self.request_state_seconds = Histogram(
            "request_state_seconds",
            "Time a request spent in one lifecycle state (observed when it left it; labels are "
            "the states of control_plane/lifecycle.py in lower case).",
            ["state"],
            buckets=STATE_BUCKETS,
            namespace=NAMESPACE,
            registry=r,
        )
        self.rpcs_total = Counter(
            "rpcs_total",
            "Request-carrying gRPC calls, by method: served by this process (Generate, "
            "ListModels, Reserve, Prefill, Decode), or on the control plane also made to nodes "
            "(client:<method>).",
            ["method"],
            namespace=NAMESPACE,
            registry=r,
        )
        # Control plane only (labelled, so the nodes, which never set them, expose no sample).
        self.nodes = Gauge(
            "nodes",
            "Nodes that take new requests (registered, heartbeating, not draining), by role "
            "(control plane).",
            ["role"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.stalled_seconds_total = Counter(
            "stalled_seconds_total",
            "Seconds this process stood still (throttled, descheduled, a long pause): on the "
            "control plane past a node-liveness tick, not counted as the nodes' silence; on a "
            "node, how late its heartbeats were.",
            ["model"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.admissible_limit = Gauge(
            "admissible_limit",
            "Tokens a request may take (prompt + max_new_tokens): the context window, or the "
            "smallest KV pool of the registered nodes when that is smaller (control plane; only "
            "while both roles have a node registered, from node_timeout_s after start).",
            ["model"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.model_online = Gauge(
            "model_online",
            "1 while the model serves, 0 while an operator has taken it offline (control plane).",
            ["model"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.model_offline_since = Gauge(
            "model_offline_since_timestamp_seconds",
            "Unix time the model was taken offline, kept across control plane restarts; 0 while "
            "it serves (control plane).",
            ["model"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.events_dropped_total = Counter(
            "events_dropped_total",
            "Cluster events dropped: the buffer was full, or the broker refused one for itself "
            "again and again (kvfence.events).",
            namespace=NAMESPACE,
            registry=r,
        )
        self.events_refused_total = Counter(
            "events_refused_total",
            "Cluster events and node status messages the MQTT broker refused (an MQTT 5 PUBACK "
            "reason code >= 0x80, e.g. its ACL), each try counted; they stay buffered and are "
            "retried.",
            namespace=NAMESPACE,
            registry=r,
        )
        # Control plane only (labelled, so the nodes, which never set it, expose no sample).
        # Failed logins are not requests: requests_total counts Generate's among its statuses
        # (UNAUTHENTICATED), but Register, Heartbeat and the admin API's refusals are only
        # here. No label carries the credential: every one is bounded.
        self.auth_failures_total = Counter(
            "auth_failures_total",
            "Calls refused for their credential (none, a wrong one, or a tenant API key on the "
            "admin API), by listener (public, admin), method and status (UNAUTHENTICATED, "
            "PERMISSION_DENIED) (control plane).",
            ["listener", "method", "status"],
            namespace=NAMESPACE,
            registry=r,
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def credential_refused(
        self, *, listener: str, method: str, status: str, reason: str, peer: str
    ) -> None:
        """Count and log one call refused for its credential (on the event loop). ``listener``
        is one of AUTH_LISTENERS, ``method`` the RPC's name, ``status`` the refusal's code name,
        ``reason`` what was wrong, in words, and ``peer`` the caller's address
        (``context.peer()``). Never pass the credential, or anything derived from it: the log
        line is for whoever reads the logs. The first refusal of a method on a listener is logged
        at once, later ones at most one line per ``auth_log_interval_s`` per listener and method
        (a bounded set: methods are the code's), which says how many were refused since the last
        (``refused``) and the latest one's status, reason and peer; the rest of a burst is logged
        by a timer when the interval is over."""
        if listener not in AUTH_LISTENERS:
            raise ValueError(f"listener {listener!r} is not one of {', '.join(AUTH_LISTENERS)}")
        self.auth_failures_total.labels(listener=listener, method=method, status=status).inc()
        key = (listener, method)
        self._auth_latest[key] = {"status": status, "reason": reason, "peer": peer}
        burst = self._auth_logs.get(key)
        if burst is None:
            burst = kvlog.BurstLog(
                functools.partial(self._log_refused, listener, method), self.auth_log_interval_s
            )
            self._auth_logs[key] = burst
        burst.note()

    def flush_auth_log(self) -> None:
        """Log the refusals since each listener's and method's last line, if any: the timer's
        job (nothing calls it at shutdown yet, so refusals of the last interval before a stop are
        counted, not logged)."""
        for burst in list(self._auth_logs.values()):
            burst.flush()

    def _log_refused(self, listener: str, method: str, refused: int) -> None:
        log.warning(
            "credentials refused",
            listener=listener,
            method=method,
            refused=refused,
            next_line_after_s=self.auth_log_interval_s,
            **self._auth_latest[(listener, method)],
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the metrics over HTTP in a daemon thread (port 0 = ephemeral); returns the port.

        An address that cannot be bound raises BindError, as a gRPC listener's does
        (kvfence.server), naming the address and node.metrics_port: ``kvfence serve`` prints it
        as its one line, where the bare OSError ("[Errno 98] Address already in use") said
        neither. Nothing is left bound then (socketserver closes the socket it failed to bind).
        """
        if self._server is not None:
            raise RuntimeError(f"metrics of {self.service} already served on {self.port}")
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise BindError(metrics_bind_message(host, port, err)) from err
        return int(self._server.server_port)

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_port)

    def stop(self) -> None:
        """Stop the HTTP server (no-op when not serving)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)


def metrics_bind_message(host: str, port: int, err: OSError) -> str:
    """Why the metrics endpoint could not listen on ``host``:``port``, in the words the gRPC
    listeners use for the same failure (kvfence.server), with the setting to change."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if err.errno == errno.EADDRINUSE:
        return (
            f"cannot serve metrics on {address} ({METRICS_PORT_SETTING}): the address is in use "
            "by another process"
        )
    # not a local address, a name that does not resolve, a privileged port
    return (
        f"cannot serve metrics on {address} (node.metrics_host, {METRICS_PORT_SETTING}): the "
        f"address cannot be bound here ({err.strerror or err})"
    )


def publish_pool(metrics: Metrics, pool: PagePool) -> None:
    """Set the ``pages`` gauge from a pool's current free / held / quarantined counts."""
    s = pool.stats()
    metrics.pages.labels(state="free").set(s.free)
    metrics.pages.labels(state="held").set(s.held)
    metrics.pages.labels(state="quarantined").set(s.quarantined)
