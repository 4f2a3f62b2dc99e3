"""Calls the control plane refuses for their credential are counted and logged, throttled.

A wrong node token on Register / Heartbeat and a wrong admin token (or none, or a tenant API key)
on the admin API used to leave no trace: no log line, no metric. Each is now counted in
``kvfence_auth_failures_total{listener, method, status}`` and logged without the credential: the
first refusal on a listener at once, later ones at most one line per interval (``BurstLog``),
which counts the refusals since the last. Controls: the right token counts and logs nothing.

Every call goes to the cluster's own listeners: Register, Heartbeat, Generate and ListModels to
the public one, the admin API to the admin one; the counts are read from the metrics the control
plane serves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from asyncwait import eventually
from cp_harness import Cluster
from structlog.testing import capture_logs

from kvfence.auth import bearer_metadata
from kvfence.errors import KvfenceError
from kvfence.metrics import AUTH_FAILURE_LOG_INTERVAL_S, Metrics
from kvfence.proto.kvfence.v1 import control_pb2, control_pb2_grpc

WRONG_NODE_TOKEN = "kvfn_" + "w" * 43
WRONG_ADMIN_TOKEN = "kvfa_" + "w" * 43
N = 50  # refusals in a burst: far fewer than one interval's worth of time


def failures(metrics: Metrics, listener: str, method: str, status: str) -> float:
    labels = {"service": metrics.service, "listener": listener, "method": method}
    value = metrics.registry.get_sample_value(
        "kvfence_auth_failures_total", {**labels, "status": status}
    )
    return value or 0.0


def all_failures(metrics: Metrics) -> float:
    return sum(
        s.value
        for family in metrics.registry.collect()
        if family.name == "kvfence_auth_failures"
        for s in family.samples
        if s.name == "kvfence_auth_failures_total"
    )


def lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "credentials refused"]


@pytest.fixture
async def registry_stub(cluster: Cluster) -> AsyncIterator[control_pb2_grpc.NodeRegistryStub]:
    """The control plane's own public listener, where nodes register."""
    channel = grpc.aio.insecure_channel(cluster.target)
    try:
        yield control_pb2_grpc.NodeRegistryStub(channel)
    finally:
        await channel.close()


async def refused(call: Any, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code


async def test_wrong_node_tokens_are_counted_and_logged_once_per_interval(
    cluster: Cluster, registry_stub: control_pb2_grpc.NodeRegistryStub
) -> None:
    metrics = cluster.cp.metrics
    assert AUTH_FAILURE_LOG_INTERVAL_S >= 1.0 and metrics.auth_log_interval_s >= 1.0
    [decode] = cluster.decode
    register = decode.register_request()
    heartbeat = control_pb2.HeartbeatRequest(node_id=decode.node_id)
    nodes = cluster.cp.registry.nodes()
    with capture_logs() as logs:
        await refused(registry_stub.Register(register, metadata=bearer_metadata(WRONG_NODE_TOKEN)))
        # the first refusal is logged at once, with the peer, without the token
        [first] = lines(logs)
        assert first["refused"] == 1 and first["listener"] == "public"
        assert first["method"] == "Register" and first["reason"] == "wrong node token"
        assert first["status"] == "UNAUTHENTICATED" and first["peer"].startswith("ipv4:127.0.0.1:")
        assert first["log_level"] == "warning"
        for i in range(N - 1):
            if i % 2:
                await refused(registry_stub.Register(register))  # no token at all
            else:
                md = bearer_metadata(WRONG_NODE_TOKEN)
                await refused(registry_stub.Heartbeat(heartbeat, metadata=md))
        # the rest of the burst is not logged call by call (Heartbeat's first is: each method
        # has its own line), but counted, every one
        assert [(e["method"], e["refused"]) for e in lines(logs)] == [
            ("Register", 1),
            ("Heartbeat", 1),
        ]
        assert failures(metrics, "public", "Register", "UNAUTHENTICATED") == 1 + (N - 1) // 2
        assert failures(metrics, "public", "Heartbeat", "UNAUTHENTICATED") == N // 2
        metrics.flush_auth_log()  # what the timer does when the interval is over
        metrics.flush_auth_log()  # nothing new since: no line
    assert [(e["method"], e["refused"]) for e in lines(logs)[2:]] in (
        [("Register", (N - 1) // 2), ("Heartbeat", N // 2 - 1)],
        [("Heartbeat", N // 2 - 1), ("Register", (N - 1) // 2)],
    )
    assert cluster.cp.registry.nodes() == nodes  # nothing was registered or refreshed
    assert all(WRONG_NODE_TOKEN not in str(e) for e in logs)
    assert WRONG_NODE_TOKEN not in metrics.render().decode()


async def test_the_node_token_registers_and_counts_nothing(
    cluster: Cluster, registry_stub: control_pb2_grpc.NodeRegistryStub
) -> None:
    """Control: the same calls with the node token are served; nothing counted or logged."""
    [decode] = cluster.decode
    md = bearer_metadata(cluster.cp.node_token)
    with capture_logs() as logs:
        assert (await registry_stub.Register(decode.register_request(), metadata=md)).accepted
        beat = control_pb2.HeartbeatRequest(node_id=decode.node_id)
        assert (await registry_stub.Heartbeat(beat, metadata=md)).known
        cluster.cp.metrics.flush_auth_log()
    assert lines(logs) == [] and all_failures(cluster.cp.metrics) == 0


async def test_refused_admin_credentials_are_counted_and_logged_once_per_interval(
    cluster: Cluster,
) -> None:
    metrics = cluster.cp.metrics
    admin, wrong = cluster.admin(WRONG_ADMIN_TOKEN)
    _, tenant_key = cluster.admin(cluster.api_key)
    with capture_logs() as logs:
        await refused(admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=wrong))
        [first] = lines(logs)
        assert first["refused"] == 1 and first["listener"] == "admin"
        assert first["method"] == "ListTenants" and first["reason"] == "wrong admin token"
        for _ in range(N - 3):
            await refused(admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=wrong))
        await refused(admin.CheckConfig(control_pb2.CheckConfigRequest()))  # no token
        # a live tenant key is answered PERMISSION_DENIED, and counted too
        denied = grpc.StatusCode.PERMISSION_DENIED
        await refused(admin.CreateKey(control_pb2.CreateKeyRequest(), metadata=tenant_key), denied)
        # each method's first refusal at once, ListTenants' later ones not yet
        assert [(e["method"], e["refused"]) for e in lines(logs)] == [
            ("ListTenants", 1),
            ("CheckConfig", 1),
            ("CreateKey", 1),
        ]
        metrics.flush_auth_log()
    assert [(e["method"], e["refused"]) for e in lines(logs)[3:]] == [("ListTenants", N - 3)]
    last = lines(logs)[2]
    assert last["method"] == "CreateKey" and last["status"] == "PERMISSION_DENIED"
    assert last["reason"] == "a tenant API key"
    assert failures(metrics, "admin", "ListTenants", "UNAUTHENTICATED") == N - 2
    assert failures(metrics, "admin", "CheckConfig", "UNAUTHENTICATED") == 1
    assert failures(metrics, "admin", "CreateKey", "PERMISSION_DENIED") == 1
    assert all(WRONG_ADMIN_TOKEN not in str(e) and cluster.api_key not in str(e) for e in logs)
    text = metrics.render().decode()
    assert WRONG_ADMIN_TOKEN not in text and cluster.api_key not in text


async def test_refused_api_keys_are_counted_and_logged_on_the_public_listener(
    cluster: Cluster,
) -> None:
    """Generate and ListModels without a valid API key: counted per method, logged once per
    interval, the key nowhere. Control: the tenant's key is served and adds nothing."""
    metrics = cluster.cp.metrics
    wrong = "kvf_" + "w" * 43
    with capture_logs() as logs:
        for client in (cluster.client(wrong), cluster.client("")):
            with pytest.raises(KvfenceError) as err:
                await client.generate(prompt_ids=[10, 11], max_new_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(KvfenceError):
            await cluster.client(wrong).list_models()
        first, models = lines(logs)  # the second Generate waits for Generate's next line
        assert (first["method"], first["reason"]) == ("Generate", "wrong or revoked API key")
        assert (models["method"], models["refused"]) == ("ListModels", 1)
        # control: the tenant's key
        assert (await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=2)).token_ids
        assert await cluster.client().list_models()
        metrics.flush_auth_log()
    assert [(e["method"], e["refused"]) for e in lines(logs)[2:]] == [("Generate", 1)]
    assert lines(logs)[2]["reason"] == "no API key"
    assert failures(metrics, "public", "Generate", "UNAUTHENTICATED") == 2
    assert failures(metrics, "public", "ListModels", "UNAUTHENTICATED") == 1
    assert all_failures(metrics) == 3
    assert all(wrong not in str(e) for e in logs) and wrong not in metrics.render().decode()


async def test_junk_api_keys_do_not_hide_a_wrong_node_token_from_the_log() -> None:
    """Anyone can send Generate with junk keys: with one log line per listener, a flood of them
    kept the public listener's line busy and a Register with a wrong node token was only ever
    named in the metric. Each method has its own line: Register's first is logged at once.
    Control: the Generate flood itself is logged once, then counted."""
    metrics = Metrics("control-plane", auth_log_interval_s=60.0)
    peer = "ipv4:10.0.0.9:5555"
    with capture_logs() as logs:
        for _ in range(N):
            metrics.credential_refused(
                listener="public", method="Generate", status="UNAUTHENTICATED",
                reason="wrong or revoked API key", peer=peer,
            )  # fmt: skip
        metrics.credential_refused(
            listener="public", method="Register", status="UNAUTHENTICATED",
            reason="wrong node token", peer="ipv4:10.0.0.7:4444",
        )  # fmt: skip
    assert [(e["method"], e["refused"]) for e in lines(logs)] == [("Generate", 1), ("Register", 1)]
    assert lines(logs)[1]["peer"] == "ipv4:10.0.0.7:4444"
    assert failures(metrics, "public", "Generate", "UNAUTHENTICATED") == N


async def test_the_admin_token_counts_nothing(cluster: Cluster) -> None:
    """Control: the admin token is served on the same methods; nothing counted or logged."""
    admin, auth = cluster.admin()
    with capture_logs() as logs:
        assert (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=auth)).tenants
        assert (await admin.CheckConfig(control_pb2.CheckConfigRequest(), metadata=auth)).ok
        cluster.cp.metrics.flush_auth_log()
    assert lines(logs) == [] and all_failures(cluster.cp.metrics) == 0


async def test_the_rest_of_a_burst_is_logged_by_the_timer_per_listener() -> None:
    """What Generate's refusals are to use too: no later refusal is needed to log the rest of a
    burst, and a flood on one listener does not fold another's refusals into its count."""
    metrics = Metrics("control-plane", auth_log_interval_s=0.2)
    peer = "ipv4:10.0.0.9:5555"
    with capture_logs() as logs:
        for _ in range(N):
            metrics.credential_refused(
                listener="public", method="Generate", status="UNAUTHENTICATED",
                reason="wrong API key", peer=peer,
            )  # fmt: skip
        metrics.credential_refused(
            listener="admin", method="ListTenants", status="UNAUTHENTICATED",
            reason="wrong admin token", peer=peer,
        )  # fmt: skip
        assert await eventually(lambda: sum(e["refused"] for e in lines(logs)) >= N + 1)
    public = [e for e in lines(logs) if e["listener"] == "public"]
    admin = [e for e in lines(logs) if e["listener"] == "admin"]
    assert [e["refused"] for e in public] == [1, N - 1]
    assert [(e["refused"], e["method"]) for e in admin] == [(1, "ListTenants")]
    assert failures(metrics, "public", "Generate", "UNAUTHENTICATED") == N
    with pytest.raises(ValueError):  # the listener label is a fixed set
        metrics.credential_refused(
            listener="elsewhere", method="Generate", status="UNAUTHENTICATED", reason="x", peer=peer
        )
