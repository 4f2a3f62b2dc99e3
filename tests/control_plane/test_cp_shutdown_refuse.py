"""A stopping control plane refuses new requests cleanly before it closes its listeners.

With no request running, ``stop()`` used to close the listeners a few milliseconds after
SIGTERM: grpc cancels the calls it has accepted but not yet handed to a handler (grpc/grpc#41785),
so clients that had not cancelled anything got CANCELLED (usually not retried), or UNAVAILABLE
with no ErrorInfo. The listeners now stay open for ``control_plane.shutdown_refuse_s`` after
draining begins, and every Generate that arrives meanwhile reaches the handler and fails
UNAVAILABLE, reason SHUTTING_DOWN (retry elsewhere).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
from cp_fakes import make_model_info
from cp_harness import eventually, make_cfg, make_cluster

from control_plane.service import serve
from kvfence.errors import KvfenceError, Unavailable

REFUSE_S = 1.5  # the window; calls are sent during its first third only (2 shared cores)
SEND_FOR_S = 0.5
GRACE_S = 0.5


async def test_requests_arriving_as_it_stops_are_refused_shutting_down(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path)
    client = c.client(timeout=10)
    # control: before stop the same call succeeds
    assert (await client.generate(prompt_ids=[10], max_new_tokens=2)).token_ids
    assert not c.cp.generation.tasks  # nothing running: stop() has nothing to wait for

    async def one() -> KvfenceError | None:
        try:
            await client.generate(prompt_ids=[10], max_new_tokens=2)
        except KvfenceError as err:
            return err
        return None

    t0 = time.monotonic()
    stopping = asyncio.create_task(c.cp.stop(grace=GRACE_S, refuse_s=REFUSE_S))
    outcomes: list[KvfenceError | None] = []
    while time.monotonic() - t0 < SEND_FOR_S:
        # a few at once: calls that arrive together are the ones grpc had accepted undispatched
        outcomes += await asyncio.gather(*(one() for _ in range(4)))
    await asyncio.wait_for(stopping, GRACE_S + REFUSE_S + 5)
    took = time.monotonic() - t0
    try:
        assert len(outcomes) >= 4
        seen = Counter(f"{e.code.name} {e.reason}" if e else "OK" for e in outcomes)
        assert seen["CANCELLED CANCELLED"] == 0, seen  # grpc cancelled an undispatched call
        assert seen == {"UNAVAILABLE SHUTTING_DOWN": len(outcomes)}, seen
        assert all(isinstance(e, Unavailable) for e in outcomes)
        # the listeners stayed open for the window, and stop() still ended soon after it
        assert REFUSE_S - 0.1 <= took < GRACE_S + REFUSE_S + 3, took
    finally:
        await client.close()
        for node in [*c.decode, *c.prefill]:
            await node.stop()


@pytest.mark.parametrize("refuse", [None, 0.0, 2.5])
async def test_serve_keeps_the_listeners_open_for_the_configured_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: float | None
) -> None:
    """SIGTERM (serve's stop event) gives control_plane.shutdown_refuse_s (default 1 s) to
    stop(); 0 closes the listeners as soon as nothing runs, as before."""
    from control_plane import service

    seen: list[float] = []
    real_stop = service.ControlPlane.stop

    async def stop(self: service.ControlPlane, grace: float = 5.0, refuse_s: float = 0.0) -> None:
        seen.append(refuse_s)
        await real_stop(self, 0, 0)

    monkeypatch.setattr(service.ControlPlane, "stop", stop)
    cfg = make_cfg(tmp_path, **({} if refuse is None else {"shutdown_refuse_s": refuse}))
    stop_event = asyncio.Event()
    task = asyncio.create_task(serve(cfg, stop_event, model_info=make_model_info()))
    await eventually(lambda: (tmp_path / "admin_token").exists())
    stop_event.set()
    await asyncio.wait_for(task, 5)
    assert seen == [1.0 if refuse is None else refuse]
