"""A cancel that lands in the turn of the event loop in which the awaited thing happens stands.

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives when its inner
awaitable has already finished: the cancelled code returns normally and goes on. Where a caller
cancels to stop something, that was a bug; these waits now use ``asyncio.timeout``. Each test
sets the awaited thing and cancels in one synchronous block (the same turn); its control lets the
same wait end without a cancel."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from asyncwait import eventually

from kvfence import events as events_mod
from kvfence.events import EventBus, clusters_seen, node_topic


def _bus() -> EventBus:
    """A bus with a broker configured but never connected: the waits are driven by hand."""
    bus = EventBus("c1", "n1", "127.0.0.1", 1)
    bus._wake = asyncio.Event()
    bus._idle = asyncio.Event()
    return bus


async def _ends_cancelled(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` ends cancelled within a second (one that swallowed the cancel is back in
    its wait long before; it is cancelled again here to end the test)."""
    done, _ = await asyncio.wait({task}, timeout=1)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    return task.cancelled()


@pytest.mark.parametrize("cancelled", [True, False])
async def test_a_stop_cancelled_as_the_bus_drains_is_cancelled(monkeypatch, cancelled):
    """EventBus.stop says a cancel aimed at it must stand; its wait_drained swallowed one that
    came as the last acknowledgement did. Control: the same drain, not cancelled, says True."""
    bus = _bus()
    drained = False
    monkeypatch.setattr(bus, "_is_drained", lambda: drained)
    waiting = asyncio.ensure_future(bus.wait_drained(30))
    assert await eventually(lambda: bool(bus._idle._waiters))  # type: ignore[union-attr]
    drained = True
    bus._idle.set()  # type: ignore[union-attr]
    if cancelled:
        waiting.cancel()
        assert await _ends_cancelled(waiting)
    else:
        assert await waiting is True


@pytest.mark.parametrize("cancelled", [True, False])
async def test_the_send_loop_cancelled_as_it_is_woken_ends(monkeypatch, cancelled):
    """The publisher's send loop, waiting for a refused topic's next try, is cancelled to end the
    connection; a cancel that came with a wakeup was swallowed and the loop ran on. Control: the
    wakeup alone sends the loop round again (it asks for the next try once more)."""
    bus = _bus()
    tries: list[float] = []

    def next_try_in() -> float:
        tries.append(30.0)
        return 30.0  # a refused topic's next try: the loop waits with a timeout

    monkeypatch.setattr(bus, "_next_try_in", next_try_in)
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    client: Any = object()  # nothing is sent: the buffer is empty and there is no status
    loop = asyncio.ensure_future(bus._send_loop(client, set(), failed))
    assert await eventually(lambda: bool(bus._wake._waiters))  # type: ignore[union-attr]
    assert len(tries) == 1
    bus._wake.set()  # type: ignore[union-attr]
    if cancelled:
        loop.cancel()
        assert await _ends_cancelled(loop)
    else:
        assert await eventually(lambda: len(tries) == 2)
        assert not loop.done()
        loop.cancel()
        assert await _ends_cancelled(loop)


class _Reader:
    """What clusters_seen uses of its connection: a subscription and the messages, fed by hand."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.messages = self

    async def subscribe(self, topic: str, qos: int) -> list[int]:
        return [1]

    async def __anext__(self) -> Any:
        return await self.queue.get()


class _Message:
    topic = node_topic("c1", "n1")
    payload = b'{"online": true}'


@pytest.mark.parametrize("cancelled", [True, False])
async def test_a_broker_read_cancelled_as_a_message_comes_ends(monkeypatch, cancelled):
    """The live view's silence hint reads the broker's retained statuses and is cancelled when
    the view ends; a cancel that came with a message was swallowed and the read went on for up
    to max_s, to print its hint after the view had ended. Control: without the cancel the
    message is read, and the read ends once the broker has been quiet for settle_s."""
    reader = _Reader()

    async def enter_reader(*args: Any) -> _Reader:
        return reader

    monkeypatch.setattr(events_mod, "_enter_reader", enter_reader)
    settle_s = 0.2 if not cancelled else 30
    reading = asyncio.ensure_future(clusters_seen("127.0.0.1", 1, settle_s=settle_s, max_s=60))
    assert await eventually(lambda: bool(reader.queue._getters))  # type: ignore[attr-defined]
    reader.queue.put_nowait(_Message())
    if cancelled:
        reading.cancel()
        assert await _ends_cancelled(reading)
    else:
        assert await asyncio.wait_for(reading, 10) == {"c1": {"n1": True}}
