"""``benchmarks/kernels.py --quick`` runs and prints one JSON object of the documented shape."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kernels.py"


def run_bench(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_quick_run_prints_one_json_object(tmp_path):
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    png = tmp_path / "kernels.png"
    proc = run_bench("--png", str(png))
    if not has_mpl:
        # Without matplotlib the run must fail with a message that says why.
        assert proc.returncode != 0
        assert "--png needs matplotlib" in proc.stderr
        proc = run_bench()
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["benchmark"] == "kernels" and result["path"] == "torch-reference"
    pages = result["pages"]
    assert set(pages["gb_per_s"]) == {"copy", "checksum", "scrub", "write"}
    assert set(pages["ratio_to_copy"]) == {"checksum", "scrub", "write"}
    assert pages["checksum_goal_ratio"] == 0.25
    assert isinstance(pages["checksum_goal_met"], bool)
    assert all(v > 0 for v in pages["gb_per_s"].values())
    assert set(result["attention"]["seconds"]) == {"paged", "sdpa_dense"}
    assert png.exists() == has_mpl
