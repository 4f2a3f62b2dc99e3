"""Authentication costs the same however many API keys exist, and carries no key list.

Keys are never deleted (revoked ones stay; each ``kvfence up`` revokes the demo tenant's key and
issues another), and every Generate, ListModels and refused admin call authenticates. So
``TenantStore.authenticate`` reads one key by its hash and one tenant by name, and returns the
tenant without its keys (every request keeps that tenant for its whole life). The admin paths
that show a tenant's keys still load them all, in created order, through the ``api_keys_tenant``
index, which a database of an earlier release gets when a TenantStore opens it.

The cost is measured deterministically: the statements authenticate runs (sqlite3's trace
callback), their query plans (EXPLAIN QUERY PLAN: index searches, no scan) and the number of
SQLite virtual machine instructions they execute (a progress handler called on every one), which
grows with every row a statement visits.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from control_plane import tenants as tenants_module
from control_plane.tenants import (
    SCHEMA_VERSION,
    TENANTS_DB,
    KeyInfo,
    Tenant,
    TenantLimits,
    TenantStore,
    check_database,
)

LIMITS = TenantLimits(max_concurrent_requests=3, max_tokens_per_request=100, scrub_on_free=True)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TenantStore]:
    s = TenantStore(tmp_path / TENANTS_DB)
    yield s
    s.close()


def add_revoked_keys(store: TenantStore, tenant: str, n: int, start: int = 0) -> None:
    """``n`` revoked keys of ``tenant``, as n key rotations leave them (a revoked key stays)."""
    db = store._db
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO api_keys (key_id, tenant, key_sha256, revoked, created_at) "
        "VALUES (?, ?, ?, 1, '2025-01-01T00:00:00Z')",
        ((f"key_{tenant}_{i:08x}", tenant, f"{tenant}-{i:060x}") for i in range(start, start + n)),
    )
    db.execute("COMMIT")


def statements(store: TenantStore, call: Callable[[], object]) -> list[str]:
    """The SQL statements ``call`` runs on the store's connection (parameters filled in)."""
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    try:
        call()
    finally:
        store._db.set_trace_callback(None)
    return seen


def vm_steps(store: TenantStore, call: Callable[[], object]) -> int:
    """How many SQLite virtual machine instructions ``call`` executes: every row a statement
    visits (scanned or returned) costs some."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0  # go on

    store._db.set_progress_handler(count, 1)
    try:
        call()
    finally:
        store._db.set_progress_handler(None, 1)
    return steps


def plan(store: TenantStore, sql: str) -> list[str]:
    return [row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql)]


def assert_index_searches_only(store: TenantStore, sql: str) -> list[str]:
    """``sql``'s plan: every table it reads is searched through an index, none scanned, and no
    sort."""
    steps = plan(store, sql)
    assert steps, sql
    for step in steps:
        assert step.startswith("SEARCH ") and " USING " in step, (sql, steps)
        assert "TEMP B-TREE" not in step, (sql, steps)
    return steps


# -- authenticate --------------------------------------------------------------------------------


def test_authenticate_returns_the_tenant_without_its_keys(store: TenantStore) -> None:
    _, api_key, key_id = store.create_tenant("acme", LIMITS)
    store.create_key("acme")
    add_revoked_keys(store, "acme", 50)

    tenant = store.authenticate(api_key)
    assert tenant == Tenant(name="acme", limits=LIMITS, keys=())
    # control: the tenant has those keys, and the admin path shows them
    keys = store.get("acme").keys
    assert len(keys) == 52 and key_id in {k.key_id for k in keys}


def test_authenticate_reads_one_key_and_one_tenant_through_indexes(store: TenantStore) -> None:
    _, api_key, _ = store.create_tenant("acme", LIMITS)
    add_revoked_keys(store, "acme", 20)

    [sql] = statements(store, lambda: store.authenticate(api_key))
    steps = assert_index_searches_only(store, sql)
    assert len(steps) == 2, steps  # the key and its tenant
    assert any("key_sha256=?" in step for step in steps), steps
    # A key that does not exist or is revoked: the same one statement, nothing else read.
    assert statements(store, lambda: store.authenticate("kvf_wrong")) == [
        sql.replace(tenants_module.hash_key(api_key), tenants_module.hash_key("kvf_wrong"))
    ]


def test_authenticate_costs_the_same_however_many_keys_exist(store: TenantStore) -> None:
    """The tenant's own revoked keys and another tenant's keys cost its requests nothing."""
    _, acme_key, _ = store.create_tenant("acme", LIMITS)
    _, bravo_key, _ = store.create_tenant("bravo", TenantLimits())

    def cost() -> tuple[int, int]:
        for key in (acme_key, bravo_key):  # compiled and cached: the steps counted are the run's
            store.authenticate(key)
        return (
            vm_steps(store, lambda: store.authenticate(acme_key)),
            vm_steps(store, lambda: store.authenticate(bravo_key)),
        )

    few = cost()
    assert all(steps > 0 for steps in few)  # control: the counter counts
    add_revoked_keys(store, "acme", 2000)
    assert cost() == few
    add_revoked_keys(store, "bravo", 2000)
    assert cost() == few

    # control: the keys are there, and reading them all costs steps that grow with them
    listing = vm_steps(store, lambda: store.get("acme"))
    add_revoked_keys(store, "acme", 500, start=2000)
    assert vm_steps(store, lambda: store.get("acme")) > listing
    assert len(store.get("acme").keys) == 2501
    assert store.authenticate(acme_key) == Tenant("acme", LIMITS)


def test_a_revoked_key_is_refused_and_a_live_one_authenticates(store: TenantStore) -> None:
    _, first, first_id = store.create_tenant("acme", LIMITS)
    second, _ = store.create_key("acme")
    add_revoked_keys(store, "acme", 10)
    assert store.authenticate(first) == Tenant("acme", LIMITS)
    assert store.authenticate(second) == Tenant("acme", LIMITS)

    store.revoke_key(first_id)
    assert store.authenticate(first) is None
    assert store.authenticate(second) == Tenant("acme", LIMITS)  # control: the other key works
    assert store.authenticate("kvf_never_issued") is None


# -- the admin listing ---------------------------------------------------------------------------


def test_the_admin_paths_list_every_key_in_created_order(
    store: TenantStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """get, list, create_tenant and set_limits show all of a tenant's keys, revoked ones too,
    oldest first (keys created in the same second in the order they were created), through the
    api_keys_tenant index."""
    times = iter(
        [
            "2025-01-01T00:00:05Z",  # acme's created_at
            "2025-01-01T00:00:05Z",  # acme's first key
            "2025-01-01T00:00:07Z",  # bravo, and its key
            "2025-01-01T00:00:07Z",
            "2025-01-01T00:00:09Z",  # acme's second and third keys: the same second
            "2025-01-01T00:00:09Z",
        ]
    )
    monkeypatch.setattr(tenants_module, "utc_now", lambda: next(times))
    created, _, k1 = store.create_tenant("acme", LIMITS)
    assert [k.key_id for k in created.keys] == [k1]
    store.create_tenant("bravo", TenantLimits())
    _, k2 = store.create_key("acme")
    _, k3 = store.create_key("acme")
    store.revoke_key(k2)
    # Created last, dated earliest (e.g. a database restored onto a clock that was ahead):
    # ordered by when it was created, not by insertion.
    store._db.execute(
        "INSERT INTO api_keys (key_id, tenant, key_sha256, revoked, created_at) "
        "VALUES ('key_early', 'acme', 'early', 1, '2025-01-01T00:00:01Z')"
    )
    want = (
        KeyInfo("key_early", True, "2025-01-01T00:00:01Z"),
        KeyInfo(k1, False, "2025-01-01T00:00:05Z"),
        KeyInfo(k2, True, "2025-01-01T00:00:09Z"),
        KeyInfo(k3, False, "2025-01-01T00:00:09Z"),
    )
    assert store.get("acme").keys == want
    assert {t.name: t.keys for t in store.list()}["acme"] == want
    assert store.set_limits("acme", TenantLimits(), ["scrub_on_free"]).keys == want
    assert len(store.get("bravo").keys) == 1  # only its own

    [_, keys_sql] = statements(store, lambda: store.get("acme"))
    [step] = assert_index_searches_only(store, keys_sql)
    assert "USING INDEX api_keys_tenant (tenant=?)" in step, step


# -- a database of an earlier release ------------------------------------------------------------


def index_names(path: Path) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    finally:
        db.close()


def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


@pytest.mark.parametrize("version", [0, 1, 2])
def test_a_database_of_an_earlier_release_opens_and_gets_the_index(
    tmp_path: Path, version: int
) -> None:
    """As releases before the index left it (schema 2, the one before, and the unversioned
    one): it opens, gets the index, keeps its tenants and keys, and is not versioned above this
    release's schema (the index is not a schema change)."""
    path = tmp_path / TENANTS_DB
    store = TenantStore(path)
    _, api_key, key_id = store.create_tenant("acme", LIMITS)
    store.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP INDEX IF EXISTS api_keys_tenant")  # releases before it had none
    if version < 2:
        db.execute("DROP TABLE database_identity")
    if version < 1:
        db.execute("DROP TABLE model_access")
    db.execute(f"PRAGMA user_version = {version}")
    db.execute("PRAGMA journal_mode = DELETE")
    db.close()
    assert "api_keys_tenant" not in index_names(path)
    assert check_database(path).schema_version == version  # a tenant database without it

    store = TenantStore(path)
    try:
        assert "api_keys_tenant" in index_names(path)
        assert store.authenticate(api_key) == Tenant("acme", LIMITS)
        assert [k.key_id for k in store.get("acme").keys] == [key_id]
        [_, keys_sql] = statements(store, lambda: store.get("acme"))
        [step] = assert_index_searches_only(store, keys_sql)
        assert "api_keys_tenant" in step, step
    finally:
        store.close()
    assert user_version(path) == SCHEMA_VERSION
    TenantStore(path).close()  # opened again: the index is there, and nothing fails
    assert "api_keys_tenant" in index_names(path)
