"""What the stop-string tests compare against: the whole-text search the incremental code replaced
(``old_find_stop``, ``old_stream_safe_len``), and a tokenizer whose decode calls are counted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfence.model.tiny import ensure_tiny_model
from kvfence.tokenizer import HFTokenizer, load_tokenizer


def old_find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def old_stream_safe_len(text: str, stops: Sequence[str]) -> int:
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[end - k : end] == s[:k]:
                hold = max(hold, k)
                break
    return end - hold


class CountingTokenizers:
    """A ``tokenizers.Tokenizer`` that notes how many ids each decode call was given."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.decoded: list[int] = []

    def decode(self, ids: Sequence[int], **kw: Any) -> str:
        self.decoded.append(len(ids))
        return str(self._inner.decode(ids, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def spy_tokenizer() -> tuple[HFTokenizer, CountingTokenizers]:
    """The tiny model's tokenizer (byte-level BPE), its decode calls counted."""
    tok = load_tokenizer(ensure_tiny_model())
    assert isinstance(tok, HFTokenizer)
    spy = CountingTokenizers(tok._tok)
    tok._tok = spy
    return tok, spy
