"""Stop strings in the colocated scheduler: the finish step, reason and text are the ones the
rule it had before gives (search ``tokenizer.decode(every id)`` after every token), streamed
text included, while the work per token no longer grows with the sequence's length."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from stop_reference import CountingTokenizers, spy_tokenizer

from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.engine import Engine
from kvfence.model.sampling import SamplingParams, find_stop
from kvfence.model.scheduler import Scheduler, StepOutput
from kvfence.model.scheduler import Sequence as SchedSequence
from kvfence.tokenizer import Tokenizer, load_tokenizer

PROMPT = [40, 41, 42, 43, 44]
MAX_NEW = 60


class FullDecode:
    """A tokenizer kvfence.detok does not know: it must be decoded whole (the positive control,
    and what every tokenizer cost before)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.vocab_size = tok.vocab_size
        self.max_text_bytes_per_token = tok.max_text_bytes_per_token

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)


def long_ids(n: int) -> list[int]:
    """Byte tokens of text with 1-3 byte characters (the tiny tokenizer's id is 3 + byte)."""
    raw = ("héllo wörld € 中文 " * (n // 10 + 1)).encode()[:n]
    return [3 + b for b in raw]


def ids_decoded_per_token(tokenizer: Any, spy: CountingTokenizers, stream_text: bool) -> list[int]:
    """Feed the scheduler's per-token rendering (stop strings, maybe streamed text) n tokens."""
    engine = ColocatedEngine.from_path(None, page_size=16, num_pages=8).engine
    sched = Scheduler(engine, tokenizer, stream_text=stream_text)
    ids = long_ids(2000)
    params = SamplingParams(max_new_tokens=len(ids), stop=("\x00never",), ignore_eos=True)
    seq = SchedSequence("s", [], 1, params)
    per_token = []
    for tok in ids:
        before = sum(spy.decoded)
        seq.output_ids.append(tok)
        sched._after_token(seq, {})
        per_token.append(sum(spy.decoded) - before)
    assert seq.finish_reason == "length" and seq.text == tokenizer.decode(ids)
    return per_token


@pytest.mark.parametrize("stream_text", [False, True])
def test_the_work_per_token_does_not_grow_with_the_sequence(stream_text: bool) -> None:
    tok, spy = spy_tokenizer()
    per_token = ids_decoded_per_token(tok, spy, stream_text)
    # A window of a character or two, decoded once or twice: the same at token 2000 as at 20.
    assert max(per_token[:-1]) <= 12, max(per_token)
    assert max(per_token[1500:-1]) <= max(per_token[:50])
    # Positive control: a tokenizer that must be decoded whole decodes every id every token.
    tok, spy = spy_tokenizer()
    control = ids_decoded_per_token(FullDecode(tok), spy, stream_text)
    assert control[1999] >= 2000 and control[99] >= 100


def reference(
    tok: Tokenizer, ids: list[int], stops: tuple[str, ...], max_new: int, eos: frozenset[int]
) -> tuple:
    """What the scheduler did before: decode every id after every token, search the whole text
    (an EOS first ends the run, unrendered)."""
    for n in range(1, min(len(ids), max_new) + 1):
        if ids[n - 1] in eos:
            return ids[:n], tok.decode(ids[: n - 1]), "eos"
        text = tok.decode(ids[:n])
        cut = find_stop(text, stops)
        if cut is not None:
            return ids[:n], text[:cut], "stop"
    return ids[:max_new], tok.decode(ids[:max_new]), "length"


def run(
    loaded: Any, pool: Any, params: SamplingParams, stream_text: bool
) -> tuple[list[StepOutput], StepOutput]:
    sched = Scheduler(Engine(loaded.model, pool), load_tokenizer(loaded.path),
                      eos_token_ids=loaded.eos_token_ids, stream_text=stream_text)  # fmt: skip
    sched.add("s", PROMPT, params)
    outs: list[StepOutput] = []
    while sched.has_work():
        outs.extend(sched.step())
    assert outs[-1].finished
    return outs, outs[-1]


def stop_sets(text: str) -> list[tuple[str, ...]]:
    """Stop strings this text meets early, late, inside multi-byte characters, never; several."""
    n = len(text)
    return [
        (text[3:5],),
        (text[n // 2 : n // 2 + 3],),
        (text[n - 4 : n - 1],),
        (text[n - 4 : n - 1], text[10:12], "\x01\x02 never"),
        ("\ufffd",),  # a character not yet complete shows as U+FFFD: stops there, as before
        ("\x01\x02 never",),
        tuple(text[i : i + 40] for i in range(0, n - 40, 7)),  # long ones, many
    ]


@pytest.mark.parametrize("stream_text", [False, True])
@pytest.mark.parametrize("sampled", [None, 11, 9], ids=["greedy", "sampled", "sampled-eos"])
def test_stop_strings_end_where_searching_the_whole_text_ended(
    tiny_loaded: Any, make_pool: Callable[..., Any], stream_text: bool, sampled: int | None
) -> None:
    tok = load_tokenizer(tiny_loaded.path)
    extra: dict[str, Any] = {"temperature": 0.9, "seed": sampled} if sampled else {}
    eos = frozenset(tiny_loaded.eos_token_ids) if sampled == 9 else frozenset()
    free = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, **extra)
    [ref] = ColocatedEngine(tiny_loaded, num_pages=16).generate([GenerationRequest(PROMPT, free)])
    assert len(ref.token_ids) == MAX_NEW and len(ref.text) > 30
    reasons = set()
    for stops in stop_sets(ref.text):
        params = SamplingParams(
            max_new_tokens=MAX_NEW, stop=stops, ignore_eos=not eos, **extra
        )  # fmt: skip
        outs, final = run(tiny_loaded, make_pool(tiny_loaded, num_pages=16), params, stream_text)
        want_ids, want_text, want_reason = reference(tok, ref.token_ids, stops, MAX_NEW, eos)
        assert (final.token_ids, final.text, final.finish_reason) == (
            want_ids, want_text, want_reason
        ), stops  # fmt: skip
        assert "".join(o.text_delta for o in outs) == final.text  # streamed: the same text
        reasons.add(final.finish_reason)
    # control: every outcome was exercised (seed 9 meets an EOS at its 44th token)
    assert reasons == ({"stop", "eos"} if eos else {"stop", "length"}), reasons
