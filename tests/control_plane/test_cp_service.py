"""The service wrapper: serve() start/stop, server-side default deadline, graceful shutdown,
metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cp_fakes import make_model_info
from cp_harness import Cluster, eventually, make_cfg, make_cluster

from control_plane.service import serve
from kvfence.errors import DeadlineExceeded, InvalidArgument, Unavailable


async def test_serve_runs_until_stop_event(tmp_path: Path) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(make_cfg(tmp_path), stop, model_info=make_model_info()))
    await eventually(lambda: (tmp_path / "admin_token").exists())
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_default_deadline_applies_without_a_client_deadline(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, default_deadline_s=0.5)
    try:
        c.script.decode_hold = asyncio.Event()
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(c.client().generate(prompt_ids=[10], max_new_tokens=2), 3)
        await eventually(lambda: "Release" in c.decode[0].methods())
        c.script.decode_hold.set()
    finally:
        await c.close()


async def test_shutdown_fails_running_requests_and_releases(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path)
    c.script.decode_hold = asyncio.Event()
    client = c.client()
    call = asyncio.create_task(client.generate(prompt_ids=[10], max_new_tokens=2))
    await eventually(lambda: "Decode" in c.decode[0].methods())
    await c.cp.stop(grace=0.2)
    with pytest.raises(Unavailable, match="shutting down"):
        await call
    assert c.decode[0].methods()[-1] == "Release"
    c.script.decode_hold.set()
    await client.close()
    for node in [*c.decode, *c.prefill]:
        await node.stop()


async def test_metrics_count_requests_and_rejections(cluster: Cluster) -> None:
    await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
    with pytest.raises(InvalidArgument):
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=1000)
    text = cluster.cp.metrics.render().decode()
    assert 'kvfence_requests_total{service="control-plane",status="OK"} 1.0' in text
    assert (
        'kvfence_admission_rejections_total{reason="OVER_ADMISSIBLE_LIMIT",'
        'service="control-plane"} 1.0'
    ) in text
