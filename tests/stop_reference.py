"""What the stop-string tests compare against: the whole-text search the incremental code replaced
(``old_find_stop``, ``old_stream_safe_len``), a tokenizer whose decode calls are counted, and the
tokenizer layouts kvfence.detok reasons about (byte fallback, byte-level BPE), built small."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from kvfence.model.tiny import ensure_tiny_model
from kvfence.tokenizer import HFTokenizer, _bytes_to_unicode, load_tokenizer


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


class CountingDecode:
    """A tokenizer's own ``decode`` (ids it cannot render included), the ids of each call noted.
    Set on the instance: kvfence.detok still knows the tokenizer by its class."""

    def __init__(self, tok: Any):
        self.decoded: list[int] = []
        inner = tok.decode

        def decode(ids: Sequence[int]) -> str:
            self.decoded.append(len(ids))
            return str(inner(ids))

        tok.decode = decode


def spy_tokenizer() -> tuple[HFTokenizer, CountingTokenizers]:
    """The tiny model's tokenizer (byte-level BPE), its decode calls counted."""
    tok = load_tokenizer(ensure_tiny_model())
    assert isinstance(tok, HFTokenizer)
    spy = CountingTokenizers(tok._tok)
    tok._tok = spy
    return tok, spy


# Pieces that stress what decoding across tokens does: characters of 1-4 UTF-8 bytes, a
# replacement character that is real text, pieces that look like byte tokens, words with and
# without the SentencePiece space mark.
TEXT_PIECES = ["a", "b", "ab", "é", "€", "中文", "😀", "\ufffd", "<0x4", "0x41>", "st", "op", "x"]
SP_PIECES = ["▁", "▁▁", "▁a", "▁ab", "▁€", "a▁", *TEXT_PIECES]
SPECIALS = ["<unk>", "<s>", "</s>"]
ADDED = [("<|eot|>", True), ("<tool>", False), ("<0x41>", False), ("▁plain", False)]


def _save(tok: RawTokenizer, folder: Path, name: str) -> HFTokenizer:
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    for content, special in ADDED:
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
    path = folder / f"{name}.json"
    path.write_text(tok.to_str())
    return HFTokenizer(path)


def sentencepiece_tokenizer(folder: Path, strip: bool = True) -> HFTokenizer:
    """Llama 2 / Mistral's layout: BPE with byte fallback (<0x00>..<0xFF> after three specials),
    Metaspace, and the Replace, ByteFallback, Fuse, Strip decoder chain."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    for piece in SP_PIECES:
        vocab.setdefault(piece, len(vocab))
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    chain = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(chain + ([decoders.Strip(" ", 1, 0)] if strip else []))
    return _save(tok, folder, f"sentencepiece-{strip}")


def byte_level_tokenizer(folder: Path) -> HFTokenizer:
    """GPT-2 / Llama 3 / Qwen2's layout: byte-level BPE whose multi-byte pieces split characters,
    at either end or both (a piece of "中文中" can end with the start of a character and begin
    with the end of one)."""
    to_char = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({to_char[b]: len(SPECIALS) + b for b in range(256)})
    for piece in [*TEXT_PIECES, " a", "ab c", "中文中", "😀😀"]:
        raw = piece.encode()
        for a in range(len(raw)):  # every run of its bytes
            for b in range(a + 1, len(raw) + 1):
                vocab.setdefault("".join(to_char[x] for x in raw[a:b]), len(vocab))
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _save(tok, folder, "byte-level")
