"""Every prefill and decode RPC needs the cluster node token; health and reflection need none.

The audit's attacks, each without the token and with a wrong one, against real nodes in process:
reserving decode pages (the pool filled so that every tenant got RESOURCE_EXHAUSTED), a whole
Reserve -> Prefill -> Decode generation past the control plane's admission, and releasing another
tenant's request by its id. Each is refused UNAUTHENTICATED with nothing changed on the node, and
paired with the same call carrying the token, which works.
"""

from __future__ import annotations

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_prefill_decode import (  # noqa: F401  (fixtures)
    _decode_request,
    nodes,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.auth import bearer_metadata
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

WRONG = "kvfn_" + "x" * 43  # a token of the right shape that is not the cluster's


def bad_metadata(kind: str, node) -> tuple[tuple[str, str], ...] | None:
    """What a caller without the token sends: nothing, a wrong token, or the right token
    without the ``Bearer`` scheme."""
    if kind == "no-scheme":
        return (("authorization", node.node_token),)
    return None if kind == "none" else bearer_metadata(WRONG)


@pytest.fixture
async def raw(nodes):  # noqa: F811
    """Stubs to the same nodes that send no token of their own."""
    dec, pre, dstub, pstub = nodes
    dch = grpc.aio.insecure_channel(dec.address)
    pch = grpc.aio.insecure_channel(pre.address)
    yield dec, pre, dstub, pstub, decode_pb2_grpc.DecodeStub(dch), prefill_pb2_grpc.PrefillStub(pch)
    await dch.close()
    await pch.close()


def refused(node) -> float:
    value = node.metrics.registry.get_sample_value(
        "kvfence_requests_total", {"service": node.rt.role.value, "status": "UNAUTHENTICATED"}
    )
    return value or 0.0


async def expect_unauthenticated(call) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "node token" in err.value.details() and "\n" not in err.value.details()


def reserve_request(request_id: str, prompt_tokens: int = 20) -> decode_pb2.ReserveRequest:
    return decode_pb2.ReserveRequest(
        request_id=request_id, tenant_id="t-x", prompt_tokens=prompt_tokens, max_new_tokens=4
    )


@pytest.mark.parametrize("kind", ["none", "wrong", "no-scheme"])
async def test_reserve_without_the_node_token_reserves_nothing(raw, kind):
    dec, _, dstub, _, d_raw, _ = raw
    free, count = dec.rt.pool.num_free, dec.servicer.rpc_count
    with structlog.testing.capture_logs() as logs:
        # the audit filled the pool this way; a handful of calls shows the same
        for i in range(5):
            await expect_unauthenticated(
                d_raw.Reserve(reserve_request(f"evil-{i}", 300), metadata=bad_metadata(kind, dec))
            )
        dec.servicer.authenticate.flush_log()  # the rest of the burst (rate-limited lines)
    assert dec.rt.pool.num_free == free and not dec.servicer.reservations
    assert dec.servicer.rpc_count == count  # refused calls are not served calls
    assert refused(dec) == 5
    lines = [e for e in logs if e["event"] == "node rpc refused"]
    assert sum(e["refused"] for e in lines) == 5 and all(e["method"] == "Reserve" for e in lines)
    assert all(dec.node_token not in str(e) and WRONG not in str(e) for e in logs)
    # control: the same call with the token reserves its pages
    res = await dstub.Reserve(reserve_request("good", 300))
    assert dec.rt.pool.num_free == free - len(res.pages) and dec.servicer.rpc_count == count + 1
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="good"))
    assert dec.rt.pool.num_free == free


@pytest.mark.parametrize("kind", ["none", "wrong"])
async def test_release_without_the_node_token_releases_nothing(raw, kind):
    """Another tenant's request, known by its id, cannot be cancelled from outside: neither its
    decode reservation nor its prefill pages go."""
    dec, pre, dstub, pstub, d_raw, p_raw = raw
    res, call = await reserve_and_prefill(dstub, pstub, "victim", list(range(3, 23)))
    await call  # prefill holds its pages until the control plane releases them
    held_dec, held_pre = dec.rt.pool.num_free, pre.rt.pool.num_free
    assert held_dec < dec.rt.pool.num_pages and held_pre < pre.rt.pool.num_pages
    release = prefill_pb2.ReleaseRequest(request_id="victim", reason="evil")
    await expect_unauthenticated(d_raw.Release(release, metadata=bad_metadata(kind, dec)))
    await expect_unauthenticated(p_raw.Release(release, metadata=bad_metadata(kind, pre)))
    assert dec.servicer.by_request.get("victim") == res.reservation_id
    assert "victim" in pre.servicer.held
    assert (dec.rt.pool.num_free, pre.rt.pool.num_free) == (held_dec, held_pre)
    assert refused(dec) == refused(pre) == 1
    # control: the same Release with the token frees both
    assert (await dstub.Release(release)).held and (await pstub.Release(release)).held
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages


@pytest.mark.parametrize("kind", ["none", "wrong"])
async def test_prefill_without_the_node_token_runs_nothing(raw, kind):
    dec, pre, dstub, pstub, _, p_raw = raw
    res = await dstub.Reserve(reserve_request("p1"))
    prefill = prefill_pb2.PrefillRequest(
        request_id="p1",
        tenant_id="t-x",
        prompt_token_ids=list(range(3, 23)),
        sampling=common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True),
        reservation=res,
    )
    count = pre.servicer.rpc_count
    await expect_unauthenticated(p_raw.Prefill(prefill, metadata=bad_metadata(kind, pre)))
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages and not pre.servicer.held
    assert pre.servicer.rpc_count == count and refused(pre) == 1
    # nothing reached decode either: the reservation still waits for its transfer
    assert dec.servicer.reservations[res.reservation_id].transfer.received == []
    # control: the same Prefill with the token runs and sends the KV
    reply = await pstub.Prefill(prefill)
    assert reply.manifest.token_count == 20 and pre.servicer.rpc_count == count + 1
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="p1"))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="p1"))


@pytest.mark.parametrize("kind", ["none", "wrong"])
async def test_decode_without_the_node_token_streams_nothing(raw, kind):
    """The last step of the audit's generation past admission: a prefilled reservation, decoded
    without the token, yields no token and stays for the control plane's own Decode."""
    dec, _, dstub, pstub, d_raw, _ = raw
    sampling = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "d1", list(range(3, 23)), sampling)
    reply = await call
    request = _decode_request(res, reply, "d1", sampling)
    stream = d_raw.Decode(request, metadata=bad_metadata(kind, dec))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stream:
            raise AssertionError("a message came back without the node token")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    held = dec.servicer.reservations[res.reservation_id]
    assert held.state.value == "reserved" and refused(dec) == 1
    # control: the same Decode with the token streams every token
    tokens, finish = [], ""
    async for msg in dstub.Decode(request):
        tokens.extend(msg.token_ids)
        finish = msg.finish_reason or finish
    assert len(tokens) == 4 and finish == "length"
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="d1"))
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages


async def test_stats_needs_the_node_token(raw):
    dec, pre, dstub, pstub, d_raw, p_raw = raw
    await expect_unauthenticated(d_raw.Stats(prefill_pb2.StatsRequest()))
    await expect_unauthenticated(p_raw.Stats(prefill_pb2.StatsRequest()))
    assert (await dstub.Stats(prefill_pb2.StatsRequest())).total_pages == dec.rt.pool.num_pages
    assert (await pstub.Stats(prefill_pb2.StatsRequest())).total_pages == pre.rt.pool.num_pages


async def test_health_and_reflection_need_no_token(raw):
    """Kubernetes probes call grpc.health.v1 without credentials."""
    dec, pre, *_ = raw
    for node, service in ((dec, "kvfence.v1.Decode"), (pre, "kvfence.v1.Prefill")):
        async with grpc.aio.insecure_channel(node.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = {s.name async for r in stream for s in r.list_services_response.service}
            assert service in names
        assert refused(node) == 0
