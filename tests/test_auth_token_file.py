"""The generated token files (``<state_dir>/node_token``, ``admin_token``): never seen empty, not
even after a crash while writing; processes starting together all get the one token; an empty file
left by an older release is replaced (with a warning) instead of failing every later start.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvfence import auth
from kvfence.auth import EmptyTokenFile, load_node_token, load_or_create_token

ROOT = Path(__file__).resolve().parent.parent


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def in_threads(n: int, fn) -> list[str]:
    """``fn()`` in ``n`` threads released together; their results."""
    barrier = threading.Barrier(n)
    results: list[str | BaseException] = [""] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as err:  # the assert below reports it
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(isinstance(r, str) for r in results), results
    return results  # type: ignore[return-value]


def no_temp_files(state: Path) -> bool:
    return not [p.name for p in state.iterdir() if p.name.endswith(".tmp")]


def test_threads_starting_together_get_one_token(tmp_path):
    state = tmp_path / "state"
    tokens = in_threads(8, lambda: load_node_token(None, state))
    assert len(set(tokens)) == 1 and tokens[0].startswith("kvfn_") and len(tokens[0]) > 20
    path = state / "node_token"
    assert path.read_text() == tokens[0] + "\n" and mode(path) == 0o600
    assert no_temp_files(state)


CHILD = """
import sys, time
from pathlib import Path
from kvfence.auth import load_node_token
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
print(load_node_token(None, Path(sys.argv[1])))
"""


def test_processes_starting_together_get_one_token(tmp_path):
    state, go = tmp_path / "state", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(state), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    go.touch()  # each child waits for it, so their creates race
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    tokens = {out.strip() for out, _ in outs}
    assert len(tokens) == 1 and (state / "node_token").read_text().strip() in tokens
    assert mode(state / "node_token") == 0o600 and no_temp_files(state)


def test_the_created_file_is_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        load_or_create_token(None, tmp_path, "admin_token", "kvfa_")
    finally:
        os.umask(old)
    assert mode(tmp_path / "admin_token") == 0o600


def test_a_crash_while_writing_leaves_no_empty_token_file(tmp_path, monkeypatch):
    """The write of the token fails (standing in for a crash between creating the file and
    writing it): no token file is left behind, so the next start generates one instead of
    failing on an empty file."""
    real_fdopen = os.fdopen

    class Crashing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError("disk gone")

    monkeypatch.setattr(auth.os, "fdopen", lambda fd, *a, **kw: Crashing(real_fdopen(fd, *a, **kw)))
    with pytest.raises(OSError, match="disk gone"):
        load_node_token(None, tmp_path)
    assert not (tmp_path / "node_token").exists() and no_temp_files(tmp_path)
    monkeypatch.undo()
    token = load_node_token(None, tmp_path)
    assert token and (tmp_path / "node_token").read_text() == token + "\n"


def test_an_empty_leftover_file_is_replaced_once_with_a_warning(tmp_path):
    """An older release could leave the file empty (a crash between its create and its write):
    every process that finds it so gets the same new token, written by one of them."""
    path = tmp_path / "node_token"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    with capture_logs() as logs:
        tokens = in_threads(6, lambda: load_node_token(None, tmp_path))
    assert len(set(tokens)) == 1 and tokens[0].startswith("kvfn_")
    assert path.read_text() == tokens[0] + "\n" and mode(path) == 0o600
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "empty" in warnings[0]["event"]
    assert warnings[0]["path"] == str(path) and tokens[0] not in str(logs)
    assert no_temp_files(tmp_path)
    assert load_node_token(None, tmp_path) == tokens[0]  # kept from now on


@pytest.mark.parametrize("written", [True, False], ids=["written-meanwhile", "control-still-empty"])
def test_a_token_written_in_place_while_waiting_for_the_lock_is_kept(
    tmp_path, monkeypatch, written
):
    """Where hard links are refused (``_create_in_place``) the creator makes the file O_EXCL and
    only then writes its token into that inode. A process that read it empty in between waits
    for the lock to replace it; by then the file is the same inode, no longer empty. It reads the
    creator's token instead of replacing it (two processes with different node tokens). Control:
    a file still empty when the lock is held is replaced."""
    path = tmp_path / "node_token"
    path.write_text("")
    real_flock = auth.fcntl.flock
    locked = []

    def flock(fd, op):
        if written and not locked:  # the creator's write lands while this one waits
            with open(path, "r+") as f:  # the same inode, as _create_in_place writes it
                f.write("kvfn_creator\n")
        locked.append(op)
        return real_flock(fd, op)

    monkeypatch.setattr(auth.fcntl, "flock", flock)
    token = load_node_token(None, tmp_path)
    assert locked  # it did find the file empty and go for the lock
    assert path.read_text() == token + "\n"
    if written:
        assert token == "kvfn_creator"
    else:
        assert token.startswith("kvfn_") and token != "kvfn_creator" and mode(path) == 0o600
    assert no_temp_files(tmp_path)


def test_an_existing_token_file_is_read_not_replaced(tmp_path):
    """Control: a token that is there is the token; the file is left as it is."""
    path = tmp_path / "node_token"
    path.write_text("kvfn_existing\n")
    os.chmod(path, 0o600)
    before = path.stat()
    with capture_logs() as logs:
        assert in_threads(3, lambda: load_node_token(None, tmp_path)) == ["kvfn_existing"] * 3
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert path.read_text() == "kvfn_existing\n" and logs == []


def test_a_configured_empty_token_file_is_an_error_not_replaced(tmp_path):
    """Only generated files are regenerated: a configured one (a Secret) is the operator's."""
    configured = tmp_path / "secret-token"
    configured.write_text("\n")
    with pytest.raises(EmptyTokenFile, match="is empty"):
        load_node_token(configured, tmp_path)
    assert configured.read_text() == "\n" and not (tmp_path / "node_token").exists()


def test_losing_the_create_race_reads_the_winners_token(tmp_path, monkeypatch):
    """The file appears between the check and the link: the link fails and that token is read,
    the file is not overwritten."""
    real_link = os.link

    def winner_first(src, dst, *args, **kwargs):
        Path(dst).write_text("kvfn_winner\n")
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(auth.os, "link", winner_first)
    assert load_node_token(None, tmp_path) == "kvfn_winner"
    assert (tmp_path / "node_token").read_text() == "kvfn_winner\n" and no_temp_files(tmp_path)


@pytest.mark.parametrize("links", [False, True], ids=["no-hard-links", "control-links"])
def test_a_filesystem_without_hard_links_still_gets_a_token(tmp_path, monkeypatch, links):
    """SMB and many FUSE mounts refuse hard links (EPERM, EOPNOTSUPP): the link into place
    raised, and every first start in such a state_dir failed. It falls back to creating the
    file itself, O_EXCL and 0600. Control: where links work, the link is used."""
    linked = []
    real_link = os.link

    def link(src, dst):
        if not links:
            raise PermissionError(1, "Operation not permitted")
        linked.append(dst)
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    token = load_or_create_token(None, tmp_path, "node_token", "kvfn_")
    path = tmp_path / "node_token"
    assert token.startswith("kvfn_") and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(None, tmp_path, "node_token", "kvfn_") == token
    assert [p.name for p in tmp_path.iterdir()] == ["node_token"]  # no temporary left
    assert linked == ([path] if links else [])


LOAD_ADMIN_TOKEN = """
import sys
from pathlib import Path
from kvfence.auth import load_or_create_token
try:
    print(load_or_create_token(None, Path(sys.argv[1]), "admin_token", "kvfa_"))
except OSError as err:
    print(err)
    sys.exit(1)
"""


def test_a_link_to_a_missing_secret_is_an_error_not_a_loop(tmp_path):
    """``<state_dir>/admin_token`` a symbolic link to a secret that is not mounted: reading it
    finds no file, creating one finds the link in the way, and the control plane spun there at
    full CPU forever, logging nothing (and holding its state directory's lock). Now an error that
    names the link and its target, leaving no temporary file. Control: once the target exists,
    its token is read through the link. (In a process of its own, which the timeout ends.)"""
    secret = tmp_path / "secrets" / "admin_token"
    link = tmp_path / "admin_token"
    link.symlink_to(secret)

    def load() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", LOAD_ADMIN_TOKEN, str(tmp_path)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip

    failed = load()
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"token file {link} is a symbolic link to {secret}, which does not exist" in (
        failed.stdout
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin_token"]  # no temp file left
    secret.parent.mkdir()
    secret.write_text("kvfa_mounted\n")
    read = load()
    assert (read.returncode, read.stdout) == (0, "kvfa_mounted\n"), read.stderr
