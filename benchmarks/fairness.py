"""Fairness benchmark: how long one tenant's request waits while another tenant's burst fills the
admission queue.

Starts ``kvfence up`` (1 prefill + 1 decode) with a decode pool that holds three requests at
once, so that a burst queues for decode pages. Each round, tenant A sends ``--burst`` requests at
once; a moment later tenant B sends one request of the same shape. Reported: B's latency during
the burst, against the burst's span (A's first request sent to its last finished) and against B's
latency on an idle stack; A's latencies. The control plane serves queued tenants in turn
(``control_plane/admission.py``), so B's request should wait for about one of A's requests, not
for the whole burst; first come first served would make it wait for nearly all of it. Prints one
JSON object; ``--quick`` for a smoke run (a burst of 12, two rounds, requests of 64 new tokens on
a decode pool that still holds three), ``--png PATH`` a chart.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib.models import bench_model
from benchlib.stack import BenchStack, started

from kvfence.client import AsyncClient

PROMPT_TOKENS = 24
NEW_TOKENS = 256
# 1024 tokens of decode pool with pages of 16: 64 pages; a request of 24 + 256 tokens takes 18,
# so three run at once and the rest of a burst queues.
DECODE_POOL_TOKENS = 1024
# --quick: the same three at once with shorter requests: 24 + 64 tokens take 6 pages, and 320
# tokens (20 pages) hold three of them, not four.
QUICK_NEW_TOKENS = 64
QUICK_DECODE_POOL_TOKENS = 320
# B's wait during the burst, as a share of the burst's span: under first come first served it is
# close to 1 (B waits behind the whole burst).
GOAL_B_OVER_SPAN = 0.25


async def one(client: AsyncClient, salt: int, new: int) -> float:
    """Seconds one greedy request of ``new`` tokens takes, sent to its last token."""
    prompt = [3 + (salt * 7 + i) % 250 for i in range(PROMPT_TOKENS)]
    t0 = time.perf_counter()
    await client.generate(prompt_ids=prompt, max_new_tokens=new, ignore_eos=True)
    return time.perf_counter() - t0


def queued(stack: BenchStack) -> int:
    """Requests of the control plane waiting for decode pages (ADMITTED) now."""
    with stack.admin() as admin:
        return sum(r.state == "ADMITTED" for r in admin.list_requests())


async def round_once(
    stack: BenchStack, a: AsyncClient, b: AsyncClient, burst: int, salt: int, new: int
) -> dict:
    t0 = time.perf_counter()
    a_tasks = [asyncio.create_task(one(a, salt + i, new)) for i in range(burst)]
    await asyncio.sleep(0.2)  # the burst is in: running and queued
    # Checked, not assumed: with none of A's requests queued when B comes, B has nobody to
    # overtake and the round says nothing about the queue's order.
    waiting = await asyncio.to_thread(queued, stack)
    b_latency = await one(b, salt + burst, new)
    a_latencies = await asyncio.gather(*a_tasks)
    return {
        "b": b_latency,
        "a": list(a_latencies),
        "span": time.perf_counter() - t0,
        "queued": waiting,
    }


async def measure(stack: BenchStack, burst: int, rounds: int, new: int, pool: int) -> dict:
    b_key = stack.create_tenant("tenant-b")
    async with (
        AsyncClient(stack.target, stack.api_key, timeout=300) as a,
        AsyncClient(stack.target, b_key, timeout=300) as b,
    ):
        await asyncio.gather(*(one(a, i, new) for i in range(4)), one(b, 99, new))  # warm-up
        idle = [await one(b, 1000 + i, new) for i in range(5)]
        results = [
            await round_once(stack, a, b, burst, 10_000 * (r + 1), new) for r in range(rounds)
        ]
    b_during = [r["b"] for r in results]
    spans = [r["span"] for r in results]
    shares = [r["b"] / r["span"] for r in results]
    return {
        "burst": burst,
        "rounds": rounds,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new,
        "decode_pool_tokens": pool,
        "b_idle": benchlib.summary_ms(idle),
        "b_during_burst": benchlib.summary_ms(b_during),
        "burst_span": benchlib.summary_ms(spans),
        "a_latency": benchlib.summary_ms([s for r in results for s in r["a"]]),
        "b_over_span": [benchlib.r(x) for x in shares],
        "b_over_span_median": benchlib.r(benchlib.median(shares)),
        "a_queued_when_b_sent": [r["queued"] for r in results],
    }


def draw_png(result: dict, path: Path) -> None:
    plt = benchlib.pyplot(path)
    names = ["B idle", "B during A's burst", "A's burst span"]
    keys = ["b_idle", "b_during_burst", "burst_span"]
    p50 = [result[k]["p50_ms"] / 1e3 for k in keys]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, p50)
    ax.set_ylabel("s (p50)")
    ax.set_title(f"tenant B's request vs tenant A's burst of {result['burst']}")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a small burst, two rounds, {QUICK_NEW_TOKENS} new tokens a request (<1 min)",
    )
    ap.add_argument("--png", type=Path, help="also draw the latencies here")
    ap.add_argument("--burst", type=int, help="tenant A's requests per burst (default 48)")
    ap.add_argument("--rounds", type=int, help="bursts (default 6)")
    args = ap.parse_args(argv)
    burst = args.burst or (12 if args.quick else 48)
    rounds = args.rounds or (2 if args.quick else 6)
    new = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    pool = QUICK_DECODE_POOL_TOKENS if args.quick else DECODE_POOL_TOKENS
    # --quick: the embedded model's checkpoint from the user cache (benchlib.models), which `up`
    # otherwise writes into the fresh state directory first (seconds of torch): the same bytes
    model = ["--model", str(bench_model("tiny"))] if args.quick else []
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-") as tmp:
        benchlib.log("starting kvfence up")
        stack = BenchStack(Path(tmp) / "stack", args=["--decode-pool-tokens", str(pool), *model])
        with started([stack]) as ready:
            machine = benchlib.machine()  # imports torch (seconds) while the stack starts
            ready()
            measured = asyncio.run(measure(stack, burst, rounds, new, pool))
    result = {
        "benchmark": "fairness",
        "quick": args.quick,
        "machine": machine,
        **measured,
        "goal": {
            "b_over_span_max": GOAL_B_OVER_SPAN,
            "met": measured["b_over_span_median"] <= GOAL_B_OVER_SPAN
            and min(measured["a_queued_when_b_sent"]) > 0,
        },
    }
    benchlib.emit(result, args.png, draw_png)


if __name__ == "__main__":
    main()
