"""A Reserve given up after node_timeout_s may still reserve on the node, late; decode refuses a
second reservation for the same request (INVALID_ARGUMENT, decode_svc/service.py). When the
request tries that node again (the only one, or the others full), it releases what the late
call left first: the retry used to fail the request INVALID_ARGUMENT. And a malformed request
from a tenant at its concurrency limit is refused INVALID_ARGUMENT, not a retryable
TENANT_CONCURRENCY."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cp_fakes import FakeDecode
from cp_harness import make_cluster

from control_plane.tenants import TenantLimits
from kvfence.errors import InvalidArgument, ResourceExhausted
from kvfence.server import abort


@pytest.fixture
def one_reservation_per_request(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The fake decode refuses a request id that already holds a reservation, as the real one
    does, and answers its first Reserve late (after reserving) when given a gate."""
    state: dict[str, Any] = {"slow_first": {}, "held": {}}
    reserve, release = FakeDecode.Reserve, FakeDecode.Release

    async def strict_reserve(self: FakeDecode, request: Any, context: Any) -> Any:
        held = state["held"].setdefault(self.node_id, set())
        if request.request_id in held:
            self.calls.append(("Reserve-dup", request))
            await abort(context, InvalidArgument("request already holds a reservation here"))
        res = await reserve(self, request, context)
        held.add(request.request_id)
        gate = state["slow_first"].pop(self.node_id, None)
        if gate is not None:
            await gate.wait()
        return res

    async def tracked_release(self: FakeDecode, request: Any, context: Any) -> Any:
        state["held"].setdefault(self.node_id, set()).discard(request.request_id)
        return await release(self, request, context)

    monkeypatch.setattr(FakeDecode, "Reserve", strict_reserve)
    monkeypatch.setattr(FakeDecode, "Release", tracked_release)
    return state


@pytest.mark.parametrize("late", [True, False], ids=["late-reserve", "control"])
@pytest.mark.parametrize("nodes", [1, 2])
async def test_a_reserve_retried_on_a_node_that_answered_late_releases_first(
    tmp_path: Path, one_reservation_per_request: dict[str, Any], nodes: int, late: bool
) -> None:
    gate = asyncio.Event()
    if late:
        one_reservation_per_request["slow_first"]["decode-0"] = gate
    c = await make_cluster(tmp_path, decode_nodes=nodes)  # node_timeout_s 0.5
    try:
        if nodes == 2:  # the other node is full: decode-0 is the only one with room
            c.decode[1].servicer.refuse = ResourceExhausted("full", reason="DECODE_POOL_FULL")
        asyncio.get_running_loop().call_later(1.0, gate.set)  # the late answer
        result = await c.client(timeout=10).generate(prompt_ids=[5], max_new_tokens=2)
        assert result.finish_reason == "length"
        methods = c.decode[0].methods()
        assert "Reserve-dup" not in methods
        if late:
            # given up, then released before it was asked again
            first = methods.index("Reserve")
            assert methods[first + 1 : first + 3] == ["Release", "Reserve"]
        else:  # control: answered at once, reserved once, nothing released before decoding
            assert methods.count("Reserve") == 1
            assert "Release" not in methods[: methods.index("Decode")]
    finally:
        gate.set()
        await c.close()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prompt_ids": [10], "temperature": -1.0}, "temperature must be"),
        ({"prompt_ids": []}, "prompt is empty"),
        ({"prompt_ids": [1_000_000]}, "vocabulary size"),
    ],
)
async def test_a_malformed_request_at_the_concurrency_limit_is_invalid_not_retryable(
    tmp_path: Path, kwargs: dict[str, Any], fragment: str
) -> None:
    c = await make_cluster(tmp_path, limits=TenantLimits(max_concurrent_requests=1))
    try:
        c.script.decode_hold = asyncio.Event()
        held = asyncio.create_task(c.client().generate(prompt_ids=[10], max_new_tokens=4))
        await asyncio.sleep(0)
        for _ in range(200):
            if c.decode[0].methods().count("Decode"):
                break
            await asyncio.sleep(0.02)
        with pytest.raises(InvalidArgument) as err:
            await c.client().generate(max_new_tokens=4, **kwargs)
        assert fragment in err.value.message
        # control: a well-formed request at the limit is still refused for concurrency
        with pytest.raises(ResourceExhausted) as busy:
            await c.client().generate(prompt_ids=[10], max_new_tokens=4)
        assert busy.value.reason == "TENANT_CONCURRENCY"
        c.script.decode_hold.set()
        await asyncio.wait_for(held, 10)
    finally:
        c.script.decode_hold.set()
        await c.close()
