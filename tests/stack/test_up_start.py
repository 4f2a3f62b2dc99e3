"""`kvfence up` start-up: one `up` per state directory, and a failed or stopped start says why.

A second `up` on the state directory of a running one rotated that stack's logs, deleted its
up.json, took the admin token already there as "the control plane started", revoked the demo key
the first had printed and printed "kvfence ready", before failing "control-plane exited with 1".
It is now refused before it touches anything. A start that fails said only the stage ("nodes
did not register" of a control plane that could not bind its port); a Ctrl-C during start said
"control plane did not start" and exited 1. `up` now names the service that exited and the last
line it logged, and a stop during start exits 0 as a stop after it does.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from stack_harness import Stack, free_port_pair
from stack_starts import seed_embedded_model

from kvfence.cli import stack as up_cli

pytestmark = pytest.mark.slow


def run_up(state_dir, port, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvfence", "up", "--state-dir", str(state_dir), "--port", str(port),
         *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def generate(stack, api_key):
    with stack.client(api_key) as c:
        return c.generate(prompt_ids=[1, 2], max_new_tokens=2, ignore_eos=True).token_ids


def demo_keys(stack):
    with stack.admin() as admin:
        (demo,) = [t for t in admin.list_tenants() if t.name == "demo"]
    return [k.key_id for k in demo.keys if not k.revoked]


def test_a_second_up_on_a_running_stacks_state_dir_is_refused_and_leaves_it_alone(tmp_path):
    a = Stack(seed_embedded_model(tmp_path / "a")).start()
    try:
        up_json = tmp_path / "a" / "up.json"
        before = up_json.read_text()
        keys = demo_keys(a)
        port = int(a.target.rsplit(":", 1)[1])
        second = run_up(tmp_path / "a", port)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip() == (
            f"kvfence up: another kvfence up (pid {a.proc.pid}) is running on {tmp_path / 'a'}: "
            "stop it, or use another --state-dir and --port"
        )
        assert "kvfence ready" not in second.stdout
        # The running stack is as it was: its up.json, its demo key, its logs (not rotated).
        assert up_json.read_text() == before
        assert demo_keys(a) == keys and generate(a, a.api_key)
        logs = tmp_path / "a" / "logs"
        assert "control plane started" in (logs / "cp.log").read_text()
        assert not list(logs.glob("*.log.1"))

        # Another state directory on the running stack's port, with the running stack's admin
        # token (a shared control_plane.admin_token_file): the token is there and the admin port
        # answers with it at once, but not from this run's control plane, which cannot listen.
        # up said "kvfence ready" there, having revoked the running stack's demo key, or
        # "nodes did not register"; it now names the cause.
        base = tmp_path / "shared-token.yaml"
        token_file = tmp_path / "a" / "admin_token"
        base.write_text(json.dumps({"control_plane": {"admin_token_file": str(token_file)}}))
        model = ["--model", str(tmp_path / "a" / "models" / "tiny-llama")]  # not written again
        busy = run_up(tmp_path / "b", port, "--config", str(base), *model)
        assert busy.returncode == 1
        assert "kvfence ready" not in busy.stdout, busy.stdout
        assert (
            f"kvfence up: control-plane exited with 1: kvfence serve control-plane: cannot listen "
            f"on 127.0.0.1:{port}: the address is in use" in busy.stderr
        ), busy.stderr
        assert f"; see {tmp_path / 'b' / 'logs'}" in busy.stderr
        assert "did not" not in busy.stderr
        assert up_json.read_text() == before
        assert demo_keys(a) == keys and generate(a, a.api_key)

        # Control: that state directory (and token) on a free port starts, while the first runs.
        shared = {"control_plane": {"admin_token_file": str(token_file)}}
        b = Stack(tmp_path / "b", config=shared, args=model).start()
        try:
            assert generate(b, b.api_key)
        finally:
            b.stop()

        # A stop after start: exit 0, nothing said; the lock goes with the process.
        a.proc.send_signal(signal.SIGINT)
        assert a.proc.wait(60) == 0
        assert "kvfence up:" not in (tmp_path / "a" / "up.out").read_text()
        with open(tmp_path / "a" / "up.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        a.stop()


def test_ctrl_c_during_start_stops_what_started_and_exits_0(tmp_path):
    state = tmp_path / "s"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfence", "up", "--state-dir", str(state),
         "--port", str(free_port_pair())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # The control plane is starting: there is something to stop, and it has not started.
        while not (children := psutil.Process(proc.pid).children(recursive=True)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert "control plane started" not in (state / "logs" / "cp.log").read_text()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert err.strip() == "kvfence up: stopped"
    assert "kvfence ready" not in out
    assert not (state / "up.json").exists()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)


def in_process_up(monkeypatch, *args):
    """`kvfence up` in this process, run_stack stubbed: returns the result and what the stub saw
    (whether up.lock was held while it ran)."""
    import typer
    from typer.testing import CliRunner

    seen = []

    def fake_run_stack(cfg_path, cfg, state_dir, *_):
        with open(state_dir / "up.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("free")
            except BlockingIOError:
                seen.append("held")
        return 0

    monkeypatch.setattr(up_cli, "run_stack", fake_run_stack)
    app = typer.Typer()
    groups = {"serve": typer.Typer()}
    app.add_typer(groups["serve"], name="serve")
    up_cli.register(app, groups)
    return CliRunner().invoke(app, ["up", *args]), seen


def test_a_held_state_dir_is_refused_before_up_writes_there_and_let_go_when_up_ends(
    tmp_path, monkeypatch
):
    state = tmp_path / "s"
    (state / "logs").mkdir(parents=True)
    files = {"up-config.yaml": "theirs\n", "up.json": "{}\n", "logs/cp.log": "their run\n"}
    for name, text in files.items():
        (state / name).write_text(text)
    with open(state / "up.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write("4242\n")
        holder.flush()
        result, seen = in_process_up(monkeypatch, "--state-dir", str(state), "--port", "40000")
        assert result.exit_code == 2
        assert result.stderr == (
            f"kvfence up: another kvfence up (pid 4242) is running on {state}: stop it, or use "
            "another --state-dir and --port\n"
        )
        assert seen == []
        assert {name: (state / name).read_text() for name in files} == files
        assert sorted(p.name for p in (state / "logs").iterdir()) == ["cp.log"]
    # Control: with the holder gone, up runs, holding the lock while the stack runs, and lets
    # go of it when it ends (a second in this process runs too).
    for _ in range(2):
        result, seen = in_process_up(monkeypatch, "--state-dir", str(state), "--port", "40000")
        assert result.exit_code == 0, result.output
        assert seen == ["held"]
        assert (state / "up.lock").read_text() == f"{os.getpid()}\n"
        assert (state / "up-config.yaml").read_text() != "theirs\n"


# -- the messages, without processes ---------------------------------------------------------------


def test_last_log_line_reads_structlog_json_and_keeps_other_lines(tmp_path):
    log = tmp_path / "x.log"
    assert up_cli.last_log_line(log) == ""  # no log at all
    log.write_text("\n\n")
    assert up_cli.last_log_line(log) == ""
    line = {
        "component": "node",
        "node_id": "decode-0",
        "event": "cannot register",
        "level": "error",
        "timestamp": "2026-01-01T00:00:00Z",
        "exception": 'Traceback (most recent call last):\n  File "x"\nOSError: boom\n',
    }
    log.write_text("first line\n" + json.dumps(line) + "\n\n")
    assert up_cli.last_log_line(log) == (
        "cannot register (component=node, node_id=decode-0): OSError: boom"
    )
    log.write_text(json.dumps(line) + "\nkvfence serve decode: [Errno 98] Address already in use\n")
    assert up_cli.last_log_line(log) == "kvfence serve decode: [Errno 98] Address already in use"


def test_a_timeout_keeps_the_stage_and_an_exit_names_the_cause(tmp_path, capsys):
    (tmp_path / "decode-0.log").write_text(json.dumps({"event": "model mismatch"}) + "\n")
    assert up_cli._not_ready(up_cli.TIMED_OUT, "nodes did not register", tmp_path) == 1
    assert capsys.readouterr().err == f"kvfence up: nodes did not register; see {tmp_path}\n"
    exited = ("decode-0", SimpleNamespace(returncode=3))
    assert up_cli._not_ready(exited, "nodes did not register", tmp_path) == 1  # type: ignore[arg-type]
    assert capsys.readouterr().err == (
        f"kvfence up: decode-0 exited with 3: model mismatch; see {tmp_path}\n"
    )
    assert up_cli._not_ready(up_cli.STOPPED, "nodes did not register", tmp_path) == 0
    assert capsys.readouterr().err == "kvfence up: stopped\n"


def test_wait_says_why_it_stopped():
    alive = SimpleNamespace(poll=lambda: None)
    gone = SimpleNamespace(poll=lambda: 1)
    procs = [("control-plane", alive), ("decode-0", gone), ("prefill-0", gone)]
    assert up_cli._wait(lambda: True, 5, lambda: False, procs[:1]) == up_cli.READY
    assert up_cli._wait(lambda: False, 5, lambda: True, procs) == up_cli.STOPPED
    assert up_cli._wait(lambda: True, 5, lambda: False, procs) == ("decode-0", gone)
    assert up_cli._wait(lambda: False, 0.3, lambda: False, procs[:1]) == up_cli.TIMED_OUT


def test_listens_on_says_it_cannot_tell_when_proc_shows_no_listener(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where /proc's TCP tables cannot be read, or show no listening socket at all (WSL1 leaves
    them empty), ``listens_on`` cannot tell (None: ``up`` then goes by the admin port's answer);
    it said False, and ``up`` waited a minute for a control plane that ran. Control: with the
    tables, this process's own listener is found, and a port nobody listens on is False."""
    import socket
    from pathlib import Path

    with socket.socket() as s, socket.socket() as idle:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        idle.bind(("127.0.0.1", 0))  # bound, not listening: its port is free of listeners
        free = idle.getsockname()[1]
        assert up_cli.listens_on(os.getpid(), port) is True  # control
        assert up_cli.listens_on(os.getpid(), free) is False  # control
        real = Path.read_text

        def no_tables(self: Path, *args: object, **kwargs: object) -> str:
            if str(self).startswith("/proc/net/tcp"):
                raise PermissionError(13, "Permission denied")
            return real(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "read_text", no_tables)
        assert up_cli.listens_on(os.getpid(), port) is None
        monkeypatch.setattr(
            Path,
            "read_text",
            lambda self, *a, **k: (
                "  sl  local_address ...\n"
                if str(self).startswith("/proc/net/tcp")
                else real(self, *a, **k)
            ),  # type: ignore[arg-type]
        )
        assert up_cli.listens_on(os.getpid(), port) is None
