"""Shared secrets of a cluster: the admin token (operators) and the node token (node registration).

Each comes from a configured file (e.g. a Kubernetes Secret) when one is set; otherwise the control
plane generates it at first start into ``<state_dir>/<name>`` with mode 0600 and keeps it across
restarts. Nodes on the same machine (``kvfence up``) read the generated file; nodes elsewhere need
the file configured. Without the node token a process that can reach the control plane could
register itself as a decode node and be sent other tenants' KV.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

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
    if path.exists():
        return read_token(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = prefix + secrets.token_urlsafe(32)
    # O_EXCL + 0600: never readable by others, not even for a moment, and never overwritten.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def node_token_path(configured: Path | None, state_dir: Path) -> Path:
    return configured if configured is not None else Path(state_dir) / NODE_TOKEN_FILE


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())
