"""Backing up the tenant database over the admin API, and restoring it offline.

``BackupTenants`` needs the admin token, returns a consistent snapshot while tenants change, and
does not stall the event loop; ``kvfence tenants backup`` writes it owner-only and never over a
file unasked; ``kvfence tenants restore`` refuses what is not a sound kvfence tenant database and
a state directory a control plane runs on (a second control plane on one state directory is
refused too), and a restored database serves the backed-up keys and not the ones issued after.
Every refusal is paired with a control that is accepted.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
import typer
from cp_fakes import make_model_info
from cp_harness import Cluster, make_cfg, make_cluster, start_on
from typer.testing import CliRunner

from control_plane.admin import AdminServicer
from control_plane.service import ControlPlane
from control_plane.tenants import (
    TENANTS_DB,
    StateDirInUse,
    TenantLimits,
    TenantStore,
    hash_key,
    restore,
)
from kvfence.cli import admin as admin_cli
from kvfence.cli import generate as generate_cli
from kvfence.client import AdminClient
from kvfence.config import parse_config
from kvfence.errors import IntegrityError, Unauthenticated
from kvfence.proto.kvfence.v1 import control_pb2
from kvfence.server import BindError


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """The in-process control plane logs through structlog to whatever sys.stdout is: while
    CliRunner captures stdout that would mix its lines into the command's output."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=io.StringIO()))
    yield
    structlog.reset_defaults()


def invoke(*args: str, stdin: bytes | None = None) -> Any:
    app = typer.Typer()
    tenants = typer.Typer()
    app.add_typer(tenants, name="tenants")
    admin_cli.register(app, {"tenants": tenants, "model": typer.Typer()})
    return CliRunner().invoke(app, list(args), input=stdin)


async def run_cli(*args: str) -> Any:
    """The CLI in a worker thread: the control plane runs on this test's event loop."""
    return await asyncio.to_thread(invoke, *args)


def assert_refused(result: Any, *needles: str) -> None:
    """Exit 1 with a one-line message naming the cause; no traceback."""
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


async def backup(cluster: Cluster) -> bytes:
    admin, auth = cluster.admin()
    chunks = [
        c async for c in admin.BackupTenants(control_pb2.BackupTenantsRequest(), metadata=auth)
    ]
    data = b"".join(c.data for c in chunks)
    assert chunks[0].total_bytes == len(data)
    assert chunks[0].sha256 == hashlib.sha256(data).hexdigest()
    return data


def open_backup(data: bytes, path: Path) -> sqlite3.Connection:
    path.write_bytes(data)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # stands alone, no -wal
    return db


def names(db: sqlite3.Connection) -> set[str]:
    return {n for (n,) in db.execute("SELECT name FROM tenants")}


async def authenticates(cluster: Cluster, api_key: str) -> bool:
    try:
        await cluster.client(api_key=api_key).generate(prompt_ids=[10], max_new_tokens=1)
    except Unauthenticated:
        return False
    return True


# -- the RPC ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "code"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.UNAUTHENTICATED),
        ("tenant-key", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_backup_needs_the_admin_token(
    cluster: Cluster, tmp_path: Path, token: str | None, code: grpc.StatusCode
) -> None:
    admin, auth = cluster.admin(cluster.api_key if token == "tenant-key" else token or "")
    call = admin.BackupTenants(
        control_pb2.BackupTenantsRequest(), metadata=[] if token is None else auth
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == code
    # control: with the admin token the same call returns the database, the tenant in it
    db = open_backup(await backup(cluster), tmp_path / "backup.sqlite3")
    assert names(db) == {"acme"}
    [(sha,)] = db.execute("SELECT key_sha256 FROM api_keys").fetchall()
    assert sha == hash_key(cluster.api_key)


async def test_a_backup_taken_while_tenants_change_is_consistent(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Tenants are created and keys issued and revoked over the admin API while backups run:
    every backup passes integrity_check, holds every tenant created before it started, and no
    tenant without the key created in the same transaction (no half of a change)."""
    admin, auth = cluster.admin()
    created: list[str] = []
    stop = asyncio.Event()

    async def churn() -> None:
        i = 0
        while not stop.is_set():
            name = f"t{i}"
            resp = await admin.CreateTenant(
                control_pb2.CreateTenantRequest(name=name), metadata=auth
            )
            created.append(name)
            await admin.CreateKey(control_pb2.CreateKeyRequest(tenant=name), metadata=auth)
            await admin.RevokeKey(control_pb2.RevokeKeyRequest(key_id=resp.key_id), metadata=auth)
            i += 1

    writer = asyncio.create_task(churn())
    try:
        for n in range(8):
            while len(created) < 5 * (n + 1):
                await asyncio.sleep(0.005)
            before = set(created)
            data = await backup(cluster)
            after = set(created)
            db = open_backup(data, tmp_path / f"backup-{n}.sqlite3")
            got = names(db) - {"acme"}
            assert before <= got <= after | {f"t{len(after)}"}, (n, sorted(before - got))
            assert db.execute("PRAGMA foreign_key_check").fetchall() == []
            keyless = db.execute(
                "SELECT name FROM tenants WHERE name NOT IN (SELECT tenant FROM api_keys)"
            ).fetchall()
            assert keyless == []
            db.close()
    finally:
        stop.set()
        await writer
    assert len(created) >= 40  # the writer really ran alongside the backups


async def test_a_backup_needs_no_temporary_directory_but_the_state_directory(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's pods have a read-only root file system and no /tmp: a backup is made in the
    state directory (control: the system's temporary directory is indeed unusable here)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/kvfence-tmp")
    with pytest.raises(OSError):
        tempfile.mkdtemp()
    db = open_backup(await backup(cluster), cluster.cp.tenants.path.parent / "copy.sqlite3")
    assert "acme" in names(db)
    leftovers = [p.name for p in cluster.cp.tenants.path.parent.iterdir() if "backup" in p.name]
    assert leftovers == []


async def test_a_backup_does_not_stall_the_event_loop(cluster: Cluster) -> None:
    """A big database (100,000 tenants, ~27 MB) takes a noticeable time to snapshot: requests,
    heartbeats and admin calls must go on meanwhile, so the snapshot runs off the event loop."""
    db = sqlite3.connect(cluster.cp.tenants.path, isolation_level=None)
    db.execute("BEGIN")
    n = 100_000
    db.executemany(
        "INSERT INTO tenants VALUES (?, 0, 0, 0, 'x')", [(f"bulk-{i}",) for i in range(n)]
    )
    db.executemany(
        "INSERT INTO api_keys VALUES (?, ?, ?, 0, 'x')",
        [(f"key_bulk{i}", f"bulk-{i}", hash_key(f"bulk-{i}")) for i in range(n)],
    )
    db.execute("COMMIT")
    db.close()
    t0 = time.monotonic()
    cluster.cp.tenants.snapshot()
    blocking = time.monotonic() - t0  # what it would stall the loop for

    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        data = await backup(cluster)
    finally:
        tick.cancel()
    assert len(data) > 10_000_000
    assert blocking > 0.1, blocking  # else this test could not tell
    assert max(gaps) < blocking / 2, (max(gaps), blocking)


async def test_a_damaged_database_is_not_backed_up(tmp_path: Path) -> None:
    """A backup that would restore a damaged database is refused with DATA_LOSS, which tells the
    operator the live database needs attention."""
    state = tmp_path / "state"
    c = await make_cluster(state)
    for _ in range(200):
        c.cp.tenants.create_key("acme")
    await backup(c)  # control: the sound database backs up
    hashes = [h for (h,) in c.cp.tenants._db.execute("SELECT key_sha256 FROM api_keys")]
    await c.close()
    db_file = state / TENANTS_DB
    db_file.write_bytes(index_mismatch(db_file.read_bytes(), hashes))
    c = await start_on(state)
    try:
        admin, auth = c.admin()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in admin.BackupTenants(control_pb2.BackupTenantsRequest(), metadata=auth):
                pass
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert "the tenant database fails SQLite's integrity check" in (err.value.details() or "")
    finally:
        await c.close()


async def test_the_client_refuses_a_backup_that_did_not_arrive_whole(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = AdminClient(cluster.admin_target, cluster.cp.admin_token)
    try:
        whole = await asyncio.to_thread(admin.backup_tenants)  # control
        assert whole.startswith(b"SQLite format 3\x00")
        snapshot = AdminServicer._snapshot

        def short(self: AdminServicer) -> tuple[bytes, str]:
            data, digest = snapshot(self)
            return data[:-100], digest  # a chunk lost on the way, as the client would see it

        monkeypatch.setattr(AdminServicer, "_snapshot", short)
        with pytest.raises(IntegrityError, match="incomplete or damaged"):
            await asyncio.to_thread(admin.backup_tenants)
    finally:
        admin.close()


# -- the CLI ---------------------------------------------------------------------------------------


async def test_backup_command_writes_owner_only_and_never_over_a_file_unasked(
    cluster: Cluster, tmp_path: Path
) -> None:
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    out = tmp_path / "out" / "tenants.backup"
    out.parent.mkdir()
    result = await run_cli("tenants", "backup", str(out), *auth)
    assert result.exit_code == 0, result.output
    assert "1 tenants and 1 API keys" in result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert names(open_backup(out.read_bytes(), tmp_path / "copy.sqlite3")) == {"acme"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["tenants.backup"]  # no temp left

    out.write_bytes(b"an earlier backup")
    out.chmod(0o644)
    result = await run_cli("tenants", "backup", str(out), *auth)
    assert_refused(result, "exists", "--force")
    assert out.read_bytes() == b"an earlier backup"
    # control: with --force it is replaced, owner-only again
    result = await run_cli("tenants", "backup", str(out), "--force", *auth)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"SQLite format 3\x00")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600

    result = await run_cli(
        "tenants", "backup", str(tmp_path / "x"), *auth[:2], "--admin-token", "bad"
    )
    assert_refused(result, "admin token refused")
    assert not (tmp_path / "x").exists()


async def test_backup_to_stdout_pipes_the_backup_alone(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tenants backup -` (to pipe it into an encryption tool, as the runbook says to store it)
    wrote an unencrypted file named "-" in the working directory and sent nothing down the pipe.
    Now stdout carries the checked backup alone, the summary goes to stderr, and no file is
    written; a terminal is refused. Control: restored from stdin, it is the database backed up."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    result = await run_cli("tenants", "backup", "-", *auth)
    assert result.exit_code == 0, result.stderr
    assert result.stdout_bytes.startswith(b"SQLite format 3\x00")
    assert "backed up 1 tenants and 1 API keys to stdout" in result.stderr
    assert list(cwd.iterdir()) == []
    assert names(open_backup(result.stdout_bytes, tmp_path / "copy.sqlite3")) == {"acme"}
    state = cwd / "restored"
    state.mkdir()
    restored = invoke(
        "tenants", "restore", "--state-dir", str(state), "-", stdin=result.stdout_bytes
    )
    assert restored.exit_code == 0, restored.output
    assert "restored 1 tenants and 1 API keys" in restored.output

    monkeypatch.setattr(generate_cli, "_is_terminal", lambda stream: True)
    tty = await run_cli("tenants", "backup", "-", *auth)
    assert tty.exit_code == 2 and "refusing to write the backup" in tty.stderr, tty.output
    assert tty.stdout_bytes == b""


@pytest.mark.parametrize("to", ["file", "stdout"])
async def test_backup_to_a_file_or_stdout_is_checked_alike_and_leaves_no_copy(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    """Both destinations take one path: the backup is written to a private file and checked
    there before any of it reaches the destination. What is not a tenant database is refused
    for either, with nothing written and no copy left, in the temporary directory (where the
    stdout path checks it) or beside the file. Control: a real backup goes through."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dest = "-" if to == "stdout" else str(out_dir / "tenants.backup")
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    with monkeypatch.context() as m:
        m.setattr(AdminClient, "backup_tenants", lambda self, timeout: b"not a database")
        result = await run_cli("tenants", "backup", dest, *auth)
    assert_refused(result, "the backup is not a SQLite database")
    assert result.stdout_bytes == b""
    assert list(out_dir.iterdir()) == [] and list(scratch.iterdir()) == []

    result = await run_cli("tenants", "backup", dest, *auth)
    assert result.exit_code == 0, result.output
    summary = result.stderr if to == "stdout" else result.stdout
    assert "backed up 1 tenants and 1 API keys to " in summary, result.output
    backup = result.stdout_bytes if to == "stdout" else (out_dir / "tenants.backup").read_bytes()
    assert names(open_backup(backup, tmp_path / "copy.sqlite3")) == {"acme"}
    assert [p.name for p in out_dir.iterdir()] == ([] if to == "stdout" else ["tenants.backup"])
    assert list(scratch.iterdir()) == []


async def test_backup_to_a_pipe_its_reader_closed_fails_in_one_line(cluster: Cluster) -> None:
    """A reader that went (an encryption tool that failed) did not get the whole backup: exit 1
    with one line on stderr, not a traceback nor a success. Control: the same command with the
    pipe read sends the backup whole."""
    cmd = [sys.executable, "-m", "kvfence", "tenants", "backup", "-"]
    cmd += ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    # The read end is closed before the command starts: its first write fails.
    r, w = os.pipe()
    os.close(r)
    try:
        gone = await asyncio.create_subprocess_exec(*cmd, stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    _, err_bytes = await gone.communicate()
    err = err_bytes.decode()
    assert gone.returncode == 1, err
    assert err.strip() == "cannot write the backup to stdout: Broken pipe", err

    read = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err_bytes = await read.communicate()
    assert read.returncode == 0, err_bytes.decode()
    assert out.startswith(b"SQLite format 3\x00")
    assert "backed up 1 tenants and 1 API keys to stdout" in err_bytes.decode()


async def test_round_trip_restores_the_backed_up_keys_and_not_later_ones(tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = await make_cluster(state)
    store = c.cp.tenants
    try:
        acme_key = c.api_key
        _, initech_key, initech_id = store.create_tenant("initech", TenantLimits(0, 50, True))
        rotated_key, _ = store.create_key("acme")
        result = await run_cli(
            "tenants", "backup", str(tmp_path / "b"),
            "--target", c.admin_target, "--admin-token", c.cp.admin_token,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        # after the backup: a new tenant, a new key, a revoked one
        _, later_key, _ = store.create_tenant("globex", TenantLimits())
        later_acme_key, _ = store.create_key("acme")
        store.revoke_key(initech_id)
        for key in (later_key, later_acme_key):
            assert await authenticates(c, key)
        assert not await authenticates(c, initech_key)
    finally:
        await c.close()
    for p in state.glob(f"{TENANTS_DB}*"):  # the volume is lost ...
        p.unlink()

    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "restored 2 tenants and 3 API keys" in result.output, result.output
    assert "there was none" in result.output
    assert "keys revoked since the backup work again: revoke them anew" in result.output
    assert stat.S_IMODE((state / TENANTS_DB).stat().st_mode) == 0o600

    c = await start_on(state)  # ... and a control plane on the restored one
    try:
        # the keys of the backup serve (a key revoked after it is valid again: the runbook says
        # to revoke such keys anew), the ones issued after it do not
        for key in (acme_key, rotated_key, initech_key):
            assert await authenticates(c, key)
        for key in (later_key, later_acme_key):
            assert not await authenticates(c, key)
        assert c.cp.tenants.get("initech").limits == TenantLimits(0, 50, True)
        assert [t.name for t in c.cp.tenants.list()] == ["acme", "initech"]
    finally:
        await c.close()


def test_a_restore_keeps_the_keys_revoked_since_the_backup_revoked(tmp_path: Path) -> None:
    """Over the same database, a key revoked after the backup stays revoked: restored as the
    backup had it, a key revoked because it leaked authenticated again, silently (kvfence has no
    un-revoke, and a restore must not be one). The restore names it. Controls: a key live in
    both stays live, one revoked before the backup stays revoked (and is not named), and a
    database that cannot be read carries nothing over and says to revoke anew."""
    state = tmp_path / "state"
    store = TenantStore(state / TENANTS_DB)
    _, leaked, leaked_id = store.create_tenant("acme", TenantLimits())
    kept, _ = store.create_key("acme")
    old, old_id = store.create_key("acme")
    store.revoke_key(old_id)
    (tmp_path / "b").write_bytes(store.snapshot())
    store.revoke_key(leaked_id)  # after the backup
    store.close()

    result = invoke("tenants", "restore", "--state-dir", str(state), str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert (
        f"kept 1 API key revoked that the backup had live (revoked since it was taken): "
        f"{leaked_id}\n" in result.output
    )
    assert old_id not in result.output
    assert "revoke them anew" not in result.output
    store = TenantStore(state / TENANTS_DB)
    try:
        assert store.authenticate(leaked) is None
        assert store.authenticate(old) is None
        authenticated = store.authenticate(kept)
        assert authenticated is not None and authenticated.name == "acme"
    finally:
        store.close()

    # A replaced database that cannot be read: nothing to carry over, and the restore says so.
    for p in state.glob(f"{TENANTS_DB}*"):
        p.unlink()
    (state / TENANTS_DB).write_bytes(b"SQLite format 3\x00" + b"\xff" * 4080)
    result = invoke("tenants", "restore", "--state-dir", str(state), str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "could not be read" in result.output
    assert "keys revoked since the backup work again: revoke them anew" in result.output
    assert "kept 1 API key revoked" not in result.output
    store = TenantStore(state / TENANTS_DB)
    try:
        assert store.authenticate(leaked) is not None  # as the backup had it
    finally:
        store.close()


CRASHED_WRITER = """
import os, sys
from pathlib import Path
from control_plane.tenants import TenantLimits, TenantStore
store = TenantStore(Path(sys.argv[1]))
store.create_tenant("newer", TenantLimits())
os._exit(0)  # killed: no close, no checkpoint; the change is committed in the -wal only
"""


def crashed_writer_state(tmp_path: Path) -> Path:
    """A state directory whose control plane died after committing ``newer`` to the -wal only,
    and a backup (``tmp_path / "b"``) from before, with ``acme`` alone."""
    state = tmp_path / "state"
    store = TenantStore(state / TENANTS_DB)
    store.create_tenant("acme", TenantLimits())
    (tmp_path / "b").write_bytes(store.snapshot())
    store.close()
    subprocess.run(
        [sys.executable, "-c", CRASHED_WRITER, str(state / TENANTS_DB)],
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert Path(f"{state / TENANTS_DB}-wal").stat().st_size > 0  # the change is there only
    return state


async def test_restore_keeps_the_database_it_replaces_with_its_wal(tmp_path: Path) -> None:
    """The database a restore replaces is kept whole: a control plane that died leaves committed
    changes in the -wal, which are folded into the kept copy (and never stay beside the restored
    file, where SQLite would replay them)."""
    state = tmp_path / "state"
    c = await make_cluster(state)
    (tmp_path / "b").write_bytes(await backup(c))
    await c.close()
    subprocess.run(
        [sys.executable, "-c", CRASHED_WRITER, str(state / TENANTS_DB)],
        check=True,
        cwd=Path(__file__).parents[2],
    )
    wal = Path(f"{state / TENANTS_DB}-wal")
    assert wal.stat().st_size > 0  # the crash left its change there

    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    [kept] = state.glob(f"{TENANTS_DB}.bak-*[0-9Z]")
    assert f"kept as {kept}" in result.output
    assert not Path(f"{kept}-wal").exists()  # one whole file
    assert kept.stat().st_mode & 0o077 == 0  # key hashes: owner only
    assert not list(state.glob(f"{TENANTS_DB}-*"))  # no -wal/-shm beside the restored one
    old = sqlite3.connect(kept)
    assert names(old) == {"acme", "newer"}  # the crashed writer's change is in the kept copy
    old.close()
    restored = sqlite3.connect(state / TENANTS_DB)
    assert names(restored) == {"acme"}
    restored.close()


def test_a_restore_killed_before_the_swap_leaves_the_old_database_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between keeping the old database and renaming the backup over it, a restore leaves
    the live name on the whole old database, the -wal's changes in it: a control plane that starts
    next serves every tenant (it used to find no database, start an empty one, and the -wal's
    changes were lost). Control: the same restore, not interrupted, swaps the backup in."""
    state = crashed_writer_state(tmp_path)

    def killed(*_: object) -> None:
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        restore(state, tmp_path / "b")
    monkeypatch.undo()
    store = TenantStore(state / TENANTS_DB)
    assert {t.name for t in store.list()} == {"acme", "newer"}
    store.close()
    restore(state, tmp_path / "b")
    store = TenantStore(state / TENANTS_DB)
    assert {t.name for t in store.list()} == {"acme"}
    store.close()


async def test_the_database_is_private_and_a_failed_start_lets_go_of_the_state_dir(
    tmp_path: Path,
) -> None:
    """The live database holds key hashes: owner only, like its backups. A control plane that
    fails after taking the state directory (a token file missing, a port taken) lets go of it, so
    that one configured right can start there in the same process."""
    state = tmp_path / "state"
    broken = make_cfg(state).model_dump()
    broken["control_plane"]["admin_token_file"] = str(tmp_path / "missing-token")
    with pytest.raises(FileNotFoundError):
        ControlPlane(parse_config(broken, environ={}), model_info=make_model_info())
    taken = await make_cluster(state)  # control: the state directory is free again
    try:
        for p in state.glob(f"{TENANTS_DB}*"):
            if not p.name.endswith(".lock"):
                assert p.stat().st_mode & 0o077 == 0, p
        other = ControlPlane(make_cfg(tmp_path / "other"), model_info=make_model_info())
        with pytest.raises(BindError):
            await other.start(listen=f"127.0.0.1:{taken.ports.public}")
        again = ControlPlane(make_cfg(tmp_path / "other"), model_info=make_model_info())
        again.tenants.close()
    finally:
        await taken.close()


def plain_sqlite(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    db.execute("INSERT INTO notes (body) VALUES ('hello')")
    db.commit()
    db.close()


def lookalike(path: Path) -> None:
    """Tables with the right names and the wrong columns."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE tenants (name TEXT PRIMARY KEY)")
    db.execute("CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, tenant TEXT)")
    db.commit()
    db.close()


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.write_text("key_id,tenant\nkey_1,acme\n"), "is not a SQLite database"),
        (lambda p: p.write_bytes(b""), "is not a SQLite database"),
        (plain_sqlite, "not a kvfence tenant database"),
        (lookalike, "not a kvfence tenant database"),
    ],
    ids=["text", "empty", "other-sqlite", "lookalike"],
)
async def test_restore_refuses_what_is_not_a_kvfence_tenant_database(
    tmp_path: Path, make: Any, needle: str
) -> None:
    state = tmp_path / "state"
    c = await make_cluster(state)
    good = await backup(c)
    await c.close()
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.suffix != ".lock"}
    bad = tmp_path / "bad"
    make(bad)
    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(bad))
    assert_refused(result, "refusing to restore", str(bad), needle)
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.suffix != ".lock"} == before
    # control: a real backup is accepted on the same state directory
    (tmp_path / "good").write_bytes(good)
    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "good"))
    assert result.exit_code == 0, result.output


def torn_page(data: bytes, hashes: list[str]) -> bytes:
    """A page overwritten with garbage (a torn or bit-rotted write)."""
    page = 4096
    return data[: 2 * page] + b"\xa5" * page + data[3 * page :]


def index_mismatch(data: bytes, hashes: list[str]) -> bytes:
    """One key hash changed in the table and not in its unique index: a file that opens and
    reads, and that only SQLite's integrity check finds wrong."""
    at = data.index(hashes[0].encode())
    return data[:at] + b"x" + data[at + 1 :]


@pytest.mark.parametrize("damage", [torn_page, index_mismatch])
async def test_restore_refuses_a_damaged_backup(tmp_path: Path, damage: Any) -> None:
    state = tmp_path / "state"
    c = await make_cluster(state)
    for _ in range(200):  # a few pages, so that damage lands in a b-tree page
        c.cp.tenants.create_key("acme")
    good = await backup(c)
    await c.close()
    db = open_backup(good, tmp_path / "copy")
    hashes = [h for (h,) in db.execute("SELECT key_sha256 FROM api_keys")]
    db.close()
    (tmp_path / "bad").write_bytes(damage(good, hashes))
    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "bad"))
    assert_refused(result, "refusing to restore")
    if damage is index_mismatch:
        assert "fails SQLite's integrity check: row" in result.output
    (tmp_path / "good").write_bytes(good)  # control
    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "good"))
    assert result.exit_code == 0, result.output


# -- one control plane per state directory ---------------------------------------------------------


async def test_restore_refuses_while_a_control_plane_runs_on_the_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = await make_cluster(state)
    (tmp_path / "b").write_bytes(await backup(c))
    _, later_key, _ = c.cp.tenants.create_tenant("later", TenantLimits())
    try:
        result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "b"))
        assert_refused(result, "is in use", "a control plane (pid", "stop it first")
        assert not list(state.glob(f"{TENANTS_DB}.bak-*"))
        assert await authenticates(c, later_key)  # the running one's database is untouched
    finally:
        await c.close()
    # control: once it is stopped the same command restores
    result = await run_cli("tenants", "restore", "--state-dir", str(state), str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert len(list(state.glob(f"{TENANTS_DB}.bak-*"))) == 1


async def test_a_second_control_plane_on_one_state_dir_is_refused(tmp_path: Path) -> None:
    first = ControlPlane(make_cfg(tmp_path / "a"), model_info=make_model_info())
    await first.start()
    try:
        with pytest.raises(StateDirInUse, match=r"is in use .*a control plane .*pid"):
            ControlPlane(make_cfg(tmp_path / "a"), model_info=make_model_info())
        # control: another state directory is fine alongside it
        other = ControlPlane(make_cfg(tmp_path / "b"), model_info=make_model_info())
        await other.start()
        await other.stop(grace=0)
    finally:
        await first.stop(grace=0)
    # control: the same directory once the first has stopped
    again = ControlPlane(make_cfg(tmp_path / "a"), model_info=make_model_info())
    await again.start()
    await again.stop(grace=0)


async def test_restore_reads_the_backup_from_stdin(tmp_path: Path) -> None:
    """`-` reads the backup from stdin (`kubectl exec -i POD -- kvfence tenants restore ... -`,
    the runbook's way into a pod that may lack tar); it is checked like a file."""
    state = tmp_path / "state"
    c = await make_cluster(state)
    good = await backup(c)
    c.cp.tenants.create_tenant("later", TenantLimits())
    await c.close()
    result = invoke("tenants", "restore", "--state-dir", str(state), "-", stdin=b"not a backup")
    assert_refused(result, "refusing to restore", "the backup on stdin is not a SQLite database")
    assert not list(state.glob(f"{TENANTS_DB}.bak-*"))
    result = invoke("tenants", "restore", "--state-dir", str(state), "-", stdin=good)  # control
    assert result.exit_code == 0, result.output
    assert "restored 1 tenants and 1 API keys" in result.output and "from stdin" in result.output
    db = sqlite3.connect(state / TENANTS_DB)
    assert names(db) == {"acme"}
    db.close()


def test_restore_needs_an_existing_state_dir_and_backup(tmp_path: Path) -> None:
    result = invoke("tenants", "restore", "--state-dir", str(tmp_path / "nope"), str(tmp_path))
    assert_refused(result, "does not exist")
    result = invoke("tenants", "restore", "--state-dir", str(tmp_path), str(tmp_path / "missing"))
    assert_refused(result, "does not exist")
