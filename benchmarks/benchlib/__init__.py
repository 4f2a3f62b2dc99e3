"""Helpers shared by the benchmark scripts (not a benchmark itself: ``make bench`` runs only the
top-level ``benchmarks/*.py``).

Every script prints one JSON object on stdout and nothing else there; progress goes to stderr.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
# The repository before this folder: ``benchmarks/kernels.py`` must not shadow the kernels package.
if sys.path[:1] != [str(REPO)]:
    sys.path.insert(0, str(REPO))
# Before anything imports ucxx: TCP on loopback works on every machine; HF never downloads.
os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MACHINE_NOTE = "shared, noisy"
T = TypeVar("T")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # SIGTERM's default action ends the script at once, skipping the ``with BenchStack(...)``
    # exit that stops its ``kvfence up``: the stack was left running (seen). Exit as Ctrl-C does.
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _exit_on_sigterm)


def log(msg: str) -> None:
    """Progress for humans, on stderr (stdout carries the one JSON object)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summary_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    """p50/p99/mean of latencies given in seconds, as milliseconds."""
    return {
        "n": len(seconds),
        "p50_ms": round(percentile(seconds, 50) * 1e3, 3),
        "p99_ms": round(percentile(seconds, 99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(seconds) * 1e3, 3) if seconds else math.nan,
    }


def turns(names: Sequence[T], rounds: int, seed: int) -> Iterator[T]:
    """Every name once per round, ``rounds`` times, so that a noisy shared machine slows every
    variant alike.

    Rounds are the rows of Latin squares over a seeded order of the names: in any ``n`` rounds
    in a row (``n`` names) each name takes each position once, so none runs first (or last)
    round after round; with a fixed seed a fresh shuffle every round left one always first in
    some runs (``interleaved`` and the stack comparisons use this with as few as 3 rounds). The
    squares alternate direction, every ``n`` rounds, so no name always runs right after the same
    other one either (and pays for its after-effects: a copy's intra-op threads still spinning,
    a forward pass that flushed the caches)."""
    base = list(names)
    rng = random.Random(seed)
    rng.shuffle(base)
    n = len(base)
    if n == 0:
        return
    squares = []
    for order in (base, base[::-1]):
        rows = [order[i:] + order[:i] for i in range(n)]
        rng.shuffle(rows)
        squares.extend(rows)
    for r in range(rounds):
        yield from squares[r % len(squares)]


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, sync: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each function, taking :func:`turns` every repetition (after one
    warm-up call each). ``sync`` (a device synchronisation) runs before and after each timed
    call, outside nothing but the clock."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in turns(list(fns), reps, seed=len(fns)):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fns[name]()
        if sync is not None:
            sync()
        times[name].append(time.perf_counter() - t0)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine() -> dict[str, Any]:
    """What ran the benchmark: core count, CPU model, and that it is shared."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "note": MACHINE_NOTE,
    }


def emit(
    result: dict[str, Any],
    png: Path | None = None,
    draw: Callable[[dict[str, Any], Path], None] | None = None,
) -> None:
    """A script's output: with ``png`` (its ``--png``), ``draw`` it there first and name it in the
    result; then the result as the one JSON line on stdout."""
    if png is not None and draw is not None:
        draw(result, png)
        result["png"] = str(png)
    print(json.dumps(result))


def pyplot(png: Path) -> Any:
    """matplotlib's pyplot on the Agg backend, or exit saying why ``--png`` cannot work."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--png needs matplotlib, which is not installed ({exc})") from exc
    png.parent.mkdir(parents=True, exist_ok=True)
    return plt


def plot_by_concurrency(
    path: Path,
    levels: Sequence[dict[str, Any]],
    names: Sequence[str],
    panels: Sequence[tuple[str, Callable[[dict[str, Any]], float]]],
) -> None:
    """Charts side by side over concurrency (log2 axis), one line per name in ``names``; each
    panel is a y label and what to plot of a level's entry for a name (``level[name]``)."""
    plt = pyplot(path)
    xs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (label, value) in zip(axes[0], panels, strict=True):
        for name in names:
            ax.plot(xs, [value(lv[name]) for lv in levels], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def r(x: float, digits: int = 4) -> float:
    """Round for JSON; keeps nan/inf out (JSON has neither) by mapping them to -1."""
    if x is None or not math.isfinite(x):
        return -1.0
    return round(x, digits)
