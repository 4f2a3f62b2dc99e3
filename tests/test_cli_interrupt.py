"""Ctrl-C while ``kvfence`` loads its commands exits like any SIGINT (130), with no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvfence.cli as cli


def test_ctrl_c_while_the_commands_load_exits_130_without_a_traceback(monkeypatch, capsys) -> None:
    def interrupted(name: str):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 130
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


def test_the_commands_load_and_run_when_not_interrupted() -> None:
    # Positive control: the same entry point loads the commands and runs one.
    done = subprocess.run(
        [sys.executable, "-m", "kvfence", "up", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "--state-dir" in done.stdout
