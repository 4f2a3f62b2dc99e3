"""Continuous batching: admission by free pages, finishing rules, aborts, integrity failures."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.engine import Engine
from kvfence.model.sampling import SamplingParams
from kvfence.model.scheduler import Scheduler, SequenceStatus, StepOutput
from kvfence.tokenizer import load_tokenizer

PROMPT = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]


def make_scheduler(loaded: Any, pool: Any, **kw: Any) -> Scheduler:
    kw.setdefault("eos_token_ids", loaded.eos_token_ids)
    return Scheduler(Engine(loaded.model, pool), load_tokenizer(loaded.path), **kw)


def run_all(sched: Scheduler) -> dict[str, list[StepOutput]]:
    by_seq: dict[str, list[StepOutput]] = {}
    while sched.has_work():
        for out in sched.step():
            by_seq.setdefault(out.seq_id, []).append(out)
    return by_seq


def reference(loaded: Any, prompt: list[int], n: int) -> Any:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    (out,) = ColocatedEngine(loaded, num_pages=8).generate([GenerationRequest(prompt, params)])
    return out


def test_admission_waits_for_free_pages(tiny_loaded: Any, make_pool: Callable[..., Any]) -> None:
    pool = make_pool(tiny_loaded, num_pages=4, page_size=16)
    sched = make_scheduler(tiny_loaded, pool)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)  # 10 + 10 tokens = 2 pages
    for i in range(3):
        sched.add(f"r{i}", PROMPT, params)
    sched.step()
    assert [s.seq_id for s in sched.running] == ["r0", "r1"]
    assert [s.seq_id for s in sched.waiting] == ["r2"] and pool.num_free == 0
    outs = run_all(sched)
    assert [o.token_ids for o in outs["r2"] if o.finished] == [outs["r0"][-1].token_ids]
    assert pool.num_free == 4
    pool.check_integrity()


def test_request_that_can_never_fit_is_refused(
    tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    sched = make_scheduler(tiny_loaded, make_pool(tiny_loaded, num_pages=2, page_size=16))
    with pytest.raises(ValueError, match="never fit a pool of 32"):
        sched.add("big", PROMPT, SamplingParams(max_new_tokens=23))
    with pytest.raises(ValueError, match="context window 2048"):
        sched.add("long", PROMPT, SamplingParams(max_new_tokens=2040))
    sched.add("ok", PROMPT, SamplingParams(max_new_tokens=22))  # control: exactly 32 tokens
    with pytest.raises(ValueError, match="already exists"):
        sched.add("ok", PROMPT, SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("stream_text", [True, False])
def test_stream_outputs_add_up_to_the_final_one(
    tiny_loaded: Any, make_pool: Callable[..., Any], stream_text: bool
) -> None:
    sched = make_scheduler(tiny_loaded, make_pool(tiny_loaded), stream_text=stream_text)
    sched.add("a", PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
    outs = run_all(sched)["a"]
    final = outs[-1]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.text_delta for o in outs) == final.text
    assert final.token_ids == reference(tiny_loaded, PROMPT, 12).token_ids
    streamed = "".join(o.text_delta for o in outs[:-1])
    assert bool(streamed) == stream_text  # without streaming the text comes at the end
    assert final.text == load_tokenizer(tiny_loaded.path).decode(final.token_ids)


def test_prefill_batches_respect_the_token_budget(
    tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    """Many prompts admitted at once, prefilled in budget-sized passes, give each prompt's tokens
    when it runs alone."""
    prompts = [[40 + i + j for j in range(n)] for i, n in enumerate((3, 10, 10, 17, 1, 10, 33))]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    sched = make_scheduler(tiny_loaded, make_pool(tiny_loaded, num_pages=32), max_prefill_tokens=20)
    calls: list[int] = []
    prefill_many = sched.engine.prefill_many

    def spy(prompts: Any, pages: Any) -> Any:
        calls.append(sum(len(p) for p in prompts))
        return prefill_many(prompts, pages)

    sched.engine.prefill_many = spy  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        sched.add(str(i), p, params)
    outs = run_all(sched)
    assert calls == [13, 10, 18, 10, 33]  # greedy chunks under 20 tokens; 33 runs alone
    for i, p in enumerate(prompts):
        assert outs[str(i)][-1].token_ids == reference(tiny_loaded, p, 6).token_ids


def test_eos_stops_unless_ignored(tiny_loaded: Any, make_pool: Callable[..., Any]) -> None:
    ref = reference(tiny_loaded, PROMPT, 12).token_ids
    eos = ref[4]  # call a token of the greedy run "EOS": the run must end at its first use
    first = ref.index(eos)
    sched = make_scheduler(tiny_loaded, make_pool(tiny_loaded), eos_token_ids=[eos])
    sched.add("stop", PROMPT, SamplingParams(max_new_tokens=12))
    sched.add("ignore", PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
    outs = run_all(sched)
    stop, ignore = outs["stop"][-1], outs["ignore"][-1]
    assert stop.finish_reason == "eos" and stop.token_ids == ref[: first + 1]
    assert stop.text == load_tokenizer(tiny_loaded.path).decode(ref[:first])  # EOS not rendered
    assert ignore.finish_reason == "length" and ignore.token_ids == ref


def test_stop_string_cuts_the_text(tiny_loaded: Any, make_pool: Callable[..., Any]) -> None:
    ref = reference(tiny_loaded, PROMPT, 20)
    text = ref.text
    at = next(
        i
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isascii() and "\ufffd" not in text[i : i + 2]
    )
    stop = text[at : at + 2]
    sched = make_scheduler(tiny_loaded, make_pool(tiny_loaded))
    sched.add("s", PROMPT, SamplingParams(max_new_tokens=20, stop=(stop,), ignore_eos=True))
    final = run_all(sched)["s"][-1]
    assert final.finish_reason == "stop"
    assert final.text == text[: text.index(stop)]
    assert final.token_ids == ref.token_ids[: len(final.token_ids)]
    assert len(final.token_ids) < 20


def test_abort_releases_pages_and_spares_the_others(
    tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    pool = make_pool(tiny_loaded, num_pages=8)
    sched = make_scheduler(tiny_loaded, pool)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    sched.add("a", PROMPT, params)
    sched.add("b", PROMPT, params)
    sched.step()
    held = pool.num_free
    sched.abort("a")
    outs = sched.step()
    aborted = next(o for o in outs if o.seq_id == "a")
    assert (
        aborted.finished and aborted.status == SequenceStatus.ABORTED and not aborted.new_token_ids
    )
    assert pool.num_free == held + 2 and pool.pages_of("a") == []
    final = run_all(sched)["b"][-1]
    assert final.status == SequenceStatus.FINISHED  # control
    assert final.token_ids == reference(tiny_loaded, PROMPT, 8).token_ids


def test_reused_page_fails_only_that_sequence(
    tiny_loaded: Any, make_pool: Callable[..., Any]
) -> None:
    """A decode-node sequence whose pages were freed and re-allocated under it (the incident's bug
    class) fails with PAGE_GENERATION; its batch neighbour finishes with the reference tokens."""
    prefill_pool, decode_pool = make_pool(tiny_loaded, 8), make_pool(tiny_loaded, 8)
    prefill = Engine(tiny_loaded.model, prefill_pool)
    sched = make_scheduler(tiny_loaded, decode_pool)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for owner in ("victim", "control"):
        src, dst = prefill_pool.allocate(1, owner), decode_pool.allocate(2, owner)
        assert src is not None and dst is not None
        first = int(prefill.prefill(PROMPT, src).argmax())
        decode_pool.kv[dst[0].page_id] = prefill_pool.kv[src[0].page_id]
        sched.add_prefilled(owner, len(PROMPT), first, dst, params)
    sched.step()
    decode_pool.release("victim")
    assert decode_pool.allocate(2, "intruder") is not None
    outs = run_all(sched)
    victim, control = outs["victim"][-1], outs["control"][-1]
    assert victim.status == SequenceStatus.FAILED and victim.error is not None
    assert victim.error.reason == "PAGE_GENERATION" and victim.token_ids is None
    assert control.status == SequenceStatus.FINISHED
    assert control.token_ids == reference(tiny_loaded, PROMPT, 8).token_ids


def test_add_from_another_thread(tiny_loaded: Any, make_pool: Callable[..., Any]) -> None:
    got: list[StepOutput] = []
    sched = make_scheduler(tiny_loaded, make_pool(tiny_loaded), on_output=got.append)
    t = threading.Thread(target=sched.add, args=("x", PROMPT, SamplingParams(max_new_tokens=3)))
    t.start()
    t.join()
    while sched.has_work():
        sched.step()
    assert got[-1].seq_id == "x" and got[-1].finished
    assert sum(len(o.new_token_ids) for o in got) == len(got[-1].token_ids or [])
