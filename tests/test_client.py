"""kvfence.client (sync, async, admin) and the generate / admin CLI against an in-process cluster.

The blocking clients and the CLI run in a worker thread (``asyncio.to_thread``) because the control
plane and the fake nodes run on this test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import structlog
import typer
from typer.testing import CliRunner

# The fake nodes and the cluster harness live with the control-plane tests.
sys.path.insert(0, str(Path(__file__).parent / "control_plane"))
from cp_fakes import TEXT, script_tokens
from cp_harness import Cluster, eventually, make_cluster

from kvfence.cli import admin as admin_cli
from kvfence.cli import generate as generate_cli
from kvfence.client import AdminClient, AsyncClient, Client, GenerationResult, Usage
from kvfence.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable

FOUR_TOKENS_TEXT = "hél"  # 4 byte tokens: h, the two bytes of é, l


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    # A test elsewhere that ran the CLI in-process may have left structlog printing to a closed
    # CliRunner stream; the in-process cluster must log somewhere that exists.
    structlog.reset_defaults()
    c = await make_cluster(tmp_path)
    yield c
    await c.close()


def make_app() -> typer.Typer:
    app = typer.Typer()
    groups = {"tenants": typer.Typer(), "model": typer.Typer()}
    for name, group in groups.items():
        app.add_typer(group, name=name)
    admin_cli.register(app, groups)
    generate_cli.register(app, groups)
    return app


async def run_cli(*args: str) -> tuple[int, str, str]:
    runner = CliRunner()
    result = await asyncio.to_thread(runner.invoke, make_app(), list(args))
    return result.exit_code, result.stdout, result.stderr


async def test_sync_client_generate_stream_and_models(cluster: Cluster) -> None:
    n = len(script_tokens())

    def work() -> tuple[GenerationResult, list[str], list]:
        with Client(cluster.target, cluster.api_key, timeout=5) as c:
            result = c.generate(prompt_ids=[10, 11], max_new_tokens=n)
            pieces = [ch.text for ch in c.stream("hi", max_new_tokens=4)]
            return result, pieces, c.list_models()

    result, pieces, models = await asyncio.to_thread(work)
    assert result.token_ids == script_tokens() and result.text == TEXT
    assert result.usage == Usage(2, n) and result.finish_reason == "length"
    assert "".join(pieces) == FOUR_TOKENS_TEXT
    assert [(m.name, m.admissible_limit) for m in models] == [("test-model", 256)]


async def test_sync_client_raises_typed_errors(cluster: Cluster) -> None:
    def over_limit() -> None:
        with Client(cluster.target, cluster.api_key) as c:
            c.generate(prompt_ids=[1], max_new_tokens=1000)

    with pytest.raises(InvalidArgument) as err:
        await asyncio.to_thread(over_limit)
    assert err.value.reason == "OVER_ADMISSIBLE_LIMIT"

    def bad_key() -> None:
        with Client(cluster.target, "kvf_nope") as c:
            c.list_models()

    with pytest.raises(Unauthenticated):
        await asyncio.to_thread(bad_key)
    with pytest.raises(ValueError):
        Client(cluster.target, "k").generate(max_new_tokens=1)  # neither prompt nor ids


@pytest.mark.parametrize("length", [100, 6000, 20000])
async def test_an_error_that_echoes_a_long_input_keeps_its_class(
    cluster: Cluster, length: int
) -> None:
    """A refusal's message echoes the input (here a tenant name). gRPC sends the message twice,
    and past its metadata limit the client got a bare ValueError (the rich status disagreed with
    the code grpc substituted) or ResourceExhausted, which reads "retry later". The message is
    cut to MAX_STATUS_MESSAGE_BYTES now. Control: a short name, the same class, whole."""
    from kvfence.errors import MAX_STATUS_MESSAGE_BYTES

    def create() -> None:
        with AdminClient(cluster.admin_target, cluster.cp.admin_token) as admin:
            admin.create_tenant("x" * length)

    with pytest.raises(InvalidArgument) as err:
        await asyncio.to_thread(create)
    assert err.value.reason == "INVALID_ARGUMENT"
    if length == 100:
        assert "x" * 100 in err.value.message
    else:
        assert len(err.value.message.encode()) < MAX_STATUS_MESSAGE_BYTES + 64
        assert err.value.message.endswith("bytes, cut)")


@pytest.mark.parametrize("length", [100, 6000, 10000])
async def test_a_status_grpc_replaced_is_typed_by_its_code(length: int) -> None:
    """A server that is not kvfence (or an old one) may send a status past the limit: the rich
    status then disagrees with the code grpc gives the call, and error_info raised ValueError
    out of every client call. Now the code alone decides. Control: a short one keeps its
    ErrorInfo."""
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    from kvfence.errors import KvfenceError, ResourceExhausted, from_rpc_error

    class Echo(grpc.GenericRpcHandler):
        def service(self, details):  # type: ignore[no-untyped-def]
            async def fail(request, context):  # type: ignore[no-untyped-def]
                info = error_details_pb2.ErrorInfo(reason="TOO_LONG", domain="kvfence.dev")
                detail = any_pb2.Any()
                detail.Pack(info)
                status = status_pb2.Status(
                    code=code_pb2.INVALID_ARGUMENT, message="n" * length, details=[detail]
                )  # uncut
                await context.abort_with_status(rpc_status.to_status(status))

            return grpc.unary_unary_rpc_method_handler(fail)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([Echo()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/x.Y/Z")
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await call(b"")
        err: KvfenceError = from_rpc_error(raw.value)
        if length == 100:
            assert isinstance(err, InvalidArgument) and err.reason == "TOO_LONG"
        else:
            assert isinstance(err, ResourceExhausted | InvalidArgument), err
    finally:
        await server.stop(None)


async def test_async_client_stream(cluster: Cluster) -> None:
    chunks = [c async for c in cluster.client().stream(prompt_ids=[10], max_new_tokens=5)]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage == Usage(1, 5)
    assert [t for c in chunks for t in c.token_ids] == script_tokens()[:5]
    assert len({c.request_id for c in chunks}) == 1


@pytest.mark.parametrize("how", ["close the client", "cancel the reader"])
async def test_a_stream_cut_locally_is_a_typed_error_not_a_phantom_cancellation(
    cluster: Cluster, how: str
) -> None:
    """Closing the AsyncClient under a stream ended its reader with a bare CancelledError, which
    callers (wait_for, TaskGroup) read as their own task being cancelled. The control: a reader
    that is itself cancelled still ends cancelled."""
    from kvfence.errors import Cancelled

    cluster.script.decode_hold = asyncio.Event()  # the stream stays open after its first chunk
    client = AsyncClient(cluster.target, cluster.api_key)
    got = asyncio.Event()

    async def read() -> None:
        async for _ in client.stream(prompt_ids=[10], max_new_tokens=5):
            got.set()

    reader = asyncio.create_task(read())
    await eventually(lambda: "Decode" in cluster.decode[0].methods())
    if how == "close the client":
        await client.close()
        with pytest.raises(Cancelled, match="cancelled locally"):
            await reader
    else:
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await client.close()
    cluster.script.decode_hold.set()


async def test_admin_client(cluster: Cluster) -> None:
    def work() -> None:
        with AdminClient(cluster.admin_target, cluster.cp.admin_token) as admin:
            created = admin.create_tenant("globex", max_tokens_per_request=50)
            assert created.api_key and created.key_id
            names = [t.name for t in admin.list_tenants()]
            assert names == ["acme", "globex"]
            tenant = admin.set_limits("globex", max_concurrent_requests=3)
            assert tenant.limits.max_concurrent_requests == 3
            assert admin.revoke_key(created.key_id)
            with pytest.raises(NotFound):
                admin.revoke_key("key_missing")
            assert [n.node_id for n in admin.list_nodes().nodes] == ["decode-0", "prefill-0"]
            assert not admin.set_model_access(False, "maintenance").online
            assert admin.model_status().reason == "maintenance"
            assert admin.set_model_access(True).online
            assert admin.list_requests() == []
            check = admin.check_config()
            assert check.ok and check.admissible_limit == 256
        with AdminClient(cluster.admin_target, "wrong") as admin, pytest.raises(Unauthenticated):
            admin.list_tenants()

    await asyncio.to_thread(work)


async def test_set_limits_changes_only_the_limits_given(cluster: Cluster) -> None:
    """Two operators changing different limits at once: the CLI read all three, then wrote all
    three back, so the later call undid the earlier one (a cap on an abusive tenant lifted by a
    scrub_on_free change, both told they succeeded). Only the limits given travel now and the
    control plane merges them. Controls: a request without fields (a client from before) still
    sets all three; an unknown field is refused; the CLI with nothing to change says so."""
    from control_plane.tenants import TenantLimits
    from kvfence.proto.kvfence.v1 import control_pb2

    def work() -> None:
        with AdminClient(cluster.admin_target, cluster.cp.admin_token) as admin:
            admin.set_limits("acme", max_concurrent_requests=2)  # operator A
            tenant = admin.set_limits("acme", scrub_on_free=True)  # operator B, after A
            assert cluster.cp.tenants.get("acme").limits == TenantLimits(2, 0, True)
            assert tenant.limits.max_concurrent_requests == 2 and tenant.limits.scrub_on_free
            old_client = control_pb2.SetLimitsRequest(
                name="acme", limits=control_pb2.TenantLimits(max_tokens_per_request=64)
            )
            admin._call("SetLimits", old_client)
            assert cluster.cp.tenants.get("acme").limits == TenantLimits(0, 64, False)
            with pytest.raises(InvalidArgument, match="unknown limit field"):
                admin._call(
                    "SetLimits",
                    control_pb2.SetLimitsRequest(
                        name="acme", fields=["max_tokens_per_request", "x"]
                    ),
                )
            assert cluster.cp.tenants.get("acme").limits == TenantLimits(0, 64, False)
            with pytest.raises(ValueError):
                admin.set_limits("acme")

    await asyncio.to_thread(work)
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    code, _, err = await run_cli("tenants", "set-limits", "acme", *auth)
    assert code == 2 and "nothing to change" in err
    code, out, _ = await run_cli("tenants", "set-limits", "acme", "--max-concurrent", "3", *auth)
    assert code == 0 and "max concurrent 3, max tokens 64" in out


async def test_set_limits_against_a_control_plane_without_fields_keeps_the_others(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control plane from before SetLimitsRequest.fields writes all three limits it is sent:
    a client sending zeros for the limits not given lifted the tenant's caps (and turned
    scrub_on_free off) there. The client sends them as they stand. (The merge on a control plane
    that knows fields is the test above.)"""
    from control_plane.tenants import TenantLimits

    store = cluster.cp.tenants
    real = store.set_limits
    monkeypatch.setattr(store, "set_limits", lambda name, limits, fields=None: real(name, limits))

    def work() -> None:
        with AdminClient(cluster.admin_target, cluster.cp.admin_token) as admin:
            admin.set_limits("acme", max_concurrent_requests=2, max_tokens_per_request=512)
            admin.set_limits("acme", scrub_on_free=True)
            assert store.get("acme").limits == TenantLimits(2, 512, True)
            admin.set_limits("acme", max_concurrent_requests=4)
            assert store.get("acme").limits == TenantLimits(4, 512, True)

    await asyncio.to_thread(work)


async def test_cli_generate_json_and_text(cluster: Cluster, quiet_logs: None) -> None:
    base = ["generate", "--target", cluster.target, "--api-key", cluster.api_key]
    code, out, _ = await run_cli(*base, "--prompt-ids", "10,11,12", "-n", "4", "--json")
    assert code == 0
    assert json.loads(out) == {
        "token_ids": script_tokens()[:4],
        "text": FOUR_TOKENS_TEXT,
        "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    code, out, _ = await run_cli(*base, "hello", "-n", "4")
    assert code == 0 and out == FOUR_TOKENS_TEXT + "\n"
    # the control plane's refusal: a request that failed at the server, exit 1
    code, _, err = await run_cli(*base, "--prompt-ids", "1", "-n", "1000")
    assert code == 1 and err.startswith("INVALID_ARGUMENT: prompt_tokens (1) + max_new_tokens")


async def test_cli_admin_commands(cluster: Cluster, quiet_logs: None) -> None:
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    code, out, _ = await run_cli(
        "tenants", "create", "initech", "--max-tokens", "64", "--json", *auth
    )
    assert code == 0
    created = json.loads(out)
    assert created["tenant"] == "initech" and created["api_key"].startswith("kvf_")
    code, out, _ = await run_cli("tenants", "list", "--json", *auth)
    tenants = {t["name"]: t for t in json.loads(out)}
    assert tenants["initech"]["limits"]["max_tokens_per_request"] == 64
    code, out, _ = await run_cli("tenants", "set-limits", "initech", "--max-concurrent", "2", *auth)
    assert code == 0 and "max concurrent 2, max tokens 64" in out
    code, out, _ = await run_cli("tenants", "revoke-key", created["key_id"], *auth)
    assert code == 0
    code, out, _ = await run_cli("nodes", "--json", *auth)
    assert [n["node_id"] for n in json.loads(out)["nodes"]] == ["decode-0", "prefill-0"]
    code, out, _ = await run_cli("nodes", *auth)
    assert code == 0 and "decode-0" in out
    code, out, _ = await run_cli("model", "offline", "--reason", "drill", *auth)
    assert code == 0 and "OFFLINE (drill)" in out
    with pytest.raises(Unavailable, match="offline: drill"):
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=1)
    code, out, _ = await run_cli("model", "online", "--json", *auth)
    assert json.loads(out)["online"] is True
    code, out, _ = await run_cli("requests", "--json", *auth)
    assert json.loads(out) == []
    code, _, err = await run_cli("abort", "req-missing", *auth)
    assert code == 1 and err.startswith("NOT_FOUND")


async def test_cli_admin_errors_are_one_line(cluster: Cluster, quiet_logs: None) -> None:
    code, _, err = await run_cli(
        "nodes", "--target", cluster.admin_target, "--admin-token", "wrong"
    )
    assert code == 1 and err.count("\n") == 1 and "admin token refused" in err
    code, _, err = await run_cli("nodes", "--target", "127.0.0.1:1", "--admin-token", "x")
    assert code == 1 and err.count("\n") == 1 and "cannot reach the admin API" in err
    assert grpc  # imported for the status names used by the CLI
