"""ListTenants with ``names`` answers only those tenants, and reads only theirs.

``kvfence tenants set-limits`` reads its tenant's limits before every change (a control plane from
before SetLimitsRequest.fields writes all three back). It listed every tenant for that: with
20,000 tenants of 10 keys each, a second of the control plane's event loop loading every key
history and an 8.6 MB answer, for one tenant's limits. It asks for its tenant now, and the control
plane loads that tenant alone. A control plane from before ``names`` ignores it and answers every
tenant: the client picks its tenant by name, so it stays correct there too (controls below).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from cp_harness import Cluster

from control_plane.tenants import TENANTS_DB, Tenant, TenantLimits, TenantStore
from kvfence.client import AdminClient
from kvfence.proto.kvfence.v1 import control_pb2

KEYS_OF = "SELECT key_id, revoked, created_at FROM api_keys WHERE tenant = "


async def list_traced(cluster: Cluster, *names: str) -> tuple[list[control_pb2.Tenant], list[str]]:
    """ListTenants(names) over the admin API: (the tenants answered, the tenants whose keys the
    control plane loaded to answer, in the order it loaded them)."""
    admin, auth = cluster.admin()
    seen: list[str] = []
    db = cluster.cp.tenants._db
    db.set_trace_callback(seen.append)  # statements with their parameters filled in
    try:
        request = control_pb2.ListTenantsRequest(names=names)
        resp = await admin.ListTenants(request, metadata=auth)
    finally:
        db.set_trace_callback(None)
    loaded = [s[len(KEYS_OF) :].split("'")[1] for s in seen if s.startswith(KEYS_OF)]
    return list(resp.tenants), loaded


def add_tenants(cluster: Cluster) -> None:
    """globex and initech besides the harness's acme, each with limits of its own and a few
    keys (one revoked)."""
    store = cluster.cp.tenants
    store.create_tenant("globex", TenantLimits(0, 50, True))
    store.create_tenant("initech", TenantLimits(7, 0, False))
    for name in ("globex", "initech"):
        _, key_id = store.create_key(name)
        store.revoke_key(key_id)


async def test_list_tenants_answers_the_named_tenants_and_loads_only_their_keys(
    cluster: Cluster,
) -> None:
    add_tenants(cluster)
    [globex], loaded = await list_traced(cluster, "globex")
    assert globex.name == "globex" and loaded == ["globex"]
    want = cluster.cp.tenants.get("globex")
    assert (globex.limits.max_tokens_per_request, globex.limits.scrub_on_free) == (50, True)
    assert [(k.key_id, k.revoked) for k in globex.keys] == [
        (k.key_id, k.revoked) for k in want.keys
    ]
    assert len(globex.keys) == 2

    # An unknown name is left out, not an error; a name given twice answers once; by name.
    tenants, loaded = await list_traced(cluster, "initech", "nobody", "globex", "initech")
    assert [t.name for t in tenants] == ["globex", "initech"] == loaded
    assert await list_traced(cluster, "nobody") == ([], [])

    # Control: no names answers every tenant, with its keys, as before the field.
    tenants, loaded = await list_traced(cluster)
    assert [t.name for t in tenants] == ["acme", "globex", "initech"] == loaded


class ListSpy:
    """The store's ``list``, recording the ``names`` each call was given."""

    def __init__(self, store: TenantStore, ignore_names: bool = False):
        self.real = store.list
        self.ignore_names = ignore_names  # a control plane from before ListTenantsRequest.names
        self.asked: list[list[str] | None] = []

    def __call__(self, names: Iterable[str] | None = None) -> list[Tenant]:
        self.asked.append(None if names is None else list(names))
        return self.real(None if self.ignore_names else names)


def without_fields(store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store as a control plane from before SetLimitsRequest.fields uses it: all three
    limits it is sent are written, so the client's reading of the others is what keeps them."""
    real = store.set_limits
    monkeypatch.setattr(store, "set_limits", lambda name, limits, fields=None: real(name, limits))


@pytest.mark.parametrize("ignore_names", [False, True], ids=["current", "before-names"])
async def test_set_limits_asks_for_its_tenant_and_keeps_its_other_limits(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, ignore_names: bool
) -> None:
    """set_limits asks the control plane for its tenant alone. Against a control plane from
    before ``names`` (it answers every tenant) it still takes its own tenant's limits, not
    another's (acme's, listed first, are all zero): the limits not given stay as they were."""
    add_tenants(cluster)
    store = cluster.cp.tenants
    spy = ListSpy(store, ignore_names)
    monkeypatch.setattr(store, "list", spy)
    without_fields(store, monkeypatch)

    def work() -> None:
        with AdminClient(cluster.admin_target, cluster.cp.admin_token) as admin:
            admin.set_limits("globex", max_concurrent_requests=2)
            admin.set_limits("initech", scrub_on_free=True)

    await asyncio.to_thread(work)
    assert spy.asked == [["globex"], ["initech"]]
    assert store.get("globex").limits == TenantLimits(2, 50, True)
    assert store.get("initech").limits == TenantLimits(7, 0, True)
    assert store.get("acme").limits == TenantLimits()  # untouched


# -- the store -------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TenantStore]:
    s = TenantStore(tmp_path / TENANTS_DB)
    yield s
    s.close()


def add_bulk(store: TenantStore, prefix: str, n: int, keys_each: int) -> None:
    """``n`` more tenants (``PREFIX-*``), ``keys_each`` revoked keys each, in one transaction."""
    db = store._db
    names = [f"{prefix}-{i:06d}" for i in range(n)]
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO tenants (name, created_at) VALUES (?, '2025-01-01T00:00:00Z')",
        ((name,) for name in names),
    )
    db.executemany(
        "INSERT INTO api_keys (key_id, tenant, key_sha256, revoked, created_at) "
        "VALUES (?, ?, ?, 1, '2025-01-01T00:00:00Z')",
        ((f"k-{t}-{j}", t, f"h-{t}-{j}") for t in names for j in range(keys_each)),
    )
    db.execute("COMMIT")


def vm_steps(store: TenantStore, call: Callable[[], object]) -> int:
    """SQLite virtual machine instructions ``call`` executes: every row visited costs some."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    store._db.set_progress_handler(count, 1)
    try:
        call()
    finally:
        store._db.set_progress_handler(None, 1)
    return steps


def test_listing_named_tenants_costs_the_same_however_many_others_exist(
    store: TenantStore,
) -> None:
    """Asking for one tenant reads that tenant (by its primary key) and its keys (through
    api_keys_tenant): the same work with 10 other tenants or 2,010. Controls: the whole listing
    grows with them; None lists every tenant, an empty selection none."""
    store.create_tenant("acme", TenantLimits(3, 100, True))
    add_bulk(store, "few", 10, keys_each=3)
    one_few = vm_steps(store, lambda: store.list(["acme", "nobody"]))
    all_few = vm_steps(store, store.list)
    add_bulk(store, "many", 2_000, keys_each=3)
    assert vm_steps(store, lambda: store.list(["acme", "nobody"])) == one_few
    assert vm_steps(store, store.list) > 50 * all_few  # control: 2,011 tenants, not 11
    [acme] = store.list(["nobody", "acme"])
    assert acme == store.get("acme") and len(acme.keys) == 1
    assert store.list([]) == []
    assert len(store.list()) == 1 + 10 + 2_000
