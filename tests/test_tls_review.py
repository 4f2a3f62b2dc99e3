"""TLS review fixes.

- Internal mutual TLS without public TLS is refused: the node registry is served on the public
  listener, so the nodes' Register / Heartbeat, node token included, would go out in clear while
  the operator believes service-to-service traffic is protected.
- ``tls.internal_server_name``: the control plane verifies every node's certificate against that
  name instead of the host it dials (a node's advertised pod IP, which one certificate shared by
  every pod cannot name); unset, the dialled host as before.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_tls import make_ca, make_leaf

sys.path.insert(0, str(Path(__file__).parent / "control_plane"))
from cp_fakes import (
    FINGERPRINT,
    TEXT_FINGERPRINT,
    EventRecorder,
    make_layout,
    make_model_info,
)

from control_plane.registry import Node
from control_plane.routing import NodeClients
from control_plane.service import ControlPlane
from kvfence import PROTOCOL_VERSION
from kvfence.auth import bearer_metadata
from kvfence.config import ConfigError, TlsConfig, parse_config
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    decode_pb2_grpc,
    prefill_pb2,
)
from kvfence.server import GrpcServer
from kvfence.tls import (
    TlsError,
    internal_channel_credentials,
    internal_server_credentials,
    registry_channel_credentials,
)

NODE_NAME = "kv-kvfence-node.serving.svc"  # what the chart's shared internal.crt names
TOKEN = "kvfn_test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_leaf(d, "public", "ca", "serverAuth")
    make_leaf(d, "cp", "ca", "serverAuth,clientAuth")
    # What a Secret shared by every pod can hold: a name, no pod IP (the node is dialled by IP).
    make_leaf(d, "shared", "ca", "serverAuth,clientAuth", san=f"DNS:{NODE_NAME}")
    return d


def internal(pki: Path, leaf: str) -> dict[str, str]:
    return {
        "internal_ca": str(pki / "ca.pem"),
        "internal_cert": str(pki / f"{leaf}.pem"),
        "internal_key": str(pki / f"{leaf}.key"),
    }


def public(pki: Path) -> dict[str, str]:
    return {"public_cert": str(pki / "public.pem"), "public_key": str(pki / "public.key")}


# --- F1: internal mTLS alone would send the node token to the registry in clear ----------------


def test_config_refuses_internal_mtls_without_public_tls(pki: Path) -> None:
    with pytest.raises(ConfigError, match="node token would travel there in clear") as err:
        parse_config({"tls": internal(pki, "shared")}, environ={})
    assert "tls.public_cert and tls.public_key" in str(err.value)
    # the variable that completed the internal set is named, as for the other cross-key checks
    with pytest.raises(ConfigError, match=re.escape("(from KVFENCE__TLS__INTERNAL_KEY)")):
        parse_config(
            {"tls": {k: v for k, v in internal(pki, "shared").items() if k != "internal_key"}},
            environ={"KVFENCE__TLS__INTERNAL_KEY": str(pki / "shared.key")},
        )
    # controls: no TLS at all, public TLS alone, and both, all load
    assert parse_config({}, environ={}).tls == TlsConfig()
    assert parse_config({"tls": public(pki)}, environ={}).tls.internal_ca is None
    both = parse_config({"tls": {**public(pki), **internal(pki, "shared")}}, environ={})
    assert both.tls.public_cert == pki / "public.pem"


def test_registry_credentials_never_fall_back_to_plaintext_under_mtls(pki: Path) -> None:
    """A TlsConfig built without the config-load check (directly) is refused where the node builds
    its registry channel too, instead of a plaintext channel."""
    only_internal = TlsConfig.model_validate(internal(pki, "shared"))
    with pytest.raises(TlsError, match="node token would travel there in clear"):
        registry_channel_credentials(only_internal)
    with pytest.raises(TlsError, match="node token would travel there in clear"):
        registry_channel_credentials(TlsConfig(internal_ca=pki / "ca.pem"))
    # controls: no TLS at all is plaintext by choice; with public TLS, TLS credentials
    assert registry_channel_credentials(TlsConfig()) is None
    full = TlsConfig.model_validate({**public(pki), **internal(pki, "shared")})
    assert isinstance(registry_channel_credentials(full), grpc.ChannelCredentials)


# --- F2: node certificates verified against tls.internal_server_name --------------------------


class StatsOnly(decode_pb2_grpc.DecodeServicer):
    async def Stats(self, request: Any, context: Any) -> prefill_pb2.NodeStats:
        return prefill_pb2.NodeStats(node_id="decode-0", role="decode")


@pytest.fixture
async def shared_cert_node(pki: Path) -> AsyncIterator[int]:
    """A decode node serving mutual TLS with the shared certificate, on 127.0.0.1."""
    creds = internal_server_credentials(TlsConfig.model_validate(internal(pki, "shared")))
    server = await GrpcServer.start(
        "127.0.0.1:0",
        [(decode_pb2_grpc.add_DecodeServicer_to_server, StatsOnly())],
        ["kvfence.v1.Decode"],
        credentials=creds,
    )
    yield server.port
    await server.stop(0)


async def stats(clients: NodeClients, node: Node) -> prefill_pb2.NodeStats:
    try:
        return await clients.decode(node).Stats(prefill_pb2.StatsRequest(), timeout=5)
    finally:
        await clients.close()


def fake_node(port: int) -> Node:
    return Node("decode-0", "decode", f"127.0.0.1:{port}", "", "fp", common_pb2.KvLayout(), 1, 1, 1)


@pytest.mark.parametrize(
    ("server_name", "reached"),
    [(NODE_NAME, True), (None, False), ("other-release-node.serving.svc", False)],
    ids=["the-name-it-carries", "unset-verifies-the-dialled-ip", "another-name"],
)
async def test_node_certificate_is_verified_against_internal_server_name(
    pki: Path, shared_cert_node: int, server_name: str | None, reached: bool
) -> None:
    creds = internal_channel_credentials(TlsConfig.model_validate(internal(pki, "cp")))
    clients = NodeClients(TOKEN, creds, tls_server_name=server_name)
    node = fake_node(shared_cert_node)
    if reached:
        assert (await stats(clients, node)).node_id == "decode-0"
        return
    # the override names what to verify, it does not turn verification off
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stats(clients, node)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_internal_server_name_is_a_name_and_needs_internal_tls(pki: Path) -> None:
    for bad in ("", "two words", "*.wildcard.svc", "host:50071"):
        with pytest.raises(ConfigError, match=re.escape("tls.internal_server_name")):
            parse_config({"tls": {**internal(pki, "shared"), "internal_server_name": bad}}, {})
    with pytest.raises(ConfigError, match="internal_server_name without internal_ca"):
        parse_config({"tls": {**public(pki), "internal_server_name": NODE_NAME}}, environ={})
    ok = {**public(pki), **internal(pki, "shared"), "internal_server_name": NODE_NAME}
    assert parse_config({"tls": ok}, environ={}).tls.internal_server_name == NODE_NAME


def register_request(port: int) -> control_pb2.RegisterRequest:
    return control_pb2.RegisterRequest(
        node_id="decode-0",
        role="decode",
        grpc_address=f"127.0.0.1:{port}",
        ucx_address="127.0.0.1:2",
        model_fingerprint=FINGERPRINT,
        text_fingerprint=TEXT_FINGERPRINT,
        layout=make_layout(),
        pool_tokens=4096,
        total_pages=256,
        instance_id="i-decode-0",
        protocol_version=PROTOCOL_VERSION,
    )


@pytest.mark.parametrize("configured", [True, False], ids=["name-set", "name-unset"])
async def test_control_plane_calls_a_registered_node_with_the_configured_name(
    pki: Path, tmp_path: Path, shared_cert_node: int, configured: bool
) -> None:
    """The control plane's own node channels take tls.internal_server_name from its config: a
    node registered at its IP, with the shared certificate, is reached only with it set."""
    tls: dict[str, str] = {**public(pki), **internal(pki, "cp")}
    if configured:
        tls["internal_server_name"] = NODE_NAME
    cfg = parse_config(
        {
            "model": {"name": "test-model"},
            "control_plane": {
                "listen": "127.0.0.1:0",
                "admin_listen": "127.0.0.1:0",
                "state_dir": str(tmp_path / "state"),
            },
            "tls": tls,
        },
        environ={},
    )
    cp = ControlPlane(cfg, model_info=make_model_info(256), events=EventRecorder())
    ports = await cp.start()
    try:
        registry_creds = registry_channel_credentials(cfg.tls)
        assert registry_creds is not None
        async with grpc.aio.secure_channel(f"127.0.0.1:{ports.public}", registry_creds) as ch:
            reply = await control_pb2_grpc.NodeRegistryStub(ch).Register(
                register_request(shared_cert_node), metadata=bearer_metadata(cp.node_token)
            )
        assert reply.accepted
        [node] = cp.registry.nodes("decode")
        call = cp.clients.decode(node).Stats(prefill_pb2.StatsRequest(), timeout=5)
        if configured:
            assert (await call).node_id == "decode-0"
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await cp.stop(grace=0.1)
