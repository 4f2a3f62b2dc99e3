"""An exclusive, non-blocking lock on a file, naming its holder: one process per state directory
(the control plane's tenant database, ``kvfence up``'s stack).

``flock`` goes with the process however it ends (``kill -9`` included), so a lock is never left
stale; the file stays, and says who holds it to whoever is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class LockHeld(RuntimeError):
    """Another process holds the lock; ``held_by`` is what it wrote there ("" if nothing)."""

    def __init__(self, path: Path, held_by: str):
        super().__init__(f"{path} is held by {held_by or 'another process'}")
        self.path = path
        self.held_by = held_by


def hold_lock(path: Path, holder: str) -> int:
    """Take the exclusive lock on ``path`` (created owner-only) and write ``holder`` into it;
    returns its fd (closing it lets go, as does the process's end). Raises :class:`LockHeld` when
    another process holds it, OSError when the file cannot be opened."""
    # os.open's fds are not inherited by child processes (PEP 446): a subprocess started while the
    # lock is held does not keep it after this process lets go.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = b""
        with contextlib.suppress(OSError):
            held = os.pread(fd, 200, 0)
        os.close(fd)
        raise LockHeld(path, held.decode(errors="replace").strip()) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder}\n".encode(), 0)
    return fd
