"""A stopping receiver drops its UCX listener only once ucxx counts no connection handler alive.

ucxx keeps counting a connection's handler one more turn of the event loop after it ended, and
warns when the listener goes first ("Listener object is being destroyed, but 1 client handler(s)
is(are) still alive"): a line every decode node's stop printed after serving a transfer. The
control drops the listener the way ``stop()`` did, as soon as the receiver's own handlers had
ended, and sees that warning: the capture works, and the race is real.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from test_transfer import make_pool, make_receiver, make_source, send

from kvfence.transfer import InboundState, KvReceiver

ALIVE = "client handler(s) is(are) still alive"


class _Alive(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if ALIVE in record.getMessage():
            self.lines.append(record.getMessage())


@pytest.fixture
def alive_warnings() -> Iterator[list[str]]:
    """ucxx's warnings of a listener dropped under a live handler. Its "ucx" logger does not
    propagate (ucxx sets it so), so pytest's caplog does not see them: a handler of its own."""
    handler = _Alive()
    logger = logging.getLogger("ucx")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


async def served_one_transfer() -> KvReceiver:
    """A receiver that has just served one transfer on a new endpoint, which the sender closed:
    returned in the first turn in which the receiver holds no handler of its own."""
    pool = make_pool()
    rx, _ = await make_receiver(pool)
    refs = pool.allocate(1, "res-1")
    t = rx.expect("res-1", "req-1", b"k" * 32, refs)
    await send(rx, t, make_source(pool, 1))
    assert t.state == InboundState.COMPLETE
    while rx._handlers:
        await asyncio.sleep(0)
    return rx


async def test_stop_drops_the_listener_with_no_handler_alive(alive_warnings: list[str]) -> None:
    rx = await served_one_transfer()
    await rx.stop()
    assert rx._listener is None
    assert alive_warnings == []


async def test_control_a_listener_dropped_at_once_is_warned_of(alive_warnings: list[str]) -> None:
    rx = await served_one_transfer()
    listener = rx._listener
    assert listener is not None and listener.active_clients == 1
    rx._listener = None
    listener.close()
    del listener  # the last reference: ucxx's finalizer runs now
    assert len(alive_warnings) == 1
    await rx.stop()
