"""control_plane.verify.DecodeStream keeps the answer's text without rebuilding it per token.

``self.text += piece`` copied the whole answer at every decode message: control-plane CPU per token
that grew with the answer (about 6 us a token at 20k tokens, 47 us at 160k). The cost test counts
the characters such concatenations copy, deterministically; the property test checks that every
message still relays what a search of the whole text relays, across the blocks the text is now
kept in (made tiny here) and after long runs of U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp_decode_stream import relay

from control_plane.admission import Prompt
from control_plane.lifecycle import RequestRecord
from control_plane.verify import DecodeStream
from kvfence.detok import GrowingText
from kvfence.model.sampling import find_stop, stream_safe_len
from kvfence.proto.kvfence.v1 import common_pb2


class Copied(str):
    """A piece of text that counts the characters before it copied by ``text + piece`` (Python
    asks a str subclass's ``__radd__`` first); the sum is a plain str, so the next piece counts
    again."""

    chars = 0

    def __radd__(self, other: str) -> str:
        Copied.chars += len(other)
        return str.__add__(other, self)


class PieceDetok:
    """A stand-in for the detokenizer: token id i is the text pieces[i], final at once (any text
    left for the flush is ``rest``); every piece is a ``wrap`` of it."""

    def __init__(self, pieces: Sequence[str], rest: str = "", wrap: type[str] = str):
        self.pieces, self.rest, self.wrap = pieces, rest, wrap

    def push(self, ids: Sequence[int]) -> str:
        return self.wrap("".join(self.pieces[i] for i in ids))

    def flush(self) -> str:
        return self.wrap(self.rest)


def stream_of(
    cls: type[DecodeStream], detok: PieceDetok, ids: list[int], stops: Sequence[str]
) -> DecodeStream:
    sampling = common_pb2.SamplingParams(max_new_tokens=len(ids), stop=list(stops))
    return cls(
        RequestRecord("r1", "t1"),
        common_pb2.KvManifest(first_token=ids[0]),
        Prompt([5, 6, 7], sampling),
        detok,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("stops", [(), ("zzzz",)])
def test_the_whole_text_is_not_copied_per_token(stops: tuple[str, ...]) -> None:
    """A token's text is added to the last GrowingText.BLOCK characters at most, whatever the
    answer's length."""
    n, block = 3000, 64
    with mock.patch.object(GrowingText, "BLOCK", block):
        stream = stream_of(DecodeStream, PieceDetok(["ab"], wrap=Copied), [0] * n, stops)
        Copied.chars = 0
        texts = relay(stream, [[0]] * n, "length")
    # Copying the text so far at every token: 2 * (0 + 1 + ... + n-1) = 9 million characters.
    assert Copied.chars <= n * block
    assert "".join(texts) == stream.text == "ab" * n  # the control: the answer is whole


class WholeText(DecodeStream):
    """What every message relayed when the text was one string searched whole."""

    def _text(self, final: bool) -> str:
        text, stops = self.text, self._stops
        cut = find_stop(text, stops) if stops else None
        if cut is not None:
            end = cut
        elif final or not stops:
            end = len(text)
        else:
            end = stream_safe_len(text, stops)
        end = max(end, self.sent)
        out, self.sent = text[self.sent : end], end
        return out


PIECES = ["a", "b", "ab", "ba", "\ufffd", "\ufffd" * 7, "\ufffd" * 40, "€", "aab", ""]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_message_relays_what_a_search_of_the_whole_text_relays(
    data: st.DataObject,
) -> None:
    ids = data.draw(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=60))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=12))) | {len(ids)})
    messages = [ids[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]
    rest = data.draw(st.sampled_from(["", "b", "\ufffd"]))
    stops = data.draw(st.lists(st.text(alphabet="ab\ufffd€", min_size=1, max_size=9), max_size=4))
    whole = "".join(PIECES[i] for i in ids) + rest
    reason = "stop" if find_stop(whole, stops) is not None else "length"
    block = data.draw(st.sampled_from([1, 2, 3, 8, GrowingText.BLOCK]))
    with mock.patch.object(GrowingText, "BLOCK", block):
        got, want = (
            relay(stream_of(cls, PieceDetok(PIECES, rest), ids, stops), messages, reason)
            for cls in (DecodeStream, WholeText)
        )
    assert got == want
