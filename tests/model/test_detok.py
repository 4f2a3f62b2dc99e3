"""Incremental detokenization (kvfence.detok): after every token, the text it keeps is exactly
``tokenizer.decode(all ids)`` for every tokenizer it treats incrementally (byte fallback,
byte-level BPE, the byte tokenizer), the stop strings it finds are the ones a search of that whole
text finds, and the rewritten ``find_stop``/``stream_safe_len`` answer as the old ones did."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stop_reference import (
    TEXT_PIECES,
    byte_level_tokenizer,
    old_find_stop,
    old_stream_safe_len,
    sentencepiece_tokenizer,
)

from kvfence.detok import WINDOW_CAP, GrowingText, IncrementalDetokenizer, StopWatch, cut_rule
from kvfence.model.sampling import find_stop, stream_safe_len
from kvfence.model.tiny import ensure_tiny_model
from kvfence.tokenizer import ByteTokenizer, HFTokenizer, _bytes_to_unicode, load_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("tokenizers")
    return {
        "tiny": load_tokenizer(ensure_tiny_model()),
        "byte": ByteTokenizer(),
        "byte-level": byte_level_tokenizer(folder),
        "sentencepiece": sentencepiece_tokenizer(folder),
        "sentencepiece-nostrip": sentencepiece_tokenizer(folder, strip=False),
    }


FIXTURES = [HealthCheck.function_scoped_fixture]  # the tokenizers, built once per module
KINDS = ["tiny", "byte", "byte-level", "sentencepiece", "sentencepiece-nostrip"]


def ids_for(tok: object) -> st.SearchStrategy[list[int]]:
    """Random ids, weighted towards UTF-8 lead and continuation bytes and past the vocabulary, or
    runs of byte tokens (byte b is id 3 + b in every tokenizer here) among them."""
    size = tok.vocab_size  # type: ignore[attr-defined]
    utf8 = [3 + b for b in (0x41, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80)]
    one = st.one_of(
        st.integers(0, size + 8),  # anything, unrenderable ids included
        st.sampled_from([0, 1, 2, *utf8]),  # specials and bytes of multi-byte characters
        st.integers(max(0, size - 30), size - 1),  # the added tokens and the last pieces
    )
    # A pattern of byte chunks, repeated: runs that are never valid, that stay valid for long (a
    # byte-fallback group that a later byte can still turn invalid), and mixes of both.
    run = st.tuples(
        st.lists(st.sampled_from(BYTE_CHUNKS), min_size=1, max_size=4), st.integers(1, 25)
    ).map(lambda t: [3 + b for _ in range(t[1]) for chunk in t[0] for b in chunk])
    runs = st.lists(st.one_of(one.map(lambda i: [i]), run, text_in_pieces(tok)), max_size=8)
    return st.one_of(
        st.lists(one, max_size=40), runs.map(lambda parts: [i for p in parts for i in p][:160])
    )


@st.composite
def text_in_pieces(draw: st.DrawFn, tok: object) -> list[int]:
    """Text cut into the tokenizer's pieces at random places: on the byte-level tokenizer, pieces
    that begin inside one character and end inside the next, one after the other (on the
    others, its bytes)."""
    text = "".join(draw(st.lists(st.sampled_from(["中文", "中", "😀", "€", "é", "a", " "]))))
    raw = text.encode()
    byte_level = isinstance(tok, HFTokenizer) and b'"ByteLevel"' in tok._tok.decoder.__getstate__()
    vocab = tok._tok.get_vocab() if byte_level else {}
    to_char = _bytes_to_unicode()
    ids, at = [], 0
    while at < len(raw):
        n = draw(st.integers(1, 6))
        while n > 1 and "".join(to_char[b] for b in raw[at : at + n]) not in vocab:
            n -= 1
        piece = "".join(to_char[b] for b in raw[at : at + n])
        ids.append(vocab.get(piece, 3 + raw[at]))  # one byte: 3 + b
        at += n
    return ids


BYTE_CHUNKS = [
    b"\x80", b"\xff", b"\xc0", b"\xe2", b"\xed\xa0",  # never valid, or cut off by what follows
    b"\xe2\x82", b"\xf0\x9f\x98",  # the start of a character
    "😀".encode(), "€".encode(), "é".encode(), b"A", b" ", "\ufffd".encode(),  # whole characters
]  # fmt: skip
# How long a window may grow before a cut is forced: one id (a forced cut at every chance) up to
# the default.
CAPS = st.sampled_from([1, 2, 3, 4, 5, 8, WINDOW_CAP])


def test_the_supported_tokenizers_are_incremental_and_others_fall_back(tokenizers: dict) -> None:
    for kind in KINDS:
        assert IncrementalDetokenizer(tokenizers[kind]).exact, kind
        assert IncrementalDetokenizer(tokenizers[kind].decode).exact, kind  # the bound method
    # Anything else: the full decode every time, as before (and another decoder, below).
    assert cut_rule(object()) is None
    assert not IncrementalDetokenizer(lambda ids: "x" * len(ids)).exact
    assert not IncrementalDetokenizer(_Subclass()).exact  # a decode that was overridden


class _Subclass(ByteTokenizer):
    def decode(self, ids: Sequence[int]) -> str:
        return super().decode(ids).upper()


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_the_incremental_text_is_the_full_decode_after_every_token(
    tokenizers: dict, kind: str, data: st.DataObject
) -> None:
    tok = tokenizers[kind]
    ids = data.draw(ids_for(tok))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    detok = IncrementalDetokenizer(tok, window_cap=data.draw(CAPS))
    emitted, n = "", 0
    while n < len(ids):
        step = ids[n : n + chunks[n]]
        n += len(step)
        emitted += detok.push(step)
        text = tok.decode(ids[:n])
        assert detok.text() == text, (ids[:n], detok.text(), text)
        for pos in (0, detok.stable_len, len(text) // 2, len(text) + 1):
            assert detok.text_from(pos) == text[pos:]
        assert emitted == text[: detok.stable_len]  # what was emitted is that text's beginning
    assert emitted + detok.flush() == tok.decode(ids)  # the control plane's whole text


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_the_stable_text_never_changes(tokenizers: dict, kind: str, data: st.DataObject) -> None:
    tok = tokenizers[kind]
    ids = data.draw(ids_for(tok))
    detok = IncrementalDetokenizer(tok, window_cap=data.draw(CAPS))
    stable: list[str] = []
    for i in ids:
        detok.push([i])
        stable.append(detok.text()[: detok.stable_len])
    final = tok.decode(ids)
    assert all(final.startswith(s) for s in stable)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_stop_strings_are_found_where_a_search_of_the_whole_text_finds_them(
    tokenizers: dict, kind: str, data: st.DataObject
) -> None:
    tok = tokenizers[kind]
    ids = data.draw(ids_for(tok))
    whole = tok.decode(ids)
    # Stop strings the text contains (pieces of it), and ones it may not.
    spans = data.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=3))
    stops = [whole[a : a + n] for a, n in spans if whole[a : a + n]]
    stops += data.draw(st.lists(st.sampled_from([*TEXT_PIECES, "é€", "b中"]), max_size=3))
    watch = StopWatch(tok, stops, window_cap=data.draw(CAPS))
    for n in range(1, len(ids) + 1):
        want = old_find_stop(tok.decode(ids[:n]), stops) if stops else None
        got = watch.push(ids[watch.token_count : n])
        assert got == want, (ids[:n], stops)
        if want is not None:
            break  # the sequence ends at its first stop string
        assert watch.text() == tok.decode(ids[:n])


@settings(max_examples=2000, deadline=None)
@given(
    text=st.text(alphabet="ab\ufffdc", max_size=30),
    stops=st.lists(st.text(alphabet="ab\ufffdc", max_size=12), max_size=4),
)
def test_stream_safe_len_and_find_stop_answer_as_before(text: str, stops: list[str]) -> None:
    assert stream_safe_len(text, stops) == old_stream_safe_len(text, stops)
    assert find_stop(text, stops) == old_find_stop(text, stops)  # empty stop strings too
    for start in range(len(text) + 1):
        # The contract: occurrences that end after start, the earliest of them.
        ends_after = [
            i for s in stops for i in range(len(text) - len(s) + 1)
            if text.startswith(s, i) and i + len(s) > start
        ]  # fmt: skip
        if start == 0:
            continue  # start 0 is the whole search (an empty stop string matches at 0)
        assert find_stop(text, stops, start) == (min(ends_after) if ends_after else None)


def test_stream_safe_len_holds_back_what_could_grow_into_a_stop_string() -> None:
    stops = ["x" * 255 + "y", "ab" * 100 + "c"]
    assert stream_safe_len("hello " + "x" * 300, stops) == 6 + 300 - 255
    assert stream_safe_len("hello " + "ab" * 150, stops) == 6 + 300 - 200
    assert stream_safe_len("hello " + "ab" * 150 + "\ufffd\ufffd", stops) == 6 + 300 - 200
    assert stream_safe_len("hello", stops) == 5  # control: nothing to hold
    assert stream_safe_len("hex", ["", "x"]) == 3  # an empty stop string holds nothing


def tiny_json_with(decoder: dict) -> str:
    spec = json.loads((ensure_tiny_model() / "tokenizer.json").read_text())
    spec["decoder"] = decoder
    return json.dumps(spec)


def test_a_decoder_not_argued_for_falls_back_to_the_full_decode(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    path.write_text(tiny_json_with(metaspace))
    tok = HFTokenizer(path)
    detok = IncrementalDetokenizer(tok)
    assert not detok.exact and detok.stable_len == 0
    ids = [3 + b for b in "héllo".encode()]
    for n in range(1, len(ids) + 1):
        detok.push(ids[n - 1 : n])
        assert detok.text() == tok.decode(ids[:n])


@pytest.mark.parametrize("build", [sentencepiece_tokenizer, byte_level_tokenizer])
def test_the_cache_of_what_a_tokenizer_is_does_not_keep_it_alive(build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tok = build(tmp_path)
    detok = IncrementalDetokenizer(tok)
    detok.push([3 + 0x41, 3 + 0x80])
    assert detok.exact and cut_rule(tok) is not None
    gone = weakref.ref(tok)
    del tok, detok
    gc.collect()
    assert gone() is None


@settings(max_examples=500, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab€\ufffd", max_size=7), max_size=30),
    block=st.integers(1, 12),
)
def test_growing_text_reads_as_the_string_it_stands_for(pieces: list[str], block: int) -> None:
    with mock.patch.object(GrowingText, "BLOCK", block):
        text, whole = GrowingText(), ""
        for piece in pieces:
            text.append(piece)
            whole += piece
            assert len(text) == len(whole) and str(text) == whole
            for start in range(len(whole) + 2):
                assert text.tail(start) == whole[start:]
                for end in (max(0, start - 1), start, start + 1, start + 5, len(whole) + 1):
                    assert text.slice(start, end) == whole[start:end]


def test_the_final_text_is_not_rebuilt_per_token() -> None:
    """``self._final += piece`` copied the whole text at every push (about 47 us a token at 160k
    tokens in the control plane): the text that is final is a GrowingText, whose text once in a
    block stays that very string however much follows."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = [3 + b for b in ("héllo wörld " * 1000).encode()]
    for i in ids[: len(ids) // 2]:
        detok.push([i])
    final = detok._final
    assert isinstance(final, GrowingText)
    blocks = list(final._blocks)
    assert blocks  # past GrowingText.BLOCK characters
    for i in ids[len(ids) // 2 :]:
        detok.push([i])
    assert detok._final is final and all(
        a is b for a, b in zip(blocks, final._blocks, strict=False)
    )
    assert detok.text() == tok.decode(ids)  # the control: the same text


@pytest.mark.parametrize("kind", ["tiny", "byte", "sentencepiece"])
@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURES)
@given(data=st.data())
def test_the_incremental_text_is_the_full_decode_across_blocks(
    tokenizers: dict, kind: str, data: st.DataObject
) -> None:
    """As test_the_incremental_text_is_the_full_decode_after_every_token, with the final text in
    blocks of a few characters (text_from reads across them)."""
    tok = tokenizers[kind]
    ids = data.draw(ids_for(tok))
    with mock.patch.object(GrowingText, "BLOCK", data.draw(st.integers(1, 4))):
        detok = IncrementalDetokenizer(tok, window_cap=data.draw(CAPS))
        for n in range(1, len(ids) + 1):
            detok.push(ids[n - 1 : n])
            text = tok.decode(ids[:n])
            assert detok.text() == text
            for pos in range(len(text) + 2):
                assert detok.text_from(pos) == text[pos:]
        detok.flush()
        assert detok.text() == tok.decode(ids)
