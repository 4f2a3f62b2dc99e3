"""Admission under a decode node that does not answer Reserve, tenant limits before the tokenizer
(and again with the exact count after it), interrupted requests and the tenant's concurrency, and
interrupts at admission not counted as refusals.

Each negative test has its control: the same path serving, or counting, when it should.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cp_fakes import FakeDecode
from cp_harness import Cluster, eventually, make_cluster

from control_plane.lifecycle import RequestState, Run
from control_plane.model_info import ByteTokenizer
from control_plane.tenants import TenantLimits
from kvfence.client import GenerationResult
from kvfence.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvfence.proto.kvfence.v1 import control_pb2

LONG_TEXT = "x" * 5000  # over UNLOCKED_ENCODE_CHARS: tokenized in a worker thread
BIG: dict[str, Any] = dict(context_window=1 << 16, decode_pool=1 << 17, prefill_pool=1 << 17)


# -- a decode node that heartbeats but does not answer Reserve ---------------------------------


@pytest.fixture
def silent_reserve(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, asyncio.Event]]:
    """node_id -> an event: that node's Reserve calls wait for it (recorded as "Reserve-held")
    while ``c.script.reserve_error`` is unset; its heartbeats go on."""
    held: dict[str, asyncio.Event] = {}
    orig = FakeDecode.Reserve

    async def reserve(self: FakeDecode, request: Any, context: Any) -> Any:
        gate = held.get(self.node_id)
        if gate is not None and self.script.reserve_error is None:
            self.calls.append(("Reserve-held", request))
            await gate.wait()
        return await orig(self, request, context)

    monkeypatch.setattr(FakeDecode, "Reserve", reserve)
    yield held
    for gate in held.values():
        gate.set()


def _held_reserves(c: Cluster, i: int) -> list[Any]:
    return [r for m, r in c.decode[i].calls if m == "Reserve-held"]


def _decoded_on(c: Cluster, i: int, request_id: str) -> bool:
    return any(m == "Decode" and r.request_id == request_id for m, r in c.decode[i].calls)


def _released_on(c: Cluster, i: int, request_id: str) -> bool:
    return any(m == "Release" and r.request_id == request_id for m, r in c.decode[i].calls)


async def test_an_unanswered_reserve_holds_the_head_only_node_timeout_s(
    tmp_path: Path, silent_reserve: dict[str, asyncio.Event]
) -> None:
    """Only the head of the admission queue reserves. Its Reserve to a decode node that does not
    answer is given up after node_timeout_s (0.5 s here), not at the head's deadline: the head
    reserves on the idle decode-1, and the other tenant's request after it is served within its
    3 s deadline. Each unanswered call counts towards decode-0's cool-down, and decode-0 gets
    the request's Release (the call may have reserved there late)."""
    silent_reserve["decode-0"] = asyncio.Event()
    c = await make_cluster(tmp_path, decode_nodes=2)
    try:
        _, key_b, _ = c.cp.tenants.create_tenant("bravo", TenantLimits())
        c.script.reserve_error = ResourceExhausted("full")  # A queues: it becomes the head
        a = asyncio.create_task(c.client(timeout=30).generate(prompt_ids=[5], max_new_tokens=2))
        await eventually(lambda: c.cp.deps.queue.waiting == 1)
        c.script.reserve_error = None  # room again: the head tries decode-0 first (by node id)
        await eventually(lambda: len(_held_reserves(c, 0)) == 1, timeout=5)
        b = await c.client(api_key=key_b, timeout=3).generate(prompt_ids=[6], max_new_tokens=2)
        ra = await asyncio.wait_for(a, 5)
        assert _decoded_on(c, 1, ra.request_id) and _decoded_on(c, 1, b.request_id)
        assert ra.usage.completion_tokens == b.usage.completion_tokens == 2
        node = c.cp.registry.get("decode-0")
        assert node is not None and node.failures == len(_held_reserves(c, 0)) >= 1
        await eventually(lambda: _released_on(c, 0, ra.request_id))
    finally:
        await c.close()


async def test_a_reserve_answered_within_node_timeout_s_reserves_there(
    tmp_path: Path, silent_reserve: dict[str, asyncio.Event]
) -> None:
    """Control: a slow Reserve answered within the bound reserves on that node; nothing is
    counted against it and the other node is not asked."""
    gate = silent_reserve["decode-0"] = asyncio.Event()
    c = await make_cluster(tmp_path, decode_nodes=2, node_timeout_s=5)
    try:
        call = asyncio.create_task(c.client(timeout=10).generate(prompt_ids=[5], max_new_tokens=2))
        await eventually(lambda: len(_held_reserves(c, 0)) == 1)
        gate.set()
        result = await asyncio.wait_for(call, 5)
        assert _decoded_on(c, 0, result.request_id)
        assert "Reserve" not in c.decode[1].methods()
        node = c.cp.registry.get("decode-0")
        assert node is not None and node.failures == 0
    finally:
        await c.close()


async def test_a_reserve_cut_by_the_request_deadline_is_not_the_nodes_fault(
    tmp_path: Path, silent_reserve: dict[str, asyncio.Event]
) -> None:
    """The bound is capped by the deadline left: a Reserve that the request's own deadline cut
    (shorter than node_timeout_s) fails the request as before and counts nothing against the
    node."""
    silent_reserve["decode-0"] = asyncio.Event()
    c = await make_cluster(tmp_path, decode_nodes=2, node_timeout_s=5)
    try:
        with pytest.raises(DeadlineExceeded):
            await c.client(timeout=0.5).generate(prompt_ids=[5], max_new_tokens=2)
        assert len(_held_reserves(c, 0)) == 1 and "Reserve" not in c.decode[1].methods()
        node = c.cp.registry.get("decode-0")
        assert node is not None and node.failures == 0
    finally:
        await c.close()


@pytest.mark.parametrize("reserved_there", [False, True])
async def test_losing_a_node_whose_reserve_went_unanswered_fails_nothing(
    tmp_path: Path, silent_reserve: dict[str, asyncio.Event], reserved_there: bool
) -> None:
    """A request whose Reserve on decode-0 went unanswered runs on decode-1: decode-0 lost
    (its heartbeats stop) fails nothing of it. Control: a request that reserved on decode-0
    fails NODE_LOST when decode-0 is lost."""
    if not reserved_there:
        silent_reserve["decode-0"] = asyncio.Event()
    c = await make_cluster(tmp_path, decode_nodes=2)
    try:
        c.script.decode_hold = asyncio.Event()
        call = asyncio.create_task(c.client(timeout=10).generate(prompt_ids=[5], max_new_tokens=2))
        running_on = 0 if reserved_there else 1
        await eventually(lambda: "Decode" in c.decode[running_on].methods(), timeout=5)
        await c.decode[0].stop_heartbeats()  # lost after node_timeout_s
        await eventually(lambda: bool(c.events.of("node_lost")), timeout=5)
        c.script.decode_hold.set()
        [lost] = c.events.of("node_lost")
        if reserved_there:
            assert lost["failed_requests"] == 1
            with pytest.raises(Unavailable) as err:
                await asyncio.wait_for(call, 5)
            assert err.value.reason == "NODE_LOST"
        else:
            assert lost["failed_requests"] == 0
            result = await asyncio.wait_for(call, 5)
            assert result.usage.completion_tokens == 2
    finally:
        await c.close()


# -- the tenant's limits before the tokenizer --------------------------------------------------


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the texts ByteTokenizer encoded."""
    calls: list[int] = []
    orig = ByteTokenizer.encode

    def counting(self: ByteTokenizer, text: str) -> list[int]:
        calls.append(len(text))
        return orig(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", counting)
    return calls


async def test_a_tenant_at_its_concurrency_limit_is_refused_before_tokenizing(
    tmp_path: Path, encoded: list[int]
) -> None:
    c = await make_cluster(tmp_path, limits=TenantLimits(max_concurrent_requests=1), **BIG)
    encoded.clear()  # the fake nodes' script
    try:
        c.script.decode_hold = asyncio.Event()
        cl = c.client()
        first = asyncio.create_task(cl.generate(prompt_ids=[5], max_new_tokens=2))
        await eventually(lambda: "Decode" in c.decode[0].methods())
        results = await asyncio.gather(
            *(cl.generate(LONG_TEXT, max_new_tokens=2) for _ in range(3)), return_exceptions=True
        )
        assert [getattr(r, "reason", r) for r in results] == ["TENANT_CONCURRENCY"] * 3
        assert encoded == []
        c.script.decode_hold.set()
        await first
        # control: within its limit, the same text is tokenized and served
        served = await cl.generate(LONG_TEXT, max_new_tokens=2)
        assert served.usage.prompt_tokens == 5000 and encoded == [5000]
    finally:
        await c.close()


@pytest.mark.parametrize("limit", [100, 6000])
async def test_a_text_over_the_tenants_tokens_by_its_bytes_is_refused_before_tokenizing(
    tmp_path: Path, encoded: list[int], limit: int
) -> None:
    """ByteTokenizer: one token stands for at most one byte, so 5000 bytes are at least 5000
    tokens. Over a limit of 100, refused with no tokenizer run; control: within 6000, served."""
    c = await make_cluster(tmp_path, limits=TenantLimits(max_tokens_per_request=limit), **BIG)
    encoded.clear()  # the fake nodes' script
    try:
        if limit == 100:
            with pytest.raises(InvalidArgument) as err:
                await c.client().generate(LONG_TEXT, max_new_tokens=2)
            assert err.value.reason == "OVER_TENANT_TOKEN_LIMIT" and encoded == []
            assert "at least 5002" in err.value.message
            [event] = c.events.of("admission_rejected")
            assert event["reason"] == "OVER_TENANT_TOKEN_LIMIT"
        else:
            result = await c.client().generate(LONG_TEXT, max_new_tokens=2)
            assert result.usage.prompt_tokens == 5000 and encoded == [5000]
    finally:
        await c.close()


@pytest.mark.parametrize("bound", [4, None], ids=["loose-bound", "no-bound"])
async def test_a_text_over_the_tenants_tokens_by_its_exact_count_is_refused_after_tokenizing(
    tmp_path: Path, encoded: list[int], monkeypatch: pytest.MonkeyPatch, bound: int | None
) -> None:
    """The check before the tokenizer refuses only what its lower bound proves too long: with a
    loose bound (an HF tokenizer: several bytes a token) 15 bytes are at least 4 tokens, 14 with
    max_new_tokens, within 20; with none (a tokenizer with unknown tokens) nothing is known.
    Tokenized they are 15, 25 in all: only the check with the exact count refuses it, before any
    node is called. Control: 10 bytes, 20 in all, are served."""
    c = await make_cluster(tmp_path, limits=TenantLimits(max_tokens_per_request=20))
    encoded.clear()  # the fake nodes' script
    try:
        monkeypatch.setattr(c.cp.model.tokenizer, "max_text_bytes_per_token", bound)
        with pytest.raises(InvalidArgument) as err:
            await c.client().generate("x" * 15, max_new_tokens=10)
        assert err.value.reason == "OVER_TENANT_TOKEN_LIMIT" and encoded == [15]
        assert "= 25 exceeds" in err.value.message  # the exact count, not "at least"
        [event] = c.events.of("admission_rejected")
        assert event["reason"] == "OVER_TENANT_TOKEN_LIMIT"
        assert c.node_calls() == 0
        result = await c.client().generate("x" * 10, max_new_tokens=10)
        assert result.usage.prompt_tokens == 10 and encoded == [15, 10]
    finally:
        await c.close()


# -- interrupted requests and the tenant's concurrency -------------------------------------------


@pytest.fixture
def tokenizer_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """A long text's tokenizing (in its worker thread) waits for the event."""
    gate = threading.Event()
    orig = ByteTokenizer.encode

    def slow(self: ByteTokenizer, text: str) -> list[int]:
        if len(text) > 4096:
            gate.wait(10)
        return orig(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", slow)
    yield gate
    gate.set()


async def _tokenizing(c: Cluster) -> Run:
    await eventually(lambda: len(c.cp.deps.table) == 1)
    [run] = list(c.cp.deps.table)
    return run


async def test_an_abort_ends_a_request_waiting_for_its_tokenizer_at_once(
    tmp_path: Path, tokenizer_gate: threading.Event
) -> None:
    """AbortRequest on a request whose text is in the tokenizer thread ends it now (the thread
    goes on, unheard), and the tenant's next request is served under its limit of 1."""
    c = await make_cluster(tmp_path, limits=TenantLimits(max_concurrent_requests=1), **BIG)
    try:
        admin, auth = c.admin()
        cl = c.client()
        a = asyncio.create_task(cl.generate(LONG_TEXT, max_new_tokens=2))
        run = await _tokenizing(c)
        resp = await admin.AbortRequest(
            control_pb2.AbortRequestRequest(request_id=run.record.request_id), metadata=auth
        )
        assert resp.aborted
        with pytest.raises(Cancelled):
            await asyncio.wait_for(a, 5)
        assert run.record.state == RequestState.CANCELLED and not tokenizer_gate.is_set()
        served = await cl.generate(prompt_ids=[5], max_new_tokens=2)
        assert served.usage.completion_tokens == 2 and not tokenizer_gate.is_set()
    finally:
        tokenizer_gate.set()
        await c.close()


async def test_an_interrupted_request_does_not_count_against_its_tenant(
    tmp_path: Path, tokenizer_gate: threading.Event
) -> None:
    """From its interrupt on, a request not yet ended is left out of its tenant's count (the
    control plane's admission and SetLimits both use it); before, it counts."""
    c = await make_cluster(tmp_path, **BIG)
    try:
        a = asyncio.create_task(c.client().generate(LONG_TEXT, max_new_tokens=2))
        run = await _tokenizing(c)
        table = c.cp.deps.table
        assert table.active_for_tenant("acme") == 1  # control: live, it counts
        assert run.interrupt(Cancelled("the client cancelled the request"))
        # no await since: the request has not ended yet
        assert not run.record.terminal and table.active_for_tenant("acme") == 0
        tokenizer_gate.set()
        with pytest.raises(Cancelled):
            await asyncio.wait_for(a, 5)
    finally:
        tokenizer_gate.set()
        await c.close()


@pytest.mark.parametrize("aborted", [True, False])
async def test_set_limits_keeps_the_live_request_not_an_interrupted_one(
    tmp_path: Path, tokenizer_gate: threading.Event, aborted: bool
) -> None:
    """SetLimits lowers the tenant's concurrency to 1 while its oldest request (A, tokenizing) is
    interrupted but not yet ended and B waits for pages: B, the only live one, is kept and
    served. Control: with A live, A is kept and B ends TENANT_CONCURRENCY."""
    c = await make_cluster(tmp_path, **BIG)
    try:
        cl = c.client()
        a = asyncio.create_task(cl.generate(LONG_TEXT, max_new_tokens=2))
        run_a = await _tokenizing(c)
        c.script.reserve_error = ResourceExhausted("full")  # B waits for pages
        b = asyncio.create_task(cl.generate(prompt_ids=[5], max_new_tokens=2))
        await eventually(lambda: c.cp.deps.queue.waiting == 1)
        # What SetLimits does, with no await between the interrupt and it (an abort's request
        # would otherwise end first).
        if aborted:
            assert run_a.interrupt(Cancelled("the request was aborted by an operator"))
        tenant = c.cp.tenants.set_limits(
            "acme", TenantLimits(max_concurrent_requests=1), ["max_concurrent_requests"]
        )
        ended = c.cp.admin._apply_limits(tenant)
        assert ended == (0 if aborted else 1)
        c.script.reserve_error = None
        c.cp.deps.queue.notify()
        tokenizer_gate.set()
        ra, rb = await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), 10)
        if aborted:
            assert isinstance(ra, Cancelled)
            assert isinstance(rb, GenerationResult) and rb.usage.completion_tokens == 2
        else:
            assert isinstance(ra, GenerationResult) and ra.usage.completion_tokens == 2
            assert isinstance(rb, ResourceExhausted) and rb.reason == "TENANT_CONCURRENCY"
    finally:
        tokenizer_gate.set()
        await c.close()


# -- interrupts at admission are not refusals --------------------------------------------------


def _rejections(c: Cluster, reason: str) -> float:
    labels = {"service": "control-plane", "reason": reason}
    value = c.cp.metrics.registry.get_sample_value("kvfence_admission_rejections_total", labels)
    return value or 0.0


async def test_a_key_revoked_while_waiting_for_a_node_is_a_failure_not_a_refusal(
    tmp_path: Path,
) -> None:
    """A request waiting (not yet admitted) for a decode node to register, its API key revoked:
    it fails API_KEY_REVOKED (FAILED, request_failed), not counted as an admission refusal.
    Control: a request whose wait for a node runs out (NO_NODES: the no-node window is set to
    0 for it, not left to its deadline, whose answer could reach a client on a loaded machine
    after its own deadline) is a refusal, counted as one."""
    c = await make_cluster(tmp_path, decode_nodes=0, no_node_wait_s=30)
    try:
        admin, auth = c.admin()
        _, key_b, key_id = c.cp.tenants.create_tenant("bravo", TenantLimits())
        call = asyncio.create_task(
            c.client(api_key=key_b, timeout=10).generate(prompt_ids=[5], max_new_tokens=2)
        )
        await eventually(lambda: c.cp.queue.waiting == 1)
        [run] = list(c.cp.deps.table)
        await admin.RevokeKey(control_pb2.RevokeKeyRequest(key_id=key_id), metadata=auth)
        with pytest.raises(Unauthenticated) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.reason == "API_KEY_REVOKED"
        assert run.record.state == RequestState.FAILED
        [failed] = c.events.of("request_failed")
        assert failed["reason"] == "API_KEY_REVOKED"
        assert c.events.of("admission_rejected") == []
        assert _rejections(c, "API_KEY_REVOKED") == 0
        # control: a refusal on the same path is counted
        c.cp.deps.no_node_wait_s = 0.0
        with pytest.raises(Unavailable) as refused:
            await c.client(timeout=10).generate(prompt_ids=[5], max_new_tokens=2)
        assert refused.value.reason == "NO_NODES"
        [rejected] = c.events.of("admission_rejected")
        assert rejected["reason"] == "NO_NODES"
        assert _rejections(c, "NO_NODES") == 1
    finally:
        await c.close()
