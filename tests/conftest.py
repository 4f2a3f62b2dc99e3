"""Test-wide settings: UCX over TCP on loopback, offline Hugging Face, no leaked processes."""

from __future__ import annotations

import os

# Before anything imports ucxx: TCP on loopback is the transport every machine here has.
os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib
import io
from collections.abc import Iterator

import psutil
import pytest
import structlog


def _live_children() -> dict[int, psutil.Process]:
    live = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                live[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return live


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()[:5])
    except psutil.Error:
        return f"pid {p.pid}"


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_children():
    """Every test module leaves no child process behind (services, brokers, stacks); module scope
    because a module's shared stack legitimately outlives (and may restart nodes during) a test."""
    before = set(_live_children())
    yield
    leaked = [p for pid, p in _live_children().items() if pid not in before]
    names = [_cmd(p) for p in leaked]
    for p in leaked:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not leaked, f"test module left processes running: {names}"


@pytest.fixture(autouse=True)
def _structlog_config_restored() -> Iterator[None]:
    """Each test leaves structlog as it found it. The CLI configures it for the whole process
    (``kvlog.configure("console", "WARNING")``), so a CLI test run in-process left info lines
    filtered out for every later test: one capturing an info line then passed alone and failed
    in the suite."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """The in-process control plane logs through structlog, which prints to whatever sys.stdout
    is; while CliRunner captures stdout that would mix server logs into the command's output."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=io.StringIO()))
    yield
    structlog.reset_defaults()
