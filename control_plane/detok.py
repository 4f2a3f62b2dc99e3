"""Incremental detokenization that never emits half a character: kvfence.detok, where the decode
node and the colocated engine use it too (to find stop strings without decoding every id)."""

from __future__ import annotations

from kvfence.detok import REPLACEMENT, IncrementalDetokenizer

__all__ = ["REPLACEMENT", "IncrementalDetokenizer"]
