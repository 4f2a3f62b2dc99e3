"""Shared secrets of a cluster: the admin token (operators) and the node token (node registration
and every call to a node).

Each comes from a configured file (e.g. a Kubernetes Secret) when one is set; otherwise the first
process of the cluster to start (the control plane, or a node that starts before it on the same
machine) generates it into ``<state_dir>/<name>`` with mode 0600 and it is kept across restarts.
The file is written and fsynced under a temporary name and linked into place only if the name is
still free, so a crash never leaves it empty and processes starting together all read the one that
got there first. An empty file (an older release could leave one when it crashed between creating
and writing it) counts as a lost token: a warning is logged and a new token replaces it, by one
process only (a lock on the file), as a missing one would be.
Nodes on the same machine (``kvfence up``) read the generated file; nodes elsewhere need the file
configured. Without the node token a process that can reach the control plane could register
itself as a decode node and be sent other tenants' KV, and one that can reach a node could reserve
its pages, run generations past the control plane's admission, or release other tenants' requests.
Both directions send it as ``authorization: Bearer <token>`` metadata (:func:`with_token`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvfence import logging as kvlog

S = TypeVar("S")

log = kvlog.get_logger("auth")

ADMIN_TOKEN_FILE = "admin_token"
NODE_TOKEN_FILE = "node_token"


class EmptyTokenFile(ValueError):
    """A token file that holds no token."""


def read_token(path: Path) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise EmptyTokenFile(f"token file {path} is empty")
    return token


def load_or_create_token(configured: Path | None, state_dir: Path, name: str, prefix: str) -> str:
    """The token in ``configured``, else the one in ``state_dir/name`` (created if missing, or
    replaced if empty: see the module docstring)."""
    if configured is not None:
        return read_token(configured)
    path = Path(state_dir) / name
    # Each round either returns or saw another process change the file meanwhile (it created the
    # missing file, or replaced the empty one): the next round reads what that process wrote.
    while True:
        try:
            return read_token(path)
        except FileNotFoundError:
            if path.is_symlink():
                # A link to a file that is not there (a secret not mounted): creating the token
                # fails on the link itself, and every round found the same, forever, silently.
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"token file {path} is a symbolic link to {os.readlink(path)}, which does "
                    "not exist (a secret not mounted?): fix the link or remove it",
                ) from None
            path.parent.mkdir(parents=True, exist_ok=True)
            token = prefix + secrets.token_urlsafe(32)
            if _create(path, token):
                return token
        except EmptyTokenFile:
            token = prefix + secrets.token_urlsafe(32)
            if _replace_empty(path, token):
                return token


def _write_temp(directory: Path, name: str, token: str) -> str:
    """A new file in ``directory`` holding ``token``, on disk (fsynced), mode 0600 (mkstemp): the
    token is never readable by others, not even for a moment."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        _write_synced(fd, token)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _write_synced(fd: int, token: str) -> None:
    """Write ``token`` to the open file ``fd``, fsync it and close it."""
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make the new name durable where the filesystem can (some network and FUSE filesystems
    refuse to fsync a directory: the token is written all the same)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _create(path: Path, token: str) -> bool:
    """Put ``token`` at ``path`` unless something is there already (False: another process of
    the cluster made it first, and theirs is the token). The token is written and fsynced under
    a temporary name and then linked into place, so ``path`` never exists empty or half
    written, not even after a crash."""
    tmp = _write_temp(path.parent, path.name, token)
    try:
        try:
            os.link(tmp, path)  # unlike a rename, fails if the name exists: never overwrites
        except FileExistsError:
            return False
        except OSError:
            # A filesystem without hard links (SMB, many FUSE mounts): create the name itself,
            # O_EXCL, as releases before this one did. A crash between the create and the write
            # can leave it empty there, which the next start replaces (_replace_empty).
            return _create_in_place(path, token)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(path.parent)
    return True


def _create_in_place(path: Path, token: str) -> bool:
    """``_create`` where hard links are refused: O_EXCL + 0600, written and fsynced."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    _write_synced(fd, token)
    _fsync_dir(path.parent)
    return True


def _replace_empty(path: Path, token: str) -> bool:
    """Replace the empty token file at ``path`` with ``token`` (False: another process replaced
    or removed it first: read again). This release leaves the file empty only on a filesystem
    without hard links (``_create_in_place``); an older one could anywhere, when it crashed
    between creating the file and writing it, and every start then failed until someone deleted
    the file. Processes that find it empty at once lock it,
    and only the first to hold the lock while it is still the same empty file replaces it: the
    others then read that process's token."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (held for the lock below)
    except FileNotFoundError:
        return False
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        held = os.fstat(f.fileno())
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino) or f.read().strip():
            return False
        log.warning(
            "token file is empty (an older release crashed while writing it): a new token "
            "replaces it; whoever needs this token needs the new one",
            path=str(path),
        )
        tmp = _write_temp(path.parent, path.name, token)
        try:
            os.replace(tmp, path)  # the lock is held: nothing else replaces it meanwhile
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_dir(path.parent)
        return True


def node_token_path(configured: Path | None, state_dir: Path) -> Path:
    return configured if configured is not None else Path(state_dir) / NODE_TOKEN_FILE


def load_node_token(configured: Path | None, state_dir: Path) -> str:
    """The cluster node token (``control_plane.node_token_file``, or the one generated under
    ``state_dir`` by whichever process of the cluster starts first): the control plane sends it
    to nodes, and nodes require it."""
    return load_or_create_token(configured, Path(state_dir), NODE_TOKEN_FILE, "kvfn_")


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def unsendable(token: str) -> str | None:
    """Why gRPC cannot send ``token`` in a header (None: it can). A header value is printable
    ASCII; anything else (the ``\\r`` a key file saved with CRLF line ends keeps, a newline, a
    non-ASCII letter) makes the client library fail the call before it connects, with
    "INTERNAL: Invalid metadata" and lines of its own log: a caller says why instead."""
    for i, c in enumerate(token):
        if not " " <= c <= "~":
            hint = " (a key file with Windows line ends?)" if c == "\r" else ""
            return f"it holds {c!r} at offset {i}: a key is printable ASCII{hint}"
    return None


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
