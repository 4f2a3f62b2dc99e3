"""What `--help` tells an operator: what the commands need and do by default, as the code does it.

`kvfence events --help` once showed --follow as optional (without it: exit 2) and no defaults (the
cluster `local` is the trap of a Helm install, whose clusterName is `kvfence`); `kvfence --help`
broke the `nodes` line mid-sentence; `tenants set-limits --scrub-on-free` had no help, `generate
--timeout` no range nor default, `check-config` no exit 2.
"""

from __future__ import annotations

import inspect
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvfence import MAX_TIMEOUT_S
from kvfence import cli as kvfence_cli
from kvfence.client import check_timeout
from kvfence.errors import InvalidArgument

# The operator commands' modules, whose every option must say what it does.
DOCUMENTED = (
    "kvfence.cli.admin",
    "kvfence.cli.events",
    "kvfence.cli.generate",
    "kvfence.cli.check",
)


@pytest.fixture(scope="module")
def root() -> Any:
    """The whole CLI's click command, every command module loaded, as `kvfence` runs it."""
    return kvfence_cli.prepare()


def run(*args: str) -> Any:
    return CliRunner().invoke(kvfence_cli.app, list(args))


def shown(*args: str) -> str:
    """`kvfence ARGS --help` as a reader sees it, the panels' borders gone and the lines joined."""
    # wide enough that no column is cut short with an ellipsis
    result = CliRunner().invoke(kvfence_cli.app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    for name, cmd in getattr(group, "commands", {}).items():
        yield " ".join((*path, name)), cmd
        yield from commands(cmd, (*path, name))


def test_events_help_says_follow_is_required_and_shows_the_defaults(root: Any) -> None:
    text = shown("events")
    assert "--follow -f <bool> Required: stream events as they arrive" in text
    assert "[default: (127.0.0.1, or events.mqtt_host of --config)]" in text
    assert "[default: (1883, or events.mqtt_port of --config)]" in text
    assert "[default: (local, or cluster of --config)]" in text
    assert "the Helm chart's clusterName, default kvfence" in text


def test_events_without_follow_still_exits_2(root: Any) -> None:
    result = run("events", "--cluster", "a/b")
    assert result.exit_code == 2
    assert "kvfence events needs --follow (only the live view exists)" in result.output
    # control: with --follow the same call gets past that check, to the next refusal
    result = run("events", "--follow", "--cluster", "a/b")
    assert result.exit_code == 2
    assert "needs --follow" not in result.output and "cannot be a cluster name" in result.output


def test_every_commands_line_in_its_groups_help_is_one_line(root: Any) -> None:
    """The group's panel shows a command's first paragraph, keeping its line breaks (typer's
    rich mode): a docstring wrapped there breaks the line mid-sentence."""
    broken = {
        path: first
        for path, cmd in commands(root)
        if "\n" in (first := inspect.cleandoc(cmd.help or "").split("\n\n")[0])
    }
    assert broken == {}
    assert "nodes" in dict(commands(root))
    assert "Registered nodes: pools, heartbeats, draining, release, and the enforced limit." in (
        shown()
    )


def test_every_option_of_the_operator_commands_has_help(root: Any) -> None:
    bare = [
        f"{path} {'/'.join(param.opts + param.secondary_opts)}"
        for path, cmd in commands(root)
        if cmd.callback is not None and cmd.callback.__module__ in DOCUMENTED
        for param in cmd.params
        if param.param_type_name == "option" and not param.help
    ]
    assert bare == []
    text = shown("tenants", "set-limits")
    said = "--scrub-on-free --no-scrub-on-free <bool> Zero the tenant's pages when they are freed"
    assert said in text


def test_generate_timeout_help_gives_the_bounds_the_client_enforces(root: Any) -> None:
    text = shown("generate")
    assert f"Deadline in seconds: above 0, at most {MAX_TIMEOUT_S} (else exit 2)" in text
    assert "Unset, the client sets none and the control plane's" in text
    # the bounds the help gives are the client's
    check_timeout(MAX_TIMEOUT_S)
    check_timeout(None)
    for bad in (0.0, MAX_TIMEOUT_S + 1):
        with pytest.raises(InvalidArgument):
            check_timeout(bad)


def test_check_config_help_gives_its_exit_codes_and_2_is_what_it_does(root: Any) -> None:
    assert "Exit 0 yes, 1 no, 2 not checked." in shown()
    assert "2: the check could not run" in shown("check-config")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run("check-config", "--target", f"127.0.0.1:{port}", "--admin-token", "kvfa_x")
    assert result.exit_code == 2, result.output
    assert "UNAVAILABLE" in result.output


def test_shown_joins_a_wrapped_help_back_together() -> None:
    """Control for ``shown``: a help text wrapped over several lines in a panel reads whole."""
    app = typer.Typer()

    @app.command()
    def cmd(x: int = typer.Option(1, "--x", help="word " * 40 + "end.")) -> None: ...

    result = CliRunner().invoke(app, ["--help"], terminal_width=60)
    assert result.output.count("word") == 40 and "\n" in result.output.split("--x", 1)[1][:200]
    assert ("word " * 39 + "word end.") in " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
