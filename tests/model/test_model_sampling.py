"""Sampling is a pure function of (logits, params, step), so a split run equals a colocated one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.engine import Engine
from kvfence.model.sampling import (
    SamplingParams,
    find_stop,
    sample,
    sample_one,
    step_seed,
    stream_safe_len,
)
from kvfence.model.scheduler import Scheduler, SequenceStatus
from kvfence.tokenizer import load_tokenizer

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]  # 18: two pages


def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_one(logits, SamplingParams(), 0) == 1
    assert sample_one(logits, SamplingParams(seed=5), 3) == 1


def test_same_seed_and_step_same_token_other_step_differs() -> None:
    logits = torch.zeros(1000)  # uniform: every draw is decided by the generator alone
    p = SamplingParams(temperature=1.0, seed=1234)
    draws = [sample_one(logits, p, s) for s in range(20)]
    assert draws == [sample_one(logits, p, s) for s in range(20)]
    assert len(set(draws)) > 10  # control: the step index changes the draw
    assert draws != [
        sample_one(logits, SamplingParams(temperature=1.0, seed=1235), s) for s in range(20)
    ]
    assert step_seed(1234, 0) != step_seed(1234, 1) and 0 <= step_seed(2**64 - 1, 7) < 2**63


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 1e-37, 1e-40])
def test_a_tiny_temperature_draws_the_top_token(temperature: float) -> None:
    """logits / T overflowed float32 below T ~ 1e-37: softmax came out NaN everywhere and every
    draw was token 0, whatever the logits said."""
    logits = torch.tensor([-5.0, 1.0, 3.0, 50.0, 2.0])
    p = SamplingParams(temperature=temperature, seed=7)
    assert {sample_one(logits, p, step) for step in range(20)} == {3}
    # control: at T = 1 on nearby logits the draws spread over several tokens
    spread = SamplingParams(temperature=1.0, seed=7)
    near = torch.tensor([1.0, 1.2, 0.9, 1.1, 1.0])
    assert len({sample_one(near, spread, step) for step in range(40)}) >= 3


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    assert {sample_one(logits, p, s) for s in range(200)} == {0, 1}
    wide = SamplingParams(temperature=1.0, top_p=1.0, seed=3)  # control: no filtering
    assert {sample_one(logits, wide, s) for s in range(200)} == {0, 1, 2, 3}


def test_batched_sample_equals_one_by_one() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=9)] * 2
    steps = [0, 1, 2, 3]
    assert sample(logits, params, steps) == [
        sample_one(logits[i], params[i], steps[i]) for i in range(4)
    ]


def test_sampled_request_needs_a_seed() -> None:
    with pytest.raises(ValueError, match="seed"):
        sample_one(torch.zeros(5), SamplingParams(temperature=1.0), 0)
    assert SamplingParams(temperature=1.0).with_seed().seed is not None
    assert SamplingParams().with_seed().seed is None  # greedy needs none


def test_stop_helpers() -> None:
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello", ["xyz"]) is None
    assert stream_safe_len("abc wo", ["world"]) == 4  # "wo" may become "world"
    assert stream_safe_len("abc\ufffd", []) == 3  # an incomplete character waits
    assert stream_safe_len("abc", ["world"]) == 3


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_split_prefill_decode_equals_colocated(
    tiny_loaded: Any, make_pool: Callable[..., Any], temperature: float
) -> None:
    """Prefill node samples draw 0, pages are copied to another pool (the transfer), a decode
    node's scheduler continues: the tokens equal one colocated process's."""
    params = SamplingParams(
        max_new_tokens=10, temperature=temperature, top_p=0.95, seed=77, ignore_eos=True
    )
    colo = ColocatedEngine(tiny_loaded, page_size=16, num_pages=8)
    (ref,) = colo.generate([GenerationRequest(PROMPT, params)])

    prefill_pool, decode_pool = make_pool(tiny_loaded, 8), make_pool(tiny_loaded, 8)
    decode_pool.allocate(3, "someone-else")  # decode node's page ids differ from prefill's
    src = prefill_pool.allocate(2, "req")
    dst = decode_pool.allocate(2, "req")
    assert src is not None and dst is not None
    logits = Engine(tiny_loaded.model, prefill_pool).prefill(PROMPT, src)
    first = sample_one(logits, params, 0)
    decode_pool.kv[[r.page_id for r in dst]] = prefill_pool.kv[[r.page_id for r in src]]

    sched = Scheduler(
        Engine(tiny_loaded.model, decode_pool),
        load_tokenizer(tiny_loaded.path),
        eos_token_ids=tiny_loaded.eos_token_ids,
    )
    sched.add_prefilled("req", len(PROMPT), first, dst, params)
    streamed: list[int] = []
    final = None
    while sched.has_work():
        for out in sched.step():
            streamed += out.new_token_ids
            if out.finished:
                final = out
    assert final is not None and final.status == SequenceStatus.FINISHED
    assert final.token_ids == ref.token_ids == streamed
    assert final.text == ref.text and final.finish_reason == ref.finish_reason == "length"
    if temperature:  # control: another seed gives another continuation
        other = SamplingParams(max_new_tokens=10, temperature=temperature, seed=78, ignore_eos=True)
        (alt,) = colo.generate([GenerationRequest(PROMPT, other)])
        assert alt.token_ids != ref.token_ids
