"""A Reserve retried on a node that left it unanswered first releases there
(``test_cp_reserve_retry``). A node lost while it answered that Release (its heartbeats stopped, a
new process registered under its id) used to fail the request UNAVAILABLE NODE_LOST, though it was
only ADMITTED and held nothing anywhere: the retry called the lost node's stub, whose channel was
gone. It now tries the next node."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cp_fakes import FakeDecode
from cp_harness import make_cluster

from kvfence.errors import ResourceExhausted

RETRY = "reserve retried after no answer"  # the reason of the Release before a retried Reserve


@pytest.mark.parametrize("lost", [True, False], ids=["lost-as-it-answered", "control"])
async def test_a_node_lost_as_it_answers_the_release_before_a_retry_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    """decode-0 leaves the request's first Reserve unanswered (node_timeout_s 0.5); decode-1 is
    full until decode-0 is lost. Lost as it answers the Release of the retry: the request is
    served by decode-1. Control: not lost, the retry reserves on decode-0 and is served there."""
    never = asyncio.Event()
    reserve = FakeDecode.Reserve
    unanswered: set[str] = set()

    async def first_unanswered(self: FakeDecode, request: Any, context: Any) -> Any:
        if self.node_id == "decode-0" and not unanswered:
            unanswered.add(request.request_id)
            self.calls.append(("Reserve-unanswered", request))
            await never.wait()  # cancelled by the control plane's timeout
        return await reserve(self, request, context)

    monkeypatch.setattr(FakeDecode, "Reserve", first_unanswered)
    c = await make_cluster(tmp_path, decode_nodes=2)
    try:
        c.decode[1].servicer.refuse = ResourceExhausted("full", reason="DECODE_POOL_FULL")
        clients = c.cp.clients
        release = clients.release

        async def release_then_lose(node: Any, request_id: str, reason: str) -> bool | None:
            held = await release(node, request_id, reason)
            if lost and reason == RETRY:
                # lost between the node's answer and the retry's Reserve
                c.cp.registry.lose(node, "no heartbeat")
                c.decode[1].servicer.refuse = None
            return held

        monkeypatch.setattr(clients, "release", release_then_lose)
        result = await c.client(timeout=10).generate(prompt_ids=[5], max_new_tokens=2)
        assert result.finish_reason == "length"
        first, other = c.decode[0].methods(), c.decode[1].methods()
        retried = first[first.index("Reserve-unanswered") + 1 :]
        assert retried[:1] == ["Release"]  # the retry began, released first
        if lost:
            assert "Reserve" not in retried and "Decode" in other
        else:
            assert retried[:3] == ["Release", "Reserve", "Decode"] and "Decode" not in other
    finally:
        never.set()
        await c.close()
