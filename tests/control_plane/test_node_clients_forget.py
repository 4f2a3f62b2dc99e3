"""NodeClients keeps call counts per node id only for nodes still registered: a node lost is
folded into per-method totals, so counts do not grow with every node that ever came and went."""

from __future__ import annotations

import types

from control_plane.routing import NodeClients


def node(node_id: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(node_id=node_id)


def test_a_lost_nodes_counts_fold_into_totals_and_the_live_ones_stay() -> None:
    clients = NodeClients("kvfn_token")
    for i in range(1000):
        clients.count(node(f"decode-{i}"), "Reserve")
        clients.count(node(f"decode-{i}"), "Release")
    clients.count(node("decode-live"), "Reserve")
    for i in range(1000):
        clients.forget(f"decode-{i}")
    # Bounded by the nodes still there: only the live node's entry is left.
    assert dict(clients.rpc_counts) == {("decode-live", "Reserve"): 1}
    # Control: nothing counted is lost from the totals.
    assert clients.total("Reserve") == 1001 and clients.total("Release") == 1000
    assert clients.total() == 2001


def test_a_node_forgotten_and_back_counts_afresh_under_its_id() -> None:
    clients = NodeClients("kvfn_token")
    clients.count(node("prefill-0"), "Prefill")
    clients.forget("prefill-0")
    clients.count(node("prefill-0"), "Prefill")
    assert clients.rpc_counts[("prefill-0", "Prefill")] == 1 and clients.total("Prefill") == 2


def test_a_call_counted_on_a_node_already_lost_does_not_bring_its_key_back() -> None:
    lost = {"decode-0"}
    clients = NodeClients("kvfn_token", registered=lambda n: n.node_id not in lost)
    clients.count(node("decode-0"), "Decode")  # a request that chose it before it was lost
    clients.count(node("decode-1"), "Decode")  # control: a registered node keeps its key
    assert dict(clients.rpc_counts) == {("decode-1", "Decode"): 1}
    assert clients.total("Decode") == 2
