"""The admin CLI's tables print what the control plane sent, as text: rich read "[...]" in a cell
as markup, so an IPv6 node's address, "[fd00:10:244::5]:50061" (what the chart's IPv6 pods
advertise), showed as ":50061", and a node id or release string with brackets (nodes choose
them) lost them too. ``--json`` always had them whole; the table now matches it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import kvfence.client as client_mod
from kvfence.cli import admin as admin_cli
from kvfence.proto.kvfence.v1 import control_pb2
from tests.fake_client import FakeClientBase

NODES = control_pb2.ListNodesResponse(
    nodes=[
        control_pb2.NodeInfo(
            node_id="decode-[blue]0",
            role="decode",
            grpc_address="[fd00:10:244::5]:50061",
            total_pages=8,
            free_pages=8,
            healthy=True,
            kvfence_version="0.1.0[dev]",
        ),
        control_pb2.NodeInfo(
            node_id="prefill-0", role="prefill", grpc_address="10.0.0.7:50061", healthy=True
        ),
    ],
    context_window=2048,
    admissible_limit=1024,
)


class FakeAdmin(FakeClientBase):
    def list_nodes(self) -> control_pb2.ListNodesResponse:
        return NODES


@pytest.fixture(autouse=True)
def fake_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "AdminClient", FakeAdmin)


def nodes(*args: str) -> Any:
    app = typer.Typer()
    admin_cli.register(app, {name: typer.Typer() for name in ("tenants", "model")})
    result = CliRunner().invoke(app, ["nodes", "--admin-token", "kvfa_x", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_nodes_table_shows_brackets_as_sent() -> None:
    table = nodes()
    for whole in ("[fd00:10:244::5]:50061", "decode-[blue]0", "0.1.0[dev]"):
        assert whole in table, table
    assert "10.0.0.7:50061" in table and "prefill-0" in table  # control: plain cells as before


def test_control_json_has_the_same_values() -> None:
    listed = json.loads(nodes("--json"))
    assert [n["grpc_address"] for n in listed["nodes"]] == [
        "[fd00:10:244::5]:50061",
        "10.0.0.7:50061",
    ]
