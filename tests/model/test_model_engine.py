"""Engine isolation: stale block tables are flagged and never write; current ones decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvfence.errors import IntegrityError
from kvfence.kv.pool import PageRef
from kvfence.model.engine import DecodeItem, Engine
from kvfence.model.llama import causal_attend

PROMPT_A = [10, 11, 12, 13, 14, 15]
PROMPT_B = [20, 21, 22, 23, 24]


def full_logits(loaded: Any, ids: list[int]) -> torch.Tensor:
    """Last-position logits of a pageless causal forward: what decode must reproduce."""
    model = loaded.model
    hidden = model(
        torch.tensor(ids), torch.arange(len(ids)), causal_attend(model.args.head_dim**-0.5)
    )
    return model.logits(hidden)[-1]


@pytest.fixture
def engine(tiny_loaded: Any, make_pool: Callable[..., Any]) -> Engine:
    return Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=6, page_size=4))


def test_prefill_then_decode_equals_full_forward(engine: Engine, tiny_loaded: Any) -> None:
    pages = engine.pool.allocate(3, "a")
    assert pages is not None
    logits = engine.prefill(PROMPT_A, pages)
    torch.testing.assert_close(logits, full_logits(tiny_loaded, PROMPT_A), rtol=1e-5, atol=1e-5)
    ids = list(PROMPT_A)
    for _ in range(4):  # positions 6..9 cross from page 1 into page 2
        ids.append(int(logits.argmax()))
        out, flags = engine.decode_step([DecodeItem(ids[-1], len(ids) - 1, pages)])
        assert flags.tolist() == [False]
        logits = out[0]
        torch.testing.assert_close(logits, full_logits(tiny_loaded, ids), rtol=1e-4, atol=1e-4)


def test_stale_generation_is_flagged_and_current_one_succeeds(engine: Engine) -> None:
    pool = engine.pool
    a, b = pool.allocate(2, "a"), pool.allocate(2, "b")
    assert a is not None and b is not None
    engine.prefill(PROMPT_A, a)
    logits_b = engine.prefill(PROMPT_B, b)
    tok_b = int(logits_b.argmax())
    # A is released and its pages go to C, which writes its own prompt there.
    pool.release("a")
    c = pool.allocate(4, "c")
    assert c is not None and {r.page_id for r in a} <= {r.page_id for r in c}
    engine.prefill(list(range(30, 45)), c)
    c_pages_before = pool.kv[[r.page_id for r in c]].clone()

    batch = [DecodeItem(99, len(PROMPT_A), a), DecodeItem(tok_b, len(PROMPT_B), b)]
    logits, flags = engine.decode_step(batch)

    assert flags.tolist() == [True, False]
    # The stale row wrote nothing into C's pages ...
    assert torch.equal(pool.kv[[r.page_id for r in c]], c_pages_before)
    # ... and the current row got exactly what it gets alone.
    b_alone = full_logits_after(engine, PROMPT_B, tok_b, b)
    torch.testing.assert_close(logits[1], b_alone, rtol=1e-5, atol=1e-5)


def full_logits_after(engine: Engine, prompt: list[int], token: int, pages: list[PageRef]) -> Any:
    logits, flags = engine.decode_step([DecodeItem(token, len(prompt), pages)])
    assert flags.tolist() == [False]
    return logits[0]


def test_stale_earlier_page_is_flagged_by_the_kernel(engine: Engine) -> None:
    """The target page is current (the write happens) but an earlier page's tag is old."""
    pages = engine.pool.allocate(3, "a")
    assert pages is not None
    engine.prefill(PROMPT_A, pages)
    stale = [PageRef(pages[0].page_id, pages[0].generation - 1), *pages[1:]]
    _, flags = engine.decode_step(
        [DecodeItem(5, len(PROMPT_A), stale), DecodeItem(5, len(PROMPT_A), pages)]
    )
    assert flags.tolist() == [True, False]


def test_prefill_refuses_a_page_it_does_not_hold(engine: Engine) -> None:
    pages = engine.pool.allocate(2, "a")
    assert pages is not None
    stale = [pages[0], PageRef(pages[1].page_id, pages[1].generation + 1)]
    before = engine.pool.kv.clone()
    with pytest.raises(IntegrityError) as err:
        engine.prefill(PROMPT_A, stale)
    assert err.value.reason == "PAGE_GENERATION"
    assert torch.equal(engine.pool.kv, before)  # nothing written
    engine.prefill(PROMPT_A, pages)  # control: the held generation works
    assert not torch.equal(engine.pool.kv, before)


def test_bad_inputs_raise_value_error(engine: Engine) -> None:
    pages = engine.pool.allocate(1, "a")
    assert pages is not None
    with pytest.raises(ValueError, match="need 2 pages"):
        engine.prefill(PROMPT_A, pages)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prefill([384], pages)
    with pytest.raises(ValueError, match="outside its 1 pages"):
        engine.decode_step([DecodeItem(5, 4, pages)])
    engine.prefill([5, 6, 7], pages)  # control


def test_bfloat16_model_runs_on_a_bfloat16_pool(tiny_dir: Any) -> None:
    from kvfence.model.colocated import ColocatedEngine, GenerationRequest
    from kvfence.model.loader import load_model
    from kvfence.model.sampling import SamplingParams

    loaded = load_model(tiny_dir, dtype="bfloat16")
    with pytest.raises(ValueError, match="pool is float32"):
        Engine(loaded.model, _f32_pool(loaded))
    engine = ColocatedEngine(loaded, page_size=4, num_pages=8)
    assert engine.pool.kv.dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    (out,) = engine.generate([GenerationRequest(PROMPT_A, params)])
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def _f32_pool(loaded: Any) -> Any:
    from kvfence.kv.pool import PagePool

    s = loaded.shape
    return PagePool(
        4, num_layers=s.num_layers, page_size=4, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim
    )
