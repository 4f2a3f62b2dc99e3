"""A decode Release that lands while decode is receiving the transfer is no failed transfer.

On a client cancel the control plane cancels the Prefill call and releases the request on decode;
decode's Release can land first, while prefill's call is still live. Decode, receiving the
transfer (its hello verified, a batch header awaited or a batch's pages in flight), aborted the
endpoint without an answer: prefill read a lost connection and reported it, a "transfer failed"
warning and a ``transfer_failed`` event (reason TRANSFER_FAILED), for an ordinary cancel. Now a
release for its request's end (``forget(..., request_ended=True)``: Release, a Decode cancelled
while it waits) does not abort a transfer still receiving: the receives already posted settle
(their pages stay QUARANTINED until then), no new one is posted, and decode answers the refusal
``{ok: false, error: RESERVATION_RELEASED, request_ended: true}`` at the transfer's next step;
prefill logs it at info, reports nothing, and its call fails UNAVAILABLE RESERVATION_RELEASED.

Control, on the same path: a release for trouble (the reaper's timeout) still aborts the
transfer, and prefill still reports it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from asyncwait import eventually
from structlog.testing import capture_logs

# The node pair and its helpers live with the node tests.
sys.path.insert(0, str(Path(__file__).parent / "nodes"))
from test_decode_restart_and_prefill_release import kept_events, outcome
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)
from test_transfer_release_wire import SendGate

from kvfence.errors import NODE_DRAINING, RESERVATION_RELEASED, Unavailable
from kvfence.kv.pool import PageState
from kvfence.proto.kvfence.v1 import prefill_pb2
from kvfence.transfer import InboundState

PROMPT = [(11 * i + 7) % 300 + 3 for i in range(37)]  # 3 pages of 16
TENANT = "t-mid"
DECODE_LINE = "KV transfer refused: its request had ended"
PREFILL_LINE = "transfer ended: request ended on decode"


def bound_logs() -> Any:
    return capture_logs(processors=[structlog.contextvars.merge_contextvars])


def failed(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [p for kind, p in events if kind == "transfer_failed"]


def release(request_id: str) -> prefill_pb2.ReleaseRequest:
    return prefill_pb2.ReleaseRequest(request_id=request_id, reason="CANCELLED: client cancelled")


@pytest.mark.parametrize(
    ("released_by", "stage"),
    [
        ("release", "header"),
        ("release", "pages"),
        ("reaper", "header"),  # controls: a release for trouble is reported, as before
        ("reaper", "pages"),
        ("drain", "pages"),  # the node going away with work held cuts the transfer
        ("shutdown", "pages"),
    ],
)
async def test_a_release_while_decode_receives_is_refused_not_aborted(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
    released_by: str,
) -> None:
    """``release``: the control plane's Release reaches decode mid-transfer, the Prefill call
    still live. Decode lets the posted receives settle (pages QUARANTINED meanwhile, never free),
    posts no other, and refuses the transfer saying its request ended: no event and no warning
    on either node, an info line on each, the call UNAVAILABLE RESERVATION_RELEASED. Controls:
    a release for trouble (``reaper``: the reservation timed out) aborts the transfer as before,
    and prefill reports it; so do the releases of a stopping node, which ``forget`` as ended
    but must not wait for a transfer (``drain``: a timed-out drain's, ``shutdown``: the stop's)."""
    gate = SendGate(monkeypatch, stage)
    async with node_pair(tiny_dir, tmp_path, transfer={"max_batch_bytes": 1 << 20}) as (
        dec,
        pre,
        dstub,
        pstub,
    ):
        dpool = dec.rt.pool
        dec_events, pre_events = kept_events(dec), kept_events(pre)
        with bound_logs() as logs:
            res, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT, tenant=TENANT)
            rid = res.reservation_id
            t = dec.receiver.transfers[rid]
            answer = asyncio.ensure_future(outcome(call))
            assert await asyncio.wait_for(gate.held.wait(), 30)
            posted = 3 if stage == "pages" else 0  # the receives of the one batch, posted
            assert await eventually(
                lambda: t.state == InboundState.RECEIVING and dpool.outstanding_ops(rid) == posted,
                10,
            )
            prompt_pages = [r.page_id for r in res.pages[:3]]
            servicer = dec.servicer
            if released_by == "release":
                assert (await dstub.Release(release("r"))).held
            elif released_by == "reaper":
                assert servicer._release(rid, "reservation timeout", request_ended=False)
            elif released_by == "drain":  # what end_in_flight does once the drain timed out
                servicer.drain_ended = Unavailable("drain timed out", reason=NODE_DRAINING)
                assert servicer._release(rid, "drain timed out", request_ended=True)
            else:  # what close() does, the node stopping
                servicer.closing = True
                assert servicer._release(rid, "shutdown", request_ended=True)
            if stage == "pages" and released_by == "release":
                # Not aborted: the receives are still posted, their pages held, not free.
                await asyncio.sleep(0.05)
                assert dpool.outstanding_ops(rid) == 3
                assert all(dpool.state_of(p) == PageState.QUARANTINED for p in prompt_pages)
            gate.gate.set()
            code, reason = await asyncio.wait_for(answer, 30)
            if released_by == "release":
                # The pages behind a header refused after the release are drained, not left in
                # UCX; a batch whose receives were posted was received, nothing to drain.
                drained = 3 if stage == "header" else 0
                assert await eventually(lambda: dec.receiver.strays_drained == drained, 10)
                assert dec.receiver.strays_posted == drained
            await pstub.Release(release("r"))
            assert await eventually(lambda: dpool.num_free == dpool.num_pages, 10)
            assert await eventually(lambda: pre.rt.pool.num_free == pre.rt.pool.num_pages, 10)
            assert all(dpool.generation(r.page_id) > r.generation for r in res.pages)
            dpool.check_integrity()
            if released_by != "release":
                assert await eventually(lambda: len(failed(pre_events)) == 1, 10)
        warned = [e for e in logs if e["event"] == "transfer failed"]
        decode_lines = [
            (e.get("reservation_id"), e.get("request_id"), e.get("tenant_id"), e["log_level"])
            for e in logs
            if e["event"] == DECODE_LINE
        ]
        prefill_lines = [
            (e.get("request_id"), e.get("tenant_id"), e["log_level"])
            for e in logs
            if e["event"] == PREFILL_LINE
        ]
        assert failed(dec_events) == []  # decode reports neither (a release is no failure there)
        if released_by == "release":
            assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, RESERVATION_RELEASED)
            assert failed(pre_events) == [] and warned == []
            assert decode_lines == [(rid, "r", TENANT, "info")]
            assert prefill_lines == [("r", TENANT, "info")]
        else:
            assert code == grpc.StatusCode.UNAVAILABLE
            assert [(p["request_id"], p["tenant_id"]) for p in failed(pre_events)] == [
                ("r", TENANT)
            ]
            assert [(w["request_id"], w["tenant_id"]) for w in warned] == [("r", TENANT)]
            assert decode_lines == [] and prefill_lines == []
