"""The prefill batcher's accounting and log line when a batched pass fails.

1. ``prefill_pass_prompts`` counts each prompt once, in the pass that gave it its result. A
   batched pass that raised (its prompts then run again one by one) was counted as well, with all
   its prompts: 3 prompts of a failed pass showed as 6, in 4 passes. Control: a pass that does
   not fail is counted as it runs.
2. The warning of that fallback names the requests of the failed pass and their tenants (it is
   logged on the engine thread, outside any request's log context): it named none.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from asyncwait import eventually
from structlog.testing import capture_logs
from test_prefill_batcher import (  # noqa: F401  (loaded: a fixture)
    GREEDY,
    PROMPTS,
    Gate,
    alloc,
    loaded,
    make_engine,
)
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.metrics import Metrics
from kvfence.proto.kvfence.v1 import prefill_pb2
from prefill_svc.batcher import PrefillBatcher

FALLBACK = "prefill pass failed; running its prompts one by one"


def pass_metric(metrics: Metrics) -> tuple[float, float]:
    """``prefill_pass_prompts``: (passes counted, prompts counted in them)."""
    get = metrics.registry.get_sample_value
    labels = {"service": metrics.service}
    count = get("kvfence_prefill_pass_prompts_count", labels) or 0.0
    total = get("kvfence_prefill_pass_prompts_sum", labels) or 0.0
    return count, total


@pytest.mark.parametrize(
    ("failing", "engine_passes", "counted"),
    [
        (None, [1, 3], (2, 4)),  # control: the three waiting prompts share a pass that works
        ("batch", [1, 3, 1, 1, 1], (4, 4)),  # the shared pass fails, each prompt reruns alone
        ("one", [1, 3, 1, 1, 1], (4, 4)),  # ... and one of them fails alone too
    ],
)
def test_a_failed_batched_pass_counts_each_prompt_once(
    loaded: Any,  # noqa: F811
    failing: str | None,
    engine_passes: list[int],
    counted: tuple[int, int],
) -> None:
    bad = PROMPTS[2]
    fail_when = {
        None: None,
        "batch": lambda prompts: len(prompts) > 1,
        "one": lambda prompts: bad in prompts,
    }[failing]
    engine = make_engine(loaded)
    gate = Gate(engine, fail_when=fail_when)
    metrics = Metrics("prefill")
    batcher = PrefillBatcher(engine, engine.pool, on_pass=metrics.prefill_pass_prompts.observe)
    try:
        refs = alloc(engine, PROMPTS, "m")
        futures = [batcher.submit(PROMPTS[0], refs[0], GREEDY)]
        assert gate.entered.wait(30)  # the first prompt's pass runs alone; the rest queue
        futures += [
            batcher.submit(p, r, GREEDY) for p, r in zip(PROMPTS[1:], refs[1:], strict=True)
        ]
        gate.go.set()
        results = []
        for f in futures:
            err = f.exception(30)
            results.append(err if err is not None else f.result())
    finally:
        batcher.close()
    assert gate.passes == engine_passes
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed == ([2] if failing == "one" else [])
    assert pass_metric(metrics) == counted
    assert (batcher.passes, batcher.prompts) == counted


def test_the_fallback_line_names_the_requests_of_the_failed_pass(loaded: Any) -> None:  # noqa: F811
    engine = make_engine(loaded)
    gate = Gate(engine, fail_when=lambda prompts: len(prompts) > 1)
    batcher = PrefillBatcher(engine, engine.pool)
    ids = [(f"req-{i}", f"ten-{i % 2}") for i in range(len(PROMPTS))]
    try:
        with capture_logs() as logs:
            refs = alloc(engine, PROMPTS, "l")
            futures = [
                batcher.submit(
                    PROMPTS[0], refs[0], GREEDY, request_id=ids[0][0], tenant_id=ids[0][1]
                )
            ]
            assert gate.entered.wait(30)
            futures += [
                batcher.submit(p, r, GREEDY, request_id=rid, tenant_id=tid)
                for p, r, (rid, tid) in zip(PROMPTS[1:], refs[1:], ids[1:], strict=True)
            ]
            gate.go.set()
            assert all(isinstance(f.result(30), int) for f in futures)
    finally:
        batcher.close()
    assert gate.passes == [1, 3, 1, 1, 1]
    fallback = [e for e in logs if e["event"] == FALLBACK]
    assert [(e["log_level"], e["request_ids"], e["tenant_ids"]) for e in fallback] == [
        ("warning", ["req-1", "req-2", "req-3"], ["ten-1", "ten-0", "ten-1"])
    ]


async def test_a_prefill_node_names_its_requests_and_counts_a_failed_pass_once(
    tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Through the Prefill service: four calls, the first held in its pass while the other three
    queue; their shared pass fails and each runs alone. Every call answers its manifest; the
    fallback line names the three requests and tenants; the node's metric counts four passes of
    one prompt each."""
    async with node_pair(tiny_dir, tmp_path) as (_dec, pre, dstub, pstub):
        engine = pre.rt.engine
        real = engine.prefill_many
        entered, go = threading.Event(), threading.Event()
        engine_passes: list[int] = []

        def prefill_many(prompts: Any, pages: Any) -> Any:
            engine_passes.append(len(prompts))
            if len(engine_passes) == 1:
                entered.set()
                assert go.wait(30)
            if len(prompts) > 1:
                raise RuntimeError("this pass fails")
            return real(prompts, pages)

        engine.prefill_many = prefill_many
        loop = asyncio.get_running_loop()
        prompt = [(5 * i + 3) % 300 + 3 for i in range(20)]
        before = pass_metric(pre.metrics)
        with capture_logs() as logs:
            try:
                _, first = await reserve_and_prefill(dstub, pstub, "n0", prompt, tenant="ta")
                first_task = asyncio.ensure_future(first)
                assert await loop.run_in_executor(None, entered.wait, 30)
                calls = [first_task]
                for i, tenant in ((1, "tb"), (2, "ta"), (3, "tc")):
                    _, call = await reserve_and_prefill(
                        dstub, pstub, f"n{i}", prompt, tenant=tenant
                    )
                    calls.append(asyncio.ensure_future(call))
                # all three queued behind the held pass before it ends
                assert await eventually(lambda: len(pre.servicer.batcher._waiting) == 3, 30)
            finally:
                go.set()
            answers = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [a.manifest.token_count for a in answers] == [len(prompt)] * 4
        assert engine_passes == [1, 3, 1, 1, 1]
        fallback = [e for e in logs if e["event"] == FALLBACK]
        assert [(e["request_ids"], e["tenant_ids"]) for e in fallback] == [
            (["n1", "n2", "n3"], ["tb", "ta", "tc"])
        ]
        after = pass_metric(pre.metrics)
        assert (after[0] - before[0], after[1] - before[1]) == (4, 4)
        for i in range(4):
            release = prefill_pb2.ReleaseRequest(request_id=f"n{i}")
            assert (await pstub.Release(release)).held and (await dstub.Release(release)).held
        pool = pre.rt.pool
        assert await eventually(lambda: pool.num_free == pool.num_pages, 10)
