"""Node registration: fingerprint and layout must match the model; heartbeats; pool checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from cp_fakes import FINGERPRINT, FakeNode, Script, make_layout
from cp_harness import Cluster, eventually, make_cluster

from kvfence import PROTOCOL_VERSION, __version__
from kvfence.errors import Unavailable
from kvfence.proto.kvfence.v1 import control_pb2, control_pb2_grpc


async def test_node_with_other_fingerprint_is_refused(cluster: Cluster) -> None:
    node = FakeNode("decode", "rogue", Script(), fingerprint="sha256:other")
    resp = await cluster.add_node(node)
    assert not resp.accepted
    assert "sha256:other" in resp.reason and FINGERPRINT in resp.reason
    # Control: same node with the right fingerprint is accepted.
    good = FakeNode("decode", "good", Script())
    assert (await cluster.add_node(good)).accepted
    ids = [n.node_id for n in cluster.cp.registry.nodes()]
    assert "rogue" not in ids and "good" in ids
    [refused] = cluster.events.of("node_refused")
    assert refused["node"] == "rogue"


async def test_node_with_other_eos_ids_or_tokenizer_is_refused(cluster: Cluster) -> None:
    """Same weights, another generation_config.json or tokenizer.json (a model folder changed
    under running pods): the weights' fingerprint matched, and the node ended requests with EOS
    ids the control plane called forged (DATA_LOSS, the integrity alert) or ran past its EOS.
    Controls: the same text fingerprint is accepted, and a node of a release that sends none."""
    node = FakeNode("decode", "drifted", Script(), text_fingerprint="sha256:other-eos")
    resp = await cluster.add_node(node)
    assert not resp.accepted and "EOS ids or tokenizer differ" in resp.reason
    assert (await cluster.add_node(FakeNode("decode", "same", Script()))).accepted
    older = FakeNode("decode", "older", Script(), text_fingerprint="")
    assert (await cluster.add_node(older)).accepted
    ids = [n.node_id for n in cluster.cp.registry.nodes()]
    assert "drifted" not in ids and {"same", "older"} <= set(ids)
    [refused] = cluster.events.of("node_refused")
    assert refused["node"] == "drifted"


async def test_node_with_other_layout_is_refused(cluster: Cluster) -> None:
    node = FakeNode("prefill", "odd", Script(), layout=make_layout(head_dim=64))
    resp = await cluster.add_node(node)
    assert not resp.accepted
    assert "head_dim=64" in resp.reason and "head_dim=32" in resp.reason
    assert (await cluster.add_node(FakeNode("prefill", "even", Script()))).accepted


@pytest.mark.parametrize(
    ("protocol", "release", "said"),
    [(PROTOCOL_VERSION + 1, "9.9.9", "protocol 2 (kvfence 9.9.9)"), (0, "", "no protocol version")],
)
async def test_a_node_of_another_protocol_is_refused_naming_both_releases(
    cluster: Cluster, protocol: int, release: str, said: str
) -> None:
    """Halfway through an upgrade a node of another release would misread the control plane's
    calls: it is refused at registration, and the reason says what to do."""
    node = FakeNode("decode", "other-release", Script())
    node.protocol_version, node.kvfence_version = protocol, release
    resp = await cluster.add_node(node)
    assert not resp.accepted
    assert said in resp.reason and f"protocol {PROTOCOL_VERSION} (kvfence {__version__})" in (
        resp.reason
    )
    assert "same kvfence release" in resp.reason
    assert "other-release" not in {n.node_id for n in cluster.cp.registry.nodes()}
    [refused] = cluster.events.of("node_refused")
    assert refused["node"] == "other-release"
    # Control: the same node speaking this protocol joins, and `kvfence nodes` shows its release.
    same = FakeNode("decode", "same-release", Script())
    assert (await cluster.add_node(same)).accepted
    admin, auth = cluster.admin()
    listed = await admin.ListNodes(control_pb2.ListNodesRequest(), metadata=auth)
    versions = {n.node_id: n.kvfence_version for n in listed.nodes}
    assert versions["same-release"] == __version__ and "other-release" not in versions


async def test_heartbeat_from_unknown_node_asks_it_to_register(cluster: Cluster) -> None:
    auth = [("authorization", f"Bearer {cluster.cp.node_token}")]
    async with grpc.aio.insecure_channel(cluster.target) as channel:
        stub = control_pb2_grpc.NodeRegistryStub(channel)
        resp = await stub.Heartbeat(control_pb2.HeartbeatRequest(node_id="ghost"), metadata=auth)
        assert not resp.known
        resp = await stub.Heartbeat(control_pb2.HeartbeatRequest(node_id="decode-0"), metadata=auth)
        assert resp.known


async def test_registration_needs_the_node_token(cluster: Cluster) -> None:
    """A process without the cluster's node token cannot join (and be sent tenants' KV)."""
    node = FakeNode("decode", "intruder", Script())
    await node.start()
    try:
        for token in ("", "kvfn_wrong"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await node.register(cluster.ports.public, token)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ids = {n.node_id for n in cluster.cp.registry.nodes()}
        assert "intruder" not in ids
        # control: the same node with the token is accepted
        assert (await node.register(cluster.ports.public, cluster.cp.node_token)).accepted
        assert "intruder" in {n.node_id for n in cluster.cp.registry.nodes()}
    finally:
        await node.stop()


async def test_lost_node_leaves_the_registry_and_the_limit(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, prefill_pool=128)
    try:
        assert c.cp.registry.admissible_limit() == 128
        small = c.prefill[0]
        big = FakeNode("prefill", "prefill-big", c.script, pool_tokens=4096)
        assert (await c.add_node(big)).accepted
        await small.stop_heartbeats()
        while c.cp.registry.get(small.node_id) is not None:
            await asyncio.sleep(0.05)
        assert c.cp.registry.admissible_limit() == 256
        assert [e["node"] for e in c.events.of("node_lost")] == [small.node_id]
    finally:
        await c.close()


async def test_check_config_flags_a_pool_smaller_than_the_window(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, prefill_pool=128)
    try:
        admin, auth = c.admin()
        check = await admin.CheckConfig(control_pb2.CheckConfigRequest(), metadata=auth)
        assert not check.ok and check.clamped
        assert (check.context_window, check.admissible_limit) == (256, 128)
        by_node = {p.node_id: p for p in check.pools}
        assert by_node["decode-0"].ok and not by_node["prefill-0"].ok
        assert "smaller than the context window of 256" in by_node["prefill-0"].message
    finally:
        await c.close()


@pytest.mark.parametrize("new_process", [True, False])
async def test_a_node_restarted_in_place_is_a_lost_node(
    cluster: Cluster, new_process: bool
) -> None:
    """A container restarted in its pod registers again with the same node id and address
    before the reaper notices the old process is gone: what the old one held is gone with it,
    so the requests holding it fail NODE_LOST. The control: the same process repeating its
    registration (a lost reply) keeps its requests."""
    cluster.script.prefill_hold = asyncio.Event()
    call = asyncio.create_task(cluster.client().generate(prompt_ids=[10], max_new_tokens=4))
    await cluster.prefill[0].servicer.entered.wait()  # decode-0 holds a reservation for it
    node = cluster.decode[0]
    if new_process:
        node.instance_id = "fake-process-2"
    assert (await node.register(cluster.ports.public, cluster.cp.node_token)).accepted
    lost = [e["node"] for e in cluster.events.of("node_lost")]
    cluster.script.prefill_hold.set()
    if new_process:
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.reason == "NODE_LOST" and lost == ["decode-0"]
    else:
        result = await asyncio.wait_for(call, 5)
        assert result.usage.completion_tokens == 4 and lost == []
    assert "decode-0" in {n.node_id for n in cluster.cp.registry.nodes()}


def _gauge(cluster: Cluster, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with ``labels`` in the control plane's metrics, None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(cluster.cp.metrics.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def test_the_nodes_gauge_follows_joins_and_losses(tmp_path: Path) -> None:
    """`kvfence_nodes{role}` (the KvfenceNoNodes alert) counts the registered nodes of a role:
    up when one joins, down to 0 when the last one is lost."""
    c = await make_cluster(tmp_path)
    try:
        assert _gauge(c, "kvfence_nodes", role="prefill") == 1
        assert _gauge(c, "kvfence_nodes", role="decode") == 1
        extra = FakeNode("prefill", "prefill-1", c.script)
        assert (await c.add_node(extra)).accepted
        assert _gauge(c, "kvfence_nodes", role="prefill") == 2
        for node in (c.prefill[0], extra):
            await node.stop_heartbeats()
        while c.cp.registry.nodes("prefill"):
            await asyncio.sleep(0.05)
        assert _gauge(c, "kvfence_nodes", role="prefill") == 0
        assert _gauge(c, "kvfence_nodes", role="decode") == 1  # control: the other role stays
    finally:
        await c.close()


async def test_the_model_online_gauge_follows_the_kill_switch(cluster: Cluster) -> None:
    """`kvfence_model_online` (the KvfenceModelOffline alert) is 0 while an operator has the
    model offline and 1 again once it is back online."""
    name = cluster.cp.model.name
    assert _gauge(cluster, "kvfence_model_online", model=name) == 1
    admin, auth = cluster.admin()
    await admin.SetModelAccess(
        control_pb2.SetModelAccessRequest(online=False, reason="incident"), metadata=auth
    )
    assert _gauge(cluster, "kvfence_model_online", model=name) == 0
    await admin.SetModelAccess(control_pb2.SetModelAccessRequest(online=True), metadata=auth)
    assert _gauge(cluster, "kvfence_model_online", model=name) == 1


async def test_the_admissible_limit_gauge_drops_when_a_smaller_node_joins(tmp_path: Path) -> None:
    """A node with a smaller pool lowers every request's limit (KvfenceAdmissibleLimitDropped
    watches `kvfence_admissible_limit`); it used to show only in an info line. Control: the
    gauge starts at the context window and comes back when that node leaves."""
    c = await make_cluster(tmp_path)  # context window 256, pools 4096
    try:
        name = c.cp.model.name
        await eventually(lambda: _gauge(c, "kvfence_admissible_limit", model=name) == 256)
        small = FakeNode("decode", "decode-small", c.script, pool_tokens=128)
        assert (await c.add_node(small)).accepted
        assert _gauge(c, "kvfence_admissible_limit", model=name) == 128
        await small.stop_heartbeats()
        while c.cp.registry.get("decode-small") is not None:
            await asyncio.sleep(0.05)
        assert _gauge(c, "kvfence_admissible_limit", model=name) == 256
    finally:
        await c.close()


async def test_the_admissible_limit_is_exported_only_while_both_roles_have_a_node(
    tmp_path: Path,
) -> None:
    """With no node of a role, the gauge said the context window (or one role's pools alone):
    a limit no request got. A control plane that started before its nodes re-registered, or
    lost them all, showed a rise, and KvfenceAdmissibleLimitDropped (the last hour's maximum
    against now) read their return to the real limit as a drop, for an hour. Nor is it
    exported before node_timeout_s (2 s here) has passed since start, by when every live node
    has registered again. Control: once both roles have a node the gauge is the smallest pool,
    and it goes when the last decode node does."""
    # context window 256
    c = await make_cluster(tmp_path, decode_nodes=0, prefill_nodes=0, node_timeout_s=2.0)

    def limit() -> float | None:
        return _gauge(c, "kvfence_admissible_limit", model=c.cp.model.name)

    try:
        first = FakeNode("decode", "decode-big", c.script, pool_tokens=4096)
        assert (await c.add_node(first)).accepted
        early = FakeNode("prefill", "prefill-early", c.script, pool_tokens=4096)
        assert (await c.add_node(early)).accepted
        # both roles registered at once, but within node_timeout_s of start: not yet
        assert limit() is None
        await eventually(lambda: limit() == 256, timeout=5)
        for node in (first, early):
            await node.stop_heartbeats()
        await eventually(lambda: not c.cp.registry.nodes(), timeout=5)
        assert limit() is None
        decode = FakeNode("decode", "decode-small", c.script, pool_tokens=128)
        assert (await c.add_node(decode)).accepted
        assert limit() is None  # no prefill yet
        prefill = FakeNode("prefill", "prefill-0", c.script, pool_tokens=4096)
        assert (await c.add_node(prefill)).accepted
        assert limit() == 128
        await decode.stop_heartbeats()
        while c.cp.registry.get("decode-small") is not None:
            await asyncio.sleep(0.05)
        assert limit() is None
    finally:
        await c.close()


async def test_the_nodes_gauge_leaves_out_draining_nodes(tmp_path: Path) -> None:
    """`kvfence_nodes{role}` counts the nodes a new request can go to. A draining node takes no
    new request, yet it used to count: with every decode node draining the gauge said 2 and
    KvfenceNoNodes (`== 0`) stayed quiet while every new request waited or failed. Control: 2
    before the drain, the other role untouched, and a replacement counts at once."""
    c = await make_cluster(tmp_path, decode_nodes=2)
    try:
        assert _gauge(c, "kvfence_nodes", role="decode") == 2
        c.decode[0].draining = True
        await eventually(lambda: c.cp.registry.get("decode-0").draining)
        assert _gauge(c, "kvfence_nodes", role="decode") == 1
        c.decode[1].draining = True
        await eventually(lambda: c.cp.registry.get("decode-1").draining)
        assert len(c.cp.registry.nodes("decode")) == 2  # still registered, finishing their work
        assert _gauge(c, "kvfence_nodes", role="decode") == 0
        assert _gauge(c, "kvfence_nodes", role="prefill") == 1
        assert (await c.add_node(FakeNode("decode", "decode-new", c.script))).accepted
        assert _gauge(c, "kvfence_nodes", role="decode") == 1
    finally:
        await c.close()


async def test_vacant_for_counts_from_when_a_roles_last_node_left(cluster: Cluster) -> None:
    """``Registry.vacant_for(role)`` (how long requests may still wait for a node) is None while
    a node of the role takes requests (registered, not draining), and counts from the moment the
    last such one started draining or left, not from an earlier loss of another, nor from the
    later departure of the draining one; a registration ends it."""
    registry = cluster.cp.registry
    assert registry.vacant_for("decode") is None and registry.vacant_for("prefill") is None
    other = FakeNode("decode", "decode-1", cluster.script)
    assert (await cluster.add_node(other)).accepted
    registry.lose(registry.get("decode-0"), "test")
    assert registry.vacant_for("decode") is None  # decode-1 is left, taking requests
    await asyncio.sleep(0.3)
    registry.mark_draining(registry.get("decode-1"))
    vacant = registry.vacant_for("decode")
    assert vacant is not None and 0 <= vacant < 0.2
    await asyncio.sleep(0.2)
    await other.stop_heartbeats()
    registry.lose(registry.get("decode-1"), "test")
    assert registry.vacant_for("decode") >= 0.2
    assert registry.vacant_for("prefill") is None  # control: the other role
    assert (await cluster.add_node(FakeNode("decode", "decode-2", cluster.script))).accepted
    assert registry.vacant_for("decode") is None


async def test_a_new_control_plane_counts_its_roles_vacant_from_its_start(tmp_path: Path) -> None:
    """Nodes register again within a heartbeat of a control plane's restart: until one of a role
    has, that role is vacant since the control plane started."""
    c = await make_cluster(tmp_path, decode_nodes=0)
    try:
        vacant = c.cp.registry.vacant_for("decode")
        assert vacant is not None and 0 <= vacant < 2
        assert c.cp.registry.vacant_for("prefill") is None
    finally:
        await c.close()


@pytest.mark.parametrize("old_draining", [True, False], ids=["old-draining", "old-serving"])
async def test_a_superseded_node_releases_and_does_not_register_again(
    cluster: Cluster, tmp_path: Path, old_draining: bool
) -> None:
    """Two processes with one node id (the old one still draining when its replacement came,
    or, misconfigured, still serving): the old one's heartbeat is answered superseded, and its
    agent releases what it holds and stops heartbeating, instead of registering again, which
    would make the control plane drop the replacement (then the replacement would, and so on).
    Control: the replacement's heartbeats are answered as usual."""
    from kvfence.node import NodeAgent

    token = tmp_path / "node_token"
    token.write_text(cluster.cp.node_token)
    forgotten: list[str] = []
    draining = {"process-old": False, "process-new": False}

    def agent(instance: str, port: int) -> NodeAgent:
        request = control_pb2.RegisterRequest(
            node_id="decode-9", role="decode", grpc_address=f"127.0.0.1:{port}",
            ucx_address="127.0.0.1:1", model_fingerprint=FINGERPRINT, layout=make_layout(),
            pool_tokens=1024, total_pages=64, instance_id=instance,
        )  # fmt: skip

        def load() -> control_pb2.HeartbeatRequest:
            return control_pb2.HeartbeatRequest(
                node_id="decode-9", free_pages=64, draining=draining[instance], instance_id=instance
            )

        return NodeAgent(
            cluster.target, request, load, 0.05, token_path=token,
            on_forgotten=lambda: forgotten.append(instance),
        )  # fmt: skip

    old, new = agent("process-old", 1), agent("process-new", 2)
    try:
        await old.register()
        await new.register()
        draining["process-old"] = old_draining  # (a draining node does not register)
        await old.heartbeat()
        assert cluster.cp.registry.get("decode-9").instance_id == "process-new"
        assert forgotten == ["process-old"] and old.superseded  # its heartbeat loop ends
        draining["process-new"] = True
        await new.heartbeat()  # control: the replacement's own (draining) heartbeat counts
        assert not new.superseded and cluster.cp.registry.get("decode-9").draining
        await old.heartbeat()  # superseded again: nothing more to release
        assert forgotten == ["process-old"]
        # The replacement goes (drained, dropped): the old process, unless it drains itself,
        # takes the node id back at its next heartbeat instead of staying out for good.
        registry = cluster.cp.registry
        registry._lose(registry.get("decode-9"), "drained")  # type: ignore[arg-type]
        old.start_heartbeats()  # its heartbeat loop, every 50 ms, goes on while superseded

        def rejoined() -> bool:
            node = registry.get("decode-9")
            return node is not None and node.instance_id == "process-old"

        if old_draining:
            await asyncio.sleep(0.3)
            assert registry.get("decode-9") is None
        else:
            await eventually(rejoined)
            assert not old.superseded
    finally:
        await old.stop()
        await new.stop()


async def test_a_draining_node_does_not_register_again(cluster: Cluster, tmp_path: Path) -> None:
    """A node forgotten while the control plane restarts retries its registration; if it starts
    draining meanwhile it must stop, or it can register after its replacement and supersede it.
    Control: the same agent, not draining, registers."""
    from kvfence.node import NodeAgent, RegistrationRefused

    token = tmp_path / "node_token"
    token.write_text(cluster.cp.node_token)
    draining = [True]
    request = control_pb2.RegisterRequest(
        node_id="decode-8", role="decode", grpc_address="127.0.0.1:3", ucx_address="127.0.0.1:1",
        model_fingerprint=FINGERPRINT, layout=make_layout(), pool_tokens=1024, total_pages=64,
        instance_id="process-1",
    )  # fmt: skip
    agent = NodeAgent(
        cluster.target, request,
        lambda: control_pb2.HeartbeatRequest(node_id="decode-8", draining=draining[0]),
        0.05, token_path=token,
    )  # fmt: skip
    try:
        with pytest.raises(RegistrationRefused, match="draining"):
            await agent.register()
        assert cluster.cp.registry.get("decode-8") is None
        draining[0] = False
        await agent.register()
        assert cluster.cp.registry.get("decode-8") is not None
    finally:
        await agent.stop()
