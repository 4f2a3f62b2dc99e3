"""Each listener's reflection describes the services it serves, and no others.

Reflection answered from the process's whole descriptor pool: the control plane's public port
listed only Generation and NodeRegistry, but resolved kvfence.v1.Admin, Decode and Prefill with
their full method lists for anyone. NodeRegistry and Admin share control.proto, and decode.proto
imports prefill.proto, so whole files would still have told. Each check here has its control:
the listener resolves its own services, every method in place, in descriptors a client can load.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import structlog
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

# The control plane harness lives with the control-plane tests.
sys.path.insert(0, str(Path(__file__).parent / "control_plane"))
from cp_harness import Cluster, make_cluster

from kvfence.proto.kvfence.v1 import (
    client_pb2,
    control_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvfence.server import GrpcServer

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
SERVICES = {
    "kvfence.v1.Generation": client_pb2.DESCRIPTOR.services_by_name["Generation"],
    "kvfence.v1.NodeRegistry": control_pb2.DESCRIPTOR.services_by_name["NodeRegistry"],
    "kvfence.v1.Admin": control_pb2.DESCRIPTOR.services_by_name["Admin"],
    "kvfence.v1.Decode": decode_pb2.DESCRIPTOR.services_by_name["Decode"],
    "kvfence.v1.Prefill": prefill_pb2.DESCRIPTOR.services_by_name["Prefill"],
}
# A message only the Admin service uses: its schema is no business of the public port either.
ADMIN_ONLY_MESSAGE = "kvfence.v1.CreateTenantRequest"


class Reflection:
    def __init__(self, channel: grpc.aio.Channel):
        self.stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def ask(self, **request: str) -> reflection_pb2.ServerReflectionResponse:
        async for reply in self.stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=5
        ):
            return reply
        raise AssertionError("no reflection reply")

    async def services(self) -> set[str]:
        reply = await self.ask(list_services="")
        return {s.name for s in reply.list_services_response.service}

    async def files(self, **request: str) -> list[descriptor_pb2.FileDescriptorProto] | None:
        """The files a file_containing_symbol / file_by_filename request returns, None if none."""
        reply = await self.ask(**request)
        if not reply.HasField("file_descriptor_response"):
            assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
            return None
        return [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in reply.file_descriptor_response.file_descriptor_proto
        ]

    async def methods(self, service: str) -> list[str] | None:
        """The methods of ``service`` as a client learns them: the returned files loaded into a
        pool of its own (every import among them), or None if the service does not resolve."""
        files = await self.files(file_containing_symbol=service)
        if files is None:
            return None
        pool = descriptor_pool.DescriptorPool()
        by_name = {f.name: f for f in files}

        def add(name: str) -> None:
            for dep in by_name[name].dependency:
                add(dep)
            try:
                pool.FindFileByName(name)
            except KeyError:
                pool.Add(by_name[name])

        for name in by_name:
            add(name)
        return [m.name for m in pool.FindServiceByName(service).methods]


async def check_scope(port: int, own: list[str]) -> None:
    """The listener on ``port`` lists and resolves ``own`` (with health and reflection), every
    method in place, and resolves none of the other kvfence services."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reflection = Reflection(channel)
        assert await reflection.services() == {*own, HEALTH, REFLECTION}
        for name, service in SERVICES.items():
            want = [m.name for m in service.methods] if name in own else None
            assert await reflection.methods(name) == want, name
        health = health_pb2.DESCRIPTOR.services_by_name["Health"]
        assert await reflection.methods(HEALTH) == [m.name for m in health.methods]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    structlog.reset_defaults()
    c = await make_cluster(tmp_path)
    yield c
    await c.close()


async def test_the_public_port_describes_only_its_own_services(cluster: Cluster) -> None:
    await check_scope(cluster.ports.public, ["kvfence.v1.Generation", "kvfence.v1.NodeRegistry"])
    async with grpc.aio.insecure_channel(cluster.target) as channel:
        reflection = Reflection(channel)
        assert await reflection.files(file_containing_symbol=ADMIN_ONLY_MESSAGE) is None
        # control.proto by name: NodeRegistry and its messages, not Admin's
        [control] = [
            f
            for f in await reflection.files(file_by_filename="kvfence/v1/control.proto") or []
            if f.name == "kvfence/v1/control.proto"
        ]
        assert [s.name for s in control.service] == ["NodeRegistry"]
        messages = {m.name for m in control.message_type}
        assert {"RegisterRequest", "HeartbeatRequest"} <= messages
        assert "CreateTenantRequest" not in messages


async def test_the_admin_port_describes_the_admin_service(cluster: Cluster) -> None:
    await check_scope(cluster.ports.admin, ["kvfence.v1.Admin"])
    async with grpc.aio.insecure_channel(cluster.admin_target) as channel:
        files = await Reflection(channel).files(file_containing_symbol=ADMIN_ONLY_MESSAGE)
        assert files is not None and files[0].name == "kvfence/v1/control.proto"


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_a_node_listener_describes_its_own_service(role: str) -> None:
    """decode.proto imports prefill.proto: a decode node serves the messages it uses from it,
    not the Prefill service."""
    if role == "decode":
        added = (decode_pb2_grpc.add_DecodeServicer_to_server, decode_pb2_grpc.DecodeServicer())
        name = "kvfence.v1.Decode"
    else:
        added = (prefill_pb2_grpc.add_PrefillServicer_to_server, prefill_pb2_grpc.PrefillServicer())
        name = "kvfence.v1.Prefill"
    server = await GrpcServer.start("127.0.0.1:0", [added], [name])
    try:
        await check_scope(server.port, [name])
    finally:
        await server.stop(grace=0)
