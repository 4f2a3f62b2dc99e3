"""A tenant database has an id, and a restore does not put another database's backup in its place.

Every tenant database carries a random id, made with it (or when a TenantStore first opens a
database of an older release) and never changed; a backup is a page copy, so it carries the id.
``tenants restore`` refuses a backup of another database over one that holds tenants (that
database's tenants' keys would work here and these tenants' would be refused), changing nothing,
unless told so (``--from-another-database``). It accepts, without asking: no database, a database
without tenants, a backup of the same database of any age, and a backup or a database from a
release before ids (saying it did not compare them). Every refusal is paired with a control that
is accepted.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_cp_backup import (
    _quiet_logs,  # noqa: F401  (autouse: the CLI's output without logs)
    assert_refused,
    invoke,
)

from control_plane.tenants import (
    IDENTITY_SCHEMA,
    SCHEMA_VERSION,
    TENANTS_DB,
    AnotherDatabase,
    DatabaseIdentity,
    IdentityCheck,
    TenantLimits,
    TenantStore,
    check_database,
    read_identity,
    restore,
)


def cluster(state: Path, *tenants: str) -> tuple[DatabaseIdentity, dict[str, str]]:
    """A state directory whose database holds ``tenants``; returns its id and each one's key."""
    store = TenantStore(state / TENANTS_DB)
    try:
        keys = {name: store.create_tenant(name, TenantLimits())[1] for name in tenants}
        return store.identity, keys
    finally:
        store.close()


def died_after_adding(state: Path, name: str) -> str:
    """A control plane's store that adds tenant ``name`` and dies without closing: the change
    is committed in the database's -wal only. Returns the tenant's key."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from control_plane.tenants import TenantLimits, TenantStore\n"
        "store = TenantStore(Path(sys.argv[1]))\n"
        "print(store.create_tenant(sys.argv[2], TenantLimits())[1], flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(state / TENANTS_DB), name],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    wal = state / f"{TENANTS_DB}-wal"
    assert wal.exists() and wal.stat().st_size > 0, "the change should be in the -wal only"
    return out.stdout.strip()


def take_backup(state: Path, out: Path) -> Path:
    store = TenantStore(state / TENANTS_DB)
    try:
        out.write_bytes(store.snapshot())
    finally:
        store.close()
    return out


def tenant_of(state: Path, api_key: str) -> str | None:
    """Whom ``api_key`` authenticates as on ``state``'s database (None: refused)."""
    store = TenantStore(state / TENANTS_DB)
    try:
        found = store.authenticate(api_key)
        return None if found is None else found.name
    finally:
        store.close()


def files(state: Path) -> dict[str, bytes]:
    """The database and its -wal as they are (the -shm is an index SQLite rebuilds)."""
    return {
        p.name: p.read_bytes()
        for p in state.iterdir()
        if p.name in (TENANTS_DB, f"{TENANTS_DB}-wal")
    }


def without_identity(path: Path, version: int = IDENTITY_SCHEMA - 1) -> None:
    """``path`` as the release before ids left it: no database_identity, user_version 1."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TABLE database_identity")
    db.execute(f"PRAGMA user_version = {version}")
    db.execute("PRAGMA journal_mode = DELETE")
    db.close()


def backups(state: Path) -> list[Path]:
    return sorted(state.glob(f"{TENANTS_DB}.bak-*"))


# -- the id ----------------------------------------------------------------------------------------


def test_a_database_gets_an_id_once_and_keeps_it(tmp_path: Path) -> None:
    """Made with the database; the same over a reopen, in a backup, and after that backup is
    restored elsewhere; two databases have different ids."""
    a = tmp_path / "a"
    identity, _ = cluster(a, "acme")
    assert len(identity.database_id) == 32 and int(identity.database_id, 16) >= 0  # uuid4 hex
    assert read_identity(a / TENANTS_DB) == identity
    store = TenantStore(a / TENANTS_DB)
    assert store.identity == identity  # reopened: unchanged
    store.create_tenant("initech", TenantLimits())
    store.close()
    assert read_identity(a / TENANTS_DB) == identity

    b = take_backup(a, tmp_path / "a.backup")
    assert check_database(b).identity == identity  # the backup carries it
    copy = tmp_path / "copy"
    copy.mkdir()
    done = restore(copy, b)
    assert done.identity == identity
    assert done.identity_check is IdentityCheck.NO_DATABASE
    store = TenantStore(copy / TENANTS_DB)
    assert store.identity == identity  # a control plane on the restored one: the same id
    store.close()
    take_backup(copy, tmp_path / "copy.backup")  # and round again
    assert check_database(tmp_path / "copy.backup").identity == identity

    other, _ = cluster(tmp_path / "other", "acme")  # control: another database, another id
    assert other.database_id != identity.database_id


# -- refused: another database's backup over one with tenants -------------------------------------


def test_another_clusters_backup_is_refused_unless_meant(tmp_path: Path) -> None:
    """A's backup into B's state directory (B has tenants): refused naming both ids, B's
    database untouched and B's keys working. Control: the same with from_another_database
    restores A (B kept beside it), and A's keys work there and B's do not."""
    a_id, a_keys = cluster(tmp_path / "a", "acme")
    a_backup = take_backup(tmp_path / "a", tmp_path / "a.backup")
    b = tmp_path / "b"
    b_id, b_keys = cluster(b, "globex")
    b_keys["initech"] = died_after_adding(b, "initech")  # B's control plane died: a -wal
    before = files(b)
    assert f"{TENANTS_DB}-wal" in before

    with pytest.raises(AnotherDatabase) as err:
        restore(b, a_backup)
    message = str(err.value)
    assert a_id.database_id in message and b_id.database_id in message, message
    assert "2 tenants" in message and "--from-another-database" in message, message
    assert (err.value.backup, err.value.current) == (a_id, b_id)
    assert files(b) == before  # not even checkpointed: the -wal is as the dead one left it
    assert tenant_of(b, b_keys["initech"]) == "initech"
    assert backups(b) == []
    assert not (b / f"{TENANTS_DB}.restoring").exists()
    assert tenant_of(b, b_keys["globex"]) == "globex"
    assert tenant_of(b, a_keys["acme"]) is None
    assert read_identity(b / TENANTS_DB) == b_id

    done = restore(b, a_backup, from_another_database=True)  # control
    assert done.identity_check is IdentityCheck.ANOTHER_DATABASE
    assert (done.identity, done.replaced_identity) == (a_id, b_id)
    assert tenant_of(b, a_keys["acme"]) == "acme"
    assert tenant_of(b, b_keys["globex"]) is None
    [kept] = backups(b)
    assert done.previous == kept
    assert read_identity(kept) == b_id  # B, whole, beside it
    db = sqlite3.connect(kept)
    assert {n for (n,) in db.execute("SELECT name FROM tenants")} == {"globex", "initech"}
    db.close()
    assert read_identity(b / TENANTS_DB) == a_id  # the restored database keeps A's id


def test_cli_refuses_another_databases_backup_and_takes_the_flag(tmp_path: Path) -> None:
    a_id, a_keys = cluster(tmp_path / "a", "acme")
    a_backup = take_backup(tmp_path / "a", tmp_path / "a.backup")
    b = tmp_path / "b"
    b_id, b_keys = cluster(b, "globex")
    before = files(b)

    result = invoke("tenants", "restore", "--state-dir", str(b), str(a_backup))
    assert_refused(
        result,
        "refusing to restore:",
        f"{a_backup} is a backup of another tenant database (id {a_id.database_id}, created "
        f"{a_id.created_at}) than the one it would replace (id {b_id.database_id}",
        "--from-another-database",
    )
    assert files(b) == before and backups(b) == []
    assert tenant_of(b, b_keys["globex"]) == "globex"
    # stdin is checked the same way
    result = invoke("tenants", "restore", "--state-dir", str(b), "-", stdin=a_backup.read_bytes())
    assert_refused(result, "refusing to restore: the backup on stdin is a backup of another")
    assert files(b) == before and backups(b) == []

    help_text = invoke("tenants", "restore", "--help").output
    assert "--from-another-database" in help_text

    # control: with the flag it restores, says which database it restored and which it replaced
    result = invoke(
        "tenants", "restore", "--state-dir", str(b), str(a_backup), "--from-another-database"
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(
        f"restored 1 tenants and 1 API keys (database {a_id.database_id}, created "
        f"{a_id.created_at}) into {b / TENANTS_DB}"
    ), lines[0]
    assert (
        "warning: --from-another-database: the database it replaced was another one "
        f"(database {b_id.database_id}, created {b_id.created_at})"
    ) in result.output, result.output
    assert tenant_of(b, a_keys["acme"]) == "acme"
    assert tenant_of(b, b_keys["globex"]) is None
    assert len(backups(b)) == 1


# -- accepted without the flag ---------------------------------------------------------------------


def test_restore_into_an_empty_state_dir_or_a_database_without_tenants(tmp_path: Path) -> None:
    """No database (a new volume), or one that holds no tenant (a control plane started on the
    new volume before the restore): nothing of it to lock out. Control: once that database has a
    tenant, the same backup is refused."""
    a_id, a_keys = cluster(tmp_path / "a", "acme")
    a_backup = take_backup(tmp_path / "a", tmp_path / "a.backup")

    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke("tenants", "restore", "--state-dir", str(empty), str(a_backup))
    assert result.exit_code == 0, result.output
    assert f"(database {a_id.database_id}, created {a_id.created_at})" in result.output
    assert "there was none" in result.output
    # the one note: nothing to carry revocations over from (a lost volume's are gone with it)
    notes = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "keys revoked since the backup work again" in notes[0], notes
    assert "warning:" not in result.output, result.output
    assert tenant_of(empty, a_keys["acme"]) == "acme"

    fresh = tmp_path / "fresh"
    fresh_id, _ = cluster(fresh)  # started, no tenant created
    assert fresh_id.database_id != a_id.database_id
    done = restore(fresh, a_backup)
    assert done.identity_check is IdentityCheck.NO_TENANTS
    assert done.replaced_identity == fresh_id
    assert read_identity(fresh / TENANTS_DB) == a_id
    assert tenant_of(fresh, a_keys["acme"]) == "acme"

    control = tmp_path / "control"  # the same, with a tenant: refused
    cluster(control, "demo")
    with pytest.raises(AnotherDatabase):
        restore(control, a_backup)


def test_an_older_backup_of_the_same_database_is_accepted(tmp_path: Path) -> None:
    """A's backup from before later changes restores into A (the usual restore): same id.
    Control: the same state directory refuses another database's backup."""
    a = tmp_path / "a"
    a_id, a_keys = cluster(a, "acme")
    old = take_backup(a, tmp_path / "old.backup")
    store = TenantStore(a / TENANTS_DB)
    _, later_key, _ = store.create_tenant("later", TenantLimits())
    store.close()
    take_backup(a, tmp_path / "newer.backup")

    result = invoke("tenants", "restore", "--state-dir", str(a), str(old))
    assert result.exit_code == 0, result.output
    assert f"(database {a_id.database_id}," in result.output
    assert "note:" not in result.output and "warning:" not in result.output, result.output
    assert tenant_of(a, a_keys["acme"]) == "acme"
    assert tenant_of(a, later_key) is None
    done = restore(a, tmp_path / "newer.backup")  # and forward again
    assert done.identity_check is IdentityCheck.SAME
    assert tenant_of(a, later_key) == "later"

    cluster(tmp_path / "b", "globex")  # control
    b_backup = take_backup(tmp_path / "b", tmp_path / "b.backup")
    result = invoke("tenants", "restore", "--state-dir", str(a), str(b_backup))
    assert_refused(result, "refusing to restore", "another tenant database")
    assert tenant_of(a, later_key) == "later"


# -- releases before ids ---------------------------------------------------------------------------


def test_a_backup_from_before_ids_is_accepted_with_a_note_and_gets_an_id(tmp_path: Path) -> None:
    """A backup a release before schema 2 took (no database_identity, user_version 1) carries no
    id, so it cannot be compared: restored over a database with tenants, saying so; a
    TenantStore opening it gives it an id, which it keeps. Control: the same backup with its id
    (another database's) is refused there."""
    a = tmp_path / "a"
    a_id, a_keys = cluster(a, "acme")
    with_id = take_backup(a, tmp_path / "with-id.backup")
    old = tmp_path / "old.backup"
    old.write_bytes(with_id.read_bytes())
    without_identity(old)
    checked = check_database(old)
    assert (checked.schema_version, checked.identity) == (1, None)

    b = tmp_path / "b"
    b_id, _ = cluster(b, "globex")
    result = invoke("tenants", "restore", "--state-dir", str(b), str(with_id))  # control
    assert_refused(result, "refusing to restore", "another tenant database")

    result = invoke("tenants", "restore", "--state-dir", str(b), str(old))
    assert result.exit_code == 0, result.output
    assert "(a database without an id)" in result.output.splitlines()[0], result.output
    assert (
        "note: the backup carries no database id (a release before schema 2 took it), so "
        "whether the backup is of the database it replaced was not checked; the control plane "
        "gives the restored database an id when it opens it"
    ) in result.output, result.output
    assert read_identity(b / TENANTS_DB) is None
    assert len(backups(b)) == 1

    store = TenantStore(b / TENANTS_DB)  # a control plane opens it: it gets an id
    given = store.identity
    assert store.schema_version == 1
    assert store.authenticate(a_keys["acme"]) is not None
    store.close()
    assert given is not None and given.database_id not in (a_id.database_id, b_id.database_id)
    assert read_identity(b / TENANTS_DB) == given
    assert check_database(b / TENANTS_DB).schema_version == SCHEMA_VERSION
    store = TenantStore(b / TENANTS_DB)  # and keeps it
    assert store.identity == given
    store.close()

    empty = tmp_path / "empty"  # into no database: the note, with nothing to compare
    empty.mkdir()
    result = invoke("tenants", "restore", "--state-dir", str(empty), str(old))
    assert result.exit_code == 0, result.output
    assert "note: the backup carries no database id" in result.output
    assert "was not checked" not in result.output, result.output
    done = restore(empty, old)  # again, over that one (tenants, no id): not compared
    assert (done.identity, done.identity_check) == (None, IdentityCheck.BACKUP_WITHOUT_ID)


def test_a_database_from_before_ids_accepts_a_backup_with_a_note(tmp_path: Path) -> None:
    """The state directory's database was written by a release before ids, and no control plane
    of this release has opened it: not compared, said so. Control: the same database with its
    id refuses the same backup."""
    a_id, a_keys = cluster(tmp_path / "a", "acme")
    a_backup = take_backup(tmp_path / "a", tmp_path / "a.backup")
    b = tmp_path / "b"
    cluster(b, "globex")
    result = invoke("tenants", "restore", "--state-dir", str(b), str(a_backup))  # control
    assert_refused(result, "another tenant database")

    without_identity(b / TENANTS_DB)
    assert read_identity(b / TENANTS_DB) is None
    done = restore(b, a_backup)
    assert done.identity_check is IdentityCheck.DATABASE_WITHOUT_ID
    assert (done.identity, done.replaced_identity) == (a_id, None)
    assert tenant_of(b, a_keys["acme"]) == "acme"

    c = tmp_path / "c"
    cluster(c, "globex")
    without_identity(c / TENANTS_DB)
    result = invoke("tenants", "restore", "--state-dir", str(c), str(a_backup))
    assert result.exit_code == 0, result.output
    assert (
        "note: the database it replaced carries no database id (a release before schema 2 "
        "wrote it, and no control plane of this release has opened it), so whether the backup "
        "is of the database it replaced was not checked"
    ) in result.output, result.output


def test_a_database_that_cannot_be_read_does_not_block_a_restore(tmp_path: Path) -> None:
    """Damaged beyond reading (a reason for many restores): its id cannot be compared; the
    backup is restored, saying so, and the damaged file is kept. Control: readable, the same
    database refuses another's backup."""
    _, a_keys = cluster(tmp_path / "a", "acme")
    a_backup = take_backup(tmp_path / "a", tmp_path / "a.backup")
    b = tmp_path / "b"
    cluster(b, "globex")
    with pytest.raises(AnotherDatabase):  # control
        restore(b, a_backup)
    garbage = b"\x00garbage" * 1000
    (b / TENANTS_DB).write_bytes(garbage)
    result = invoke("tenants", "restore", "--state-dir", str(b), str(a_backup))
    assert result.exit_code == 0, result.output
    assert "note: the database it replaced could not be read (damaged?)" in result.output
    assert tenant_of(b, a_keys["acme"]) == "acme"
    [kept] = backups(b)
    assert kept.read_bytes() == garbage
