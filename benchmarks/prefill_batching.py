"""Prefill-batching benchmark: what sharing a forward pass between waiting prompts buys, and costs.

One ``kvfence up`` stack (1 prefill + 1 decode) per value of ``prefill.max_batch_tokens`` (default
values: 1, every prompt alone; 128, kvfence's default; 4096), all up at once on the same
checkpoint. The closed-loop load of ``e2e.py`` (byte-token prompts of 24-40 tokens, greedy, EOS
ignored, ``concurrency`` streaming clients) drives one stack at a time, taking turns every round in
a new seeded random order. Per stack and concurrency: tokens/s (median of the rounds), TTFT, the
gap between the messages a client receives, tokens per message, and each process's CPU time per
delivered token. ``ratio`` is each stack's tokens/s over that of the first value. No goal: this
measures the trade-off behind the default. Prints one JSON object; ``--quick`` for a smoke run,
``--png PATH`` a chart, ``--model small`` the 24.5M-parameter random Llama (where prefill is a real
share of the work; on the tiny model a token's gRPC messages outweigh its forward pass).
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

DECODE_POOL_TOKENS = 8192  # as e2e.py: room for every request at concurrency 64 at once


def key(value: int) -> str:
    return f"max_batch_tokens_{value}"


def add_ratios(level: dict[str, Any], values: list[int]) -> dict[str, Any]:
    base = level[key(values[0])]["tokens_per_s"]
    level["ratio"] = {key(v): benchlib.r(level[key(v)]["tokens_per_s"] / base, 3) for v in values}
    return level


def draw_png(result: dict[str, Any], path: Path) -> None:
    benchlib.plot_by_concurrency(
        path,
        result["levels"],
        tuple(key(v) for v in result["values"]),
        [
            ("tokens/s", lambda e: e["tokens_per_s"]),
            ("TTFT p50 (ms)", lambda e: e["ttft"]["p50_ms"]),
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 4 only, few requests")
    ap.add_argument("--png", type=Path, help="also draw tokens/s and TTFT here")
    ap.add_argument(
        "--values",
        default="1,128,4096",
        help="prefill.max_batch_tokens values, comma-separated; ratios are against the first",
    )
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    args = ap.parse_args(argv)
    try:
        values = [int(v) for v in args.values.split(",")]
    except ValueError:
        ap.error("--values must be integers, e.g. 1,128,4096")
    if len(values) < 2 or len(set(values)) != len(values) or min(values) < 1:
        ap.error("--values needs at least two different values, each >= 1")
    new = 16 if args.quick else 32
    levels_c = [4] if args.quick else [16, 64]
    rounds = 1 if args.quick else 3
    checkpoint = bench_model(args.model)
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-") as tmp:
        stacks = {
            v: BenchStack(
                Path(tmp) / f"stack-{v}",
                config={"prefill": {"max_batch_tokens": v}},
                args=["--model", str(checkpoint), "--decode-pool-tokens", str(DECODE_POOL_TOKENS)],
            )
            for v in values
        }
        benchlib.log(f"starting {len(stacks)} kvfence up stacks")
        with started(list(stacks.values())) as ready:
            machine = benchlib.machine()  # imports torch (seconds) while the stacks start
            ready()
            named = {key(v): s for v, s in stacks.items()}
            levels = compare_by_concurrency(named, levels_c, new, rounds, args.quick)
    result = {
        "benchmark": "prefill_batching",
        "quick": args.quick,
        "machine": machine,
        "workload": workload(args.model, new),
        "values": values,
        "levels": [add_ratios(lv, values) for lv in levels],
    }
    benchlib.emit(result, args.png, draw_png)


if __name__ == "__main__":
    main()
