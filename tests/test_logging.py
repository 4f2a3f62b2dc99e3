"""Request-scoped log fields: bound for a block, undone after it, however the block ends."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator

import structlog

from kvfence import logging as kvlog


async def test_a_streaming_handler_closed_from_another_context_leaves_no_error() -> None:
    """A streaming handler (an async generator) holds request_context across its yields. A
    client that cancels mid-stream gets it closed later from another task, whose context did
    not make the bindings: resetting them raised ValueError there, an unretrieved task error
    in the node's log on every cancelled stream. The control: a stream read to its end."""

    async def handler() -> AsyncIterator[int]:
        with kvlog.request_context("req-1", "tenant-a"):
            for i in range(3):
                yield i

    done = [x async for x in handler()]  # control: read to the end, closed where it was made
    assert done == [0, 1, 2]
    assert structlog.contextvars.get_contextvars() == {}

    loop = asyncio.get_running_loop()
    stream = handler()
    # started by one task (grpc.aio's handler task, in a context of its own) ...
    assert await loop.create_task(stream.__anext__(), context=contextvars.Context()) == 0
    # ... closed by another: aclose() used to raise ValueError from the reset
    closing = contextvars.Context()
    await loop.create_task(stream.aclose(), context=closing)
    assert closing.run(structlog.contextvars.get_contextvars) == {}
    assert structlog.contextvars.get_contextvars() == {}  # this context was never touched
