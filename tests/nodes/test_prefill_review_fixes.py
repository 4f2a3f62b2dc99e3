"""Prefill node: what a review found, each with its control.

- The reaper's line about pages never released names the request's tenant as well as the request
  (every line about a request carries both; no call's request context covers the reaper).
- A Prefill call its client cancels is counted in ``requests_total`` (CANCELLED), as decode counts
  its cancelled streams; control: a call Released mid-pass is counted too.
- A reservation whose decode UCX address is not HOST:PORT is refused INVALID_ARGUMENT before the
  forward pass, with no page taken (it was INTERNAL, a ValueError, after a whole pass); control: a
  well-formed address nobody listens on fails UNAVAILABLE at the send.
- The batcher takes exactly the pages a prompt fills: with a page more, it zeroed the tail of
  that one, leaving the tail of the page actually written as its previous owner left it;
  control: the exact pages, tail zeroed.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
from structlog.testing import capture_logs
from test_prefill_batcher import GREEDY, loaded, make_engine  # noqa: F401 (fixture)
from test_prefill_decode import (  # noqa: F401 (fixture)
    _all_free,
    held_pass,
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.proto.kvfence.v1 import decode_pb2, prefill_pb2
from prefill_svc.batcher import PrefillBatcher

PROMPT = list(range(3, 23))


def requests_total(node) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in node.metrics.render().decode().splitlines():
        if line.startswith("kvfence_requests_total{"):
            status = re.search(r'status="([^"]*)"', line).group(1)
            out[status] = out.get(status, 0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_the_reapers_line_names_the_request_and_its_tenant(tiny_dir, tmp_path) -> None:  # noqa: F811
    transfer = {"reservation_timeout_s": 0.4}
    async with node_pair(tiny_dir, tmp_path, transfer=transfer) as (_, pre, dstub, pstub):
        with capture_logs() as logs:
            _, call = await reserve_and_prefill(dstub, pstub, "req-X", PROMPT, tenant="ten-Y")
            await call  # answered, never Released: the reaper frees its pages
            await _all_free(pre.rt.pool, 5.0)
    reaped = [e for e in logs if "never released" in e["event"]]
    assert reaped
    assert all((e["request_id"], e.get("tenant_id")) == ("req-X", "ten-Y") for e in reaped)


@pytest.mark.parametrize("end", ["cancel", "release"])
async def test_a_prefill_ended_mid_pass_is_counted(tiny_dir, tmp_path, end: str) -> None:  # noqa: F811
    async with node_pair(tiny_dir, tmp_path) as (_, pre, dstub, pstub):
        before = requests_total(pre)
        with held_pass(pre.rt.engine) as (entered, go):
            _, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT)
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            if end == "cancel":
                call.cancel()
            else:
                await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
            go.set()
            with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
                await call
        await _all_free(pre.rt.pool)
        assert not pre.servicer.calls
        after = requests_total(pre)
    assert sum(after.values()) == sum(before.values()) + 1, after
    if end == "cancel":
        assert after.get("CANCELLED", 0) == before.get("CANCELLED", 0) + 1


@pytest.mark.parametrize(
    ("address", "code"),
    [
        ("127.0.0.1", grpc.StatusCode.INVALID_ARGUMENT),
        ("127.0.0.1:", grpc.StatusCode.INVALID_ARGUMENT),
        (":5000", grpc.StatusCode.INVALID_ARGUMENT),
        ("127.0.0.1:70000", grpc.StatusCode.INVALID_ARGUMENT),
        ("127.0.0.1:1", grpc.StatusCode.UNAVAILABLE),  # control: well-formed, nobody there
    ],
)
async def test_a_decode_address_not_host_port_is_refused_before_the_pass(
    tiny_dir,  # noqa: F811
    tmp_path,
    address: str,
    code: grpc.StatusCode,
) -> None:
    transfer = {"batch_timeout_s": 1}
    async with node_pair(tiny_dir, tmp_path, transfer=transfer) as (_, pre, dstub, pstub):
        request = decode_pb2.ReserveRequest(
            request_id="r", tenant_id="t", prompt_tokens=len(PROMPT), max_new_tokens=4
        )
        res = await dstub.Reserve(request)
        res.decode_ucx_address = address
        passes = pre.rt.engine.prefill_many
        ran: list[int] = []

        def counted(*args, **kw):
            ran.append(1)
            return passes(*args, **kw)

        pre.rt.engine.prefill_many = counted
        _, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT, res=res, tenant="t")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        await _all_free(pre.rt.pool)
    assert err.value.code() == code, err.value.details()
    assert len(ran) == (1 if code == grpc.StatusCode.UNAVAILABLE else 0)


@pytest.mark.parametrize("extra", [1, 0], ids=["a page more", "exact"])
def test_the_batcher_takes_exactly_the_pages_a_prompt_fills(loaded, extra: int) -> None:  # noqa: F811
    engine = make_engine(loaded)
    engine.pool.kv.fill_(7.0)  # a previous owner's bytes
    refs = engine.pool.allocate(1 + extra, "a")
    batcher = PrefillBatcher(engine, engine.pool)
    try:
        if extra:
            with pytest.raises(ValueError, match="fills 1 pages, not 2"):
                batcher.submit(list(range(3, 8)), refs, GREEDY)
            return
        batcher.submit(list(range(3, 8)), refs, GREEDY).result(30)
    finally:
        batcher.close()
    # The 5 tokens' page: past them, zeros, not the previous owner's 7.0.
    assert (engine.pool.kv[refs[0].page_id][:, :, 5:] == 0).all()
