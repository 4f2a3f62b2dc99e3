"""A status grpc could not send (its batch failed) is logged at info when the client had gone
already (its deadline passed, or it cancelled: about one in eight short-deadline requests under
load hit this), at warning otherwise, and names the error's type, not a C object's repr."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from control_plane import generation
from control_plane.generation import GenerationServicer, PendingAnswer
from kvfence.errors import DeadlineExceeded, KvfenceError, Unavailable


class Context:
    """What _end uses of a grpc.aio.ServicerContext, with a status that cannot be sent."""

    def __init__(self, remaining: float | None, cancelled: bool) -> None:
        self.remaining, self._cancelled = remaining, cancelled

    async def abort_with_status(self, status: Any) -> None:
        [batch_error] = generation._BATCH_ERRORS
        raise batch_error('Failed "execute_batch": (<cygrpc object at 0x7f00>,)')

    def time_remaining(self) -> float | None:
        return self.remaining

    def cancelled(self) -> bool:
        return self._cancelled


async def end(context: Context, err: KvfenceError) -> list[dict[str, Any]]:
    servicer = GenerationServicer.__new__(GenerationServicer)  # _end reads nothing else of it
    run = SimpleNamespace(
        decided=asyncio.Event(),
        done=asyncio.Event(),
        record=SimpleNamespace(request_id="req-1", tenant_id="t"),
    )
    with structlog.testing.capture_logs() as logs:
        await servicer._end(run, PendingAnswer(), context, err)  # type: ignore[arg-type]
    assert run.decided.is_set()
    return [e for e in logs if e["event"] == "status could not be sent"]


@pytest.mark.parametrize(
    ("remaining", "cancelled"), [(-0.01, False), (None, True)], ids=["deadline", "cancelled"]
)
async def test_a_status_for_a_client_gone_is_info(remaining, cancelled) -> None:
    [line] = await end(Context(remaining, cancelled), DeadlineExceeded("deadline exceeded"))
    assert (line["log_level"], line["client_gone"]) == ("info", True)
    assert line["error"] == "ExecuteBatchError" and "0x" not in str(line)


@pytest.mark.parametrize("remaining", [5.0, None], ids=["deadline-ahead", "no-deadline"])
async def test_a_status_a_waiting_client_missed_is_a_warning(remaining) -> None:
    # Control: the client is still there (its deadline ahead, or none), so a status that could
    # not be sent is something to look at.
    [line] = await end(Context(remaining, False), Unavailable("decode node lost"))
    assert (line["log_level"], line["client_gone"]) == ("warning", False)
    assert line["code"] == "UNAVAILABLE" and line["error"] == "ExecuteBatchError"
