"""kvfence with its protections switched off: the "off" side of ``isolation_overhead.py``.

The services have no switch that turns the protections off, and get none for a benchmark: a
config key that disables isolation is one an operator can set by mistake. So the "off" side is
made here, outside the product, in two forms:

* in this process, :data:`KERNELS_WITHOUT_CHECK` swapped in as ``kvfence.model.engine``'s
  ``kernels`` (the engine reads ``kernels.<fn>`` at call time): attention without the generation
  check (:class:`UncheckedPlan`);
* in the node processes of a whole ``kvfence up`` stack, :func:`apply`, which
  ``unprotected_site/sitecustomize.py`` runs at interpreter start-up in every ``kvfence serve
  prefill|decode`` process that finds :data:`REPORT_ENV` set: put that folder first on
  ``PYTHONPATH`` (:func:`stack_env`) and every process of the stack inherits it.

:func:`apply` removes exactly the protections the benchmark prices, and nothing the stack needs to
produce the same tokens: the generation check inside decode attention; manifest verification
(decode) and the MAC prefill signs it with; the page checksums prefill computes for the manifest
and decode recomputes, and prefill's scrub of the last page's unused tail; the deferred-release
bookkeeping (``PagePool.begin_ops``/``end_ops``: with none counted, a released page is free at
once). Each replacement counts its calls, and at exit the process appends one JSON line (pid,
role, calls) to the file :data:`REPORT_ENV` names, so the benchmark can show that the patches were
live in the processes that served its load.
"""

from __future__ import annotations

import atexit
import json
import os
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import kernels
from kernels import reference

REPORT_ENV = "KVFENCE_BENCH_UNPROTECTED_REPORT"
SITE_DIR = Path(__file__).resolve().parent / "unprotected_site"


class UncheckedPlan:
    """The reference's plan (``kernels.reference.DecodeAttentionPlan``) with the generation
    check, the page-id range check and the argument checks removed. It runs the reference's own
    pieces (``_table_read`` and the valid slots once per step, ``_attend_pages`` per layer), so
    that the difference is the check and nothing else."""

    def __init__(
        self,
        kv_pages: torch.Tensor,
        block_tables: torch.Tensor,
        expected_gen: torch.Tensor,
        page_gen: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ):
        rows = reference._table_read(block_tables, seq_lens, kv_pages.shape[3])
        assert rows is not None, "the benchmark's batches are valid"
        self.hi, read, self.table = rows
        self.valid = (
            None
            if read is None
            else reference._valid_slots(self.table.shape[1] * kv_pages.shape[3], seq_lens)
        )
        self.kv_pages, self.scale = kv_pages, scale

    def __call__(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = reference._attend_pages(
            q, self.kv_pages, layer, self.table, self.hi, self.valid, self.scale
        )
        return out, torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)


def _kernels_with(**replaced: Any) -> types.SimpleNamespace:
    """The ``kernels`` module's public functions, some replaced."""
    public = {k: getattr(kernels, k) for k in dir(kernels) if not k.startswith("_")}
    return types.SimpleNamespace(**{**public, **replaced})


KERNELS_WITHOUT_CHECK = _kernels_with(plan_decode_attention=UncheckedPlan)


def apply(report: Path, role: str) -> Counter[str]:
    """Switch this process's protections off (module docstring); returns the call counter that
    is reported to ``report`` at exit."""
    import kvfence.model.engine as engine_mod
    from kvfence import manifest
    from kvfence.kv.pool import PagePool

    calls: Counter[str] = Counter()

    def counted(name: str, result: Any = None) -> Any:
        def replacement(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return result(*args, **kwargs) if callable(result) else result

        return replacement

    class CountedUncheckedPlan(UncheckedPlan):
        def __init__(self, *args: Any) -> None:
            calls["unchecked_attention_plans"] += 1
            super().__init__(*args)

    def no_checksums(kv_pages: torch.Tensor, page_ids: torch.Tensor, *_: Any) -> torch.Tensor:
        return torch.zeros(page_ids.shape[0], dtype=torch.int64)

    # Engine and services read ``kernels.<fn>`` and ``manifest.<fn>`` at call time.
    kernels.page_checksum = counted("page_checksums_skipped", no_checksums)  # type: ignore[assignment]
    kernels.scrub_pages = counted("tail_scrubs_skipped")  # type: ignore[assignment]
    engine_mod.kernels = _kernels_with(plan_decode_attention=CountedUncheckedPlan)  # type: ignore[assignment]
    manifest.verify = counted("manifest_verifications_skipped")  # type: ignore[assignment]
    manifest.sign = counted("manifest_signatures_skipped")  # type: ignore[assignment]
    PagePool.begin_ops = counted("begin_ops_skipped")  # type: ignore[method-assign]
    PagePool.end_ops = counted("end_ops_skipped", lambda *a, **k: [])  # type: ignore[method-assign]

    def write_report() -> None:
        line = {"pid": os.getpid(), "role": role, "calls": dict(sorted(calls.items()))}
        with report.open("a") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(write_report)
    return calls


def stack_env(report: Path) -> dict[str, str]:
    """The environment that has a ``kvfence up`` stack's nodes run :func:`apply`."""
    path = [str(SITE_DIR), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), REPORT_ENV: str(report)}


def read_report(report: Path) -> tuple[dict[str, dict[str, int]], set[int]]:
    """From :func:`apply`'s lines: the calls each role's processes counted (summed per role), and
    the pids of the processes that ran it."""
    calls: dict[str, Counter[str]] = {}
    pids: set[int] = set()
    if report.exists():
        for line in report.read_text().splitlines():
            rec = json.loads(line)
            calls.setdefault(rec["role"], Counter()).update(rec["calls"])
            pids.add(int(rec["pid"]))
    return {role: dict(sorted(c.items())) for role, c in sorted(calls.items())}, pids
