"""Dispatch and import hygiene, each in a fresh interpreter so this process stays untouched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CPU_CALLS = """
import torch
import kernels
kv = torch.randn(4, 1, 2, 16, 1, 32)
gen = torch.zeros(4, dtype=torch.int64)
out, err = kernels.paged_decode_attention(
    torch.randn(1, 2, 32), kv, 0, torch.tensor([[1]], dtype=torch.int32),
    torch.zeros(1, 1, dtype=torch.int64), gen, torch.tensor([3], dtype=torch.int32), 0.2)
assert out.shape == (1, 2, 32) and err.tolist() == [False]
kernels.write_kv_pages(torch.ones(1, 1, 32), torch.ones(1, 1, 32), kv, 0, torch.tensor([5]))
c = kernels.page_checksum(kv, torch.tensor([0]), torch.tensor([kernels.checksum_seed("r", 0)]))
kernels.scrub_pages(kv, torch.tensor([0]), 0)
assert c.dtype == torch.int64 and int(kv[0].count_nonzero()) == 0
"""


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cpu_path_works_without_triton():
    proc = run_python(
        "import sys\nsys.modules['triton'] = None  # any 'import triton' now fails\n"
        + CPU_CALLS
        + "assert 'kernels.triton_impl' not in sys.modules\nprint('cpu-ok')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["cpu-ok"]


def test_cpu_dispatch_never_imports_triton():
    proc = run_python(CPU_CALLS + "import sys\nprint('triton' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False"]


def test_launcher_refuses_cpu_tensors_without_the_interpreter():
    proc = run_python(
        """
        import torch
        from kernels import triton_impl
        kv = torch.zeros(2, 1, 2, 16, 1, 32)
        try:
            triton_impl.scrub_pages(kv, torch.tensor([0]), 0)
        except RuntimeError as exc:
            print("refused" if "TRITON_INTERPRET" in str(exc) else exc)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["refused"]
