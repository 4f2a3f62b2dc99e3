"""Engine isolation: stale block tables are flagged and never write; current ones decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvfence.errors import IntegrityError
from kvfence.kv.pool import PageRef
from kvfence.model.engine import DecodeBatch, DecodeItem, Engine
from kvfence.model.llama import causal_attend
from kvfence.model.rope import apply_rope, apply_rope_factors, rope_factors

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


def test_prefill_many_equals_one_prefill_per_prompt(
    tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    """One pass over prompts of mixed (and repeated) lengths writes the same K/V and gives the same
    last-position logits as separate prefills; a prompt whose page is stale is left out.

    Same up to float rounding, not bit for bit: a CPU BLAS may round a GEMM row differently for a
    different number of rows (decode batches of different sizes have the same property); the
    attention itself is the per-prompt SDPA call."""
    prompts = [PROMPT_A, PROMPT_B, list(range(40, 57)), [7], list(range(60, 66)), PROMPT_B]
    one = Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=32, page_size=4))
    many = Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=32, page_size=4))
    pages_one = [list(one.pool.allocate(5, str(i)) or []) for i in range(len(prompts))]
    pages_many = [list(many.pool.allocate(5, str(i)) or []) for i in range(len(prompts))]
    expected = torch.stack([one.prefill(p, r) for p, r in zip(prompts, pages_one, strict=True)])
    stale = list(pages_many)
    stale[2] = [PageRef(r.page_id, r.generation + 1) for r in pages_many[2]]
    logits, errors = many.prefill_many(prompts, stale)
    assert [e is not None for e in errors] == [False, False, True, False, False, False]
    assert errors[2] is not None and errors[2].reason == "PAGE_GENERATION"
    keep = [0, 1, 3, 4, 5]
    torch.testing.assert_close(logits[keep], expected[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[keep].argmax(-1), expected[keep].argmax(-1))
    for i in keep:
        ids_one = [r.page_id for r in pages_one[i]]
        ids_many = [r.page_id for r in pages_many[i]]
        torch.testing.assert_close(
            many.pool.kv[ids_many], one.pool.kv[ids_one], rtol=1e-5, atol=1e-5
        )
    assert not many.pool.kv[[r.page_id for r in pages_many[2]]].any()  # nothing written
    with pytest.raises(ValueError, match="must not share pages"):
        many.prefill_many([PROMPT_A, PROMPT_B], [pages_many[0], pages_many[0]])


def test_decode_batch_equals_decode_step_as_rows_come_and_go(
    tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    engine = Engine(tiny_loaded.model, make_pool(tiny_loaded, num_pages=12, page_size=4))
    pool = engine.pool
    pool_pages = [pool.allocate(3, name) for name in ("a", "b", "c")]
    assert all(p is not None for p in pool_pages)
    a, b, c = (list(p or []) for p in pool_pages)
    for prompt, pages in ((PROMPT_A, a), (PROMPT_B, b), (PROMPT_A, c)):
        engine.prefill(prompt, pages)
    batch = DecodeBatch(engine)
    state = {id(a): len(PROMPT_A), id(b): len(PROMPT_B), id(c): len(PROMPT_A)}
    for rows in ([a, b], [a, b], [b], [b, c], [b, c, a], [c, a]):
        batch.sync(rows)
        toks = [5 + i for i in range(len(rows))]
        pos = [state[id(r)] for r in rows]
        # Read what decode_step gives from a copy of the pool, then step the batch on the real one.
        before = pool.kv.clone()
        want, want_flags = engine.decode_step(
            [DecodeItem(t, p, r) for t, p, r in zip(toks, pos, rows, strict=True)]
        )
        pool.kv.copy_(before)
        got, flags = batch.step(toks, pos)
        assert torch.equal(got, want) and torch.equal(flags, want_flags)
        for r in rows:
            state[id(r)] += 1
    with pytest.raises(ValueError, match="outside its 3 pages"):
        batch.step([5, 5], [12, 1])
    # A row whose page changed owner is flagged and writes nothing.
    pool.release("c")
    d = pool.allocate(6, "d")  # every free page: c's included
    assert d is not None and {r.page_id for r in c} <= {r.page_id for r in d}
    before = pool.kv.clone()
    batch.sync([c, a])
    _, flags = batch.step([5, 5], [state[id(c)], state[id(a)]])
    assert flags.tolist() == [True, False]
    assert torch.equal(pool.kv[[r.page_id for r in d]], before[[r.page_id for r in d]])


def test_rope_factors_are_bit_identical_to_apply_rope() -> None:
    g = torch.Generator().manual_seed(0)
    for heads, hd in ((4, 32), (1, 64), (3, 128)):
        x = torch.randn(9, heads, hd, generator=g)
        cos, sin = torch.randn(9, hd, generator=g), torch.randn(9, hd, generator=g)
        assert torch.equal(apply_rope_factors(x, *rope_factors(cos, sin)), apply_rope(x, cos, sin))


@pytest.mark.parametrize("fails", [True, False])
def test_a_failed_generate_gives_every_page_back_and_the_engine_runs_on(fails: bool) -> None:
    """A tag check failing for one row (what a stale page does) raised out of generate() and
    left the other running sequences' pages held under their ids: the next generate() on the
    engine failed ("owner '1' already holds pages"). Control: the same run without the failure
    frees everything and repeats."""
    from kvfence.model.colocated import ColocatedEngine, GenerationRequest
    from kvfence.model.sampling import SamplingParams

    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=32)
    real = colo.engine.decode_rows
    calls = [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        logits, flags = real(*args, **kwargs)
        calls[0] += 1
        if fails and calls[0] == 2:
            flags = flags.clone()
            flags[0] = True
        return logits, flags

    colo.engine.decode_rows = flaky  # type: ignore[method-assign]
    requests = [
        GenerationRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=8, ignore_eos=True))
        for _ in range(3)
    ]
    if fails:
        with pytest.raises(IntegrityError):
            colo.generate(requests)
    else:
        assert all(len(out.token_ids) == 8 for out in colo.generate(requests))
    assert colo.pool.num_free == colo.pool.num_pages and not colo.pool.owners()
    colo.engine.decode_rows = real  # type: ignore[method-assign]
    assert all(len(out.token_ids) == 8 for out in colo.generate(requests))
    colo.pool.check_integrity()
