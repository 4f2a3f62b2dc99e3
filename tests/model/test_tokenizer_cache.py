"""The control plane tokenizes every tenant's prompt: the tokenizer must not keep them.

``tokenizers``' BPE keeps a cache of every distinct word under 256 bytes (up to 10,000); with the
embedded tiny model's ``ByteLevel(use_regex=False)`` and no merges, a word is a whole prompt, the
cache saves no work, and a control plane grew by tens of MB as prompts came (a soak's +0.18 MB
per 1,000 requests). Measured on the native heap (glibc ``mallinfo2``), where the cache lives.
"""

from __future__ import annotations

import ctypes
import gc
import random
import sys

import pytest
from tokenizers import Tokenizer

from kvfence.tokenizer import HFTokenizer, byte_level_tokenizer_json

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallinfo2")

PROMPTS = 3000


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _malloc_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    gc.collect()
    return int(libc.mallinfo2().uordblks)


def _growth(encode) -> int:
    """Native heap in use after encoding PROMPTS distinct short prompts, minus before."""
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(10**9)}" for _ in range(8)) for _ in range(PROMPTS)]
    encode("warm up")
    before = _malloc_in_use()
    for p in prompts:
        encode(p)
    return _malloc_in_use() - before


@pytest.fixture
def tiny_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(byte_level_tokenizer_json())
    return path


def test_the_tokenizer_keeps_no_prompt_and_encodes_as_the_library_does(tiny_json) -> None:
    raw = Tokenizer.from_file(str(tiny_json))
    # Control: the measurement sees the library's word cache keep every short prompt.
    assert _growth(raw.encode) > 5 * 2**20
    tok = HFTokenizer(tiny_json)
    assert _growth(tok.encode) < 1 * 2**20
    for text in ("héllo wörld ✓", "The quick brown fox", "</s> x", "a" * 5000):
        assert tok.encode(text) == raw.encode(text).ids
