"""A late KV hello for a reservation released because its request ended is no failed transfer.

On a client cancel during the KV transfer the control plane cancels the Prefill call and releases
the decode reservation. When decode's Release lands first, prefill's hello (it carries the
reservation's authenticator) reaches decode for a released reservation while the Prefill call is
still live. Decode refused it RESERVATION_RELEASED and emitted ``transfer_failed`` ("the system
is slow"), and prefill logged "transfer failed" and emitted ``transfer_failed`` too, for an
ordinary cancel. Now decode remembers why it released (``KvReceiver.forget``): for a request that
ended it logs the late hello at info, emits nothing, and says ``request_ended`` in its refusal;
prefill logs "transfer ended: request ended on decode" at info and emits nothing. The call still
fails UNAVAILABLE RESERVATION_RELEASED.

Controls, on the same path: a late hello of a reservation the reaper released (nobody ended the
request: the system was slow) is reported on both sides as before; so is one, for a reservation
released by a Release, that lacks the authenticator (anyone can send an id): decode's event
says ``authenticated: false``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from asyncwait import eventually
from test_decode_restart_and_prefill_release import kept_events, outcome
from test_drain_timeout_prefill import HelloHold, held_hello  # noqa: F401  (a fixture)
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)
from test_prefill_transfer_failed_on_cancel import all_free, bound_logs, release

from kvfence.errors import RESERVATION_RELEASED

PROMPT = [(7 * i + 5) % 300 + 3 for i in range(37)]  # 3 pages of 16
TENANT = "t-late"
DECODE_LINE = "late KV hello refused: its request had ended"
PREFILL_LINE = "transfer ended: request ended on decode"


def logged(logs: list[dict[str, Any]], event: str) -> list[tuple[Any, ...]]:
    return [
        (e.get("reservation_id"), e.get("request_id"), e.get("tenant_id"), e["log_level"])
        for e in logs
        if e["event"] == event
    ]


def failed(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [p for kind, p in events if kind == "transfer_failed"]


@pytest.mark.parametrize("released_by", ["release", "reaper", "forged-hello"])
async def test_a_late_hello_after_its_request_ended_reports_nothing_on_either_node(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    held_hello: HelloHold,  # noqa: F811
    released_by: str,
) -> None:
    """Decode holds prefill's hello; the reservation is released meanwhile, the Prefill call
    still live, then decode reads the hello. ``release``: the control plane's Release of a client
    cancel, landed before the call's cancel: no event on either node, an info line on each, the
    call UNAVAILABLE RESERVATION_RELEASED. Controls: ``reaper`` (decode's reservation timed out:
    the system was slow) and ``forged-hello`` (a Release, but a hello without the reservation's
    authenticator) are reported on both nodes as before, with no info line."""
    async with node_pair(tiny_dir, tmp_path) as (dec, pre, dstub, pstub):
        if released_by == "forged-hello":
            real_raw = pre.servicer._send_raw

            async def send_raw(*args: Any, auth: Any, stall: float) -> float:
                return await real_raw(*args, auth="0" * 64, stall=stall)

            monkeypatch.setattr(pre.servicer, "_send_raw", send_raw)
        dec_events, pre_events = kept_events(dec), kept_events(pre)
        with bound_logs() as logs:
            res, call = await reserve_and_prefill(dstub, pstub, "r", PROMPT, tenant=TENANT)
            rid = res.reservation_id
            answer = asyncio.ensure_future(outcome(call))
            assert await eventually(held_hello.entered.is_set, 30)
            if released_by == "reaper":
                dec.servicer.reservations[rid].created -= 3600.0  # timed out, as if slow
                assert await eventually(lambda: rid not in dec.servicer.reservations, 10)
            else:
                assert (await dstub.Release(release("r"))).held
            held_hello.gate.set()  # decode reads the hello now: its reservation is released
            assert await asyncio.wait_for(answer, 30) == (
                grpc.StatusCode.UNAVAILABLE,
                RESERVATION_RELEASED,
            )
            await pstub.Release(release("r"))
            assert await all_free(pre)
            assert await all_free(dec)
            if released_by != "release":
                # Decode's event is emitted before its refusal is sent: already here.
                assert await eventually(lambda: len(failed(pre_events)) == 1, 10)
        warned = [e for e in logs if e["event"] == "transfer failed"]
        if released_by == "release":
            assert failed(dec_events) == [] and failed(pre_events) == [] and warned == []
            assert logged(logs, DECODE_LINE) == [(rid, "r", TENANT, "info")]
            assert logged(logs, PREFILL_LINE) == [(None, "r", TENANT, "info")]
        else:
            [on_decode] = failed(dec_events)
            assert (on_decode["reason"], on_decode["reservation_id"], on_decode["stage"]) == (
                RESERVATION_RELEASED,
                rid,
                "ucx_hello",
            )
            assert on_decode.get("authenticated", True) is (released_by == "reaper")
            assert [(p["reason"], p["request_id"], p["tenant_id"]) for p in failed(pre_events)] == [
                (RESERVATION_RELEASED, "r", TENANT)
            ]
            assert [(w["reason"], w["request_id"], w["tenant_id"]) for w in warned] == [
                (RESERVATION_RELEASED, "r", TENANT)
            ]
            assert logged(logs, DECODE_LINE) == [] and logged(logs, PREFILL_LINE) == []
