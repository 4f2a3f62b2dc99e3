"""The decode batcher: a sequence joins with its first token recorded, and the events of a step
reach the event loop together, in order, with the same tokens as the colocated engine."""

from __future__ import annotations

import asyncio

import pytest
from stop_reference import spy_tokenizer

from control_plane.admission import Prompt
from control_plane.detok import IncrementalDetokenizer
from control_plane.lifecycle import RequestRecord
from control_plane.verify import DecodeStream
from decode_svc.batcher import ActiveSeq, DecodeBatcher
from kvfence.config import pages_needed
from kvfence.errors import IntegrityError
from kvfence.kv.pool import PageRef
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams, sample_one
from kvfence.proto.kvfence.v1 import common_pb2, decode_pb2

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42] * 7, [100 + i for i in range(18)]]


class RecordingActive(dict):
    """The batcher's table of active sequences, noting what each held when it joined."""

    def __init__(self) -> None:
        super().__init__()
        self.joined: dict[str, list[int]] = {}

    def __setitem__(self, key: str, seq: ActiveSeq) -> None:
        self.joined[key] = list(seq.generated)
        super().__setitem__(key, seq)


def start_sequence(colo: ColocatedEngine, i: int, prompt: list[int], new: int, events: list):
    refs = colo.pool.allocate(pages_needed(len(prompt) + new, colo.pool.page_size), f"seq-{i}")
    assert refs is not None
    first = int(colo.engine.prefill(prompt, refs).argmax())
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return ActiveSeq(f"seq-{i}", refs, len(prompt), first, params, events.append)


async def test_a_sequence_joins_with_its_first_token_and_one_of_length_one_never_joins():
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=32)
    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                            asyncio.get_running_loop())  # fmt: skip
    batcher._active = RecordingActive()  # the engine thread is not started: nothing steps
    long_events: list = []
    long = start_sequence(colo, 0, PROMPTS[0], 4, long_events)
    batcher.add(long)
    # A step must never find a sequence without its last token.
    assert batcher._active.joined == {"seq-0": [long.first_token]} and batcher.active == 1
    short_events: list = []
    short = start_sequence(colo, 1, PROMPTS[1], 1, short_events)
    batcher.add(short)  # finished by its first token: it never enters the batch
    assert "seq-1" not in batcher._active.joined and batcher.active == 1
    await asyncio.sleep(0.05)  # let the loop deliver what add() posted
    assert long_events == [("tokens", [long.first_token])]
    assert short_events == [("tokens", [short.first_token]), ("finish", "length")]


async def test_steps_deliver_their_events_together_and_match_the_colocated_engine():
    new = 6
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    want = colo.generate(
        [GenerationRequest(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in PROMPTS]
    )
    loop = asyncio.get_running_loop()
    wakeups = 0
    post = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        nonlocal wakeups
        wakeups += 1
        return post(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode, loop)
    events: list[list] = [[] for _ in PROMPTS]
    seqs = [start_sequence(colo, i, p, new, events[i]) for i, p in enumerate(PROMPTS)]
    try:
        await run_batcher(batcher, seqs, events)
    finally:
        del loop.call_soon_threadsafe
    for e, w in zip(events, want, strict=True):
        tokens = [t for kind, value in e if kind == "tokens" for t in value]
        assert tokens == w.token_ids and e[-1] == ("finish", "length")
    # The three first tokens posted by add(), then at most one wakeup per step; posting each
    # token and finish on its own would take 3 + 3 * (new - 1) + 3 = 3 * new + 3.
    assert wakeups <= 3 + batcher.steps < 3 * new + 3, (wakeups, batcher.steps)


async def run_batcher(batcher: DecodeBatcher, seqs: list[ActiveSeq], events: list[list]) -> None:
    batcher.start()
    try:
        for s in seqs:
            batcher.add(s)
        for _ in range(500):
            if all(e and e[-1][0] == "finish" for e in events):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"sequences did not finish: {events}")
    finally:
        batcher.stop()


async def test_stream_interval_groups_tokens_first_at_once_and_rest_with_the_finish():
    new = 8
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    chunks = {}
    for interval in (1, 3):
        batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                                asyncio.get_running_loop(), stream_interval=interval)  # fmt: skip
        events: list = []
        seq = start_sequence(colo, interval, PROMPTS[2], new, events)
        await run_batcher(batcher, [seq], [events])
        assert events[-1] == ("finish", "length")
        chunks[interval] = [value for kind, value in events[:-1] if kind == "tokens"]
        assert len(chunks[interval]) == len(events) - 1  # nothing but tokens before the finish
        colo.pool.release(f"seq-{interval}")
    # Control: one token a message; with 3, the first alone, then threes, the rest at the end.
    assert [len(c) for c in chunks[1]] == [1] * new
    assert [len(c) for c in chunks[3]] == [1, 3, 3, 1]
    assert [t for c in chunks[3] for t in c] == [t for c in chunks[1] for t in c]


def record_step_sizes(batcher: DecodeBatcher) -> list[int]:
    """The number of sequences of every step the batcher runs from now on, as it runs it."""
    sizes: list[int] = []
    step = batcher._step

    def recording(batch: list[ActiveSeq]) -> None:
        sizes.append(len(batch))
        step(batch)

    batcher._step = recording  # type: ignore[method-assign]
    return sizes


async def test_max_batch_bounds_each_step_and_the_waiting_sequences_still_finish():
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                            asyncio.get_running_loop(), max_batch=2)  # fmt: skip
    sizes = record_step_sizes(batcher)
    events: list[list] = [[] for _ in PROMPTS]
    seqs = [start_sequence(colo, i, p, 3 + 2 * i, events[i]) for i, p in enumerate(PROMPTS)]
    await run_batcher(batcher, seqs, events)
    want = colo.generate(
        [GenerationRequest(p, SamplingParams(max_new_tokens=3 + 2 * i, ignore_eos=True))
         for i, p in enumerate(PROMPTS)]
    )  # fmt: skip
    for e, w in zip(events, want, strict=True):
        assert [t for kind, value in e if kind == "tokens" for t in value] == w.token_ids
    assert max(sizes) == 2  # three sequences, never more than two in a step (and two at once)


async def test_on_step_reports_the_rows_of_every_step():
    """What the decode_step_rows metric observes: each step's rows, as the step ran them."""
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    seen: list[int] = []
    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                            asyncio.get_running_loop(), on_step=seen.append)  # fmt: skip
    ran = record_step_sizes(batcher)
    events: list[list] = [[] for _ in PROMPTS]
    # 2, 4 and 6 new tokens: the first token comes from prefill, so 1, 3 and 5 steps each
    seqs = [start_sequence(colo, i, p, 2 + 2 * i, events[i]) for i, p in enumerate(PROMPTS)]
    await run_batcher(batcher, seqs, events)
    assert seen == ran and batcher.steps == len(seen)
    assert sum(seen) == 1 + 3 + 5  # one row per token decoded after the first


async def test_a_failing_on_step_fails_no_request():
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)

    def broken(rows: int) -> None:
        raise RuntimeError("metrics backend down")

    want = colo.generate(
        [GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))]
    )
    for on_step in (None, broken):  # control: the same sequence without the callback
        batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                                asyncio.get_running_loop(), on_step=on_step)  # fmt: skip
        events: list = []
        seq = start_sequence(colo, 0, PROMPTS[0], 4, events)
        await run_batcher(batcher, [seq], [events])
        assert events[-1] == ("finish", "length"), events
        assert [t for kind, v in events if kind == "tokens" for t in v] == want[0].token_ids
        colo.pool.release("seq-0")


async def test_a_row_that_cannot_step_fails_alone_and_the_thread_keeps_running():
    """A sequence whose pages were released before it joined, or that asks for more tokens than
    its pages hold, used to raise on the engine thread before the step and end the thread: every
    request on the node then waited forever. Now that row fails with an error event and the
    others, here a good sequence in the same steps (the control), finish with the right tokens."""
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    want = colo.generate(
        [GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True))]
    )
    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                            asyncio.get_running_loop())  # fmt: skip
    events: list[list] = [[], [], []]
    good = start_sequence(colo, 0, PROMPTS[0], 6, events[0])
    released = start_sequence(colo, 1, PROMPTS[1], 6, events[1])
    colo.pool.release("seq-1")  # released before it joins
    overrun = start_sequence(colo, 2, PROMPTS[2], 6, events[2])
    overrun.params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # its pages hold 6
    batcher.start()
    try:
        for s in (released, overrun, good):
            batcher.add(s)
        for _ in range(500):
            if all(e and e[-1][0] in ("finish", "error") for e in events):
                break
            await asyncio.sleep(0.01)
        assert batcher._thread.is_alive()
    finally:
        batcher.stop()
    assert events[0][-1] == ("finish", "length")
    assert [t for kind, v in events[0] if kind == "tokens" for t in v] == want[0].token_ids
    assert events[1][-1][0] == "error" and "released" in str(events[1][-1][1])
    assert events[2][-1][0] == "error" and "past the sequence's" in str(events[2][-1][1])
    assert batcher.active == 0
    for owner in ("seq-0", "seq-2"):
        colo.pool.release(owner)
    assert colo.pool.num_free == colo.pool.num_pages  # no write left counted on any page
    colo.pool.check_integrity()


async def test_a_failed_step_tells_no_row_what_another_row_held():
    """A step is every row's: when it raises, each row fails, and its error must not carry the
    cause, which may be another row's data (here the engine names a token id outside the
    vocabulary, one tenant's first token). The cause goes to the node's log. Control: the good
    sequence alone finishes."""
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    secret_token = colo.engine.vocab_size + 4242
    for with_bad in (False, True):
        batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                                asyncio.get_running_loop())  # fmt: skip
        events: list[list] = [[], []]
        seqs = [start_sequence(colo, 0, PROMPTS[0], 6, events[0])]
        if with_bad:
            bad = start_sequence(colo, 1, PROMPTS[1], 6, events[1])
            bad.first_token = secret_token
            seqs.append(bad)
        batcher.start()
        try:
            for seq in seqs:
                batcher.add(seq)
            ended = events[: len(seqs)]
            for _ in range(500):
                if all(e and e[-1][0] in ("finish", "error") for e in ended):
                    break
                await asyncio.sleep(0.01)
        finally:
            batcher.stop()
        if with_bad:
            for e in events:
                assert e[-1][0] == "error", e
                assert str(secret_token) not in str(e[-1][1]), e[-1][1]
                assert "decode step failed" in str(e[-1][1])
        else:
            assert events[0][-1] == ("finish", "length"), events[0]
        for seq in seqs:
            colo.pool.release(seq.seq_id)
    assert colo.pool.num_free == colo.pool.num_pages


def stop_sets(text: str) -> list[tuple[str, ...]]:
    """Stop strings a generation with this free-running text meets early, late, never."""
    n = len(text)
    return [
        (text[3:5],),
        (text[n // 2 : n // 2 + 3],),
        (text[n - 4 : n - 1], text[10:12], "\x01\x02 never"),
        ("\ufffd",),
        ("\x01\x02 never",),
        tuple(text[i : i + 40] for i in range(0, n - 40, 7)),
    ]


STOP_PROMPT = [40, 41, 42, 43, 44]


@pytest.mark.parametrize("seed", [None, 9], ids=["greedy", "sampled-eos"])
async def test_stop_strings_end_decode_and_the_relayed_text_where_the_colocated_engine_does(
    seed: int | None,
) -> None:
    """The disaggregated path with stop strings: the decode batcher finishes at the colocated
    engine's token with its reason, and the control plane relays its text (seed 9 samples an EOS
    at the 44th token: EOS before a late stop string)."""
    new = 60
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    extra: dict = {"temperature": 0.9, "seed": seed} if seed is not None else {}
    free = SamplingParams(max_new_tokens=new, ignore_eos=True, **extra)
    [ref] = colo.generate([GenerationRequest(STOP_PROMPT, free)])
    eos = frozenset(colo.loaded.eos_token_ids) if seed is not None else frozenset()
    reasons = set()
    for i, stops in enumerate(stop_sets(ref.text)):
        params = SamplingParams(max_new_tokens=new, stop=stops, ignore_eos=not eos, **extra)
        [want] = colo.generate([GenerationRequest(STOP_PROMPT, params)])
        batcher = DecodeBatcher(colo.engine, colo.pool, eos, colo.tokenizer.decode,
                                asyncio.get_running_loop())  # fmt: skip
        events: list = []
        refs = colo.pool.allocate(pages_needed(len(STOP_PROMPT) + new, 16), f"stop-{i}")
        assert refs is not None
        first = sample_one(colo.engine.prefill(STOP_PROMPT, refs), params, 0)
        seq = ActiveSeq(f"stop-{i}", refs, len(STOP_PROMPT), first, params, events.append)
        await run_batcher(batcher, [seq], [events])
        colo.pool.release(f"stop-{i}")
        tokens = [t for kind, v in events if kind == "tokens" for t in v]
        assert (tokens, events[-1]) == (want.token_ids, ("finish", want.finish_reason)), stops
        stream = DecodeStream(
            RequestRecord("r1", "t1"),
            common_pb2.KvManifest(first_token=first),
            Prompt(STOP_PROMPT, common_pb2.SamplingParams(max_new_tokens=new, stop=stops,
                                                         ignore_eos=not eos)),
            IncrementalDetokenizer(colo.tokenizer),
            eos,
        )  # fmt: skip
        stream.accept(decode_pb2.DecodeResponse(verified=True))
        texts = [stream.accept(decode_pb2.DecodeResponse(token_ids=v)) for k, v in events[:-1]]
        stream.accept(decode_pb2.DecodeResponse(finish_reason=want.finish_reason))
        relayed = "".join(out.text for out in texts if out is not None) + stream.finish().text
        assert relayed == want.text, stops
        reasons.add(want.finish_reason)
    assert reasons == ({"stop", "eos"} if eos else {"stop", "length"}), reasons


def long_ids(n: int) -> list[int]:
    """Byte tokens of text with 1-3 byte characters (the tiny tokenizer's id is 3 + byte)."""
    raw = ("héllo wörld € 中文 " * (n // 10 + 1)).encode()[:n]
    return [3 + b for b in raw]


class _Loop:
    """Takes what a batcher posts to the event loop, and drops it."""

    def call_soon_threadsafe(self, *args: object) -> None:
        pass


def ids_decoded_per_token(detokenize, spy, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=8)
    batcher = DecodeBatcher(colo.engine, colo.pool, [], detokenize, _Loop())  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=len(ids) + 1, stop=("\x00never",), ignore_eos=True)
    seq = ActiveSeq("s", [], 1, ids[0], params, lambda event: None)
    per_token = []
    for tok in ids:
        before = sum(spy.decoded)
        assert not batcher._accept(seq, tok)  # what the engine thread does with each token
        per_token.append(sum(spy.decoded) - before)
    return per_token


def test_the_stop_check_of_a_step_does_not_grow_with_the_sequence() -> None:
    """Before, each step decoded every id the sequence had generated (0.8 ms at 4000 on the
    tiny tokenizer), on the thread that steps every sequence of the batch."""
    ids = long_ids(2000)
    tok, spy = spy_tokenizer()
    per_token = ids_decoded_per_token(tok.decode, spy, ids)  # what decode_svc passes
    assert max(per_token) <= 12 and max(per_token[1500:]) <= max(per_token[:50]), max(per_token)
    # Positive control: a decode function it cannot reason about is decoded whole every step.
    tok, spy = spy_tokenizer()
    control = ids_decoded_per_token(lambda ids: tok.decode(ids), spy, ids)
    assert control[1999] >= 2000 and control[99] >= 100


async def run_until_ended(batcher: DecodeBatcher, events: list[list]) -> None:
    """Start a batcher whose sequences were added before it (so its first step has them all)
    and stop it once every list of ``events`` ends in a finish or an error (5 s at most)."""
    batcher.start()
    try:
        for _ in range(500):
            if all(e and e[-1][0] in ("finish", "error") for e in events):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"sequences did not end: {events}")
    finally:
        batcher.stop()


def tokens_of(events: list) -> list[int]:
    return [t for kind, value in events if kind == "tokens" for t in value]


async def test_max_batch_caps_a_step_when_more_sequences_wait_than_fit():
    """Three sequences wait when the engine thread starts: the first step takes max_batch of
    them, the third waits for a later step and still finishes with the colocated tokens.
    Control: with max_batch 3 the first step takes all three."""
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    want = colo.generate(
        [GenerationRequest(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in PROMPTS]
    )
    for max_batch in (2, 3):
        batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                                asyncio.get_running_loop(), max_batch=max_batch)  # fmt: skip
        sizes = record_step_sizes(batcher)
        events: list[list] = [[] for _ in PROMPTS]
        for i, p in enumerate(PROMPTS):
            batcher.add(start_sequence(colo, i, p, 4, events[i]))
        await run_until_ended(batcher, events)
        assert sizes[0] == max_batch and max(sizes) == max_batch, sizes
        for e, w in zip(events, want, strict=True):
            assert tokens_of(e) == w.token_ids and e[-1] == ("finish", "length")
        for i in range(len(PROMPTS)):
            colo.pool.release(f"seq-{i}")
    assert colo.pool.num_free == colo.pool.num_pages


async def run_pair_removing_one_mid_step(
    colo: ColocatedEngine, remove: bool
) -> tuple[list[ActiveSeq], list[list], list[bool]]:
    """Two sequences, both in the first step; with ``remove``, seq-1 is removed from the first
    step's on_step callback (after the engine sampled, before the step's tokens are accepted).
    Returns them, their events, and what remove() answered."""
    removed: list[bool] = []
    events: list[list] = [[], []]

    def remove_mid_step(rows: int) -> None:
        if remove and not removed:
            removed.append(batcher.remove("seq-1"))

    batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                            asyncio.get_running_loop(), on_step=remove_mid_step)  # fmt: skip
    seqs = [start_sequence(colo, i, p, 4, events[i]) for i, p in enumerate(PROMPTS[:2])]
    for seq in seqs:
        batcher.add(seq)
    await run_until_ended(batcher, events[:1] if remove else events)
    assert batcher.active == 0
    return seqs, events, removed


async def test_a_sequence_removed_during_a_step_gets_no_token_from_it():
    """A cancel or release removes a sequence while a step that includes it runs. The step's
    token for it must be dropped: nothing more reaches its stream, nothing is appended to it.
    Control: without the removal the same sequence gets every token; its neighbour in the same
    steps finishes either way."""
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    want = colo.generate(
        [GenerationRequest(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
         for p in PROMPTS[:2]]
    )  # fmt: skip
    for remove in (False, True):
        seqs, events, removed = await run_pair_removing_one_mid_step(colo, remove)
        assert tokens_of(events[0]) == want[0].token_ids  # the neighbour, either way
        if remove:
            assert removed == [True]
            assert events[1] == [("tokens", [seqs[1].first_token])], events[1]
            assert seqs[1].generated == [seqs[1].first_token]
        else:  # control
            assert tokens_of(events[1]) == want[1].token_ids
            assert events[1][-1] == ("finish", "length")
        for seq in seqs:
            colo.pool.release(seq.seq_id)
    assert colo.pool.num_free == colo.pool.num_pages  # the step's write settled on every page


async def test_a_row_whose_tag_check_fails_is_failed_with_an_integrity_error():
    """A row whose block table names a page at a generation the pool no longer has (here an
    earlier page, so the page the step writes is still its own and the step runs) is flagged by
    the kernel and gets no token: it must end with PAGE_GENERATION at once, not stay in the batch
    with nothing emitted. Control: the same sequence with its current refs finishes; the
    neighbour in the same steps finishes either way."""
    colo = ColocatedEngine.from_path(None, page_size=16, num_pages=64)
    want = colo.generate(
        [GenerationRequest(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
         for p in (PROMPTS[0], PROMPTS[2])]
    )  # fmt: skip
    for stale in (False, True):
        batcher = DecodeBatcher(colo.engine, colo.pool, [], colo.tokenizer.decode,
                                asyncio.get_running_loop())  # fmt: skip
        events: list[list] = [[], []]
        good = start_sequence(colo, 0, PROMPTS[0], 4, events[0])
        victim = start_sequence(colo, 2, PROMPTS[2], 4, events[1])  # 18 tokens: writes page 1
        assert len(victim.pages) == 2
        if stale:
            first = victim.pages[0]
            victim.pages = [PageRef(first.page_id, first.generation - 1), victim.pages[1]]
        batcher.add(good)
        batcher.add(victim)
        await run_until_ended(batcher, events)
        assert tokens_of(events[0]) == want[0].token_ids  # the neighbour, either way
        if stale:
            assert len(events[1]) == 2 and events[1][0] == ("tokens", [victim.first_token])
            kind, err = events[1][1]
            assert kind == "error" and isinstance(err, IntegrityError), events[1]
            assert err.reason == "PAGE_GENERATION"
            assert victim.generated == [victim.first_token]
        else:  # control
            assert tokens_of(events[1]) == want[1].token_ids
            assert events[1][-1] == ("finish", "length")
        assert batcher.active == 0
        for seq in (good, victim):
            colo.pool.release(seq.seq_id)
    assert colo.pool.num_free == colo.pool.num_pages
