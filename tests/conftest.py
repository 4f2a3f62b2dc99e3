"""Test-wide settings: UCX over TCP on loopback, offline Hugging Face, no leaked processes."""

from __future__ import annotations

import os

# Before anything imports ucxx: TCP on loopback is the transport every machine here has.
os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import psutil
import pytest


@pytest.fixture(autouse=True)
def _no_leaked_children():
    """Every test leaves no child process behind (services, brokers, stacks)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leaked = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.is_running()
    ]
    leaked = [p for p in leaked if p.status() != psutil.STATUS_ZOMBIE]
    for p in leaked:
        p.kill()
    assert not leaked, f"test left processes running: {[p.cmdline()[:4] for p in leaked]}"
