"""Every benchmark script runs with ``--quick``, prints exactly one JSON object of its documented
shape, draws its PNG, and leaves no stack process behind. Shapes only: never a speed.

The scripts run two at a time, from the module's first test on (``quick_runs``): a script's time
is mostly its stacks starting and stopping, processes waiting on each other, and two scripts at
once on a 2-core machine take far less than one after the other. Each test then checks its own
script's run, as it did running the script itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
AT_ONCE = 2  # scripts running at a time

pytestmark = pytest.mark.slow

# test -> (script, its extra arguments, whether it draws its PNG); in the module's order
RUNS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "test_admission_quick": ("admission", (), True),
    "test_fairness_quick": ("fairness", (), True),
    "test_transfer_quick": ("transfer", (), True),
    "test_isolation_overhead_quick": ("isolation_overhead", (), True),
    "test_e2e_quick": ("e2e", (), True),
    "test_stream_interval_quick": ("stream_interval", (), True),
    "test_prefill_batching_quick": ("prefill_batching", (), True),
    "test_isolation_overhead_a_a_quick": ("isolation_overhead", ("--a-a", "--second-first"), False),
}


def _bench_processes(not_of: tuple[Path, ...] = ()) -> set[int]:
    """Processes of a benchmark's stack (their state dirs carry this prefix), but those of the
    runs whose own folders are named in ``not_of`` (the scripts that may run meanwhile)."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = p.info["cmdline"] or []
            if any("kvfence-bench-" in part for part in cmdline) and not any(
                str(other) in part for other in not_of for part in cmdline
            ):
                found.add(p.info["pid"])
        except psutil.Error:
            pass
    return found


@dataclass
class QuickRun:
    script: str
    proc: subprocess.CompletedProcess[str]
    png: Path
    draws: bool
    left_running: set[int]  # its stacks' processes still there once it had exited


def _run(test: str, root: Path) -> QuickRun:
    """The test's script with ``--quick``, its temporary files (its stacks' state dirs among
    them) in a folder of its own: that tells another script's stack processes from its own."""
    name, extra, draws = RUNS[test]
    own = root / test
    (own / "tmp").mkdir(parents=True)
    others = tuple(root / t for t in RUNS if t != test)
    before = _bench_processes(not_of=others)
    png = own / f"{name}.png"
    args = ["--png", str(png)] if HAS_MPL else []
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick", *extra, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "TMPDIR": str(own / "tmp")},
    )
    left = _bench_processes(not_of=others) - before
    return QuickRun(name, proc, png, draws, left)


@pytest.fixture(scope="module")
def quick_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[QuickRun]]]:
    """The runs of this module's selected tests, all started at the first one that asks,
    AT_ONCE at a time in the module's order; each test waits for its own."""
    root = tmp_path_factory.mktemp("quick")
    selected = {item.name for item in request.session.items if item.path == request.path}
    pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="bench-quick")
    try:
        yield {test: pool.submit(_run, test, root) for test in RUNS if test in selected}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_quick(quick_runs: dict[str, Future[QuickRun]], test: str) -> dict[str, Any]:
    run = quick_runs[test].result()
    proc = run.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line, got {len(lines)}"
    result = json.loads(lines[0])
    assert result["benchmark"] == run.script and result["quick"] is True
    machine = result["machine"]
    assert isinstance(machine["nproc"], int) and isinstance(machine["cpu"], str)
    assert machine["note"] == "shared, noisy"
    assert run.png.exists() == (HAS_MPL and run.draws)
    assert run.left_running == set(), "the benchmark left stack processes running"
    return result


def assert_latency(summary: dict[str, Any]) -> None:
    assert set(summary) == {"n", "p50_ms", "p99_ms", "mean_ms"}
    assert isinstance(summary["n"], int) and summary["n"] > 0
    assert all(isinstance(summary[k], float) for k in ("p50_ms", "p99_ms", "mean_ms"))


def assert_two_stacks(stacks: dict[str, Any], sides: tuple[str, str]) -> None:
    """isolation_overhead's two stacks at concurrency 1 and 8, and their same greedy tokens."""
    for conc in ("1", "8"):
        level = stacks[conc]
        for side in sides:
            assert level[side]["failed_requests"] == 0
            assert level[side]["tokens_per_s"] > 0
            assert_latency(level[side]["inter_token_latency"])
            assert_latency(level[side]["ttft"])
            cpu = level[side]["cpu_us_per_token"]
            assert set(cpu) == {"control-plane", "prefill", "decode", "load_generator"}
            assert level[side]["stack_cpu_us_per_token"] > 0
        assert isinstance(level["overhead_fraction"], float)
        assert isinstance(level["cpu_overhead_fraction"], float)
    assert stacks["same_tokens"] is True


def test_admission_quick(quick_runs):
    result = run_quick(quick_runs, "test_admission_quick")
    assert isinstance(result["admissible_limit"], int)
    assert result["requests"] == 40 and sum(result["errors"].values()) == 40
    assert isinstance(result["all_invalid_argument"], bool)
    assert_latency(result["rejection_latency"])
    assert set(result["rejection_latency_by_shape"]) == {"long_prompt", "long_generation"}
    assert isinstance(result["node_rpcs_from_rejections"], int)
    assert isinstance(result["control"]["node_rpcs"], int)
    assert isinstance(result["control_moved_counters"], bool)
    assert result["goal"]["node_rpcs_from_rejections"] == 0
    assert isinstance(result["goal"]["met"], bool)


def test_fairness_quick(quick_runs):
    result = run_quick(quick_runs, "test_fairness_quick")
    assert result["burst"] == 12 and result["rounds"] == 2
    for key in ("b_idle", "b_during_burst", "burst_span", "a_latency"):
        assert_latency(result[key])
    assert result["a_latency"]["n"] == 24 and result["b_during_burst"]["n"] == 2
    assert len(result["b_over_span"]) == 2 and isinstance(result["b_over_span_median"], float)
    assert [isinstance(n, int) for n in result["a_queued_when_b_sent"]] == [True, True]
    assert result["goal"]["b_over_span_max"] == 0.25 and isinstance(result["goal"]["met"], bool)


def test_transfer_quick(quick_runs):
    result = run_quick(quick_runs, "test_transfer_quick")
    methods = {"kvfence", "raw_ucxx", "raw_ucxx_new_endpoint", "grpc_stream", "memcpy"}
    assert [(s["layout"], s["pages"]) for s in result["sizes"]] == [
        ("tiny", 1),
        ("tiny", 8),
        ("big", 4),
    ]
    for size in result["sizes"]:
        assert set(size["gb_per_s"]) == methods and set(size["median_ms"]) == methods
        assert size["bytes"] == size["pages"] * size["page_bytes"]
        assert isinstance(size["kvfence_vs_raw_ucxx"], float)
        assert isinstance(size["kvfence_vs_grpc_stream"], float)
        assert isinstance(size["goal_vs_raw_met"], bool)
        assert isinstance(size["goal_vs_grpc_met"], bool)
    memory = result["memory"]
    assert memory["rounds"] == memory["refused_warm_hellos"] > 0
    assert memory["refused_pages_drained_by_decode"] >= memory["rounds"] * memory["pages_per_hello"]
    assert isinstance(memory["rss_growth_kib_per_round"], float)
    goal = result["goal"]
    assert goal["kvfence_vs_raw_ucxx"] == 0.8 and goal["kvfence_vs_grpc_stream"] == 3.0
    for key in ("vs_raw_met_at_largest", "vs_grpc_met_at_largest", "vs_raw_met_all_sizes"):
        assert isinstance(goal[key], bool)


def test_isolation_overhead_quick(quick_runs):
    result = run_quick(quick_runs, "test_isolation_overhead_quick")
    assert set(result["decode_checks"]) == {"1", "8"}
    for checks in result["decode_checks"].values():
        assert set(checks["attention_us"]) == {"on", "off"}
        for key in ("plan_in_step_us", "attention_in_step_us"):
            assert set(checks[key]) == {"on", "off"}
            assert checks[key]["on"] > 0 and checks[key]["off"] > 0
        spans = checks["write_side_in_step_us"]
        assert set(spans) == {"write_check", "flags_or", "flags_read"}
        for span in spans.values():
            assert set(span) == {"on", "off"} and span["on"] > 0 and span["off"] > 0
        assert isinstance(checks["write_side_check_us_per_step"], float)
        assert set(checks["decode_step_itl"]) == {"on", "off"}
        assert_latency(checks["decode_step_itl"]["on"])
        assert isinstance(checks["decode_step_overhead_fraction"], float)
    per_req = result["per_request_us"]
    for key in (
        "sign",
        "verify",
        "prefill_checksum",
        "tail_scrub",
        "ops_transfer",
        "ops_decode_step",
        "ops_decode_step_1",
        "owns_transfer",
        "owns_decode_step",
        "owns_decode_step_1",
        "prefill_gen_check_span_on",
        "prefill_gen_check_span_off",
        "prefill_hold_span_on",
        "prefill_hold_span_off",
    ):
        assert isinstance(per_req[key], float)
    assert set(result["colocated_e2e_on_off"]["tokens_per_s"]) == {"on", "off"}
    stacks = result["stack_e2e_on_off"]
    assert_two_stacks(stacks, ("on", "off"))
    assert stacks["started_first"] == "on"
    # The off stack's nodes ran without protections, and reported it (the script checks that
    # they, and no node of the on stack, ran the patches: else it fails).
    calls = stacks["off_stack_patched_calls"]
    for key in (
        "unchecked_attention_plans",
        "decode_write_checks_skipped",
        "decode_flag_reads_skipped",
        "owns_checks_skipped",
        "manifest_verifications_skipped",
    ):
        assert calls["decode"][key] > 0, key
    for key in ("prefill_generation_checks_skipped", "page_checksums_skipped",
                "manifest_signatures_skipped"):  # fmt: skip
        assert calls["prefill"][key] > 0, key
    # the decode node's own count of its step rows, on both stacks: one request decodes alone
    for side in ("on", "off"):
        assert stacks["1"][side]["decode_rows_per_step"] == 1.0
        assert 1.0 <= stacks["8"][side]["decode_rows_per_step"] <= 8.0
    for view, conc in (("latency_view", "1"), ("throughput_view", "8")):
        est = result["estimate"][view]
        assert est["decode_rows_per_step"] == stacks[conc]["on"]["decode_rows_per_step"]
        assert set(est["per_request_us"]) == {
            "tag_check",
            "write_side_check",
            "page_owns_check",
            "manifest_sign",
            "manifest_verify",
            "prefill_checksum",
            "prefill_generation_check",
            "tail_scrub",
            "deferred_release_ops",
        }
        assert isinstance(est["fraction_of_e2e"], float)
        # a number, or null with the reason (the estimated cost reached the request's time)
        off_tps = est["estimated_tokens_per_s_off"]
        if off_tps is None:
            assert isinstance(est["estimated_tokens_per_s_off_null_because"], str)
        else:
            assert isinstance(off_tps, float) and off_tps > 0
    assert "a_a" not in result
    goal = result["goal"]
    assert goal["max_fraction"] == 0.01
    assert set(goal["cpu_overhead_fraction"]) == set(goal["tokens_per_s_overhead_fraction"])
    assert set(goal["cpu_overhead_fraction"]) == {"1", "8"}
    for key in ("estimate_met", "cpu_met", "met"):
        assert isinstance(goal[key], bool)
    assert goal["met"] == (goal["estimate_met"] and goal["cpu_met"])
    assert isinstance(result["goal"]["met"], bool)


def test_e2e_quick(quick_runs):
    result = run_quick(quick_runs, "test_e2e_quick")
    levels = result["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        for backend in ("disaggregated", "colocated", "colocated_node_threads", "transformers"):
            assert isinstance(lv[backend]["tokens_per_s"], float)
            assert_latency(lv[backend]["ttft"])
        cpu = lv["disaggregated"]["cpu_us_per_token"]
        assert set(cpu) == {"control-plane", "prefill", "decode", "load_generator"}
        # CPU time comes in clock ticks (10 ms): a quick level's few requests can leave one
        # process at 0 ticks, and did, now and then (prefill at concurrency 1).
        assert all(v >= 0 for v in cpu.values()) and sum(cpu.values()) > 0
        # the stack's own metrics: one request at a time decodes alone; four share steps
        rows = lv["disaggregated"]["decode_rows_per_step"]
        assert rows == 1.0 if lv["concurrency"] == 1 else 1.0 <= rows <= 4.0
        states = lv["disaggregated"]["request_state_ms"]
        assert set(states) == {"received", "admitted", "reserved", "prefilling", "kv_verified",
                               "decoding"}  # fmt: skip
        assert all(v >= 0 for v in states.values()) and states["decoding"] > 0
        assert isinstance(lv["disaggregated_vs_colocated"], float)
        assert isinstance(lv["disaggregated_vs_colocated_node_threads"], float)
        assert isinstance(lv["colocated_vs_transformers"], float)
    rss = result["rss_mib"]["peak_by_concurrency"]
    assert set(rss) == {"idle", "1", "4"}
    assert set(rss["4"]) == {"control-plane", "prefill", "decode"}
    goal = result["goal"]
    assert goal["disaggregated_vs_colocated"] == 0.9 and goal["at_concurrency_at_least"] == 16
    assert goal["disaggregated_vs_colocated_met"] is None  # quick never reaches 16
    assert isinstance(goal["colocated_vs_transformers_met"], bool)
    assert isinstance(goal["decode_rss_met"], bool)


def test_stream_interval_quick(quick_runs):
    result = run_quick(quick_runs, "test_stream_interval_quick")
    assert result["interval"] == 4 and result["workload"]["new_tokens"] == 16
    (lv,) = result["levels"]
    assert lv["concurrency"] == 4
    for k in (1, 4):
        side = lv[f"interval_{k}"]
        assert isinstance(side["tokens_per_s"], float) and side["failed_requests"] == 0
        assert_latency(side["ttft"])
        assert_latency(side["message_gap"])
        assert set(side["cpu_us_per_token"]) == {"control-plane", "prefill", "decode",
                                                 "load_generator"}  # fmt: skip
    # Not a speed: the interval reached decode. Its 16 tokens leave decode in at most 5
    # messages (1 + 4 + 4 + 4 + 3), which nothing downstream splits.
    assert lv["interval_4"]["tokens_per_message"] >= 16 / 5
    assert lv["interval_1"]["tokens_per_message"] >= 1.0
    assert isinstance(lv["ratio"], float)


def test_prefill_batching_quick(quick_runs):
    result = run_quick(quick_runs, "test_prefill_batching_quick")
    assert result["values"] == [1, 128, 4096] and result["workload"]["new_tokens"] == 16
    (lv,) = result["levels"]
    assert lv["concurrency"] == 4
    for v in result["values"]:
        side = lv[f"max_batch_tokens_{v}"]
        assert isinstance(side["tokens_per_s"], float) and side["failed_requests"] == 0
        assert_latency(side["ttft"])
        assert set(side["cpu_us_per_token"]) == {"control-plane", "prefill", "decode",
                                                 "load_generator"}  # fmt: skip
    assert lv["ratio"]["max_batch_tokens_1"] == 1.0
    assert all(isinstance(x, float) for x in lv["ratio"].values())


def test_bench_models_small_is_a_larger_llama_the_engine_loads(tmp_path, monkeypatch):
    # ``--model small`` must be a real checkpoint of the configured shape, not the tiny one again
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    sys.path.insert(0, str(BENCH))
    try:
        from benchlib.models import SMALL_CONFIG, bench_model
    finally:
        sys.path.remove(str(BENCH))
    from kvfence.model.loader import load_model

    tiny, small = load_model(bench_model("tiny")), load_model(bench_model("small"))
    assert small.config == SMALL_CONFIG
    assert small.args.num_layers == 8 and small.args.hidden_size == 512
    assert small.fingerprint != tiny.fingerprint
    n_small = sum(p.numel() for p in small.model.parameters())
    assert n_small > 50 * sum(p.numel() for p in tiny.model.parameters())
    with pytest.raises(ValueError, match="unknown benchmark model"):
        bench_model("huge")


def test_isolation_overhead_a_a_quick(quick_runs):
    """Two identical, protected stacks: the same measures, and no node ran without
    protections (the default run above is the control in which the off stack's nodes did)."""
    result = run_quick(quick_runs, "test_isolation_overhead_a_a_quick")
    assert result["a_a"] is True
    assert set(result) == {
        "benchmark",
        "quick",
        "machine",
        "workload",
        "a_a",
        "stack_e2e_on_on_again",
    }
    stacks = result["stack_e2e_on_on_again"]
    assert_two_stacks(stacks, ("on", "on_again"))
    assert stacks["started_first"] == "on_again"
    assert stacks["off_stack_patched_calls"] == {}
