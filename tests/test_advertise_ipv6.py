"""A node's advertised gRPC address on an IPv6 pod.

Kubernetes can only build the address by substitution, ``$(POD_IP):port`` (the Helm chart does), so
on an IPv6-only cluster the node receives ``fd00::1:50061``. gRPC reads an unbracketed address with
several colons as a host without a port and fails to resolve it, so the control plane could never
reach such a node. The config brackets an IPv6 literal host: ``[fd00::1]:50061``.
"""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfence.config import parse_config
from kvfence.server import GrpcServer


def advertise(value: str) -> str:
    return parse_config({}, environ={"KVFENCE__NODE__ADVERTISE": value}).node.advertise


def test_bare_ipv6_pod_ip_is_bracketed() -> None:
    assert advertise("fd00::1:50061") == "[fd00::1]:50061"
    assert advertise("2001:db8::7:13437") == "[2001:db8::7]:13437"
    assert advertise("::1:50071") == "[::1]:50071"


@pytest.mark.parametrize(
    "value",
    [
        "10.1.2.3:50061",  # an IPv4 pod: as before
        "decode-0.kvfence.svc:50071",  # a DNS name
        "[fd00::1]:50061",  # already bracketed
        "dns:///decode.svc:50071",  # a gRPC target URI is not a host
        "",  # unset: the node advertises its bound listen address
    ],
)
def test_other_addresses_are_kept_as_written(value: str) -> None:
    # Positive control: only an IPv6 literal host is rewritten.
    assert advertise(value) == value


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def _health(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=3
        )
    return int(reply.status)


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_the_advertised_ipv6_address_reaches_the_node() -> None:
    # The chart's listen address (0.0.0.0 is gRPC's dual-stack wildcard) and its advertise value
    # as Kubernetes expands it on an IPv6 pod, with ::1 standing in for the pod IP.
    server = await GrpcServer.start("0.0.0.0:0", [], ["kvfence.v1.Test"])
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        # control: the same server over IPv4, and the bracketed form itself
        assert await _health(f"127.0.0.1:{server.port}") == serving
        assert await _health(f"[::1]:{server.port}") == serving
        # what the control plane dials: the node's advertise address after config parsing
        assert await _health(advertise(f"::1:{server.port}")) == serving
    finally:
        await server.stop(grace=0)
