"""Ctrl-C while ``kvfence`` loads (its imports, its command modules, the click command) exits like
any SIGINT (130), with no traceback (kvfence/entry.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer.main

import kvfence.cli as cli
from kvfence import entry


def interrupted(*_: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "where",
    [
        "kvfence.cli.importlib.import_module",  # a command module importing
        "typer.main.get_command",  # click's command being built
        "kvfence.cli.prepare",  # anything before (kvfence.cli's own imports)
    ],
)
def test_ctrl_c_while_the_cli_loads_exits_130_without_a_traceback(
    monkeypatch, capsys, where: str
) -> None:
    monkeypatch.setattr(where, interrupted)
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    assert exit_.value.code == 130
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out


def test_the_cli_loads_and_runs_when_not_interrupted() -> None:
    # Positive control: the same entry point (the one `python -m kvfence` and the console script
    # run) loads the commands and runs one.
    done = subprocess.run(
        [sys.executable, "-m", "kvfence", "up", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "--state-dir" in done.stdout


def test_the_old_entry_point_still_runs(monkeypatch) -> None:
    # kvfence.cli:main was the console script before kvfence.entry (an environment installed
    # then keeps that script until it is reinstalled).
    monkeypatch.setattr("sys.argv", ["kvfence", "--help"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 0
    assert typer.main.get_command(cli.app).commands  # loaded
