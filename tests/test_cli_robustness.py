"""CLI robustness: bad input is one line on stderr (never a traceback), `kvfence up` can run twice
on one state directory and stops its services on SIGHUP, admin commands reach a TLS control plane.

Every refusal is paired with a control on the same path that is accepted. Commands run in-process
(CliRunner); ``run_stack`` is stubbed where only the option parsing of ``up`` is under test. One
slow test runs the real ``kvfence up`` twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import ssl
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import typer
import yaml
from fake_client import FakeClientBase
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "control_plane"))
sys.path.insert(0, str(Path(__file__).parent / "stack"))
from cp_fakes import EventRecorder, make_model_info
from cp_harness import make_cfg, make_cluster
from stack_starts import seed_embedded_model
from test_tls import make_ca, make_leaf

from control_plane.service import ControlPlane
from control_plane.tenants import TenantLimits
from kvfence import client as client_mod
from kvfence.cli import admin as admin_cli
from kvfence.cli import check as check_cli
from kvfence.cli import events as events_cli
from kvfence.cli import generate as generate_cli
from kvfence.cli import probe as probe_cli
from kvfence.cli import stack as stack_cli
from kvfence.client import AdminClient, AsyncClient, Client, build_request
from kvfence.config import TlsConfig
from kvfence.errors import Unauthenticated, Unavailable
from kvfence.events import EVENT_KINDS
from kvfence.localstack import free_port
from kvfence.tls import TlsError

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def make_app() -> typer.Typer:
    app = typer.Typer()
    groups = {name: typer.Typer() for name in ("serve", "tenants", "model", "probe")}
    for name, group in groups.items():
        app.add_typer(group, name=name)
    for module in (stack_cli, generate_cli, admin_cli, events_cli, check_cli, probe_cli):
        module.register(app, groups)
    return app


def invoke(*args: str) -> Any:
    return CliRunner().invoke(make_app(), list(args))


def assert_one_line_error(result: Any, code: int, *needles: str) -> None:
    """Exit ``code`` with a clean message: no exception escaped, no traceback printed."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


async def run_cli(*args: str) -> Any:
    """The CLI in a worker thread: the control plane runs on this test's event loop."""
    return await asyncio.to_thread(invoke, *args)


# -- kvfence up: option parsing and the config file (run_stack stubbed) ---------------------------


@pytest.fixture
def stub_stack(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces run_stack: records the config `up` would run with and returns 0."""
    calls: list[dict[str, Any]] = []

    def fake_run_stack(cfg_path: Path, cfg: dict[str, Any], *_: Any) -> int:
        calls.append(cfg)
        return 0

    monkeypatch.setattr(stack_cli, "run_stack", fake_run_stack)
    return calls


def test_up_port_must_be_a_real_port(tmp_path: Path, stub_stack: list[dict[str, Any]]) -> None:
    for bad in ("0", "65535", "-1"):
        result = invoke("up", "--state-dir", str(tmp_path), "--port", bad)
        assert_one_line_error(result, 2, "--port")
    assert stub_stack == []
    # control: the lowest and highest ports whose admin port (port + 1) exists are accepted
    for good, admin in (("1", "127.0.0.1:2"), ("65534", "127.0.0.1:65535")):
        result = invoke("up", "--state-dir", str(tmp_path), "--port", good)
        assert result.exit_code == 0, result.output
        assert stub_stack[-1]["control_plane"]["listen"] == f"127.0.0.1:{good}"
        assert stub_stack[-1]["control_plane"]["admin_listen"] == admin


def test_up_bad_config_file_is_one_line(tmp_path: Path, stub_stack: list[dict[str, Any]]) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    cases = [
        (tmp_path / "missing.yaml", "cannot read config file"),
        (listed, "top level must be a mapping"),
        (broken, "not valid YAML"),
    ]
    for path, message in cases:
        result = invoke("up", "--state-dir", str(tmp_path / "s"), "--config", str(path))
        assert_one_line_error(result, 2, message)
    assert stub_stack == []
    # control: a valid base config is loaded and overlaid with the options
    good = tmp_path / "good.yaml"
    good.write_text("cluster: robust\nkv:\n  page_size: 8\n")
    result = invoke("up", "--state-dir", str(tmp_path / "s"), "--config", str(good))
    assert result.exit_code == 0, result.output
    assert stub_stack[-1]["cluster"] == "robust"
    assert stub_stack[-1]["kv"]["page_size"] == 16  # --page-size (default 16) wins


def test_up_refuses_a_config_with_tls(
    tmp_path: Path, stub_stack: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """up's services and its own admin calls are plain loopback: with tls in the base config
    (or in KVFENCE__TLS__* variables, which the services read too) the control plane served TLS
    up could not speak, and up waited 180 s to say "nodes did not register". Control: the same
    base config without tls is run."""
    base = {"cluster": "robust", "tls": {"public_cert": "/x/cert.pem", "public_key": "/x/k.pem"}}
    path = tmp_path / "tls.yaml"
    path.write_text(yaml.safe_dump(base))
    result = invoke("up", "--state-dir", str(tmp_path / "s"), "--config", str(path))
    assert_one_line_error(result, 2, "sets tls (public_cert, public_key)")
    with monkeypatch.context() as env:
        env.setenv("KVFENCE__TLS__INTERNAL_CA", "/x/ca.pem")
        result = invoke("up", "--state-dir", str(tmp_path / "s"))
        assert_one_line_error(result, 2, "sets tls (internal_ca)")
    assert stub_stack == []
    del base["tls"]
    path.write_text(yaml.safe_dump(base))
    result = invoke("up", "--state-dir", str(tmp_path / "s"), "--config", str(path))
    assert result.exit_code == 0, result.output
    assert stub_stack[-1]["cluster"] == "robust"


def test_up_refuses_environment_overrides_of_what_it_sets(
    tmp_path: Path, stub_stack: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The services read KVFENCE__* overrides over up's config: with the state directory or a
    listener moved, up waited 60 s for the admin token where it was not (or called an admin
    port nobody listened on) and said the control plane did not start. Control: without the
    override, up runs."""
    for name, value in (
        ("KVFENCE__CONTROL_PLANE__STATE_DIR", str(tmp_path / "elsewhere")),
        ("KVFENCE__CONTROL_PLANE__ADMIN_LISTEN", "127.0.0.1:6000"),
        ("KVFENCE__CONTROL_PLANE__ADDRESS", "10.0.0.9:50051"),
    ):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            result = invoke("up", "--state-dir", str(tmp_path / "s"))
            assert_one_line_error(result, 2, f"{name} overrides what up sets")
    assert stub_stack == []
    result = invoke("up", "--state-dir", str(tmp_path / "s"))
    assert result.exit_code == 0, result.output
    # a base config's control_plane.address is this stack's own: the nodes register here
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"control_plane": {"address": "10.0.0.9:50051"}}))
    result = invoke("up", "--state-dir", str(tmp_path / "s"), "--config", str(base))
    assert result.exit_code == 0, result.output
    assert stub_stack[-1]["control_plane"]["address"] == stub_stack[-1]["control_plane"]["listen"]


def test_up_stops_on_sighup_as_on_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stop signal gets `up`'s handler (which stops the services it started)."""
    handled: dict[int, Any] = {}
    monkeypatch.setattr(signal, "signal", lambda signum, h: handled.setdefault(signum, h))

    def no_spawn(*_: Any) -> Any:
        raise RuntimeError("spawn stubbed")

    monkeypatch.setattr(stack_cli, "_spawn", no_spawn)
    cfg = {"control_plane": {"listen": "127.0.0.1:1", "admin_listen": "127.0.0.1:2"}}
    with pytest.raises(RuntimeError, match="spawn stubbed"):
        stack_cli.run_stack(tmp_path / "c.yaml", cfg, tmp_path, 1, 1)
    assert signal.SIGHUP in handled
    # control: the SIGTERM handler, and SIGHUP's is the same one
    assert handled[signal.SIGHUP] is handled[signal.SIGTERM]
    assert handled[signal.SIGINT] is handled[signal.SIGTERM]


# -- kvfence generate: numbers in range, token ids, --tls-ca ---------------------------------------


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A Client that builds the real GenerateRequest (where out-of-range values used to raise
    protobuf's ValueError) and returns no tokens; records each request."""
    built: list[Any] = []

    class FakeClient(FakeClientBase):
        def stream(self, prompt: str | None, **kw: Any) -> Iterator[Any]:
            built.append(build_request(prompt, **kw))
            return iter(())

    monkeypatch.setattr(client_mod, "Client", FakeClient)
    return built


GEN = ("generate", "--api-key", "k")


@pytest.mark.parametrize(
    "args",
    [
        ["--prompt-ids", "1", "-n", "-1"],
        ["--prompt-ids", "1", "-n", "0"],
        ["--prompt-ids", "1", "-n", "99999999999"],
        ["--prompt-ids", "1,-2"],
        ["--prompt-ids", "99999999999"],
        ["--prompt-ids", "1", "--seed", "-1"],
        ["--prompt-ids", "1", "--seed", str(UINT64_MAX + 1)],
        ["--prompt-ids", "1,x"],
    ],
)
def test_generate_out_of_range_is_a_usage_error(fake_client: list[Any], args: list[str]) -> None:
    result = invoke(*GEN, *args)
    assert_one_line_error(result, 2)
    assert fake_client == []


def test_generate_accepts_the_extremes_of_each_range(fake_client: list[Any]) -> None:
    args = ["--prompt-ids", f"0,{UINT32_MAX}", "-n", str(UINT32_MAX), "--seed", str(UINT64_MAX)]
    result = invoke(*GEN, *args)
    assert result.exit_code == 0, (result.output, result.exception)
    (req,) = fake_client
    assert list(req.token_ids.ids) == [0, UINT32_MAX]
    assert req.max_new_tokens == UINT32_MAX and req.seed == UINT64_MAX
    assert invoke(*GEN, "--prompt-ids", "1", "-n", "1", "--seed", "0").exit_code == 0


# -- a TLS control plane: admin commands, check-config and generate with --tls-ca -----------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", "serverAuth")
    # names a host only (not 127.0.0.1): reached through a port-forward, or by another name
    make_leaf(d, "named", "ca", "serverAuth", san=f"DNS:{CP_NAME}")
    return d


CP_NAME = "kvfence-cp.example"


async def start_tls_cp(state: Path, pki: Path, leaf: str, **control_plane: Any) -> Any:
    """An in-process control plane serving ``pki/leaf`` (signed by ``pki/ca.pem``); no nodes.
    ``control_plane``: settings of its ``control_plane`` section (``make_cfg``)."""
    tls = TlsConfig(public_cert=pki / f"{leaf}.pem", public_key=pki / f"{leaf}.key")
    cfg = make_cfg(state, **control_plane).model_copy(update={"tls": tls})
    cp = ControlPlane(cfg, model_info=make_model_info(), events=EventRecorder())
    cp.ports = await cp.start()  # type: ignore[attr-defined]
    return cp


@pytest.fixture
async def tls_cp(tmp_path: Path, pki: Path, quiet_logs: None) -> AsyncIterator[ControlPlane]:
    """An in-process control plane serving TLS (certificate from ``pki/ca.pem``); no nodes."""
    cp = await start_tls_cp(tmp_path, pki, "server")
    yield cp
    await cp.stop(grace=0.5)


@pytest.fixture
async def named_cp(tmp_path: Path, pki: Path, quiet_logs: None) -> AsyncIterator[ControlPlane]:
    """Like ``tls_cp``, with a certificate that names CP_NAME only, not 127.0.0.1."""
    cp = await start_tls_cp(tmp_path, pki, "named")
    yield cp
    await cp.stop(grace=0.5)


@pytest.fixture
async def named_cp_no_node_wait(
    tmp_path: Path, pki: Path, quiet_logs: None
) -> AsyncIterator[ControlPlane]:
    """``named_cp`` that fails a request NO_NODES at once (``no_node_wait_s`` 0): no node ever
    comes, and a request waited the default 10 s for one (the probe's run took as long)."""
    cp = await start_tls_cp(tmp_path, pki, "named", no_node_wait_s=0)
    yield cp
    await cp.stop(grace=0.5)


async def test_admin_commands_reach_a_tls_control_plane(tls_cp: Any, pki: Path) -> None:
    auth = ["--target", f"127.0.0.1:{tls_cp.ports.admin}", "--admin-token", tls_cp.admin_token]
    ca = ["--tls-ca", str(pki / "ca.pem")]
    result = await run_cli("tenants", "create", "acme", "--json", *auth, *ca)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tenant"] == "acme"
    for cmd in (["tenants", "list"], ["nodes"], ["model", "status"], ["requests"]):
        result = await run_cli(*cmd, "--json", *auth, *ca)
        assert result.exit_code == 0, (cmd, result.output)
    result = await run_cli("model", "offline", *auth, *ca)
    assert result.exit_code == 0 and "OFFLINE" in result.stdout
    result = await run_cli("model", "online", *auth, *ca)
    assert result.exit_code == 0 and "online" in result.stdout
    result = await run_cli("tenants", "set-limits", "acme", "--max-tokens", "8", *auth, *ca)
    assert result.exit_code == 0 and "max tokens 8" in result.stdout
    result = await run_cli("abort", "req-missing", *auth, *ca)
    assert_one_line_error(result, 1, "NOT_FOUND")
    # negative: the wrong CA or plaintext cannot talk to it; a missing CA file is one line
    result = await run_cli("nodes", *auth, "--tls-ca", str(pki / "other-ca.pem"))
    assert_one_line_error(result, 1, "cannot reach the admin API")
    result = await run_cli("nodes", *auth)
    assert_one_line_error(result, 1, "cannot reach the admin API")
    result = await run_cli("nodes", *auth, "--tls-ca", str(pki / "missing.pem"))
    assert_one_line_error(result, 1, "--tls-ca", "does not exist")
    assert result.output.strip().count("\n") == 0


async def test_check_config_live_reaches_a_tls_control_plane(tls_cp: Any, pki: Path) -> None:
    live = ["check-config", "--target", f"127.0.0.1:{tls_cp.ports.admin}"]
    live += ["--admin-token", tls_cp.admin_token]
    # through TLS to the control plane, which answers: no node has registered yet
    result = await run_cli(*live, "--tls-ca", str(pki / "ca.pem"))
    assert_one_line_error(result, 2, "no node is registered")
    result = await run_cli(*live, "--tls-ca", str(pki / "other-ca.pem"))
    assert_one_line_error(result, 2, "UNAVAILABLE")
    result = await run_cli(*live, "--tls-ca", str(pki / "missing.pem"))
    assert_one_line_error(result, 2, "--tls-ca", "does not exist")


async def test_generate_tls_ca_file_errors_are_one_line(tls_cp: Any, pki: Path) -> None:
    base = [*GEN, "--target", f"127.0.0.1:{tls_cp.ports.public}", "--prompt-ids", "1"]
    result = await run_cli(*base, "--tls-ca", str(pki / "missing.pem"))
    assert_one_line_error(result, 2, "--tls-ca", "does not exist")
    not_pem = pki / "not-pem.txt"
    not_pem.write_text("hello")
    result = await run_cli(*base, "--tls-ca", str(not_pem))
    assert_one_line_error(result, 2, "not PEM")
    # control: the right CA gets through TLS to the control plane, which refuses the key "k":
    # a request that failed at the server, exit 1 (the CA files above: nothing sent, exit 2)
    result = await run_cli(*base, "--tls-ca", str(pki / "ca.pem"), "--timeout", "10")
    assert_one_line_error(result, 1, "UNAUTHENTICATED")


# -- --tls-server-name: a certificate that does not name the host connected to (port-forward) ----


async def run_cli_env(env: dict[str, str], *args: str) -> Any:
    return await asyncio.to_thread(CliRunner().invoke, make_app(), list(args), env=env)


async def test_admin_tls_server_name(named_cp: Any, pki: Path, tmp_path: Path) -> None:
    """Connecting to 127.0.0.1, the CA alone is refused (the certificate names CP_NAME only);
    --tls-server-name CP_NAME (or its env var) gets through, on every command; a wrong name is
    refused; the name without --tls-ca is a usage error."""
    auth = ["--target", f"127.0.0.1:{named_cp.ports.admin}", "--admin-token", named_cp.admin_token]
    ca = ["--tls-ca", str(pki / "ca.pem")]
    named = [*ca, "--tls-server-name", CP_NAME]
    # negative: the CA is right, but the certificate does not name 127.0.0.1
    result = await run_cli("tenants", "list", *auth, *ca)
    assert_one_line_error(
        result, 1, "cannot reach the admin API", "does not name 127.0.0.1", "--tls-server-name"
    )
    assert result.output.strip().count("\n") == 0
    # positive control: the same CA, checked for the name the certificate carries
    result = await run_cli("tenants", "create", "acme", "--json", *auth, *named)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tenant"] == "acme"
    for cmd in (["tenants", "list"], ["nodes"], ["model", "status"], ["requests"]):
        result = await run_cli(*cmd, "--json", *auth, *named)
        assert result.exit_code == 0, (cmd, result.output)
    result = await run_cli("tenants", "create-key", "acme", *auth, *named)
    assert result.exit_code == 0, result.output
    result = await run_cli("tenants", "set-limits", "acme", "--max-tokens", "8", *auth, *named)
    assert result.exit_code == 0 and "max tokens 8" in result.stdout
    result = await run_cli("model", "offline", *auth, *named)
    assert result.exit_code == 0 and "OFFLINE" in result.stdout
    result = await run_cli("model", "online", *auth, *named)
    assert result.exit_code == 0 and "online" in result.stdout
    result = await run_cli("abort", "req-missing", *auth, *named)
    assert_one_line_error(result, 1, "NOT_FOUND")  # reached the control plane
    out = tmp_path / "tenants.backup"
    result = await run_cli("tenants", "backup", str(out), *auth, *named)
    assert result.exit_code == 0 and "backed up 1 tenants" in result.stdout, result.output
    # the env var does the same
    env = {"KVFENCE_ADMIN_TLS_SERVER_NAME": CP_NAME}
    result = await run_cli_env(env, "tenants", "list", "--json", *auth, *ca)
    assert result.exit_code == 0 and json.loads(result.stdout)[0]["name"] == "acme"
    # negative: a name the certificate does not carry
    result = await run_cli("tenants", "list", *auth, *ca, "--tls-server-name", "wrong.example")
    assert_one_line_error(result, 1, "cannot reach the admin API", "does not name wrong.example")
    # usage errors: without --tls-ca (there is no TLS), or empty
    result = await run_cli("tenants", "list", *auth, "--tls-server-name", CP_NAME)
    assert_one_line_error(result, 2, "--tls-server-name", "needs --tls-ca")
    result = await run_cli_env(env, "tenants", "list", *auth)
    assert_one_line_error(result, 2, "KVFENCE_ADMIN_TLS_SERVER_NAME", "needs --tls-ca")
    result = await run_cli("tenants", "list", *auth, *ca, "--tls-server-name", " ")
    assert_one_line_error(result, 2, "--tls-server-name is empty")


async def test_check_config_and_generate_tls_server_name(named_cp: Any, pki: Path) -> None:
    ca = ["--tls-ca", str(pki / "ca.pem")]
    named = [*ca, "--tls-server-name", CP_NAME]
    live = ["check-config", "--target", f"127.0.0.1:{named_cp.ports.admin}"]
    live += ["--admin-token", named_cp.admin_token]
    result = await run_cli(*live, *ca)
    assert_one_line_error(result, 2, "UNAVAILABLE", "does not name 127.0.0.1")
    # control: through TLS to the control plane, which answers: no node has registered yet
    result = await run_cli(*live, *named)
    assert_one_line_error(result, 2, "no node is registered")
    result = await run_cli(*live, "--tls-server-name", CP_NAME)
    assert_one_line_error(result, 2, "check-config: --tls-server-name", "needs --tls-ca")
    gen = [*GEN, "--target", f"127.0.0.1:{named_cp.ports.public}", "--prompt-ids", "1"]
    gen += ["--timeout", "10"]
    result = await run_cli(*gen, *ca)
    assert_one_line_error(result, 1, "UNAVAILABLE", "does not name 127.0.0.1")
    # control: the control plane answers, and refuses the key "k"
    result = await run_cli(*gen, *named)
    assert_one_line_error(result, 1, "UNAUTHENTICATED")
    result = await run_cli_env({"KVFENCE_TLS_SERVER_NAME": CP_NAME}, *gen, *ca)
    assert_one_line_error(result, 1, "UNAUTHENTICATED")
    result = await run_cli(*gen, "--tls-server-name", CP_NAME)
    assert_one_line_error(result, 2, "KVFENCE_TLS_SERVER_NAME", "needs --tls-ca")


async def test_probe_isolation_tls_server_name(named_cp_no_node_wait: Any, pki: Path) -> None:
    """The probe through a port-forward: the certificate names the control plane, not 127.0.0.1.
    Without --tls-server-name the probe cannot set up (a hostname error, exit 2); with it, it
    reaches the control plane and finds its model (this one has no node: it stops there)."""
    named_cp = named_cp_no_node_wait
    _, key_a, _ = named_cp.tenants.create_tenant("a", TenantLimits())
    _, key_b, _ = named_cp.tenants.create_tenant("b", TenantLimits())
    probe = ["probe", "isolation", "--target", f"127.0.0.1:{named_cp.ports.public}"]
    probe += ["--tenant-a-key", key_a, "--tenant-b-key", key_b, "--timeout", "5"]
    probe += ["--requests", "1", "--concurrency", "1", "--tls-ca", str(pki / "ca.pem")]
    result = await run_cli(*probe)
    assert result.exit_code == 2 and "Hostname Verification" in result.output, result.output
    result = await run_cli(*probe, "--tls-server-name", CP_NAME)
    assert "Hostname Verification" not in result.output, result.output
    assert "NO_NODES" in result.output or "no decode node" in result.output, result.output
    result = await run_cli(*probe[:-2], "--tls-server-name", CP_NAME)
    assert_one_line_error(result, 2, "KVFENCE_TLS_SERVER_NAME", "needs --tls-ca")


async def test_clients_take_a_tls_server_name(named_cp: Any, pki: Path) -> None:
    """The library: AsyncClient (grpc.aio), Client and AdminClient check the certificate for
    ``tls_server_name`` instead of the host connected to."""
    _, api_key, _ = named_cp.tenants.create_tenant("acme", TenantLimits())
    public = f"127.0.0.1:{named_cp.ports.public}"
    ca = pki / "ca.pem"
    async with AsyncClient(public, api_key, tls_ca=ca, tls_server_name=CP_NAME, timeout=5) as c:
        assert [m.name for m in await c.list_models()] == ["test-model"]
    for name in (None, "wrong.example"):  # negative: 127.0.0.1, or a name it does not carry
        async with AsyncClient(public, api_key, tls_ca=ca, tls_server_name=name, timeout=5) as c:
            with pytest.raises(Unavailable, match="Hostname Verification"):
                await c.list_models()

    def blocking() -> None:
        with Client(public, api_key, tls_ca=ca, tls_server_name=CP_NAME, timeout=5) as c:
            assert [m.name for m in c.list_models()] == ["test-model"]
        with Client(public, api_key, tls_ca=ca, timeout=5) as c, pytest.raises(Unavailable):
            c.list_models()
        admin = f"127.0.0.1:{named_cp.ports.admin}"
        with AdminClient(admin, named_cp.admin_token, tls_ca=ca, tls_server_name=CP_NAME) as a:
            assert [t.name for t in a.list_tenants()] == ["acme"]

    await asyncio.to_thread(blocking)
    with pytest.raises(TlsError, match="needs the CA"):
        AdminClient("127.0.0.1:1", "t", tls_server_name=CP_NAME)
    with pytest.raises(TlsError, match="empty"):
        Client("127.0.0.1:1", "k", tls_ca=ca, tls_server_name="")


def test_tls_server_name_is_sent_as_sni(pki: Path) -> None:
    """The name is also the SNI of the handshake (what a TLS proxy or ingress routes by): a TLS
    listener records the names clients send; without the option a client to 127.0.0.1 sends none."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "named.pem", pki / "named.key")
    ctx.set_alpn_protocols(["h2"])
    names: list[str | None] = []
    ctx.sni_callback = lambda _sock, name, _ctx: names.append(name)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True):
                pass  # handshake done, then hang up: the client's call fails, as expected

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        for name in (CP_NAME, None):
            target = f"127.0.0.1:{port}"
            admin = AdminClient(target, "t", tls_ca=pki / "ca.pem", tls_server_name=name, timeout=5)
            with admin, pytest.raises(Unavailable):
                admin.list_tenants()
    finally:
        done.set()
        thread.join(5)
        listener.close()
    assert CP_NAME in names
    assert set(names) - {CP_NAME} <= {None}  # never 127.0.0.1, nor another name
    assert names[-1] is None  # control: without the option, no name is sent


# -- tenants: limits in range, create-key ---------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path, quiet_logs: None) -> AsyncIterator[Any]:
    c = await make_cluster(tmp_path)
    yield c
    await c.close()


async def test_tenant_limits_out_of_range_are_usage_errors(cluster: Any) -> None:
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    bad = [
        ["tenants", "create", "x", "--max-concurrent", "-1"],
        ["tenants", "create", "x", "--max-concurrent", "99999999999"],
        ["tenants", "create", "x", "--max-tokens", str(2**31)],  # the tenant store's bound
        ["tenants", "set-limits", "acme", "--max-tokens", "-5"],
        ["tenants", "set-limits", "acme", "--max-concurrent", "99999999999"],
    ]
    for args in bad:
        assert_one_line_error(await run_cli(*args, *auth), 2)
    assert {t.name for t in cluster.cp.tenants.list()} == {"acme"}
    # control: in-range values are accepted ...
    result = await run_cli("tenants", "create", "x", "--max-concurrent", "0", *auth)
    assert result.exit_code == 0, result.output
    result = await run_cli("tenants", "set-limits", "acme", "--max-tokens", "5", *auth)
    assert result.exit_code == 0 and "max tokens 5" in result.stdout
    # ... up to the top of the range the tenant store keeps
    result = await run_cli("tenants", "create", "y", "--max-concurrent", str(2**31 - 1), *auth)
    assert result.exit_code == 0, result.output


async def test_tenants_create_key(cluster: Any) -> None:
    auth = ["--target", cluster.admin_target, "--admin-token", cluster.cp.admin_token]
    result = await run_cli("tenants", "create-key", "acme", "--json", *auth)
    assert result.exit_code == 0, result.output
    created = json.loads(result.stdout)
    assert created["tenant"] == "acme" and created["key_id"].startswith("key_")
    tenants = cluster.cp.tenants
    assert tenants.authenticate(created["api_key"]).name == "acme"  # the new key works ...
    assert tenants.authenticate(cluster.api_key).name == "acme"  # ... and the old one still does
    result = await run_cli("tenants", "create-key", "acme", *auth)
    assert result.exit_code == 0 and "shown once" in result.stdout
    # negative: no such tenant is one line, exit 1
    result = await run_cli("tenants", "create-key", "nobody", *auth)
    assert_one_line_error(result, 1, "NOT_FOUND")


async def test_demo_key_rotates_an_existing_demo_tenant(cluster: Any) -> None:
    """What a second `kvfence up` on one state directory does: a fresh key, older ones revoked."""
    tenants = cluster.cp.tenants

    def work() -> None:
        with AdminClient(cluster.admin_target, cluster.cp.admin_token) as admin:
            first = stack_cli.demo_key(admin)  # no demo tenant yet: created
            assert tenants.authenticate(first).name == "demo"
            admin.create_key("demo")  # e.g. `kvfence tenants create-key demo` in between
            second = stack_cli.demo_key(admin)  # the tenant exists: no ALREADY_EXISTS
            assert tenants.authenticate(second).name == "demo"
            assert tenants.authenticate(first) is None
            demo = next(t for t in admin.list_tenants() if t.name == "demo")
            assert [k.revoked for k in demo.keys].count(False) == 1
            # control: other tenants' keys are untouched
            assert tenants.authenticate(cluster.api_key).name == "acme"

    await asyncio.to_thread(work)


# -- kvfence events --kind ------------------------------------------------------------------------


def test_events_unknown_kind_is_a_usage_error() -> None:
    port = str(free_port())  # nothing listens: a valid invocation fails to connect, exit 1
    result = invoke("events", "--follow", "--mqtt-port", port, "--kind", "bogus")
    assert_one_line_error(result, 2, "bogus", *EVENT_KINDS)
    result = invoke("events", "-f", "--mqtt-port", port, "-k", "node_joined", "-k", "nope")
    assert_one_line_error(result, 2, "nope")
    # control: known kinds pass validation and the command goes on to the broker
    result = invoke("events", "-f", "--mqtt-port", port, "-k", "node_joined", "-k", "node_lost")
    assert_one_line_error(result, 1, "unreachable")


# -- the real `kvfence up`, twice on one state directory ------------------------------------------


@pytest.mark.slow
def test_up_twice_on_one_state_dir_and_sighup_stops_everything(tmp_path: Path) -> None:
    from stack_harness import Stack

    state = seed_embedded_model(tmp_path / "s")
    first = Stack(state).start()
    services = list(first.children)
    try:
        old_key = first.api_key
        assert first.proc is not None
        first.proc.send_signal(signal.SIGHUP)  # the terminal closed
        assert first.proc.wait(60) == 0
        _, alive = psutil.wait_procs(services, timeout=30)
        assert alive == [], "services outlived `kvfence up` after SIGHUP"
        assert not (state / "up.json").exists()
    finally:
        first.stop()
        for p in services:
            if p.is_running():
                p.kill()
    second = Stack(state).start()  # the demo tenant exists from the first run
    try:
        with second.client() as c:
            assert len(c.generate(prompt_ids=[1, 2], max_new_tokens=2, ignore_eos=True).token_ids)
        assert second.api_key != old_key
        with second.client(old_key) as c, pytest.raises(Unauthenticated):
            c.generate(prompt_ids=[1, 2], max_new_tokens=2)
    finally:
        second.stop()


@pytest.mark.parametrize(("command", "unreachable"), [("backup", 1), ("probe", 2)])
def test_a_timeout_grpc_cannot_set_is_a_usage_error(
    command: str, unreachable: int, tmp_path: Path
) -> None:
    """As for generate: above MAX_TIMEOUT_S gRPC's deadline overflowed, and the call failed at
    once DEADLINE_EXCEEDED, as if the server had not answered. Control: the largest timeout taken
    reaches the connection attempt at a port nothing listens on: "cannot reach", UNAVAILABLE
    (the probe's exit status for that is its setup error's, 2)."""
    target = ["--target", f"127.0.0.1:{free_port()}"]
    args = {
        "backup": ["tenants", "backup", str(tmp_path / "b.json"), "--admin-token", "t", *target],
        "probe": ["probe", "isolation", *target, "--tenant-a-key", "a", "--tenant-b-key", "b"],
    }[command]
    for too_large in ("1000000.5", "1e10", "inf"):
        result = invoke(*args, "--timeout", too_large)
        assert_one_line_error(result, 2, "Invalid value for '--timeout'")
        assert "DEADLINE_EXCEEDED" not in result.output
    result = invoke(*args, "--timeout", "1000000")
    assert_one_line_error(result, unreachable, "cannot reach", "Connection refused")
