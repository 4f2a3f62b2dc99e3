"""The clients' ``timeout`` against gRPC's deadline: one it cannot set (inf, 1e10: its deadline
overflowed, and every call failed at once DEADLINE_EXCEEDED, as if the server had not answered;
0 or less: a deadline already past; NaN) is InvalidArgument before a channel is opened. Controls:
``MAX_TIMEOUT_S`` and None reach the connection attempt at a port nothing listens on
(UNAVAILABLE)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvfence import MAX_TIMEOUT_S
from kvfence.client import AdminClient, AsyncClient, Client
from kvfence.errors import InvalidArgument, Unavailable
from tests.fixtures_mqtt import free_port

UNSETTABLE = [math.inf, 1e10, MAX_TIMEOUT_S + 0.5, 0, -1.0, math.nan]


def closed_target() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("timeout", UNSETTABLE)
@pytest.mark.parametrize("cls", [Client, AsyncClient, AdminClient])
def test_a_timeout_grpc_cannot_set_is_refused_before_anything_is_opened(
    cls: Any, timeout: float
) -> None:
    with pytest.raises(InvalidArgument, match="timeout must be above 0 and at most 1000000"):
        cls(closed_target(), "key", timeout=timeout)


@pytest.mark.parametrize("timeout", ["10", True])
def test_a_timeout_that_is_not_a_number_is_refused(timeout: Any) -> None:
    with pytest.raises(InvalidArgument, match="timeout must be a number of seconds"):
        Client(closed_target(), "key", timeout=timeout)


@pytest.mark.parametrize("timeout", [MAX_TIMEOUT_S, 30, None])
def test_settable_timeouts_reach_the_server(timeout: float | None) -> None:
    with Client(closed_target(), "key", timeout=timeout) as c, pytest.raises(Unavailable):
        c.generate(prompt_ids=[1, 2], max_new_tokens=2)
    admin = AdminClient(closed_target(), "token", timeout=timeout)
    with admin, pytest.raises(Unavailable):
        admin.check_config()


@pytest.mark.parametrize("timeout", [MAX_TIMEOUT_S, None])
async def test_settable_timeouts_reach_the_server_async(timeout: float | None) -> None:
    async with AsyncClient(closed_target(), "key", timeout=timeout) as c:
        with pytest.raises(Unavailable):
            await c.generate(prompt_ids=[1, 2], max_new_tokens=2)


def test_backup_tenants_checks_its_own_timeout() -> None:
    with AdminClient(closed_target(), "token") as admin:
        for timeout in (math.inf, 1e10, 0):
            with pytest.raises(InvalidArgument, match="timeout must be above 0"):
                admin.backup_tenants(timeout=timeout)
        with pytest.raises(Unavailable):
            admin.backup_tenants(timeout=MAX_TIMEOUT_S)
