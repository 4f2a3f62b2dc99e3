"""Tenants, API keys and limits in a SQLite file under ``state_dir`` (WAL mode, survives restarts),
and the operator's kill switch (``model_access``), which must survive restarts too.

An API key is 256 random bits, shown once at creation; the store keeps only its SHA-256, so a copy
of the database does not let anyone call the API. Every authentication reads the database, so a
revoked key is refused from the next request on; the requests already sent with it, queued or
running, end UNAUTHENTICATED ``API_KEY_REVOKED`` (the admin API's RevokeKey). New limits
(SetLimits) reach the requests still waiting for pages too: those the limits refuse end as a new
request would be refused, the oldest kept first, and the rest reserve under them; running requests
go on. Calls are short
and local, so they run inline on the event loop; a backup (:meth:`TenantStore.snapshot`) is not,
and runs in a worker thread.

One control plane per state directory: the store holds an exclusive ``flock`` on
``<state_dir>/tenants.sqlite3.lock`` for as long as it is open, so a second control plane on the
same directory fails to start, and :func:`restore` (offline: it replaces the database file)
refuses while a control plane runs on it.

The schema is versioned in ``PRAGMA user_version`` (:data:`SCHEMA_VERSION`), so that backups
survive upgrades *and rollbacks*: an operator who rolls back a release must still be able to back
up the live database and restore a backup the later release took, and a later release must open
and restore what an earlier one wrote. Versions:

- 0: a database from before versioning (releases before schema 1): ``tenants`` and ``api_keys``,
  and ``model_access`` if the release that wrote it saved the kill switch (the release just before
  schema 1 did, and created the same three tables as schema 1; earlier releases did not have it).
- 1 (the first versioned release): ``tenants``, ``api_keys`` and ``model_access``, always (a
  TenantStore adds ``model_access`` to a version-0 database that lacks it).
- 2 (this release): those, and ``database_identity``: one row, the database's random id and its
  creation time, made once with the table (in a new database, or by a TenantStore opening an older
  one) and never changed. A backup is a page copy, so it carries the id: :func:`restore` refuses,
  unless told otherwise, a backup of another database over one that holds tenants.

:class:`TenantStore` sets ``user_version`` to :data:`SCHEMA_VERSION` when it creates or upgrades a
database, never lowers it (a database a later release wrote opens and works, with a warning), and
:func:`check_database` accepts any database holding every table and column this release reads and
writes as :data:`_SCHEMA` declares them (type, NOT NULL, primary key, UNIQUE constraints, foreign
keys), whatever else it holds, as long as this release's INSERTs still work on it (no added NOT
NULL column without a default). That works only while every later release keeps to this rule:

    **Schema changes are additive only, and bump user_version.** Add tables; add columns only with
    ``ALTER TABLE ... ADD COLUMN`` and a default (NOT NULL only with a non-NULL default), so that
    an older release's INSERTs, which name their columns, still work; never rename, drop or retype
    a table or column an older release reads, and add no trigger or constraint that refuses what
    an older release writes. Then increment :data:`SCHEMA_VERSION`, list it above, and upgrade in
    :class:`TenantStore` (``_SCHEMA``'s ``CREATE ... IF NOT EXISTS`` and the added columns; an
    added table goes in ``_ADDED_TABLES`` with the new version).

What a later release adds is kept by an older one (a restore copies the file whole; a backup is a
page copy) but not used: e.g. a setting that release introduced has no effect after a rollback.

An index that is not UNIQUE (:data:`_INDEXES`) is not a schema change in that sense and bumps no
version: it refuses nothing an older release writes and changes nothing any release reads (SQLite
keeps it up to date and uses it for an older release's queries too), so a version saying "has it"
would buy nothing and make a rollback warn of a newer database for no reason. A TenantStore
creates it ``IF NOT EXISTS`` whenever it opens a database it can use, whatever its version, so a
database of an earlier release gets it on first open; :func:`check_database` does not require it.

Authentication reads one API key by its hash (``key_sha256``'s UNIQUE index) and its tenant by
name: its cost does not grow with the number of keys, of the tenant or of anyone. Keys are never
deleted (a revoked one stays, and each ``kvfence up`` revokes the demo tenant's key and issues
another), so the tenant it returns carries no key list; the admin paths that show a tenant's keys
(:meth:`TenantStore.get`, :meth:`TenantStore.list`, and what creates tenants or sets limits)
load them, through the ``api_keys_tenant`` index.
"""

from __future__ import annotations

import calendar
import contextlib
import enum
import hashlib
import io
import os
import re
import secrets
import shutil
import socket
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import grpc

from kvfence.errors import IntegrityError, InvalidArgument, KvfenceError, NotFound
from kvfence.filelock import LockHeld, hold_lock
from kvfence.logging import get_logger

log = get_logger("tenants")

TENANTS_DB = "tenants.sqlite3"  # the database's file name in the state directory
KEY_PREFIX = "kvf_"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # whole name: fullmatch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    max_concurrent_requests INTEGER NOT NULL DEFAULT 0,
    max_tokens_per_request INTEGER NOT NULL DEFAULT 0,
    scrub_on_free INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name),
    key_sha256 TEXT NOT NULL UNIQUE,
    revoked INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS model_access (
    model TEXT PRIMARY KEY,
    online INTEGER NOT NULL CHECK (online IN (0, 1)),
    reason TEXT NOT NULL DEFAULT '',
    since TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS database_identity (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    database_id TEXT NOT NULL,
    created_at TEXT NOT NULL
);
"""
# Tables of _SCHEMA that older releases did not create, each with the schema version from which
# every database has it: a database (a backup) below that version may lack it and is still a tenant
# database (opening it in a TenantStore adds the table); one at or above it may not.
_ADDED_TABLES = {"model_access": 1, "database_identity": 2}
# Indexes that only make reads cheaper (none UNIQUE: a UNIQUE one is a constraint, which goes in
# _SCHEMA and is versioned). Not versioned (see the module's docstring): a TenantStore creates them
# on every database it opens, after _schema_problems has accepted it (an index on a column the
# database lacks would fail before the problem could be said). api_keys_tenant: a tenant's keys in
# created order (the admin listing) without scanning every tenant's keys.
_INDEXES = """
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys(tenant, created_at);
"""
# The schema version this release writes in PRAGMA user_version (see the module's docstring for
# the versions and the rule every later release must follow: additive changes only).
SCHEMA_VERSION = 2
# The first schema whose databases carry an id (database_identity): a database or backup of an
# older one has none until a TenantStore opens it.
IDENTITY_SCHEMA = _ADDED_TABLES["database_identity"]


class AlreadyExists(KvfenceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class StateDirInUse(RuntimeError):
    """Another process (a control plane, or a restore) holds the state directory's lock."""


class NotATenantDatabase(ValueError):
    """A file offered for restore is not a sound kvfence tenant database."""


@dataclass(frozen=True)
class DatabaseIdentity:
    """A tenant database's id (random, made with the database: its backups carry it) and when it
    was made (UTC, :data:`UTC_FORMAT`)."""

    database_id: str
    created_at: str


class AnotherDatabase(ValueError):
    """A backup offered for restore is of another tenant database than the state directory's,
    which holds tenants: restored, the other database's tenants and keys would serve here and
    these would be refused. :func:`restore` refuses it unless ``from_another_database``."""

    def __init__(
        self, name: str, backup: DatabaseIdentity, current: DatabaseIdentity, tenants: int
    ):
        self.backup = backup
        self.current = current
        super().__init__(
            f"{name} is a backup of another tenant database (id {backup.database_id}, created "
            f"{backup.created_at}) than the one it would replace (id {current.database_id}, "
            f"created {current.created_at}, {tenants} tenants): restored, that database's tenants "
            "and keys would work here and these would be refused. Restore a backup of this "
            "database; or, if replacing it is meant (moving tenants from another state "
            "directory, or a database started afresh after the volume was lost), pass "
            "--from-another-database (the replaced database is kept as tenants.sqlite3.bak-<time>)"
        )


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; 0 means "no limit of its own" (the admissible limit still applies)."""

    max_concurrent_requests: int = 0
    max_tokens_per_request: int = 0
    scrub_on_free: bool = False


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    revoked: bool
    created_at: str


# TenantLimits' fields, which are also the tenants table's columns (SetLimitsRequest.fields).
LIMIT_FIELDS = ("max_concurrent_requests", "max_tokens_per_request", "scrub_on_free")


@dataclass(frozen=True)
class Tenant:
    """A tenant and its limits; ``keys``: its API keys, oldest first, revoked ones included, only
    where the admin API shows them (:meth:`TenantStore.get`, :meth:`~TenantStore.list`,
    :meth:`~TenantStore.create_tenant`, :meth:`~TenantStore.set_limits`).

    The tenant :meth:`TenantStore.authenticate` returns carries no key list (``keys`` is empty,
    whatever keys the tenant has): every request keeps it for its whole life, and keys are never
    deleted, so loading them would cost each request time and memory growing with the tenant's key
    history. Read a tenant's keys from :meth:`TenantStore.get`."""

    name: str
    limits: TenantLimits
    keys: tuple[KeyInfo, ...] = field(default=())


@dataclass(frozen=True)
class SavedAccess:
    """One model's kill switch as saved; ``since``: when it last went online or offline (UTC)."""

    model: str
    online: bool
    reason: str
    since: str


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # every time the database holds


def utc_now() -> str:
    return time.strftime(UTC_FORMAT, time.gmtime())


def utc_seconds(text: str) -> float:
    """Unix time of a :data:`UTC_FORMAT` time."""
    return float(calendar.timegm(time.strptime(text, UTC_FORMAT)))


def _check_limits(limits: TenantLimits) -> None:
    for name in ("max_concurrent_requests", "max_tokens_per_request"):
        value = getattr(limits, name)
        if not 0 <= value < 2**31:
            raise InvalidArgument(f"{name} must be between 0 and 2^31-1, got {value}")


def lock_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".lock")


def lock_state(db_path: Path, user: str) -> int:
    """Take the exclusive lock on ``db_path``'s state directory; returns the lock's fd (closing
    it releases the lock, as does the process's exit). ``user`` says who holds it, for the message
    another process gets. Raises :class:`StateDirInUse` when it is held."""
    path = lock_path(db_path)
    try:
        return hold_lock(path, f"{user} (pid {os.getpid()} on {socket.gethostname()})")
    except LockHeld as held:
        raise StateDirInUse(
            f"the state directory {db_path.parent} is in use ({held.held_by or 'another process'}"
            f" holds {path}): one control plane per state directory, and restore only while none "
            "runs on it"
        ) from None


class TenantStore:
    """The tenant database; one instance per control plane process, and per state directory."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock: int | None = lock_state(path, "a control plane")
        try:
            # Key hashes: owner only. SQLite gives its -wal and -shm the database's mode; an
            # older database (or one a restore left) is made private too.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            for p in (path, *(Path(f"{path}{s}") for s in ("-wal", "-shm"))):
                if p.exists():
                    os.chmod(p, 0o600)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            # A commit is on disk when it returns (WAL's usual NORMAL may lose the last ones to a
            # power cut): an acknowledged kill switch or key revocation must not come undone.
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            # The schema version the database says it has (0: from before versioning); never
            # lowered. A later release's database opens and works: what it added is not used.
            self.schema_version = self._upgrade()
            # The database's id, made with it (or by the upgrade above) and never changed.
            self.identity = _identity(self._db)
            if self.schema_version > SCHEMA_VERSION:
                log.warning(
                    newer_schema_note(self.schema_version, "the tenant database"),
                    path=str(path),
                    schema_version=self.schema_version,
                    release_schema_version=SCHEMA_VERSION,
                )
        except BaseException:
            self._unlock()
            raise

    def _upgrade(self) -> int:
        """Create the tables of this release's schema that the database lacks (a new database, or
        one of an older release), give it its id if it has none (``database_identity`` was just
        made) and raise its user_version to :data:`SCHEMA_VERSION`, in one transaction; returns
        the version it had. NotATenantDatabase, changing nothing, when it is not a database this
        release can use (:func:`_schema_problems`)."""
        found = _user_version(self._db)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            # Checked before the tables are added: a database that says it has a schema with
            # a table it lacks is refused, not mended (saying all that is wrong with it).
            if not _missing_added_tables(set(_table_names(self._db)), found):
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
            problems = _schema_problems(self._db, found)
            if problems:
                raise NotATenantDatabase(_not_tenant_db(str(self.path), self._db, problems, found))
            # Whatever its version: a database of an earlier release gets them here (unversioned,
            # see the module's docstring).
            for statement in _INDEXES.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            if _identity(self._db) is None:
                # Only ever into an empty table: an id, once made, is never changed.
                self._db.execute(
                    "INSERT INTO database_identity (singleton, database_id, created_at) "
                    "VALUES (1, ?, ?)",
                    (uuid.uuid4().hex, utc_now()),
                )
            if found < SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return found

    def close(self) -> None:
        self._db.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def snapshot(self) -> bytes:
        """A consistent copy of the database, as one self-contained SQLite file (no -wal).

        SQLite's online backup API, in one step on a connection of its own: it reads one
        snapshot of the database while this store's connection goes on writing (WAL readers and
        the writer do not block each other). Blocking (disk I/O): call it in a worker thread.
        IntegrityError (DATA_LOSS) when the copy fails SQLite's integrity check: the database
        itself is damaged, and no backup is better than a damaged one.
        """
        try:
            # In the state directory: the chart's pods have a read-only root file system, and no
            # /tmp of their own; the state volume is writable (and as private as the database).
            with tempfile.TemporaryDirectory(prefix=".backup-", dir=self.path.parent) as tmp:
                copy = Path(tmp) / TENANTS_DB
                src = sqlite3.connect(self.path, timeout=30.0)
                try:
                    dst = sqlite3.connect(copy, isolation_level=None)
                    try:
                        src.backup(dst)  # pages=-1: every page in one step, one read transaction
                        # The copy carries the source's WAL flag; a backup file stands alone.
                        dst.execute("PRAGMA journal_mode=DELETE")
                        _check_integrity(dst, "the tenant database")
                    finally:
                        dst.close()
                finally:
                    src.close()
                return copy.read_bytes()
        except NotATenantDatabase as err:
            raise IntegrityError(str(err), reason="TENANT_DATABASE_DAMAGED") from None
        except (sqlite3.Error, OSError) as err:
            raise KvfenceError(f"the backup of the tenant database failed: {err}") from None

    def create_tenant(self, name: str, limits: TenantLimits) -> tuple[Tenant, str, str]:
        """Create ``name`` with one API key; returns (tenant, api_key, key_id)."""
        if not TENANT_NAME.fullmatch(name):
            raise InvalidArgument(
                f"tenant name {name!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
        _check_limits(limits)
        try:
            with self._tx():
                self._db.execute(
                    "INSERT INTO tenants (name, max_concurrent_requests, max_tokens_per_request, "
                    "scrub_on_free, created_at) VALUES (?, ?, ?, ?, ?)",
                    (
                        name,
                        limits.max_concurrent_requests,
                        limits.max_tokens_per_request,
                        int(limits.scrub_on_free),
                        utc_now(),
                    ),
                )
                api_key, key_id = self._insert_key(name)
        except sqlite3.IntegrityError as err:
            # Only the tenant name's key means the tenant exists; any other constraint (a NOT NULL,
            # CHECK or trigger of a database that breaks the additive rule) is the database's
            # fault, not the caller's.
            if _is_unique_violation(err, "tenants.name"):
                raise AlreadyExists(f"tenant {name!r} already exists") from None
            raise KvfenceError(
                f"tenant {name!r} was not created: the state database refused it ({err}; "
                f"{getattr(err, 'sqlite_errorname', 'no error name')})",
                reason="TENANT_NOT_SAVED",
            ) from None
        return self.get(name), api_key, key_id

    def get(self, name: str) -> Tenant:
        row = self._db.execute(
            "SELECT name, max_concurrent_requests, max_tokens_per_request, scrub_on_free "
            "FROM tenants WHERE name = ?",
            (name,),
        ).fetchone()
        if row is None:
            raise NotFound(f"tenant {name!r} does not exist")
        return self._tenant(row)

    def list(self, names: Iterable[str] | None = None) -> list[Tenant]:
        """Every tenant (``names`` None), or only those named (an empty ``names``: none); a name
        no tenant has is left out, not an error. Ordered by name, each once. A named tenant is
        read by its primary key, and only the tenants returned have their keys loaded: asking
        for one of many costs one tenant's reads (``kvfence tenants set-limits`` asks for its
        own before every change)."""
        columns = "name, max_concurrent_requests, max_tokens_per_request, scrub_on_free"
        if names is None:
            rows = self._db.execute(f"SELECT {columns} FROM tenants ORDER BY name").fetchall()
        else:
            # One lookup per name rather than one IN (...): SQLite bounds the parameters of a
            # statement (999 before 3.32), and a caller may name more.
            found = (
                self._db.execute(f"SELECT {columns} FROM tenants WHERE name = ?", (n,)).fetchone()
                for n in sorted(set(names))
            )
            rows = [row for row in found if row is not None]
        return [self._tenant(row) for row in rows]

    def set_limits(
        self, name: str, limits: TenantLimits, fields: Iterable[str] | None = None
    ) -> Tenant:
        """Set ``fields`` of ``limits`` (all of them when None or empty); the others keep their
        stored value, in one statement (nobody's change in between is undone)."""
        _check_limits(limits)
        chosen = set(fields or LIMIT_FIELDS)
        unknown = sorted(chosen - set(LIMIT_FIELDS))
        if unknown:
            raise InvalidArgument(
                f"unknown limit field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(LIMIT_FIELDS)}"
            )
        values = {
            "max_concurrent_requests": limits.max_concurrent_requests,
            "max_tokens_per_request": limits.max_tokens_per_request,
            "scrub_on_free": int(limits.scrub_on_free),
        }
        columns = [f for f in LIMIT_FIELDS if f in chosen]  # names from LIMIT_FIELDS only
        cur = self._db.execute(
            f"UPDATE tenants SET {', '.join(f'{c} = ?' for c in columns)} WHERE name = ?",
            (*(values[c] for c in columns), name),
        )
        if cur.rowcount == 0:
            raise NotFound(f"tenant {name!r} does not exist")
        return self.get(name)

    def create_key(self, name: str) -> tuple[str, str]:
        """Another API key for tenant ``name``; returns (api_key, key_id). NotFound if no such
        tenant."""
        self.get(name)
        with self._tx():
            return self._insert_key(name)

    def _insert_key(self, name: str) -> tuple[str, str]:
        """A new key for ``name``, stored hashed (inside the caller's transaction)."""
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)  # 32 bytes = 256 bits
        key_id = "key_" + secrets.token_hex(8)
        self._db.execute(
            "INSERT INTO api_keys (key_id, tenant, key_sha256, revoked, created_at) "
            "VALUES (?, ?, ?, 0, ?)",
            (key_id, name, hash_key(api_key), utc_now()),
        )
        return api_key, key_id

    def revoke_key(self, key_id: str) -> bool:
        """Revoke ``key_id`` (idempotent); NotFound when no such key exists."""
        cur = self._db.execute("UPDATE api_keys SET revoked = 1 WHERE key_id = ?", (key_id,))
        if cur.rowcount == 0:
            raise NotFound(f"API key {key_id!r} does not exist")
        return True

    def key_sha256(self, key_id: str) -> str | None:
        """The hash of ``key_id``'s key (what requests sent with it carry), None if unknown."""
        row = self._db.execute(
            "SELECT key_sha256 FROM api_keys WHERE key_id = ?", (key_id,)
        ).fetchone()
        return None if row is None else str(row[0])

    def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant owning an unrevoked ``api_key``, else None; without its key list (``keys``
        is empty, see :class:`Tenant`).

        One statement reading one key (by its hash, through ``key_sha256``'s UNIQUE index) and one
        tenant (by name, its primary key): run for every Generate, ListModels and refused admin
        call, it costs the same however many keys, revoked or not, this tenant or others have."""
        row = self._db.execute(
            "SELECT t.name, t.max_concurrent_requests, t.max_tokens_per_request, t.scrub_on_free "
            "FROM api_keys k JOIN tenants t ON t.name = k.tenant "
            "WHERE k.key_sha256 = ? AND k.revoked = 0",
            (hash_key(api_key),),
        ).fetchone()
        return None if row is None else _tenant_without_keys(row)

    def save_model_access(self, model: str, online: bool, reason: str, since: str) -> None:
        """Save ``model``'s kill switch: committed, on disk, when this returns. KvfenceError
        (reason ``MODEL_ACCESS_NOT_SAVED``) when it cannot be."""
        try:
            self._db.execute(
                "INSERT INTO model_access (model, online, reason, since) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (model) DO UPDATE SET "
                "online = excluded.online, reason = excluded.reason, since = excluded.since",
                (model, int(online), reason, since),
            )
        except sqlite3.Error as err:
            raise KvfenceError(
                f"the state database did not take the change: {err}",
                reason="MODEL_ACCESS_NOT_SAVED",
            ) from None

    def model_access(self) -> tuple[SavedAccess, ...]:
        """Every model's saved switch (a state directory may have served other models)."""
        return _model_access(self._db)

    def _tenant(self, row: tuple[str, int, int, int]) -> Tenant:
        """The tenant of ``row`` with its keys (the admin paths; not :meth:`authenticate`)."""
        tenant = _tenant_without_keys(row)
        # Through api_keys_tenant: this tenant's keys only, already in order (no sort). rowid
        # orders the keys created in the same second (created_at has whole seconds) as they were
        # created, and is the index's last column, so it costs no sort either.
        keys = self._db.execute(
            "SELECT key_id, revoked, created_at FROM api_keys WHERE tenant = ? "
            "ORDER BY created_at, rowid",
            (tenant.name,),
        ).fetchall()
        return replace(tenant, keys=tuple(KeyInfo(k, bool(r), c) for k, r, c in keys))

    @contextmanager
    def _tx(self) -> Iterator[None]:
        # The connection is in autocommit mode (isolation_level=None), so a multi-statement change
        # opens its transaction explicitly.
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")


def _tenant_without_keys(row: tuple[str, int, int, int]) -> Tenant:
    name, max_conc, max_tok, scrub = row
    return Tenant(name=name, limits=TenantLimits(int(max_conc), int(max_tok), bool(scrub)))


# -- offline restore -------------------------------------------------------------------------------

SQLITE_MAGIC = b"SQLite format 3\x00"


_UNIQUE_VIOLATIONS = frozenset({"SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"})


def _is_unique_violation(err: sqlite3.IntegrityError, column: str) -> bool:
    """Whether ``err`` is a PRIMARY KEY or UNIQUE violation on ``column`` (``table.column``)
    alone."""
    name = getattr(err, "sqlite_errorname", None)
    return name in _UNIQUE_VIOLATIONS and str(err) == f"UNIQUE constraint failed: {column}"


def _user_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def _identity(db: sqlite3.Connection) -> DatabaseIdentity | None:
    """``db``'s id; None when it has none (a database of a schema before
    :data:`IDENTITY_SCHEMA`, which a TenantStore has not opened)."""
    if "database_identity" not in _table_names(db):
        return None
    row = db.execute(
        "SELECT database_id, created_at FROM database_identity ORDER BY singleton LIMIT 1"
    ).fetchone()
    return None if row is None else DatabaseIdentity(str(row[0]), str(row[1]))


def read_identity(path: Path) -> DatabaseIdentity | None:
    """The id of the tenant database file ``path`` (read-only, :func:`_read_only`); None when it
    has none. sqlite3.Error when it cannot be read."""
    with _read_only(path) as db:
        return _identity(db)


@contextmanager
def _read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection to the database file ``path``, the -wal's committed changes
    included, that leaves the files as they were: it does not checkpoint the -wal on close, and
    the empty -wal and the -shm it makes on a WAL database where there were none are removed
    again. Only where no other connection can have them open (no control plane runs on it)."""
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    made = [p for p in (wal, shm) if not p.exists()]
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            yield db
        finally:
            db.close()
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                if p is shm or p.stat().st_size == 0:
                    p.unlink()


@dataclass(frozen=True)
class _Column:
    type: str  # declared type, upper case
    notnull: bool
    default: str | None  # the DEFAULT expression's text (upper case); None: no default
    pk: int  # position in the primary key (1-based); 0: not in it


@dataclass(frozen=True)
class _Table:
    """What :func:`_schema_problems` compares of a table: its columns (PRAGMA table_info), its
    unique keys (the columns, with their collations, of each UNIQUE or PRIMARY KEY constraint and
    each non-partial unique index: what enforces uniqueness and what ``ON CONFLICT (...)``
    matches) and its foreign keys ((parent table, ((column, parent column), ...)))."""

    columns: dict[str, _Column]
    unique: frozenset[frozenset[tuple[str, str]]]
    foreign_keys: frozenset[tuple[str, tuple[tuple[str, str], ...]]]

    def primary_key(self) -> tuple[str, ...]:
        return tuple(n for n, c in sorted(self.columns.items(), key=lambda i: i[1].pk) if c.pk)


def _table_names(db: sqlite3.Connection) -> list[str]:
    """In the order they were created."""
    return [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]


def _tables(db: sqlite3.Connection) -> dict[str, _Table]:
    """Each table's columns, unique keys and foreign keys, from PRAGMA table_info, index_list,
    index_xinfo and foreign_key_list."""
    tables = {}
    for table in _table_names(db):
        columns = {
            name: _Column(
                str(kind).upper(),
                bool(notnull),
                None if default is None else str(default).strip().upper(),
                int(pk),
            )
            for _, name, kind, notnull, default, pk in db.execute(
                "SELECT * FROM pragma_table_info(?)", (table,)
            )
        }
        unique = set()
        for _, index, is_unique, _, partial in db.execute(
            "SELECT * FROM pragma_index_list(?)", (table,)
        ):
            if not is_unique or partial:
                continue
            keys = [
                (column, str(collation).upper())
                for _, _, column, _, collation, key in db.execute(
                    "SELECT * FROM pragma_index_xinfo(?)", (index,)
                )
                if key
            ]
            if all(column is not None for column, _ in keys):  # not on an expression
                unique.add(frozenset(keys))
        references: dict[int, tuple[str, list[tuple[str, str]]]] = {}
        for fk_id, _, parent, column, parent_column, *_ in db.execute(
            "SELECT * FROM pragma_foreign_key_list(?)", (table,)
        ):
            references.setdefault(fk_id, (parent, []))[1].append((column, parent_column))
        tables[table] = _Table(
            columns,
            frozenset(unique),
            frozenset((parent, tuple(pairs)) for parent, pairs in references.values()),
        )
    return tables


def _required_tables() -> dict[str, _Table]:
    """What this release reads and writes: every table of ``_SCHEMA`` as it declares it."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        return _tables(db)
    finally:
        db.close()


def _missing_added_tables(tables: set[str], version: int) -> list[str]:
    """A table of ``_ADDED_TABLES`` may be missing only from a database older than the schema
    that has it: every later one has it (tables are never dropped)."""
    return [
        f"no table {table}, which every database of schema {since} or later has (this one "
        f"says {version})"
        for table, since in sorted(_ADDED_TABLES.items())
        if table not in tables and version >= since
    ]


def _keys(columns: Iterable[str]) -> str:
    return ", ".join(columns)


def _schema_problems(db: sqlite3.Connection, version: int) -> list[str]:
    """Why ``db`` (saying it has schema ``version``) is not a tenant database this release can use
    (empty: it is). Every table of ``_SCHEMA`` must be there with every column, as declared there
    (type and NOT NULL), with its primary key, its UNIQUE constraints and its foreign keys: this
    release's reads, upserts and checks rely on them. A table of ``_ADDED_TABLES`` may be missing
    from a database older than the schema that added it (a TenantStore adds it). Anything else
    (a later release's tables, columns, indexes) is allowed, except a column this release's
    INSERTs cannot fill: NOT NULL without a default (a later release that broke the rule)."""
    have = _tables(db)
    problems = _missing_added_tables(set(have), version)
    for table, want in _required_tables().items():
        if table not in have:
            if table not in _ADDED_TABLES:
                problems.append(f"no table {table}")
            continue
        got = have[table]
        for column, spec in want.columns.items():
            found = got.columns.get(column)
            if found is None:
                problems.append(f"table {table} has no column {column}")
            elif found.type != spec.type:
                problems.append(
                    f"column {table}.{column} is {found.type or 'untyped'}, not {spec.type}"
                )
            elif spec.notnull and not found.notnull:
                problems.append(f"column {table}.{column} is nullable, not NOT NULL")
        for column, found in got.columns.items():
            if column not in want.columns and found.notnull and found.default in (None, "NULL"):
                problems.append(
                    f"column {table}.{column} is NOT NULL without a default (this release's "
                    f"INSERTs into {table} do not set it)"
                )
        if got.primary_key() != want.primary_key():
            problems.append(
                f"the PRIMARY KEY of table {table} is ({_keys(got.primary_key())}), not "
                f"({_keys(want.primary_key())})"
                if got.primary_key()
                else f"table {table} has no PRIMARY KEY ({_keys(want.primary_key())})"
            )
        pk = frozenset(want.primary_key())
        for key in sorted(want.unique - got.unique, key=sorted):
            columns = sorted(key)
            if {c for c, _ in columns} == pk and got.primary_key() != want.primary_key():
                continue  # said above
            collated = [c if coll == "BINARY" else f"{c} COLLATE {coll}" for c, coll in columns]
            problems.append(f"table {table} has no UNIQUE constraint on ({_keys(collated)})")
        for parent, pairs in sorted(want.foreign_keys - got.foreign_keys):
            problems.append(
                f"table {table} has no FOREIGN KEY ({_keys(c for c, _ in pairs)}) REFERENCES "
                f"{parent}({_keys(p for _, p in pairs)})"
            )
    return problems


def _not_tenant_db(name: str, db: sqlite3.Connection, problems: list[str], version: int) -> str:
    tables = sorted(_table_names(db))
    newer = (
        f"; it says schema {version}, newer than this release's {SCHEMA_VERSION}, but a later "
        "kvfence only ever adds tables and columns"
        if version > SCHEMA_VERSION
        else ""
    )
    return (
        f"{name} is a SQLite database but not a kvfence tenant database ({'; '.join(problems)}; "
        f"tables {', '.join(tables) or 'none'}{newer})"
    )


def newer_schema_note(version: int, what: str) -> str:
    """What to tell an operator about a database (``what``) a later release wrote."""
    return (
        f"{what} was written by a newer kvfence (schema {version}, this release knows "
        f"{SCHEMA_VERSION}): tables/columns it added are kept but not used by this release"
    )


def _check_integrity(db: sqlite3.Connection, what: str) -> None:
    result = [row[0] for row in db.execute("PRAGMA integrity_check").fetchall()]
    if result != ["ok"]:
        raise NotATenantDatabase(f"{what} fails SQLite's integrity check: {'; '.join(result[:3])}")
    if db.execute("PRAGMA foreign_key_check").fetchone() is not None:
        raise NotATenantDatabase(f"{what} has API keys of tenants that do not exist")


@dataclass(frozen=True)
class TenantDatabase:
    """What :func:`check_database` found in a sound tenant database."""

    tenants: int
    keys: int
    schema_version: int  # its PRAGMA user_version: 0 before versioning, see SCHEMA_VERSION
    identity: DatabaseIdentity | None = None  # None: from before ids (IDENTITY_SCHEMA)

    @property
    def newer(self) -> bool:
        """Written by a later release: what it added is kept, not used by this one."""
        return self.schema_version > SCHEMA_VERSION


def check_database(path: Path, name: str | None = None) -> TenantDatabase:
    """Check that ``path`` is a sound kvfence tenant database: a SQLite file passing
    ``integrity_check`` that has every table and column this release reads, with the constraints
    it relies on (:func:`_schema_problems`: ``_SCHEMA`` compared column by column, with its
    primary keys, UNIQUE constraints and foreign keys; a table of ``_ADDED_TABLES`` may be missing
    from a database older than the schema that added it). Whatever else it holds is allowed: the
    tables, columns and indexes a later release added (but no NOT NULL column without a default:
    this release's INSERTs would fail), and a newer ``user_version`` (``TenantDatabase.newer``).
    Raises :class:`NotATenantDatabase` saying what is wrong.

    It opens the file read-write (a WAL-flagged copy is converted to a self-contained one): pass
    a copy, not a file that must stay as it is. Messages call the file ``name`` (default: path).
    """
    name = name or str(path)
    with path.open("rb") as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise NotATenantDatabase(f"{name} is not a SQLite database")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=DELETE")
        _check_integrity(db, name)
        version = _user_version(db)
        problems = _schema_problems(db, version)
        if problems:
            raise NotATenantDatabase(_not_tenant_db(name, db, problems, version))
        tenants = db.execute("SELECT count(*) FROM tenants").fetchone()[0]
        keys = db.execute("SELECT count(*) FROM api_keys").fetchone()[0]
        return TenantDatabase(int(tenants), int(keys), version, _identity(db))
    except sqlite3.DatabaseError as err:
        raise NotATenantDatabase(f"{name} is not a usable SQLite database: {err}") from None
    finally:
        db.close()


def _model_access(db: sqlite3.Connection) -> tuple[SavedAccess, ...]:
    rows = db.execute("SELECT model, online, reason, since FROM model_access ORDER BY model")
    return tuple(SavedAccess(m, bool(o), r, s) for m, o, r, s in rows.fetchall())


def read_model_access(path: Path) -> tuple[SavedAccess, ...] | None:
    """The switches saved in the database file ``path`` (read-only; none in a database of an
    older release); None when it cannot be read."""
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return _model_access(db) if "model_access" in _table_names(db) else ()
        finally:
            db.close()
    except sqlite3.Error:
        return None


class IdentityCheck(enum.Enum):
    """How :func:`restore` compared the backup's database id with the replaced database's."""

    SAME = "same"  # a backup of the database it replaced
    NO_DATABASE = "no database"  # nothing was replaced
    # The replaced one held no tenant (a control plane started on an empty volume before the
    # restore): no tenant of it to lock out.
    NO_TENANTS = "no tenants"
    UNREADABLE = "unreadable"  # the replaced one could not be read (damaged): not compared
    BACKUP_WITHOUT_ID = "backup without id"  # the backup is from before ids: not compared
    DATABASE_WITHOUT_ID = "database without id"  # the replaced one is from before ids: not compared
    ANOTHER_DATABASE = "another database"  # ids differ: restored with from_another_database


@dataclass(frozen=True)
class Restored:
    path: Path  # the restored database
    previous: Path | None  # where the database it replaced was kept (None: there was none)
    tenants: int
    keys: int
    # The kill switches the restored database holds (a control plane starts with them), and those
    # of the database it replaced (None: there was none, or it could not be read).
    access: tuple[SavedAccess, ...] = ()
    access_before: tuple[SavedAccess, ...] | None = None
    # The restored database's schema version (PRAGMA user_version, kept as it was): above
    # SCHEMA_VERSION when a later release wrote it (``newer``).
    schema_version: int = SCHEMA_VERSION
    # The restored database's id (the backup's; None: a backup from before ids, which gets one when
    # a TenantStore opens it), the replaced database's (None: there was none, or it had none or
    # could not be read), and what the restore made of the two.
    identity: DatabaseIdentity | None = None
    replaced_identity: DatabaseIdentity | None = None
    identity_check: IdentityCheck = IdentityCheck.SAME
    # The ids of the keys the backup had live and the replaced database had revoked: they stay
    # revoked in the restored database.
    kept_revoked: tuple[str, ...] = ()

    @property
    def newer(self) -> bool:
        return self.schema_version > SCHEMA_VERSION


@dataclass(frozen=True)
class _Replaced:
    """What the state directory's database holds before a restore replaces it."""

    tenants: int | None  # None: it could not be read
    identity: DatabaseIdentity | None
    # Its revoked API keys, as (key_id, key_sha256): the restore keeps them revoked.
    revoked: frozenset[tuple[str, str]] = frozenset()


def _replaced(db_path: Path) -> _Replaced:
    """Read-only (:func:`_read_only`): a database that is not replaced (the restore is refused)
    stays as it was."""
    try:
        with _read_only(db_path) as db:
            tenants = 0  # a file without the table (empty: a start that died) holds no tenant
            names = _table_names(db)
            if "tenants" in names:
                tenants = int(db.execute("SELECT count(*) FROM tenants").fetchone()[0])
            revoked: frozenset[tuple[str, str]] = frozenset()
            if "api_keys" in names:
                rows = db.execute("SELECT key_id, key_sha256 FROM api_keys WHERE revoked != 0")
                revoked = frozenset((str(k), str(h)) for k, h in rows)
            return _Replaced(tenants, _identity(db), revoked)
    except sqlite3.Error:
        return _Replaced(None, None)


def _keep_revoked(staged: Path, revoked: frozenset[tuple[str, str]]) -> tuple[str, ...]:
    """Revoke in the staged backup every key the replaced database has revoked (the same key id
    and hash) and the backup still has live; their ids, sorted. kvfence has no un-revoke: a
    restore must not be one, bringing back a key revoked because it leaked."""
    if not revoked:
        return ()
    db = sqlite3.connect(staged, isolation_level=None)
    try:
        live = {
            (str(k), str(h))
            for k, h in db.execute("SELECT key_id, key_sha256 FROM api_keys WHERE revoked = 0")
        }
        again = sorted(revoked & live)
        if again:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "UPDATE api_keys SET revoked = 1 WHERE key_id = ? AND key_sha256 = ?", again
            )
            db.execute("COMMIT")
        return tuple(k for k, _ in again)
    finally:
        db.close()


def _identity_check(
    name: str, backup: DatabaseIdentity | None, replaced: _Replaced | None, override: bool
) -> IdentityCheck:
    """Whether ``backup`` (the id of the backup called ``name``) may replace ``replaced`` (the
    state directory's database; None: there is none). :class:`AnotherDatabase` when both carry
    ids, they differ, the replaced one holds tenants and not ``override``."""
    if replaced is None:
        return IdentityCheck.NO_DATABASE
    if replaced.tenants is None:
        return IdentityCheck.UNREADABLE
    if replaced.tenants == 0:
        return IdentityCheck.NO_TENANTS
    if backup is None:
        return IdentityCheck.BACKUP_WITHOUT_ID
    if replaced.identity is None:
        return IdentityCheck.DATABASE_WITHOUT_ID
    if backup.database_id == replaced.identity.database_id:
        return IdentityCheck.SAME
    if not override:
        raise AnotherDatabase(name, backup, replaced.identity, replaced.tenants)
    return IdentityCheck.ANOTHER_DATABASE


_SIDE_FILES = ("-wal", "-journal", "-shm")


def restore(
    state_dir: Path,
    backup: Path | BinaryIO,
    name: str | None = None,
    *,
    from_another_database: bool = False,
) -> Restored:
    """Replace ``state_dir``'s tenant database with ``backup``, a file or a readable binary stream
    (stdin) called ``name`` in messages (offline: no control plane may run on ``state_dir``;
    :class:`StateDirInUse` otherwise).

    A backup of another database (its id differs from the current database's) is refused
    (:class:`AnotherDatabase`, changing nothing) when the current one holds tenants: restored, the
    other database's tenants' keys would work here and these tenants' would not. Unless
    ``from_another_database``: moving tenants between state directories, or restoring into one
    where a database holding tenants was started afresh (``kvfence up`` creates one). Accepted
    without it: no current database, or one without tenants (a control plane started on an empty
    volume before the restore), one that cannot be read, a backup or a current database from
    before ids (not compared: ``Restored.identity_check`` says so), and a backup of the current
    database, of any age.

    The backup is copied next to the database and checked there (:func:`check_database`: one an
    older or a later release took is accepted, ``Restored.newer`` for the latter); only then is it
    swapped in, as it is (its schema version too). The current database is kept as
    ``tenants.sqlite3.bak-<UTC time>``: its -wal (a control plane that died leaves committed changes
    there) is first checkpointed into it, so that it is one whole file, which is linked to the kept
    name before the copy is renamed over the live one: killed at any point, the live name holds a
    whole database, the old or the new, never none (a control plane would start on an empty one) and
    never the new with the old -wal beside it. A database SQLite cannot checkpoint (damaged: the
    reason for many restores) moves aside with its -wal instead. The lock is held throughout, so no
    control plane starts meanwhile.

    The kill switch is state like the rest: a control plane started on the restored database has
    the model online or offline as it was at the backup (``Restored.access``), whatever the
    replaced one had (``Restored.access_before``, for the operator to compare). Revocations are
    not: a key the replaced database has revoked stays revoked (``Restored.kept_revoked``), since
    kvfence has no un-revoke and a key revoked because it leaked must not come back. That needs
    the replaced database readable (``IdentityCheck.UNREADABLE``: nothing carried over).
    """
    if not state_dir.is_dir():
        raise FileNotFoundError(f"state directory {state_dir} does not exist")
    if isinstance(backup, Path) and not backup.is_file():
        raise FileNotFoundError(f"backup file {backup} does not exist")
    name = name or str(backup)
    db_path = state_dir / TENANTS_DB
    fd = lock_state(db_path, "kvfence tenants restore")
    staged = state_dir / (TENANTS_DB + ".restoring")
    try:
        for p in (staged, *(Path(f"{staged}{s}") for s in _SIDE_FILES)):
            p.unlink(missing_ok=True)
        with create_private(staged) as dst:
            if isinstance(backup, Path):
                with backup.open("rb") as src:
                    shutil.copyfileobj(src, dst)
            else:
                shutil.copyfileobj(backup, dst)
        checked = check_database(staged, name)
        replaced = _replaced(db_path) if db_path.exists() else None
        identity_check = _identity_check(name, checked.identity, replaced, from_another_database)
        kept_revoked = _keep_revoked(staged, replaced.revoked) if replaced else ()
        access = read_model_access(staged) or ()
        with open(staged, "rb") as f:
            os.fsync(f.fileno())
        # The current database and its journal move aside together, under SQLite's names for a
        # database and its journal, so the kept copy opens with its committed -wal changes. A
        # journal left without its database moves aside too: SQLite would replay it onto the
        # restored file. The -shm is an index SQLite rebuilds; stale, it must not stay.
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        kept = _free_name(state_dir, f"{TENANTS_DB}.bak-{stamp}")
        previous = kept if db_path.exists() else None
        before: tuple[SavedAccess, ...] | None = None
        if previous is not None and _fold_journal(db_path):
            os.link(db_path, kept)  # the old file, whole, under its kept name too
            before = read_model_access(kept)
        else:
            for suffix in ("", "-wal", "-journal"):
                current = Path(f"{db_path}{suffix}")
                if current.exists():
                    os.rename(current, Path(f"{kept}{suffix}"))
        if previous is not None:
            os.chmod(kept, 0o600)
        Path(f"{db_path}-shm").unlink(missing_ok=True)
        os.replace(staged, db_path)
        dir_fd = os.open(state_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return Restored(
            db_path,
            previous,
            checked.tenants,
            checked.keys,
            access,
            before,
            checked.schema_version,
            checked.identity,
            None if replaced is None else replaced.identity,
            identity_check,
            kept_revoked,
        )
    finally:
        for p in (staged, *(Path(f"{staged}{s}") for s in _SIDE_FILES)):
            p.unlink(missing_ok=True)
        os.close(fd)


def _fold_journal(db_path: Path) -> bool:
    """Checkpoint ``db_path``'s -wal into it (and roll back a hot -journal), leaving one whole
    file and no journal beside it. Only with the state directory's lock held: no control plane
    writes. False when SQLite cannot (a damaged database) or a journal is left."""
    try:
        db = sqlite3.connect(db_path, isolation_level=None)
        try:
            busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            db.execute("PRAGMA journal_mode=DELETE")  # out of WAL mode: the -wal goes on close
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return False
    return busy == 0 and not any(Path(f"{db_path}{s}").exists() for s in ("-wal", "-journal"))


def create_private(path: Path) -> io.BufferedWriter:
    """``path`` created for writing, owner-only (it holds key hashes); FileExistsError when it
    exists (never overwritten)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _free_name(directory: Path, name: str) -> Path:
    path, n = directory / name, 1
    while path.exists() or Path(f"{path}-wal").exists():
        n += 1
        path = directory / f"{name}.{n}"
    return path
