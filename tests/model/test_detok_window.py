"""The window kvfence.detok decodes stays short whatever the model outputs: runs of bytes that never
complete a character (byte fallback's ``<0x..>`` and byte-level tokens alike), ids the tokenizer
cannot render, special tokens, replacement characters that are real text, long valid runs of
byte-fallback tokens and pieces that all split characters no longer make every step decode every
id since the last boundary, while the text is still ``tokenizer.decode(every id)``.

``PYTHONPATH=.:tests .venv/bin/python tests/model/test_detok_window.py`` prints the ids decoded
per step at steps 100, 1000 and 2000 of each run below, and their maximum and mean."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stop_reference import CountingDecode, byte_level_tokenizer, sentencepiece_tokenizer

from kvfence.detok import REPLACEMENT, WINDOW_CAP, IncrementalDetokenizer, StopWatch
from kvfence.model.tiny import ensure_tiny_model
from kvfence.tokenizer import ByteTokenizer, Tokenizer, _bytes_to_unicode, load_tokenizer

STEPS = 2000


def byte_id(b: int) -> int:
    """The token of byte b in every tokenizer here (and Llama 2's ``<0xXX>``): id 3 + b."""
    return 3 + b


def pieces(tok: Tokenizer, parts: list[bytes]) -> list[int]:
    """Each part of the bytes as one byte-level piece where the vocabulary has it, else as bytes."""
    inner = getattr(tok, "_tok", None)
    to_char = _bytes_to_unicode()
    ids = []
    for part in parts:
        found = inner.token_to_id("".join(to_char[b] for b in part)) if inner else None
        byte_level = found is not None and inner.decoder.__class__.__name__ == "ByteLevel"
        ids += [found] if byte_level else [byte_id(b) for b in part]
    return ids


# "中文" in pieces that each end with the start of a character: no boundary between two of them
# is a character's.
STRADDLING = [b"\xe4\xb8", *[b"\xad\xe6\x96", b"\x87\xe4\xb8"] * STEPS]

# What a model could be made to output, for STEPS tokens: (name, ids for a tokenizer).
RUNS: dict[str, Callable[[Tokenizer], list[int]]] = {
    # A continuation byte with nothing to continue: U+FFFD each, forever.
    "invalid bytes": lambda tok: [byte_id(0x80)] * STEPS,
    # A byte no UTF-8 text has, after valid text.
    "text then 0xFF": lambda tok: [byte_id(0x41)] * 10 + [byte_id(0xFF)] * STEPS,
    # Lead bytes that the next lead byte cuts off: U+FFFD each.
    "cut-off leads": lambda tok: [byte_id(0xE2)] * STEPS,
    # Valid 4-byte characters as bytes (an emoji the vocabulary lacks, in byte fallback).
    "emoji bytes": lambda tok: [byte_id(b) for b in "😀".encode()] * STEPS,
    # Valid and invalid bytes mixed.
    "mixed bytes": lambda tok: [byte_id(b) for b in b"\xe2\x82\xac\x80A\xf0\x9f"] * STEPS,
    # Ids past the vocabulary (a padded model vocabulary): U+FFFD each.
    "unrenderable": lambda tok: [tok.vocab_size + 5] * STEPS,
    # U+FFFD as real text, as the tokenizer encodes it (a piece, or its three bytes).
    "U+FFFD text": lambda tok: tok.encode(REPLACEMENT * STEPS),
    # Valid text in pieces that all split characters (where the vocabulary has them).
    "straddling": lambda tok: pieces(tok, STRADDLING),
    # Special tokens render as nothing.
    "specials": lambda tok: [byte_id(0x41), 1] + [1] * STEPS,
}


def tokenizer(kind: str, folder: Path) -> Tokenizer:
    if kind == "tiny":
        return load_tokenizer(ensure_tiny_model())
    if kind == "byte":
        return ByteTokenizer()
    if kind == "byte-level":
        return byte_level_tokenizer(folder)
    return sentencepiece_tokenizer(folder, strip=kind == "sentencepiece")


KINDS = ["tiny", "byte", "byte-level", "sentencepiece", "sentencepiece-nostrip"]


def ids_decoded_per_step(
    tok: Tokenizer,
    ids: list[int],
    decode: Callable[[list[int]], str] | None = None,
    check_every: int = 0,
) -> list[int]:
    """What the engine does after every token (kvfence.model.scheduler, decode_svc.batcher): push
    it to a StopWatch on ``tok`` (or on ``decode``, a function over it) and read the text; the ids
    given to ``tok.decode`` per step. Every ``check_every`` steps and at the end, the text must
    be the full decode."""
    spy = CountingDecode(tok)
    watch = StopWatch(decode or tok, ["\x00never"])
    per_step = []
    for n in range(1, len(ids) + 1):
        before = sum(spy.decoded)
        assert watch.push(ids[n - 1 : n]) is None
        text = watch.text()
        per_step.append(sum(spy.decoded) - before)
        if check_every and (n % check_every == 0 or n == len(ids)):
            assert text == tok.decode(ids[:n]), n
    return per_step


def measure() -> None:
    with tempfile.TemporaryDirectory() as folder:
        print(f"{'tokenizer':22} {'run':16} {'step 100':>9} {'step 1000':>9} {'step 2000':>9}"
              f" {'max':>6} {'mean':>6}")  # fmt: skip
        for kind in KINDS:
            for name, make in RUNS.items():
                tok = tokenizer(kind, Path(folder))
                ids = make(tok)[:STEPS]
                per_step = ids_decoded_per_step(tok, ids)
                at = [per_step[i - 1] if i <= len(per_step) else None for i in (100, 1000, 2000)]
                stats = f" {max(per_step):>6} {sum(per_step) / len(per_step):>6.1f}"
                print(f"{kind:22} {name:16} " + " ".join(f"{a!s:>9}" for a in at) + stats)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


# Per step: the window (at most WINDOW_CAP + 1 ids past a context of one id) once, and when a
# cut is forced a few more decodes of it (at worst, lossy UTF-8: both sides of 4 places to cut).
BOUND = 5 * (WINDOW_CAP + 2)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("kind", KINDS)
def test_the_ids_decoded_per_step_stay_bounded(folder: Path, kind: str, run: str) -> None:
    tok = tokenizer(kind, folder)
    ids = RUNS[run](tok)[:STEPS]
    per_step = ids_decoded_per_step(tok, ids, check_every=250)  # and the text is the decode's
    assert len(per_step) == STEPS
    assert max(per_step) <= BOUND, (max(per_step), per_step.index(max(per_step)))
    assert sum(per_step) / STEPS <= WINDOW_CAP, sum(per_step) / STEPS
    assert max(per_step[-500:]) <= max(per_step[:500])  # the same at step 2000 as at 100


def test_the_count_sees_a_window_that_grows(folder: Path) -> None:
    """Positive control: through a decode function kvfence.detok cannot reason about, every step
    decodes every id (what every run above cost before)."""
    tok = tokenizer("tiny", folder)
    ids = RUNS["invalid bytes"](tok)[:STEPS]
    per_step = ids_decoded_per_step(tok, ids, decode=lambda ids: tok.decode(ids))
    assert per_step[99] >= 100 and per_step[999] >= 1000 and per_step[1999] >= 2000


LOSSY = ["tiny", "byte", "byte-level"]
FALLBACK = ["sentencepiece", "sentencepiece-nostrip"]
SOME_BYTES = st.binary(max_size=12) | st.lists(
    st.sampled_from([0x41, 0x20, 0x80, 0xBF, 0xC0, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xED, 0xA0,
                     0xEF, 0xBD, 0xF0, 0x9F, 0x98, 0xF4, 0x90, 0xFF]),
    max_size=12,
).map(bytes)  # fmt: skip


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=SOME_BYTES)
def test_bytes_decode_as_the_module_argues(folder: Path, raw: bytes) -> None:
    """What the forced cuts rest on, asked of the tokenizers themselves: byte-level decoding is
    Python's errors="replace" (one U+FFFD per maximal subpart), and a byte-fallback group is its
    text when all of it is valid, else one U+FFFD per byte."""
    for kind in LOSSY:
        tok = tokenizer(kind, folder)
        assert tok.decode([byte_id(b) for b in raw]) == raw.decode("utf-8", "replace"), kind
    for kind in FALLBACK:
        tok = tokenizer(kind, folder)
        try:
            want = raw.decode("utf-8")
        except UnicodeDecodeError:
            want = REPLACEMENT * len(raw)
        if kind == "sentencepiece" and want.startswith(" "):
            want = want[1:]  # Strip: one leading space of the run
        assert tok.decode([byte_id(b) for b in raw]) == want, kind


def test_one_byte_turns_a_thousand_valid_fallback_bytes_into_u_fffd(folder: Path) -> None:
    """A byte-fallback group is not settled by being long: the text of its first byte depends on
    its last. The detokenizer keeps it (within a short window) as text that can still change."""
    for kind in FALLBACK:
        tok = tokenizer(kind, folder)
        ids = [byte_id(0x41)] * 1000 + [byte_id(0x80)]
        assert tok.decode(ids[:-1]) == "A" * 1000
        assert tok.decode(ids) == REPLACEMENT * 1001
        spy = CountingDecode(tok)
        watch = StopWatch(tok, [REPLACEMENT * 2])
        for n in range(1, len(ids) + 1):
            before = sum(spy.decoded)
            hit = watch.push(ids[n - 1 : n])
            assert sum(spy.decoded) - before <= BOUND
            assert watch.text() == tok.decode(ids[:n]), (kind, n)
            if n < len(ids):
                assert hit is None and watch.detok.stable_len == 0  # nothing of it is final
        assert hit == 0  # the whole text turned at once
        # The byte-level decode keeps the valid bytes: only the last one is U+FFFD.
        assert tokenizer("tiny", folder).decode(ids) == "A" * 1000 + REPLACEMENT


@pytest.mark.parametrize("kind", FALLBACK)
def test_a_long_valid_group_becomes_final_when_it_closes(folder: Path, kind: str) -> None:
    tok = tokenizer(kind, folder)
    emoji = [byte_id(b) for b in "😀".encode()] * 100
    piece = tok.encode("a")[-1]
    ids = [*emoji, piece, *emoji, byte_id(0xE2), piece]  # the second group ends cut off
    detok = IncrementalDetokenizer(tok)
    emitted = ""
    for n in range(1, len(ids) + 1):
        emitted += detok.push(ids[n - 1 : n])
        assert detok.text() == tok.decode(ids[:n]), n
        assert emitted == detok.text()[: detok.stable_len]
    assert emitted == "😀" * 100 + "a" + REPLACEMENT * 401 + "a"


if __name__ == "__main__":
    sys.exit(measure())
