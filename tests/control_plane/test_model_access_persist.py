"""The kill switch (`kvfence model offline`) survives control plane restarts and restores.

It is saved in the state database before the admin RPC answers; a control plane started on that
directory serves (or refuses) as the last one left it, and says so in its log, its events and its
metrics. A database from before the switch was saved opens online; a switch saved for another
model is not applied; a restore brings the switch back as it was at the backup. Every refusal has
a control that serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path

import grpc
import pytest
import structlog
from cp_fakes import make_model_info
from cp_harness import Cluster, make_cluster, start_on

from control_plane.tenants import (
    TENANTS_DB,
    SavedAccess,
    TenantLimits,
    TenantStore,
    read_model_access,
    utc_seconds,
)
from kvfence.cli import admin as admin_cli
from kvfence.errors import Unavailable
from kvfence.proto.kvfence.v1 import control_pb2

REASON = "suspected cross-tenant KV leak"


async def set_access(c: Cluster, online: bool, reason: str = "") -> control_pb2.ModelStatus:
    admin, auth = c.admin()
    request = control_pb2.SetModelAccessRequest(online=online, reason=reason)
    return await admin.SetModelAccess(request, metadata=auth)


async def status(c: Cluster) -> control_pb2.ModelStatus:
    admin, auth = c.admin()
    return await admin.GetModelStatus(control_pb2.ModelStatusRequest(), metadata=auth)


def gauge(c: Cluster, name: str) -> float | None:
    labels = {"model": c.cp.model.name, "service": "control-plane"}
    return c.cp.metrics.registry.get_sample_value(name, labels)


async def assert_offline(c: Cluster, api_key: str, reason: str) -> None:
    with pytest.raises(Unavailable) as err:
        await c.client(api_key=api_key).generate(prompt_ids=[10], max_new_tokens=2)
    assert err.value.reason == "MODEL_OFFLINE"
    assert err.value.message == f"model {c.cp.model.name} is offline: {reason}"
    assert c.node_calls() == 0


async def assert_serves(c: Cluster, api_key: str) -> None:
    result = await c.client(api_key=api_key).generate(prompt_ids=[10], max_new_tokens=2)
    assert result.usage.completion_tokens == 2


def old_database(state: Path) -> str:
    """A tenant database as releases before the saved switch left it; returns a tenant's key."""
    store = TenantStore(state / TENANTS_DB)
    _, api_key, _ = store.create_tenant("acme", TenantLimits())
    store.close()
    db = sqlite3.connect(state / TENANTS_DB)
    db.execute("DROP TABLE IF EXISTS model_access")
    db.execute("DROP TABLE IF EXISTS database_identity")  # nor an id (schema 2)
    db.execute("PRAGMA user_version = 0")  # from before the schema was versioned
    db.execute("PRAGMA journal_mode=DELETE")
    db.close()
    return api_key


async def test_the_kill_switch_survives_restarts_until_it_is_undone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = await make_cluster(tmp_path)
    api_key = c.api_key
    try:
        thrown = await set_access(c, False, REASON)
        assert not thrown.online and thrown.offline_since
        # Saved (committed) by the time the RPC answered: another reader of the file sees it.
        saved = SavedAccess("test-model", False, REASON, thrown.offline_since)
        assert read_model_access(tmp_path / TENANTS_DB) == (saved,)
    finally:
        await c.close()

    with structlog.testing.capture_logs() as logs:
        c = await start_on(tmp_path)
    try:
        await assert_offline(c, api_key, REASON)
        now = await status(c)
        assert (now.online, now.reason, now.offline_since) == (False, REASON, thrown.offline_since)
        assert gauge(c, "kvfence_model_online") == 0
        since = utc_seconds(thrown.offline_since)
        assert gauge(c, "kvfence_model_offline_since_timestamp_seconds") == since
        [event] = c.events.of("model_access")
        assert (event["online"], event["reason"]) == (False, REASON)
        assert event["since"] == thrown.offline_since
        [warning] = [e for e in logs if e["event"].startswith("model offline since before")]
        assert warning["log_level"] == "warning" and warning["reason"] == REASON

        capsys.readouterr()
        await asyncio.to_thread(
            admin_cli.model_status,
            as_json=False,
            target=c.admin_target,
            admin_token=c.cp.admin_token,
            tls_ca=None,
            tls_server_name=None,
        )
        shown = [
            line for line in capsys.readouterr().out.splitlines() if "model test-model" in line
        ]
        assert shown == [
            f"model test-model: OFFLINE ({REASON}) since {thrown.offline_since}; context window "
            "256, admissible limit 256"
        ]

        # Said again with another reason, it keeps the time it was first thrown.
        again = await set_access(c, False, "still investigating")
        assert again.offline_since == thrown.offline_since
        assert (await set_access(c, True)).online  # undone ...
    finally:
        await c.close()

    c = await start_on(tmp_path)  # ... and that is kept too: the control
    try:
        await assert_serves(c, api_key)
        now = await status(c)
        assert (now.online, now.reason, now.offline_since) == (True, "", "")
        assert gauge(c, "kvfence_model_online") == 1
        assert gauge(c, "kvfence_model_offline_since_timestamp_seconds") == 0
        assert c.events.of("model_access") == []
    finally:
        await c.close()


async def test_a_switch_that_cannot_be_saved_still_goes_offline_and_never_online(
    tmp_path: Path,
) -> None:
    """Offline takes effect even when the state database refuses the write (the RPC fails,
    saying it lasts only until the control plane stops); online does not, and stays offline."""
    c = await make_cluster(tmp_path)
    try:
        db = sqlite3.connect(tmp_path / TENANTS_DB, isolation_level=None)
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON model_access "
            "BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await set_access(c, False, REASON)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "only until this control plane stops" in (err.value.details() or "")
        assert "disk says no" in (err.value.details() or "")
        await assert_offline(c, c.api_key, REASON)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await set_access(c, True)
        assert "not changed" in (err.value.details() or "")
        await assert_offline(c, c.api_key, REASON)

        db.execute("DROP TRIGGER refuse")  # control: with the database taking it, online works
        db.close()
        assert (await set_access(c, True)).online
        await assert_serves(c, c.api_key)
    finally:
        await c.close()


async def test_a_database_from_before_the_switch_was_saved_opens_online_and_keeps_it(
    tmp_path: Path,
) -> None:
    api_key = old_database(tmp_path)
    c = await start_on(tmp_path)
    try:
        await assert_serves(c, api_key)
        assert (await status(c)).online and gauge(c, "kvfence_model_online") == 1
        await set_access(c, False, REASON)  # the table was added on opening: the switch is kept
    finally:
        await c.close()
    c = await start_on(tmp_path)
    try:
        await assert_offline(c, api_key, REASON)
    finally:
        await c.close()


async def test_a_switch_saved_for_another_model_is_not_applied(tmp_path: Path) -> None:
    """Keyed by model name: a state directory that served another model does not take this one
    offline (a warning names the other model's switch), and keeps that switch for that model."""
    other = dataclasses.replace(make_model_info(), name="other-model")
    c = await start_on(tmp_path, model_info=other)
    try:
        _, api_key, _ = c.cp.tenants.create_tenant("acme", TenantLimits())
        await set_access(c, False, REASON)
    finally:
        await c.close()

    with structlog.testing.capture_logs() as logs:
        c = await start_on(tmp_path)
    try:
        await assert_serves(c, api_key)
        assert (await status(c)).online and c.events.of("model_access") == []
        [ignored] = [
            e for e in logs if e["event"] == "ignoring the kill switch saved for another model"
        ]
        assert (ignored["switched_model"], ignored["reason"]) == ("other-model", REASON)
        assert ignored["model"] == "test-model"
    finally:
        await c.close()

    c = await start_on(tmp_path, model_info=other)  # control: it is still that model's switch
    try:
        await assert_offline(c, api_key, REASON)
    finally:
        await c.close()


async def test_a_restore_brings_the_switch_back_as_it_was_at_the_backup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backup taken while offline restores offline, and says so; one taken by a release that
    did not save the switch is accepted, restores online, and warns that the database it
    replaced had the model offline."""
    state = tmp_path / "state"
    c = await make_cluster(state)
    api_key = c.api_key
    try:
        await set_access(c, False, REASON)
        (tmp_path / "offline.backup").write_bytes(await asyncio.to_thread(c.cp.tenants.snapshot))
        await set_access(c, True)
    finally:
        await c.close()
    old = tmp_path / "old"
    old.mkdir()
    old_key = old_database(old)

    capsys.readouterr()
    admin_cli.tenants_restore(tmp_path / "offline.backup", state_dir=state)
    out = capsys.readouterr().out
    assert "model test-model is offline in the restored database" in out and REASON in out
    c = await start_on(state)
    try:
        await assert_offline(c, api_key, REASON)
    finally:
        await c.close()

    capsys.readouterr()  # the control plane's log lines
    admin_cli.tenants_restore(old / TENANTS_DB, state_dir=state)
    out = capsys.readouterr().out
    assert out.startswith("restored 1 tenants and 1 API keys"), out
    assert "warning: model test-model was offline in the replaced database" in out
    c = await start_on(state)
    try:
        await assert_serves(c, old_key)
    finally:
        await c.close()
