"""Operator errors at the control plane's two ports and at the metrics port, in one clear line.

A CLI command pointed at the control plane's other port (the admin commands at the public port,
``generate`` or the probe at the admin port: under ``kvfence up`` they are one apart) printed only
``UNIMPLEMENTED: Method not found!``; it now names the target and the likely mix-up, with the exit
status the command uses for a server error. A metrics port that cannot be bound killed a service
with ``[Errno 98] Address already in use``, naming neither the address nor the setting; it now
does both, and what the control plane had started before it is not left serving. ``kvfence up``
refuses a fixed ``node.metrics_port``, which every service it starts would try to bind.

Every negative is paired with its control: the right port serves, a free metrics port serves.
The control plane runs in-process with fake nodes; the CLI runs in a worker thread (CliRunner).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent / "control_plane"))
from cp_fakes import make_model_info
from cp_harness import Cluster, make_cfg, make_cluster
from test_cli_robustness import free_port, invoke, run_cli

from control_plane.service import ControlPlane
from control_plane.service import serve as serve_cp
from control_plane.tenants import TenantLimits
from kvfence.cli import admin as admin_cli
from kvfence.cli import stack as stack_cli
from kvfence.config import Role, parse_config
from kvfence.metrics import Metrics
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node
from kvfence.server import BindError

UP_HINT = "(`kvfence up`'s admin port is the public port + 1)"


@pytest.fixture
async def cluster(tmp_path: Path, quiet_logs: None) -> AsyncIterator[Cluster]:
    c = await make_cluster(tmp_path)
    yield c
    await c.close()


def assert_one_line(result: Any, code: int, line: str) -> None:
    """Exit ``code`` with exactly ``line`` on stderr: no traceback, no raw status."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stderr.splitlines() == [line], result.stderr


def bindable(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (a bind without SO_REUSEADDR succeeds)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process (this test) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def metrics_in_use(port: int) -> str:
    return (
        f"cannot serve metrics on 127.0.0.1:{port} (node.metrics_port): the address is in use by "
        "another process"
    )


# -- a CLI command at the other port ---------------------------------------------------------------


async def test_admin_commands_at_the_public_port_say_so(cluster: Cluster) -> None:
    """With the right admin token at the public port: one line naming the target and the
    likely mix-up, exit 1 as for the admin commands' other server errors. Control: the same
    command at the admin port works."""
    token = ["--admin-token", cluster.cp.admin_token]
    for cmd in (["nodes"], ["tenants", "list"], ["model", "status"]):
        result = await run_cli(*cmd, "--target", cluster.target, *token)
        assert_one_line(
            result,
            1,
            f"{cluster.target} does not serve the kvfence Admin API (UNIMPLEMENTED): is it the "
            f"public port? {UP_HINT}",
        )
        result = await run_cli(*cmd, "--target", cluster.admin_target, *token)
        assert result.exit_code == 0, (cmd, result.output)
    result = await run_cli("nodes", "--json", "--target", cluster.admin_target, *token)
    assert len(json.loads(result.stdout)["nodes"]) == 2  # the fake decode and prefill nodes


@pytest.fixture
def older_admin() -> Iterator[str]:
    """An Admin API of an older release: the service is there (ListTenants answers) but later
    methods (GetModelStatus, BackupTenants, CheckConfig) are not. Its address."""
    from concurrent import futures

    import grpc

    from kvfence.proto.kvfence.v1 import control_pb2

    handler = grpc.method_handlers_generic_handler(
        "kvfence.v1.Admin",
        {
            "ListTenants": grpc.unary_unary_rpc_method_handler(
                lambda request, context: control_pb2.ListTenantsResponse(),
                request_deserializer=control_pb2.ListTenantsRequest.FromString,
                response_serializer=control_pb2.ListTenantsResponse.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_method_an_older_control_plane_lacks_is_not_called_the_wrong_port(
    older_admin: str, tmp_path: Path
) -> None:
    """UNIMPLEMENTED for one Admin method, where the Admin API itself answers (a CLI newer than
    its control plane), was told "is it the public port?" of the right port. ListTenants, which
    every release serves, tells the two apart. Control: the method that control plane has works,
    and the wrong port is still called the wrong port (the test above)."""
    token = ["--admin-token", "kvfa_x"]
    older = (
        f"the control plane at {older_admin} does not implement this command (UNIMPLEMENTED): an "
        "older release? Upgrade it, or use the kvfence CLI of its release"
    )
    for cmd in (["model", "status"], ["tenants", "backup", str(tmp_path / "b.backup")]):
        assert_one_line(invoke(*cmd, "--target", older_admin, *token), 1, older)
    assert_one_line(
        invoke("check-config", "--target", older_admin, *token), 2, f"check-config: {older}"
    )
    result = invoke("tenants", "list", "--target", older_admin, *token)  # control
    assert result.exit_code == 0, result.output


async def test_check_config_at_the_public_port_says_so(cluster: Cluster) -> None:
    """check-config's live mode, exit 2 (the check could not run). Control: at the admin
    port it runs and passes."""
    token = ["--admin-token", cluster.cp.admin_token]
    result = await run_cli("check-config", "--target", cluster.target, *token)
    assert_one_line(
        result,
        2,
        f"check-config: {cluster.target} does not serve the kvfence Admin API (UNIMPLEMENTED): "
        f"is it the public port? {UP_HINT}",
    )
    result = await run_cli("check-config", "--target", cluster.admin_target, *token)
    assert result.exit_code == 0, result.output


async def test_generate_at_the_admin_port_says_so(cluster: Cluster) -> None:
    """generate at the admin port with a valid API key: one line, exit 1 as for any failed
    request. Control: at the public port it generates."""
    args = ["--api-key", cluster.api_key, "--prompt-ids", "10,11", "-n", "2"]
    result = await run_cli("generate", "--target", cluster.admin_target, *args)
    assert_one_line(
        result,
        1,
        f"{cluster.admin_target} does not serve the kvfence public API (UNIMPLEMENTED): is it "
        "the admin port? (`kvfence up`'s public port is the admin port - 1)",
    )
    assert result.stdout == ""
    result = await run_cli("generate", "--target", cluster.target, "--json", *args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["usage"]["completion_tokens"] == 2


async def test_probe_at_the_admin_port_says_so(cluster: Cluster) -> None:
    """The isolation probe at the admin port said "cannot reach TARGET: UNIMPLEMENTED"; it
    says what generate says, exit 2 (could not run), in --json's error too. Control: at the
    public port it gets past its setup (the model is found, requests are sent)."""
    _, key_b, _ = cluster.cp.tenants.create_tenant("b", TenantLimits())
    keys = ["--tenant-a-key", cluster.api_key, "--tenant-b-key", key_b]
    opts = [*keys, "--requests", "1", "--concurrency", "1", "--timeout", "5"]
    wrong = (
        f"{cluster.admin_target} does not serve the kvfence public API (UNIMPLEMENTED): is it "
        "the admin port? (`kvfence up`'s public port is the admin port - 1)"
    )
    result = await run_cli("probe", "isolation", "--target", cluster.admin_target, *opts)
    assert_one_line(result, 2, f"kvfence probe isolation: {wrong}")
    result = await run_cli("probe", "isolation", "--target", cluster.admin_target, "--json", *opts)
    assert json.loads(result.stdout)["error"] == wrong
    result = await run_cli("probe", "isolation", "--target", cluster.target, "--json", *opts)
    report = json.loads(result.stdout)
    assert "error" not in report, result.output
    assert report["canary_requests"] >= 1 and report["model"] == "test-model", report


# -- kvfence up with a fixed metrics port ----------------------------------------------------------


@pytest.fixture
def stub_stack(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces run_stack: records the config `up` would run with and returns 0."""
    calls: list[dict[str, Any]] = []

    def fake_run_stack(cfg_path: Path, cfg: dict[str, Any], *_: Any) -> int:
        calls.append(cfg)
        return 0

    monkeypatch.setattr(stack_cli, "run_stack", fake_run_stack)
    return calls


def test_up_refuses_a_fixed_metrics_port(
    tmp_path: Path, stub_stack: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every service up starts reads its one config: with a fixed node.metrics_port the first
    bound it and the others died, and up said "nodes did not register" after waiting. Refused
    at once, exit 2, naming the setting (from the base config or KVFENCE__NODE__METRICS_PORT).
    Control: 0 (a free port each) and no setting run."""
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({"node": {"metrics_port": 50105}}))
    result = invoke("up", "--state-dir", str(tmp_path / "s1"), "--config", str(path))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("kvfence up: the config sets node.metrics_port 50105: "), line
    assert "use 0" in line
    with monkeypatch.context() as env:
        env.setenv("KVFENCE__NODE__METRICS_PORT", "9100")
        result = invoke("up", "--state-dir", str(tmp_path / "s2"))
        assert result.exit_code == 2, result.output
        assert "node.metrics_port 9100" in result.stderr
    assert stub_stack == []
    path.write_text(yaml.safe_dump({"node": {"metrics_port": 0}}))
    result = invoke("up", "--state-dir", str(tmp_path / "s3"), "--config", str(path))
    assert result.exit_code == 0, result.output
    assert stub_stack[-1]["node"]["metrics_port"] == 0
    result = invoke("up", "--state-dir", str(tmp_path / "s4"))
    assert result.exit_code == 0, result.output
    assert len(stub_stack) == 2


# -- a metrics port that is taken ------------------------------------------------------------------


async def test_control_plane_with_its_metrics_port_taken_starts_nothing(
    tmp_path: Path, taken_port: int
) -> None:
    """serve() bound the metrics port after both listeners had started and the broker was told
    the control plane was online, and its failure left them serving. Now the bind fails first:
    BindError naming the address and the setting, both listener ports free afterwards, and the
    state directory let go of (another control plane starts there). Control: with a free metrics
    port serve() runs and the endpoint answers."""
    public, admin = free_port(), free_port()
    cfg = make_cfg(tmp_path, listen=f"127.0.0.1:{public}", admin_listen=f"127.0.0.1:{admin}")
    taken = cfg.model_copy(
        update={"node": cfg.node.model_copy(update={"metrics_port": taken_port})}
    )
    with pytest.raises(BindError) as err:
        await serve_cp(taken, asyncio.Event(), model_info=make_model_info())
    assert str(err.value) == metrics_in_use(taken_port)
    assert bindable(public) and bindable(admin)
    again = ControlPlane(cfg, model_info=make_model_info())  # the state dir is free
    await again.start()
    await again.stop(grace=0)

    free = cfg.model_copy(update={"node": cfg.node.model_copy(update={"metrics_port": 0})})
    metrics = Metrics("control-plane")
    stop = asyncio.Event()
    task = asyncio.create_task(serve_cp(free, stop, model_info=make_model_info(), metrics=metrics))
    try:
        deadline = time.monotonic() + 10
        while not (metrics.port and not bindable(public)):
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert b"kvfence_build_info{" in body and b'service="control-plane"' in body
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert metrics.port is None and bindable(public)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


async def test_node_with_its_metrics_port_taken_starts_nothing(
    tiny_dir: Path, tmp_path: Path, taken_port: int
) -> None:
    """A node serves its metrics before anything else starts: with the port taken it fails with
    the address and the setting named, and its gRPC port was never bound. Control: a free
    metrics port serves."""
    listen = free_port()
    data: dict[str, Any] = {
        "model": {"path": str(tiny_dir)},
        "kv": {"page_size": 16, "prefill_pool": {"num_pages": 8}, "decode_pool": {"num_pages": 8}},
        "node": {"node_id": "prefill-m", "listen": f"127.0.0.1:{listen}"},
        "control_plane": {"state_dir": str(tmp_path)},
    }
    data["node"]["metrics_port"] = taken_port
    with pytest.raises(BindError) as err:
        await start_node(parse_config(data, environ={}), Role.PREFILL, register=False)
    assert str(err.value) == metrics_in_use(taken_port)
    assert bindable(listen)
    data["node"]["metrics_port"] = 0
    node = await start_node(parse_config(data, environ={}), Role.PREFILL, register=False)
    try:
        assert node.metrics.port and not bindable(listen)
        url = f"http://127.0.0.1:{node.metrics.port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert b'service="prefill"' in body
    finally:
        await node.stop(grace=0)


def test_serve_exits_1_with_one_line_when_its_metrics_port_is_taken(
    tmp_path: Path, taken_port: int
) -> None:
    """The process: `kvfence serve control-plane` prints the one line and exits 1 (at once, not
    after a stop of listeners it had started). Control: the same config with a free metrics
    port gets as far as serving (its log says so), and stops on SIGTERM."""
    cfg: dict[str, Any] = {
        "control_plane": {
            "state_dir": str(tmp_path / "state"),
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
        },
        "node": {"metrics_port": taken_port},
    }
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "kvfence", "serve", "control-plane", "--config", str(path)]
    done = subprocess.run(cmd, capture_output=True, timeout=60)
    assert done.returncode == 1, done
    # stderr carries the service's JSON log lines too (none before this failure, today)
    assert [line for line in done.stderr.decode().splitlines() if not line.startswith("{")] == [
        f"kvfence serve control-plane: {metrics_in_use(taken_port)}"
    ]
    assert b"control plane started" not in done.stderr  # it never started its listeners

    cfg["node"]["metrics_port"] = 0
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "cp.log"
    with log.open("wb") as out, subprocess.Popen(cmd, stdout=out, stderr=out) as proc:
        try:
            deadline = time.monotonic() + 60
            while b"control plane started" not in log.read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert b"metrics served" in log.read_bytes()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()


def test_an_unimplemented_call_whose_target_then_goes_is_named_neither_way(
    older_admin: str,
) -> None:
    """UNIMPLEMENTED, then ListTenants failing otherwise (the target gone since, or failing):
    neither an older release nor the wrong port can be told, and the line says both, where it
    said "older release?". Control: a target whose ListTenants answers is an older release."""
    gone = f"127.0.0.1:{free_port()}"
    assert admin_cli.unimplemented_admin(gone, "kvfa_x") == (
        f"{gone} does not implement this command (UNIMPLEMENTED), and did not answer again "
        "(UNAVAILABLE): the public port, or a control plane of an older release"
    )
    assert "an older release? Upgrade it" in admin_cli.unimplemented_admin(older_admin, "kvfa_x")
