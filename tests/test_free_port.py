"""``kvfence.localstack.free_port``: ports for listeners the tests and LocalStack start later.

A port ``bind(0)`` hands out is an ephemeral one, which another process's outgoing connection
may take before the listener binds it: a CI run's decode node failed to start with UCX's bind
"Address already in use" on one. The ports now come from below the ephemeral range, and one
something holds is never handed out."""

from __future__ import annotations

import socket

import pytest

from kvfence import localstack
from kvfence.localstack import free_port, free_port_pair


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    ephemeral = localstack._ephemeral_start()
    for _ in range(20):
        port = free_port_pair()
        assert port >= 10_000
        assert port + 1 < ephemeral
        assert bindable(port) and bindable(port + 1)


def test_a_port_something_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    low = free_port(2)
    # Only low and low + 1 can be drawn.
    monkeypatch.setattr(localstack, "_LOWEST_PORT", low)
    monkeypatch.setattr(localstack, "_ephemeral_start", lambda: low + 2)
    assert {free_port() for _ in range(40)} == {low, low + 1}  # control: both free, both drawn
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        held.listen()
        assert {free_port() for _ in range(40)} == {low + 1}
        with socket.socket() as other:
            other.bind(("127.0.0.1", low + 1))
            other.listen()
            with pytest.raises(RuntimeError, match="no 1 free"):
                free_port()
