"""The control plane never runs the model, so importing it must not load torch (seconds of start-up
and hundreds of MB of memory per process): what it shares with the nodes (stop strings,
detokenization) lives in torch-free modules (kvfence.model.stops, kvfence.detok).

Each check imports in a fresh interpreter: this test process has long loaded torch for others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What `kvfence serve control-plane` runs (kvfence.cli.stack imports serve from it).
CONTROL_PLANE_ENTRY = "control_plane.service"
# A node's service: it runs the model, so torch is there when imported.
DECODE_ENTRY = "decode_svc.service"

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps({m: m in sys.modules for m in ("torch", "numpy")}))
"""


def loaded_after_import(module: str) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_control_plane_import_loads_no_torch() -> None:
    loaded = loaded_after_import(CONTROL_PLANE_ENTRY)
    assert loaded["torch"] is False
    # numpy only came in with torch: nothing in the control plane needs it either.
    assert loaded["numpy"] is False


@pytest.mark.timeout(180)
def test_probe_sees_torch_where_it_is_imported() -> None:
    # Positive control: the same probe reports torch for a module that does import it.
    assert loaded_after_import(DECODE_ENTRY)["torch"] is True
