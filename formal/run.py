#!/usr/bin/env python3
"""Build and run the SPIN verifier for formal/kvfence.pml and its mutants.

Each variant is the same model compiled with different `-D` switches. For every variant this
script runs `spin -a`, compiles `pan.c` with gcc and runs `./pan` (exhaustive, safety only:
assertions and invalid end states), all in a scratch directory so no pan* files land in the
repository. The real model must finish a complete search with no error; every mutant (and the
witness, which asserts that the dangerous-but-safe path cannot happen) must be refuted, with the
violated assertion naming the expected property. Standard library only.

    python3 formal/run.py                 # all variants, a table, exit 1 on any surprise
    python3 formal/run.py --keep out/     # keep the build dirs and trails (replay them)
    python3 formal/run.py --json          # machine-readable results
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).resolve().with_name("kvfence.pml")

P1 = "P1_isolation"
P2 = "P2_no_free_while_write_outstanding"
P3 = "P3_only_verified_enter_decode"
P4 = "P4_pool_drained"
P5 = "P5_terminal_never_resumed"
WITNESS = "WITNESS_late_write_page_reused"
W_DECODE_RELEASE = "WITNESS_release_during_decode_write"
W_DUPLICATE_DECODE = "WITNESS_duplicate_decode_while_decoding"
W_POST_AFTER_RELEASE = "WITNESS_post_after_release_and_reserve"
TAGS = (P1, P2, P3, P4, P5, WITNESS, W_DECODE_RELEASE, W_DUPLICATE_DECODE, W_POST_AFTER_RELEASE)
INVALID_END = "invalid_end_state"

MAX_DEPTH = 10_000  # the real model needs < 100; pan says so if this is ever too small
MEMLIM_MB = 1024  # a search that needs more is reported as truncated, not as a pass
# -O0: compiling pan.c is most of a variant's CPU (measured: gcc -O2 3.2 s, -O0 0.8 s per
# variant), and the searches are short (pan -O0 1.6 s for the real model, 0.7 s at -O2)
PAN_CFLAGS = ["-O0", "-w", "-DSAFETY", f"-DMEMLIM={MEMLIM_MB}"]
TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compilation of the model: its -D switches and the outcome it must have."""

    name: str
    defines: tuple[str, ...]
    expect: str | None  # None: no error in a complete search; else the violated property tag
    about: str


VARIANTS: tuple[Variant, ...] = (
    Variant("model", (), None, "the protocol as DESIGN.md specifies it"),
    Variant(
        "witness",
        ("WITNESS",),
        WITNESS,
        "non-vacuity: a page hit by a late write after an abort is later read, safely",
    ),
    Variant(
        "mutant_placeholder",
        ("MUTANT_PLACEHOLDER",),
        P3,
        "rejected request runs a 1-token placeholder; decode skips count/coverage",
    ),
    Variant(
        "mutant_placeholder_no_p3",
        ("MUTANT_PLACEHOLDER", "NO_P3"),
        P1,
        "same, P3 not asserted: decode reads pages its prefill never wrote",
    ),
    Variant(
        "mutant_placeholder_cp_only",
        ("MUTANT_PLACEHOLDER_CP_ONLY",),
        None,
        "only the control-plane bug: decode's count/coverage check still stops it",
    ),
    Variant(
        "mutant_no_count_check",
        ("MUTANT_NO_COUNT_CHECK",),
        P1,
        "only the decode bug: a prefill that truncates its page list breaks isolation",
    ),
    Variant(
        "mutant_release_on_timeout",
        ("MUTANT_RELEASE_ON_TIMEOUT",),
        P2,
        "decode frees pages on timeout while a cancelled receive may still land",
    ),
    Variant(
        "mutant_release_on_timeout_no_p2",
        ("MUTANT_RELEASE_ON_TIMEOUT", "NO_P2"),
        P1,
        "same, P2 not asserted: the late write lands in another tenant's verified page",
    ),
    Variant(
        "mutant_leak_quarantine",
        ("MUTANT_LEAK_QUARANTINE",),
        P4,
        "quarantined pages are never released: the pool does not drain",
    ),
    # The control plane logs and forgets a failed Release, so decode's own timeouts (the
    # per-batch timeout, the reaper) are what give a reservation back when that Release is lost.
    Variant(
        "mutant_no_decode_timeout",
        ("MUTANT_NO_DECODE_TIMEOUT",),
        P4,
        "decode never times out a transfer or reaps a reservation itself: a lost Release "
        "leaves the reservation's pages held for good",
    ),
    Variant(
        "mutant_cp_resumes_terminal",
        ("MUTANT_CP_RESUMES_TERMINAL",),
        P5,
        "cp_to moves a request that is already terminal (a cancelled request then FAILED)",
    ),
    # Decoding as a state of its own: a decode step's KV write is an outstanding operation
    # (begin_ops ... end_ops), and a Release, an abort, a duplicate Decode or the stream ending
    # can come at any point of it.
    Variant(
        "witness_decode_release",
        ("WITNESS_DECODE_RELEASE",),
        W_DECODE_RELEASE,
        "non-vacuity: a Release lands while a decode step's write into the request's page is "
        "outstanding (the page is freed by that step's end_ops)",
    ),
    Variant(
        "witness_duplicate_decode",
        ("WITNESS_DUPLICATE_DECODE",),
        W_DUPLICATE_DECODE,
        "non-vacuity: a duplicate Decode arrives while the first one's sequence decodes",
    ),
    Variant(
        "mutant_release_ignores_ops",
        ("MUTANT_RELEASE_IGNORES_OPS",),
        P2,
        "release frees a page at once although a decode step's write into it is outstanding",
    ),
    Variant(
        "mutant_release_ignores_ops_no_p2",
        ("MUTANT_RELEASE_IGNORES_OPS", "NO_P2"),
        P1,
        "same, P2 not asserted: the late decode write lands in the other tenant's page",
    ),
    Variant(
        "mutant_add_after_release",
        ("MUTANT_ADD_AFTER_RELEASE",),
        P3,
        "the Decode stream adds its sequence although its reservation was released",
    ),
    Variant(
        "mutant_add_after_release_no_p3",
        ("MUTANT_ADD_AFTER_RELEASE", "NO_P3"),
        None,
        "same, P3 not asserted: the batcher's ownership check at claim stops it (defence in depth)",
    ),
    # Decode posts a batch's receives only after the hello and the batch header (awaits), so a
    # Release and a Reserve of the same pages by another request can come in between.
    Variant(
        "witness_post_after_release",
        ("WITNESS_POST_AFTER_RELEASE",),
        W_POST_AFTER_RELEASE,
        "non-vacuity: the transfer handler resumes to post a batch whose reservation was "
        "released and whose page another request has reserved (the check refuses it)",
    ),
    Variant(
        "mutant_post_after_release",
        ("MUTANT_POST_AFTER_RELEASE",),
        P2,
        "the transfer handler posts a batch's receives without re-checking that the transfer "
        "still receives and owns its pages, and the Release's endpoint abort did not take effect",
    ),
    Variant(
        "mutant_post_after_release_no_p2",
        ("MUTANT_POST_AFTER_RELEASE", "NO_P2"),
        P1,
        "same, P2 not asserted: the released transfer's page lands in the next owner's page",
    ),
)


@dataclasses.dataclass
class Result:
    """What one pan run reported, parsed."""

    variant: str
    expect: str | None
    errors: int | None = None
    violated: str | None = None  # property tag of the first error, or INVALID_END
    violation_text: str | None = None
    states_stored: int | None = None
    transitions: int | None = None
    depth: int | None = None
    state_vector_bytes: int | None = None
    complete: bool = False  # full (not bitstate) search that was not cut short
    problems: list[str] = dataclasses.field(default_factory=list)
    pan_seconds: float | None = None
    total_seconds: float = 0.0
    replay_tag: str | None = None  # property named by `spin -t` replaying the trail
    replay_line: int | None = None  # model line of the failed assertion, from the replay
    trail: str | None = None
    workdir: str | None = None

    @property
    def ok(self) -> bool:
        """True when the run had exactly the outcome the variant must have."""
        if self.expect is None:
            return self.complete and self.errors == 0 and not self.problems
        found = (self.errors or 0) >= 1
        return found and self.violated == self.expect and self.replay_tag == self.expect


class ToolMissing(RuntimeError):
    """spin or gcc is not installed."""


def require_tools() -> None:
    """Raise ToolMissing with an install hint if spin or gcc is absent."""
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        raise ToolMissing(
            f"{' and '.join(missing)} not found on PATH: the formal model needs SPIN and a C "
            "compiler (`make system-deps` runs `apt-get install spin`; gcc comes with "
            "build-essential)"
        )


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def _int(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return int(float(match.group(1))) if match else None


def _tag(text: str) -> str | None:
    for tag in TAGS:
        if tag in text:
            return tag
    return None


def parse_pan(output: str, result: Result) -> None:
    """Fill result from pan's report."""
    result.errors = _int(r"errors: (\d+)", output)
    result.states_stored = _int(r"([\d.e+]+) states, stored", output)
    result.transitions = _int(r"([\d.e+]+) transitions \(= stored\+matched\)", output)
    result.depth = _int(r"depth reached (\d+)", output)
    result.state_vector_bytes = _int(r"State-vector (\d+) byte", output)
    result.pan_seconds = (
        float(m.group(1)) if (m := re.search(r"elapsed time ([\d.e+]+)", output)) else None
    )
    first = re.search(r"^pan:1: (.*)$", output, re.MULTILINE)
    if first:
        result.violation_text = first.group(1)
        if "invalid end state" in first.group(1):
            result.violated = INVALID_END
        else:
            result.violated = _tag(first.group(1))
    if "max search depth too small" in output:
        result.problems.append("max search depth too small (raise MAX_DEPTH)")
    if "MEMLIM" in output or "out of memory" in output:
        result.problems.append(f"ran out of memory (MEMLIM={MEMLIM_MB} MB)")
    if "Full statespace search" not in output:
        result.problems.append("not a full state-space search")
    if result.errors is None:
        result.problems.append("no pan summary line")
    result.complete = not result.problems


def run_variant(variant: Variant, workroot: Path) -> Result:
    """Generate, compile and run one variant in workroot/<name>; replay its trail if any."""
    require_tools()
    work = workroot / variant.name
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL, work / MODEL.name)
    result = Result(variant=variant.name, expect=variant.expect, workdir=str(work))
    dflags = [f"-D{d}" for d in variant.defines]
    start = time.monotonic()
    steps = (
        ["spin", *dflags, "-a", MODEL.name],
        ["gcc", *PAN_CFLAGS, "-o", "pan", "pan.c"],
        ["./pan", f"-m{MAX_DEPTH}"],
    )
    output = ""
    for cmd in steps:
        proc = _run(cmd, work)
        output = proc.stdout + proc.stderr
        (work / f"{Path(cmd[0]).name}.log").write_text(output)
        if proc.returncode != 0 and cmd[0] != "./pan":
            result.problems.append(f"{' '.join(cmd)} failed: {output.strip()[-2000:]}")
            result.total_seconds = time.monotonic() - start
            return result
    parse_pan(output, result)
    trail = work / f"{MODEL.name}.trail"
    if trail.exists():
        result.trail = str(trail)
        replay = _run(["spin", *dflags, "-t", "-p", "-g", MODEL.name], work)
        text = replay.stdout + replay.stderr
        (work / "replay.txt").write_text(text)
        failed = re.search(r"text of failed assertion: (.*)", text)
        result.replay_tag = _tag(failed.group(1)) if failed else None
        if "invalid end state" in text:
            result.replay_tag = result.replay_tag or INVALID_END
        line = re.search(rf"spin: {re.escape(MODEL.name)}:(\d+), Error", text)
        result.replay_line = int(line.group(1)) if line else None
    result.total_seconds = time.monotonic() - start
    return result


def run_all(workroot: Path, names: list[str] | None = None) -> list[Result]:
    """Run every variant (or those named) under workroot, one per CPU at a time (each in its own
    directory; spin, gcc and pan are separate processes, so threads suffice). In VARIANTS
    order."""
    chosen = [v for v in VARIANTS if names is None or v.name in names]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, cpus or 1)) as pool:
        return list(pool.map(lambda v: run_variant(v, workroot), chosen))


def _short(tag: str | None) -> str:
    return "none" if tag is None else tag.split("_", 1)[0]


def report(results: list[Result]) -> str:
    """A table of results, one line per variant."""
    head = f"{'variant':34} {'expect':8} {'got':8} {'states':>10} {'depth':>6} {'time':>7}  verdict"
    lines = [head, "-" * len(head)]
    for r in results:
        got = _short(r.violated) if r.errors else ("none" if r.errors == 0 else "?")
        verdict = "OK" if r.ok else "FAIL " + "; ".join(r.problems)
        lines.append(
            f"{r.variant:34} {_short(r.expect):8} {got:8} {r.states_stored or 0:>10} "
            f"{r.depth or 0:>6} {r.total_seconds:>6.1f}s  {verdict}"
        )
        if r.errors:
            lines.append(f"    first error: {r.violation_text}")
            if r.trail:
                lines.append(f"    trail: {r.trail} (model line {r.replay_line})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build in this directory and keep it")
    parser.add_argument("--only", nargs="+", choices=[v.name for v in VARIANTS])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args(argv)
    try:
        require_tools()
    except ToolMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = run_all(args.keep.resolve(), args.only)
    else:
        with tempfile.TemporaryDirectory(prefix="kvfence-spin-") as tmp:
            results = run_all(Path(tmp), args.only)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        print(report(results))
        print(f"total {time.monotonic() - start:.1f}s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
