"""The benchmark's protections-off nodes (``benchmarks/benchlib/unprotected.py``): its
sitecustomize patches a ``kvfence serve prefill|decode`` process that has the report variable,
and leaves every other process as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "benchmarks" / "benchlib" / "unprotected_site"

PROBE = """
import json, sys
import kernels
import kvfence.model.engine as engine_mod
from kvfence import manifest
from kvfence.kv.pool import PagePool
print(json.dumps({
    "loaded": "kvfence_bench_unprotected" in sys.modules,
    "plan": engine_mod.kernels.plan_decode_attention.__name__,
    "verify_replaced": manifest.verify.__name__ == "replacement",
    "begin_ops_replaced": PagePool.begin_ops.__name__ == "replacement",
    "checksum_replaced": kernels.page_checksum.__name__ == "replacement",
}))
if manifest.verify.__name__ == "replacement":
    manifest.verify(None, None)
    PagePool.begin_ops(None, [1])
"""


def probe(tmp_path: Path, *argv: str, report: bool = True) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SITE)}
    env.pop("KVFENCE_BENCH_UNPROTECTED_REPORT", None)
    if report:
        env["KVFENCE_BENCH_UNPROTECTED_REPORT"] = str(tmp_path / "report.jsonl")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(proc.stdout)


def test_a_node_process_runs_unprotected_and_reports_its_calls(tmp_path):
    seen = probe(tmp_path, "serve", "decode")
    assert seen == {
        "loaded": True,
        "plan": "CountedUncheckedPlan",
        "verify_replaced": True,
        "begin_ops_replaced": True,
        "checksum_replaced": True,
    }
    [line] = (tmp_path / "report.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert rec["role"] == "decode"
    assert rec["calls"] == {"manifest_verifications_skipped": 1, "begin_ops_skipped": 1}


def test_other_processes_keep_every_protection(tmp_path):
    controls = {
        "not a node": probe(tmp_path, "serve", "control-plane"),
        "no report variable": probe(tmp_path, "serve", "decode", report=False),
    }
    for why, seen in controls.items():
        assert seen == {
            "loaded": False,
            "plan": "plan_decode_attention",
            "verify_replaced": False,
            "begin_ops_replaced": False,
            "checksum_replaced": False,
        }, why
    assert not (tmp_path / "report.jsonl").exists()
