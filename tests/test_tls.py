"""TLS and mutual TLS credentials against a real grpc.aio server (the health service)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # no stub

from kvfence.config import TlsConfig
from kvfence.tls import (
    TlsError,
    channel_credentials,
    internal_channel_credentials,
    internal_server_credentials,
    public_server_credentials,
    server_credentials,
)

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    openssl(
        "req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d,
    )  # fmt: skip


def make_leaf(
    d: Path, name: str, ca: str, usage: str, san: str = "DNS:localhost,IP:127.0.0.1"
) -> None:
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
            cwd=d)  # fmt: skip
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name, cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca/server/client from one CA; other-ca/other-client from a second, unrelated one."""
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", "serverAuth")
    make_leaf(d, "client", "ca", "clientAuth")
    make_leaf(d, "other-client", "other-ca", "clientAuth")
    return d


async def check_health(port: int, creds: grpc.ChannelCredentials) -> bool:
    """True when a Health.Check over ``creds`` succeeds; False on a handshake failure."""
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            return False
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return True


async def start_server(creds: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    servicer = health_aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


async def test_tls_accepts_the_right_ca_and_rejects_another(pki: Path) -> None:
    server, port = await start_server(server_credentials(pki / "server.pem", pki / "server.key"))
    try:
        assert await check_health(port, channel_credentials(pki / "ca.pem"))
        assert not await check_health(port, channel_credentials(pki / "other-ca.pem"))
    finally:
        await server.stop(None)


async def test_mutual_tls_requires_a_client_cert_from_the_ca(pki: Path) -> None:
    creds = server_credentials(pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem")
    server, port = await start_server(creds)
    try:
        good = channel_credentials(pki / "ca.pem", pki / "client.pem", pki / "client.key")
        assert await check_health(port, good)
        assert not await check_health(port, channel_credentials(pki / "ca.pem"))
        foreign = channel_credentials(
            pki / "ca.pem", pki / "other-client.pem", pki / "other-client.key"
        )
        assert not await check_health(port, foreign)
    finally:
        await server.stop(None)


async def test_internal_credentials_from_config_are_mutual(pki: Path) -> None:
    tls = TlsConfig(
        internal_ca=pki / "ca.pem",
        internal_cert=pki / "server.pem",
        internal_key=pki / "server.key",
    )
    server_creds = internal_server_credentials(tls)
    assert server_creds is not None
    server, port = await start_server(server_creds)
    try:
        client = TlsConfig(
            internal_ca=pki / "ca.pem",
            internal_cert=pki / "client.pem",
            internal_key=pki / "client.key",
        )
        client_creds = internal_channel_credentials(client)
        assert client_creds is not None
        assert await check_health(port, client_creds)
        assert not await check_health(port, channel_credentials(pki / "ca.pem"))
    finally:
        await server.stop(None)


def test_unset_config_gives_no_credentials() -> None:
    assert public_server_credentials(TlsConfig()) is None
    assert internal_server_credentials(TlsConfig()) is None
    assert internal_channel_credentials(TlsConfig()) is None


def test_partial_config_is_an_error(pki: Path) -> None:
    with pytest.raises(TlsError, match=re.escape("tls.public_cert and tls.public_key")):
        public_server_credentials(TlsConfig(public_cert=pki / "server.pem"))
    with pytest.raises(
        TlsError, match=re.escape("tls.internal_ca, tls.internal_cert and tls.internal_key")
    ):
        internal_channel_credentials(TlsConfig(internal_ca=pki / "ca.pem"))
    with pytest.raises(TlsError, match="needs its key"):
        channel_credentials(pki / "ca.pem", cert=pki / "client.pem")


def test_file_errors_name_the_file(pki: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsError, match=re.escape(f"TLS certificate file {missing} does not exist")):
        server_credentials(missing, pki / "server.key")
    with pytest.raises(TlsError, match=re.escape(f"CA file {tmp_path} is a directory")):
        channel_credentials(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsError, match=re.escape(f"client CA file {garbage} is not PEM")):
        server_credentials(pki / "server.pem", pki / "server.key", client_ca=garbage)
    unreadable = tmp_path / "locked.key"
    unreadable.write_text("-----BEGIN PRIVATE KEY-----\n")
    unreadable.chmod(0)
    try:
        unreadable.read_bytes()
    except PermissionError:
        with pytest.raises(TlsError, match=re.escape(f"TLS key file {unreadable} cannot be read")):
            server_credentials(pki / "server.pem", unreadable)
    # Paired control: the same call with good files builds credentials.
    assert server_credentials(pki / "server.pem", pki / "server.key") is not None
