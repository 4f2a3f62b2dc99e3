"""One parse of a decode UCX address (``kvfence.transfer.host_port``) for prefill and send_pages.

Prefill refused a reservation whose address is not HOST:PORT with a check of its own, while
``send_pages`` split the address its own way: an address that check refuses (no host, port 0 or
over 65535) was dialled by send_pages, and one it took with a non-ASCII digit for a port crashed
it (``int``). Now both use ``host_port``: what prefill refuses, send_pages refuses before it
connects, with the same ValueError; what it takes, send_pages dials as before.
"""

from __future__ import annotations

import pytest

import prefill_svc.service as prefill_service
from kvfence.transfer import EndpointPool, TransferError, host_port, send_pages

BAD = ["127.0.0.1", "127.0.0.1:", ":5000", "127.0.0.1:0", "127.0.0.1:70000", "h:5x", "h:\u00b2"]


@pytest.mark.parametrize("address", BAD)
def test_an_address_that_is_not_host_port_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        host_port(address)


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("decode-0.kvfence:65535", ("decode-0.kvfence", 65535)),
        ("[::1]:4000", ("[::1]", 4000)),  # the host as written, up to the last colon
    ],
)
def test_a_host_and_port_are_split_as_send_pages_dials_them(
    address: str, parsed: tuple[str, int]
) -> None:
    assert host_port(address) == parsed


def test_prefill_checks_an_address_with_the_function_send_pages_parses_it_with() -> None:
    assert prefill_service.host_port is host_port
    assert not hasattr(prefill_service, "_host_port")  # no copy of its own


async def send_nothing(address: str, pool: EndpointPool) -> None:
    """A transfer of no pages to ``address`` through ``pool``."""
    await send_pages(
        address,
        reservation_id="res-1",
        request_id="req-1",
        secret=b"k" * 32,
        pages=[],
        page_bytes=1024,
        max_batch_bytes=4096,
        batch_timeout_s=1.0,
        endpoints=pool,
    )


@pytest.mark.parametrize("address", BAD)
async def test_send_pages_refuses_what_prefill_refuses_before_connecting(address: str) -> None:
    """send_pages opens no endpoint for an address prefill's check refuses."""
    pool = EndpointPool()
    try:
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            await send_nothing(address, pool)
        assert pool.opened == 0 and pool.abandoned_connects == 0
    finally:
        await pool.close()


async def test_control_a_well_formed_address_is_dialled() -> None:
    """Control: a well-formed address with nobody listening gets as far as the connect, and
    fails there (UNREACHABLE), not on its parse."""
    pool = EndpointPool()
    try:
        with pytest.raises(TransferError) as err:
            await send_nothing("127.0.0.1:1", pool)
        assert err.value.reason == "UNREACHABLE"
    finally:
        await pool.close()
