"""The ``kvfence`` command line: serving, the local stack, generation and operator commands.

Each module in this package owns one area and adds its commands through ``register(app, groups)``;
heavy imports (torch, grpc services) happen inside the commands so that ``kvfence --help`` is fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import typer
import typer.main

from kvfence import logging as kvlog

app = typer.Typer(
    name="kvfence",
    help="Multi-tenant disaggregated LLM serving; no request reads KV cache it did not write.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

GROUPS: dict[str, typer.Typer] = {
    "serve": typer.Typer(help="Run one kvfence service in this process.", no_args_is_help=True),
    "model": typer.Typer(
        help="The embedded model and the model access switch.", no_args_is_help=True
    ),
    "tenants": typer.Typer(help="Tenants, API keys and limits.", no_args_is_help=True),
    "probe": typer.Typer(help="Probes against a running deployment.", no_args_is_help=True),
}
for _name, _group in GROUPS.items():
    app.add_typer(_group, name=_name)

# Modules that add commands; each is owned by one area of the code base.
COMMAND_MODULES = ("local", "stack", "generate", "admin", "events", "probe", "check")


def _load_commands() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"kvfence.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"kvfence.cli.{name}":
                continue  # area not built yet
            raise
        module.register(app, GROUPS)


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    kvlog.configure("console", "DEBUG" if verbose else "WARNING")


def prepare() -> Callable[[], Any]:
    """The click command of the whole CLI, every command module loaded (kvfence.entry runs it)."""
    _load_commands()
    return typer.main.get_command(app)


def main() -> None:
    """The CLI (kvfence.entry's main, which also turns a Ctrl-C while it loads into exit 130)."""
    from kvfence.entry import main as entry_main

    entry_main()
