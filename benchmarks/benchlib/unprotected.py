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
produce the same tokens: the generation check inside decode attention; decode's write-side checks
(the generation of the page a step writes into, the error flags gathered over the layers and read
back after the step, and ``PagePool.owns`` of that page per row per step, which the transfer
receiver also calls once per batch); prefill's generation check of the pages it writes; manifest
verification (decode) and the MAC prefill signs it with; the page checksums prefill computes for
the manifest and decode recomputes, and prefill's scrub of the last page's unused tail; the
deferred-release bookkeeping (``PagePool.begin_ops``/``end_ops``: with none counted, a released
page is free at once). Each replacement counts its calls, and at exit the process appends one JSON
line (pid, role, calls) to the file :data:`REPORT_ENV` names, so the benchmark can show that the
patches were live in the processes that served its load.

The write-side and prefill checks are inline in the engine's methods, with no function to swap:
:func:`rewrite` compiles a copy of such a method from its own source with exactly the lines
listed in :data:`DECODE_ROWS_EDITS`, :data:`STEP_AND_SAMPLE_EDITS` and :data:`PREFILL_MANY_EDITS`
replaced, and fails if those lines are not found there once each (the engine changed: the edits
must follow it). Given ``times`` it also clocks each edited span, the lines kept (on) as their
replacement (off), so that ``isolation_overhead.py`` can price the checks inside real steps.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import textwrap
import time
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kernels
from kernels import reference

REPORT_ENV = "KVFENCE_BENCH_UNPROTECTED_REPORT"
SITE_DIR = Path(__file__).resolve().parent / "unprotected_site"

# The error flags of a step with nothing checked: one 0-d False, which broadcasts against a
# batch's flags (no tensor made per call).
NO_FLAGS = torch.zeros((), dtype=torch.bool)

# (span, lines of the engine's method, their replacement). Lines are compared stripped, without
# comment-only lines or trailing comments; the replacement takes the first line's indentation.
Edit = tuple[str, list[str], list[str]]
# Engine.decode_rows: the generation check of the page each row writes (a stale one is written
# to slot -1 and the row flagged; with it go the target ids and generations the check alone
# needs, in the step's input tensor), and the step's flags: the attention plan's (the OR of its
# layers' flags) ORed with the write check's.
DECODE_ROWS_EDITS: list[Edit] = [
    (
        "write_check",
        [
            "targets = [r.page_id for r in writes]",
            "wanted = [r.generation for r in writes]",
            "inputs = torch.tensor(",
            "[token_ids, positions, slots, targets, wanted], dtype=torch.long, device=dev",
            ")",
            "tokens, pos, slot, target, want = inputs.unbind(0)",
            "stale = self.pool.page_gen.index_select(0, target) != want",
            "slot_mapping = torch.where(stale, -1, slot)",
        ],
        [
            "inputs = torch.tensor([token_ids, positions, slots], dtype=torch.long, device=dev)",
            "tokens, pos, slot_mapping = inputs.unbind(0)",
        ],
    ),
    ("flags_or", ["flags = attention.flags | stale"], ["flags = _NO_FLAGS"]),
    # the step's count on the pages it writes (Engine._hold), which makes its check last the step
    (
        "write_hold",
        ["held = [] if pages_held else self._hold([r.page_id for r in writes])"],
        ["held = []"],
    ),
]
# DecodeBatch.step_and_sample: the step's flags read back to the host (a device sync on a GPU).
STEP_AND_SAMPLE_EDITS: list[Edit] = [("flags_read", ["bad = flags.tolist()"], ["bad = ()"])]
# Engine.prefill_many: the generation check of the pages a prompt is about to write.
PREFILL_MANY_EDITS: list[Edit] = [
    (
        "prefill_gen_check",
        [
            "ids = torch.tensor([r.page_id for r in flat], device=dev)",
            "want = torch.tensor([r.generation for r in flat], device=dev)",
            "current = (self.pool.page_gen[ids] == want).tolist()",
        ],
        ["current = [True] * len(flat)"],
    ),
    ("prefill_hold", ["held = self._hold([r.page_id for r in flat])"], ["held = []"]),
]


def _code(line: str) -> str:
    return line.split("  #", 1)[0].strip()


def rewrite(
    method: Callable[..., Any],
    edits: list[Edit],
    *,
    off: bool = True,
    times: dict[str, list[float]] | None = None,
) -> Callable[..., Any]:
    """A copy of ``method`` (a plain function or method of the engine) compiled from its source,
    with each edit's lines replaced by its replacement (``off``) or kept (``off=False``: the same
    code as ``method``). With ``times``, each edited span, as it stands in the copy, is clocked
    and its seconds appended to ``times[span]`` (a span that is empty in the copy is clocked too:
    the clock's own cost cancels between on and off). Raises RuntimeError when an edit's lines are
    not in the source exactly once."""
    fn = inspect.unwrap(method)
    lines = [
        ln
        for ln in textwrap.dedent(inspect.getsource(fn)).splitlines()
        if not ln.strip().startswith("#")
    ]
    for span, old, new in edits:
        n = len(old)
        at = [i for i in range(len(lines) - n + 1) if [_code(x) for x in lines[i : i + n]] == old]
        if len(at) != 1:
            raise RuntimeError(
                f"{fn.__qualname__}: the lines of {span!r} are there {len(at)} times, not once "
                "(the engine changed; benchlib/unprotected.py's edits must follow it)"
            )
        i = at[0]
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        body = list(new) if off else [_code(x) for x in lines[i : i + n]]
        if times is not None:
            times.setdefault(span, [])
            body = [
                "_t0 = _clock()",
                *body,
                f"_times[{span!r}].append(_clock() - _t0)",
            ]
        lines[i : i + n] = [indent + b for b in body]
    factory = "def _factory(_clock, _times, _NO_FLAGS):\n"
    factory += textwrap.indent("\n".join(lines), "    ")
    factory += f"\n    return {fn.__name__}\n"
    variant = ("off" if off else "on") + (", timed" if times is not None else "")
    code = compile(factory, f"<{fn.__qualname__}, {variant}>", "exec")
    ns: dict[str, Any] = {}
    exec(code, fn.__globals__, ns)  # the engine module's globals: its ``kernels`` swaps apply
    out = ns["_factory"](time.perf_counter, times if times is not None else {}, NO_FLAGS)
    out.__qualname__ = f"{fn.__qualname__}[{variant}]"
    return out


class UncheckedPlan:
    """The reference's plan (``kernels.reference.DecodeAttentionPlan``) with the generation
    check, the page-id range check and the argument checks removed. It runs the reference's own
    pieces (``_table_read``, the valid and invalid slots once per step, ``_attend_pages`` per
    layer), so that the difference is the check and nothing else."""

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
        self.invalid = None if self.valid is None else reference._invalid_slots(self.valid)
        self.kv_pages, self.scale = kv_pages, scale
        self.flags = NO_FLAGS

    def __call__(self, q: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = reference._attend_pages(
            q,
            self.kv_pages,
            layer,
            self.table,
            self.hi,
            self.valid,
            self.scale,
            invalid=self.invalid,
        )
        return out, NO_FLAGS


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
    from kvfence.model.engine import DecodeBatch, Engine

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
    PagePool.owns = counted("owns_checks_skipped", True)  # type: ignore[method-assign]
    Engine.decode_rows = counted(  # type: ignore[method-assign]
        "decode_write_checks_skipped", rewrite(Engine.decode_rows, DECODE_ROWS_EDITS)
    )
    DecodeBatch.step_and_sample = counted(  # type: ignore[method-assign]
        "decode_flag_reads_skipped", rewrite(DecodeBatch.step_and_sample, STEP_AND_SAMPLE_EDITS)
    )
    Engine.prefill_many = counted(  # type: ignore[method-assign]
        "prefill_generation_checks_skipped", rewrite(Engine.prefill_many, PREFILL_MANY_EDITS)
    )

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
