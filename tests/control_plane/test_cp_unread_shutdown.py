"""A stopping control plane gives a finished answer its client is still reading the grace period.

``stop`` waited its grace only for the requests' pipeline tasks. A request whose pipeline had
finished while its client was still reading its answer has no task left, so it was interrupted at
once: the client got UNAVAILABLE "the control plane is shutting down" a few milliseconds into a
10 s grace, with none of its tokens. Now ``stop`` waits, within the same grace, for the handlers
of such requests to write their answers too (GenerationServicer.settle), then interrupts what is
left. The handler runs with the test_cp_slow_reader context, whose writes wait until the client
"reads".
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from cp_harness import eventually, make_cluster
from test_cp_slow_reader import NEW_TOKENS, UnreadStream, start

from control_plane import generation
from control_plane.lifecycle import RequestState


@pytest.mark.parametrize("reads", [True, False], ids=["reads-within-grace", "never-reads"])
async def test_stop_gives_an_unread_finished_answer_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: bool
) -> None:
    """reads-within-grace: the client starts reading a while into a 10 s grace and gets its whole
    answer, OK, and stop returns as soon as it is written (not at the grace's end). never-reads
    (control): the answer is cut UNAVAILABLE SHUTTING_DOWN when the grace ends, not before, and
    stop returns."""
    # The fake abort waits for a read that never comes: the handler gives up on it after this.
    monkeypatch.setattr(generation, "ABORT_WAIT_S", 0.2)
    grace_s = 10.0 if reads else 0.5
    c = await make_cluster(tmp_path, default_deadline_s=60)  # the deadline does not end it
    ctx = UnreadStream(c.api_key)
    handler = start(c, ctx)
    stopping: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(ctx.waiting.wait(), 5)
        await eventually(lambda: not c.cp.generation.tasks)  # the pipeline finished
        [run] = c.cp.table
        assert run.record.state == RequestState.FINISHED and not ctx.written

        t0 = time.monotonic()
        stopping = asyncio.create_task(c.cp.stop(grace=grace_s))
        if reads:
            # The client starts reading a while into the grace: the cut used to come within a
            # few milliseconds of stop, before it (a busy loop only delays the cut further).
            await asyncio.sleep(0.3)
            assert ctx.status is None
            ctx.read.set()
            await asyncio.wait_for(handler, 5)
            assert ctx.status is None  # OK
            assert len(ctx.ids()) == NEW_TOKENS and ctx.written[-1].finish_reason == "length"
            await asyncio.wait_for(stopping, 5)
            assert time.monotonic() - t0 < grace_s  # stop did not wait out the grace
        else:
            await eventually(lambda: ctx.status is not None, timeout=grace_s + 5)
            cut_at = time.monotonic() - t0
            assert cut_at >= grace_s - 0.05, cut_at  # at the grace's end, not before
            assert ctx.status.code == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in ctx.status.details
            assert not ctx.written
            await asyncio.wait_for(stopping, 5)
            # The handler does not wait on the status for the client: ABORT_WAIT_S, then it ends.
            await asyncio.wait_for(handler, 5)
            assert not ctx.read.is_set()
        assert not c.cp.table
    finally:
        ctx.read.set()
        if not handler.done():
            handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        for node in [*c.decode, *c.prefill]:
            await node.stop()
        if stopping is None:
            await c.cp.stop(grace=0.5)
        else:
            await asyncio.gather(stopping, return_exceptions=True)
