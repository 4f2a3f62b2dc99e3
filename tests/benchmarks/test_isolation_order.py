"""isolation_overhead's order of turns between its two stacks: each stack first in half the
rounds, so that a position effect cannot lean the comparison one way run after run.

The orders are computed in a subprocess: importing the benchmark's ``benchlib`` sets a
benchmark script's signal handling and environment, which this test process must not take."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

ORDERS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from isolation_overhead import _balanced_turns as balanced
from benchlib import turns
print(json.dumps({
    "balanced": {s: list(balanced(["on", "off"], 8, s)) for s in (1, 8, 123)},
    "one_round": list(balanced(["on", "off"], 1, 1)),
    "turns": list(turns(["on", "off"], 8, seed=1)),
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


def _firsts(seq: list[str]) -> dict[str, int]:
    return {k: sum(1 for i in range(0, len(seq), 2) if seq[i] == k) for k in ("on", "off")}


def test_each_stack_goes_first_in_half_the_rounds():
    orders = _orders()
    for seq in orders["balanced"].values():
        assert len(seq) == 16
        assert all({seq[i], seq[i + 1]} == {"on", "off"} for i in range(0, 16, 2))
        assert _firsts(seq) == {"on": 4, "off": 4}
    assert orders["one_round"] == ["on", "off"]
    # The control: ``benchlib.turns`` (a new random order every round), which the stacks took
    # before, gives the second stack six first turns of eight at concurrency 1's seed.
    assert _firsts(orders["turns"]) == {"on": 2, "off": 6}
