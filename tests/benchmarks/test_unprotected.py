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
from kvfence.model.engine import DecodeBatch, Engine
print(json.dumps({
    "loaded": "kvfence_bench_unprotected" in sys.modules,
    "plan": engine_mod.kernels.plan_decode_attention.__name__,
    "verify_replaced": manifest.verify.__name__ == "replacement",
    "begin_ops_replaced": PagePool.begin_ops.__name__ == "replacement",
    "checksum_replaced": kernels.page_checksum.__name__ == "replacement",
    "owns_replaced": PagePool.owns.__name__ == "replacement",
    "decode_rows_replaced": Engine.decode_rows.__name__ == "replacement",
    "step_and_sample_replaced": DecodeBatch.step_and_sample.__name__ == "replacement",
    "prefill_many_replaced": Engine.prefill_many.__name__ == "replacement",
}))
if manifest.verify.__name__ == "replacement":
    manifest.verify(None, None)
    PagePool.begin_ops(None, [1])
"""


REPLACED = (
    "verify_replaced",
    "begin_ops_replaced",
    "checksum_replaced",
    "owns_replaced",
    "decode_rows_replaced",
    "step_and_sample_replaced",
    "prefill_many_replaced",
)


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
        **{k: True for k in REPLACED},
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
            **{k: False for k in REPLACED},
        }, why
    assert not (tmp_path / "report.jsonl").exists()


# The engine's methods as the off stack runs them (``rewrite``): the same tokens as the shipped
# ones, but a step whose page changed owner is no longer caught (the check is really gone); the
# timed copies clock the edited lines; and an edit whose lines are not in the method fails.
REWRITE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("unprotected", sys.argv[1])
u = importlib.util.module_from_spec(spec)
spec.loader.exec_module(u)
import torch
from kvfence.model.colocated import ColocatedEngine
from kvfence.model.engine import DecodeBatch, Engine
from kvfence.model.sampling import SamplingParams
from kvfence.model.tiny import ensure_tiny_model

colo = ColocatedEngine.from_path(ensure_tiny_model(), page_size=16, num_pages=64)
eng, pool = colo.engine, colo.pool
refs = [pool.allocate(12, f"s{i}") for i in range(3)]
prompt = list(range(1, 121))
out = {}
spans = {}
shipped = Engine.prefill_many(eng, [prompt], [refs[0]])[0]
unchecked = u.rewrite(Engine.prefill_many, u.PREFILL_MANY_EDITS)(eng, [prompt], [refs[0]])[0]
timed = u.rewrite(Engine.prefill_many, u.PREFILL_MANY_EDITS, off=False, times=spans)
out["prefill_same"] = torch.equal(shipped, unchecked) and torch.equal(
    shipped, timed(eng, [prompt], [refs[0]])[0])

rows_off = u.rewrite(Engine.decode_rows, u.DECODE_ROWS_EDITS, times=spans)
sample_off = u.rewrite(DecodeBatch.step_and_sample, u.STEP_AND_SAMPLE_EDITS)
batch = DecodeBatch(eng)
batch.sync(refs)
args = ([7] * 3, [130] * 3, [SamplingParams()] * 3, [0] * 3)

def both():
    on = batch.step_and_sample(*args)
    eng.decode_rows = rows_off.__get__(eng)
    try:
        return on, sample_off(batch, *args)
    finally:
        del eng.decode_rows

out["decode"] = both()
pool.release("s1")
pool.allocate(12, "another tenant")
out["decode_after_release"] = both()
out["spans"] = {k: len(v) for k, v in sorted(spans.items())}
try:
    u.rewrite(Engine.decode_rows, [("x", ["no such line"], [])])
except RuntimeError as err:
    out["missing"] = str(err)
print(json.dumps(out))
"""


def test_rewritten_engine_methods_drop_the_checks_and_nothing_else():
    proc = subprocess.run(
        [sys.executable, "-c", REWRITE, str(SITE.parent / "unprotected.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["prefill_same"] is True
    shipped, unchecked = out["decode"]
    assert shipped == unchecked and None not in shipped
    shipped, unchecked = out["decode_after_release"]
    assert shipped[1] is None and None not in unchecked  # only the shipped step caught it
    assert shipped[0] == unchecked[0] and shipped[2] == unchecked[2]
    # one timed prefill pass; two timed unchecked decode steps, each clocking its write span
    # and its flags span (the plan's flags ORed with the write check's, made constant) once, and
    # the pass's count on the pages it writes (Engine._hold) once
    assert out["spans"] == {
        "flags_or": 2,
        "prefill_gen_check": 1,
        "prefill_hold": 1,
        "write_check": 2,
        "write_hold": 2,
    }
    assert "'x'" in out["missing"] and "0 times" in out["missing"]
