"""LocalStack.start() never takes an ``up.json`` left by an earlier stack for this run's, and
never removes one (a stack still running there keeps its credentials).

``kvfence up`` is replaced by a fake process (no services start): it writes its own ``up.json``
the first time it is polled, or has exited at once without writing one. The last test's fake
``up`` is a real process that starts one service and dies: stop() waits for that service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvfence.localstack as localstack
from kvfence.localstack import LocalStack


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


DEAD_PID = _dead_pid()


STALE = {
    "target": "127.0.0.1:1",
    "admin_target": "127.0.0.1:2",
    "admin_token": "old",
    "pid": DEAD_PID + 1,  # another `up`'s
}
FRESH = {
    "target": "127.0.0.1:3",
    "admin_target": "127.0.0.1:4",
    "admin_token": "new",
    "api_keys": {"demo": "k"},
}


class _FakeUp:
    """Stands for ``subprocess.Popen([... "kvfence", "up", ...])``."""

    def __init__(self, state_dir: Path, *, exits: bool) -> None:
        self.state_dir = state_dir
        self.exits = exits
        # No process: stop() stops the children of `up` and whatever names it as its `up`
        # (LocalStack._services), which for this process's own pid would be the test run's.
        self.pid = DEAD_PID

        self.signals: list[int] = []

    def poll(self) -> int | None:
        if self.exits or self.signals:
            return 1  # `up` failed before it wrote up.json, or was stopped
        (self.state_dir / "up.json").write_text(json.dumps({**FRESH, "pid": self.pid}))
        return None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        return 1


STARTED: list[_FakeUp] = []  # what the latest _stack's Popen started


def _stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, exits: bool) -> LocalStack:
    state = tmp_path / "state"

    def popen(cmd: list[str], **kw: Any) -> _FakeUp:
        assert cmd[2:4] == ["kvfence", "up"]
        STARTED.append(_FakeUp(state, exits=exits))
        return STARTED[-1]

    STARTED.clear()

    monkeypatch.setattr(localstack.subprocess, "Popen", popen)
    return LocalStack(state)


def _leave_stale(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "up.json").write_text(json.dumps(STALE))  # an earlier stack, killed


def test_a_stale_up_json_is_not_read_as_this_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _leave_stale(tmp_path)
    stack = _stack(tmp_path, monkeypatch, exits=False).start(timeout=30)
    try:
        assert stack.up == {**FRESH, "pid": DEAD_PID}
    finally:
        stack._log.close()


def test_a_failed_up_is_reported_not_covered_by_a_stale_up_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _leave_stale(tmp_path)
    stack = _stack(tmp_path, monkeypatch, exits=True)
    with pytest.raises(RuntimeError, match="kvfence up failed"):
        stack.start(timeout=30)
    # The refused run's own up.json never came; the other stack's is as it left it.
    assert json.loads((tmp_path / "state" / "up.json").read_text()) == STALE


def test_control_a_fresh_state_dir_reads_this_runs_up_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = _stack(tmp_path, monkeypatch, exits=False).start(timeout=30)
    try:
        assert stack.up == {**FRESH, "pid": DEAD_PID}
    finally:
        stack._log.close()


@pytest.mark.parametrize("stale", ["", "{", "[1]", "{not json"])
def test_a_stale_up_json_cut_short_is_waited_past(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stale: str
) -> None:
    """A stale file that is not this run's in any form (cut short by a full disk, say) is not this
    run's up.json; it raised out of start() and left the `up` it had started running."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "up.json").write_text(stale)
    stack = _stack(tmp_path, monkeypatch, exits=False).start(timeout=30)
    try:
        assert stack.up == {**FRESH, "pid": DEAD_PID}
    finally:
        stack._log.close()


def test_an_interrupted_start_stops_the_up_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while start() waits: the `up` it started is stopped (SIGTERM), not left running.
    Control: the same start, not interrupted, leaves it running (no signal)."""
    import signal

    _leave_stale(tmp_path)  # so the first look finds no up.json of this run, and waits
    stack = _stack(tmp_path, monkeypatch, exits=False)

    def interrupted(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(localstack.time, "sleep", interrupted)
    monkeypatch.setattr(_FakeUp, "poll", lambda self: None)  # never writes up.json
    with pytest.raises(KeyboardInterrupt):
        stack.start(timeout=30)
    assert [up.signals for up in STARTED] == [[signal.SIGTERM]]

    monkeypatch.undo()
    control = _stack(tmp_path, monkeypatch, exits=False).start(timeout=30)
    try:
        assert [up.signals for up in STARTED] == [[]]
    finally:
        control._log.close()


# A service as `kvfence up` starts one: told its `up` in the environment (PARENT_ENV), stopped by
# the kernel's SIGTERM when that `up` dies (PR_SET_PDEATHSIG), and taking a moment to stop.
SERVICE = """
import ctypes, signal, sys, time
def stop(*_):
    time.sleep(0.5)  # its graceful stop
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
print("ready", flush=True)
time.sleep(60)
"""
# An `up` that starts one such service, then dies before it wrote up.json.
DYING_UP = """
import os, subprocess, sys
env = {**os.environ, "KVFENCE_STOP_WITH_PARENT": str(os.getpid())}
service = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, start_new_session=True
)
service.stdout.readline()
open(sys.argv[2], "w").write(str(service.pid))
os._exit(1)
"""
REAL_POPEN = subprocess.Popen


def test_a_start_whose_up_died_waits_for_the_services_it_had_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`up` died during start, its services still stopping: start() raised while they ran on,
    since stop() knew only the services of a start that had returned. Now it finds them by the
    `up` they name, and returns once they are gone. Control: a process naming another `up` is
    left alone (never by the state directory: a refused second stack must not stop the first)."""
    import psutil

    from kvfence.cli.stack import PARENT_ENV

    pid_file = tmp_path / "service.pid"

    def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        assert cmd[2:4] == ["kvfence", "up"]
        return REAL_POPEN([sys.executable, "-c", DYING_UP, SERVICE, str(pid_file)], **kw)

    bystander = REAL_POPEN(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, PARENT_ENV: str(os.getpid())},  # another `up`'s service
    )
    try:
        monkeypatch.setattr(localstack.subprocess, "Popen", popen)
        with pytest.raises(RuntimeError, match="kvfence up failed"):
            LocalStack(tmp_path / "state").start(timeout=60)
        monkeypatch.undo()
        service = int(pid_file.read_text())
        gone = not psutil.pid_exists(service) or psutil.Process(service).status() == "zombie"
        assert gone, "start() returned with the dead up's service still running"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
