"""The page checksum reference: a pure-Python twin, the properties the manifest check relies on."""

from __future__ import annotations

import re
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import reference

U64 = (1 << 64) - 1


def python_checksum(page: torch.Tensor, seed: int) -> int:
    """CHECKSUM_ALGO on one page with Python integers: the spec, written as plainly as possible."""
    raw = page.contiguous().view(torch.uint8).numpy().tobytes()
    words = struct.unpack(f"<{len(raw) // 8}Q", raw)
    mult = reference.fmix64(seed) | 1
    total = 0
    for j, u in enumerate(words):
        x = ((u ^ ((j * 0x9E3779B97F4A7C15) & U64)) * mult) & U64
        total += x ^ (x >> 32)
    return total & U64


def make_pages(dtype=torch.float32, num_pages=4, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, 2, 16, 2, 32, generator=gen).to(dtype)  # 16 KiB pages (fp32)


def one(kv: torch.Tensor, page: int, seed: int) -> int:
    return int(kernels.page_checksum(kv, torch.tensor([page]), torch.tensor([seed]))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_python_spec(dtype):
    kv = make_pages(dtype)
    seeds = [kernels.checksum_seed("res-1", i) for i in range(4)]
    got = kernels.page_checksum(kv, torch.tensor([2, 0, 3, 1]), torch.tensor(seeds))
    want = [python_checksum(kv[p], s) for p, s in zip([2, 0, 3, 1], seeds, strict=True)]
    assert [kernels.checksum_as_uint64(int(x)) for x in got] == want


@settings(max_examples=25, deadline=None)
@given(
    words=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=64, max_size=64),
    seed=st.integers(-(2**63), 2**63 - 1),
)
def test_matches_the_python_spec_on_any_bits(words, seed):
    # Arbitrary 32-bit patterns, NaN payloads and negative words included.
    kv = torch.tensor(words, dtype=torch.int32).view(torch.float32).reshape(1, 1, 2, 2, 2, 8)
    assert kernels.checksum_as_uint64(one(kv, 0, seed)) == python_checksum(kv[0], seed)


def test_many_small_pages_in_one_pass_match_one_at_a_time():
    kv = make_pages(num_pages=40)  # 40 pages of 2048 words: several pages per chunk
    ids = torch.randperm(40)
    seeds = torch.arange(40, dtype=torch.int64) * 1_000_003 - 7
    batched = kernels.page_checksum(kv, ids, seeds).tolist()
    singles = [one(kv, int(p), int(s)) for p, s in zip(ids, seeds, strict=True)]
    assert batched == singles


def test_same_data_same_checksum():
    kv = make_pages()
    first = one(kv, 1, 42)
    assert one(kv, 1, 42) == first
    assert one(kv.clone(), 1, 42) == first


def test_swapping_two_words_changes_it():
    kv = make_pages()
    before = one(kv, 1, 42)
    words = kv.view(4, -1).view(torch.int32)
    words[1, [10, 2000]] = words[1, [2000, 10]]
    assert one(kv, 1, 42) != before
    words[1, [10, 2000]] = words[1, [2000, 10]]  # control: swapping back restores it
    assert one(kv, 1, 42) == before


def test_swapping_the_halves_of_a_half_precision_word_changes_it():
    kv = make_pages(torch.float16)
    before = one(kv, 0, 9)
    flat = kv.view(4, -1)
    flat[0, [6, 7]] = flat[0, [7, 6]]
    assert one(kv, 0, 9) != before


def test_swapped_pages_fail_their_seeds():
    kv = make_pages()
    ids = torch.tensor([1, 2])
    seeds = torch.tensor([kernels.checksum_seed("r", 0), kernels.checksum_seed("r", 1)])
    before = kernels.page_checksum(kv, ids, seeds).tolist()
    kv[[1, 2]] = kv[[2, 1]]
    after = kernels.page_checksum(kv, ids, seeds).tolist()
    assert after[0] != before[0] and after[1] != before[1]


def test_a_copy_of_another_page_fails():
    kv = make_pages()
    seed = kernels.checksum_seed("r", 3)
    before = one(kv, 3, seed)
    kv[3] = kv[1]
    assert one(kv, 3, seed) != before


def test_a_different_seed_changes_it():
    kv = make_pages()
    assert one(kv, 2, 1) != one(kv, 2, 2)
    assert one(kv, 2, 1) == one(kv, 2, 1)  # control


def test_a_zero_page_still_depends_on_the_seed():
    kv = torch.zeros(1, 1, 2, 16, 1, 32)
    assert one(kv, 0, 1) != one(kv, 0, 2)


def test_rejects_page_ids_outside_the_pool():
    kv = make_pages()
    with pytest.raises(ValueError, match="page_ids must lie in"):
        kernels.page_checksum(kv, torch.tensor([4]), torch.tensor([0]))
    with pytest.raises(ValueError, match="seeds shape"):
        kernels.page_checksum(kv, torch.tensor([0, 1]), torch.tensor([0]))


def test_checksum_seed_is_a_stable_signed_int64():
    a0 = kernels.checksum_seed("reservation-a", 0)
    assert a0 == kernels.checksum_seed("reservation-a", 0)
    assert -(2**63) <= a0 < 2**63
    others = {kernels.checksum_seed("reservation-a", 1), kernels.checksum_seed("reservation-b", 0)}
    assert a0 not in others and len(others) == 2
    with pytest.raises(ValueError):
        kernels.checksum_seed("reservation-a", -1)


def test_algo_name_is_versioned():
    assert re.fullmatch(r"[a-z0-9-]+-v[0-9]+", kernels.CHECKSUM_ALGO)


def test_swapping_the_32_bit_halves_of_a_64_bit_word_changes_it():
    kv = make_pages()
    before = one(kv, 2, 5)
    words = kv.view(4, -1).view(torch.int32)
    words[2, [8, 9]] = words[2, [9, 8]]  # one 64-bit word, its halves swapped
    assert one(kv, 2, 5) != before
    words[2, [8, 9]] = words[2, [9, 8]]  # control: swapping back restores it
    assert one(kv, 2, 5) == before


def test_a_page_that_is_not_whole_64_bit_words_is_refused():
    odd = torch.zeros(2, 1, 2, 1, 1, 1, dtype=torch.float16)  # 4 bytes per page
    with pytest.raises(ValueError, match="64-bit words"):
        kernels.page_checksum(odd, torch.tensor([0]), torch.tensor([1]))
    even = torch.zeros(2, 1, 2, 2, 1, 1, dtype=torch.float16)  # control: 8 bytes per page
    assert kernels.page_checksum(even, torch.tensor([0]), torch.tensor([1])).shape == (1,)
