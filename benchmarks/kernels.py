"""Kernel benchmark: prints one JSON object; ``--quick`` for a smoke run, ``--png PATH`` a chart.

On CPU it times the torch references (what the CPU services run) for checksum, scrub and write
against ``tensor.copy_`` of the same bytes, interleaving the repetitions so that a noisy shared
machine hits every measurement alike; the stated goal is a checksum at >= 25% of copy bandwidth
(reported, not asserted). On CUDA it times the Triton kernels against the same copy and runs
attention beside torch SDPA over the same K/V gathered into dense tensors.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# This file is itself named kernels.py: put the repository first so that "kernels" is the package,
# not this script (imported by name so type checkers do not confuse the two either).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # for benchlib
import benchlib

kernels = importlib.import_module("kernels")

CHECKSUM_GOAL = 0.25  # checksum bandwidth / copy bandwidth


def _interleaved(
    fns: dict[str, Callable[[], object]], reps: int, device: torch.device
) -> dict[str, float]:
    """Median seconds per call of each function, taking turns every repetition; on CUDA each
    timed call is bracketed by a device synchronisation (the warm-up call compiles Triton)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    times = benchlib.interleaved(fns, reps, sync=sync)
    return {name: benchlib.median(ts) for name, ts in times.items()}


def _pool_shape(quick: bool) -> dict[str, int]:
    if quick:
        return dict(num_pages=48, num_layers=4, page_size=16, num_kv_heads=4, head_dim=64)
    return dict(num_pages=256, num_layers=16, page_size=16, num_kv_heads=8, head_dim=128)


def bench_pages(device: torch.device, dtype: torch.dtype, quick: bool, reps: int) -> dict:
    """GB/s of checksum, scrub and write beside a copy of the same bytes, in one interleaved run."""
    s = _pool_shape(quick)
    shape = (s["num_pages"], s["num_layers"], 2, s["page_size"], s["num_kv_heads"], s["head_dim"])
    kv = torch.randn(shape, device=device).to(dtype)
    n = s["num_pages"] // 2
    ids = torch.randperm(s["num_pages"], device=device)[:n]
    seeds = torch.arange(n, dtype=torch.int64, device=device)
    page_bytes = kv[0].numel() * kv.element_size()
    src = kv[:n].clone()  # copy n pages' worth of bytes, contiguous
    dst = torch.empty_like(src)
    # Write: every layer of n pages' tokens, as prefill does (one call per layer).
    tokens = n * s["page_size"]
    k = torch.randn(tokens, s["num_kv_heads"], s["head_dim"], device=device).to(dtype)
    slots = (ids[:, None] * s["page_size"] + torch.arange(s["page_size"], device=device)).flatten()

    def write_all_layers() -> None:
        for layer in range(s["num_layers"]):
            kernels.write_kv_pages(k, k, kv, layer, slots)

    secs = _interleaved(
        {
            "copy": lambda: dst.copy_(src),
            "checksum": lambda: kernels.page_checksum(kv, ids, seeds),
            "scrub": lambda: kernels.scrub_pages(kv, ids, 0),
            "write": write_all_layers,
        },
        reps,
        device,
    )
    nbytes = n * page_bytes
    gbps = {name: nbytes / t / 1e9 for name, t in secs.items()}
    ratio = {name: gbps[name] / gbps["copy"] for name in ("checksum", "scrub", "write")}
    return {
        "pool_shape": list(shape),
        "pages": n,
        "bytes_per_call": nbytes,
        "seconds": {name: round(t, 6) for name, t in secs.items()},
        "gb_per_s": {name: round(v, 3) for name, v in gbps.items()},
        "ratio_to_copy": {name: round(v, 3) for name, v in ratio.items()},
        "checksum_goal_ratio": CHECKSUM_GOAL,
        "checksum_goal_met": ratio["checksum"] >= CHECKSUM_GOAL,
    }


def bench_attention(device: torch.device, dtype: torch.dtype, quick: bool, reps: int) -> dict:
    """Paged decode attention beside SDPA over the same K/V gathered into dense tensors (SDPA's
    own grouped-query path, ``enable_gqa``, on contiguous K/V: its fastest form here; expanding
    K/V to every query head with ``repeat_interleave`` and passing transposed, non-contiguous
    tensors, as this did before, took 1.5x as long on CPU for the same results)."""
    import torch.nn.functional as F

    batch, heads, kv_heads, head_dim, page_size = (
        (4, 8, 2, 64, 16) if quick else (32, 32, 8, 128, 16)
    )
    seq = 256 if quick else 2048
    pages_per_seq = seq // page_size
    num_pages = batch * pages_per_seq + 1
    kv = torch.randn(num_pages, 1, 2, page_size, kv_heads, head_dim, device=device).to(dtype)
    page_gen = torch.zeros(num_pages, dtype=torch.int64, device=device)
    tables = (torch.randperm(num_pages - 1, device=device) + 1)[: batch * pages_per_seq]
    tables = tables.view(batch, pages_per_seq).to(torch.int32)
    expected = torch.zeros(batch, pages_per_seq, dtype=torch.int64, device=device)
    lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    # SDPA gets K/V already gathered, laid out densely and contiguous, one head per KV head
    # (B, KVH, S, D), with its grouped-query path: the best case for it.
    k = kv[tables.long(), 0, 0].flatten(1, 2).transpose(1, 2).contiguous()
    v = kv[tables.long(), 0, 1].flatten(1, 2).transpose(1, 2).contiguous()
    qd = q[:, :, None, :]  # (B, H, 1, D)

    def paged() -> torch.Tensor:
        return kernels.paged_decode_attention(q, kv, 0, tables, expected, page_gen, lens, scale)[0]

    def sdpa_dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True)

    # both compute the same attention (the comparison is of two ways to the same result)
    diff = (paged().float() - sdpa_dense()[:, :, 0].float()).abs().max().item()
    if diff > (1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4):
        raise RuntimeError(f"paged attention and SDPA differ by {diff}")
    secs = _interleaved({"paged": paged, "sdpa_dense": sdpa_dense}, reps, device)
    kv_bytes = 2 * batch * seq * kv_heads * head_dim * kv.element_size()
    return {
        "batch": batch,
        "seq_len": seq,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seconds": {name: round(t, 6) for name, t in secs.items()},
        "kv_gb_per_s": {name: round(kv_bytes / t / 1e9, 3) for name, t in secs.items()},
        "paged_over_sdpa_time": round(secs["paged"] / secs["sdpa_dense"], 3),
    }


def draw_png(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--png needs matplotlib, which is not installed ({exc})") from exc
    gbps = result["pages"]["gb_per_s"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(gbps), list(gbps.values()), color=["grey", "tab:blue", "tab:green", "tab:orange"])
    ax.axhline(gbps["copy"] * CHECKSUM_GOAL, ls="--", color="tab:red", label="checksum goal")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvfence kernels on {result['device']} ({result['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions (<1 min)")
    ap.add_argument("--png", type=Path, help="also draw the page-kernel bandwidths here")
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    reps = 5 if args.quick else 20
    torch.manual_seed(0)
    result: dict = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "path": "triton" if device.type == "cuda" else "torch-reference",
        "dtype": args.dtype,
        "quick": args.quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "checksum_algo": kernels.CHECKSUM_ALGO,
        "pages": bench_pages(device, dtype, args.quick, reps),
        "attention": bench_attention(device, dtype, args.quick, reps),
    }
    if device.type == "cuda":
        # Peak is not queryable; the copy in the same run is the practical device bandwidth.
        result["device_copy_gb_per_s"] = result["pages"]["gb_per_s"]["copy"]
    benchlib.emit(result, args.png, draw_png)


if __name__ == "__main__":
    main()
