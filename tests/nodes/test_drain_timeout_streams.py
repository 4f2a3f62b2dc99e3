"""A decode node whose drain times out ends its running Decode streams itself, with UNAVAILABLE
``NODE_DRAINING`` ("the decode node serving this request is shutting down"), before its server
stops. They used to be cut by the server's stop, and reached their clients as NODE_UNREACHABLE,
"became unreachable": a network fault to look for, where the node had stopped on purpose."""

from __future__ import annotations

import asyncio

import pytest
from test_node_drain import (  # noqa: F401  (fixtures)
    RealCluster,
    real,
    slow_decode,
    stream_tokens,
)
from test_prefill_decode import tiny_dir  # noqa: F401  (a fixture)

from kvfence.config import Role
from kvfence.errors import NODE_DRAINING, Unavailable


@pytest.mark.parametrize("drain_timeout_s", [0.3, 20.0], ids=["timed-out", "control"])
async def test_a_stream_cut_by_a_timed_out_drain_says_the_node_stopped(
    real: RealCluster,  # noqa: F811
    slow_decode: None,  # noqa: F811
    drain_timeout_s: float,
) -> None:
    """A 60-token stream (about 2 s at 30 ms a step) runs when its decode node stops. Its drain
    of 0.3 s times out: the stream fails UNAVAILABLE NODE_DRAINING, the node's pages all come
    back. Control: a drain of 20 s lets the same stream finish (``stream_tokens`` checks its
    finish reason)."""
    await real.add(Role.PREFILL, "prefill-0")
    dec = await real.add(Role.DECODE, "decode-0")
    await asyncio.sleep(0)
    async with real.client() as client:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_tokens(client, 60, started))
        await asyncio.wait_for(started.wait(), 30)
        stop = asyncio.create_task(dec.stop(drain_timeout_s=drain_timeout_s))
        if drain_timeout_s < 1:
            with pytest.raises(Unavailable) as info:
                await stream
            assert info.value.reason == NODE_DRAINING, info.value
            assert "shutting down" in info.value.message
        else:
            assert len(await stream) == 60
        await asyncio.wait_for(stop, 30)
    real.nodes.remove(dec)
    pool = dec.rt.pool
    assert pool.num_free == pool.num_pages and pool.stats().quarantined == 0
