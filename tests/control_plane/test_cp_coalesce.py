"""The client stream merges token messages that wait to be written, and nothing else
(control_plane/generation.py ``PendingAnswer``)."""

from __future__ import annotations

import psutil

from control_plane.generation import MAX_IDS_PER_MESSAGE, PendingAnswer
from kvfence.proto.kvfence.v1 import client_pb2


def msg(ids: list[int], text: str, final: bool = False) -> client_pb2.GenerateResponse:
    m = client_pb2.GenerateResponse(request_id="req-1", token_ids=ids, text=text)
    if final:
        m.finish_reason = "length"
        m.usage.completion_tokens = 9
    return m


def pending(*items: object) -> PendingAnswer:
    answer = PendingAnswer()
    for item in items:
        answer.emit(item)
    return answer


def drain(answer: PendingAnswer) -> list[object]:
    out = []
    while (item := answer.take()) is not None:
        out.append(item)
        if not isinstance(item, client_pb2.GenerateResponse) or item.finish_reason:
            break
    return out


def test_waiting_token_messages_are_merged_in_order_and_the_final_one_kept_apart():
    final = msg([], "", final=True)
    answer = pending(msg([1], "a"), msg([2], "b"), msg([3, 4], "cd"), final, msg([5], "after"))
    merged, last = drain(answer)
    assert isinstance(merged, client_pb2.GenerateResponse)
    assert list(merged.token_ids) == [1, 2, 3, 4] and merged.text == "abcd"
    assert merged.request_id == "req-1" and not merged.finish_reason
    assert last is final  # written on its own, after the merged one; nothing after it is kept


def test_a_message_with_nothing_waiting_is_written_as_it_is():
    first = msg([1], "a")
    answer = pending(first)
    assert answer.take() is first
    assert answer.take() is None  # nothing yet: the writer waits (get)


def test_an_error_behind_tokens_ends_the_answer_after_them():
    err = RuntimeError("node lost")
    answer = pending(msg([1], "a"), msg([2], "b"), err, msg([3], "c"))
    merged, end = drain(answer)
    assert isinstance(merged, client_pb2.GenerateResponse)
    assert list(merged.token_ids) == [1, 2] and end is err
    assert answer.take() is err  # the end stays the end


def test_a_final_message_is_never_merged_into():
    first = msg([4], "d", final=True)
    answer = pending(first, msg([5], "e"))
    assert answer.take() is first


def test_many_waiting_messages_are_merged_in_linear_cost_into_bounded_messages():
    """20,000 messages waiting (a client that paused): appending each one's text to the merged
    message made upb copy the whole text each time and keep every copy, O(k^2): +600 MB and 3 s
    on the event loop for this many. Now the messages are built once from lists, each at most
    MAX_IDS_PER_MESSAGE ids (whole decode messages), their content exactly what was emitted."""
    k = 20_000
    answer = pending(*(msg([104, 195, 169], "hé") for _ in range(k)))
    rss = psutil.Process().memory_info().rss
    written = drain(answer)
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 64 << 20, grown  # the quadratic merge grew by about 600 MB
    ids = [i for m in written for i in m.token_ids]  # type: ignore[attr-defined]
    assert ids == [104, 195, 169] * k
    assert "".join(m.text for m in written) == "hé" * k  # type: ignore[attr-defined]
    sizes = [len(m.token_ids) for m in written]  # type: ignore[attr-defined]
    assert max(sizes) <= MAX_IDS_PER_MESSAGE and max(sizes) > MAX_IDS_PER_MESSAGE - 3
    assert len(written) == -(-3 * k // (MAX_IDS_PER_MESSAGE // 3 * 3))


def test_a_decode_message_larger_than_the_bound_goes_alone_and_whole():
    big = list(range(MAX_IDS_PER_MESSAGE + 5))
    answer = pending(msg([1], "a"), msg(big, "big"), msg([2], "b"))
    written = drain(answer)
    assert [list(m.token_ids) for m in written] == [[1], big, [2]]  # type: ignore[attr-defined]
    assert [m.text for m in written] == ["a", "big", "b"]  # type: ignore[attr-defined]
