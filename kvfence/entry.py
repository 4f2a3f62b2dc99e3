"""The ``kvfence`` command's entry point (the console script and ``python -m kvfence``).

It imports nothing at module level, so that a Ctrl-C while Python loads the CLI (typer, ssl, the
command modules: a few tenths of a second) exits as a SIGINT does, 130, without a traceback of
whatever was importing. Click answers a Ctrl-C once a command runs ("Aborted!", or the command's
own handling)."""

import signal
import sys


def main() -> None:
    try:
        from kvfence.cli import prepare

        command = prepare()
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
    command()
