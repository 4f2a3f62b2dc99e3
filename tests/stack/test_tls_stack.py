"""TLS on the public endpoint and mutual TLS between services, across real processes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack_harness import Cluster
from stack_starts import seed_embedded_model
from test_tls import make_ca, make_leaf

from kvfence.client import Client
from kvfence.errors import Unavailable
from kvfence.tls import channel_credentials

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "public", "ca", "serverAuth")
    make_leaf(d, "node", "ca", "serverAuth,clientAuth")
    make_leaf(d, "intruder", "other-ca", "serverAuth,clientAuth")
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pki):
    tls = {
        "public_cert": str(pki / "public.pem"),
        "public_key": str(pki / "public.key"),
        "internal_ca": str(pki / "ca.pem"),
        "internal_cert": str(pki / "node.pem"),
        "internal_key": str(pki / "node.key"),
    }
    c = Cluster(seed_embedded_model(tmp_path_factory.mktemp("tls")), config={"tls": tls})
    c.tls_ca = pki / "ca.pem"
    c.start()
    c.key = c.create_tenant("tenant-a")
    yield c
    c.stop()


def test_public_tls_with_the_right_ca(cluster, pki):
    with cluster.client(cluster.key) as c:
        assert (
            len(c.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, ignore_eos=True).token_ids) == 3
        )
    # the wrong CA, or plaintext, cannot talk to the public endpoint
    wrong = Client(cluster.target, cluster.key, tls_ca=pki / "other-ca.pem", timeout=5)
    with wrong, pytest.raises(Unavailable):
        wrong.list_models()
    with grpc.insecure_channel(cluster.target) as ch, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def node_health(address: str, creds: grpc.ChannelCredentials | None) -> int:
    ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with ch:
        return (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        )


def test_nodes_require_client_certificates_from_the_internal_ca(cluster, pki):
    with cluster.admin() as admin:
        nodes = admin.list_nodes().nodes
    assert {n.role for n in nodes} == {"prefill", "decode"}
    ca = pki / "ca.pem"
    for node in nodes:
        good = channel_credentials(ca, pki / "node.pem", pki / "node.key")
        assert node_health(node.grpc_address, good) == health_pb2.HealthCheckResponse.SERVING
        for creds in (
            channel_credentials(ca),  # TLS but no client certificate
            channel_credentials(ca, pki / "intruder.pem", pki / "intruder.key"),  # other CA
            None,  # plaintext
        ):
            with pytest.raises(grpc.RpcError):
                node_health(node.grpc_address, creds)
