"""The admin commands' fallback to the local stack's admin token: only for that stack's own admin
address while its ``kvfence up`` runs, and said so in their help and the README.

Before, any target got ``./.kvfence/admin_token`` when no token was given: an operator in the
repository checkout (where `make up` wrote `.kvfence/`) who pointed KVFENCE_ADMIN_TARGET at
another cluster and forgot the token sent the local stack's credential there. Loopback alone is
not enough: the RUNBOOK's port-forward puts production's admin API at 127.0.0.1:50052, the local
stack's default admin address, so the token is read from ``up.json`` (there while ``up`` runs,
naming its pid and admin target) and sent only to that target. Commands run in-process (CliRunner)
against a fake AdminClient that records what it was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import typer
from typer.testing import CliRunner

from kvfence import client as client_mod
from kvfence.cli import admin as admin_cli

ROOT = Path(__file__).resolve().parents[1]
LOCAL_TOKEN = "kvfa_local_stack"
UP_ADMIN = "127.0.0.1:50052"
SAME = ["127.0.0.1:50052", "localhost:50052", "LOCALHOST:50052", "[::1]:50052", "127.8.9.10:50052"]
REMOTE = [
    "10.0.0.5:50052",
    "kvfence-admin.prod.svc:50052",
    "[fd00::1]:50052",
    "127.0.0.1.nip.io:50052",  # a name, whatever it starts with
    "dns:///127.0.0.1:50052",  # a gRPC scheme: not read as a host
    "127.0.0.1:50053",  # loopback, but not the local stack's admin port (a port-forward's)
    "127.0.0.1",  # no port
]


class FakeAdmin:
    """Stands for kvfence.client.AdminClient: records each construction, answers ListNodes."""

    made: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, target: str, token: str, **_: Any) -> None:
        FakeAdmin.made.append((target, token))

    def __enter__(self) -> FakeAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def list_nodes(self) -> Any:
        return SimpleNamespace(nodes=[], context_window=4096, admissible_limit=4096)


def write_up(state: Path, pid: int, admin_target: str = UP_ADMIN) -> None:
    up = {"target": "127.0.0.1:50051", "admin_target": admin_target, "admin_token": LOCAL_TOKEN}
    (state / "up.json").write_text(json.dumps({**up, "api_keys": {}, "pid": pid}))


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory where the local stack runs (its up.json names this live process and
    its admin token file is there too), no token in the environment."""
    state = tmp_path / ".kvfence"
    state.mkdir()
    (state / "admin_token").write_text(LOCAL_TOKEN + "\n")
    write_up(state, os.getpid())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVFENCE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("KVFENCE_ADMIN_TARGET", raising=False)
    monkeypatch.setattr(client_mod, "AdminClient", FakeAdmin)
    FakeAdmin.made = []
    yield tmp_path


def nodes(*args: str, env: dict[str, str] | None = None) -> Any:
    app = typer.Typer()
    groups = {name: typer.Typer() for name in ("serve", "tenants", "model", "probe")}
    for name, group in groups.items():
        app.add_typer(group, name=name)
    admin_cli.register(app, groups)
    return CliRunner().invoke(app, ["nodes", *args], env=env)


def refused(result: Any, target: str) -> None:
    assert result.exit_code == 1, result.output
    assert f"no admin token for {target}: pass --admin-token or set KVFENCE_ADMIN_TOKEN" in (
        result.output
    )
    assert LOCAL_TOKEN not in result.output
    assert FakeAdmin.made == []  # no connection was even set up


@pytest.mark.parametrize("target", SAME)
def test_the_local_stacks_admin_address_gets_its_token(checkout: Path, target: str) -> None:
    result = nodes("--target", target)
    assert result.exit_code == 0, result.output
    assert FakeAdmin.made == [(target, LOCAL_TOKEN)]


@pytest.mark.parametrize("target", REMOTE)
def test_another_target_never_gets_the_local_stacks_token(checkout: Path, target: str) -> None:
    result = nodes("--target", target)
    refused(result, target)
    assert f"the local stack here serves its admin API at {UP_ADMIN}" in result.output


@pytest.mark.parametrize("target", REMOTE[:2])
def test_another_target_gets_the_token_it_is_given(checkout: Path, target: str) -> None:
    """Control: the same targets are called, with the token given by flag or environment."""
    assert nodes("--target", target, "--admin-token", "kvfa_prod").exit_code == 0
    assert nodes("--target", target, env={"KVFENCE_ADMIN_TOKEN": "kvfa_env"}).exit_code == 0
    assert FakeAdmin.made == [(target, "kvfa_prod"), (target, "kvfa_env")]


def test_an_empty_token_variable_is_no_token(checkout: Path) -> None:
    """`KVFENCE_ADMIN_TOKEN= kvfence nodes`: unset for the fallback."""
    assert nodes("--target", UP_ADMIN, env={"KVFENCE_ADMIN_TOKEN": ""}).exit_code == 0
    assert nodes("--target", "10.0.0.5:50052", env={"KVFENCE_ADMIN_TOKEN": ""}).exit_code == 1
    assert FakeAdmin.made == [(UP_ADMIN, LOCAL_TOKEN)]


def test_a_port_forward_on_the_local_default_address_gets_no_token_once_up_stopped(
    checkout: Path,
) -> None:
    """The RUNBOOK's port-forward at 127.0.0.1:50052 with the local stack stopped (up.json gone,
    its admin_token file still there) or killed with -9 (up.json left, naming a dead pid)."""
    (checkout / ".kvfence" / "up.json").unlink()
    refused(nodes("--target", UP_ADMIN), UP_ADMIN)
    write_up(checkout / ".kvfence", dead_pid())
    refused(nodes("--target", UP_ADMIN), UP_ADMIN)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"pid": 0}', '{"pid": "x"}'])
def test_an_up_json_that_is_not_ups_gives_no_token(checkout: Path, content: str) -> None:
    (checkout / ".kvfence" / "up.json").write_text(content)
    refused(nodes("--target", UP_ADMIN), UP_ADMIN)


@pytest.mark.parametrize(
    ("target", "loopback"),
    [(t, True) for t in SAME] + [(t, False) for t in REMOTE[:5]] + [("::1", True), ("", False)],
)
def test_is_loopback(target: str, loopback: bool) -> None:
    assert admin_cli.is_loopback(target) is loopback


def test_the_help_and_the_readme_say_when_the_local_token_is_sent() -> None:
    help_text = " ".join(str(admin_cli.TOKEN.help).split())
    said = "the local stack's, from ./.kvfence/up.json while its kvfence up runs and --target is"
    assert said in help_text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "the local stack's (from `.kvfence/up.json`, while its `kvfence up` runs) only" in readme
