"""Text <-> token ids for a checkpoint: its ``tokenizer.json`` through ``tokenizers``, else bytes.

Ids are the contract, text is a convenience: any id the model can emit decodes to *something*. An id
the tokenizer cannot render (past its vocabulary, e.g. a padded model vocab) shows as ``"\\ufffd"``,
never an exception, because a serving path must not crash on what a model sampled.

The byte fallback follows the Llama convention: ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>`` and
byte ``b`` is id ``3 + b``. The embedded tiny model's ``tokenizer.json`` uses the same ids, so
both paths agree on it. Like any ``tokenizers`` file it matches special-token text (``"</s>"``) in
a prompt; the byte fallback encodes such text as plain bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

PLACEHOLDER = "\ufffd"
BYTE_OFFSET = 3
BYTE_SPECIALS = ("<pad>", "<s>", "</s>")


# How much a normalizer may shrink text before it is split into tokens (NFC composes "e" and a
# combining accent, 3 bytes, into "é", 2; StripAccents drops the accent): a generous factor on
# top of the longest token, so that a bound derived from it never refuses a prompt that fits.
NORMALIZER_SLACK = 4
# A text this long is encoded with the call that releases the GIL (encode_batch): the control
# plane tokenizes on its event loop's behalf, and holding the GIL there stalls every tenant.
UNLOCKED_ENCODE_CHARS = 4096


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    vocab_size: int  # ids the tokenizer itself can render
    # An upper bound on the UTF-8 bytes of input text that one token can stand for, or None when
    # there is none (a tokenizer with an unknown token maps a whole unknown word to it). The
    # control plane refuses a text prompt that cannot fit before tokenizing it.
    max_text_bytes_per_token: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens after three specials (for a checkpoint without tokenizer.json)."""

    vocab_size = BYTE_OFFSET + 256
    max_text_bytes_per_token: int | None = 1  # one token per byte, no normalizer

    def encode(self, text: str) -> list[int]:
        return [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < self.vocab_size:
                run.append(i - BYTE_OFFSET)
                continue
            if 0 <= i < BYTE_OFFSET:
                continue  # specials render as nothing, like skip_special_tokens
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(PLACEHOLDER)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path | str):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        spec = json.loads(self._tok.to_str())
        model = spec.get("model") or {}
        resize = getattr(self._tok.model, "_resize_cache", None)
        if model.get("type") == "BPE" and not model.get("merges") and resize is not None:
            # Without merges BPE's word cache saves no work (measured: 11.7 µs per encode either
            # way), yet it keeps every distinct word under 256 bytes, up to 10,000; with
            # ByteLevel(use_regex=False) (the embedded tiny model) a word is a whole prompt, about
            # 33 bytes per prompt byte: a control plane grew by tens of MB as tenants' prompts came.
            resize(0)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.max_text_bytes_per_token = _max_text_bytes_per_token(
            spec, self._tok.get_vocab(with_added_tokens=True)
        )

    def encode(self, text: str) -> list[int]:
        if len(text) >= UNLOCKED_ENCODE_CHARS:
            # encode() holds the GIL throughout (measured: a thread running it stalled an event
            # loop for the whole 0.6 s of a 360k-token text); encode_batch releases it.
            return list(self._tok.encode_batch([text])[0].ids)
        return list(self._tok.encode(text).ids)

    def _renderable(self, i: int) -> bool:
        return 0 <= i < self.vocab_size and self._tok.id_to_token(i) is not None

    def decode(self, ids: Sequence[int]) -> str:
        # Decode runs of renderable ids together (byte-level pieces merge across tokens) and put a
        # placeholder where an id has no token.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._renderable(i):
                run.append(i)
                continue
            if run:
                out.append(self._tok.decode(run, skip_special_tokens=True))
                run = []
            out.append(PLACEHOLDER)
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=True))
        return "".join(out)


def _max_text_bytes_per_token(spec: dict, vocab: dict[str, int]) -> int | None:
    """The ``max_text_bytes_per_token`` of a ``tokenizer.json``: None unless every piece of text
    becomes tokens no longer than the vocabulary's longest (BPE over bytes, or with byte
    fallback: no unknown token swallows a word); then that length in UTF-8 bytes, which is at
    least the raw bytes a token stands for (byte-level "Ġ" is 2 bytes for a space, "▁" 3, and
    "<0x0A>" 6 for one), times NORMALIZER_SLACK."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not vocab:
        return None

    def byte_level(part: dict | None) -> bool:
        if not part:
            return False
        if part.get("type") == "ByteLevel":
            return True
        return any(byte_level(p) for p in part.get("pretokenizers", []))

    if not (model.get("byte_fallback") or byte_level(spec.get("pre_tokenizer"))):
        return None
    return NORMALIZER_SLACK * max(len(token.encode("utf-8")) for token in vocab)


# Tokenizer files kvfence does not read: a folder with one of these but no tokenizer.json has a
# tokenizer, and serving it with the byte tokenizer would silently turn prompts into wrong ids.
UNREAD_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "spiece.model")


def load_tokenizer(path: Path | str) -> Tokenizer:
    """The checkpoint folder's ``tokenizer.json`` if it has one; the byte tokenizer for a folder
    with no tokenizer at all (the embedded model, random test checkpoints); ValueError for a
    folder whose tokenizer comes in another format."""
    folder = Path(path)
    file = folder / "tokenizer.json"
    if file.exists():
        return HFTokenizer(file)
    other = [name for name in UNREAD_TOKENIZER_FILES if (folder / name).exists()]
    if other:
        raise ValueError(
            f"{folder} has its tokenizer as {', '.join(other)}, which kvfence does not read; "
            "write a tokenizer.json next to it (with transformers: AutoTokenizer.from_pretrained"
            "(folder).save_pretrained(folder) writes one for a fast tokenizer)"
        )
    return ByteTokenizer()


def byte_level_tokenizer_json() -> str:
    """A ``tokenizer.json`` with the byte fallback's ids, built with ``tokenizers`` (no merges).

    The output is canonical JSON, so writing it twice gives identical bytes.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps each byte to a printable character; order them by the byte they stand for.
    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(alphabet), "byte-level alphabet changed"
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab.update({byte_to_char[b]: BYTE_OFFSET + b for b in range(256)})
    tok = _Tok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    return json.dumps(json.loads(tok.to_str()), sort_keys=True, indent=1) + "\n"


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map, which ByteLevel uses.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}
