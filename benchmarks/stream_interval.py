"""Stream-interval benchmark: what sending tokens in groups buys a CPU-bound stack, and costs.

Two ``kvfence up`` stacks (1 prefill + 1 decode each) on the same checkpoint, both up at once, one
with ``decode.stream_interval`` 1 (every token its own message, the default) and one with
``--interval`` (default 4). The same closed-loop load as ``e2e.py`` (byte-token prompts of 24-40
tokens, greedy, EOS ignored, ``concurrency`` streaming clients) drives one stack at a time, taking
turns every round in a new seeded random order. Per stack and concurrency: tokens/s (median of the
rounds), TTFT, the gap between the messages a client receives (its p99 is how bursty the stream
is), tokens per message, and each process's CPU time per delivered token. ``ratio`` is tokens/s
with the interval over tokens/s without. No goal: this measures a trade-off for operators.
Prints one JSON object; ``--quick`` for a smoke run, ``--png PATH`` a chart, ``--model small`` the
24.5M-parameter random Llama.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib.models import MODELS, bench_model
from benchlib.stack import BenchStack, compare_by_concurrency, started, workload

DECODE_POOL_TOKENS = 8192


def add_ratio(level: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    level["ratio"] = benchlib.r(
        level[f"interval_{hi}"]["tokens_per_s"] / level[f"interval_{lo}"]["tokens_per_s"], 3
    )
    return level


def draw_png(result: dict[str, Any], path: Path) -> None:
    benchlib.plot_by_concurrency(
        path,
        result["levels"],
        ("interval_1", f"interval_{result['interval']}"),
        [
            ("tokens/s", lambda e: e["tokens_per_s"]),
            ("gap between messages p99 (ms)", lambda e: e["message_gap"]["p99_ms"]),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 4 only, few requests")
    ap.add_argument("--png", type=Path, help="also draw tokens/s and message gaps here")
    ap.add_argument("--interval", type=int, default=4, help="the interval compared with 1")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    args = ap.parse_args(argv)
    if args.interval < 2:
        ap.error("--interval must be at least 2 (it is compared with 1)")
    new = 16 if args.quick else 32
    levels_c = [4] if args.quick else [1, 16, 64]
    rounds = 1 if args.quick else 3
    checkpoint = bench_model(args.model)
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-") as tmp:
        stacks = {
            k: BenchStack(
                Path(tmp) / f"stack-{k}",
                config={"decode": {"stream_interval": k}},
                # as e2e.py: room for every request at concurrency 64 at once
                args=["--model", str(checkpoint), "--decode-pool-tokens", str(DECODE_POOL_TOKENS)],
            )
            for k in (1, args.interval)
        }
        benchlib.log("starting two kvfence up stacks")
        with started(list(stacks.values())) as ready:
            machine = benchlib.machine()  # imports torch (seconds) while the stacks start
            ready()
            named = {f"interval_{k}": s for k, s in stacks.items()}
            levels = compare_by_concurrency(named, levels_c, new, rounds, args.quick)
    result = {
        "benchmark": "stream_interval",
        "quick": args.quick,
        "machine": machine,
        "workload": workload(args.model, new),
        "interval": args.interval,
        "levels": [add_ratio(lv, 1, args.interval) for lv in levels],
    }
    benchlib.emit(result, args.png, draw_png)


if __name__ == "__main__":
    main()
