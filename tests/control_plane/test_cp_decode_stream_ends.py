"""A decode stream that runs on past the end of its run is never relayed as a complete answer.

Decode (``decode_svc.batcher``) and the colocated engine end a run at its first end, checked after
each token: an EOS that counts ("eos"), then a stop string in the text ("stop"), then
max_new_tokens ("length"). The control plane checked only the last finish reason against the last
token and the whole text: a decode that went on after an EOS or a stop string and said "length"
reached the tenant OK, with the text after the EOS and completion_tokens too high. Now a token
after the run's end is DATA_LOSS STREAM_ORDER, a finish other than the one the tokens call for
DATA_LOSS FINISH_REASON, each reported as the other checks of decode's stream are (a
request_failed event, kvfence_integrity_failures_total). Each refused stream has its control: the
same stream as decode sends it, relayed OK; and streams made by the real decode batcher's stopping
and message batching, with random tokens, are never refused.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from cp_harness import Cluster, eventually
from hypothesis import given, settings
from hypothesis import strategies as st
from stop_reference import byte_level_tokenizer, sentencepiece_tokenizer

from control_plane.admission import Prompt
from control_plane.detok import IncrementalDetokenizer
from control_plane.lifecycle import RequestRecord
from control_plane.model_info import ByteTokenizer as PlainByteTokenizer
from control_plane.verify import DecodeStream
from decode_svc.batcher import ActiveSeq, DecodeBatcher
from kvfence.errors import IntegrityError
from kvfence.model.sampling import SamplingParams
from kvfence.model.stops import find_stop
from kvfence.proto.kvfence.v1 import common_pb2, decode_pb2
from kvfence.tokenizer import ByteTokenizer, Tokenizer

TOK = ByteTokenizer()  # exact (kvfence.detok): its final text is a prefix of decode's
PLAIN = PlainByteTokenizer()  # the fake cluster's: not known to kvfence.detok, so not exact
EOS = 2
EURO = TOK.encode("€")  # three bytes


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def relay(
    messages: list[list[int]],
    finish: str,
    max_new: int,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    tokenizer: Any = TOK,
) -> tuple[str, str, int]:
    """The text, finish reason and completion_tokens the client gets for this stream."""
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new, stop=stop, ignore_eos=ignore_eos)
    stream = DecodeStream(
        RequestRecord("r1", "t1"),
        common_pb2.KvManifest(first_token=messages[0][0]),
        Prompt([5, 6, 7], sampling),
        IncrementalDetokenizer(tokenizer),
        frozenset({EOS}),
    )
    stream.accept(decode_pb2.DecodeResponse(verified=True))
    texts = []
    for m in messages:
        out = stream.accept(decode_pb2.DecodeResponse(token_ids=m))
        assert out is not None
        texts.append(out.text)
    stream.accept(decode_pb2.DecodeResponse(finish_reason=finish))
    final = stream.finish()
    return "".join(texts) + final.text, final.finish_reason, final.usage.completion_tokens


# name: (refused stream, its check, the stream decode sends instead, what the client then gets)
CASES: dict[str, Any] = {
    "tokens after an EOS in one message": (
        ([[*ids("a"), EOS, *ids("zz")]], "length", 4, ()),
        "STREAM_ORDER",
        ([[*ids("a"), EOS]], "eos", 4, ()),
        ("a", "eos", 2),
    ),
    "tokens after an EOS, next message": (
        ([[*ids("a"), EOS], ids("zz")], "length", 4, ()),
        "STREAM_ORDER",
        ([ids("a"), [EOS]], "eos", 4, ()),
        ("a", "eos", 2),
    ),
    "the last token an EOS, said length": (
        ([[*ids("abc"), EOS]], "length", 4, ()),
        "FINISH_REASON",
        ([[*ids("abc"), EOS]], "eos", 4, ()),
        ("abc", "eos", 4),
    ),
    "tokens after a stop string in one message": (
        ([ids("aXYbb")], "length", 5, ("XY",)),
        "STREAM_ORDER",
        ([ids("aXY")], "stop", 5, ("XY",)),
        ("a", "stop", 3),
    ),
    "tokens after a stop string, said stop": (
        ([ids("aXYb")], "stop", 8, ("XY",)),
        "STREAM_ORDER",
        ([ids("aX"), ids("Y")], "stop", 8, ("XY",)),
        ("a", "stop", 3),
    ),
    "tokens after a stop string, next message": (
        ([ids("aX"), ids("Y"), ids("b")], "stop", 8, ("XY",)),
        "STREAM_ORDER",
        ([ids("aX"), ids("Y")], "stop", 8, ("XY",)),
        ("a", "stop", 3),
    ),
    # decode's text after "a" and the first byte of "€" ends in U+FFFD, the stop string: not
    # final text yet (the character is still open), decode's text all the same
    "tokens after a stop string in text not final yet": (
        ([[*ids("a"), *EURO]], "length", 4, ("\ufffd",)),
        "STREAM_ORDER",
        ([[*ids("a"), EURO[0]]], "stop", 4, ("\ufffd",)),
        ("a", "stop", 2),
    ),
    "an EOS after a stop string": (
        ([[*ids("aXY"), EOS]], "eos", 8, ("XY",)),
        "STREAM_ORDER",
        ([ids("aXY")], "stop", 8, ("XY",)),
        ("a", "stop", 3),
    ),
    "a stop string at the last of max_new_tokens, said length": (
        ([ids("aXY")], "length", 3, ("XY",)),
        "FINISH_REASON",
        ([ids("aXY")], "stop", 3, ("XY",)),
        ("a", "stop", 3),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_that_runs_past_its_end_is_data_loss(case: str) -> None:
    bad, check, good, relayed = CASES[case]
    with pytest.raises(IntegrityError) as err:
        relay(*bad)
    assert err.value.reason == check
    assert relay(*good) == relayed  # control: the stream decode sends


def test_an_ignored_eos_is_an_ordinary_token() -> None:
    """With ignore_eos the EOS ends nothing: tokens after it are the answer (control for the EOS
    cases), and "eos" is refused as before."""
    assert relay([[*ids("a"), EOS], ids("b")], "length", 3, ignore_eos=True) == ("ab", "length", 3)
    with pytest.raises(IntegrityError) as err:
        relay([[*ids("a"), EOS]], "eos", 3, ignore_eos=True)
    assert err.value.reason == "FINISH_REASON"


def test_without_an_exact_detokenizer_only_the_tokens_own_ends_are_checked() -> None:
    """A tokenizer kvfence.detok does not know may render the text otherwise than decode's
    (incremental) text: a stop string seen here is not proof that decode saw one, so such a
    stream is still relayed as before. The EOS is checked whatever the tokenizer."""
    assert relay([ids("aXYbb")], "length", 5, ("XY",), tokenizer=PLAIN) == ("a", "length", 5)
    with pytest.raises(IntegrityError) as err:
        relay([[*ids("a"), EOS, *ids("zz")]], "length", 4, tokenizer=PLAIN)
    assert err.value.reason == "STREAM_ORDER"


# -- the real decode batcher's streams are never refused -------------------------------------------


class _Now:
    """Runs what the batcher posts to the event loop at once."""

    def call_soon_threadsafe(self, f: Any, *args: Any) -> None:
        f(*args)


def decode_events(
    tok: Tokenizer, tokens: list[int], params: SamplingParams
) -> list[tuple[str, Any]]:
    """What decode_svc.batcher emits for a run whose sampled tokens are ``tokens`` (as many as
    it takes; the last repeats), by its own stopping: ("tokens", ids) events, ("finish", why)."""
    batcher = DecodeBatcher.__new__(DecodeBatcher)  # its stopping only: no engine, no thread
    batcher.eos_ids, batcher.detokenize, batcher.loop = frozenset({EOS}), tok.decode, _Now()  # type: ignore[assignment]
    batcher.stream_interval, batcher._outbox = 1, None
    batcher._lock, batcher._active = threading.Lock(), {}
    events: list[tuple[str, Any]] = []
    seq = ActiveSeq("s", [], 3, tokens[0], params, events.append)
    step = 0
    while not batcher._accept(seq, tokens[min(step, len(tokens) - 1)]):
        step += 1
    return events


ALPHABET = ["a", "b", "é", "€", " ", "\ufffd", "ab"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder: Path = tmp_path_factory.mktemp("tokenizers")
    return {
        "byte": TOK,
        "byte-level": byte_level_tokenizer(folder),
        "sentencepiece": sentencepiece_tokenizer(folder),
        "plain": PLAIN,
    }


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_stream_the_decode_batcher_makes_is_relayed_as_the_colocated_engine_ends_it(
    tokenizers: dict[str, Any], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(tokenizers)))
    tok = tokenizers[name]
    byte_ids = sorted({3 + b for c in ALPHABET for b in c.encode()})
    one = st.one_of(
        st.sampled_from(byte_ids), st.just(EOS), st.sampled_from([3 + 0x80, 3 + 0xE2, 3 + 0xFF])
    )
    tokens = data.draw(st.lists(one, min_size=1, max_size=30))
    stops = data.draw(
        st.lists(st.text(alphabet="ab€é \ufffd", min_size=1, max_size=3), max_size=3, unique=True)
    )
    ignore_eos = data.draw(st.booleans())
    max_new = data.draw(st.integers(1, 30))
    params = SamplingParams(max_new_tokens=max_new, stop=tuple(stops), ignore_eos=ignore_eos)
    events = decode_events(tok, tokens, params)
    kind, finish = events[-1]
    assert kind == "finish"
    generated = [t for k, v in events if k == "tokens" for t in v]
    # decode_svc.service sends the token events queued together as one message
    messages: list[list[int]] = []
    for _k, v in events[:-1]:
        if messages and data.draw(st.booleans()):
            messages[-1] += v
        else:
            messages.append(list(v))
    got = relay(messages, finish, max_new, tuple(stops), ignore_eos, tok)
    # the colocated engine's answer: no EOS that ended the run in the text, cut at a stop string
    text = tok.decode(generated[:-1] if finish == "eos" else generated)
    cut = find_stop(text, stops) if finish == "stop" else None
    assert got == (text if cut is None else text[:cut], finish, len(generated))


# -- through the control plane ---------------------------------------------------------------------


def integrity_failures(cluster: Cluster, check: str) -> float:
    labels = {"service": "control-plane", "check": check}
    value = cluster.cp.metrics.registry.get_sample_value("kvfence_integrity_failures_total", labels)
    return value or 0.0


@pytest.mark.parametrize(
    "tokens, finish, check",
    [
        ([*ids("a"), EOS, *ids("z")], "length", "STREAM_ORDER"),  # on after an EOS
        ([*ids("ab"), EOS], "length", "FINISH_REASON"),  # the EOS said to be the length
    ],
    ids=["tokens after an EOS", "an EOS called length"],
)
async def test_the_tenant_gets_data_loss_and_the_failure_is_reported(
    cluster: Cluster, tokens: list[int], finish: str, check: str
) -> None:
    """The fake decode streams ``tokens`` (up to max_new_tokens, 3 a message) then ``finish``.
    Control: the same request answered as decode ends it, OK, counting nothing."""
    cluster.script.tokens, cluster.script.finish_reason = [*ids("ab"), EOS], "eos"
    ok = await cluster.client().generate(prompt_ids=[10], max_new_tokens=3)
    assert (ok.text, ok.finish_reason, ok.usage.completion_tokens) == ("ab", "eos", 3)
    assert integrity_failures(cluster, check) == 0 and not cluster.events.of("request_failed")

    cluster.script.tokens, cluster.script.finish_reason = tokens, finish
    with pytest.raises(IntegrityError) as err:
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=len(tokens))
    assert err.value.reason == check  # DATA_LOSS, the check in its ErrorInfo
    [failed] = cluster.events.of("request_failed")
    assert (failed["code"], failed["reason"]) == ("DATA_LOSS", check)
    assert integrity_failures(cluster, check) == 1
    # its nodes released, its books closed
    request_id = failed["request_id"]
    await eventually(lambda: not cluster.cp.table, 5)
    for node in (cluster.decode[0], cluster.prefill[0]):
        await eventually(
            lambda n=node: any(m == "Release" and r.request_id == request_id for m, r in n.calls),
            5,
        )
