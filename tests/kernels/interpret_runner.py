"""Run ``kernels.triton_impl`` launchers on CPU under the Triton interpreter (a test helper).

Usage: ``python interpret_runner.py CASES.pt RESULTS.pt``. CASES is a dict ``name -> (fn, args)``;
RESULTS maps each name to what the launcher returned, or, for the in-place launchers, to the pool
after the call. The interpreter is chosen when triton is first imported, so this runs as its own
process and the pytest process never imports triton in interpreter mode.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from kernels import triton_impl

IN_PLACE = {"write_kv_pages": 2, "scrub_pages": 0}  # launcher -> index of the pool argument


def planned_attention(
    kv_pages: torch.Tensor,
    block_tables: torch.Tensor,
    expected_gen: torch.Tensor,
    page_gen: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    q: torch.Tensor,
    bump: int,
) -> tuple:
    """One plan for layers 0 and 1, page ``bump`` changing owner in between: both results, and
    the plan's flags after each (their OR so far)."""
    attend = triton_impl.plan_decode_attention(
        kv_pages, block_tables, expected_gen, page_gen, seq_lens, scale
    )
    first = attend(q, 0)
    flags_after_first = attend.flags.clone()
    page_gen[bump] += 1
    return first, attend(q, 1), flags_after_first, attend.flags


HELPERS = {"planned_attention": planned_attention}


def main(cases_path: str, results_path: str) -> None:
    cases = torch.load(cases_path)
    results = {}
    for name, (fn, args) in cases.items():
        ret = (HELPERS[fn] if fn in HELPERS else getattr(triton_impl, fn))(*args)
        results[name] = args[IN_PLACE[fn]] if fn in IN_PLACE else ret
    torch.save(results, results_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
