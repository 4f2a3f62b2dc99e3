"""Run a script of Triton launcher calls under the Triton interpreter, in a process of its own (a
test helper): the interpreter is chosen when triton is first imported, so the pytest process never
imports triton in interpreter mode.

``run_interpreted(script, jobs, tmp)`` saves ``jobs`` to ``tmp/cases.pt``, runs ``script`` (Python
source, dedented, as ``python -c script CASES.pt OUT.pt``; or a Path, a script file run as
``python FILE CASES.pt OUT.pt``) with ``TRITON_INTERPRET=1`` and the repository on the path, and
returns what the script saved to ``OUT.pt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(script: str | Path, jobs: Any, tmp: Path, timeout: float = 180) -> Any:
    torch.save(jobs, tmp / "cases.pt")
    program = [str(script)] if isinstance(script, Path) else ["-c", textwrap.dedent(script)]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        TRITON_INTERPRET="1",
    )
    proc = subprocess.run(
        [sys.executable, *program, tmp / "cases.pt", tmp / "out.pt"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-4000:]}"
    return torch.load(tmp / "out.pt")
