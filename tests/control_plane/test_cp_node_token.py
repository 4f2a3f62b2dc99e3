"""The control plane calls nodes with the cluster node token, on every call.

The fake nodes require the token they registered with, as real nodes do (``cp_fakes``), and keep
the token each call carried: a success and a failure that makes the control plane release both
nodes cover every method it calls (Reserve, Prefill, Decode, Release on each role).
"""

from __future__ import annotations

import grpc
import pytest
from cp_harness import Cluster, eventually

from control_plane.routing import NodeClients
from kvfence.errors import IntegrityError
from kvfence.proto.kvfence.v1 import decode_pb2_grpc, prefill_pb2


async def test_every_node_call_carries_the_node_token(cluster: Cluster) -> None:
    reply = await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    assert len(reply.token_ids) == 4
    cluster.script.decode_error = IntegrityError("checksum of page 3", reason="CHECKSUM_MISMATCH")
    with pytest.raises(IntegrityError):
        await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=4)
    [decode], [prefill] = cluster.decode, cluster.prefill
    await eventually(lambda: "Release" in decode.methods())
    token = cluster.cp.node_token
    dec_calls, pre_calls = decode.servicer.presented, prefill.servicer.presented
    assert {m for m, _ in dec_calls} == {"Reserve", "Decode", "Release"}
    assert {m for m, _ in pre_calls} == {"Prefill", "Release"}
    assert all(t == token for _, t in [*dec_calls, *pre_calls]), [*dec_calls, *pre_calls]


async def test_the_fake_nodes_refuse_a_call_without_the_token(cluster: Cluster) -> None:
    """The check above means something: a call without the token is refused and not served."""
    [decode] = cluster.decode
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode_pb2_grpc.DecodeStub(ch).Release(prefill_pb2.ReleaseRequest(request_id="x"))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert decode.methods() == [] and decode.servicer.presented == [("Release", None)]


async def test_node_clients_add_the_token_to_metadata_the_caller_passes(cluster: Cluster) -> None:
    [decode] = cluster.decode
    [node] = cluster.cp.registry.nodes("decode")
    clients = NodeClients("kvfn_other")
    try:
        request = prefill_pb2.ReleaseRequest(request_id="x")
        stub = clients.decode(node)
        assert clients.decode(node) is stub  # built once per channel
        with pytest.raises(grpc.aio.AioRpcError) as err:  # not this cluster's token
            await stub.Release(request, metadata=[("x-trace", "1")], timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        real = NodeClients(cluster.cp.node_token)
        try:
            assert (await real.decode(node).Release(request, metadata=[("x-trace", "1")])).held
        finally:
            await real.close()
    finally:
        await clients.close()
    assert decode.servicer.presented == [
        ("Release", "kvfn_other"),
        ("Release", cluster.cp.node_token),
    ]
    with pytest.raises(ValueError):
        NodeClients("")
