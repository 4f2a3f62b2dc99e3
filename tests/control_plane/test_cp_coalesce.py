"""The client stream merges token messages that are already queued, and nothing else."""

from __future__ import annotations

import asyncio

from control_plane.generation import coalesce_tokens
from kvfence.proto.kvfence.v1 import client_pb2


def msg(ids: list[int], text: str, final: bool = False) -> client_pb2.GenerateResponse:
    m = client_pb2.GenerateResponse(request_id="req-1", token_ids=ids, text=text)
    if final:
        m.finish_reason = "length"
        m.usage.completion_tokens = 9
    return m


def queue(*items: object) -> asyncio.Queue[object]:
    q: asyncio.Queue[object] = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_waiting_token_messages_are_merged_in_order_and_the_final_one_kept_apart():
    final = msg([], "", final=True)
    q = queue(msg([2], "b"), msg([3, 4], "cd"), final, "after")
    merged, nxt = coalesce_tokens(msg([1], "a"), q)
    assert list(merged.token_ids) == [1, 2, 3, 4] and merged.text == "abcd"
    assert merged.request_id == "req-1" and not merged.finish_reason
    assert nxt is final  # the final message is written on its own, after the merged one
    assert q.get_nowait() == "after"


def test_a_message_with_nothing_queued_is_written_as_it_is():
    first = msg([1], "a")
    q = queue()
    merged, nxt = coalesce_tokens(first, q)
    assert merged is first and nxt is None


def test_an_error_behind_tokens_stops_the_merge():
    err = RuntimeError("node lost")
    q = queue(msg([2], "b"), err, msg([3], "c"))
    merged, nxt = coalesce_tokens(msg([1], "a"), q)
    assert list(merged.token_ids) == [1, 2] and nxt is err
    assert q.qsize() == 1  # nothing after the error was taken


def test_a_final_message_is_never_merged_into():
    q = queue(msg([5], "e"))
    first = msg([4], "d", final=True)
    merged, nxt = coalesce_tokens(first, q)
    assert merged is first and nxt is None and q.qsize() == 1
