"""Isolation overhead benchmark: what kvfence's protections cost, against a 1% goal.

Two measurements. First, end to end: two ``kvfence up`` stacks side by side on the same
checkpoint, one as shipped ("on") and one whose prefill and decode nodes run with the
protections priced below removed ("off"; the services have no switch for that and get none:
``benchlib/unprotected.py`` patches the node processes at start-up, and the script checks from
their reports that the off stack's nodes, and only they, ran the patches). The same requests
drive one stack at a time, in a new seeded order every round, at concurrency 1 and ``--batch``:
tokens/s, inter-token latency p50/p99, TTFT, and the CPU time each process spends per delivered
token, on and off. On a shared 2-core machine a round's tokens/s moves by several percent with
nothing changed, more than the 1% sought; the stacks' CPU time per delivered token moves less
(not always: see RESULTS.md), so the goal is judged on it (``cpu_overhead_fraction``: stack CPU
per token on over off, minus 1) together with the estimate below, and tokens/s is reported
beside it. ``--a-a`` runs the same
two stacks both protected and nothing else: how far two identical stacks read apart on the
machine at hand, the noise floor of every end-to-end figure.

Second, in-process, each protection the off stack removes, on its own against none, on the same
engine and data, to say where the cost is:

(a) decode steps: the tag check, ``kernels`` reference paged attention (generation compare
    inside) against the same gather + attention arithmetic with the compare removed, timed in a
    loop; and whole decode steps as the decode node runs them (``DecodeBatch.step_and_sample``)
    with every check the off stack removes from them on or off (so the decode inter-token latency
    on/off is measured directly), and inside those steps (what the estimate counts: between a
    step's matmuls a check is out of cache and dearer than in a loop) the step's attention plan
    and its calls (one a layer), and decode's write-side checks: the generation check of the
    page each row writes (with the target ids and generations it alone needs), the one OR of
    the attention plan's flags (its layers') with that check's, the step's flags read back (the
    lines the off stack removes, clocked in place in copies of the engine's methods,
    ``benchlib.unprotected.rewrite``); and colocated end-to-end generation (tokens/s) with the
    engine's checks on or off, repetitions interleaved;
(b) the manifest MAC prefill signs (``kvfence.manifest.sign``) and decode's verification
    (``kvfence.manifest.verify``: MAC, coverage, generations, checksums recomputed over the
    received pages), each against none;
(c) the checksums prefill computes for the manifest, and the tail scrub of the last page, per
    request, against none (beside the prefill forward pass for scale), and prefill's generation
    check of the pages it writes, timed inside real prefill passes as (a)'s write-side checks;
(d) deferred-release bookkeeping (``PagePool.begin_ops``/``end_ops`` per transfer batch and per
    decode step) against none;
(e) ``PagePool.owns``: the decode batcher's per row and step, the receiver's per transfer batch,
    timed in a loop.

The per-request sum of (a)-(e) (``estimate``) is divided by the end-to-end seconds per request
of the "on" stack at concurrency 1 (latency view) and at the batch size (throughput view). A
decode step's costs are shared by the rows it carries, and under load it carries fewer than the
concurrency (requests wait in prefill meanwhile): the estimate shares them by the mean rows per
step the on stack's decode node reported over the same runs (its ``kvfence_decode_step_rows``
metric), at the cost of a step of that many rows (timed at 1 and at ``--batch`` rows, linear in
between). The goal (<= 1%) is met when both the estimate and the measured CPU overhead are within
it; it is reported, never asserted. Prints one JSON object; ``--quick`` for a smoke run, ``--png
PATH`` a chart, ``--model small`` the same on a 24.5M-parameter random Llama instead of the
embedded tiny model.
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
from benchlib.stack import (
    METRICS_CONFIG,
    BenchStack,
    CpuMeter,
    StackMetrics,
    started,
    warm_up,
)
from benchlib.unprotected import (
    DECODE_ROWS_EDITS,
    KERNELS_WITHOUT_CHECK,
    PREFILL_MANY_EDITS,
    STEP_AND_SAMPLE_EDITS,
    UncheckedPlan,
    read_report,
    rewrite,
    stack_env,
)

import kernels
import kvfence.model.engine as engine_mod
from kernels._checks import check_attention_args
from kvfence import manifest as mf
from kvfence.config import pages_needed
from kvfence.kv.pool import PagePool
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.engine import DecodeBatch, Engine
from kvfence.model.sampling import SamplingParams
from kvfence.proto.kvfence.v1 import common_pb2

GOAL_FRACTION = 0.01
PAGE_SIZE = 16


def attention_unchecked(
    q: torch.Tensor, kv_pages: torch.Tensor, layer: int, *shared: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the "off" baseline (``paged_decode_attention``'s arguments)."""
    return UncheckedPlan(kv_pages, *shared)(q, layer)


# The engine's methods as shipped, and as the off stack runs them (benchlib/unprotected.py).
SHIPPED = {
    (Engine, "decode_rows"): Engine.decode_rows,
    (DecodeBatch, "step_and_sample"): DecodeBatch.step_and_sample,
    (Engine, "prefill_many"): Engine.prefill_many,
}
UNCHECKED = {
    (Engine, "decode_rows"): rewrite(Engine.decode_rows, DECODE_ROWS_EDITS),
    (DecodeBatch, "step_and_sample"): rewrite(DecodeBatch.step_and_sample, STEP_AND_SAMPLE_EDITS),
    (Engine, "prefill_many"): rewrite(Engine.prefill_many, PREFILL_MANY_EDITS),
}


def set_engine_checks(on: bool) -> None:
    """The engine's checks on (as shipped) or off (as the off stack's nodes run): the tag check
    in attention (the engine reads ``kernels.<fn>`` at call time: swapping its module reference
    toggles it), decode's write-side checks and prefill's generation check."""
    engine_mod.kernels = kernels if on else KERNELS_WITHOUT_CHECK  # type: ignore[assignment]
    for (cls, name), fn in (SHIPPED if on else UNCHECKED).items():
        setattr(cls, name, fn)


def _timed_plan(plan: Any, plans: list[float], calls: list[float]) -> Any:
    """``plan`` (a ``plan_decode_attention``), timing each planning in ``plans`` and each call
    of a plan it made in ``calls``."""

    class Timed:
        def __init__(self, *args: Any) -> None:
            t0 = time.perf_counter()
            self.attend = plan(*args)
            plans.append(time.perf_counter() - t0)

        @property
        def flags(self) -> Any:
            return self.attend.flags

        def __call__(self, q: torch.Tensor, layer: int) -> Any:
            t0 = time.perf_counter()
            out = self.attend(q, layer)
            calls.append(time.perf_counter() - t0)
            return out

    return Timed


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

    def decode_batch(self) -> DecodeBatch:
        """The decode node's batch of these sequences (``DecodeBatch``, as its batcher keeps)."""
        batch = DecodeBatch(self.engine)
        batch.sync(self.refs)  # type: ignore[arg-type]
        return batch

    def step_args(self) -> tuple[list[int], list[int], list[SamplingParams], list[int]]:
        """``DecodeBatch.step_and_sample``'s arguments for one step of every sequence."""
        b = self.batch
        return [7] * b, [self.position] * b, [SamplingParams()] * b, [0] * b

    def attention_args(self) -> tuple[Any, ...]:
        a = self.args
        pages = self.refs
        table = torch.tensor([[r.page_id for r in refs] for refs in pages], dtype=torch.int32)  # type: ignore[union-attr]
        gens = torch.tensor([[r.generation for r in refs] for refs in pages])  # type: ignore[union-attr]
        lens = torch.full((self.batch,), self.position + 1, dtype=torch.int32)
        q = torch.randn(self.batch, a.num_heads, a.head_dim)
        return (q, self.pool.kv, 0, table, gens, self.pool.page_gen, lens, a.head_dim**-0.5)


def _median_us(times: list[float]) -> float:
    return benchlib.median(times) * 1e6


def bench_decode_checks(w: Workload, reps: int) -> dict[str, Any]:
    """(a) the tag check in attention, and decode's write-side checks, on and off: attention
    calls in a loop, and whole decode steps as the decode node runs them
    (``DecodeBatch.step_and_sample``) with every check the off stack removes from them on or off,
    each check timed inside those steps."""
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
    # The checks are also timed inside whole decode steps, between the step's matmuls: there
    # their code and data are no longer in cache and they cost 1.5-3x what they cost timed in a
    # loop. A whole step's on/off difference would show that too, but on a model whose step is
    # milliseconds long it drowns in the step's own noise. A step plans its attention once and
    # calls it once per layer; both are timed. The write-side checks are lines inside the
    # engine's methods: copies of those methods (``benchlib.unprotected.rewrite``), with the
    # lines kept (on) or removed (off), clock the lines in place (``spans``).
    in_step: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    spans: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    kernels_in_step = {
        on: types.SimpleNamespace(
            write_kv_pages=kernels.write_kv_pages,
            plan_decode_attention=_timed_plan(
                kernels.plan_decode_attention if on else UncheckedPlan, *in_step[on]
            ),
        )
        for on in (True, False)
    }
    rows = {
        on: types.MethodType(
            rewrite(Engine.decode_rows, DECODE_ROWS_EDITS, off=not on, times=spans[on]), w.engine
        )
        for on in (True, False)
    }
    batches = {on: w.decode_batch() for on in (True, False)}
    for on, batch in batches.items():
        batch.step_and_sample = types.MethodType(  # type: ignore[method-assign]
            rewrite(DecodeBatch.step_and_sample, STEP_AND_SAMPLE_EDITS, off=not on,
                    times=spans[on]),
            batch,
        )  # fmt: skip
    step_args = w.step_args()

    def step(on: bool) -> None:
        engine_mod.kernels = kernels_in_step[on]  # type: ignore[assignment]
        w.engine.decode_rows = rows[on]  # type: ignore[method-assign]
        try:
            # As the decode node's batcher steps: its claim counts the write pages (priced in
            # deferred_release_ops), so the engine counts none of its own.
            tokens = batches[on].step_and_sample(*step_args, pages_held=True)
        finally:
            del w.engine.decode_rows
            set_engine_checks(True)
        assert None not in tokens, "a decode row was flagged"

    steps = benchlib.interleaved({"on": lambda: step(True), "off": lambda: step(False)}, reps)
    attn_on, attn_off = benchlib.median(attn["on"]), benchlib.median(attn["off"])
    step_on, step_off = benchlib.median(steps["on"]), benchlib.median(steps["off"])
    plan_on, plan_off = (benchlib.median(in_step[on][0]) for on in (True, False))
    situ_on, situ_off = (benchlib.median(in_step[on][1]) for on in (True, False))
    layers = w.args.num_layers
    tag_per_step = (plan_on - plan_off) + (situ_on - situ_off) * layers
    span_us = {k: {"on": _median_us(spans[True][k]), "off": _median_us(spans[False][k])}
               for k in ("write_check", "flags_or", "flags_read")}  # fmt: skip
    per_step_calls = {"write_check": 1, "flags_or": 1, "flags_read": 1}
    write_per_step = sum((v["on"] - v["off"]) * per_step_calls[k] for k, v in span_us.items()) / 1e6
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
        "attention_in_step_check_us_per_step": benchlib.r(tag_per_step * 1e6, 2),
        # of "attention_us" (one unplanned call): argument validation (shapes/dtypes only),
        # also removed from "off"; within a step, the shared arguments are checked at planning
        "arg_checks_us_per_call": benchlib.r(arg_checks * 1e6, 2),
        # decode's write-side checks, each span timed inside real steps: the generation check of
        # the page each row writes, the OR of the attention plan's flags (its layers') with the
        # write check's, the step's flags read back to the host (each once a step)
        "write_side_in_step_us": {
            k: {side: benchlib.r(us, 2) for side, us in v.items()} for k, v in span_us.items()
        },
        "write_side_check_us_per_step": benchlib.r(write_per_step * 1e6, 2),
        "decode_step_itl": {
            "on": benchlib.summary_ms(steps["on"]),
            "off": benchlib.summary_ms(steps["off"]),
        },
        "decode_step_delta_us": benchlib.r((step_on - step_off) * 1e6, 2),
        "decode_step_overhead_fraction": benchlib.r((step_on - step_off) / step_off),
        "_tag_per_step_s": max(0.0, tag_per_step),
        "_write_per_step_s": max(0.0, write_per_step),
    }


def bench_colocated(w: Workload, n_requests: int, rounds: int) -> dict[str, Any]:
    """Colocated end-to-end generation, the engine's checks on and off (``set_engine_checks``),
    rounds interleaved."""
    prompts = make_prompts(n_requests, w.prompt, w.prompt, seed=1)
    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=w.new, ignore_eos=True)) for p in prompts
    ]
    colo = ColocatedEngine(w.colo.loaded, tokenizer=w.colo.tokenizer, max_batch_size=w.batch)

    def run(on: bool) -> None:
        set_engine_checks(on)
        try:
            colo.generate(reqs)
        finally:
            set_engine_checks(True)

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
    return kernels.page_checksums(pool.kv, page_ids, seeds)


def bench_per_request(w: Workload, reps: int) -> dict[str, Any]:
    """(b) sign and verify, (c) prefill checksum and tail scrub, (d) bookkeeping, (e) page
    ownership checks, each in a loop; and the prefill pass with its generation check on and off,
    the check timed inside the pass (``prefill_gen_check_span``: the lines the off stack
    removes, on, and what it runs instead, off)."""
    refs = w.refs[0]
    assert refs is not None
    secret = b"k" * 32
    m, exp = make_manifest(w, refs, secret)
    n = pages_needed(w.prompt, PAGE_SIZE)
    ids = [r.page_id for r in refs[:n]]

    def checksums(page_ids: list[int], seeds: list[int]) -> list[int]:
        return kernels.page_checksums(w.pool.kv, page_ids, seeds)

    def verify() -> None:
        mf.verify(m, exp, current_generation=w.pool.generation, checksums=checksums,
                  checksum_seed=kernels.checksum_seed)  # fmt: skip

    batch_ids = [r[0].page_id for r in w.refs if r is not None]
    # the decode batcher checks, per row and step, that the row's sequence still owns the page
    # the step writes; the transfer receiver checks a batch's pages once
    index = w.position // PAGE_SIZE
    rows = [(f"b{w.batch}-seq-{i}", [r[index]]) for i, r in enumerate(w.refs) if r is not None]
    owner = f"b{w.batch}-seq-0"
    tail = w.prompt % PAGE_SIZE
    prefill_refs = w.refs[-1]
    prompt = make_prompts(1, w.prompt, w.prompt, seed=2)[0]
    spans: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    prefill_many = {
        on: types.MethodType(
            rewrite(Engine.prefill_many, PREFILL_MANY_EDITS, off=not on, times=spans[on]),
            w.engine,
        )
        for on in (True, False)
    }

    def prefill(on: bool) -> None:
        w.engine.prefill_many = prefill_many[on]  # type: ignore[method-assign]
        try:
            w.engine.prefill(prompt, prefill_refs)  # type: ignore[arg-type]
        finally:
            del w.engine.prefill_many

    times = benchlib.interleaved(
        {
            "sign": lambda: mf.sign(m, secret),
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
            "owns_transfer": lambda: w.pool.owns(owner, refs[:n]),
            "owns_decode_step": lambda: [w.pool.owns(o, r) for o, r in rows],
            "owns_decode_step_1": lambda: [w.pool.owns(o, r) for o, r in rows[:1]],
            "prefill_forward": lambda: prefill(True),
            "prefill_forward_unchecked": lambda: prefill(False),
            "nothing": lambda: None,
        },
        reps,
    )
    med = {k: benchlib.median(v) for k, v in times.items()}
    for on, side in ((True, "on"), (False, "off")):
        med[f"prefill_gen_check_span_{side}"] = benchlib.median(spans[on]["prefill_gen_check"])
        med[f"prefill_hold_span_{side}"] = benchlib.median(spans[on]["prefill_hold"])
    return med


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
    (control plane, prefill, decode) on over off, minus 1; ``decode_rows_per_step``: the mean
    rows of the decode node's steps over the runs (its ``kvfence_decode_step_rows`` metric; both
    stacks serve their metrics), which ``estimate`` shares a step's costs by.

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
        env = {} if a_a else stack_env(report)
        stacks = {
            "on": BenchStack(Path(tmp) / "on", config=METRICS_CONFIG, args=args),
            second: BenchStack(Path(tmp) / second, config=METRICS_CONFIG, args=args, env=env),
        }
        benchlib.log(f"starting two kvfence up stacks: on, and {second}")
        order = [second, "on"] if second_first else ["on", second]
        # one after the other, in that order (it is a knob); stopped at once
        with started([stacks[k] for k in order], at_once=False):
            node_pids = {
                k: {p.pid for role, p in st.services().items() if role != "control-plane"}
                for k, st in stacks.items()
            }
            warm_up(stacks.values(), make_prompts(4, w.prompt, w.prompt), w.new, 4)
            same = _same_tokens(stacks, make_prompts(2, w.prompt, w.prompt, seed=4), w.new)
            metrics = {k: StackMetrics(st) for k, st in stacks.items()}
            for conc in sorted({1, w.batch}):
                n = (2 if quick else 6) * conc if conc > 1 else (4 if quick else 12)
                prompts = make_prompts(n, w.prompt, w.prompt, seed=3)
                benchlib.log(f"stacks: {n} requests at concurrency {conc} x {rounds} rounds")
                runs: dict[str, list[Any]] = {k: [] for k in stacks}
                cpu = {k: CpuMeter(st) for k, st in stacks.items()}
                for m in metrics.values():
                    m.used.clear()
                for k in benchlib.turns(list(stacks), rounds, seed=conc):
                    st = stacks[k]
                    # metrics scraped outside the CPU span (as e2e.py reads them)
                    with metrics[k].measure():
                        runs[k].append(
                            run_load(
                                st.target, st.api_key, prompts, w.new, conc, during=cpu[k].measure
                            )
                        )
                out[str(conc)] = _stack_sides(runs, cpu, metrics, n)
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


def _stack_sides(
    runs: dict[str, list[Any]],
    cpu: dict[str, CpuMeter],
    metrics: dict[str, StackMetrics],
    n: int,
) -> dict[str, Any]:
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
            "decode_rows_per_step": metrics[k].decode_rows_per_step(),
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
        "decode": (
            "unchecked_attention_plans",
            "decode_write_checks_skipped",
            "decode_flag_reads_skipped",
            "owns_checks_skipped",
            "manifest_verifications_skipped",
            "begin_ops_skipped",
        ),
        "prefill": (
            "prefill_generation_checks_skipped",
            "page_checksums_skipped",
            "manifest_signatures_skipped",
            "begin_ops_skipped",
        ),
    }
    missing = [
        f"{role}.{k}" for role, ks in want.items() for k in ks if not calls.get(role, {}).get(k)
    ]
    if missing:
        raise RuntimeError(f"the protections-off stack did not run its patches: {missing}")


def per_step_at(rows: float, batch: int, at_1: float, at_batch: float) -> float:
    """A per-step cost at ``rows`` rows a step, linear between its values timed at 1 row and at
    ``batch`` rows (steps under load carry fewer rows than the concurrency: see estimate)."""
    if batch == 1:
        return at_1
    x = min(max(rows, 1.0), float(batch))
    return at_1 + (at_batch - at_1) * (x - 1.0) / (batch - 1)


def estimate(
    new: int,
    checks: dict[int, dict[str, Any]],
    per_req: dict[str, float],
    batch: int,
    rows: float,
) -> dict[str, float]:
    """Protection seconds per request at concurrency ``batch``, where the decode node's steps
    carried ``rows`` rows on average (measured on the on stack): every decode step's costs, at
    that many rows, are shared by its rows. Costs timed per step (the tag check, the write-side
    checks, the pool's bookkeeping and ownership checks of a step's pages) are timed at 1 row and
    at ``batch`` rows, and taken at ``rows`` by :func:`per_step_at`."""
    nothing = per_req["nothing"]
    loop = {k: max(0.0, v - nothing) for k, v in per_req.items()}
    steps = new - 1  # the first token comes from prefill

    def decode_steps(at_1: float, at_batch: float) -> float:
        return steps * per_step_at(rows, batch, at_1, at_batch) / rows

    def timed(key: str) -> float:
        return decode_steps(checks[1][key], checks[batch][key])

    return {
        "tag_check": timed("_tag_per_step_s"),
        "write_side_check": timed("_write_per_step_s"),
        "page_owns_check": loop["owns_transfer"]
        + decode_steps(loop["owns_decode_step_1"], loop["owns_decode_step"]),
        "manifest_sign": loop["sign"],
        "manifest_verify": loop["verify"],
        "prefill_checksum": loop["prefill_checksum"],
        # the check, and the pass's count on the pages it writes that makes the check last it
        "prefill_generation_check": max(
            0.0,
            per_req["prefill_gen_check_span_on"]
            - per_req["prefill_gen_check_span_off"]
            + per_req["prefill_hold_span_on"]
            - per_req["prefill_hold_span_off"],
        ),
        "tail_scrub": loop["tail_scrub"],
        "deferred_release_ops": loop["ops_transfer"]
        + decode_steps(loop["ops_decode_step_1"], loop["ops_decode_step"]),
    }


def tokens_per_s_off(tokens_per_s: float, e2e: float, total: float) -> dict[str, Any]:
    """The on stack's tokens/s were every protection's estimated cost taken out of each request's
    time; null, with the reason, when that cost is not below the request's time (the in-process
    timings and the stack's then do not fit together: a --quick run's few repetitions, or a
    noisy moment), where the formula would divide by nothing."""
    if total >= e2e:
        return {
            "estimated_tokens_per_s_off": None,
            "estimated_tokens_per_s_off_null_because": (
                f"the estimated cost ({total * 1e6:.0f} µs a request) is not below the on "
                f"stack's time per request ({e2e * 1e6:.0f} µs)"
            ),
        }
    return {"estimated_tokens_per_s_off": benchlib.r(tokens_per_s * e2e / (e2e - total), 1)}


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
    ap.add_argument("--new", type=int, help="new tokens per request (default 64, quick 32)")
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
    reps = 10 if args.quick else 300
    if args.new is None:
        args.new = 32 if args.quick else 64
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
    benchlib.log("decode checks: attention and decode steps")
    per_batch = {b: Workload(colo, args.prompt, args.new, b) for b in sorted({1, args.batch})}
    checks = {b: bench_decode_checks(w, reps) for b, w in per_batch.items()}
    w = per_batch[args.batch]
    benchlib.log("manifest, checksum, scrub, bookkeeping, ownership, prefill's check")
    per_req = bench_per_request(w, reps)
    benchlib.log("colocated end to end, engine checks on/off")
    # --quick: one full batch, one round (with bench_colocated's warm-up: two runs on, two off)
    colocated = bench_colocated(
        w, args.batch if args.quick else 6 * args.batch, 1 if args.quick else 6
    )
    stack = bench_stacks(w, model, args.quick, second_first=args.second_first)

    views = {}
    for name, b in (("latency_view", 1), ("throughput_view", args.batch)):
        s = stack[str(b)]["on"]
        rows = s["decode_rows_per_step"]
        if not rows:
            raise RuntimeError(f"the on stack's decode node reported no steps at concurrency {b}")
        cost = estimate(args.new, checks, per_req, b, rows)
        e2e = s["mean_latency_s"] if b == 1 else s["seconds_per_request"]
        total = sum(cost.values())
        views[name] = {
            "concurrency": b,
            "decode_rows_per_step": rows,
            "per_request_us": {k: benchlib.r(v * 1e6, 2) for k, v in cost.items()},
            "total_us": benchlib.r(total * 1e6, 2),
            "e2e_seconds_per_request": benchlib.r(e2e, 5),
            "fraction_of_e2e": benchlib.r(total / e2e, 5),
            **tokens_per_s_off(s["tokens_per_s"], e2e, total),
        }
    for t in checks.values():
        t.pop("_tag_per_step_s")
        t.pop("_write_per_step_s")
    fractions = [v["fraction_of_e2e"] for v in views.values()]
    levels = [str(b) for b in sorted({1, args.batch})]
    cpu_overhead = {c: stack[c]["cpu_overhead_fraction"] for c in levels}
    tps_overhead = {c: stack[c]["overhead_fraction"] for c in levels}
    result = {
        "benchmark": "isolation_overhead",
        "quick": args.quick,
        "machine": benchlib.machine(),
        "workload": workload,
        "decode_checks": {str(b): t for b, t in checks.items()},
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
