"""Decode sends the tokens already queued for a stream in one message, and nothing else."""

from __future__ import annotations

import asyncio

from decode_svc.service import drain_tokens


def queue(*items: tuple[str, object]) -> asyncio.Queue[tuple[str, object]]:
    q: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_queued_tokens_join_in_order_and_the_finish_is_kept_for_its_own_message():
    q = queue(("tokens", [2]), ("tokens", [3, 4]), ("finish", "length"), ("tokens", [9]))
    ids, pending = drain_tokens([1], q)
    assert ids == [1, 2, 3, 4] and pending == ("finish", "length")
    assert q.get_nowait() == ("tokens", [9])  # nothing after the finish was taken


def test_with_nothing_queued_the_message_holds_just_its_tokens():
    ids, pending = drain_tokens([5], queue())
    assert ids == [5] and pending is None


def test_an_error_is_not_merged():
    err = ("error", RuntimeError("tag check"))
    ids, pending = drain_tokens([1], queue(err))
    assert ids == [1] and pending == err
