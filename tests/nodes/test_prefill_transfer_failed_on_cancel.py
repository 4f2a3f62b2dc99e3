"""A KV send that fails because its request ended is not a failed transfer.

When a client cancels during the KV transfer, the control plane cancels the Prefill call and then
releases the request on decode and prefill. Decode, released, refuses a hello it reads after that
(RESERVATION_RELEASED) or aborts the transfer it was receiving. Prefill reported such a failure as
any other: a ``transfer_failed`` event and a "transfer failed" warning, for an ordinary cancel.

1. Driven in the control plane's order on a real pair (the cancel, then the releases), the call's
   cancel stops the send before decode's refusal can come back: prefill reports nothing. Control:
   the same refusal while the call is live (decode released the reservation, nobody cancelled
   the call: a genuine late hello, the system was slow) is reported, event and warning.
2. The call's cancel, or its request's Release on this node, can land in the turn in which the
   send reads decode's refusal, before the send is cancelled: the refusal used to be reported
   then. Now it is logged at info, "transfer ended: request cancelled", naming the request, and
   no event is emitted. Controls: the same refusal with the call live is reported; a refusal for
   an integrity check (a wrong authenticator) is reported even with the call cancelled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from asyncwait import eventually
from structlog.testing import capture_logs
from test_decode_restart_and_prefill_release import kept_events, outcome
from test_drain_timeout_prefill import HelloHold, held_hello  # noqa: F401  (a fixture)
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.errors import RESERVATION_RELEASED
from kvfence.proto.kvfence.v1 import decode_pb2, prefill_pb2
from kvfence.transfer import TransferError

PROMPT = [(5 * i + 3) % 300 + 3 for i in range(37)]  # 3 pages of 16
TENANT = "t-cancel"


def bound_logs() -> Any:
    """capture_logs with the request's bound fields (request_id, tenant_id) merged in."""
    return capture_logs(processors=[structlog.contextvars.merge_contextvars])


def lines(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("component") == "prefill" and e["event"] == event]


def release(request_id: str) -> prefill_pb2.ReleaseRequest:
    return prefill_pb2.ReleaseRequest(request_id=request_id, reason="CANCELLED: client cancelled")


async def all_free(node: Any) -> bool:
    pool = node.rt.pool
    return await eventually(lambda: pool.num_free == pool.num_pages, 10)


@pytest.mark.parametrize("order", ["cancel-then-release", "release-call-live"])
async def test_a_client_cancel_mid_transfer_reports_no_failed_transfer_on_prefill(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    held_hello: HelloHold,  # noqa: F811
    order: str,
) -> None:
    """Decode holds the hello (the send waits for its answer). ``cancel-then-release``: what the
    control plane does on a client cancel, the Prefill RPC cancelled, then Release on both nodes;
    decode then reads the hello of a released reservation. Prefill emits no event and logs no
    "transfer failed". Control (``release-call-live``): decode's reservation released while the
    call is live (its reaper's doing: nobody cancelled the call); the refusal is reported."""
    async with node_pair(tiny_dir, tmp_path) as (_dec, pre, dstub, pstub):
        events = kept_events(pre)
        with bound_logs() as logs:
            _, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT, tenant=TENANT)
            task = asyncio.ensure_future(outcome(call))
            assert await eventually(held_hello.entered.is_set, 30)
            if order == "cancel-then-release":
                call.cancel()
                assert await eventually(lambda: not pre.servicer.calls, 30)
                await asyncio.gather(dstub.Release(release("r")), pstub.Release(release("r")))
            else:  # decode's reaper (a Release now means the request ended: no event)
                dec = _dec.servicer
                assert dec._release(dec.by_request["r"], "reservation timeout", request_ended=False)
            held_hello.gate.set()  # decode reads the hello now: its reservation is released
            await asyncio.wait({task}, timeout=30)
            assert task.done()
            if order == "release-call-live":
                assert task.result() == (grpc.StatusCode.UNAVAILABLE, RESERVATION_RELEASED)
                await pstub.Release(release("r"))
            assert await all_free(pre)
        failed = [p for kind, p in events if kind == "transfer_failed"]
        warned = lines(logs, "transfer failed")
        if order == "cancel-then-release":
            assert task.cancelled()  # the client's own cancel
            assert failed == [] and warned == []
        else:
            assert [(p["reason"], p["request_id"], p["tenant_id"]) for p in failed] == [
                (RESERVATION_RELEASED, "r", TENANT)
            ]
            assert [(w["reason"], w["request_id"], w["tenant_id"]) for w in warned] == [
                (RESERVATION_RELEASED, "r", TENANT)
            ]


@pytest.mark.parametrize(
    ("end", "refusal"),
    [
        ("cancelled", RESERVATION_RELEASED),
        ("released", RESERVATION_RELEASED),
        (None, RESERVATION_RELEASED),  # control: the call live, a genuine late hello
        ("cancelled", "BAD_AUTHENTICATOR"),  # control: an integrity refusal is always reported
    ],
)
async def test_a_refusal_read_as_the_call_ends_is_logged_not_reported(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    end: str | None,
    refusal: str,
) -> None:
    """Decode refuses the hello (its reservation released before the transfer; or, for the
    integrity control, a wrong authenticator). ``end``: what lands in the turn the send reads
    the refusal, before the send handles it: the call's cancel (grpc's, the client gone) or
    this node's Release of the request (the control plane's). Either way the request is over:
    an info line naming it, no ``transfer_failed`` event, no "transfer failed" warning."""
    async with node_pair(tiny_dir, tmp_path) as (_dec, pre, dstub, pstub):
        servicer = pre.servicer
        events = kept_events(pre)
        real_raw = servicer._send_raw

        async def send_raw(
            req: Any, outbound: Any, page_bytes: int, *, auth: Any, stall: float
        ) -> float:
            if refusal != RESERVATION_RELEASED:
                auth = "0" * 64  # what the fault hook's bad_auth sends
            try:
                return await real_raw(req, outbound, page_bytes, auth=auth, stall=stall)
            except TransferError as err:
                assert err.reason == refusal and err.refused
                if end == "cancelled":
                    # The client's cancel, and what grpc does on reading it: cancel the handler.
                    client[0].cancel()
                    task = servicer.held[req.request_id].call.task
                    assert task is not None
                    task.cancel()
                elif end == "released":
                    assert servicer._release(req.request_id)
                raise

        client: list[Any] = []  # the Prefill call, as its client holds it
        monkeypatch.setattr(servicer, "_send_raw", send_raw)
        res = await dstub.Reserve(
            decode_pb2.ReserveRequest(
                request_id="r", tenant_id=TENANT, prompt_tokens=len(PROMPT), max_new_tokens=4
            )
        )
        if refusal == RESERVATION_RELEASED:  # by decode's reaper, as in the test above
            assert _dec.servicer._release(
                res.reservation_id, "reservation timeout", request_ended=False
            )
        with bound_logs() as logs:
            _, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT, res=res, tenant=TENANT)
            client.append(call)
            task = asyncio.ensure_future(outcome(call))
            await asyncio.wait({task}, timeout=30)
            assert task.done()
            assert await eventually(lambda: not servicer.calls, 10)
        await pstub.Release(release("r"))
        await dstub.Release(release("r"))
        assert await all_free(pre)
    failed = [
        (p["reason"], p["request_id"], p["tenant_id"]) for k, p in events if k == "transfer_failed"
    ]
    warned = [
        (w["reason"], w["request_id"], w["tenant_id"]) for w in lines(logs, "transfer failed")
    ]
    ended = lines(logs, "transfer ended: request cancelled")
    if end is None or refusal != RESERVATION_RELEASED:
        assert failed == warned == [(refusal, "r", TENANT)]
        assert ended == []
    else:
        assert failed == [] and warned == []
        assert [
            (e["ended"], e["reason"], e["request_id"], e["tenant_id"], e["log_level"])
            for e in ended
        ] == [(end, RESERVATION_RELEASED, "r", TENANT, "info")]
    if end == "cancelled":
        assert task.cancelled()  # the client's own cancel
    else:
        assert task.result() == (grpc.StatusCode.UNAVAILABLE, RESERVATION_RELEASED)
