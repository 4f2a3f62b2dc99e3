"""gRPC credentials from PEM files: TLS on the public endpoint, mutual TLS between services.

What each covers: the public endpoint (Generation, the node registry, and the admin port) is
server-authenticated TLS: a node's Register / Heartbeat are authenticated by the node token it
carries, over that TLS, with no client certificate asked for. Mutual TLS covers the control
plane's calls to nodes (Reserve, Prefill, Decode, Release, Stats). The KV pages themselves go
prefill -> decode over UCX, which none of this encrypts.

Files are read once, when the credentials are built; a missing, unreadable or non-PEM file raises
:class:`TlsError` naming the file and the setting it came from, instead of gRPC's opaque handshake
failure later.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from kvfence.config import REGISTRY_IN_CLEAR, ConfigError, TlsConfig

PathLike = Path | str


class TlsError(ConfigError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


def read_pem(path: PathLike, what: str) -> bytes:
    """The bytes of PEM file ``path``; ``what`` says which setting it is (for the error message)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{what} file {p} does not exist") from None
    except IsADirectoryError:
        raise TlsError(f"{what} file {p} is a directory, not a PEM file") from None
    except OSError as err:
        raise TlsError(f"{what} file {p} cannot be read: {err.strerror}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{what} file {p} is not PEM (no '-----BEGIN' line)")
    return data


def server_credentials(
    cert: PathLike, key: PathLike, client_ca: PathLike | None = None
) -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca`` clients must present a cert it signed (mTLS)."""
    pair = (read_pem(key, "TLS key"), read_pem(cert, "TLS certificate"))
    if client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=read_pem(client_ca, "client CA"), require_client_auth=True
    )


def channel_credentials(
    ca: PathLike, cert: PathLike | None = None, key: PathLike | None = None
) -> grpc.ChannelCredentials:
    """Channel credentials trusting ``ca``; ``cert`` and ``key`` (both or neither) for mTLS."""
    if (cert is None) != (key is None):
        raise TlsError("a client certificate needs its key and a key needs its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "CA"),
        private_key=None if key is None else read_pem(key, "client key"),
        certificate_chain=None if cert is None else read_pem(cert, "client certificate"),
    )


def public_server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """Credentials for the public endpoint; None when ``tls.public_cert/key`` are not set."""
    if tls.public_cert is None and tls.public_key is None:
        return None
    if tls.public_cert is None or tls.public_key is None:
        raise TlsError("tls.public_cert and tls.public_key must be set together")
    return server_credentials(tls.public_cert, tls.public_key)


def _internal_files(tls: TlsConfig) -> tuple[Path, Path, Path] | None:
    files = (tls.internal_ca, tls.internal_cert, tls.internal_key)
    if all(f is None for f in files):
        return None
    if tls.internal_ca is None or tls.internal_cert is None or tls.internal_key is None:
        raise TlsError(
            "tls.internal_ca, tls.internal_cert and tls.internal_key must be set together"
        )
    return tls.internal_ca, tls.internal_cert, tls.internal_key


def internal_server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """Mutual-TLS credentials for a service-to-service listener; None when not configured."""
    files = _internal_files(tls)
    if files is None:
        return None
    ca, cert, key = files
    return server_credentials(cert, key, client_ca=ca)


def internal_channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """Mutual-TLS credentials for calling another service; None when not configured."""
    files = _internal_files(tls)
    if files is None:
        return None
    ca, cert, key = files
    return channel_credentials(ca, cert, key)


def registry_channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """How a node reaches the control plane's registry (served on the public listener): TLS
    trusting the internal CA when the public endpoint has TLS (with the node's own certificate when
    one is set), plaintext when no TLS is configured at all. Internal mTLS without public TLS is an
    error, not plaintext: the node token would go out in clear while the operator believes
    service-to-service traffic is protected (a loaded config refuses it already)."""
    if tls.public_cert is None:
        if any(f is not None for f in (tls.internal_ca, tls.internal_cert, tls.internal_key)):
            raise TlsError(REGISTRY_IN_CLEAR)
        return None
    if tls.internal_ca is None:
        raise TlsError("tls.public_cert is set: nodes need tls.internal_ca to verify it")
    return channel_credentials(tls.internal_ca, tls.internal_cert, tls.internal_key)
