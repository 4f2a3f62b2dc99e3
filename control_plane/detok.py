"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte characters (a byte-level token is often a fragment of a
UTF-8 sequence) and merges that depend on the next token. So the text of the tokens since the last
emitted boundary is decoded as a whole, and new text is emitted only when it does not end in the
replacement character, i.e. when the pending bytes form complete characters.
"""

from __future__ import annotations

from control_plane.model_info import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids as they arrive; get back the text that is final so far."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens up to here have been emitted as text

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Whatever is left, replacement characters included (the stream has ended)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        seen = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]
