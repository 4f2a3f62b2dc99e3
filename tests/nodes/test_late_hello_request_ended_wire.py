"""The wire side of a late hello whose request ended (``KvReceiver.forget(request_ended=True)``).

Decode refuses a hello for a reservation it released RESERVATION_RELEASED, as before. When the
release was its request's end and the hello carries the reservation's authenticator, it reports
nothing, says ``request_ended: true`` in the refusal (an additive field), and still drains every
page the sender put behind a warm hello; prefill's ``send_pages`` raises a refused TransferError
with ``request_ended`` set. Controls: the same hello for a reservation released for trouble (the
default) is reported and its refusal says nothing more; an answer that says ``request_ended`` for
any other reason, or a refusal without the key (a decode before it), sets nothing.
"""

from __future__ import annotations

import pytest
from asyncwait import eventually
from test_transfer import make_pool, make_receiver, make_source, send

from kvfence.transfer import EndpointPool, TransferError, _check_reply


@pytest.mark.parametrize("opening", ["cold", "warm"])
@pytest.mark.parametrize("request_ended", [True, False])
async def test_a_refused_late_hello_says_its_request_ended_only_when_it_did(
    opening: str, request_ended: bool
) -> None:
    pool = make_pool()
    rx, events = await make_receiver(pool)
    eps = EndpointPool()
    try:
        if opening == "warm":  # a completed transfer leaves a pooled endpoint, decode v4 on it
            done = rx.expect("res-ok", "req-ok", b"o" * 32, pool.allocate(2, "res-ok"))
            await send(rx, done, make_source(pool, 2), endpoints=eps)
        late = rx.expect("res-late", "req-late", b"k" * 32, pool.allocate(2, "res-late"))
        rx.cancel("res-late")
        pool.release("res-late")
        rx.forget("res-late", request_ended=request_ended, tenant_id="t-late")
        drained = rx.strays_drained
        with pytest.raises(TransferError) as err:
            await send(rx, late, make_source(pool, 2), endpoints=eps)
        assert (err.value.reason, err.value.refused) == ("RESERVATION_RELEASED", True)
        assert err.value.request_ended is request_ended
        assert eps.reused == (1 if opening == "warm" else 0)
        if opening == "warm":  # batch 0 rode behind the hello: all of it drained, either way
            assert await eventually(lambda: rx.strays_drained - drained == 2)
        reported = [(k, p["reason"]) for k, p in events if p.get("reservation_id") == "res-late"]
        assert reported == ([] if request_ended else [("transfer_failed", "RESERVATION_RELEASED")])
    finally:
        await eps.close()
        await rx.stop()
    pool.check_integrity()


@pytest.mark.parametrize(
    ("answer", "ended"),
    [
        ({"ok": False, "error": "RESERVATION_RELEASED", "request_ended": True}, True),
        ({"ok": False, "error": "RESERVATION_RELEASED"}, False),  # a decode before the field
        ({"ok": False, "error": "BAD_AUTHENTICATOR", "request_ended": True}, False),
        ({"ok": False, "error": "RESERVATION_RELEASED", "request_ended": "yes"}, False),
    ],
)
def test_only_a_late_transfers_refusal_can_say_its_request_ended(answer: dict, ended: bool) -> None:
    with pytest.raises(TransferError) as err:
        _check_reply(answer)
    assert err.value.refused and err.value.reason == answer["error"]
    assert err.value.request_ended is ended
