"""Incremental detokenization that never emits half a character, and the text it stands for.

Decoding token by token breaks multi-byte characters (a byte-level token is often a fragment of a
UTF-8 sequence) and merges that depend on the next token. So the text of the tokens since the last
emitted boundary is decoded as a whole (with the tokens before that boundary as context, the
window of vLLM's detokenizer), and new text is emitted only when it does not end in the
replacement character, i.e. when the pending bytes form complete characters.

The decode node and the colocated scheduler look for stop strings in ``tokenizer.decode(ids)``
after every token; decoding every id at every step costs each sequence of the batch time that
grows with its length. :class:`IncrementalDetokenizer` gives the same text from a short window
(``text()``, ``text_from()``) and tells how much of it can never change again (``stable_len``),
where it can prove that; :class:`StopWatch` searches only what is new.

Why the windowed text is ``tokenizer.decode(ids)`` exactly
-----------------------------------------------------------
Write ``D(a, b)`` for ``decode(ids[a:b])``. The detokenizer keeps ``prefix <= read``, the text
``final = D(0, read)`` and, per push, decodes the window ``W = D(prefix, n)``; the current text is
``final + W[len(D(prefix, read)):]``. It moves ``read`` to ``n`` (a *cut*) only when ``W`` grew
and does not end in U+FFFD, plus the tokenizer's own rule below. That is exact when, for every cut
``r`` and every later ``n``, ``D(0, n) = D(0, r) + X`` and ``D(p, n) = D(p, r) + X`` with the same
``X`` (``p`` the cut before ``r``): the text up to a cut never changes and the window's view of
what follows is the whole decode's. It holds for the decoders below, and only those get cuts
(``exact``); any other tokenizer keeps the emitting behaviour it always had but answers
``text()`` with a full decode and ``stable_len`` 0 (the old cost, never a different text).

* ``kvfence.tokenizer.ByteTokenizer`` and an ``HFTokenizer`` whose decoder is ``ByteLevel`` (GPT-2,
  Llama 3, Qwen2, the embedded tiny model): each token stands for fixed bytes (specials for none),
  and the text is the lossy UTF-8 decoding of their concatenation; an id the tokenizer cannot
  render is U+FFFD and starts a new run of bytes. Lossy UTF-8 (Python's and Rust's
  ``from_utf8_lossy`` both replace maximal subparts) reads left to right, and a complete valid
  character is decided without looking further: if ``D(p, r)`` ends in a character other than
  U+FFFD, the bytes at ``r`` start afresh in any longer decode, so ``X`` is the decode of the bytes
  after ``r`` in both. (``p`` was itself a cut, so the window starts at a character boundary.)
* An ``HFTokenizer`` with SentencePiece's decoder chain ``Replace("▁", " "), ByteFallback, Fuse``
  and optionally ``Strip(" ", 1, 0)`` (Llama 2, Mistral): tokens map to text one by one except
  that consecutive ``<0xXX>`` tokens form one group that becomes its UTF-8 text if the whole group
  is valid, else one U+FFFD per byte: a later byte can turn "€" back into "����". So a cut also
  needs the last id to be an ordinary vocabulary token (not ``<0x..>``, not an added or special
  token, which are skipped and leave a group open): the group before it is then closed for good.
  ``Strip`` removes one leading space of the text of a run (the whole decode, or what follows an
  unrenderable id); a window that starts mid-run strips its first text, which lies before
  ``read`` (the window's text up to ``read`` is never empty at a cut: the cut emitted it), so
  ``X`` is the same.

The property tests in ``tests/model/test_detok.py`` check ``text() == decode(ids)`` after every
token for random id sequences on all three kinds, unrenderable, special and added ids included.
A window grows only while the text ends in an incomplete character (or, with byte fallback, while
byte tokens follow each other): per token, work is bounded by that, not by the sequence's length.
"""

from __future__ import annotations

import contextlib
import json
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvfence.model.sampling import find_stop

REPLACEMENT = "\ufffd"


class Decodes(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


CutRule = Callable[[int], bool]  # whether the text may be cut after this id (besides U+FFFD)


def _always(_: int) -> bool:
    return True


_RULES: weakref.WeakKeyDictionary[Any, CutRule | None] = weakref.WeakKeyDictionary()
_RULES_LOCK = threading.Lock()


def cut_rule(tokenizer: Any) -> CutRule | None:
    """The extra condition for a cut after an id, or None when the windowed text of this
    tokenizer is not proven to be its full decode (module docstring). Cached per tokenizer: the
    control plane builds a detokenizer per request on its event loop."""
    with _RULES_LOCK, contextlib.suppress(KeyError, TypeError):  # TypeError: no weak reference
        return _RULES[tokenizer]
    rule = _classify(tokenizer)
    with _RULES_LOCK, contextlib.suppress(TypeError):
        _RULES[tokenizer] = rule
    return rule


_SENTENCEPIECE_CHAIN = [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_SENTENCEPIECE_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


def _classify(tokenizer: Any) -> CutRule | None:
    from kvfence.tokenizer import ByteTokenizer, HFTokenizer

    cls = type(tokenizer)
    # Only the decode this module reasons about: a subclass that decodes otherwise falls back.
    if isinstance(tokenizer, ByteTokenizer) and cls.decode is ByteTokenizer.decode:
        return _always
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
    if spec.get("type") == "ByteLevel":
        return _always
    chain = spec.get("decoders") if spec.get("type") == "Sequence" else None
    if chain not in (_SENTENCEPIECE_CHAIN, [*_SENTENCEPIECE_CHAIN, _SENTENCEPIECE_STRIP]):
        return None
    added = frozenset(inner.get_added_tokens_decoder())

    def closes_group(i: int) -> bool:
        if i in added or not tokenizer._renderable(i):
            return False
        piece = inner.id_to_token(i)
        # ByteFallback's byte token is "<0xXX>"; anything that looks like one keeps the group open
        # (a cut refused is only a longer window, never a different text).
        return piece is not None and not (piece.startswith("<0x") and piece.endswith(">"))

    return closes_group


def _decoder_of(tokenizer: Decodes | Callable[[list[int]], str]) -> tuple[Any, Any]:
    """(decode function, the tokenizer it belongs to or None)."""
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode, tokenizer
    owner = getattr(tokenizer, "__self__", None)  # a bound ``tokenizer.decode``
    func = getattr(tokenizer, "__func__", None)
    if owner is not None and func is not None and func is getattr(type(owner), "decode", None):
        return tokenizer, owner
    return tokenizer, None


class IncrementalDetokenizer:
    """Feed token ids as they arrive; get back the text that is final so far."""

    def __init__(self, tokenizer: Decodes | Callable[[list[int]], str]):
        self._decode, owner = _decoder_of(tokenizer)
        self._rule = cut_rule(owner) if owner is not None else None
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens up to here have been emitted as text
        self._seen = 0  # len(decode(ids[prefix:read])), which never changes until the next cut
        self._final = ""  # the text emitted so far
        self._tail = ""  # exact: the current text past _final

    @property
    def exact(self) -> bool:
        """Whether text() is the full decode without decoding every id (module docstring)."""
        return self._rule is not None

    @property
    def token_count(self) -> int:
        return len(self._ids)

    @property
    def stable_len(self) -> int:
        """A prefix of text() that no later push can change (0 when not exact)."""
        return len(self._final) if self._rule is not None else 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
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
        if self._rule is None:
            return self._decode(self._ids)[start:]
        if start <= len(self._final):
            return self._final[start:] + self._tail
        return self._tail[start - len(self._final) :]

    def _step(self, final: bool) -> str:
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= self._seen or (
            not final
            and (
                window.endswith(REPLACEMENT)
                or (self._rule is not None and not self._rule(self._ids[-1]))
            )
        ):
            self._tail = window[self._seen :]
            return ""
        new = window[self._seen :]
        self._prefix, self._read = self._read, len(self._ids)
        self._seen = len(self._decode(self._ids[self._prefix : self._read]))
        self._final += new
        self._tail = ""
        return new


class StopWatch:
    """The first stop string in the text of the ids pushed so far: after every push, the same
    answer as ``find_stop(decode(ids), stops)``, searching only text that is new or may still
    change (what lies in ``stable_len`` was searched once and found clean)."""

    def __init__(self, tokenizer: Decodes | Callable[[list[int]], str], stops: Sequence[str]):
        self.detok = IncrementalDetokenizer(tokenizer)
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
