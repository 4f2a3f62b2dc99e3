"""A node with no ``node.node_id`` gets ``<role>-<hostname>-<pid>``: nodes in two containers (each
pid 1) must not share an id, or the second to register supersedes the first and the role serves
as one node."""

from __future__ import annotations

import re

import pytest

from kvfence.config import NAME_PATTERN, Role
from kvfence.node import default_node_id


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_two_containers_with_pid_1_get_different_ids(monkeypatch, role: Role) -> None:
    monkeypatch.setattr("os.getpid", lambda: 1)
    ids = []
    for host in ("a1b2c3d4e5f6", "f6e5d4c3b2a1"):  # Docker names a container's host by its id
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        ids.append(default_node_id(role))
    assert ids == [f"{role.value}-a1b2c3d4e5f6-1", f"{role.value}-f6e5d4c3b2a1-1"]


def test_one_host_one_pid_is_one_id(monkeypatch) -> None:
    # Positive control: the id is stable for one process, so a restart in place (same host name,
    # same pid 1) is recognised as the same node (NODE_RESTARTED, not a misrouted transfer).
    monkeypatch.setattr("os.getpid", lambda: 1)
    monkeypatch.setattr("socket.gethostname", lambda: "decode-7f9c")
    assert default_node_id(Role.DECODE) == default_node_id(Role.DECODE) == "decode-decode-7f9c-1"


@pytest.mark.parametrize(
    ("host", "expected"),
    [("node 1/with+odd#chars", "decode-node_1_with_odd_chars-42"), ("", "decode-host-42")],
)
def test_host_names_a_node_id_may_not_hold_are_made_valid(monkeypatch, host, expected) -> None:
    monkeypatch.setattr("os.getpid", lambda: 42)
    monkeypatch.setattr("socket.gethostname", lambda: host)
    node_id = default_node_id(Role.DECODE)
    assert node_id == expected
    assert re.match(NAME_PATTERN, node_id)  # a level of the node's MQTT topics
