"""Argument checks shared by the torch references and the Triton launchers.

Only metadata is inspected here (shapes, dtypes, devices, strides): reading tensor *contents* would
synchronise with the device, which the decode hot path must not do.
"""

from __future__ import annotations

import torch

POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_pool(kv_pages: torch.Tensor) -> None:
    """The pool is ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` and contiguous.

    Contiguity is part of the design (one page is one UCX message) and the checksum reads raw bytes.
    """
    if kv_pages.dim() != 6 or kv_pages.shape[2] != 2:
        raise ValueError(
            "kv_pages must be [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_pages.shape)}"
        )
    if kv_pages.dtype not in POOL_DTYPES:
        raise ValueError(f"kv_pages dtype must be one of {POOL_DTYPES}, got {kv_pages.dtype}")
    if not kv_pages.is_contiguous():
        raise ValueError("kv_pages must be contiguous (one page is one contiguous buffer)")


def check_layer(kv_pages: torch.Tensor, layer: int) -> None:
    if not 0 <= layer < kv_pages.shape[1]:
        raise ValueError(f"layer {layer} out of range for a pool with {kv_pages.shape[1]} layers")


def check_same_device(*tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    return device


def check_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")


def check_attention_args(
    q: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    expected_gen: torch.Tensor,
    page_gen: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Raises ValueError naming the first argument that breaks the attention contract: what
    :func:`check_attention_plan` and :func:`check_attention_call` check, in that order."""
    check_attention_plan(kv_pages, block_tables, expected_gen, page_gen, seq_lens)
    check_attention_call(q, kv_pages, layer, block_tables.shape[0])


def check_attention_plan(
    kv_pages: torch.Tensor,
    block_tables: torch.Tensor,
    expected_gen: torch.Tensor,
    page_gen: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """The arguments every layer of a decode step shares (checked once per step).

    A valid set is accepted by one expression over the tensors' metadata (about a third of the
    time of the checks one by one); only a set it does not accept goes through the checks one by
    one, which name what is wrong.
    """
    pool, bt = kv_pages.shape, block_tables.shape
    if (
        len(pool) == 6
        and pool[2] == 2
        and kv_pages.dtype in POOL_DTYPES
        and kv_pages.is_contiguous()
        and pool[4] > 0
        and block_tables.dtype == torch.int32
        and expected_gen.dtype == torch.int64
        and page_gen.dtype == torch.int64
        and seq_lens.dtype == torch.int32
        and len(bt) == 2
        and expected_gen.shape == bt
        and page_gen.shape == (pool[0],)
        and seq_lens.shape == (bt[0],)
        and _one_device(kv_pages, block_tables, expected_gen, page_gen, seq_lens)
    ):
        return
    check_pool(kv_pages)
    if kv_pages.shape[4] <= 0:  # every call's head check divides by it
        raise ValueError(f"kv_pages must have num_kv_heads >= 1, got {kv_pages.shape[4]}")
    check_same_device(kv_pages, block_tables, expected_gen, page_gen, seq_lens)
    check_dtype("block_tables", block_tables, torch.int32)
    check_dtype("expected_gen", expected_gen, torch.int64)
    check_dtype("page_gen", page_gen, torch.int64)
    check_dtype("seq_lens", seq_lens, torch.int32)
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, max_pages], got {tuple(block_tables.shape)}")
    if expected_gen.shape != block_tables.shape:
        raise ValueError(
            f"expected_gen shape {tuple(expected_gen.shape)} differs from block_tables "
            f"{tuple(block_tables.shape)}"
        )
    if page_gen.shape != (kv_pages.shape[0],):
        raise ValueError(f"page_gen must be [{kv_pages.shape[0]}], got {tuple(page_gen.shape)}")
    batch = block_tables.shape[0]
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [{batch}], got {tuple(seq_lens.shape)}")


def check_attention_call(q: torch.Tensor, kv_pages: torch.Tensor, layer: int, batch: int) -> None:
    """One layer's query and layer index against a pool (and a batch) already checked by
    :func:`check_attention_plan` (checked on every call)."""
    pool, qs = kv_pages.shape, q.shape
    if (
        0 <= layer < pool[1]
        and len(qs) == 3
        and qs[0] == batch
        and qs[2] == pool[5]
        and qs[1] > 0
        and qs[1] % pool[4] == 0
        and q.dtype == kv_pages.dtype
        and ((q.is_cpu and kv_pages.is_cpu) or q.device == kv_pages.device)
    ):
        return
    check_layer(kv_pages, layer)
    check_same_device(q, kv_pages)
    num_kv_heads, head_dim = kv_pages.shape[4], kv_pages.shape[5]
    if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != head_dim:
        raise ValueError(f"q must be [{batch}, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.dtype != kv_pages.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the pool dtype {kv_pages.dtype}")
    if q.shape[1] == 0:
        # No head, no kernel program: a stale row would go unflagged (the Triton launch has no
        # program to flag it) while its caller reads "nothing wrong".
        raise ValueError("q must have at least one head")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")


def _one_device(*tensors: torch.Tensor) -> bool:
    if all(t.is_cpu for t in tensors):
        return True
    device = tensors[0].device
    return all(t.device == device for t in tensors)


def check_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pages: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    check_pool(kv_pages)
    check_layer(kv_pages, layer)
    check_same_device(k, v, kv_pages, slot_mapping)
    want = (slot_mapping.shape[0], kv_pages.shape[4], kv_pages.shape[5])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {want}, got {tuple(t.shape)}")
        if t.dtype != kv_pages.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the pool dtype {kv_pages.dtype}")
    check_dtype("slot_mapping", slot_mapping, torch.int64)
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be [T], got {tuple(slot_mapping.shape)}")


def check_page_ids(page_ids: torch.Tensor, kv_pages: torch.Tensor) -> None:
    check_same_device(page_ids, kv_pages)
    check_dtype("page_ids", page_ids, torch.int32, torch.int64)
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be [N], got {tuple(page_ids.shape)}")


def check_page_ids_in_range(page_ids: torch.Tensor, num_pages: int) -> None:
    """Contents check (synchronises on a device): checksum and scrub are off the decode hot path."""
    if page_ids.numel() and (int(page_ids.min()) < 0 or int(page_ids.max()) >= num_pages):
        raise ValueError(f"page_ids must lie in [0, {num_pages}), got {page_ids.tolist()[:16]}")
