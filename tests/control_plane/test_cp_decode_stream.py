"""What the control plane relays from a decode stream: text cut at a stop string as the colocated
engine cuts it, and only finish reasons the tokens bear out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stop_reference import old_find_stop, old_stream_safe_len

from control_plane.admission import Prompt
from control_plane.detok import IncrementalDetokenizer
from control_plane.lifecycle import RequestRecord
from control_plane.verify import DecodeStream
from kvfence.errors import IntegrityError
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams
from kvfence.model.tiny import ensure_tiny_model
from kvfence.proto.kvfence.v1 import common_pb2, decode_pb2
from kvfence.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TOK = ByteTokenizer()
EOS = 2


def stream_of(
    first: int,
    max_new: int,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    tokenizer: Tokenizer = TOK,
    eos_ids: frozenset[int] = frozenset({EOS}),
) -> DecodeStream:
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new, stop=stop, ignore_eos=ignore_eos)
    return DecodeStream(
        RequestRecord("r1", "t1"),
        common_pb2.KvManifest(first_token=first),
        Prompt([5, 6, 7], sampling),
        IncrementalDetokenizer(tokenizer),
        eos_ids,
    )


def relay(stream: DecodeStream, messages: list[list[int]], reason: str) -> list[str]:
    """The text of every client message, the final one last."""
    stream.accept(decode_pb2.DecodeResponse(verified=True))
    texts = []
    for ids in messages:
        out = stream.accept(decode_pb2.DecodeResponse(token_ids=ids))
        assert out is not None
        texts.append(out.text)
    stream.accept(decode_pb2.DecodeResponse(finish_reason=reason))
    texts.append(stream.finish().text)
    return texts


@pytest.mark.parametrize(
    "chunks",
    [["ab", "c", "st"], ["abcs", "t"], ["a", "b", "c", "s", "t"], ["abcst"]],
    ids=["stop in one message", "split over two", "a token a message", "all at once"],
)
def test_the_text_ends_before_the_stop_string_however_it_is_split(chunks: list[str]) -> None:
    """Decode ends with "stop" once "st" appears (its last token is the "t"); the client used to
    get "st" as well. (A token after it is refused: test_cp_decode_stream_ends.)"""
    messages = [TOK.encode(c) for c in chunks]
    first = messages[0][0]
    texts = relay(stream_of(first, 8, stop=("st",)), messages, "stop")
    assert "".join(texts) == "abc"
    assert all("s" not in t for t in texts)  # nothing of the stop string was ever sent early


def test_text_that_only_looked_like_a_stop_string_is_sent_once_it_is_not() -> None:
    messages = [TOK.encode(c) for c in ["ab", "s", "x", "yz"]]  # "s" could start "st": held
    texts = relay(stream_of(messages[0][0], 6, stop=("st",)), messages, "length")
    assert texts[:2] == ["ab", ""] and texts[2] == "sx"
    assert "".join(texts) == "absxyz"  # control: no stop string, nothing cut


def test_without_stop_strings_text_streams_as_it_comes() -> None:
    messages = [TOK.encode(c) for c in ["ab", "st", "6"]]
    assert relay(stream_of(messages[0][0], 5), messages, "length") == ["ab", "st", "6", ""]


def test_the_stop_text_matches_the_colocated_engine() -> None:
    """Same prompt, same stop string: the text the control plane relays from a decode stream is
    the colocated engine's text."""
    engine = ColocatedEngine.from_path(None, page_size=16, num_pages=32)
    prompt = [40, 41, 42, 43, 44]
    [free] = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=12))])
    assert free.finish_reason == "length" and len(free.text) >= 4
    stop = free.text[2:4]  # a stop string this greedy generation is sure to meet
    params = SamplingParams(max_new_tokens=12, stop=(stop,))
    [colo] = engine.generate([GenerationRequest(prompt, params)])
    assert colo.finish_reason == "stop"
    ids = colo.token_ids
    texts = relay(
        stream_of(ids[0], 12, stop=(stop,)), [[t] for t in ids], "stop"
    )  # one token a message, as decode streams at stream_interval 1
    assert "".join(texts) == colo.text


PROMPT = [40, 41, 42, 43, 44]


def checkpoint_with_plain_eos(folder: Path) -> tuple[ColocatedEngine, int]:
    """The tiny model as a checkpoint whose EOS is ``</s>`` not marked special in tokenizer.json,
    with the id of a token its greedy run emits (so the run ends on it): the engine and the id."""
    free = ColocatedEngine.from_path(None, page_size=16, num_pages=32)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    [ref] = free.generate([GenerationRequest(PROMPT, params)])
    eos = ref.token_ids[4]
    shutil.copytree(ensure_tiny_model(), folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    [byte] = [piece for piece, i in vocab.items() if i == eos]
    vocab[byte], vocab["</s>"] = 2, eos  # the byte token takes </s>'s old id
    for added in spec["added_tokens"]:
        if added["content"] == "</s>":
            added["id"], added["special"] = eos, False
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert load_tokenizer(folder).decode([eos]) == "</s>"  # EOS renders: it is not special
    return ColocatedEngine.from_path(folder, page_size=16, num_pages=32), eos


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos ends the run", "eos ignored"])
def test_the_text_of_a_run_ended_by_a_plain_eos_matches_the_colocated_engine(
    tmp_path: Path, ignore_eos: bool
) -> None:
    """The colocated engine never renders the EOS that ended a run; the control plane
    detokenized every id decode sent, so a checkpoint whose EOS is not marked special ended the
    client's text with "</s>". With ignore_eos (the control) the EOS is an ordinary token: both
    render it."""
    engine, eos = checkpoint_with_plain_eos(tmp_path / "ckpt")
    params = SamplingParams(max_new_tokens=12, ignore_eos=ignore_eos)
    [colo] = engine.generate([GenerationRequest(PROMPT, params)])
    assert colo.finish_reason == ("length" if ignore_eos else "eos")
    assert eos in colo.token_ids and ("</s>" in colo.text) == ignore_eos
    ids = colo.token_ids
    stream = stream_of(
        ids[0],
        12,
        ignore_eos=ignore_eos,
        tokenizer=load_tokenizer(tmp_path / "ckpt"),
        eos_ids=frozenset(engine.loaded.eos_token_ids),
    )
    stream.accept(decode_pb2.DecodeResponse(verified=True))
    relayed = [stream.accept(decode_pb2.DecodeResponse(token_ids=[t])) for t in ids]
    assert [t for out in relayed if out is not None for t in out.token_ids] == ids  # EOS too
    stream.accept(decode_pb2.DecodeResponse(finish_reason=colo.finish_reason))
    texts = [out.text for out in relayed if out is not None] + [stream.finish().text]
    assert "".join(texts) == colo.text


@pytest.mark.parametrize(
    "messages, reason, max_new, ignore_eos, ok",
    [
        ([[70, 71]], "length", 2, False, True),  # control: as many as asked
        ([[70, 71]], "length", 8, False, False),  # a truncated answer passed off as complete
        ([[70, EOS]], "eos", 8, False, True),  # control
        ([[70, 71]], "eos", 8, False, False),  # no EOS came
        ([[70, EOS]], "eos", 8, True, False),  # EOS was to be ignored
        ([], "length", 8, False, False),  # no token at all (not even prefill's)
        ([[70, 71]], "banana", 8, False, False),  # not a finish reason
        ([[70, 71]], "stop", 8, False, False),  # no stop string was asked for
    ],
)
def test_a_finish_the_tokens_do_not_bear_out_is_data_loss(
    messages: list[list[int]], reason: str, max_new: int, ignore_eos: bool, ok: bool
) -> None:
    stream = stream_of(70, max_new, ignore_eos=ignore_eos)
    if ok:
        relay(stream, messages, reason)
        assert stream.finish_reason == reason
    else:
        with pytest.raises(IntegrityError) as err:
            relay(stream, messages, reason)
        assert err.value.reason == "FINISH_REASON"


class WholeTextStream(DecodeStream):
    """DecodeStream as it was: every message searched the whole text and sliced every suffix."""

    def _text(self, final: bool) -> str:
        stops = list(self.prompt.sampling.stop)
        cut = old_find_stop(self.text, stops) if stops else None
        if cut is not None:
            end = cut
        elif final or not stops:
            end = len(self.text)
        else:
            end = old_stream_safe_len(self.text, stops)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_every_message_relays_the_text_it_relayed_when_it_searched_the_whole_text(
    data: st.DataObject,
) -> None:
    """The stop strings are looked for in the new text only, and the held-back suffix found from
    the last characters only: the same text in every message as before."""
    text = data.draw(st.text(alphabet="abcé€\ufffd", min_size=1, max_size=40))
    ids = TOK.encode(text)
    if data.draw(st.booleans()):  # bytes of a character cut short, somewhere
        ids.insert(data.draw(st.integers(0, len(ids))), TOK.encode("€")[0])
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=8))) | {len(ids)})
    whole = TOK.decode(ids)
    stops = tuple(
        data.draw(st.lists(st.one_of(
            st.text(alphabet="abcé€\ufffd", min_size=1, max_size=6),
            st.tuples(st.integers(0, len(whole)), st.integers(1, 8)).map(
                lambda t: whole[t[0] : t[0] + t[1]]
            ).filter(bool),
        ), max_size=16))
    )  # fmt: skip
    # Decode ends the run at the first token after which its text holds a stop string.
    stopped = [old_find_stop(TOK.decode(ids[:k]), list(stops)) for k in range(1, len(ids) + 1)]
    end = next((k + 1 for k, at in enumerate(stopped) if at is not None), None)
    reason = "length" if end is None else "stop"
    ids = ids if end is None else ids[:end]
    cuts = sorted({min(c, len(ids)) for c in cuts})
    messages = [ids[a:b] for a, b in zip([0, *cuts], cuts, strict=False) if ids[a:b]]
    sampling = common_pb2.SamplingParams(max_new_tokens=len(ids), stop=stops)
    got, want = (
        relay(
            cls(RequestRecord("r1", "t1"), common_pb2.KvManifest(first_token=ids[0]),
                Prompt([5, 6, 7], sampling), IncrementalDetokenizer(TOK), frozenset({EOS})),
            messages, reason,
        )
        for cls in (DecodeStream, WholeTextStream)
    )  # fmt: skip
    assert got == want
