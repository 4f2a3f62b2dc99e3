"""A finished request's OK reaches the client when its final message is written, not after the
releases its task still awaits on the nodes (control_plane/generation.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from cp_fakes import FakeDecode
from cp_harness import Cluster, eventually, make_cluster

from control_plane import routing
from control_plane.pipeline import Pipeline
from kvfence.errors import KvfenceError

# Shorter than routing's 5 s, to keep the test short; longer than the client's deadline below, so
# a status held behind the Release reaches the client as DEADLINE_EXCEEDED.
RELEASE_WAIT_S = 3.0
CLIENT_DEADLINE_S = 2.0


@pytest.fixture
def silent_reserve(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, asyncio.Event]]:
    """Reserve on the nodes named here waits for their gate: a node that heartbeats but does not
    answer (the control plane gives up after node_timeout_s and reserves elsewhere)."""
    held: dict[str, asyncio.Event] = {}
    orig = FakeDecode.Reserve

    async def reserve(self: FakeDecode, request: Any, context: Any) -> Any:
        gate = held.get(self.node_id)
        if gate is not None:
            self.calls.append(("Reserve-held", request))
            await gate.wait()
        return await orig(self, request, context)

    monkeypatch.setattr(FakeDecode, "Reserve", reserve)
    yield held
    for gate in held.values():
        gate.set()


@pytest.fixture
async def two_decodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, silent_reserve: dict[str, asyncio.Event]
) -> AsyncIterator[Cluster]:
    """Two fake decode nodes (their servicers take silent_reserve's Reserve: patched first)."""
    monkeypatch.setattr(routing, "RELEASE_TIMEOUT_S", RELEASE_WAIT_S)
    c = await make_cluster(tmp_path, decode_nodes=2)  # node_timeout_s 0.5
    try:
        yield c
    finally:
        if c.script.release_hold is not None:
            c.script.release_hold.set()
        if c.cp.deps.draining:  # the test stopped the control plane: clients and nodes
            for close in reversed(c._closers):
                await close()
        else:
            await c.close()


@pytest.mark.parametrize("silent", [True, False], ids=["silent-node", "control"])
async def test_finished_request_ends_ok_before_its_releases(
    two_decodes: Cluster, silent_reserve: dict[str, asyncio.Event], silent: bool
) -> None:
    """decode-0 heartbeats but answers neither Reserve nor Release: the request reserves on
    decode-1 and finishes, and its task then sends decode-0 a Release (its Reserve is unanswered,
    it may hold pages) that waits RELEASE_TIMEOUT_S. The handler waited for that before ending
    the stream, so a client whose deadline was shorter heard DEADLINE_EXCEEDED for a complete
    answer. Now the stream ends OK at the final message; the Release still goes out, and the
    control plane's stop waits for the task, so none is left. Control: no silent node, same
    answer."""
    c = two_decodes
    if silent:
        silent_reserve["decode-0"] = asyncio.Event()
        c.script.release_hold = asyncio.Event()
    chunks = []
    t0 = time.monotonic()
    t_final = None
    async for chunk in c.client(timeout=CLIENT_DEADLINE_S).stream(prompt_ids=[5], max_new_tokens=2):
        chunks.append(chunk)
        if chunk.finish_reason:
            t_final = time.monotonic()
    t_end = time.monotonic()

    assert t_final is not None
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert sum(len(ch.token_ids) for ch in chunks) == 2
    assert t_end - t_final < 1.0, (t_end - t_final, t_end - t0)
    if silent:
        assert "Reserve-held" in c.decode[0].methods()  # the scenario did happen
        # The release goes on in the request's own task, owned by the servicer.
        await eventually(lambda: "Release" in c.decode[0].methods())
        assert len(c.cp.generation.tasks) == 1
        assert len(c.cp.table) == 1
    else:
        assert "Release" not in c.decode[0].methods()

    await c.cp.stop(grace=0.5)  # Release still unanswered: stop waits out its timeout
    assert not c.cp.generation.tasks
    assert not c.cp.table
    text = c.cp.metrics.render().decode()
    assert 'kvfence_requests_total{service="control-plane",status="OK"} 1.0' in text


async def test_a_request_task_that_fails_after_its_answer_is_logged(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler no longer awaits the request's task to its end: a failure there (in its
    releases, after the answer went out) is logged by the servicer, not left to asyncio's
    'exception was never retrieved' at garbage collection. The client's answer is unaffected."""

    async def broken_release_all(self: Pipeline, run: Any) -> None:
        raise RuntimeError("release bookkeeping broke")

    monkeypatch.setattr(Pipeline, "_release_all", broken_release_all)
    with structlog.testing.capture_logs() as logs:
        result = await cluster.client(timeout=5).generate(prompt_ids=[5], max_new_tokens=2)
        await eventually(lambda: not cluster.cp.generation.tasks)
    assert result.finish_reason == "length" and result.usage.completion_tokens == 2
    [failed] = [e for e in logs if e["event"] == "request task failed"]
    assert failed["log_level"] == "error"
    assert isinstance(failed["exc_info"], RuntimeError)


@pytest.mark.parametrize("broken", [True, False], ids=["internal-bug", "control"])
async def test_a_bug_in_the_pipeline_is_internal_not_shutting_down(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    """An exception that is no KvfenceError (a bug in the control plane) reached the tenant as
    UNAVAILABLE "the control plane is shutting down": a retry-later for a control plane that is
    not stopping. It is INTERNAL now, with no internals in its message, and logged whole.
    Control: the same path without the bug answers OK."""
    if broken:

        async def execute(self: Pipeline, *args: Any) -> None:
            raise RuntimeError("bookkeeping broke at /srv/secret/path")

        monkeypatch.setattr(Pipeline, "execute", execute)
    with structlog.testing.capture_logs() as logs:
        if broken:
            with pytest.raises(KvfenceError) as info:
                await cluster.client(timeout=5).generate(prompt_ids=[5], max_new_tokens=2)
            assert info.value.code == grpc.StatusCode.INTERNAL
            assert "shutting down" not in info.value.message
            assert "secret" not in info.value.message
        else:
            result = await cluster.client(timeout=5).generate(prompt_ids=[5], max_new_tokens=2)
            assert result.finish_reason == "length"
        await eventually(lambda: not cluster.cp.generation.tasks)
    failed = [e for e in logs if e["event"] == "request task failed"]
    if broken:
        assert isinstance(failed[0]["exc_info"], RuntimeError)
    else:
        assert not failed
    assert not cluster.cp.deps.draining
