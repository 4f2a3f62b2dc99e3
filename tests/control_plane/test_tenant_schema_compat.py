"""The tenant database's schema is forward-compatible: a rollback does not break backups.

A later release may only add to the schema (tables; columns with defaults; indexes) and bumps
``PRAGMA user_version``. This release, rolled back to, must go on working on what that release
wrote: back up the live database, restore a backup that release took (saying it came from a newer
schema), and serve, create tenants and keys and authenticate on it, without lowering its version.
What is not a kvfence tenant database (tables or columns this release reads are missing or
retyped) is still refused, and so is one without the keys and constraints this release relies on
(primary keys, UNIQUE, the foreign key, NOT NULL), with a column its INSERTs cannot fill (NOT NULL
without a default), saying schema 1 or later without model_access, or saying schema 2 or later
without database_identity (the database's id). The version is set, and the id made, on a new
database and on one from before versioning or from before ids (schema 1).
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import structlog
from cp_harness import make_cluster, start_on
from test_cp_backup import (
    _quiet_logs,  # noqa: F401  (autouse: the CLI's output without logs)
    assert_refused,
    authenticates,
    invoke,
    run_cli,
)
from test_model_access_persist import old_database

from control_plane.tenants import (
    SCHEMA_VERSION,
    TENANTS_DB,
    AlreadyExists,
    NotATenantDatabase,
    SavedAccess,
    TenantLimits,
    TenantStore,
    check_database,
    hash_key,
    read_identity,
    read_model_access,
)
from kvfence.errors import KvfenceError, NotFound

FUTURE = SCHEMA_VERSION + 1
NEWER = f"written by a newer kvfence (schema {FUTURE}, this release knows {SCHEMA_VERSION})"
KEPT = "tables/columns it added are kept but not used by this release"


def future_database(state: Path) -> str:
    """A tenant database as this release makes it, then changed as a later release would (the
    additive rule): a column with a default on each table, NOT NULL among them, a new table
    referring to tenants, an index, a higher user_version. Returns tenant acme's key."""
    store = TenantStore(state / TENANTS_DB)
    _, api_key, _ = store.create_tenant("acme", TenantLimits(max_tokens_per_request=64))
    store.save_model_access("test-model", True, "", "2030-01-01T00:00:00Z")
    store.close()
    db = sqlite3.connect(state / TENANTS_DB, isolation_level=None)
    db.executescript(
        f"""
        ALTER TABLE tenants ADD COLUMN region TEXT NOT NULL DEFAULT 'eu-west';
        ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT 'generate';
        ALTER TABLE model_access ADD COLUMN drain_s INTEGER NOT NULL DEFAULT 30;
        CREATE TABLE future_thing (
            id INTEGER PRIMARY KEY,
            tenant TEXT NOT NULL REFERENCES tenants(name),
            note TEXT NOT NULL
        );
        INSERT INTO future_thing (tenant, note) VALUES ('acme', 'kept');
        CREATE INDEX tenants_by_region ON tenants (region);
        PRAGMA user_version = {FUTURE};
        PRAGMA journal_mode = DELETE;
        """
    )
    db.close()
    return api_key


def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def assert_future_kept(path: Path) -> None:
    """What the later release added is still there, as it left it."""
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT tenant, note FROM future_thing").fetchall() == [("acme", "kept")]
        assert db.execute("SELECT region FROM tenants WHERE name = 'acme'").fetchone() == (
            "eu-west",
        )
        assert db.execute("PRAGMA user_version").fetchone() == (FUTURE,)
    finally:
        db.close()


def same_database(backup: Path, of: Path) -> None:
    """``backup`` given the id of the database ``of``: what a later release's backup of that
    database (after an upgrade, before a rollback) carries."""
    identity = read_identity(of)
    assert identity is not None
    db = sqlite3.connect(backup, isolation_level=None)
    db.execute(
        "UPDATE database_identity SET database_id = ?, created_at = ?",
        (identity.database_id, identity.created_at),
    )
    db.close()


def newer_warnings(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in logs if "newer kvfence" in str(e["event"])]


# -- a later release's database --------------------------------------------------------------------


def test_check_database_accepts_a_later_releases_database(tmp_path: Path) -> None:
    future_database(tmp_path)
    checked = check_database(tmp_path / TENANTS_DB)
    assert (checked.tenants, checked.keys, checked.schema_version) == (1, 1, FUTURE)
    assert checked.newer
    # control: this release's own database is not "newer"
    store = TenantStore(tmp_path / "current" / TENANTS_DB)
    store.create_tenant("acme", TenantLimits())
    store.close()
    checked = check_database(tmp_path / "current" / TENANTS_DB)
    assert (checked.tenants, checked.keys, checked.schema_version) == (1, 1, SCHEMA_VERSION)
    assert not checked.newer


async def test_backup_over_a_live_control_plane_on_a_later_releases_database(
    tmp_path: Path,
) -> None:
    """Rolled back: the live database is the later release's; `tenants backup` takes it whole,
    says so, and the later release's additions are in the backup."""
    state = tmp_path / "state"
    api_key = future_database(state)
    c = await start_on(state)
    try:
        assert await authenticates(c, api_key)
        out = tmp_path / "tenants.backup"
        result = await run_cli(
            "tenants", "backup", str(out),
            "--target", c.admin_target, "--admin-token", c.cp.admin_token,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "backed up 1 tenants and 1 API keys" in result.output, result.output
        assert f"note: the tenant database was {NEWER}: {KEPT}" in result.output, result.output
    finally:
        await c.close()
    assert_future_kept(out)
    assert_future_kept(state / TENANTS_DB)  # and the live one is not downgraded either


async def test_restore_of_a_later_releases_backup_says_so_and_serves(tmp_path: Path) -> None:
    future = tmp_path / "future"
    api_key = future_database(future)
    (tmp_path / "future.backup").write_bytes((future / TENANTS_DB).read_bytes())
    state = tmp_path / "state"
    c = await make_cluster(state)  # this release's database, with another acme key
    (tmp_path / "current.backup").write_bytes(c.cp.tenants.snapshot())
    await c.close()
    # a backup of another database is refused whatever release took it (its id is compared) ...
    result = await run_cli(
        "tenants", "restore", "--state-dir", str(state), str(tmp_path / "future.backup")
    )
    assert result.exit_code == 1 and "another tenant database" in result.output, result.output
    # ... the later release's backup of this database (a rollback) is restored
    same_database(tmp_path / "future.backup", state / TENANTS_DB)

    result = await run_cli(
        "tenants", "restore", "--state-dir", str(state), str(tmp_path / "future.backup")
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("restored 1 tenants and 1 API keys"), result.output
    assert f"warning: the backup was {NEWER}: {KEPT}" in result.output, result.output
    assert "kvfence model status" in result.output
    assert_future_kept(state / TENANTS_DB)
    c = await start_on(state)
    try:
        assert await authenticates(c, api_key)
        assert c.cp.tenants.get("acme").limits == TenantLimits(max_tokens_per_request=64)
    finally:
        await c.close()
    assert_future_kept(state / TENANTS_DB)

    # control: a backup of this release's database restores without that warning
    result = await run_cli(
        "tenants", "restore", "--state-dir", str(state), str(tmp_path / "current.backup")
    )
    assert result.exit_code == 0, result.output
    assert "newer kvfence" not in result.output, result.output
    assert user_version(state / TENANTS_DB) == SCHEMA_VERSION


def test_a_tenant_store_on_a_later_releases_database_works_and_keeps_its_version(
    tmp_path: Path,
) -> None:
    """Creates tenants and keys (the later release's NOT NULL columns take their defaults),
    authenticates, revokes, changes limits and the kill switch; warns once, naming both
    versions; leaves user_version and the later release's data as they were."""
    acme_key = future_database(tmp_path)
    with structlog.testing.capture_logs() as logs:
        store = TenantStore(tmp_path / TENANTS_DB)
    try:
        [warning] = newer_warnings(logs)
        assert warning["log_level"] == "warning"
        assert warning["event"] == f"the tenant database was {NEWER}: {KEPT}"
        assert (warning["schema_version"], warning["release_schema_version"]) == (
            FUTURE,
            SCHEMA_VERSION,
        )
        assert store.schema_version == FUTURE

        tenant, initech_key, initech_id = store.create_tenant("initech", TenantLimits(2, 32, True))
        assert tenant.limits == TenantLimits(2, 32, True)
        rotated_key, _ = store.create_key("acme")
        for key, name in ((acme_key, "acme"), (initech_key, "initech"), (rotated_key, "acme")):
            found = store.authenticate(key)
            assert found is not None and found.name == name
        store.revoke_key(initech_id)
        assert store.authenticate(initech_key) is None
        assert store.set_limits("acme", TenantLimits(1, 8)).limits == TenantLimits(1, 8)
        store.save_model_access("test-model", False, "incident", "2030-01-02T00:00:00Z")
        assert store.model_access() == (
            SavedAccess("test-model", False, "incident", "2030-01-02T00:00:00Z"),
        )
        assert [t.name for t in store.list()] == ["acme", "initech"]
    finally:
        store.close()

    db = sqlite3.connect(tmp_path / TENANTS_DB)
    try:
        assert db.execute("SELECT name, region FROM tenants ORDER BY name").fetchall() == [
            ("acme", "eu-west"),
            ("initech", "eu-west"),
        ]
        assert {s for (s,) in db.execute("SELECT scopes FROM api_keys")} == {"generate"}
        assert db.execute("SELECT drain_s FROM model_access").fetchall() == [(30,)]
    finally:
        db.close()
    assert_future_kept(tmp_path / TENANTS_DB)
    assert read_model_access(tmp_path / TENANTS_DB) == (
        SavedAccess("test-model", False, "incident", "2030-01-02T00:00:00Z"),
    )

    # control: this release's own database opens without the warning
    with structlog.testing.capture_logs() as logs:
        TenantStore(tmp_path / "current" / TENANTS_DB).close()
    assert newer_warnings(logs) == []


# -- the schema version ----------------------------------------------------------------------------


def test_user_version_is_set_on_a_new_database_and_on_one_from_before_versioning(
    tmp_path: Path,
) -> None:
    new = tmp_path / "new" / TENANTS_DB
    TenantStore(new).close()
    assert user_version(new) == SCHEMA_VERSION

    old = tmp_path / "old"
    old.mkdir()
    api_key = old_database(old)
    assert user_version(old / TENANTS_DB) == 0  # as a release before versioning left it
    assert check_database(old / TENANTS_DB).schema_version == 0  # still a tenant database
    with structlog.testing.capture_logs() as logs:
        store = TenantStore(old / TENANTS_DB)
    try:
        assert store.schema_version == 0
        found = store.authenticate(api_key)
        assert found is not None and found.name == "acme"
        assert store.model_access() == ()  # the table it lacked is added
    finally:
        store.close()
    assert newer_warnings(logs) == []
    assert user_version(old / TENANTS_DB) == SCHEMA_VERSION
    identity = read_identity(old / TENANTS_DB)
    assert identity is not None and store.identity == identity  # given an id
    TenantStore(old / TENANTS_DB).close()  # and opened again, it stays there
    assert user_version(old / TENANTS_DB) == SCHEMA_VERSION
    assert read_identity(old / TENANTS_DB) == identity  # the id too


def test_a_database_of_schema_1_is_upgraded_to_2_with_an_id(tmp_path: Path) -> None:
    """As the release before ids left it (user_version 1, no database_identity): a TenantStore
    adds the table with a new id, raises the version, and keeps both on reopening; its tenants
    and keys are as they were."""
    store = TenantStore(tmp_path / TENANTS_DB)
    _, api_key, _ = store.create_tenant("acme", TenantLimits())
    store.close()
    db = sqlite3.connect(tmp_path / TENANTS_DB, isolation_level=None)
    db.execute("DROP TABLE database_identity")
    db.execute("PRAGMA user_version = 1")
    db.close()
    checked = check_database(tmp_path / TENANTS_DB)
    assert (checked.schema_version, checked.identity) == (1, None)

    store = TenantStore(tmp_path / TENANTS_DB)
    try:
        assert store.schema_version == 1
        assert store.identity is not None
        found = store.authenticate(api_key)
        assert found is not None and found.name == "acme"
    finally:
        store.close()
    identity = store.identity
    assert user_version(tmp_path / TENANTS_DB) == SCHEMA_VERSION == 2
    assert read_identity(tmp_path / TENANTS_DB) == identity
    TenantStore(tmp_path / TENANTS_DB).close()
    assert read_identity(tmp_path / TENANTS_DB) == identity


# -- still refused: not a kvfence tenant database --------------------------------------------------


def without_api_keys(db: sqlite3.Connection) -> None:
    db.execute("DROP TABLE api_keys")


def rebuild_tenants(db: sqlite3.Connection, columns: str, copied: str) -> None:
    db.execute("PRAGMA foreign_keys = OFF")
    db.execute(f"CREATE TABLE tenants_new ({columns})")
    db.execute(f"INSERT INTO tenants_new SELECT {copied} FROM tenants")
    db.execute("DROP TABLE tenants")
    db.execute("ALTER TABLE tenants_new RENAME TO tenants")


def tenants_without_scrub_on_free(db: sqlite3.Connection) -> None:
    """``tenants`` lacking a column this release reads (a later release that broke the rule)."""
    rebuild_tenants(
        db,
        "name TEXT PRIMARY KEY, max_concurrent_requests INTEGER NOT NULL DEFAULT 0, "
        "max_tokens_per_request INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL, "
        "region TEXT NOT NULL DEFAULT 'eu-west'",
        "name, max_concurrent_requests, max_tokens_per_request, created_at, 'eu-west'",
    )


def tenants_with_a_retyped_column(db: sqlite3.Connection) -> None:
    rebuild_tenants(
        db,
        "name TEXT PRIMARY KEY, max_concurrent_requests TEXT NOT NULL DEFAULT '', "
        "max_tokens_per_request INTEGER NOT NULL DEFAULT 0, "
        "scrub_on_free INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL",
        "name, 'lots', max_tokens_per_request, scrub_on_free, created_at",
    )


BROKEN: list[tuple[Callable[[sqlite3.Connection], None], str]] = [
    (without_api_keys, "no table api_keys"),
    (tenants_without_scrub_on_free, "table tenants has no column scrub_on_free"),
    (tenants_with_a_retyped_column, "column tenants.max_concurrent_requests is TEXT, not INTEGER"),
]


def broken_database(
    state: Path, damage: Callable[[sqlite3.Connection], None], version: int
) -> None:
    """One from before versioning (no model_access), damaged, with ``version``."""
    state.mkdir(parents=True)
    old_database(state)
    db = sqlite3.connect(state / TENANTS_DB, isolation_level=None)
    damage(db)
    db.execute(f"PRAGMA user_version = {version}")
    db.close()


@pytest.mark.parametrize("version", [0, FUTURE], ids=["unversioned", "newer"])
@pytest.mark.parametrize(("damage", "problem"), BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_what_lacks_a_table_or_column_this_release_reads_is_refused(
    tmp_path: Path, damage: Callable[[sqlite3.Connection], None], problem: str, version: int
) -> None:
    """As today (a newer user_version does not excuse it): check_database, `tenants restore`
    (changing nothing), and a TenantStore where it cannot add what is missing (a column; it adds
    a missing table, as it always did), which then changes nothing and lets go of the directory.
    Controls: the same database before the damage is accepted."""
    bad = tmp_path / "bad"
    broken_database(bad, damage, version)
    with pytest.raises(NotATenantDatabase) as err:
        check_database(bad / TENANTS_DB, "the backup")
    message = str(err.value)
    assert message.startswith("the backup is a SQLite database but not a kvfence tenant database")
    assert problem in message
    assert (f"it says schema {FUTURE}" in message) == (version == FUTURE)

    state = tmp_path / "state"
    store = TenantStore(state / TENANTS_DB)
    store.create_tenant("acme", TenantLimits())
    store.close()
    before = (state / TENANTS_DB).read_bytes()
    result = invoke("tenants", "restore", "--state-dir", str(state), str(bad / TENANTS_DB))
    assert_refused(result, "refusing to restore", "not a kvfence tenant database", problem)
    assert (state / TENANTS_DB).read_bytes() == before
    assert not list(state.glob(f"{TENANTS_DB}.bak-*"))

    if damage is not without_api_keys:
        copy = tmp_path / "copy"
        copy.mkdir()
        shutil.copy(bad / TENANTS_DB, copy / TENANTS_DB)
        with pytest.raises(NotATenantDatabase, match=problem):
            TenantStore(copy / TENANTS_DB)
        db = sqlite3.connect(copy / TENANTS_DB)  # nothing added, the version not raised
        assert (
            db.execute("SELECT name FROM sqlite_master WHERE name = 'model_access'").fetchall()
            == []
        )
        assert db.execute("PRAGMA user_version").fetchone() == (version,)
        db.close()
        TenantStore(tmp_path / "other" / TENANTS_DB).close()  # control: a sound one opens ...
        (copy / TENANTS_DB).unlink()
        TenantStore(copy / TENANTS_DB).close()  # ... and the lock was let go

    good = tmp_path / "good"  # control: undamaged, the same database is accepted
    good.mkdir()
    old_database(good)
    assert check_database(good / TENANTS_DB).tenants == 1
    result = invoke("tenants", "restore", "--state-dir", str(state), str(good / TENANTS_DB))
    assert result.exit_code == 0, result.output


# -- refused: without the keys and constraints this release relies on -----------------------------


def rebuild(db: sqlite3.Connection, table: str, columns: str, added: str = "") -> None:
    """``table`` made again with ``columns`` (its columns, named as they were, then the ``added``
    one, set to ``'gold'`` in the rows copied): a later release that broke the additive rule."""
    db.execute("PRAGMA foreign_keys = OFF")
    names = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
    values = [*names, "'gold'"] if added else names
    names = [*names, added] if added else names
    db.execute(f"CREATE TABLE {table}_new ({columns})")
    db.execute(
        f"INSERT INTO {table}_new ({', '.join(names)}) SELECT {', '.join(values)} FROM {table}"
    )
    db.execute(f"DROP TABLE {table}")
    db.execute(f"ALTER TABLE {table}_new RENAME TO {table}")


API_KEYS = (
    "key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(name), "
    "key_sha256 TEXT NOT NULL UNIQUE, revoked INTEGER NOT NULL DEFAULT 0, "
    "created_at TEXT NOT NULL, scopes TEXT NOT NULL DEFAULT 'generate'"
)  # as future_database leaves it


def key_hash_not_unique(db: sqlite3.Connection) -> None:
    rebuild(db, "api_keys", API_KEYS.replace("key_sha256 TEXT NOT NULL UNIQUE", "key_sha256 TEXT"))


def key_hash_unique_only_with_the_tenant(db: sqlite3.Connection) -> None:
    rebuild(
        db,
        "api_keys",
        API_KEYS.replace("key_sha256 TEXT NOT NULL UNIQUE", "key_sha256 TEXT NOT NULL")
        + ", UNIQUE (tenant, key_sha256)",
    )


def api_keys_without_foreign_key(db: sqlite3.Connection) -> None:
    rebuild(db, "api_keys", API_KEYS.replace(" REFERENCES tenants(name)", ""))


def api_keys_keyed_by_hash(db: sqlite3.Connection) -> None:
    rebuild(
        db,
        "api_keys",
        API_KEYS.replace("key_id TEXT PRIMARY KEY", "key_id TEXT NOT NULL UNIQUE").replace(
            "key_sha256 TEXT NOT NULL UNIQUE", "key_sha256 TEXT PRIMARY KEY"
        ),
    )


def model_access_without_primary_key(db: sqlite3.Connection) -> None:
    rebuild(
        db,
        "model_access",
        "model TEXT NOT NULL, online INTEGER NOT NULL CHECK (online IN (0, 1)), "
        "reason TEXT NOT NULL DEFAULT '', since TEXT NOT NULL, drain_s INTEGER NOT NULL DEFAULT 30",
    )


def tenants_with_nullable_created_at(db: sqlite3.Connection) -> None:
    rebuild(
        db,
        "tenants",
        "name TEXT PRIMARY KEY, max_concurrent_requests INTEGER NOT NULL DEFAULT 0, "
        "max_tokens_per_request INTEGER NOT NULL DEFAULT 0, "
        "scrub_on_free INTEGER NOT NULL DEFAULT 0, created_at TEXT, "
        "region TEXT NOT NULL DEFAULT 'eu-west'",
    )


def tenants_with_a_not_null_column_without_default(db: sqlite3.Connection) -> None:
    """A later release that added ``tenants.tier`` NOT NULL without a default (by rebuilding the
    table: ALTER TABLE refuses that): this release's INSERTs into tenants would fail."""
    rebuild(
        db,
        "tenants",
        "name TEXT PRIMARY KEY, max_concurrent_requests INTEGER NOT NULL DEFAULT 0, "
        "max_tokens_per_request INTEGER NOT NULL DEFAULT 0, "
        "scrub_on_free INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL, "
        "region TEXT NOT NULL DEFAULT 'eu-west', tier TEXT NOT NULL",
        added="tier",
    )


def without_model_access(db: sqlite3.Connection) -> None:
    db.execute("DROP TABLE model_access")


def without_database_identity(db: sqlite3.Connection) -> None:
    db.execute("DROP TABLE database_identity")


UNSOUND: list[tuple[Callable[[sqlite3.Connection], None], str]] = [
    (key_hash_not_unique, "table api_keys has no UNIQUE constraint on (key_sha256)"),
    (key_hash_unique_only_with_the_tenant, "no UNIQUE constraint on (key_sha256)"),
    (api_keys_without_foreign_key, "no FOREIGN KEY (tenant) REFERENCES tenants(name)"),
    (api_keys_keyed_by_hash, "the PRIMARY KEY of table api_keys is (key_sha256), not (key_id)"),
    (model_access_without_primary_key, "table model_access has no PRIMARY KEY (model)"),
    (tenants_with_nullable_created_at, "column tenants.created_at is nullable, not NOT NULL"),
    (
        tenants_with_a_not_null_column_without_default,
        "column tenants.tier is NOT NULL without a default (this release's INSERTs into tenants "
        "do not set it)",
    ),
    (
        without_model_access,
        f"no table model_access, which every database of schema 1 or later has (this one says "
        f"{FUTURE})",
    ),
    (
        without_database_identity,
        f"no table database_identity, which every database of schema 2 or later has (this one "
        f"says {FUTURE})",
    ),
]


def unsound_database(state: Path, damage: Callable[[sqlite3.Connection], None]) -> None:
    """A later release's database (``future_database``), then ``damage``d."""
    future_database(state)
    db = sqlite3.connect(state / TENANTS_DB, isolation_level=None)
    damage(db)
    db.close()


def tables_and_version(path: Path) -> tuple[list[str], int]:
    db = sqlite3.connect(path)
    try:
        tables = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return sorted(tables), int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def assert_refused_everywhere(tmp_path: Path, bad: Path, *problems: str) -> None:
    """check_database names every problem; `tenants restore` refuses, changing nothing; a
    TenantStore refuses, adding nothing and leaving the version, and lets go of the directory."""
    with pytest.raises(NotATenantDatabase) as err:
        check_database(bad, "the backup")
    message = str(err.value)
    assert message.startswith("the backup is a SQLite database but not a kvfence tenant database")
    for problem in problems:
        assert problem in message, message

    state = tmp_path / "state"
    store = TenantStore(state / TENANTS_DB)
    store.create_tenant("acme", TenantLimits())
    store.close()
    before = (state / TENANTS_DB).read_bytes()
    result = invoke("tenants", "restore", "--state-dir", str(state), str(bad))
    assert_refused(result, "refusing to restore", "not a kvfence tenant database", *problems)
    assert (state / TENANTS_DB).read_bytes() == before
    assert not list(state.glob(f"{TENANTS_DB}.bak-*"))

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(bad, copy / TENANTS_DB)
    as_it_was = tables_and_version(copy / TENANTS_DB)
    with pytest.raises(NotATenantDatabase) as err:
        TenantStore(copy / TENANTS_DB)
    for problem in problems:
        assert problem in str(err.value), str(err.value)
    assert tables_and_version(copy / TENANTS_DB) == as_it_was
    (copy / TENANTS_DB).unlink()
    TenantStore(copy / TENANTS_DB).close()  # the lock was let go


@pytest.mark.parametrize(("damage", "problem"), UNSOUND, ids=[u[0].__name__ for u in UNSOUND])
def test_a_later_database_without_a_key_or_constraint_this_release_relies_on_is_refused(
    tmp_path: Path, damage: Callable[[sqlite3.Connection], None], problem: str
) -> None:
    """A newer user_version and every column this release reads, with the right types, is not
    enough: the primary keys, UNIQUE constraints, foreign key and NOT NULLs of ``_SCHEMA`` (what
    authentication, the kill switch's upsert and the integrity check rely on) must be there, no
    added column may be NOT NULL without a default (this release's INSERTs would fail), and a
    database saying schema 1 or later must have model_access. Control: the same later database,
    undamaged, is accepted."""
    good = tmp_path / "good"
    future_database(good)
    assert check_database(good / TENANTS_DB).schema_version == FUTURE  # control
    bad = tmp_path / "bad"
    unsound_database(bad, damage)
    assert_refused_everywhere(tmp_path, bad / TENANTS_DB, problem)


def test_a_loose_copy_of_the_tables_is_refused(tmp_path: Path) -> None:
    """The reviewer's database: every table and column by name and type, but no key or constraint,
    two tenants sharing one key hash (both would authenticate with it), no user_version. Control:
    the same rows in a database as kvfence makes it are accepted (but not the shared hash: the
    UNIQUE constraint refuses it)."""
    shared = hash_key("kvf_shared")
    bad = tmp_path / "loose.sqlite3"
    db = sqlite3.connect(bad, isolation_level=None)
    db.executescript(
        f"""
        CREATE TABLE tenants (name TEXT, max_concurrent_requests INTEGER,
            max_tokens_per_request INTEGER, scrub_on_free INTEGER, created_at TEXT);
        CREATE TABLE api_keys (key_id TEXT, tenant TEXT, key_sha256 TEXT, revoked INTEGER,
            created_at TEXT);
        CREATE TABLE model_access (model TEXT, online INTEGER, reason TEXT, since TEXT);
        INSERT INTO tenants VALUES ('a', 0, 0, 0, 'x'), ('b', 0, 0, 0, 'x');
        INSERT INTO api_keys VALUES ('k1', 'a', '{shared}', 0, 'x'),
                                    ('k2', 'b', '{shared}', 0, 'x');
        """
    )
    db.close()
    assert_refused_everywhere(
        tmp_path,
        bad,
        "table tenants has no PRIMARY KEY (name)",
        "table api_keys has no PRIMARY KEY (key_id)",
        "table api_keys has no UNIQUE constraint on (key_sha256)",
        "table api_keys has no FOREIGN KEY (tenant) REFERENCES tenants(name)",
        "table model_access has no PRIMARY KEY (model)",
        "column tenants.created_at is nullable, not NOT NULL",
    )

    good = tmp_path / "good" / TENANTS_DB  # control
    TenantStore(good).close()
    db = sqlite3.connect(good, isolation_level=None)
    db.execute("INSERT INTO tenants VALUES ('a', 0, 0, 0, 'x'), ('b', 0, 0, 0, 'x')")
    db.execute(f"INSERT INTO api_keys VALUES ('k1', 'a', '{shared}', 0, 'x')")
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
        db.execute(f"INSERT INTO api_keys VALUES ('k2', 'b', '{shared}', 0, 'x')")
    db.close()
    assert check_database(good).tenants == 2


def test_model_access_may_be_missing_only_below_schema_1(tmp_path: Path) -> None:
    """Before versioning (0) a database may lack the kill switch's table (releases before the
    saved switch did not make it): accepted, and a TenantStore adds it. From schema 1 on every
    database has it, so one saying 1 without it is refused (the FUTURE case is in UNSOUND)."""
    for version in (0, 1):
        state = tmp_path / f"v{version}"
        future_database(state)
        db = sqlite3.connect(state / TENANTS_DB, isolation_level=None)
        without_model_access(db)
        db.execute(f"PRAGMA user_version = {version}")
        db.close()
    assert check_database(tmp_path / "v0" / TENANTS_DB).schema_version == 0
    store = TenantStore(tmp_path / "v0" / TENANTS_DB)
    assert store.model_access() == ()
    store.close()
    assert user_version(tmp_path / "v0" / TENANTS_DB) == SCHEMA_VERSION
    assert_refused_everywhere(
        tmp_path,
        tmp_path / "v1" / TENANTS_DB,
        "no table model_access, which every database of schema 1 or later has (this one says 1)",
    )


def test_database_identity_may_be_missing_only_below_schema_2(tmp_path: Path) -> None:
    """Before ids (schema 1, and 0) a database may lack database_identity: accepted (with no id),
    and a TenantStore adds it. From schema 2 on every database has it, so one saying 2 without
    it is refused (the FUTURE case is in UNSOUND)."""
    for version in (0, 1, 2):
        state = tmp_path / f"v{version}"
        future_database(state)
        db = sqlite3.connect(state / TENANTS_DB, isolation_level=None)
        without_database_identity(db)
        db.execute(f"PRAGMA user_version = {version}")
        db.close()
    for version in (0, 1):
        path = tmp_path / f"v{version}" / TENANTS_DB
        checked = check_database(path)
        assert (checked.schema_version, checked.identity) == (version, None)
        store = TenantStore(path)
        assert store.identity is not None
        store.close()
        assert user_version(path) == SCHEMA_VERSION
        assert read_identity(path) == store.identity
    assert_refused_everywhere(
        tmp_path,
        tmp_path / "v2" / TENANTS_DB,
        "no table database_identity, which every database of schema 2 or later has (this one "
        "says 2)",
    )


# -- create_tenant: only the name's key means "already exists" -------------------------------------


def a_trigger_wanting_a_plan(db: sqlite3.Connection) -> None:
    db.execute(
        "CREATE TRIGGER tenants_need_a_plan BEFORE INSERT ON tenants WHEN NEW.name <> 'acme' "
        "BEGIN SELECT RAISE(ABORT, 'a new tenant needs a plan'); END"
    )


REFUSING_INSERTS: list[tuple[Callable[[sqlite3.Connection], None], str]] = [
    (a_trigger_wanting_a_plan, "(a new tenant needs a plan; SQLITE_CONSTRAINT_TRIGGER)"),
    (
        tenants_with_a_not_null_column_without_default,
        "(NOT NULL constraint failed: tenants.tier; SQLITE_CONSTRAINT_NOTNULL)",
    ),
]


@pytest.mark.parametrize(
    ("change", "named"), REFUSING_INSERTS, ids=[r[0].__name__ for r in REFUSING_INSERTS]
)
def test_create_tenant_says_already_exists_only_for_the_name(
    tmp_path: Path, change: Callable[[sqlite3.Connection], None], named: str
) -> None:
    """A constraint other than the name's key refusing the INSERT (a later release's trigger,
    which the schema check does not look at, or a NOT NULL column without a default made while
    the store was open: both break the additive rule) is an internal error naming it, not
    ALREADY_EXISTS: the tenant does not exist. Control: a tenant that does exist is
    ALREADY_EXISTS (before the change: SQLite checks NOT NULL before the keys)."""
    future_database(tmp_path)
    store = TenantStore(tmp_path / TENANTS_DB)
    try:
        with pytest.raises(AlreadyExists, match="tenant 'acme' already exists"):
            store.create_tenant("acme", TenantLimits())  # control
        db = sqlite3.connect(tmp_path / TENANTS_DB, isolation_level=None)
        change(db)
        db.close()
        with pytest.raises(KvfenceError) as err:
            store.create_tenant("initech", TenantLimits())
        assert not isinstance(err.value, AlreadyExists)
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert err.value.reason == "TENANT_NOT_SAVED"
        message = str(err.value)
        assert "tenant 'initech' was not created: the state database refused it" in message
        assert named in message, message
        with pytest.raises(NotFound):
            store.get("initech")
    finally:
        store.close()
