"""LocalStack.start() never takes an ``up.json`` left by an earlier stack for this run's, and
never removes one (a stack still running there keeps its credentials).

``kvfence up`` is replaced by a fake process (no services start): it writes its own ``up.json``
the first time it is polled, or has exited at once without writing one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import kvfence.localstack as localstack
from kvfence.localstack import LocalStack

STALE = {
    "target": "127.0.0.1:1",
    "admin_target": "127.0.0.1:2",
    "admin_token": "old",
    "pid": os.getpid() + 1,  # another `up`'s
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
        self.pid = os.getpid()  # psutil looks for its children: none that matter here

    def poll(self) -> int | None:
        if self.exits:
            return 1  # `up` failed before it wrote up.json
        (self.state_dir / "up.json").write_text(json.dumps({**FRESH, "pid": self.pid}))
        return None


def _stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, exits: bool) -> LocalStack:
    state = tmp_path / "state"

    def popen(cmd: list[str], **kw: Any) -> _FakeUp:
        assert cmd[2:4] == ["kvfence", "up"]
        return _FakeUp(state, exits=exits)

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
        assert stack.up == {**FRESH, "pid": os.getpid()}
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
        assert stack.up == {**FRESH, "pid": os.getpid()}
    finally:
        stack._log.close()
