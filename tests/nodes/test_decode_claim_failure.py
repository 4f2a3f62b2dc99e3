"""The decode engine thread survives a failure while it claims a step's rows.

``_claim`` ran outside the step's error handling: an exception it did not foresee (here the pool
raising IndexError as the row's page write is counted) ended the engine thread, and every request
on the node then waited for tokens that never came. Now that row fails, told what a failed step
tells, and the next request decodes. Control: without the failure both requests decode."""

from __future__ import annotations

import asyncio

import pytest
from asyncwait import eventually
from test_decode_batcher import PROMPTS, start_sequence

from decode_svc.batcher import DecodeBatcher
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams

NEW = 5


def _ended(events: list) -> bool:
    return bool(events) and events[-1][0] in ("finish", "error")


def _tokens(events: list) -> list[int]:
    return [t for kind, value in events if kind == "tokens" for t in value]


@pytest.mark.parametrize("claim_fails", [True, False])
async def test_a_failure_while_claiming_a_row_fails_that_row_and_the_next_request_decodes(
    monkeypatch, claim_fails
):
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    want = colo.generate(
        [
            GenerationRequest(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            for p in PROMPTS[:2]
        ]
    )
    events: list[list] = [[], []]
    # Prefilled before the failure is armed: the engine's prefill counts its writes too.
    first = start_sequence(colo, 0, PROMPTS[0], NEW, events[0])
    if claim_fails:
        begin_ops = colo.pool.begin_ops
        calls = 0

        def failing_once(page_ids: list[int]) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise IndexError("page table out of range")  # none the claim foresaw
            begin_ops(page_ids)

        monkeypatch.setattr(colo.pool, "begin_ops", failing_once)
    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                            asyncio.get_running_loop())  # fmt: skip
    batcher.start()
    try:
        batcher.add(first)
        assert await eventually(lambda: _ended(events[0]), timeout=10)
        # The next request, added once the first has ended: only a live thread decodes it.
        nxt = start_sequence(colo, 1, PROMPTS[1], NEW, events[1])
        batcher.add(nxt)
        assert await eventually(lambda: _ended(events[1]), timeout=10), events[1]
        assert batcher._thread.is_alive()
    finally:
        batcher.stop()
    if claim_fails:
        kind, err = events[0][-1]
        assert kind == "error" and "decode step failed" in str(err), events[0]
        assert "page table" not in str(err)  # the cause is the node log's, not the stream's
        assert _tokens(events[0]) == [first.first_token]  # nothing decoded after the failure
    else:
        assert events[0][-1] == ("finish", "length") and _tokens(events[0]) == want[0].token_ids
    assert events[1][-1] == ("finish", "length") and _tokens(events[1]) == want[1].token_ids
    assert batcher.active == 0
    for seq in (first, nxt):
        colo.pool.release(seq.seq_id)
    assert colo.pool.num_free == colo.pool.num_pages  # no page write left counted
    colo.pool.check_integrity()
