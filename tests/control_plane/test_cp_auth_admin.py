"""Tenant API keys, the admin token, the tenant store across restarts, and the admin API."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import grpc
import pytest
from cp_fakes import make_model_info
from cp_harness import Cluster, eventually, make_cfg

from control_plane.service import ControlPlane
from control_plane.tenants import TenantLimits
from kvfence.client import AsyncClient
from kvfence.errors import Unauthenticated
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc, control_pb2


async def test_missing_bad_and_revoked_keys_are_refused(cluster: Cluster) -> None:
    # Control first: the valid key works.
    assert (await cluster.client().generate(prompt_ids=[10], max_new_tokens=1)).token_ids
    # Prefill's pages are released in the background once decode verified the KV: let that call
    # land before counting, or it is counted against the refused requests below.
    await eventually(lambda: "Release" in cluster.prefill[0].methods())
    calls = cluster.node_calls()
    channel = grpc.aio.insecure_channel(cluster.target)
    stub = client_pb2_grpc.GenerationStub(channel)
    request = client_pb2.GenerateRequest(token_ids=client_pb2.TokenIds(ids=[10]), max_new_tokens=1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(request):
            pass
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await channel.close()
    with pytest.raises(Unauthenticated, match="not valid or has been revoked"):
        await cluster.client(api_key="kvf_wrong").generate(prompt_ids=[10], max_new_tokens=1)
    with pytest.raises(Unauthenticated):
        await cluster.client(api_key="kvf_wrong").list_models()

    admin, auth = cluster.admin()
    [tenant] = (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=auth)).tenants
    [key] = tenant.keys
    assert not key.revoked
    resp = await admin.RevokeKey(control_pb2.RevokeKeyRequest(key_id=key.key_id), metadata=auth)
    assert resp.revoked
    with pytest.raises(Unauthenticated):
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=1)
    assert cluster.node_calls() == calls


@pytest.mark.parametrize(
    ("token", "code"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.UNAUTHENTICATED),
        ("tenant-key", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_admin_token_required(cluster: Cluster, token: str | None, code) -> None:
    admin, auth = cluster.admin(cluster.api_key if token == "tenant-key" else token or "")
    metadata = [] if token is None else auth
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=metadata)
    assert err.value.code() == code
    good, good_auth = cluster.admin()  # control: the real token works
    assert (await good.ListTenants(control_pb2.ListTenantsRequest(), metadata=good_auth)).tenants


ADMIN = control_pb2.DESCRIPTOR.services_by_name["Admin"]


async def admin_call(admin, name: str, request, metadata) -> grpc.StatusCode:
    """The status the Admin method ``name`` answers ``request`` with (a stream read to its end)."""
    call = getattr(admin, name)
    try:
        if ADMIN.methods_by_name[name].server_streaming:
            async for _ in call(request, metadata=metadata):
                pass
        else:
            await call(request, metadata=metadata)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("token", "code"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", grpc.StatusCode.UNAUTHENTICATED),
        ("tenant-key", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_every_admin_method_needs_the_admin_token(
    cluster: Cluster, token: str | None, code
) -> None:
    """Each Admin method checks the token itself (``@_admin_only``, one per method): a method
    left without it serves whoever reaches the admin port, and only ListTenants was tested. Each
    is sent a request it serves with the admin token (so a missing check shows as a success, not
    as NOT_FOUND): no token, a wrong one and a tenant's key are refused, and nothing changes.
    Control: the admin token gets every one of the same requests through."""
    import asyncio

    from kvfence.errors import Cancelled, ResourceExhausted

    admin, good = cluster.admin()
    [tenant] = (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=good)).tenants
    cluster.script.reserve_error = ResourceExhausted("full")  # a request in flight, to abort
    waiting = asyncio.create_task(
        cluster.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=2)
    )
    await eventually(lambda: cluster.cp.queue.waiting == 1)
    listed = await admin.ListRequests(control_pb2.ListRequestsRequest(), metadata=good)
    [in_flight] = listed.requests
    # In an order the control can serve them all: the abort before the model goes offline (which
    # ends the waiting request too).
    requests = {
        "ListTenants": control_pb2.ListTenantsRequest(),
        "CreateTenant": control_pb2.CreateTenantRequest(name="intruder"),
        "CreateKey": control_pb2.CreateKeyRequest(tenant=tenant.name),
        "SetLimits": control_pb2.SetLimitsRequest(
            name=tenant.name, limits=control_pb2.TenantLimits(scrub_on_free=True)
        ),
        "ListNodes": control_pb2.ListNodesRequest(),
        "GetModelStatus": control_pb2.ModelStatusRequest(),
        "ListRequests": control_pb2.ListRequestsRequest(),
        "AbortRequest": control_pb2.AbortRequestRequest(request_id=in_flight.request_id),
        "CheckConfig": control_pb2.CheckConfigRequest(),
        "BackupTenants": control_pb2.BackupTenantsRequest(),
        "RevokeKey": control_pb2.RevokeKeyRequest(key_id=tenant.keys[0].key_id),
        "SetModelAccess": control_pb2.SetModelAccessRequest(online=False, reason="maintenance"),
    }
    assert set(requests) == set(ADMIN.methods_by_name)  # a new Admin method belongs here too

    _, bad = cluster.admin(cluster.api_key if token == "tenant-key" else token or "")
    metadata = [] if token is None else bad
    answered = {name: await admin_call(admin, name, r, metadata) for name, r in requests.items()}
    assert answered == dict.fromkeys(requests, code)
    # nothing changed: no tenant, key or limits; the model online; the request still waiting
    after = await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=good)
    assert list(after.tenants) == [tenant]
    assert cluster.cp.access.online
    assert cluster.cp.queue.waiting == 1 and not waiting.done()

    # control: with the admin token every one is served, and each did what it says
    answered = {name: await admin_call(admin, name, r, good) for name, r in requests.items()}
    assert answered == dict.fromkeys(requests, grpc.StatusCode.OK)
    with pytest.raises(Cancelled):
        await asyncio.wait_for(waiting, 5)
    after = await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=good)
    assert sorted(t.name for t in after.tenants) == sorted([tenant.name, "intruder"])
    [acme] = [t for t in after.tenants if t.name == tenant.name]
    assert acme.limits.scrub_on_free
    assert [k.revoked for k in acme.keys] == [True, False]
    assert not cluster.cp.access.online


async def test_tenants_survive_restart_and_keys_are_stored_hashed(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    first = ControlPlane(cfg, model_info=make_model_info())
    await first.start()
    admin_token = first.admin_token
    _, api_key, key_id = first.tenants.create_tenant("globex", TenantLimits(3, 100, True))
    await first.stop(grace=0)

    db = (tmp_path / "tenants.sqlite3").read_bytes() + b"".join(
        p.read_bytes() for p in tmp_path.glob("tenants.sqlite3-*")
    )
    assert api_key.encode() not in db
    assert hashlib.sha256(api_key.encode()).hexdigest().encode() in db
    token_file = tmp_path / "admin_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600

    second = ControlPlane(cfg, model_info=make_model_info())
    ports = await second.start()
    try:
        assert second.admin_token == admin_token
        tenant = second.tenants.authenticate(api_key)
        assert tenant is not None and tenant.limits == TenantLimits(3, 100, True)
        # An authenticated tenant carries no key list: the admin path (get) shows the keys.
        assert [k.key_id for k in second.tenants.get("globex").keys] == [key_id]
        async with AsyncClient(f"127.0.0.1:{ports.public}", api_key) as client:
            [model] = await client.list_models()
            assert model.name == "test-model"
    finally:
        await second.stop(grace=0)


async def test_admin_token_file_is_used_when_configured(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("operator-secret\n")
    cp = ControlPlane(
        make_cfg(tmp_path / "state", admin_token_file=str(token_file)),
        model_info=make_model_info(),
    )
    assert cp.admin_token == "operator-secret"
    assert not (tmp_path / "state" / "admin_token").exists()
    cp.tenants.close()


async def test_admin_tenant_crud(cluster: Cluster) -> None:
    admin, auth = cluster.admin()
    created = await admin.CreateTenant(
        control_pb2.CreateTenantRequest(
            name="initech", limits=control_pb2.TenantLimits(max_concurrent_requests=2)
        ),
        metadata=auth,
    )
    assert created.api_key.startswith("kvf_") and len(created.api_key) >= 40
    assert created.tenant.keys[0].key_id == created.key_id
    result = await cluster.client(api_key=created.api_key).generate(
        prompt_ids=[10], max_new_tokens=1
    )
    assert cluster.decode[0].calls[0][1].tenant_id == "initech"
    assert result.usage.completion_tokens == 1

    tenant = await admin.SetLimits(
        control_pb2.SetLimitsRequest(
            name="initech", limits=control_pb2.TenantLimits(scrub_on_free=True)
        ),
        metadata=auth,
    )
    assert tenant.limits.scrub_on_free and tenant.limits.max_concurrent_requests == 0
    await cluster.client(api_key=created.api_key).generate(prompt_ids=[10], max_new_tokens=1)
    reserves = [r for m, r in cluster.decode[0].calls if m == "Reserve"]
    assert [r.scrub_on_free for r in reserves] == [False, True]
    # prefill holds the same tenant's prompt KV: it is told too
    prefills = [r for m, r in cluster.prefill[0].calls if m == "Prefill"]
    assert [r.scrub_on_free for r in prefills] == [False, True]

    for bad in (
        admin.CreateTenant(control_pb2.CreateTenantRequest(name="initech"), metadata=auth),
        admin.CreateTenant(control_pb2.CreateTenantRequest(name="bad name!"), metadata=auth),
        # "$" also matches before a final newline: the name must match whole
        admin.CreateTenant(control_pb2.CreateTenantRequest(name="initech2\n"), metadata=auth),
        admin.CreateKey(control_pb2.CreateKeyRequest(tenant="nobody"), metadata=auth),
        admin.SetLimits(control_pb2.SetLimitsRequest(name="nobody"), metadata=auth),
        admin.RevokeKey(control_pb2.RevokeKeyRequest(key_id="key_nope"), metadata=auth),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bad
        assert err.value.code() in (
            grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
        )


async def test_list_nodes_model_status_and_check_config(cluster: Cluster) -> None:
    admin, auth = cluster.admin()
    nodes = await admin.ListNodes(control_pb2.ListNodesRequest(), metadata=auth)
    assert [(n.node_id, n.role, n.pool_tokens) for n in nodes.nodes] == [
        ("decode-0", "decode", 4096),
        ("prefill-0", "prefill", 4096),
    ]
    assert all(n.healthy for n in nodes.nodes)
    assert (nodes.context_window, nodes.admissible_limit) == (256, 256)
    status = await admin.GetModelStatus(control_pb2.ModelStatusRequest(), metadata=auth)
    assert (status.name, status.online, status.admissible_limit) == ("test-model", True, 256)
    check = await admin.CheckConfig(control_pb2.CheckConfigRequest(), metadata=auth)
    assert check.ok and not check.clamped and len(check.pools) == 2


async def test_a_key_is_rotated_by_creating_another_then_revoking_the_old(cluster: Cluster) -> None:
    admin, auth = cluster.admin()
    [tenant] = (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=auth)).tenants
    [old] = tenant.keys
    new = await admin.CreateKey(control_pb2.CreateKeyRequest(tenant=tenant.name), metadata=auth)
    assert new.api_key.startswith("kvf_") and new.api_key != cluster.api_key
    # both work until the old one is revoked (the control: the old key still serves)
    for key in (cluster.api_key, new.api_key):
        result = await cluster.client(api_key=key).generate(prompt_ids=[10], max_new_tokens=1)
        assert result.usage.completion_tokens == 1
    await admin.RevokeKey(control_pb2.RevokeKeyRequest(key_id=old.key_id), metadata=auth)
    with pytest.raises(Unauthenticated):
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=1)
    result = await cluster.client(api_key=new.api_key).generate(prompt_ids=[10], max_new_tokens=1)
    assert result.usage.completion_tokens == 1
    [tenant] = (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=auth)).tenants
    assert {(k.key_id, k.revoked) for k in tenant.keys} == {(old.key_id, True), (new.key_id, False)}


async def test_revoking_a_key_ends_the_requests_sent_with_it_and_no_other(
    cluster: Cluster,
) -> None:
    """A request queued for decode pages passed its key check on arrival, and was served when
    pages came, however long after the key was revoked (up to max_deadline_s). Revoking now
    ends the requests sent with that key, queued or running, UNAUTHENTICATED API_KEY_REVOKED.
    Control: the tenant's request sent with its other key, queued the same way, is served."""
    import asyncio

    from kvfence.errors import API_KEY_REVOKED, ResourceExhausted

    admin, auth = cluster.admin()
    [tenant] = (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=auth)).tenants
    [old] = tenant.keys
    new = await admin.CreateKey(control_pb2.CreateKeyRequest(tenant=tenant.name), metadata=auth)
    cluster.script.reserve_error = ResourceExhausted("full")  # both wait for pages
    leaked = asyncio.create_task(
        cluster.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=2)
    )
    kept = asyncio.create_task(
        cluster.client(api_key=new.api_key, timeout=8).generate(prompt_ids=[10], max_new_tokens=2)
    )
    await eventually(lambda: cluster.cp.queue.waiting == 2)
    await admin.RevokeKey(control_pb2.RevokeKeyRequest(key_id=old.key_id), metadata=auth)
    with pytest.raises(Unauthenticated) as err:
        await asyncio.wait_for(leaked, 5)
    assert err.value.reason == API_KEY_REVOKED
    cluster.script.reserve_error = None  # pages free up: only the other key's request runs
    result = await asyncio.wait_for(kept, 8)
    assert result.usage.completion_tokens == 2
    assert cluster.prefill[0].methods().count("Prefill") == 1  # the revoked one never ran


async def test_lowered_limits_end_the_waiting_requests_they_refuse_and_keep_the_rest(
    cluster: Cluster,
) -> None:
    """New limits reach the requests already waiting for pages: one over the new tokens per
    request ends INVALID_ARGUMENT, the newest beyond the new concurrency limit end
    RESOURCE_EXHAUSTED, and the ones kept reserve under them (scrub_on_free, asked for while they
    waited, reaches both nodes). Before, every queued request was served under the old limits.
    Control: the two oldest small requests, within the new limits, are served."""
    import asyncio

    from kvfence.errors import InvalidArgument, ResourceExhausted

    admin, auth = cluster.admin()
    [tenant] = (await admin.ListTenants(control_pb2.ListTenantsRequest(), metadata=auth)).tenants
    cluster.script.reserve_error = ResourceExhausted("full")  # every request waits for pages
    prompts = [[10], [11], [12], list(range(10, 30))]  # the last: 20 + 2 tokens
    tasks = []
    for n, ids in enumerate(prompts, start=1):
        gen = cluster.client(timeout=8).generate(prompt_ids=ids, max_new_tokens=2)
        tasks.append(asyncio.create_task(gen))
        await eventually(lambda n=n: cluster.cp.queue.waiting == n)  # arrival order is known
    limits = control_pb2.TenantLimits(
        max_concurrent_requests=2, max_tokens_per_request=16, scrub_on_free=True
    )
    await admin.SetLimits(
        control_pb2.SetLimitsRequest(name=tenant.name, limits=limits), metadata=auth
    )
    with pytest.raises(InvalidArgument) as too_long:
        await asyncio.wait_for(tasks[3], 5)
    assert too_long.value.reason == "OVER_TENANT_TOKEN_LIMIT"
    with pytest.raises(ResourceExhausted) as too_many:
        await asyncio.wait_for(tasks[2], 5)
    assert too_many.value.reason == "TENANT_CONCURRENCY"
    cluster.script.reserve_error = None  # pages free up
    for task in tasks[:2]:
        assert (await asyncio.wait_for(task, 8)).usage.completion_tokens == 2
    decode = cluster.decode[0].servicer.calls
    served = [r for m, r in decode if m == "Reserve"][-2:]
    assert [r.prompt_tokens for r in served] == [1, 1] and all(r.scrub_on_free for r in served)
    prefills = [r for m, r in cluster.prefill[0].servicer.calls if m == "Prefill"]
    assert len(prefills) == 2 and all(r.scrub_on_free for r in prefills)
