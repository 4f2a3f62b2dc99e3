"""A prefill node's timed-out drain at the turn of the event loop where a call's step has just
ended but the call has not resumed yet (``PrefillServicer.end_in_flight``). Each test runs the
node's real drain there, in one turn of the loop, then the rest of its stop (``drain_times_out``):
no sleep decides which comes first.

1. The UCX send has ended having sent every page. The drain used to end the call CANCELLED
   ``NODE_DRAINING``, its cancel winning over the send's result, so the request failed while
   decode held the whole transfer. Now the call is left to answer its manifest, which gets out
   through the server's stop, and decode verifies it. Control: a call still in its send is ended
   CANCELLED ``NODE_DRAINING`` (decode may hold part of it).
2. The forward pass has failed prefill's own integrity check (PAGE_GENERATION). The drain's cancel
   used to win there too: the violation was never reported (no metric, event or log line), and
   the call answered UNAVAILABLE ``NODE_DRAINING``, which has the control plane prefill the request
   again on another node. Now it is reported, once, and the call answers DATA_LOSS. Control: a
   pass that gave its first token is ended UNAVAILABLE ``NODE_DRAINING`` (nothing left the node).
   A pass that fails only after the drain ended its call (still running then) is reported when it
   ends; its call had answered ``NODE_DRAINING`` already.
3. The UCX send has just failed an integrity check: decode refused the transfer (a wrong
   authenticator), or prefill's own check of decode's answers failed (PROTOCOL). Both were
   reported already (``transfer_failed``), yet the drain ended the call CANCELLED
   ``NODE_DRAINING``: the tenant read "shutting down". Now the call answers DATA_LOSS with the
   check's reason, as without the drain. Control: the same refused send, still in progress when
   the drain times out, is ended CANCELLED ``NODE_DRAINING``.

Every page of the prefill node is free once it stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from test_decode_restart_and_prefill_release import outcome
from test_drain_timeout_prefill import (  # noqa: F401  (held_pass: a fixture)
    PROMPT,
    Pair,
    PassHold,
    assert_prefill_node_clean,
    held_pass,
    node_pair,
)
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    _decode_request,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.errors import NODE_DRAINING, error_info
from kvfence.kv.pool import PageRef
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2
from kvfence.transfer import TransferError
from prefill_svc.service import PrefillServicer

# reserve_and_prefill's default
SAMPLING = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)


def drain_times_out(pair: Pair) -> None:
    """The prefill node's stop with its drain timing out in this turn of the event loop
    (``Pair.stop_after_drain``), then the server's stop with its grace, the servicer's close."""
    assert pair.stop_after_drain(pair.pre)


def send_state(send: asyncio.Task[int] | None) -> str:
    if send is None:
        return "not begun"
    if not send.done():
        return "sending"
    if send.cancelled():
        return "cancelled"
    return "failed" if send.exception() is not None else "sent"


def watch_ends(servicer: PrefillServicer) -> list[tuple[list[tuple[str, bool]], int]]:
    """For each ``end_in_flight``: where each call in flight was (its send, whether its handler
    had finished), and how many calls it ended."""
    ends: list[tuple[list[tuple[str, bool]], int]] = []
    real = servicer.end_in_flight

    def end_in_flight(err: Any) -> int:
        where = [(send_state(c.send), c.task is None or c.task.done()) for c in servicer.calls]
        ended = real(err)
        ends.append((where, ended))
        return ended

    servicer.end_in_flight = end_in_flight  # type: ignore[method-assign]
    return ends


async def decode_outcome(pair: Pair, res: Any, reply: Any) -> tuple[bool, list[int], str]:
    """Decode with prefill's manifest: (verified, tokens, finish reason)."""
    verified, tokens, finish = False, [], ""
    async for msg in pair.dstub.Decode(_decode_request(res, reply, "r", SAMPLING)):
        verified = verified or msg.verified
        tokens.extend(msg.token_ids)
        finish = msg.finish_reason or finish
    return verified, tokens, finish


@pytest.mark.parametrize("drain_at", ["send-over", "mid-send"])
async def test_a_prefill_whose_send_is_over_answers_its_manifest_through_a_timed_out_drain(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    drain_at: str,
) -> None:
    """The drain times out as the send's task has its result (queued before the task's end wakes
    the call): the call is not ended, answers OK with its manifest through the server's stop, and
    decode verifies that manifest and decodes. Control (mid-send): the drain times out as the send
    has just begun: the call is ended CANCELLED NODE_DRAINING."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        servicer = pair.pre.servicer
        ends = watch_ends(servicer)
        real = servicer._send
        loop = asyncio.get_running_loop()

        async def send(req: Any, outbound: Any, fault: Any) -> int:
            if drain_at == "mid-send":
                loop.call_soon(drain_times_out, pair)
                return await real(req, outbound, fault)
            sent = await real(req, outbound, fault)
            # Queued now, before this returns: the task's end (its result set) wakes the call
            # on a later turn than the drain's.
            loop.call_soon(drain_times_out, pair)
            return sent

        servicer._send = send  # type: ignore[method-assign]
        res, call = await reserve_and_prefill(pair.dstub, pair.pstub, "r", PROMPT)
        if drain_at == "send-over":
            reply = await asyncio.wait_for(call, 30)
            assert ends == [([("sent", False)], 0)]
            assert (reply.pages_sent, reply.manifest.token_count) == (2, len(PROMPT))
            verified, tokens, finish = await asyncio.wait_for(decode_outcome(pair, res, reply), 30)
            assert verified and len(tokens) == 4 and finish == "length"
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, 30)
            assert ends == [([("sending", False)], 1)]
            assert err.value.code() == grpc.StatusCode.CANCELLED, err.value
            info = error_info(err.value)
            assert info is not None and info.reason == NODE_DRAINING, err.value
            assert "drain timed out" in (err.value.details() or "")
        assert pair.stopping is not None
        await asyncio.wait_for(pair.stopping, 30)
        await pair.dstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
    assert_prefill_node_clean(pair.pre)
    pool = pair.dec.rt.pool
    assert pool.num_free == pool.num_pages


def integrity_failures(pair: Pair) -> float:
    labels = {"service": "prefill", "check": "PAGE_GENERATION"}
    value = pair.pre.metrics.registry.get_sample_value("kvfence_integrity_failures_total", labels)
    return value or 0.0


def stale_pages(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward pass finds the request's pages at another generation (as if they had changed
    owner before it read them): PAGE_GENERATION, prefill's own check."""
    engine = pair.pre.servicer.batcher.engine
    real = engine.prefill_many

    def prefill_many(prompts: Any, pages: Any) -> Any:
        return real(prompts, [[PageRef(r.page_id, r.generation + 1) for r in p] for p in pages])

    monkeypatch.setattr(engine, "prefill_many", prefill_many)


def record_events(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    bus = pair.pre.servicer.bus
    real = bus.emit

    def emit(kind: str, **payload: Any) -> int:
        events.append((kind, payload))
        return real(kind, **payload)

    monkeypatch.setattr(bus, "emit", emit)
    return events


@pytest.mark.parametrize("pass_ends", ["integrity-failure", "first-token"])
async def test_a_prefill_whose_pass_just_failed_its_integrity_check_answers_it_at_a_drain(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    held_pass: PassHold,  # noqa: F811
    pass_ends: str,
) -> None:
    """The drain times out as the call's forward pass has just ended (its future done on the
    engine thread, the call not woken yet): a pass that failed PAGE_GENERATION is reported once
    (metric, event, error line) and the call answers DATA_LOSS PAGE_GENERATION, not a retry
    elsewhere. Control: a pass that gave the first token is ended UNAVAILABLE NODE_DRAINING (its
    send had not begun), and nothing is reported."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        servicer = pair.pre.servicer
        if pass_ends == "integrity-failure":
            stale_pages(pair, monkeypatch)
        events = record_events(pair, monkeypatch)
        ends = watch_ends(servicer)
        _, call = await reserve_and_prefill(pair.dstub, pair.pstub, "r", PROMPT)
        try:
            await asyncio.wait_for(asyncio.to_thread(held_pass.entered.wait, 30), 35)
            job = servicer.held["r"].job
            assert job is not None
            with structlog.testing.capture_logs() as logs:
                # Nothing runs on the event loop from here to the drain: the pass ends on the
                # engine thread (what it wakes on the loop is queued), the call still waits.
                held_pass.gate.set()
                concurrent.futures.wait([job], timeout=30)
                assert job.done()
                drain_times_out(pair)
                answer = await asyncio.wait_for(outcome(call), 30)
                assert pair.stopping is not None
                await asyncio.wait_for(pair.stopping, 30)
        finally:
            held_pass.gate.set()
        assert ends == [([("not begun", False)], 1)]
        reported = [e for e in logs if e["event"] == "integrity check failed"]
        violations = [p for kind, p in events if kind == "integrity_violation"]
        if pass_ends == "integrity-failure":
            assert answer == (grpc.StatusCode.DATA_LOSS, "PAGE_GENERATION")
            assert integrity_failures(pair) == 1
            [line] = reported
            assert (line["stage"], line["check"], line["request_id"]) == (
                "prefill",
                "PAGE_GENERATION",
                "r",
            )
            [event] = violations
            assert (event["stage"], event["request_id"]) == ("prefill", "r")
        else:
            assert answer == (grpc.StatusCode.UNAVAILABLE, NODE_DRAINING)
            assert integrity_failures(pair) == 0 and reported == [] and violations == []
        await pair.dstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
    assert_prefill_node_clean(pair.pre)


async def test_a_pass_that_fails_after_the_drain_ended_its_call_is_still_reported(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    held_pass: PassHold,  # noqa: F811
) -> None:
    """The drain times out while the call's pass runs (held): the call answers UNAVAILABLE
    NODE_DRAINING at once, as before (nothing of it left the node; the pass cannot be stopped).
    The pass then fails PAGE_GENERATION, with no call waiting for it: it is reported all the
    same, once, by the time the node's stop (which waits for the pass) is over."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        stale_pages(pair, monkeypatch)
        events = record_events(pair, monkeypatch)
        ends = watch_ends(pair.pre.servicer)
        _, call = await reserve_and_prefill(pair.dstub, pair.pstub, "r", PROMPT)
        try:
            await asyncio.wait_for(asyncio.to_thread(held_pass.entered.wait, 30), 35)
            with structlog.testing.capture_logs() as logs:
                drain_times_out(pair)
                answer = await asyncio.wait_for(outcome(call), 30)
                assert integrity_failures(pair) == 0  # the pass has not ended
                held_pass.gate.set()
                assert pair.stopping is not None
                await asyncio.wait_for(pair.stopping, 30)
        finally:
            held_pass.gate.set()
        assert ends == [([("not begun", False)], 1)]
        assert answer == (grpc.StatusCode.UNAVAILABLE, NODE_DRAINING)
        assert integrity_failures(pair) == 1
        [line] = [e for e in logs if e["event"] == "integrity check failed"]
        assert (line["stage"], line["request_id"]) == ("prefill", "r")
        assert [p["request_id"] for kind, p in events if kind == "integrity_violation"] == ["r"]
        await pair.dstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
    assert_prefill_node_clean(pair.pre)


def sample(pair: Pair, name: str, **labels: str) -> float:
    value = pair.pre.metrics.registry.get_sample_value(name, {"service": "prefill", **labels})
    return value or 0.0


@pytest.mark.parametrize("failure", ["decode-refused", "own-check", "in-progress"])
async def test_a_prefill_whose_send_just_failed_an_integrity_check_answers_it_at_a_drain(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
) -> None:
    """The drain times out as the call's send has just failed an integrity check (the send's
    task ended, the call not woken yet): decode refused its wrong authenticator
    (BAD_AUTHENTICATOR, decode's check), or prefill's check of decode's answer failed (PROTOCOL,
    counted here, once). The call answers DATA_LOSS with that reason, not CANCELLED
    NODE_DRAINING; the failure was reported once (``transfer_failed``). Control (in-progress): the
    same refused send, the drain timing out as it has just begun, is ended CANCELLED
    NODE_DRAINING."""
    async with node_pair(tiny_dir, tmp_path) as pair:
        servicer = pair.pre.servicer
        events = record_events(pair, monkeypatch)
        ends = watch_ends(servicer)
        real_raw, real_send = servicer._send_raw, servicer._send
        loop = asyncio.get_running_loop()

        async def send_raw(
            req: Any, outbound: Any, page_bytes: int, *, auth: Any, stall: float
        ) -> float:
            if failure == "own-check":
                raise TransferError("decode answered outside the protocol", "PROTOCOL")
            # What the fault hook's bad_auth sends: decode refuses the hello.
            return await real_raw(req, outbound, page_bytes, auth="0" * 64, stall=stall)

        async def send(req: Any, outbound: Any, fault: Any) -> int:
            if failure == "in-progress":
                loop.call_soon(drain_times_out, pair)
                return await real_send(req, outbound, fault)
            try:
                return await real_send(req, outbound, fault)
            finally:
                # Queued before this task's end (its exception set) wakes the call.
                loop.call_soon(drain_times_out, pair)

        monkeypatch.setattr(servicer, "_send_raw", send_raw)
        monkeypatch.setattr(servicer, "_send", send)
        _, call = await reserve_and_prefill(pair.dstub, pair.pstub, "r", PROMPT)
        answer = await asyncio.wait_for(outcome(call), 30)
        assert pair.stopping is not None
        await asyncio.wait_for(pair.stopping, 30)
        failed = [p["reason"] for kind, p in events if kind == "transfer_failed"]
        counted = sample(pair, "kvfence_integrity_failures_total", check="PROTOCOL")
        if failure == "in-progress":
            assert ends == [([("sending", False)], 1)]
            assert answer == (grpc.StatusCode.CANCELLED, NODE_DRAINING)
            assert sample(pair, "kvfence_requests_total", status="CANCELLED") == 1
        else:
            reason = "PROTOCOL" if failure == "own-check" else "BAD_AUTHENTICATOR"
            assert ends == [([("failed", False)], 1)]
            assert answer == (grpc.StatusCode.DATA_LOSS, reason)
            assert failed == [reason]
            # This node counts its own check only, once: decode counted its refusal.
            assert counted == (1 if failure == "own-check" else 0)
            assert sample(pair, "kvfence_requests_total", status="DATA_LOSS") == 1
        assert sample(pair, "kvfence_requests_total", status="OK") == 0
        await pair.dstub.Release(prefill_pb2.ReleaseRequest(request_id="r"))
    assert_prefill_node_clean(pair.pre)
    pool = pair.dec.rt.pool
    assert pool.num_free == pool.num_pages
