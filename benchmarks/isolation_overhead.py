"""Isolation overhead benchmark: what kvfence's protections cost, against a 1% goal.

Two measurements. First, end to end: two ``kvfence up`` stacks side by side on the same
checkpoint, one as shipped ("on") and one whose prefill and decode nodes run with every protection
removed ("off"; the services have no switch for that and get none: ``benchlib/unprotected.py``
patches the node processes at start-up, and the script checks from their reports that the off
stack's nodes, and only they, ran the patches). The same requests drive one stack at a time, in a
new seeded order every round, at concurrency 1 and ``--batch``: tokens/s, inter-token latency
p50/p99, TTFT, and the CPU time each process spends per delivered token, on and off. On a shared
2-core machine a round's tokens/s moves by several percent with nothing changed, more than the 1%
sought; the stacks' CPU time per delivered token moves less (not always: see RESULTS.md), so the
goal is judged on it (``cpu_overhead_fraction``: stack CPU per token on over off, minus 1)
together with the estimate below, and tokens/s is reported beside it. ``--a-a`` runs the same
two stacks both protected and nothing else: how far two identical stacks read apart on the
machine at hand, the noise floor of every end-to-end figure.

Second, in-process, each protection on its own against none, on the same engine and data, to say
where the cost is:

(a) tag check: ``kernels`` reference paged attention (generation compare inside) against the same
    gather + attention arithmetic with the compare removed; and whole ``Engine.decode_step`` calls
    with either attention (so the decode inter-token latency on/off is measured directly), the
    step's attention plan and its calls (one a layer) timed inside those steps (what the
    estimate below counts: between a step's matmuls the check is out of cache and dearer than in
    a loop), and colocated end-to-end
    generation (tokens/s) with either, repetitions interleaved;
(b) manifest verification per transfer (``kvfence.manifest.verify``: MAC, coverage, generations,
    checksums recomputed over the received pages) against none;
(c) the checksums prefill computes for the manifest, and the tail scrub of the last page, per
    request, against none (beside the prefill forward pass for scale);
(d) deferred-release bookkeeping (``PagePool.begin_ops``/``end_ops`` per transfer batch and per
    decode step) against none.

The per-request sum of (a)-(d) is divided by the end-to-end seconds per request of the "on" stack
at concurrency 1 (latency view) and at the batch size (throughput view): the ``estimate``. The
goal (<= 1%) is met when both the estimate and the measured CPU overhead are within it; it is
reported, never asserted. Prints one JSON object; ``--quick`` for a smoke run, ``--png PATH`` a
chart, ``--model small`` the same on a 24.5M-parameter random Llama instead of the embedded tiny
model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
import torch
from benchlib.load import make_prompts, run_load
from benchlib.models import MODELS, bench_model
from benchlib.stack import BenchStack, CpuMeter
from benchlib.unprotected import KERNELS_WITHOUT_CHECK, UncheckedPlan, read_report, stack_env

import kernels
import kvfence.model.engine as engine_mod
from kernels._checks import check_attention_args
from kvfence import manifest as mf
from kvfence.config import pages_needed
from kvfence.kv.pool import PagePool
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.engine import DecodeItem, Engine
from kvfence.model.sampling import SamplingParams
from kvfence.proto.kvfence.v1 import common_pb2

GOAL_FRACTION = 0.01
PAGE_SIZE = 16


def attention_unchecked(
    q: torch.Tensor, kv_pages: torch.Tensor, layer: int, *shared: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the "off" baseline (``paged_decode_attention``'s arguments)."""
    return UncheckedPlan(kv_pages, *shared)(q, layer)


def set_tag_check(on: bool) -> None:
    # The engine reads ``kernels.<fn>`` at call time: swapping its module reference toggles it.
    engine_mod.kernels = kernels if on else KERNELS_WITHOUT_CHECK  # type: ignore[assignment]


def _timed_plan(plan: Any, plans: list[float], calls: list[float]) -> Any:
    """``plan`` (a ``plan_decode_attention``), timing each planning in ``plans`` and each call
    of a plan it made in ``calls``."""

    def planned(*args: Any) -> Any:
        t0 = time.perf_counter()
        attend = plan(*args)
        plans.append(time.perf_counter() - t0)

        def call(q: torch.Tensor, layer: int) -> Any:
            t0 = time.perf_counter()
            out = attend(q, layer)
            calls.append(time.perf_counter() - t0)
            return out

        return call

    return planned


class Workload:
    """One request shape (prompt, new tokens) and a decode batch of ``batch`` such requests."""

    def __init__(self, colo: ColocatedEngine, prompt: int, new: int, batch: int):
        self.colo, self.prompt, self.new, self.batch = colo, prompt, new, batch
        self.engine: Engine = colo.engine
        self.pool: PagePool = colo.pool
        self.args = colo.loaded.args
        g = torch.Generator().manual_seed(0)
        self.pool.kv.copy_(torch.randn(self.pool.kv.shape, generator=g))
        per_seq = pages_needed(prompt + new, PAGE_SIZE)
        self.refs = [self.pool.allocate(per_seq, f"b{batch}-seq-{i}") for i in range(batch)]
        # the middle of generation: half the new tokens are in the pages
        self.position = prompt + new // 2

    def decode_items(self) -> list[DecodeItem]:
        return [DecodeItem(7, self.position, refs) for refs in self.refs]  # type: ignore[arg-type]

    def attention_args(self) -> tuple[Any, ...]:
        a = self.args
        pages = self.refs
        table = torch.tensor([[r.page_id for r in refs] for refs in pages], dtype=torch.int32)  # type: ignore[union-attr]
        gens = torch.tensor([[r.generation for r in refs] for refs in pages])  # type: ignore[union-attr]
        lens = torch.full((self.batch,), self.position + 1, dtype=torch.int32)
        q = torch.randn(self.batch, a.num_heads, a.head_dim)
        return (q, self.pool.kv, 0, table, gens, self.pool.page_gen, lens, a.head_dim**-0.5)


def bench_tag_check(w: Workload, reps: int) -> dict[str, Any]:
    """(a) attention and whole decode steps with the generation check on and off."""
    args = w.attention_args()
    out_on, flags = kernels.paged_decode_attention(*args)
    out_off, _ = attention_unchecked(*args)
    assert not flags.any() and torch.allclose(out_on, out_off, atol=1e-5), "baseline differs"
    attn = benchlib.interleaved(
        {
            "on": lambda: kernels.paged_decode_attention(*args),
            "off": lambda: attention_unchecked(*args),
            "off_with_arg_checks": lambda: (
                check_attention_args(*args[:7]),
                attention_unchecked(*args),
            ),
        },
        reps,
    )
    arg_checks = benchlib.median(attn["off_with_arg_checks"]) - benchlib.median(attn["off"])
    items = w.decode_items()
    # The attention calls are also timed inside whole decode steps, between the step's matmuls:
    # there the check's code and data are no longer in cache and it costs 1.5-3x what it costs
    # timed in a loop. A whole step's on/off difference would show that too, but on a model whose
    # step is milliseconds long it drowns in the step's own noise. A step plans its attention
    # once and calls it once per layer; both are timed.
    in_step: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    kernels_in_step = {
        on: types.SimpleNamespace(
            write_kv_pages=kernels.write_kv_pages,
            plan_decode_attention=_timed_plan(
                kernels.plan_decode_attention if on else UncheckedPlan, *in_step[on]
            ),
        )
        for on in (True, False)
    }

    def step(on: bool) -> None:
        engine_mod.kernels = kernels_in_step[on]  # type: ignore[assignment]
        try:
            w.engine.decode_step(items)
        finally:
            set_tag_check(True)

    steps = benchlib.interleaved({"on": lambda: step(True), "off": lambda: step(False)}, reps)
    attn_on, attn_off = benchlib.median(attn["on"]), benchlib.median(attn["off"])
    step_on, step_off = benchlib.median(steps["on"]), benchlib.median(steps["off"])
    plan_on, plan_off = (benchlib.median(in_step[on][0]) for on in (True, False))
    situ_on, situ_off = (benchlib.median(in_step[on][1]) for on in (True, False))
    layers = w.args.num_layers
    per_step = (plan_on - plan_off) + (situ_on - situ_off) * layers
    return {
        "attention_us": {"on": benchlib.r(attn_on * 1e6, 2), "off": benchlib.r(attn_off * 1e6, 2)},
        "attention_check_us_per_step": benchlib.r((attn_on - attn_off) * layers * 1e6, 2),
        "plan_in_step_us": {
            "on": benchlib.r(plan_on * 1e6, 2),
            "off": benchlib.r(plan_off * 1e6, 2),
        },
        "attention_in_step_us": {
            "on": benchlib.r(situ_on * 1e6, 2),
            "off": benchlib.r(situ_off * 1e6, 2),
        },
        "attention_in_step_check_us_per_step": benchlib.r(per_step * 1e6, 2),
        # of "attention_us" (one unplanned call): argument validation (shapes/dtypes only),
        # also removed from "off"; within a step, the shared arguments are checked at planning
        "arg_checks_us_per_call": benchlib.r(arg_checks * 1e6, 2),
        "decode_step_itl": {
            "on": benchlib.summary_ms(steps["on"]),
            "off": benchlib.summary_ms(steps["off"]),
        },
        "decode_step_delta_us": benchlib.r((step_on - step_off) * 1e6, 2),
        "decode_step_overhead_fraction": benchlib.r((step_on - step_off) / step_off),
        "_per_step_s": max(0.0, per_step),
    }


def bench_colocated(w: Workload, n_requests: int, rounds: int) -> dict[str, Any]:
    """Colocated end-to-end generation, check on and off, rounds interleaved."""
    prompts = make_prompts(n_requests, w.prompt, w.prompt, seed=1)
    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=w.new, ignore_eos=True)) for p in prompts
    ]
    colo = ColocatedEngine(w.colo.loaded, tokenizer=w.colo.tokenizer, max_batch_size=w.batch)

    def run(on: bool) -> None:
        set_tag_check(on)
        try:
            colo.generate(reqs)
        finally:
            set_tag_check(True)

    times = benchlib.interleaved({"on": lambda: run(True), "off": lambda: run(False)}, rounds)
    tokens = n_requests * w.new
    tps = {k: tokens / benchlib.median(v) for k, v in times.items()}
    return {
        "requests": n_requests,
        "rounds": rounds,
        "tokens_per_s": {k: benchlib.r(v, 1) for k, v in tps.items()},
        "overhead_fraction": benchlib.r(tps["off"] / tps["on"] - 1),
    }


def make_manifest(w: Workload, refs: list[Any], secret: bytes) -> tuple[Any, mf.Expected]:
    n = pages_needed(w.prompt, PAGE_SIZE)
    layout = common_pb2.KvLayout(
        page_size=PAGE_SIZE,
        dtype=w.pool.dtype,
        num_layers=w.pool.num_layers,
        num_kv_heads=w.pool.num_kv_heads,
        head_dim=w.pool.head_dim,
    )
    rid = "res-bench"
    tail = w.prompt % PAGE_SIZE
    if tail:  # prefill zeroes the unused tail before the checksum (and the benchmark repeats it)
        kernels.scrub_pages(w.pool.kv, torch.tensor([refs[n - 1].page_id]), tail)
    sums = prefill_checksums(w.pool, [r.page_id for r in refs[:n]], rid)
    pages = [
        common_pb2.ManifestPage(
            page_id=r.page_id,
            generation=r.generation,
            tokens_in_page=min(PAGE_SIZE, w.prompt - i * PAGE_SIZE),
            checksum=sums[i],
        )
        for i, r in enumerate(refs[:n])
    ]
    m = common_pb2.KvManifest(
        request_id="req-bench",
        tenant_id="t",
        reservation_id=rid,
        model_fingerprint="fp",
        layout=layout,
        token_count=w.prompt,
        first_token=7,
        pages=pages,
        checksum_algo=kernels.CHECKSUM_ALGO,
    )
    mf.sign(m, secret)
    exp = mf.Expected(
        request_id="req-bench",
        tenant_id="t",
        reservation_id=rid,
        secret=secret,
        prompt_tokens=w.prompt,
        pages=refs,
        receiving=True,
        received=list(range(n)),
        fingerprint="fp",
        layout=layout,
        checksum_algo=kernels.CHECKSUM_ALGO,
        vocab_size=8,
    )
    return m, exp


def prefill_checksums(pool: PagePool, page_ids: list[int], rid: str) -> list[int]:
    """What prefill computes for a manifest (as prefill_svc does)."""
    seeds = [kernels.checksum_seed(rid, i) for i in range(len(page_ids))]
    sums = kernels.page_checksum(pool.kv, torch.tensor(page_ids), torch.tensor(seeds)).tolist()
    return [int(s) & 0xFFFFFFFFFFFFFFFF for s in sums]


def bench_per_request(w: Workload, reps: int) -> dict[str, Any]:
    """(b) verify, (c) prefill checksum and tail scrub, (d) bookkeeping, and the prefill pass."""
    refs = w.refs[0]
    assert refs is not None
    m, exp = make_manifest(w, refs, b"k" * 32)
    n = pages_needed(w.prompt, PAGE_SIZE)
    ids = [r.page_id for r in refs[:n]]

    def checksums(page_ids: list[int], seeds: list[int]) -> list[int]:
        sums = kernels.page_checksum(w.pool.kv, torch.tensor(page_ids), torch.tensor(seeds))
        return [int(x) & 0xFFFFFFFFFFFFFFFF for x in sums.tolist()]

    def verify() -> None:
        mf.verify(m, exp, current_generation=w.pool.generation, checksums=checksums,
                  checksum_seed=kernels.checksum_seed)  # fmt: skip

    batch_ids = [r[0].page_id for r in w.refs if r is not None]
    tail = w.prompt % PAGE_SIZE
    prefill_refs = w.refs[-1]
    prompt = make_prompts(1, w.prompt, w.prompt, seed=2)[0]
    times = benchlib.interleaved(
        {
            "verify": verify,
            "prefill_checksum": lambda: prefill_checksums(w.pool, ids, "res-bench"),
            "tail_scrub": lambda: (
                kernels.scrub_pages(w.pool.kv, torch.tensor([ids[-1]]), tail) if tail else None
            ),
            "ops_transfer": lambda: (w.pool.begin_ops(ids), w.pool.end_ops(ids)),
            "ops_decode_step": lambda: (w.pool.begin_ops(batch_ids), w.pool.end_ops(batch_ids)),
            # a step of one sequence (the latency view) counts one page, not the batch's
            "ops_decode_step_1": lambda: (
                w.pool.begin_ops(batch_ids[:1]),
                w.pool.end_ops(batch_ids[:1]),
            ),
            "prefill_forward": lambda: w.engine.prefill(prompt, prefill_refs),  # type: ignore[arg-type]
            "nothing": lambda: None,
        },
        reps,
    )
    med = {k: benchlib.median(v) for k, v in times.items()}
    return {k: v for k, v in med.items()}


def bench_stacks(
    w: Workload, model: Path, quick: bool, a_a: bool = False, second_first: bool = False
) -> dict[str, Any]:
    """End to end through two ``kvfence up`` stacks side by side, the same but for the
    protections: "on" as shipped, "off" with its nodes patched at start-up
    (``benchlib.unprotected``). At concurrency 1 and ``batch``, the same requests on each, one
    stack at a time in a new seeded order every round. Per stack: tokens/s (median of the
    rounds), inter-token latency and TTFT over all rounds, CPU µs per delivered token of each
    process; ``overhead_fraction``: tokens/s off over on, minus 1, with the spread of that ratio
    round by round (the machine's noise); ``cpu_overhead_fraction``: the stack's CPU per token
    (control plane, prefill, decode) on over off, minus 1.

    ``a_a``: the second stack is protected too (named ``on_again``), which measures how far two
    identical stacks read apart here: the noise floor of every figure above. The "on" stack is
    started first unless ``second_first`` (identical stacks have read apart in the same
    direction, the second started the cheaper, so the order is a knob to test that with)."""
    second = "on_again" if a_a else "off"
    out: dict[str, Any] = {}
    pool_tokens = max(4096, 2 * w.batch * (w.prompt + w.new))
    rounds = 1 if quick else 8
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-") as tmp:
        report = Path(tmp) / "unprotected.jsonl"
        args = ["--model", str(model), "--decode-pool-tokens", str(pool_tokens)]
        stacks = {
            "on": BenchStack(Path(tmp) / "on", args=args),
            second: BenchStack(Path(tmp) / second, args=args, env={} if a_a else stack_env(report)),
        }
        benchlib.log(f"starting two kvfence up stacks: on, and {second}")
        order = [second, "on"] if second_first else ["on", second]
        with stacks[order[0]], stacks[order[1]]:
            node_pids = {
                k: {p.pid for role, p in st.services().items() if role != "control-plane"}
                for k, st in stacks.items()
            }
            for st in stacks.values():  # first use of each stack's code paths, not measured
                run_load(st.target, st.api_key, make_prompts(4, w.prompt, w.prompt), w.new, 4)
            same = _same_tokens(stacks, make_prompts(2, w.prompt, w.prompt, seed=4), w.new)
            for conc in sorted({1, w.batch}):
                n = (4 if quick else 6) * conc if conc > 1 else (4 if quick else 12)
                prompts = make_prompts(n, w.prompt, w.prompt, seed=3)
                benchlib.log(f"stacks: {n} requests at concurrency {conc} x {rounds} rounds")
                runs: dict[str, list[Any]] = {k: [] for k in stacks}
                cpu = {k: CpuMeter(st) for k, st in stacks.items()}
                for k in benchlib.turns(list(stacks), rounds, seed=conc):
                    st = stacks[k]
                    runs[k].append(
                        run_load(st.target, st.api_key, prompts, w.new, conc, during=cpu[k].measure)
                    )
                out[str(conc)] = _stack_sides(runs, cpu, n)
        calls, pids = read_report(report)  # written by the off stack's nodes as they exited
    _check_patched(calls, pids, node_pids, second)
    out["off_stack_patched_calls"] = calls
    out["same_tokens"] = same
    out["started_first"] = order[0]
    return out


def _same_tokens(stacks: dict[str, BenchStack], prompts: list[list[int]], new: int) -> bool:
    """Both stacks generate the same greedy tokens: the off stack does the same work, less the
    protections. Raises if not (the comparison would be meaningless)."""
    tokens = {}
    for k, st in stacks.items():
        with st.client() as c:
            tokens[k] = [
                c.generate(prompt_ids=p, max_new_tokens=new, ignore_eos=True).token_ids
                for p in prompts
            ]
    if len({str(t) for t in tokens.values()}) != 1:
        raise RuntimeError(f"the stacks {list(stacks)} generated other tokens")
    return True


def _stack_sides(runs: dict[str, list[Any]], cpu: dict[str, CpuMeter], n: int) -> dict[str, Any]:
    """One concurrency level of :func:`bench_stacks`: each stack's measures and the ratios of the
    second stack (off, or on again) to the first (on)."""
    sides: dict[str, Any] = {}
    for k, rs in runs.items():
        timings = [t for r in rs for t in r.timings]
        per_process = cpu[k].us_per_token(sum(r.tokens for r in rs))
        stack_cpu = sum(v for role, v in per_process.items() if role != "load_generator")
        sides[k] = {
            "cpu_us_per_token": per_process,
            "stack_cpu_us_per_token": benchlib.r(stack_cpu, 1),
            "failed_requests": sum(len(r.failures) for r in rs),
            "failures_sample": sorted({f for r in rs for f in r.failures})[:3],
            "tokens_per_s": benchlib.r(benchlib.median([r.tokens_per_s for r in rs]), 1),
            "seconds_per_request": benchlib.r(benchlib.median([r.wall_s for r in rs]) / n, 5),
            "mean_latency_s": benchlib.r(sum(t.total_s for t in timings) / max(1, len(timings)), 5),
            "inter_token_latency": benchlib.summary_ms([g for r in rs for g in r.gaps()]),
            "ttft": benchlib.summary_ms([t for r in rs for t in r.ttft()]),
        }
    first, second = runs  # "on", then "off" (or "on_again")
    per_round = [
        b.tokens_per_s / a.tokens_per_s - 1 for a, b in zip(runs[first], runs[second], strict=True)
    ]
    return {
        "requests": n,
        "rounds": len(runs[first]),
        **sides,
        "overhead_fraction": benchlib.r(
            sides[second]["tokens_per_s"] / sides[first]["tokens_per_s"] - 1
        ),
        "cpu_overhead_fraction": benchlib.r(
            sides[first]["stack_cpu_us_per_token"] / sides[second]["stack_cpu_us_per_token"] - 1
        ),
        "overhead_fraction_by_round": {
            "min": benchlib.r(min(per_round)),
            "median": benchlib.r(benchlib.median(per_round)),
            "max": benchlib.r(max(per_round)),
        },
    }


def _check_patched(
    calls: dict[str, dict[str, int]], pids: set[int], node_pids: dict[str, set[int]], second: str
) -> None:
    """The off stack, and only it, ran unprotected: every node of the off stack and none of the
    on stack reported, and the off stack's nodes counted calls of every replacement the load
    reaches (else the comparison would be of two protected stacks, or two unprotected ones).
    With ``second`` ``on_again`` (both protected) no node may have reported."""
    unprotected = node_pids["off"] if second == "off" else set()
    if pids != unprotected:
        raise RuntimeError(
            f"unprotected nodes {sorted(pids)}; should be {sorted(unprotected)}, "
            f"stacks' nodes {node_pids}"
        )
    if second != "off":
        return
    want = {
        "decode": ("unchecked_attention_plans", "manifest_verifications_skipped"),
        "prefill": ("page_checksums_skipped", "manifest_signatures_skipped", "begin_ops_skipped"),
    }
    missing = [
        f"{role}.{k}" for role, ks in want.items() for k in ks if not calls.get(role, {}).get(k)
    ]
    if missing:
        raise RuntimeError(f"the protections-off stack did not run its patches: {missing}")


def estimate(
    w: Workload, tag: dict[str, Any], per_req: dict[str, float], batch: int
) -> dict[str, float]:
    """Protection seconds per request when ``batch`` requests share every decode step."""
    nothing = per_req["nothing"]
    net = {k: max(0.0, v - nothing) for k, v in per_req.items()}
    steps = w.new - 1  # the first token comes from prefill
    return {
        "tag_check": steps * tag["_per_step_s"] / batch,
        "manifest_verify": net["verify"],
        "prefill_checksum": net["prefill_checksum"],
        "tail_scrub": net["tail_scrub"],
        "deferred_release_ops": net["ops_transfer"]
        + steps * net["ops_decode_step" if batch > 1 else "ops_decode_step_1"] / batch,
    }


def draw_png(result: dict[str, Any], path: Path) -> None:
    plt = benchlib.pyplot(path)
    est = result["estimate"]["throughput_view"]["per_request_us"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.barh(list(est), list(est.values()), color="tab:blue")
    ax1.set_xlabel("µs per request")
    ax1.set_title("protection cost per request")
    views = result["estimate"]
    bars = {f"estimate, c={v['concurrency']}": v["fraction_of_e2e"] * 100 for v in views.values()}
    for c, f in result["goal"]["cpu_overhead_fraction"].items():
        bars[f"stack CPU, c={c}"] = f * 100
    ax2.bar(list(bars), list(bars.values()), color="tab:orange")
    ax2.tick_params(axis="x", labelrotation=20)
    ax2.axhline(GOAL_FRACTION * 100, ls="--", color="tab:red", label="goal")
    ax2.set_ylabel("cost, % (time or stack CPU per token)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="few repetitions, small stack run (<1 min)"
    )
    ap.add_argument("--png", type=Path, help="also draw the cost breakdown here")
    ap.add_argument("--prompt", type=int, default=120, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument(
        "--batch", type=int, default=8, help="decode batch (concurrency) for the throughput view"
    )
    ap.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="checkpoint (benchlib/models.py): the embedded tiny model or a 24.5M random Llama",
    )
    ap.add_argument(
        "--a-a",
        action="store_true",
        help="only the two stacks, both protected: how far identical stacks read apart here",
    )
    ap.add_argument(
        "--second-first",
        action="store_true",
        help="start the off (or on_again) stack before the on stack (default: after it)",
    )
    args = ap.parse_args(argv)
    reps = 20 if args.quick else 300
    torch.manual_seed(0)
    model = bench_model(args.model)
    colo = ColocatedEngine.from_path(model, page_size=PAGE_SIZE, num_pages=512)
    workload = {
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "batch": args.batch,
        "model": args.model,
        "parameters": sum(p.numel() for p in colo.loaded.model.parameters()),
        "page_size": PAGE_SIZE,
        "reps": reps,
    }
    if args.a_a:
        w = Workload(colo, args.prompt, args.new, args.batch)
        benchlib.emit({
            "benchmark": "isolation_overhead",
            "quick": args.quick,
            "machine": benchlib.machine(),
            "workload": workload,
            "a_a": True,
            "stack_e2e_on_on_again": bench_stacks(
                w, model, args.quick, a_a=True, second_first=args.second_first
            ),
        })  # fmt: skip
        return
    benchlib.log("tag check: attention and decode steps")
    per_batch = {b: Workload(colo, args.prompt, args.new, b) for b in sorted({1, args.batch})}
    tag = {b: bench_tag_check(w, reps) for b, w in per_batch.items()}
    w = per_batch[args.batch]
    benchlib.log("manifest, checksum, scrub, bookkeeping")
    per_req = bench_per_request(w, reps)
    benchlib.log("colocated end to end, check on/off")
    colocated = bench_colocated(
        w, 2 * args.batch if args.quick else 6 * args.batch, 2 if args.quick else 6
    )
    stack = bench_stacks(w, model, args.quick, second_first=args.second_first)

    views = {}
    for name, b in (("latency_view", 1), ("throughput_view", args.batch)):
        cost = estimate(per_batch[b], tag[b], per_req, b)
        s = stack[str(b)]["on"]
        e2e = s["mean_latency_s"] if b == 1 else s["seconds_per_request"]
        total = sum(cost.values())
        views[name] = {
            "concurrency": b,
            "per_request_us": {k: benchlib.r(v * 1e6, 2) for k, v in cost.items()},
            "total_us": benchlib.r(total * 1e6, 2),
            "e2e_seconds_per_request": benchlib.r(e2e, 5),
            "fraction_of_e2e": benchlib.r(total / e2e, 5),
            "estimated_tokens_per_s_off": benchlib.r(
                s["tokens_per_s"] * e2e / max(e2e - total, 1e-9), 1
            ),
        }
    for t in tag.values():
        t.pop("_per_step_s")
    fractions = [v["fraction_of_e2e"] for v in views.values()]
    levels = [str(b) for b in sorted({1, args.batch})]
    cpu_overhead = {c: stack[c]["cpu_overhead_fraction"] for c in levels}
    tps_overhead = {c: stack[c]["overhead_fraction"] for c in levels}
    result = {
        "benchmark": "isolation_overhead",
        "quick": args.quick,
        "machine": benchlib.machine(),
        "workload": workload,
        "tag_check": {str(b): t for b, t in tag.items()},
        "per_request_us": {k: benchlib.r(v * 1e6, 2) for k, v in per_req.items()},
        "colocated_e2e_on_off": colocated,
        "stack_e2e_on_off": stack,
        "estimate": views,
        "goal": {
            "max_fraction": GOAL_FRACTION,
            "estimate_met": max(fractions) <= GOAL_FRACTION,
            "cpu_overhead_fraction": cpu_overhead,
            "cpu_met": max(cpu_overhead.values()) <= GOAL_FRACTION,
            "tokens_per_s_overhead_fraction": tps_overhead,
            "met": max(fractions) <= GOAL_FRACTION and max(cpu_overhead.values()) <= GOAL_FRACTION,
        },
    }
    benchlib.emit(result, args.png, draw_png)


if __name__ == "__main__":
    main()
