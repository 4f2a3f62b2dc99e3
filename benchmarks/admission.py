"""Admission benchmark: latency of an over-length rejection through a real stack, and proof that
the rejected requests cost the nodes nothing.

Starts ``kvfence up`` (1 prefill + 1 decode) and sends requests whose ``prompt + max_new_tokens``
exceeds the admissible limit the cluster reports (two shapes: a long prompt, and a short prompt
with too many new tokens). Each must fail with INVALID_ARGUMENT before any node RPC; the nodes'
``rpc_count`` (Stats RPC) is read before and after and must not move. A positive control (valid
requests right after) must move it, so the zero cannot pass vacuously. Latency of the valid
requests is reported beside the rejections for scale. Prints one JSON object; ``--quick`` for a
smoke run, ``--png PATH`` a chart.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib.models import bench_model
from benchlib.stack import BenchStack, started

from kvfence.client import Client
from kvfence.errors import InvalidArgument, KvfenceError

GOAL_NODE_RPCS = 0  # node RPCs caused by rejected requests


def reject_once(client: Client, prompt_ids: list[int], max_new: int) -> tuple[float, str]:
    """Seconds until the rejection arrives, and the error's class name (not rejected: 'OK')."""
    t0 = time.perf_counter()
    try:
        client.generate(prompt_ids=prompt_ids, max_new_tokens=max_new, ignore_eos=True)
    except KvfenceError as err:
        return time.perf_counter() - t0, type(err).__name__
    return time.perf_counter() - t0, "OK"


def run(stack: BenchStack, n: int, n_control: int) -> dict:
    rng = random.Random(0)
    with Client(stack.target, stack.api_key, timeout=30) as client:
        limit = client.list_models()[0].admissible_limit
        # shapes: a prompt over the limit by itself, and a short prompt asking for too much
        shapes = {
            "long_prompt": (limit + 1, 1),
            "long_generation": (8, limit),
        }
        for prompt_len, max_new in shapes.values():  # warm-up: channels, tokenizer, code paths
            reject_once(client, [rng.randrange(3, 259) for _ in range(prompt_len)], max_new)
        client.generate(prompt_ids=[5, 6, 7], max_new_tokens=2, ignore_eos=True)
        before = stack.node_rpc_counts()
        lat: dict[str, list[float]] = {name: [] for name in shapes}
        errors: dict[str, int] = {}
        for i in range(n):  # interleave the two shapes
            for name, (prompt_len, max_new) in shapes.items():
                ids = [rng.randrange(3, 259) for _ in range(prompt_len)]
                secs, err = reject_once(client, ids, max_new)
                lat[name].append(secs)
                errors[err] = errors.get(err, 0) + 1
            del i
        after = stack.node_rpc_counts()
        control_lat = []
        for _ in range(n_control):
            t0 = time.perf_counter()
            client.generate(prompt_ids=[5, 6, 7, 8], max_new_tokens=1, ignore_eos=True)
            control_lat.append(time.perf_counter() - t0)
        after_control = stack.node_rpc_counts()
    rejected_rpcs = sum(after.values()) - sum(before.values())
    control_rpcs = sum(after_control.values()) - sum(after.values())
    all_lat = [s for v in lat.values() for s in v]
    return {
        "admissible_limit": limit,
        "requests": 2 * n,
        "errors": errors,
        "all_invalid_argument": errors == {InvalidArgument.__name__: 2 * n},
        "rejection_latency": benchlib.summary_ms(all_lat),
        "rejection_latency_by_shape": {
            name: {"prompt_tokens": shapes[name][0], "max_new_tokens": shapes[name][1]}
            | benchlib.summary_ms(v)
            for name, v in lat.items()
        },
        "node_rpc_count_before": before,
        "node_rpc_count_after": after,
        "node_rpcs_from_rejections": rejected_rpcs,
        "control": {
            "requests": n_control,
            "node_rpcs": control_rpcs,
            "latency_1_token": benchlib.summary_ms(control_lat),
        },
        "control_moved_counters": control_rpcs > 0,
    }


def draw_png(result: dict, path: Path) -> None:
    plt = benchlib.pyplot(path)
    by = result["rejection_latency_by_shape"]
    names = [*by, "valid (1 token)"]
    ctrl = result["control"]["latency_1_token"]
    p50 = [by[n]["p50_ms"] for n in by] + [ctrl["p50_ms"]]
    p99 = [by[n]["p99_ms"] for n in by] + [ctrl["p99_ms"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms")
    ax.set_title(f"over-length rejection; node RPCs caused: {result['node_rpcs_from_rejections']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few requests (<1 min)")
    ap.add_argument("--png", type=Path, help="also draw the latencies here")
    ap.add_argument("--requests", type=int, help="rejections per shape (default 300, quick 20)")
    args = ap.parse_args(argv)
    n = args.requests or (20 if args.quick else 300)
    # --quick: the embedded model's checkpoint from the user cache (benchlib.models), which `up`
    # otherwise writes into the fresh state directory first (seconds of torch): the same bytes
    stack_args = ["--model", str(bench_model("tiny"))] if args.quick else []
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-") as tmp:
        benchlib.log("starting kvfence up")
        stack = BenchStack(Path(tmp) / "stack", args=stack_args)
        with started([stack]) as ready:
            machine = benchlib.machine()  # imports torch (seconds) while the stack starts
            ready()
            measured = run(stack, n, 3 if args.quick else 20)
    result = {
        "benchmark": "admission",
        "quick": args.quick,
        "machine": machine,
        **measured,
        "goal": {
            "node_rpcs_from_rejections": GOAL_NODE_RPCS,
            "met": measured["node_rpcs_from_rejections"] == GOAL_NODE_RPCS
            and measured["all_invalid_argument"]
            and measured["control_moved_counters"],
        },
    }
    benchlib.emit(result, args.png, draw_png)


if __name__ == "__main__":
    main()
