"""Shared secrets of a cluster: the admin token (operators) and the node token (node registration
and every call to a node).

Each comes from a configured file (e.g. a Kubernetes Secret) when one is set; otherwise the first
process of the cluster to start (the control plane, or a node that starts before it on the same
machine) generates it into ``<state_dir>/<name>`` with mode 0600 and it is kept across restarts.
Nodes on the same machine (``kvfence up``) read the generated file; nodes elsewhere need the file
configured. Without the node token a process that can reach the control plane could register
itself as a decode node and be sent other tenants' KV, and one that can reach a node could reserve
its pages, run generations past the control plane's admission, or release other tenants' requests.
Both directions send it as ``authorization: Bearer <token>`` metadata (:func:`with_token`).
"""

from __future__ import annotations

import hmac
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

S = TypeVar("S")

ADMIN_TOKEN_FILE = "admin_token"
NODE_TOKEN_FILE = "node_token"


def read_token(path: Path) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def load_or_create_token(configured: Path | None, state_dir: Path, name: str, prefix: str) -> str:
    """The token in ``configured``, else the one in ``state_dir/name`` (created if missing)."""
    if configured is not None:
        return read_token(configured)
    path = Path(state_dir) / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        token = prefix + secrets.token_urlsafe(32)
        # O_EXCL + 0600: never readable by others, not even for a moment, and never overwritten.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process of the cluster made it first: theirs is the token
        else:
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            return token
    return _read_written(path)


def _read_written(path: Path, wait_s: float = 2.0) -> str:
    """``read_token``, waiting a moment for a file another process has created but not yet
    written."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return read_token(path)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def node_token_path(configured: Path | None, state_dir: Path) -> Path:
    return configured if configured is not None else Path(state_dir) / NODE_TOKEN_FILE


def load_node_token(configured: Path | None, state_dir: Path) -> str:
    """The cluster node token (``control_plane.node_token_file``, or the one generated under
    ``state_dir`` by whichever process of the cluster starts first): the control plane sends it
    to nodes, and nodes require it."""
    return load_or_create_token(configured, Path(state_dir), NODE_TOKEN_FILE, "kvfn_")


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``token`` as ``authorization: Bearer <token>``."""
    return (("authorization", f"Bearer {token}"),)


class _WithMetadata:
    """A stub method that sends fixed metadata (before any the caller passes) with every call."""

    __slots__ = ("_metadata", "_method")

    def __init__(self, method: Callable[..., Any], metadata: tuple[tuple[str, str], ...]):
        self._method = method
        self._metadata = metadata

    def __call__(self, request: Any, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        sent = self._metadata if metadata is None else (*self._metadata, *metadata)
        return self._method(request, *args, metadata=sent, **kwargs)


def with_token(stub: S, token: str) -> S:
    """``stub`` (a generated gRPC stub, sync or async) with every method sending ``token`` as a
    bearer token: how the control plane, and tests, call nodes."""
    metadata = bearer_metadata(token)
    for name, method in list(vars(stub).items()):
        if callable(method):
            setattr(stub, name, _WithMetadata(method, metadata))
    return stub
