"""A node's bus watches its own status topic for a late will that overwrote its status. The
broker's retained status, sent on every subscribe (MQTT 3.1.1 cannot ask it not to), is old news
that this connection's own status replaces anyway: it used to make every reconnect after an
earlier crash warn and publish the status twice."""

from __future__ import annotations

import asyncio
import types

import pytest
from test_events_undeliverable import make_bus


@pytest.mark.parametrize("retained", [True, False], ids=["retained-on-subscribe", "control-live"])
async def test_only_a_live_offline_message_makes_the_status_be_published_again(
    retained: bool,
) -> None:
    bus = make_bus(port=1)  # never started: the bookkeeping alone
    bus._idle, bus._wake = asyncio.Event(), asyncio.Event()
    bus.publish_node_status({"role": "decode", "online": True})
    bus._task = asyncio.get_running_loop().create_future()  # "running", not stopping
    bus._status_dirty = False
    message = types.SimpleNamespace(
        topic=bus._status_topic, payload=b'{"online": false}', retain=retained
    )
    bus._status_seen(message)
    assert bus._status_dirty is (not retained)
    bus._task.cancel()
