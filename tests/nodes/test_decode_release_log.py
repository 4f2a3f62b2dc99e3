"""DESIGN.md, "Events and logs": every log line about a request carries its request_id and
tenant_id. The decode node's "reservation released" line carried neither when the release came
from outside a Decode call: the control plane's Release, the reaper, the control plane
forgetting the node. Control: the line at a Decode stream's own end (bound by the call) had both.
"""

from __future__ import annotations

import pytest
import structlog
from asyncwait import eventually
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    _all_free,
    _decode_request,
    _outcome,
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.proto.kvfence.v1 import common_pb2, decode_pb2, prefill_pb2

PROMPT = list(range(3, 23))
SAMPLING = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)


def released_lines(logs: list[dict]) -> list[dict]:
    return [line for line in logs if line.get("event") == "reservation released"]


@pytest.mark.parametrize("via", ["stream_end", "release_rpc", "release_all", "reaper"])
async def test_the_reservation_released_line_names_the_request_and_tenant(
    tiny_dir,  # noqa: F811
    tmp_path,
    via,
):
    # The reaper's case: a reservation no Decode call comes for, reaped after 0.5 s.
    transfer = {"reservation_timeout_s": 0.5 if via == "reaper" else 60.0}
    async with node_pair(tiny_dir, tmp_path, transfer=transfer) as (dec, _, dstub, pstub):
        with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs:
            if via == "reaper":
                await dstub.Reserve(
                    decode_pb2.ReserveRequest(
                        request_id="req-X", tenant_id="ten-Y", prompt_tokens=20, max_new_tokens=4
                    )
                )
                assert await eventually(lambda: not dec.servicer.reservations, timeout=10)
            else:
                res, call = await reserve_and_prefill(
                    dstub, pstub, "req-X", PROMPT, SAMPLING, tenant="ten-Y"
                )
                reply = await call
                if via == "stream_end":  # control: bound by the Decode call
                    request = _decode_request(res, reply, "req-X", SAMPLING, tenant="ten-Y")
                    _, err = await _outcome(dstub.Decode(request))
                    assert err is None
                elif via == "release_rpc":
                    released = await dstub.Release(prefill_pb2.ReleaseRequest(request_id="req-X"))
                    assert released.held
                else:
                    dec.servicer.release_all()
                await pstub.Release(prefill_pb2.ReleaseRequest(request_id="req-X"))
        [line] = released_lines(logs)
        assert (line["request_id"], line["tenant_id"]) == ("req-X", "ten-Y"), line
        # Bound for the release only (release_all ran in this task): nothing after it is
        # logged as that request.
        assert "request_id" not in structlog.contextvars.get_contextvars()
        await _all_free(dec.rt.pool)
