"""Cluster configuration: pydantic models loaded from YAML plus environment overrides.

One file describes the whole cluster; each process reads the sections it needs (`node` says which
role it plays). Environment variables override the file: ``KVFENCE__<SECTION>__<FIELD>=value``
(double underscores separate levels), e.g. ``KVFENCE__NODE__ROLE=decode``. A string field (names,
addresses, paths, roles) takes the value exactly as written (``KVFENCE__NODE__NODE_ID=0123`` is
the string "0123"); where the field may be unset, ``null`` or ``~`` unsets it. Every other value is
parsed as YAML (numbers, booleans, ``null``, a flow mapping for a whole section). A malformed name,
or two variables that set the same field or a field and the section holding it, is a ConfigError
that names the variables. An invalid value that came from the environment is reported with the
variables behind it, "(from KVFENCE__...)": the one that set the field or the section holding it,
and, for an error about a whole section, the variables that set a field its message names (its
cross-field checks), or every one under a section name that does not exist.

A bad value raises :class:`ConfigError` whose message names the field and the rule it broke.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from enum import StrEnum
from pathlib import Path, PurePath
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

ENV_PREFIX = "KVFENCE__"
# Names that become MQTT topic levels (cluster, node id): no "/" (a level separator), no "+" or "#"
# (wildcards, which a broker refuses in a published topic), no spaces.
NAME_CHARS = "A-Za-z0-9_.-"
NAME_PATTERN = rf"^[{NAME_CHARS}]+$"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message names field and rule."""


# grpc fails at once a call whose timeout is over about 7.5e9 s (DEADLINE_EXCEEDED), and a
# request's deadline becomes its node calls' timeout: a billion seconds (31 years) is the most.
MAX_DEADLINE_S = 1e9


class _Strict(BaseModel):
    # No infinite (or NaN) numbers: `gt=0` lets .inf through, and an infinite timeout or interval
    # breaks at its first use (a node's registration: OverflowError converting the heartbeat
    # interval to ms; a request's deadline: grpc fails a call given timeout=inf at once).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Role(StrEnum):
    CONTROL_PLANE = "control-plane"
    PREFILL = "prefill"
    DECODE = "decode"


class ModelShape(_Strict):
    """The KV-relevant shape of the model; read from the checkpoint, or given for static checks."""

    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    context_window: int = Field(gt=0)


class ModelConfig(_Strict):
    """Which model to serve and how far its context may be used."""

    name: str = "tiny-llama"
    # Checkpoint folder (config.json + *.safetensors). None = the embedded tiny model.
    path: Path | None = None
    dtype: str = Field(default="float32", pattern="^(float32|float16|bfloat16)$")
    # Overrides the checkpoint's max_position_embeddings when set.
    context_window: int | None = Field(default=None, gt=0)
    # An operator who knowingly runs pools smaller than the context window says so here; without it,
    # check-config fails on such a cluster (the incident's configuration).
    clamp_context: bool = False
    # Shape for `check-config --static` when the checkpoint is not at hand (e.g. a Helm hook).
    shape: ModelShape | None = None


class PoolConfig(_Strict):
    """One node's KV page pool: a page count, or a byte budget from which the count is derived."""

    num_pages: int | None = Field(default=None, gt=0)
    memory_bytes: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> PoolConfig:
        if (self.num_pages is None) == (self.memory_bytes is None):
            raise ValueError("set exactly one of num_pages or memory_bytes")
        return self

    def pages_for(self, page_bytes: int) -> int:
        """Number of pages this pool holds when one page is ``page_bytes`` bytes."""
        if self.num_pages is not None:
            return self.num_pages
        assert self.memory_bytes is not None
        return self.memory_bytes // page_bytes


class KvConfig(_Strict):
    """KV cache layout shared by every node, and the pools per role."""

    page_size: int = Field(default=16, ge=1, le=1024)
    prefill_pool: PoolConfig = PoolConfig(num_pages=256)
    decode_pool: PoolConfig = PoolConfig(num_pages=256)
    # Zero pages when they are freed, for every tenant (tenants can also ask for it one by one).
    scrub_on_free: bool = False


class NodeConfig(_Strict):
    """This process: its role and where it listens."""

    role: Role = Role.CONTROL_PLANE
    # empty = "<role>-<hostname>-<pid>" (kvfence.node.default_node_id). A level of this node's
    # MQTT topics, so constrained like `cluster`.
    node_id: str = Field(default="", pattern=rf"^[{NAME_CHARS}]*$")
    listen: str = "127.0.0.1:0"
    # Address others use to reach this node, host:port; empty = the bound listen address. An IPv6
    # host may come bare ("fd00::1:50061", as Kubernetes' $(POD_IP) gives it): it is bracketed.
    advertise: str = ""
    ucx_host: str = "127.0.0.1"
    ucx_port: int = Field(default=0, ge=0, le=65535)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # Address the Prometheus endpoint binds. 127.0.0.1 keeps it on this machine; where Prometheus
    # scrapes the pod's address it must be 0.0.0.0 (the Helm chart sets that).
    metrics_host: str = "127.0.0.1"
    # Test-only fault hook in the transfer path (kvfence/faults.py); never reachable from the
    # public API. Both must be set for it to act.
    fault_hook: bool = False
    fault_file: Path | None = None
    # On SIGTERM a prefill or decode node drains first: it tells the control plane (heartbeats
    # with `draining`, so it is sent no new requests), refuses new Reserve / Prefill calls
    # (UNAVAILABLE, reason NODE_DRAINING: the control plane tries another node) and lets the
    # work it holds finish, then stops. This long at most: what still runs then fails as on a
    # plain stop. 0 = no drain. Keep it under the pod's terminationGracePeriodSeconds (the Helm
    # chart's drainTimeoutS sets both).
    drain_timeout_s: float = Field(default=25.0, ge=0)

    @field_validator("advertise")
    @classmethod
    def _bracket_ipv6_host(cls, value: str) -> str:
        # Kubernetes builds the address by substitution, "$(POD_IP):port" (the Helm chart does),
        # so an IPv6 pod gets "fd00::1:50061", which gRPC reads as a host without a port and
        # cannot dial. The address ends in ":port", so a host before the last colon that is an
        # IPv6 literal gets its brackets; anything else (names, IPv4, "[...]", URIs) is kept.
        host, sep, port = value.rpartition(":")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return value
        return f"[{host}]{sep}{port}"


class TransferConfig(_Strict):
    """Bounds on the prefill -> decode KV transfer, and prefill's pool of UCX endpoints."""

    # At most this many bytes of pages in flight per transfer: each batch waits for decode's
    # acknowledgement of the one before. On TCP every batch costs a round trip: with 4 MiB,
    # 16-64 MiB transfers reached 0.63-0.91 of raw ucxx here, with 16 MiB 0.75-1.03
    # (benchmarks/transfer.py, three runs each).
    max_batch_bytes: int = Field(default=16 << 20, gt=0)
    batch_timeout_s: float = Field(default=10.0, gt=0)
    # How long decode waits for the manifest after reserving before it gives the pages up.
    reservation_timeout_s: float = Field(default=60.0, gt=0)
    # Prefill keeps up to this many idle, already-connected UCX endpoints per decode node and
    # reuses them for later transfers (one transfer at a time per endpoint; an endpoint whose
    # transfer failed is never reused). 0 = a new endpoint for every transfer. Size it to the
    # transfers in flight to one decode node at once: a transfer that finds no idle endpoint
    # opens one (10-25 ms on TCP), and with 16 concurrent requests a limit of 4 halved the
    # transfer speed, as endpoints beyond it were closed and opened again.
    endpoint_pool_max_idle: int = Field(default=32, ge=0, le=256)
    # An idle pooled endpoint is closed after this long unused. Decode waits this long plus
    # batch_timeout_s for the next hello on an endpoint, so prefill normally closes first (its
    # reaper can come round later; decode then closes the idle endpoint quietly, and prefill never
    # leases one idle past this).
    endpoint_idle_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # Decode serves at most this many UCX connections at once whose first hello is not verified
    # yet (waiting for it, up to batch_timeout_s, or lingering after refusing it); a connection
    # beyond it is closed at once, unserved (kvfence/transfer.py, KvReceiver). A legit one is
    # unverified for about one round trip, and a prefill's pooled endpoints not at all once
    # verified, so size it well above the new connections all prefill nodes open to one decode
    # node at once.
    max_unverified_connections: int = Field(default=256, ge=1, le=65536)


class PrefillConfig(_Strict):
    """How a prefill node batches its prompts."""

    # Prompts that wait while the engine thread is busy run together in one forward pass, in
    # arrival order, up to this many prompt tokens (a longer prompt still runs, alone); 1 runs
    # every prompt alone. On this CPU a pass of four ~32-token prompts costs about 0.7x per token
    # what four passes of one do, but a long pass delays every prompt that arrives during it, and
    # the requests it releases together reach decode, finish and come back together. With the
    # bundled small model (benchmarks/RESULTS.md, prefill_batching.py) 128 gave 1.08-1.12x the
    # tokens/s of 1 at concurrency 64 and 1.02-1.05x at 16, where 256 gave 1.11-1.15x and
    # 0.99-1.02x and raised TTFT p50 at 16 from 58-79 ms to 164-228 (128: 119-120). An
    # accelerator runs more tokens in the same time, so its best value is likely larger (not
    # measured here).
    max_batch_tokens: int = Field(default=128, ge=1, le=1 << 20)


class DecodeConfig(_Strict):
    """How a decode node batches its sequences and streams their tokens."""

    # At most this many sequences in one decode step; the others wait for a place, in the order
    # their KV was verified.
    max_batch: int = Field(default=64, ge=1, le=4096)
    # A sequence's new tokens go out every this many tokens: its first token at once, its last
    # with its finish reason. 1 sends each token as it is sampled. Every message costs the decode
    # node and the control plane a gRPC message (68-83 µs of CPU, sender and receiver together, on
    # a grpc.aio stream on loopback here), so where they are CPU-bound a larger value buys
    # throughput (benchmarks/stream_interval.py); clients then get tokens in bursts of this many.
    # Stop conditions are checked on every token either way.
    stream_interval: int = Field(default=1, ge=1, le=256)


NODE_TIMEOUT_HEARTBEATS = 2  # node_timeout_s >= this many heartbeat intervals

# Of a decode reservation's life (transfer.reservation_timeout_s), the part a request may spend
# waiting for prefill room before it fails NO_CAPACITY: control_plane.pipeline's
# RESERVATION_USE_FRACTION, repeated here because kvfence/ does not import the control plane
# (tests/control_plane/test_config_refused_room.py holds the two equal).
PREFILL_ROOM_WAIT_FRACTION = 0.75


def refused_room_bound_s(reservation_timeout_s: float) -> float:
    """The most ``control_plane.refused_room_max_s`` may be: 2/3 of the longest wait for prefill
    room (PREFILL_ROOM_WAIT_FRACTION x ``reservation_timeout_s``), i.e. half the reservation
    timeout.

    A node left out longer than requests wait fails every request waiting for it, room or not.
    Out at most 2/3 of the wait, it is back in routing for at least the last third of the wait
    of a request that began waiting when it refused (at least half as long as it was out), and a
    request refused in the first third of its own wait still tries it again. With the default 60 s
    timeout this is 30 s, the field's own cap, so no value accepted there before is refused."""
    # 0.75 x 2/3 is exactly 0.5: the bound is exactly half, as the Helm chart checks it.
    return reservation_timeout_s * (PREFILL_ROOM_WAIT_FRACTION * 2 / 3)


class ControlPlaneConfig(_Strict):
    """The control plane's listeners and admission bounds."""

    listen: str = "127.0.0.1:50051"
    admin_listen: str = "127.0.0.1:50052"
    # Address nodes use to register; empty = `listen`.
    address: str = ""
    state_dir: Path = Path(".kvfence")
    admission_queue: int = Field(default=256, ge=1)
    # Places of the admission queue one tenant may hold: so that one tenant cannot lock the others
    # out of it. At most admission_queue: a larger value given is refused (it would be cut to
    # admission_queue, and the operator believe in a bound that is not there); left unset, the
    # default 64 is cut to admission_queue where that is lowered (as tests and small stacks do).
    admission_queue_per_tenant: int = Field(default=64, ge=1)
    default_deadline_s: float = Field(default=120.0, gt=0, le=MAX_DEADLINE_S)
    # The longest deadline a client may ask (its gRPC timeout is cut to this): a request holds
    # its queue place, and its pages, until its deadline.
    max_deadline_s: float = Field(default=3600.0, gt=0, le=MAX_DEADLINE_S)
    # How long a stopping control plane lets running requests finish before it fails them
    # (SHUTTING_DOWN); the chart's terminationGracePeriodSeconds must exceed it.
    shutdown_grace_s: float = Field(default=25.0, ge=0)
    # How long a stopping control plane keeps its listeners open after it starts refusing
    # requests (health NOT_SERVING; new ones fail UNAVAILABLE, SHUTTING_DOWN, to be retried
    # elsewhere), however soon its running ones end: closing them at once has grpc cancel the
    # calls it accepted but had not handed to a handler yet (CANCELLED, which clients take for
    # their own doing), and a load balancer needs a moment to stop sending new connections.
    # It runs alongside shutdown_grace_s, not after it; 0 = close as soon as nothing runs. The
    # chart's terminationGracePeriodSeconds must exceed it too.
    shutdown_refuse_s: float = Field(default=1.0, ge=0)
    # Sent to nodes in whole ms (a uint32): from 1 ms to about 49 days.
    heartbeat_interval_s: float = Field(default=1.0, ge=0.001, le=4_000_000)
    # A node silent this long is lost. At least 2x heartbeat_interval_s, so one late heartbeat does
    # not drop a healthy node (a shorter timeout makes nodes flap lost/joined); one lost heartbeat
    # takes about interval + max(interval, 1 s) (kvfence.node.NodeAgent), which the default 5 s
    # covers at the default 1 s interval.
    node_timeout_s: float = Field(default=5.0, gt=0)
    # A request that finds no node of a role registered (its last one drained and was dropped, or
    # crashed; or this control plane just started) waits in the admission queue, within its
    # deadline, until this long after that role's last node left, for one to register (a rolling
    # update's replacement, a restarted pod, nodes re-registering after a control plane restart);
    # then it fails UNAVAILABLE (NO_NODES), and so does every new one until a node registers.
    # 0 = fail at once.
    no_node_wait_s: float = Field(default=10.0, ge=0)
    # Routing's cool-down (control_plane/routing.py): a node whose calls failed on its side this
    # many times in a row, no success between, is left out of routing for failure_cooldown_s while
    # another node of its role takes requests; then one request probes it. 1 = at the first
    # failure (a transient error, a peer restarting, then costs that node's share of capacity for
    # the whole cool-down). At most 100: a node has failed that many requests by then, so a higher
    # value only disguises "never", which failure_cooldown_s: 0 says plainly.
    failures_to_cool: int = Field(default=3, ge=1, le=100)
    # 0 = never cool (failures are still counted and logged). At most an hour: the node stays up
    # and heartbeating while left out (a restarted process registers afresh, its count at 0), so a
    # longer one only keeps a node that has recovered out of routing, and one probe per cool-down
    # is all that a broken node costs already.
    failure_cooldown_s: float = Field(default=10.0, ge=0, le=3600)
    # A prefill node that refused a Prefill for room (RESOURCE_EXHAUSTED) is left out at most this
    # long, whatever its heartbeats say (its pages can come back unseen, and it then sits empty
    # while requests wait). Above 0: 0 would have every request waiting for prefill room send it
    # its whole prompt again at each wake-up. At most 30 s, and at most half of
    # transfer.reservation_timeout_s (ClusterConfig checks it: refused_room_bound_s). Left
    # unset, it is 5 s cut to that bound where the reservation timeout is lowered.
    refused_room_max_s: float = Field(default=5.0, gt=0, le=30)
    # The largest message the public and admin listeners accept, in bytes; a larger one is refused
    # RESOURCE_EXHAUSTED by gRPC before any handler runs, credentials unchecked: gRPC holds a
    # whole message in memory first, so 64 MiB ones from anyone who reached the port (no key
    # needed) took the control plane's memory and event loop. The largest legitimate one is a
    # Generate whose prompt fills the context window: up to 5 bytes a token as ids, a text up to
    # its tokenizer's max_text_bytes_per_token a token. The default 16 MiB takes a million ids,
    # or 8 MiB of text. At least 64 KiB; at most 64 MiB (kvfence.server.MAX_MESSAGE_BYTES, what
    # clients send at most).
    max_request_bytes: int = Field(default=16 << 20, ge=64 << 10, le=64 << 20)
    admin_token_file: Path | None = None
    # Shared by the control plane and every node (kvfence/auth.py): nodes present it to register,
    # and every call to a node must carry it. None = generated under state_dir (by the first
    # process of the cluster to start), which only processes sharing that directory can read.
    node_token_file: Path | None = None

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> ControlPlaneConfig:
        if self.node_timeout_s < NODE_TIMEOUT_HEARTBEATS * self.heartbeat_interval_s:
            raise ValueError(
                f"node_timeout_s ({self.node_timeout_s:g}) must be at least "
                f"{NODE_TIMEOUT_HEARTBEATS} x heartbeat_interval_s ({self.heartbeat_interval_s:g}),"
                " or nodes are declared lost between heartbeats"
            )
        if self.default_deadline_s > self.max_deadline_s:
            raise ValueError(
                f"default_deadline_s ({self.default_deadline_s:g}) must not exceed "
                f"max_deadline_s ({self.max_deadline_s:g})"
            )
        return self

    @model_validator(mode="after")
    def _admin_listener_of_its_own(self) -> ControlPlaneConfig:
        """The two listeners cannot share a port (kvfence binds without SO_REUSEPORT): refused
        here, so that ``check-config --static`` (the chart's pre-install hook) says so rather
        than the control plane failing to bind at start."""
        if _same_listener(self.listen, self.admin_listen):
            raise ValueError(
                f"admin_listen ({self.admin_listen}) and listen ({self.listen}) take the same "
                "port: the admin API needs a listener of its own, give it another port"
            )
        return self

    @model_validator(mode="after")
    def _tenant_share_within_queue(self) -> ControlPlaneConfig:
        if self.admission_queue_per_tenant <= self.admission_queue:
            return self
        if "admission_queue_per_tenant" not in self.model_fields_set:
            # The default, cut to a lowered queue here rather than only where the queue is built,
            # so that the config as loaded (and a dump of it, loaded again) says the share in
            # force. Frozen model, not handed out yet: set in place, still unset.
            object.__setattr__(self, "admission_queue_per_tenant", self.admission_queue)
            return self
        raise ValueError(
            f"admission_queue_per_tenant ({self.admission_queue_per_tenant}) must not exceed "
            f"admission_queue ({self.admission_queue}): one tenant's share of the queue "
            "cannot be larger than the queue"
        )


def _listen_host(host: str) -> str:
    """One spelling per host a listener binds: "" for every wildcard form (``0.0.0.0``, ``[::]``,
    ``[::0]``, no host), an address in its canonical form (``[0:0::1]`` is ``::1``), a name in
    lower case."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name ("" included)
    if ip.is_unspecified:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


# ``localhost`` binds the loopback address of each family it resolves to.
_LOCALHOST = {"localhost": frozenset({"localhost", "127.0.0.1", "::1"})}


def _same_listener(a: str, b: str) -> bool:
    """Whether binding ``a`` and then ``b`` (host:port) would collide: the same port, not 0 (a
    port of the system's choosing), on the same host (however spelt: ``localhost`` and
    ``127.0.0.1``, ``[::1]`` and ``[0:0::1]``) or where either is a wildcard address, which takes
    the port on every interface."""
    if ":" not in a or ":" not in b:
        return False  # not host:port: binding it fails, naming it, at start
    host_a, port_a = a.strip().rsplit(":", 1)
    host_b, port_b = b.strip().rsplit(":", 1)
    if not (port_a.isdigit() and port_b.isdigit()) or int(port_a) != int(port_b) or not int(port_a):
        return False
    host_a, host_b = _listen_host(host_a), _listen_host(host_b)
    if host_a == host_b or "" in (host_a, host_b):
        return True
    return host_b in _LOCALHOST.get(host_a, ()) or host_a in _LOCALHOST.get(host_b, ())


class EventsConfig(_Strict):
    """MQTT event stream; no host = events go to the log only."""

    # None (YAML null, or the key left out) = no broker. An empty string is refused: it is not
    # "no broker" but a host that can never be reached.
    mqtt_host: str | None = None
    mqtt_port: int = Field(default=1883, ge=1, le=65535)
    buffer_size: int = Field(default=10_000, ge=1)
    # The broker account (both or neither; neither = connect anonymously). The password is read
    # from a file (e.g. a mounted Kubernetes Secret), never written in the config: the file's
    # content without its trailing newlines (kvfence/events.py, load_mqtt_credentials).
    mqtt_username: str | None = None
    mqtt_password_file: Path | None = None
    # TLS to the broker (None = plain TCP): the broker's certificate must be signed by this CA
    # (PEM; the only one trusted) and name mqtt_host. A broker that requires client certificates
    # also gets mqtt_tls_cert_file + mqtt_tls_key_file (PEM, both or neither; only with the CA).
    # The files are read at start and again at each reconnect (kvfence/events.py, MqttTls).
    mqtt_tls_ca_file: Path | None = None
    mqtt_tls_cert_file: Path | None = None
    mqtt_tls_key_file: Path | None = None

    @field_validator("mqtt_host")
    @classmethod
    def _host_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("empty broker host: give a host, or null for no broker (log only)")
        return value

    @field_validator("mqtt_username")
    @classmethod
    def _username_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("empty MQTT username: give one, or null to connect anonymously")
        return value

    def _together(self, first: str, second: str, advice: str) -> None:
        """Both of two fields, or neither: ValueError naming the one given and the one missing."""
        given = [name for name in (first, second) if getattr(self, name) is not None]
        if len(given) == 1:
            missing = second if given == [first] else first
            raise ValueError(f"{given[0]} is set but {missing} is not: {advice}")

    @model_validator(mode="after")
    def _username_and_password_together(self) -> EventsConfig:
        self._together(
            "mqtt_username",
            "mqtt_password_file",
            "give both (a broker account), or neither (anonymous)",
        )
        return self

    @model_validator(mode="after")
    def _tls_files_together(self) -> EventsConfig:
        self._together(
            "mqtt_tls_cert_file",
            "mqtt_tls_key_file",
            "a client certificate needs its key (give both, or neither for no client certificate)",
        )
        if self.mqtt_tls_cert_file is not None and self.mqtt_tls_ca_file is None:
            raise ValueError(
                "mqtt_tls_cert_file and mqtt_tls_key_file without mqtt_tls_ca_file: a client "
                "certificate is for TLS, which needs the CA that signed the broker's certificate"
            )
        return self


# Why internal mTLS alone is refused (ClusterConfig, at load) and what registry_channel_credentials
# raises for a TlsConfig built without that check: the registry is served on the public listener.
REGISTRY_IN_CLEAR = (
    "tls.internal_ca, tls.internal_cert and tls.internal_key (mutual TLS between the services) "
    "are set but tls.public_cert and tls.public_key are not: nodes register and heartbeat on "
    "the control plane's public listener, so their node token would travel there in clear; set "
    "tls.public_cert and tls.public_key too (a certificate signed by tls.internal_ca, which the "
    "nodes verify it with)"
)


_TLS_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_TLS_NAME_PATTERN = rf"^{_TLS_LABEL}(\.{_TLS_LABEL})*$"


class TlsConfig(_Strict):
    """TLS on the public endpoint and mutual TLS between services (paths to PEM files).

    ``internal_server_name``: the name the control plane verifies every node's certificate
    against (gRPC ``ssl_target_name_override``) instead of the host of the node's advertised
    address, for a certificate shared by the nodes that cannot name each pod's IP; None = the
    dialled host."""

    public_cert: Path | None = None
    public_key: Path | None = None
    internal_ca: Path | None = None
    internal_cert: Path | None = None
    internal_key: Path | None = None
    # A DNS name (or IPv4 address) as a certificate's subjectAltName has it; nothing resolves it.
    internal_server_name: str | None = Field(
        default=None, max_length=253, pattern=_TLS_NAME_PATTERN
    )

    @model_validator(mode="after")
    def _server_name_needs_internal_tls(self) -> TlsConfig:
        if self.internal_server_name is not None and self.internal_ca is None:
            raise ValueError(
                "internal_server_name without internal_ca: the control plane calls nodes in "
                "clear, there is no node certificate to verify the name against"
            )
        return self


class ClusterConfig(_Strict):
    """Everything one kvfence process needs to know."""

    cluster: str = Field(default="local", pattern=NAME_PATTERN)
    model: ModelConfig = ModelConfig()
    kv: KvConfig = KvConfig()
    node: NodeConfig = NodeConfig()
    transfer: TransferConfig = TransferConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    control_plane: ControlPlaneConfig = ControlPlaneConfig()
    events: EventsConfig = EventsConfig()
    tls: TlsConfig = TlsConfig()

    @model_validator(mode="after")
    def _public_tls_together(self) -> ClusterConfig:
        """tls.public_cert and tls.public_key: both or neither, refused at load (so by
        ``check-config --static``) rather than when the control plane builds its credentials
        (kvfence.tls.public_server_credentials, which checks it again for a TlsConfig built
        without this). On ClusterConfig, as the next check, so that a TlsConfig can still be
        built with a partial set (tests of those credential checks do)."""
        t = self.tls
        if (t.public_cert is None) != (t.public_key is None):
            have, missing = (
                ("tls.public_cert", "tls.public_key")
                if t.public_key is None
                else ("tls.public_key", "tls.public_cert")
            )
            raise ValueError(
                f"{have} is set but {missing} is not: give both (TLS on the public endpoint), "
                "or neither (plaintext)"
            )
        return self

    @model_validator(mode="after")
    def _registry_not_in_clear(self) -> ClusterConfig:
        """Internal mTLS without public TLS: refused (REGISTRY_IN_CLEAR). On ClusterConfig, not
        TlsConfig, so a TlsConfig holding the internal files alone (a node's server credentials in
        tests) still builds; a partial internal set is refused where credentials are built."""
        t = self.tls
        internal = (t.internal_ca, t.internal_cert, t.internal_key)
        if all(f is not None for f in internal) and (t.public_cert is None or t.public_key is None):
            raise ValueError(REGISTRY_IN_CLEAR)
        return self

    @model_validator(mode="after")
    def _refused_room_within_wait(self) -> ClusterConfig:
        """control_plane.refused_room_max_s at most refused_room_bound_s: refused when given,
        the default cut to it when not (configs that only lower the reservation timeout, as
        tests and local stacks do, keep loading)."""
        cp, timeout = self.control_plane, self.transfer.reservation_timeout_s
        bound = refused_room_bound_s(timeout)
        if cp.refused_room_max_s <= bound:
            return self
        if "refused_room_max_s" in cp.model_fields_set:
            wait = PREFILL_ROOM_WAIT_FRACTION * timeout
            raise ValueError(
                f"control_plane.refused_room_max_s ({cp.refused_room_max_s:g}) must be at most "
                f"{bound:g} s, half of transfer.reservation_timeout_s ({timeout:g}): requests "
                f"waiting for prefill room fail NO_CAPACITY after {wait:g} s "
                f"({PREFILL_ROOM_WAIT_FRACTION:g} x reservation_timeout_s), and a prefill node "
                "that refused for room, left out of routing up to refused_room_max_s, must be "
                "back within 2/3 of that wait, or they fail though it has room again; lower "
                "refused_room_max_s or raise reservation_timeout_s"
            )
        clamped = cp.model_copy(update={"refused_room_max_s": bound})
        # Still the default, cut: unset, so a config rebuilt from this one with another timeout
        # cuts it afresh.
        clamped.model_fields_set.discard("refused_room_max_s")
        # The models are frozen, but this one is not handed out yet: set the field in place.
        object.__setattr__(self, "control_plane", clamped)
        return self

    def page_bytes(self, shape: ModelShape) -> int:
        """Bytes of one KV page: layers x (K, V) x page_size x kv_heads x head_dim x dtype."""
        return (
            shape.num_layers
            * 2
            * self.kv.page_size
            * shape.num_kv_heads
            * shape.head_dim
            * DTYPE_BYTES[self.model.dtype]
        )

    def pool_for(self, role: Role) -> PoolConfig:
        return self.kv.decode_pool if role == Role.DECODE else self.kv.prefill_pool


def pages_needed(tokens: int, page_size: int) -> int:
    """ceil(tokens / page_size): the pages a request of ``tokens`` tokens occupies."""
    return math.ceil(tokens / page_size)


EnvSources = dict[tuple[str, ...], str]  # config path -> the variable that set it


def _env_overrides(environ: dict[str, str]) -> tuple[dict[str, Any], EnvSources]:
    """The ``KVFENCE__`` variables of ``environ`` as a nested mapping, and which variable set
    which path (for error messages)."""
    sources: EnvSources = {}
    for key in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
        path = tuple(p.lower() for p in key[len(ENV_PREFIX) :].split("__"))
        if not all(path):
            raise ConfigError(
                f"environment variable {key}: malformed name, expected "
                f"{ENV_PREFIX}<SECTION>[__<FIELD>...] with levels separated by '__'"
            )
        for other_path, other in sources.items():
            shorter, longer = sorted((path, other_path), key=len)
            if longer[: len(shorter)] == shorter:
                what = "the same field" if path == other_path else "a section and a field in it"
                raise ConfigError(
                    f"environment variables {other} and {key} conflict: both set {what} "
                    f"({'.'.join(shorter)}); keep one"
                )
        sources[path] = key
    tree: dict[str, Any] = {}
    for path, key in sources.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(key, environ[key], _field_annotation(path))
    return tree, sources


def _field_annotation(path: tuple[str, ...]) -> Any:
    """The type annotation of the config field at ``path``; None where there is no such field."""
    annotation: Any = ClusterConfig
    for part in path:
        model = next((a for a in _members(annotation) if _is_model(a)), None)
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
    return annotation


def _members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, UnionType):
        return get_args(annotation)
    return (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _env_value(key: str, raw: str, annotation: Any) -> Any:
    """``raw`` as the field at ``annotation`` should see it (see the module docstring)."""
    members = _members(annotation) if annotation is not None else ()
    kinds = [m for m in members if m is not NoneType]
    if kinds and all(isinstance(k, type) and issubclass(k, str | PurePath) for k in kinds):
        # As written: YAML would read 0123 as the int 83, 2024 as an int, "a # b" as "a".
        if NoneType in members and raw.strip() in ("null", "Null", "NULL", "~"):
            return None
        return raw
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"environment variable {key}: not a valid YAML value: {err}") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(err: ValidationError, sources: EnvSources) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        if not loc:
            # A check across sections (ClusterConfig's validators): its message names the keys
            # and their values, and its input is the whole config, so neither is repeated; the
            # variables that set a key it names are.
            line = e["msg"].removeprefix("Value error, ")
            keys = re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", line)
            named = [
                k
                for p, k in sources.items()
                if any(tuple(key.split("."))[: len(p)] == p for key in keys)
            ]
            lines.append(line if not named else f"{line} (from {', '.join(named)})")
            continue
        line = f"{'.'.join(loc)}: {e['msg']}"
        line += f" (got {json.dumps(e.get('input'), default=str)[:80]})"
        # the variable that set this field or the section holding it; for an error about a
        # whole section, the variables that set something in it the error is about: all of them
        # for a section name that does not exist, else those whose field the message names (its
        # cross-field checks name their fields: the chart sets other control_plane variables on
        # every pod, which such an error must not send the operator to)
        named = [
            k
            for p, k in sources.items()
            if loc[: len(p)] == p
            or (
                p[: len(loc)] == loc
                and (
                    e["type"] == "extra_forbidden"
                    or re.search(rf"\b{re.escape(p[len(loc)])}\b", e["msg"]) is not None
                )
            )
        ]
        lines.append(line if not named else f"{line} (from {', '.join(named)})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any], environ: dict[str, str] | None = None) -> ClusterConfig:
    """Validate a config mapping merged with ``KVFENCE__`` overrides from ``environ``."""
    overrides, sources = _env_overrides(dict(os.environ) if environ is None else environ)
    merged = _merge(data, overrides)
    try:
        return ClusterConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(_describe(err, sources)) from None


def load_config(path: Path | str | None, environ: dict[str, str] | None = None) -> ClusterConfig:
    """Load ``path`` (YAML; None = defaults) and apply environment overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        data = loaded or {}
    return parse_config(data, environ)
