"""A prefill call that failed because decode restarted in place (UNAVAILABLE ``NODE_RESTARTED``:
decode's new process refused the transfer for a reservation of its old one) counts against
neither node's cool-down: the prefill node did nothing wrong, and decode's new process serves.
Counting it cooled a healthy prefill node after three such requests (a restart with requests in
flight makes as many). Controls: a failed transfer (TRANSFER_FAILED) still counts against both,
and RESERVATION_RELEASED, as before, against neither."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from control_plane.registry import DECODE, PREFILL
from control_plane.routing import node_failed
from kvfence.errors import NODE_RESTARTED, RESERVATION_RELEASED, Unavailable


def _rpc_error(reason: str) -> grpc.aio.AioRpcError:
    status = Unavailable("KV transfer to decode failed", reason=reason).to_status()
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )


@pytest.mark.parametrize(
    "reason, counted",
    [(NODE_RESTARTED, 0), (RESERVATION_RELEASED, 0), ("TRANSFER_FAILED", 1)],
)
def test_a_restarted_decode_counts_against_neither_node(reason: str, counted: int) -> None:
    registry = SimpleNamespace(failures_to_cool=3, failure_cooldown_s=10.0)
    prefill = SimpleNamespace(node_id="prefill-0", role=PREFILL, failures=0, failed_at=0.0)
    decode = SimpleNamespace(node_id="decode-0", role=DECODE, failures=0, failed_at=0.0)
    failure = node_failed(registry, prefill, _rpc_error(reason), decode)  # type: ignore[arg-type]
    assert failure.reason == reason and failure.code == grpc.StatusCode.UNAVAILABLE
    assert (prefill.failures, decode.failures) == (counted, counted)
