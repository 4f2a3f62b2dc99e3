"""The benchmarks' order of turns (``benchlib.turns``): every variant in every position equally
often, so that a position effect cannot lean a comparison one way run after run, and no variant
always runs right after the same other one.

The orders are computed in a subprocess: importing the benchmark's ``benchlib`` sets a
benchmark script's signal handling and environment, which this test process must not take."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

ORDERS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from benchlib import turns
print(json.dumps({
    "two": {s: list(turns(["on", "off"], 8, s)) for s in (1, 8, 123)},
    "three": {s: list(turns(["a", "b", "c"], 3, s)) for s in (1, 16, 64)},
    "three_x2": list(turns(["a", "b", "c"], 6, 16)),
    "one_round": list(turns(["on", "off"], 1, 1)),
}))
"""


def _orders() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ORDERS, str(BENCH)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def _positions(seq: list[str], n: int) -> Counter[tuple[str, int]]:
    return Counter((name, i % n) for i, name in enumerate(seq))


def test_every_variant_takes_every_position_equally_often():
    orders = _orders()
    for seq in orders["two"].values():  # isolation_overhead's two stacks, eight rounds
        assert all({seq[i], seq[i + 1]} == {"on", "off"} for i in range(0, 16, 2))
        assert _positions(seq, 2) == Counter({(k, p): 4 for k in ("on", "off") for p in (0, 1)})
    for seq in orders["three"].values():  # e2e, stream_interval, prefill_batching: 3 rounds
        # (a fresh shuffle a round once left one variant first in all three, with these seeds)
        assert _positions(seq, 3) == Counter({(k, p): 1 for k in "abc" for p in range(3)})
    assert len(orders["one_round"]) == 2 and set(orders["one_round"]) == {"on", "off"}


def test_no_variant_always_follows_the_same_one():
    seq = _orders()["three_x2"]
    before: dict[str, set[str]] = {k: set() for k in "abc"}
    for prev, cur in itertools.pairwise(seq):
        before[cur].add(prev)
    assert all(len(p) >= 2 for p in before.values()), before
    assert _positions(seq, 3) == Counter({(k, p): 2 for k in "abc" for p in range(3)})
