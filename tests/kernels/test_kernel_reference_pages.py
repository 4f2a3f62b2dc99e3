"""The torch references of the KV page write and the page scrub, and their dispatchers on CPU."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference


def test_write_puts_each_token_at_its_slot(make_pool):
    pool = make_pool(num_pages=4, page_size=16)
    before = pool.kv.clone()
    k = torch.randn(4, 2, 32)
    v = torch.randn(4, 2, 32)
    slots = torch.tensor(
        [17, -1, 31, 32], dtype=torch.int64
    )  # page 1 slots 1 and 15, page 2 slot 0
    kernels.write_kv_pages(k, v, pool.kv, 1, slots)
    assert torch.equal(pool.kv[1, 1, 0, 1], k[0]) and torch.equal(pool.kv[1, 1, 1, 1], v[0])
    assert torch.equal(pool.kv[1, 1, 0, 15], k[2]) and torch.equal(pool.kv[1, 1, 1, 15], v[2])
    assert torch.equal(pool.kv[2, 1, 0, 0], k[3]) and torch.equal(pool.kv[2, 1, 1, 0], v[3])
    changed = (pool.kv != before) & ~torch.isnan(before)
    # Exactly 3 tokens x (K, V) x 2 heads x 32 elements, all in layer 1.
    assert int(changed.sum()) == 3 * 2 * 2 * 32
    assert int(changed[:, 0].sum()) == 0


def test_write_rejects_slots_outside_the_pool(make_pool):
    pool = make_pool(num_pages=4, page_size=16)
    k = torch.randn(1, 2, 32)
    for slot in (64, -2):
        with pytest.raises(ValueError, match="slot_mapping must lie in"):
            kernels.write_kv_pages(k, k, pool.kv, 0, torch.tensor([slot]))
    kernels.write_kv_pages(k, k, pool.kv, 0, torch.tensor([63]))  # control: the last slot is fine
    assert torch.equal(pool.kv[3, 0, 0, 15], k[0])


def test_write_rejects_wrong_dtype_and_shape(make_pool):
    pool = make_pool()
    k = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="dtype"):
        kernels.write_kv_pages(k.half(), k.half(), pool.kv, 0, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must be"):
        kernels.write_kv_pages(k[:, :1], k[:, :1], pool.kv, 0, torch.tensor([0, 1]))


def test_scrub_whole_pages(make_pool):
    pool = make_pool(num_pages=5)
    before = pool.kv.clone()
    kernels.scrub_pages(pool.kv, torch.tensor([1, 3]), 0)
    assert int(pool.kv[[1, 3]].count_nonzero()) == 0
    assert torch.equal(pool.kv[[2, 4]], before[[2, 4]])


def test_scrub_tail_from_one_slot(make_pool):
    pool = make_pool(num_pages=5, page_size=16)
    before = pool.kv.clone()
    kernels.scrub_pages(pool.kv, torch.tensor([2]), 5)
    assert int(pool.kv[2, :, :, 5:].count_nonzero()) == 0
    assert torch.equal(pool.kv[2, :, :, :5], before[2, :, :, :5])
    assert torch.equal(pool.kv[3:], before[3:])


def test_scrub_tail_per_page(make_pool):
    pool = make_pool(num_pages=5, page_size=16)
    before = pool.kv.clone()
    reference.scrub_pages(pool.kv, torch.tensor([1, 2, 4]), torch.tensor([0, 9, 16]))
    assert int(pool.kv[1].count_nonzero()) == 0
    assert int(pool.kv[2, :, :, 9:].count_nonzero()) == 0
    assert torch.equal(pool.kv[2, :, :, :9], before[2, :, :, :9])
    assert torch.equal(pool.kv[4], before[4])  # from_slot == page_size touches nothing
    assert torch.equal(pool.kv[3], before[3])


def test_scrub_rejects_bad_ids_and_slots(make_pool):
    pool = make_pool(num_pages=5, page_size=16)
    with pytest.raises(ValueError, match="page_ids must lie in"):
        kernels.scrub_pages(pool.kv, torch.tensor([5]), 0)
    with pytest.raises(ValueError, match="from_slot must lie in"):
        kernels.scrub_pages(pool.kv, torch.tensor([1]), 17)
    with pytest.raises(ValueError, match="from_slot shape"):
        kernels.scrub_pages(pool.kv, torch.tensor([1, 2]), torch.tensor([3]))
