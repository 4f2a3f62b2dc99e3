"""What every kvfence gRPC service shares: health, reflection, rich errors, bearer tokens, shutdown.

Usage in a service::

    server = await GrpcServer.start(cfg.node.listen, [(add_DecodeServicer_to_server, servicer)],
                                    ["kvfence.v1.Decode"])
    ...
    await server.stop(grace=5)

``stop`` first flips health to NOT_SERVING (so load balancers drain), then lets in-flight RPCs
finish for ``grace`` seconds.

A server accepts messages of up to ``max_receive_bytes`` (MAX_MESSAGE_BYTES unless its caller
says less: the control plane's listeners do, control_plane.max_request_bytes); a larger one is
refused RESOURCE_EXHAUSTED by gRPC before any handler or credential check runs. Its reflection
describes only the services it serves (:func:`reflection_pool`).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvfence.errors import KvfenceError

Registrar = Callable[[Any, grpc.aio.Server], None]
T = TypeVar("T")

# Large enough for a manifest of a long prompt's pages; KV bytes themselves never travel over gRPC.
# What node listeners and every client channel accept. The control plane's listeners, which
# anyone who reaches them can send to before any credential is checked, accept less
# (control_plane.max_request_bytes): gRPC holds a whole message in memory before a handler runs.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC sets SO_REUSEPORT on Linux by default, which lets a second process bind a port that is
# already served: two control planes once shared one address and took turns answering. Without
# it a taken port fails to bind (BindError) instead.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]

# Keepalive of the clients' channels (kvfence.client): while a call is open the client pings the
# connection every KEEPALIVE_TIME_MS and drops it when a ping goes unanswered for
# KEEPALIVE_TIMEOUT_MS, so that a connection lost without a word (a NAT or load balancer
# forgetting it, a host gone) fails the call UNAVAILABLE instead of leaving it waiting for good:
# the clients set no deadline of their own. Pings go on however long the call sends nothing
# (max_pings_without_data 0): a request may wait silently in the admission queue.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000
# How often a server accepts a ping on a connection it has sent nothing on since. gRPC's default
# is once in 5 minutes, and after the third ping too soon it closes the connection with GOAWAY
# too_many_pings, failing the calls on it (UNAVAILABLE): below KEEPALIVE_TIME_MS, with room for
# timer jitter.
MIN_PING_INTERVAL_MS = 10_000


def client_channel_options() -> list[tuple[str, Any]]:
    """CHANNEL_OPTIONS with the clients' keepalive (above)."""
    return [
        *CHANNEL_OPTIONS,
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """SERVER_OPTIONS, accepting the clients' keepalive pings (MIN_PING_INTERVAL_MS) and
    messages of up to ``max_receive_bytes``."""
    return [
        *(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]


class BindError(OSError):
    """A server could not listen on its address (in use, not local, or unusable credentials)."""


@dataclass
class GrpcServer:
    """A started grpc.aio server with health and reflection."""

    server: grpc.aio.Server
    port: int
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    service_names: list[str]

    @classmethod
    async def start(
        cls,
        listen: str,
        servicers: Iterable[tuple[Registrar, Any]],
        service_names: list[str],
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
    ) -> GrpcServer:
        server = grpc.aio.server(
            options=server_options(max_receive_bytes), interceptors=list(interceptors)
        )
        for add, servicer in servicers:
            add(servicer, server)
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        served = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(served, server, pool=reflection_pool(served))
        try:
            port = _bind(server, listen, credentials)
        except BindError:
            await server.stop(None)
            raise
        await server.start()
        for name in ["", *service_names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return cls(server, port, health_servicer, list(service_names))

    async def stop(self, grace: float = 5.0) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)


def reflection_pool(service_names: Iterable[str]) -> descriptor_pool.DescriptorPool:
    """A descriptor pool describing ``service_names`` (those of them the process knows) and the
    message and enum types their methods use, and nothing else, for a listener's reflection.

    Reflection answers from the whole process's pool by default: the control plane's public port
    described the Admin service and the nodes' Decode and Prefill services to anyone, though it
    listed only its own. Whole files are not small enough either: control.proto holds both
    NodeRegistry (public port) and Admin (admin port), and decode.proto imports prefill.proto. So
    each file here is a copy of the original with only the services served and the top-level
    types reachable from their methods (through fields, transitively), and imports only the
    files that still hold one of those.
    """
    default = descriptor_pool.Default()
    services = []
    for name in service_names:
        try:
            services.append(default.FindServiceByName(name))
        except KeyError:
            continue  # not a service this process has compiled in: nothing to describe
    keep: dict[str, set[str]] = {}  # file name -> names of its top-level messages, enums, services
    files: dict[str, FileDescriptor] = {}
    seen: set[str] = set()

    def take(file: FileDescriptor, name: str) -> None:
        files[file.name] = file
        keep.setdefault(file.name, set()).add(name)

    def message(desc: Descriptor) -> None:
        while desc.containing_type is not None:  # a nested type comes with its top-level one
            desc = desc.containing_type
        if desc.full_name in seen:
            return
        seen.add(desc.full_name)
        take(desc.file, desc.name)
        pending = [desc]
        while pending:
            m = pending.pop()
            pending.extend(m.nested_types)
            for f in m.fields:
                if f.message_type is not None:
                    message(f.message_type)
                if f.enum_type is not None:
                    enum(f.enum_type)

    def enum(desc: EnumDescriptor) -> None:
        if desc.containing_type is not None:
            message(desc.containing_type)
        else:
            take(desc.file, desc.name)

    for service in services:
        take(service.file, service.name)
        for method in service.methods:
            message(method.input_type)
            message(method.output_type)

    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        added.add(name)
        proto = descriptor_pb2.FileDescriptorProto()
        files[name].CopyToProto(proto)
        names = keep[name]
        for field in ("message_type", "enum_type", "service"):
            kept = [d for d in getattr(proto, field) if d.name in names]
            proto.ClearField(field)  # type: ignore[arg-type]
            getattr(proto, field).extend(kept)
        # Imports of files that hold nothing kept go, and public / weak imports are renumbered.
        deps = list(proto.dependency)
        kept_deps = [d for d in deps if d in keep]
        renumber = {deps.index(d): i for i, d in enumerate(kept_deps)}
        public = [renumber[i] for i in proto.public_dependency if i in renumber]
        weak = [renumber[i] for i in proto.weak_dependency if i in renumber]
        for field in ("dependency", "public_dependency", "weak_dependency"):
            proto.ClearField(field)  # type: ignore[arg-type]
        proto.dependency.extend(kept_deps)
        proto.public_dependency.extend(public)
        proto.weak_dependency.extend(weak)
        for dep in kept_deps:  # a file's imports must be in the pool before it
            add(dep)
        pool.Add(proto)

    for name in sorted(keep):
        add(name)
    return pool


def _bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    """Add the listening port; a failure raises BindError naming ``listen``.

    grpc.aio raises RuntimeError("Failed to bind to address ...") when the address is taken or
    cannot be bound (older releases returned 0 instead); both become BindError.
    """
    detail = ""
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError as err:
        port, detail = 0, f" ({err})"
    if port == 0:
        raise BindError(
            f"cannot listen on {listen}: the address is in use by another process or cannot be "
            f"bound here{detail}"
        )
    return int(port)


def host_of(listen: str) -> str:
    host = listen.rsplit(":", 1)[0]
    return "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host


def bearer_token(context: grpc.aio.ServicerContext) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, if present."""
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


async def abort(context: grpc.aio.ServicerContext, err: KvfenceError) -> NoReturn:
    """End the RPC with ``err``'s status code, message and ErrorInfo."""
    await context.abort_with_status(err.to_status())  # type: ignore[attr-defined]
    raise AssertionError("unreachable")  # abort_with_status always raises


def install_shutdown_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set ``stop`` so the service can shut down gracefully."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def take_ready(queue: asyncio.Queue[T], joins: Callable[[T], bool]) -> tuple[list[T], T | None]:
    """The items already waiting in ``queue`` for which ``joins`` holds, in order, and the first
    waiting item for which it does not (taken as well), or None. Never waits.

    A stream writer uses it to send what piled up behind one message in a single write: with many
    streams on one event loop, a write per token is what limits throughput, and when the reader
    keeps up the queue is empty and nothing changes.
    """
    taken: list[T] = []
    while not queue.empty():
        item = queue.get_nowait()
        if not joins(item):
            return taken, item
        taken.append(item)
    return taken, None
