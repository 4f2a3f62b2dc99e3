"""Incremental detokenization that never emits half a character, and the text it stands for.

Decoding token by token breaks multi-byte characters (a byte-level token is often a fragment of a
UTF-8 sequence) and merges that depend on the next token. So the text of the tokens since the last
emitted boundary is decoded as a whole (with a few tokens before that boundary as context, the
window of vLLM's detokenizer), and new text is emitted only when it does not end in the
replacement character, i.e. when the pending bytes form complete characters, or, once the window
has grown past ``WINDOW_CAP`` ids, up to where the text provably cannot change any more (invalid
bytes are U+FFFD in the whole decode too).

The decode node and the colocated scheduler look for stop strings in ``tokenizer.decode(ids)``
after every token; decoding every id at every step costs each sequence of the batch time that
grows with its length. :class:`IncrementalDetokenizer` gives the same text from a short window
(``text()``, ``text_from()``) and tells how much of it can never change again (``stable_len``),
where it can prove that; :class:`StopWatch` searches only what is new. The text that is final
is kept in a :class:`GrowingText`, not rebuilt as one string per token.

Why the windowed text is ``tokenizer.decode(ids)`` exactly
-----------------------------------------------------------
Write ``D(xs)`` for ``decode(xs)``. The detokenizer keeps the text ``final`` of the ids up to the
last *cut*, a short list of context ids ``ctx`` and the ids ``win`` pushed since the cut, and per
push decodes ``W = D(ctx + win)``; the current text is ``final + W[len(D(ctx)):]``. That is exact
when, for every later list of ids ``F``, ``D(ctx + win + F)[len(D(ctx)):]`` is what the whole
decode has after ``final``: the text up to a cut never changes, and the window's view of what
follows is the whole decode's. Each cut below picks its ``ctx`` so that this holds. It is argued
for the decoders below, and only those get cuts (``exact``); any other tokenizer keeps the
emitting behaviour it always had (its ``ctx`` is every id of the last cut's window) but answers
``text()`` with a full decode and ``stable_len`` 0 (the old cost, never a different text).

Special tokens render as nothing wherever they stand (``skip_special_tokens``; the byte tokenizer's
ids 0-2), so ``D`` of a list is ``D`` of it without them: they never enter ``win``.

* ``kvfence.tokenizer.ByteTokenizer`` and an ``HFTokenizer`` whose decoder is ``ByteLevel`` (GPT-2,
  Llama 3, Qwen2, the embedded tiny model): each token stands for fixed bytes, and the text is the
  lossy UTF-8 decoding of their concatenation; an id the tokenizer cannot render is U+FFFD and
  starts a new run of bytes. Lossy UTF-8 (Python's and Rust's ``from_utf8_lossy`` both replace
  each *maximal subpart*: the longest start of a valid sequence, or one byte) reads left to right,
  and decides where a character or subpart ends from at most the byte after it. A cut is made
  where the text is known to restart, with no context (``ctx = []``):

  - after ``win`` when ``W`` grew and does not end in U+FFFD: its last character is complete, and
    nothing after it can extend it;
  - *forced*, once ``win`` is longer than ``WINDOW_CAP``, at the first of these found near its
    end (before one of its last four ids, or inside one), the text before it being final:

    - before a byte that is not a continuation byte (0x80-0xBF), i.e. before an id whose bytes
      begin with one, or inside an id, before its last such byte: nothing before such a byte can
      take it in, so a character or subpart starts there whatever surrounds it. Inside an id,
      the window then starts with the tokens of that id's bytes from there on (every byte-level
      vocabulary has one per byte), and the text before them is ``W`` less the window's text;
    - before or after an id the tokenizer cannot render: the run of bytes ends there;
    - before ``win[r]`` when ``D(win[:r]) + D(win[r:]) == W``. If a subpart straddled that
      point, its part after it (continuation bytes, at least one) would decode on its own as one
      U+FFFD per byte, and the sum would be longer than ``W``; so a character or subpart ends
      exactly there, decided by bytes already pushed (``win[r:]`` renders as something, so it
      has a byte or breaks the run). This settles runs of continuation bytes.

    Runs of invalid bytes, of ids past the vocabulary or of real U+FFFD characters, which never
    end in anything else, and tokens that each end with the start of the next character, which
    never end a character, are settled so.
* An ``HFTokenizer`` with SentencePiece's decoder chain ``Replace("▁", " "), ByteFallback, Fuse``
  and optionally ``Strip(" ", 1, 0)`` (Llama 2, Mistral): tokens (added ones too) map to text one
  by one except that consecutive ``<0xXX>`` tokens form one *group* that becomes its UTF-8 text if
  the whole group is valid, else one U+FFFD per byte: a later byte can turn "€" back into "���",
  and a thousand valid bytes into a thousand U+FFFD. So a cut needs the last id to be an ordinary
  piece (not ``<0x..>``, as ByteFallback tells them apart): the group before it is then closed for
  good. ``Strip`` removes one leading space of the text of a run (the whole decode, or what
  follows an unrenderable id): the context is that ordinary piece (``ctx = [piece]``), whose own
  text comes first and is never empty before the strip, so the strip never reaches what follows.
  Cuts:

  - after ``win`` when ``W`` grew, does not end in U+FFFD and ``win[-1]`` is an ordinary piece;
  - forced, once ``win`` is longer than ``WINDOW_CAP``: after its last ordinary piece
    (``ctx = [piece]``) or unrenderable id (``ctx = []``: a new run, stripped on its own), the
    group before either closed. If there is neither, ``win`` is one open group of bytes, and

    - if those bytes can no longer start valid UTF-8 (Python's strict incremental decoder
      rejects them), every byte of the group is U+FFFD whatever follows: all of ``win`` is cut,
      and the context is one byte token that no UTF-8 text has (``<0xFF>``, say; a vocabulary
      without one keeps the long window): any later byte of the group joins it in a group as
      invalid as the real one, one U+FFFD per byte;
    - else nothing about the group is final yet: its longest complete run of characters
      ``win[:r]`` is set aside as a *head*, its text if the group stays valid (``D(ctx +
      win[:r])``, stripped as the run's start would be) and its length in bytes, and
      ``win[r:]`` is decoded after an ordinary piece as context. The group's bytes are valid
      exactly when the bytes after ``r`` are (``r`` is a character boundary), which is what that
      window's own group says; the text is ``final`` + the head's text (or one U+FFFD per byte
      of it, when the rest is not valid) + the window's, and the head becomes final, as the
      group then is, at the cut that closes the group (or the flush).

So the window is at most ``WINDOW_CAP`` ids (and those of one push) past a context of one id or
none, and a step decodes it a few times at most. Where no forced cut is found (a byte-level
vocabulary without a token per byte whose tokens all split characters; a byte-fallback one
without an invalid byte token or an ordinary piece), the next try waits until the window has
doubled: the old cost, never a different text.

The property tests in ``tests/model/test_detok.py`` check ``text() == decode(ids)`` after every
token for random id sequences (runs of invalid and valid bytes among them) on all three kinds,
unrenderable, special and added ids included, with windows as short as one id;
``tests/model/test_detok_window.py`` checks that the ids decoded per step stay bounded over
thousands of tokens that never settle on their own.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvfence.model.stops import find_stop

REPLACEMENT = "\ufffd"
# Ids pushed since the last cut past which a cut is forced where the text provably cannot change
# (module docstring). A character is at most 4 bytes, so text that settles on its own is cut long
# before that.
WINDOW_CAP = 32


class Decodes(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


CutRule = Callable[[int], bool]  # whether the text may be cut after this id (besides U+FFFD)


def _always(_: int) -> bool:
    return True


@dataclass(frozen=True)
class _ByteFallback:
    """What a cut in a SentencePiece byte-fallback decode needs to know of its ids."""

    renderable: Callable[[int], bool]
    byte: Callable[[int], int | None]  # the byte of a token ByteFallback reads as one, else None
    doom: int | None  # a byte token that no UTF-8 text has (None: the vocabulary lacks one)
    anchor: int | None  # an ordinary piece (None: no such piece)


@dataclass(frozen=True)
class _Bytes:
    """The bytes of a token in a lossy UTF-8 decode (None for one the tokenizer cannot render),
    and the tokens of single bytes (ids[b] for byte b; None: the vocabulary lacks one)."""

    of: Callable[[int], bytes | None]
    ids: Sequence[int] | None


@dataclass(frozen=True)
class _Kind:
    """A tokenizer whose windowed text is its full decode (module docstring)."""

    closes: CutRule
    skipped: Callable[[int], bool]  # renders as nothing wherever it stands
    fallback: _ByteFallback | None  # None: lossy UTF-8 over the ids' bytes
    raw: _Bytes | None = None  # lossy UTF-8: the ids' bytes


_KINDS: weakref.WeakKeyDictionary[Any, _Kind | None] = weakref.WeakKeyDictionary()
_KINDS_LOCK = threading.Lock()


def _kind(tokenizer: Any) -> _Kind | None:
    """Cached per tokenizer: the control plane builds a detokenizer per request on its event
    loop."""
    with _KINDS_LOCK, contextlib.suppress(KeyError, TypeError):  # TypeError: no weak reference
        return _KINDS[tokenizer]
    kind = _classify(tokenizer)
    with _KINDS_LOCK, contextlib.suppress(TypeError):
        _KINDS[tokenizer] = kind
    return kind


def cut_rule(tokenizer: Any) -> CutRule | None:
    """The extra condition for a cut after an id, or None when the windowed text of this
    tokenizer is not proven to be its full decode (module docstring)."""
    kind = _kind(tokenizer)
    return kind.closes if kind is not None else None


_SENTENCEPIECE_CHAIN = [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_SENTENCEPIECE_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
# ByteFallback's test: 6 bytes, "<0x" and ">" around what Rust's u8::from_str_radix(_, 16) reads.
_FALLBACK_BYTE = re.compile(rb"<0x(\+?[0-9A-Fa-f]+)>")
# Bytes that begin no UTF-8 character: any group that starts with one is invalid.
_NEVER_FIRST = [*range(0xFF, 0xF4, -1), 0xC0, 0xC1, *range(0x80, 0xC0)]


def _fallback_byte(token: str) -> int | None:
    raw = token.replace("\u2581", " ").encode()  # Replace runs before ByteFallback
    match = _FALLBACK_BYTE.fullmatch(raw) if len(raw) == 6 else None
    return int(match[1], 16) if match else None


def _classify(tokenizer: Any) -> _Kind | None:
    from kvfence.tokenizer import BYTE_OFFSET, ByteTokenizer, HFTokenizer

    cls = type(tokenizer)
    # Only the decode this module reasons about: a subclass that decodes otherwise falls back.
    if isinstance(tokenizer, ByteTokenizer) and cls.decode is ByteTokenizer.decode:

        def of(i: int) -> bytes | None:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                return bytes([i - BYTE_OFFSET])
            return b"" if 0 <= i < BYTE_OFFSET else None

        raw = _Bytes(of, range(BYTE_OFFSET, BYTE_OFFSET + 256))
        return _Kind(_always, lambda i: 0 <= i < BYTE_OFFSET, None, raw)
    if not (
        isinstance(tokenizer, HFTokenizer)
        and cls.decode is HFTokenizer.decode
        and cls._renderable is HFTokenizer._renderable
    ):
        return None
    inner = tokenizer._tok
    decoder = inner.decoder
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:
        return None
    # The cache is keyed by the tokenizer weakly: what it keeps must not hold the tokenizer.
    tokenizer_ref = weakref.ref(tokenizer)

    def renderable(i: int) -> bool:
        tok = tokenizer_ref()
        assert tok is not None  # a detokenizer holds its tokenizer's decode
        return bool(tok._renderable(i))

    special = frozenset(i for i, t in inner.get_added_tokens_decoder().items() if t.special)

    def skipped(i: int) -> bool:
        return i in special and renderable(i)

    if spec.get("type") == "ByteLevel":
        return _Kind(_always, skipped, None, _byte_level_bytes(inner, renderable, special))
    chain = spec.get("decoders") if spec.get("type") == "Sequence" else None
    if chain not in (_SENTENCEPIECE_CHAIN, [*_SENTENCEPIECE_CHAIN, _SENTENCEPIECE_STRIP]):
        return None

    def byte(i: int) -> int | None:
        if not renderable(i) or i in special:
            return None
        piece = inner.id_to_token(i)
        return _fallback_byte(piece) if piece is not None else None

    def closes(i: int) -> bool:
        # An ordinary piece (added ones too: the decoder reads their text like any other).
        return renderable(i) and i not in special and byte(i) is None

    doom = next(
        (i for b in _NEVER_FIRST if (i := inner.token_to_id(f"<0x{b:02X}>")) is not None
         and byte(i) == b),
        None,
    )  # fmt: skip
    anchor = next((i for i in range(tokenizer.vocab_size) if closes(i)), None)
    return _Kind(closes, skipped, _ByteFallback(renderable, byte, doom, anchor))


def _byte_level_bytes(
    inner: Any, renderable: Callable[[int], bool], special: frozenset[int]
) -> _Bytes:
    """The bytes of a token as the ByteLevel decoder takes them: its characters mapped back to
    the bytes they stand for, or its UTF-8 when one of them stands for none."""
    from kvfence.tokenizer import _bytes_to_unicode

    to_char = _bytes_to_unicode()
    to_byte = {c: b for b, c in to_char.items()}

    def of(i: int) -> bytes | None:
        if not renderable(i):
            return None
        if i in special:
            return b""
        piece = inner.id_to_token(i)
        if piece is None:
            return None
        if all(c in to_byte for c in piece):
            return bytes(to_byte[c] for c in piece)
        return str(piece).encode()

    ids = [inner.token_to_id(to_char[b]) for b in range(256)]
    if any(i is None or of(i) != bytes([b]) for b, i in enumerate(ids)):
        return _Bytes(of, None)  # a vocabulary without every byte: no cuts inside tokens
    return _Bytes(of, ids)


def _decoder_of(tokenizer: Decodes | Callable[[list[int]], str]) -> tuple[Any, Any]:
    """(decode function, the tokenizer it belongs to or None)."""
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode, tokenizer
    owner = getattr(tokenizer, "__self__", None)  # a bound ``tokenizer.decode``
    func = getattr(tokenizer, "__func__", None)
    if owner is not None and func is not None and func is getattr(type(owner), "decode", None):
        return tokenizer, owner
    return tokenizer, None


def _can_be_valid(raw: bytes) -> bool:
    """Whether these bytes may still begin valid UTF-8 (False only when they cannot)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(raw, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _is_valid(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class GrowingText:
    """A text that only grows, a small piece at a time, and is mostly read near its end.

    ``text += piece`` builds a new string of the whole text per piece: over an answer of 160k
    tokens, one piece per token, that is quadratic (about 47 us a token at the end). Here pieces
    are added to a string of the last ``BLOCK`` characters at most, and the text before it is
    kept in blocks of about that size that are never copied again: an append copies at most about
    ``BLOCK`` characters however long the text, a read near the end (``tail``, ``slice``) is one
    slice of that string, and only ``str()`` copies the whole text.
    """

    BLOCK = 1024

    def __init__(self) -> None:
        self._blocks: list[str] = []  # the older text, each block at least BLOCK characters
        self._recent = ""  # the text after the blocks, shorter than BLOCK
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return "".join([*self._blocks, self._recent])

    def append(self, piece: str) -> None:
        if not piece:
            return
        self._len += len(piece)
        if len(self._recent) + len(piece) < self.BLOCK:
            self._recent += piece
        else:
            self._blocks.append(self._recent + piece)
            self._recent = ""

    def tail(self, start: int) -> str:
        """``str(self)[start:]`` for ``start >= 0``, at the cost of that part."""
        want = self._len - start
        recent = self._recent
        if want <= len(recent):
            return recent[len(recent) - want :] if want > 0 else ""
        parts = [recent]
        want -= len(recent)
        for block in reversed(self._blocks):
            if len(block) >= want:
                parts.append(block[len(block) - want :])
                break
            parts.append(block)
            want -= len(block)
        return "".join(reversed(parts))

    def suffix(self, start: int) -> tuple[int, str]:
        """A suffix of the text that begins at ``start`` (``>= 0``) or before: (where it begins,
        its text); the string of the last characters, not a copy, when it reaches that far."""
        begin = self._len - len(self._recent)
        if begin <= start:
            return begin, self._recent
        return start, self.tail(start)

    def slice(self, start: int, end: int) -> str:
        """``str(self)[start:end]`` for ``start, end >= 0``, at the cost of ``str(self)[start:]``
        (nothing when ``end <= start``)."""
        return self.tail(start)[: end - start] if end > start else ""


class IncrementalDetokenizer:
    """Feed token ids as they arrive; get back the text that is final so far."""

    def __init__(
        self, tokenizer: Decodes | Callable[[list[int]], str], window_cap: int = WINDOW_CAP
    ):
        self._decode, owner = _decoder_of(tokenizer)
        self._kind = _kind(owner) if owner is not None else None
        self._cap = max(1, window_cap)
        self._force_at = self._cap  # a longer window gets a forced cut (exact only)
        self._ids: list[int] = []
        self._ctx: list[int] = []  # decoded before the window for context, not emitted again
        self._win: list[int] = []  # the ids since the last cut (special tokens left out, exact)
        self._seen = 0  # len(decode(ctx))
        self._final = GrowingText()  # the text emitted so far (not rebuilt per push)
        self._tail = ""  # exact: the current text past _final
        # Byte fallback: the text of the bytes of an open group set aside from the window (if the
        # group turns out valid), their count, and whether ctx is the invalid byte (doomed group).
        self._head = ""
        self._head_bytes = 0
        self._doomed = False

    @property
    def exact(self) -> bool:
        """Whether text() is the full decode without decoding every id (module docstring)."""
        return self._kind is not None

    @property
    def token_count(self) -> int:
        return len(self._ids)

    @property
    def stable_len(self) -> int:
        """A prefix of text() that no later push can change (0 when not exact)."""
        return len(self._final) if self._kind is not None else 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        if self._kind is None:
            self._win.extend(token_ids)
        else:
            before = len(self._win)
            self._win.extend(i for i in token_ids if not self._kind.skipped(i))
            if len(self._win) == before:
                return ""  # only special tokens: nothing changed
        return self._step(final=False)

    def flush(self) -> str:
        """Whatever is left, replacement characters included (the stream has ended: push no
        more, the text after a flush is no longer a boundary the windows can start from)."""
        return self._step(final=True)

    def text(self) -> str:
        """``decode(every id pushed)``."""
        return self.text_from(0)

    def text_from(self, start: int) -> str:
        """``text()[start:]``; when exact, at the cost of the part after ``start`` only."""
        if self._kind is None:
            return self._decode(self._ids)[start:]
        if start <= len(self._final):
            return self._final.tail(start) + self._tail
        return self._tail[start - len(self._final) :]

    def _text_of(self, ids: list[int]) -> str:
        return self._decode(ids) if ids or self._kind is None else ""

    def _step(self, final: bool) -> str:
        kind = self._kind
        window = self._decode(self._ctx + self._win)
        head = self._head_now(self._win)
        grew = len(window) > self._seen
        if (final and (grew or head)) or (
            not final
            and grew
            and not window.endswith(REPLACEMENT)
            and (kind is None or kind.closes(self._win[-1]))
        ):
            new = head + window[self._seen :]
            if kind is None or final:
                ctx = self._win  # the emitting behaviour it always had
            else:
                ctx = [] if kind.fallback is None else self._win[-1:]
            self._cut(ctx)
            self._final.append(new)
            self._tail = ""
            return new
        new = ""
        if kind is not None and not final and len(self._win) > self._force_at:
            new, window = self._force(window)
            head = self._head_now(self._win)
            self._force_at = max(self._cap, 2 * len(self._win))  # if it could not cut: rarely
        self._tail = head + window[self._seen :]
        return new

    def _cut(self, ctx: list[int]) -> None:
        self._ctx, self._win = ctx, []
        self._seen = len(self._text_of(ctx))
        self._head, self._head_bytes, self._doomed = "", 0, False
        self._force_at = self._cap

    def _force(self, window: str) -> tuple[str, str]:
        """A forced cut (module docstring): (the text it made final, the new window's text)."""
        assert self._kind is not None
        fallback = self._kind.fallback
        if fallback is None:
            win, known = self._win, self._kind.raw
            if known is None or self._ctx:  # (a context only after a flush)
                return "", window
            places = range(len(win) - 1, max(0, len(win) - 5), -1)  # before one of the last 4 ids
            for r in places:  # before a byte nothing takes in, or where a run breaks
                here, before = known.of(win[r]), known.of(win[r - 1])
                if here is None or before is None or (here and not 0x80 <= here[0] < 0xC0):
                    return self._cut_lossy(self._decode(win[:r]), win[r:])
            byte_ids = known.ids or []
            for r in range(len(win) - 1, max(-1, len(win) - 5), -1):  # inside one of those ids
                token = (known.of(win[r]) or b"") if byte_ids else b""
                q = max((k for k, b in enumerate(token) if not 0x80 <= b < 0xC0), default=0)
                if q > 0:
                    rest_ids = [byte_ids[b] for b in token[q:]] + win[r + 1 :]
                    rest = self._decode(rest_ids)
                    if window.endswith(rest):  # what the argument says: never fails
                        return self._cut_lossy(window[: len(window) - len(rest)], rest_ids, rest)
            for r in places:  # where the decodes of both sides make the window's
                done, rest = self._decode(win[:r]), self._decode(win[r:])
                if rest and done + rest == window:
                    return self._cut_lossy(done, win[r:], rest)
            return "", window
        new = ""
        while len(self._win) > self._cap:
            win = self._win
            last = max((j for j, i in enumerate(win) if fallback.byte(i) is None), default=-1)
            if last >= 0:  # after the last ordinary piece or unrenderable id
                r = last + 1
                done = self._head_now(win[:r]) + self._decode(self._ctx + win[:r])[self._seen :]
                self._cut([win[last]] if fallback.renderable(win[last]) else [])
                self._win = win[r:]
            else:  # one open group of bytes
                raw = bytes(b for i in win if (b := fallback.byte(i)) is not None)
                if self._doomed or not _can_be_valid(raw):
                    if fallback.doom is None:
                        break
                    done = REPLACEMENT * self._head_bytes
                    done += self._decode(self._ctx + win)[self._seen :]
                    self._cut([fallback.doom])
                    self._doomed = True
                else:
                    r = next((k for k in range(len(raw), 0, -1) if _is_valid(raw[:k])), 0)
                    if r == 0 or fallback.anchor is None:
                        break
                    self._head += self._decode(self._ctx + win[:r])[self._seen :]
                    self._head_bytes += r
                    self._ctx, self._win = [fallback.anchor], win[r:]
                    self._seen = len(self._decode(self._ctx))
                    continue
            self._final.append(done)
            new += done
        return new, self._decode(self._ctx + self._win)

    def _cut_lossy(self, new: str, win: list[int], text: str | None = None) -> tuple[str, str]:
        """A forced cut of a lossy UTF-8 decode: new is final, win (whose text is text) the
        window from there."""
        self._final.append(new)
        self._cut([])
        self._win = win
        return new, self._decode(win) if text is None else text

    def _head_now(self, win: list[int]) -> str:
        """The head's text now: as set aside if the group's bytes in win are valid (or none),
        else one U+FFFD per byte."""
        if not self._head_bytes:
            return ""
        assert self._kind is not None and self._kind.fallback is not None
        raw = bytearray()
        for i in win:
            b = self._kind.fallback.byte(i)
            if b is None:
                break
            raw.append(b)
        return self._head if _is_valid(bytes(raw)) else REPLACEMENT * self._head_bytes


class StopWatch:
    """The first stop string in the text of the ids pushed so far: after every push, the same
    answer as ``find_stop(decode(ids), stops)``, searching only text that is new or may still
    change (what lies in ``stable_len`` was searched once and found clean)."""

    def __init__(
        self,
        tokenizer: Decodes | Callable[[list[int]], str],
        stops: Sequence[str],
        window_cap: int = WINDOW_CAP,
    ):
        self.detok = IncrementalDetokenizer(tokenizer, window_cap)
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._searched = 0  # no stop string ends at or before this index of the text
        self.hit: int | None = None  # where the first stop string begins, once one has appeared

    @property
    def token_count(self) -> int:
        return self.detok.token_count

    def push(self, token_ids: Sequence[int]) -> int | None:
        self.detok.push(token_ids)
        if self.hit is None and self.stops:
            # A stop string that ends after _searched begins at or after base.
            base = max(0, self._searched - self._longest + 1)
            at = find_stop(self.detok.text_from(base), self.stops, self._searched - base)
            if at is not None:
                self.hit = base + at
            # Everything was searched; what can no longer change need not be again.
            self._searched = self.detok.stable_len
        return self.hit

    def text(self) -> str:
        return self.detok.text()
