"""A stopping control plane ends the requests waiting for prefill room at once.

Such a request (PREFILLING, holding decode pages) sees the drain when it wakes and fails
UNAVAILABLE SHUTTING_DOWN (pipeline ``_check_serving``), but ``stop()`` woke only the queued
requests (interrupted): it went on sleeping until its next poll, a heartbeat interval, or until the
grace ran out, holding its decode pages and its client the while. Control: while the control
plane is not stopping, the same request keeps waiting.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cp_harness import eventually, make_cluster

from control_plane.lifecycle import RequestState
from kvfence.errors import ResourceExhausted, Unavailable

HEARTBEAT_S = 20.0  # the control plane's poll of waiting requests; far longer than the test


async def test_stop_ends_a_request_waiting_for_prefill_room_at_once(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, heartbeat_interval_s=HEARTBEAT_S, node_timeout_s=60.0)
    client = c.client(timeout=30)
    stopping: asyncio.Task[None] | None = None
    try:
        c.prefill[0].servicer.refuse = ResourceExhausted("full", reason="PREFILL_POOL_FULL")
        call = asyncio.create_task(client.generate(prompt_ids=[10], max_new_tokens=2))
        prefill = c.cp.registry.get("prefill-0")
        assert prefill is not None
        await eventually(lambda: prefill.refused_room, 5)  # refused: waiting for room
        [run] = list(c.cp.table)
        assert run.record.state == RequestState.PREFILLING
        # control: nothing wakes it while the control plane runs
        done, _ = await asyncio.wait({call}, timeout=0.5)
        assert not done and run.record.state == RequestState.PREFILLING

        stopping = asyncio.create_task(c.cp.stop(grace=HEARTBEAT_S / 2))
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, 3)  # not a heartbeat interval, nor the grace
        assert err.value.reason == "SHUTTING_DOWN"
        await asyncio.wait_for(stopping, 5)
        assert "Release" in c.decode[0].methods()  # its decode pages went back
    finally:
        if stopping is None:
            await c.cp.stop(grace=0.1)
        elif not stopping.done():
            await stopping
        await client.close()
        for node in [*c.decode, *c.prefill]:
            await node.stop()
