"""Prefill and decode nodes in process, driven the way the control plane drives them."""

from __future__ import annotations

import grpc
import pytest

from kvfence.config import Role, parse_config
from kvfence.errors import error_info
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def make_cfg(tiny_dir, tmp_path, **over):
    data = {
        "model": {"path": str(tiny_dir)},
        "kv": {
            "page_size": 16,
            "prefill_pool": {"num_pages": 16},
            "decode_pool": {"num_pages": 24},
        },
        "control_plane": {"state_dir": str(tmp_path)},
        "transfer": {"max_batch_bytes": 40000, "batch_timeout_s": 5},
    }
    for k, v in over.items():
        data.setdefault(k, {}).update(v)
    return parse_config(data, environ={})


@pytest.fixture
async def nodes(tiny_dir, tmp_path):
    cfg = make_cfg(tiny_dir, tmp_path)
    dec = await start_node(cfg, Role.DECODE, register=False)
    pre = await start_node(cfg, Role.PREFILL, register=False)
    dch = grpc.aio.insecure_channel(dec.address)
    pch = grpc.aio.insecure_channel(pre.address)
    yield dec, pre, decode_pb2_grpc.DecodeStub(dch), prefill_pb2_grpc.PrefillStub(pch)
    await dch.close()
    await pch.close()
    await pre.stop(grace=1)
    await dec.stop(grace=1)


async def run_request(dstub, pstub, request_id, tenant, prompt, max_new, sampling=None):
    sampling = sampling or common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    res = await dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id=request_id,
            tenant_id=tenant,
            prompt_tokens=len(prompt),
            max_new_tokens=max_new,
        )
    )
    pre = await pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id,
            tenant_id=tenant,
            prompt_token_ids=prompt,
            sampling=sampling,
            reservation=res,
        )
    )
    tokens, finish, verified = [], "", False
    async for msg in dstub.Decode(
        decode_pb2.DecodeRequest(
            request_id=request_id,
            tenant_id=tenant,
            reservation_id=res.reservation_id,
            manifest=pre.manifest,
            sampling=sampling,
        )
    ):
        verified = verified or msg.verified
        tokens.extend(msg.token_ids)
        finish = msg.finish_reason or finish
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id=request_id))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id=request_id))
    return res, pre, tokens, finish, verified


@pytest.mark.parametrize("prompt_len", [15, 16, 17, 33])
async def test_disaggregated_equals_colocated(nodes, tiny_dir, prompt_len):
    dec, pre, dstub, pstub = nodes
    prompt = [(7 * i + 3) % 300 + 3 for i in range(prompt_len)]
    _, p, tokens, finish, verified = await run_request(dstub, pstub, "r1", "t-a", prompt, 12)
    ref = ColocatedEngine.from_path(tiny_dir).generate(
        [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    )[0]
    assert verified
    assert tokens == ref.token_ids
    assert finish == ref.finish_reason == "length"
    assert p.manifest.token_count == prompt_len
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages
    dec.rt.pool.check_integrity()


async def test_tampered_manifest_is_data_loss_and_pages_come_back(nodes):
    dec, pre, dstub, pstub = nodes
    prompt = list(range(3, 40))
    res = await dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id="r2", tenant_id="t-b", prompt_tokens=37, max_new_tokens=4
        )
    )
    sampling = common_pb2.SamplingParams(max_new_tokens=4)
    p = await pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="r2",
            tenant_id="t-b",
            prompt_token_ids=prompt,
            sampling=sampling,
            reservation=res,
        )
    )
    bad = common_pb2.KvManifest()
    bad.CopyFrom(p.manifest)
    bad.token_count -= 1  # the incident: fewer tokens than reserved
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in dstub.Decode(
            decode_pb2.DecodeRequest(
                request_id="r2",
                tenant_id="t-b",
                reservation_id=res.reservation_id,
                manifest=bad,
                sampling=sampling,
            )
        ):
            pass
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert error_info(err.value).reason == "MAC"  # tampering breaks the MAC first
    assert any(e["kind"] == "integrity_violation" for e in dec.bus.recent)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r2"))
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages
    # control: the same path with an untouched manifest succeeds on a fresh reservation
    _, _, tokens, finish, verified = await run_request(dstub, pstub, "r3", "t-b", prompt, 4)
    assert verified and len(tokens) >= 1 and finish in ("length", "eos")
