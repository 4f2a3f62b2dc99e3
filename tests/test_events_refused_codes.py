"""A SUBACK reason code from 0x80 (``PUBACK_REFUSED_FROM``) up is a refusal, below it a grant
(0x00 Granted QoS 0, 0x01 Granted QoS 1). kvfence/events.py compares the codes the broker sends
in three places; the PUBACK's (``_Client.publish``) is covered in test_events_undeliverable.py,
the two SUBACKs' here:

- ``EventBus._watch_own_status``: a node whose account may not read its own status topic warns
  once ("event bus cannot read its own node status"): it cannot notice a stale will.
- ``clusters_seen``: a refused subscription raises instead of answering "no cluster seen".

0x80 (Unspecified error) is the lowest refusal, and in MQTT 3.1.1 the only one: a ``>`` there
would take it for a grant. Mosquitto refuses only with 0x87, so the broker is real (connection,
SUBSCRIBE, SUBACK) and the code its SUBACK carries is replaced, as paho hands it to aiomqtt, for
one client of the test's (by its MQTT client id)."""

from __future__ import annotations

from typing import Any

import aiomqtt
import pytest
import structlog
from fixtures_mqtt import start_mosquitto
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from test_events_cli_hint import cluster_bus

import kvfence.events as events_mod
from kvfence.events import clusters_seen, node_topic

CANNOT_READ = "event bus cannot read its own node status"


def suback_says(monkeypatch: pytest.MonkeyPatch, code: int, client_id_prefix: str) -> list[int]:
    """Make the SUBACKs of the clients whose id starts with ``client_id_prefix`` carry ``code``;
    the list returned gets the code for each SUBACK so answered."""
    answered: list[int] = []
    original = aiomqtt.Client._on_subscribe

    def on_subscribe(
        self: aiomqtt.Client, paho: Any, userdata: Any, mid: int, codes: Any, props: Any = None
    ) -> None:
        if self.identifier.startswith(client_id_prefix):
            codes = [ReasonCode(PacketTypes.SUBACK, identifier=code) for _ in codes]
            answered.append(code)
        original(self, paho, userdata, mid, codes, props)

    # aiomqtt hands paho the bound method at construction: patched before any client is made
    monkeypatch.setattr(events_mod._Client, "_on_subscribe", on_subscribe)
    return answered


@pytest.mark.parametrize(
    ("code", "refused"),
    [(0x00, False), (0x80, True)],  # Granted QoS 0 (the bus asks for QoS 0); Unspecified error
    ids=["0x00-granted", "0x80-refused"],
)
async def test_own_status_subscription_refused_from_0x80(
    monkeypatch: pytest.MonkeyPatch, code: int, refused: bool
) -> None:
    answered = suback_says(monkeypatch, code, "kvfence-node-a-")
    with start_mosquitto() as broker, structlog.testing.capture_logs() as logs:
        # cluster_bus waits until its status is delivered, which the bus holds back until its
        # SUBACK was read (_serve_connection): by then _watch_own_status has judged the code.
        async with cluster_bus(broker, "prod") as bus:
            assert answered == [code]
            assert bus._watch_warned is refused
    warned = [e for e in logs if e["event"] == CANNOT_READ]
    if refused:
        (entry,) = warned
        assert entry["topic"] == node_topic("prod", "node-a")
    else:
        assert warned == []


@pytest.mark.parametrize(
    ("code", "refused"),
    [(0x01, False), (0x00, False), (0x80, True)],  # Granted QoS 1 (asked), 0 (downgraded)
    ids=["0x01-granted", "0x00-granted", "0x80-refused"],
)
async def test_clusters_seen_subscription_refused_from_0x80(
    monkeypatch: pytest.MonkeyPatch, code: int, refused: bool
) -> None:
    answered = suback_says(monkeypatch, code, "kvfence-follow-")
    with start_mosquitto() as broker:
        async with cluster_bus(broker, "prod"):  # a retained status to see
            if refused:
                with pytest.raises(aiomqtt.MqttError, match="refused the subscription"):
                    await clusters_seen(broker.host, broker.port, settle_s=0.5)
            else:
                seen = await clusters_seen(broker.host, broker.port, settle_s=0.5)
                assert seen == {"prod": {"node-a": True}}
    assert answered == [code]
