"""Tenants, API keys and limits in a SQLite file under ``state_dir`` (WAL mode, survives restarts).

An API key is 256 random bits, shown once at creation; the store keeps only its SHA-256, so a copy
of the database does not let anyone call the API. Every authentication reads the database, so a
revoked key is refused from the next request on. Calls are short and local, so they run inline on
the event loop.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvfence.errors import InvalidArgument, KvfenceError, NotFound

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
"""


class AlreadyExists(KvfenceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


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


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits
    keys: tuple[KeyInfo, ...] = field(default=())


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _check_limits(limits: TenantLimits) -> None:
    for name in ("max_concurrent_requests", "max_tokens_per_request"):
        value = getattr(limits, name)
        if not 0 <= value < 2**31:
            raise InvalidArgument(f"{name} must be between 0 and 2^31-1, got {value}")


class TenantStore:
    """The tenant database; one instance per control plane process."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

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
                    "INSERT INTO tenants VALUES (?, ?, ?, ?, ?)",
                    (
                        name,
                        limits.max_concurrent_requests,
                        limits.max_tokens_per_request,
                        int(limits.scrub_on_free),
                        _now(),
                    ),
                )
                api_key, key_id = self._insert_key(name)
        except sqlite3.IntegrityError:
            raise AlreadyExists(f"tenant {name!r} already exists") from None
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

    def list(self) -> list[Tenant]:
        rows = self._db.execute(
            "SELECT name, max_concurrent_requests, max_tokens_per_request, scrub_on_free "
            "FROM tenants ORDER BY name"
        ).fetchall()
        return [self._tenant(row) for row in rows]

    def set_limits(self, name: str, limits: TenantLimits) -> Tenant:
        _check_limits(limits)
        cur = self._db.execute(
            "UPDATE tenants SET max_concurrent_requests = ?, max_tokens_per_request = ?, "
            "scrub_on_free = ? WHERE name = ?",
            (
                limits.max_concurrent_requests,
                limits.max_tokens_per_request,
                int(limits.scrub_on_free),
                name,
            ),
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
            "INSERT INTO api_keys VALUES (?, ?, ?, 0, ?)",
            (key_id, name, hash_key(api_key), _now()),
        )
        return api_key, key_id

    def revoke_key(self, key_id: str) -> bool:
        """Revoke ``key_id`` (idempotent); NotFound when no such key exists."""
        cur = self._db.execute("UPDATE api_keys SET revoked = 1 WHERE key_id = ?", (key_id,))
        if cur.rowcount == 0:
            raise NotFound(f"API key {key_id!r} does not exist")
        return True

    def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant owning an unrevoked ``api_key``, else None."""
        row = self._db.execute(
            "SELECT t.name, t.max_concurrent_requests, t.max_tokens_per_request, t.scrub_on_free "
            "FROM api_keys k JOIN tenants t ON t.name = k.tenant "
            "WHERE k.key_sha256 = ? AND k.revoked = 0",
            (hash_key(api_key),),
        ).fetchone()
        return None if row is None else self._tenant(row)

    def _tenant(self, row: tuple[str, int, int, int]) -> Tenant:
        name, max_conc, max_tok, scrub = row
        keys = self._db.execute(
            "SELECT key_id, revoked, created_at FROM api_keys WHERE tenant = ? ORDER BY created_at",
            (name,),
        ).fetchall()
        return Tenant(
            name=name,
            limits=TenantLimits(int(max_conc), int(max_tok), bool(scrub)),
            keys=tuple(KeyInfo(k, bool(r), c) for k, r, c in keys),
        )

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
