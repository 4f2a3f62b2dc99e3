"""Decode's manifest verification on real nodes, from a review of the transfer manifest path: the
manifest is checked before the sampling parameters, integrity log lines name the reservation's
ids (not the ones the call claims), and a Decode after its reservation was released is checked
for nothing."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import structlog
from test_prefill_decode import (  # noqa: F401  (nodes, tiny_dir: fixtures)
    _all_free,
    _decode_request,
    _outcome,
    nodes,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence.errors import RESERVATION_RELEASED, error_info
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2

PROMPT = list(range(3, 23))
SAMPLING = common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
OVERSIZED = common_pb2.SamplingParams(max_new_tokens=50, ignore_eos=True)


@pytest.fixture(autouse=True)
def _all_log_levels() -> Iterator[None]:
    """Log through structlog's defaults, every level: a CLI test run in-process before this one
    configures structlog at WARNING, which dropped the info lines these tests read."""
    structlog.reset_defaults()
    yield


def integrity_events(dec) -> list[dict]:
    return [e for e in dec.bus.recent if e["kind"] == "integrity_violation"]


async def test_a_tampered_manifest_with_too_many_new_tokens_is_an_integrity_failure(
    nodes,  # noqa: F811
):
    """A tampered manifest asking for more new tokens than reserved is DATA_LOSS MAC, reported
    and its reservation gone (it was INVALID_ARGUMENT, with no event and the reservation kept)."""
    dec, _, dstub, pstub = nodes
    res, call = await reserve_and_prefill(dstub, pstub, "s1", PROMPT, SAMPLING, max_new=2)
    reply = await call
    bad = _decode_request(res, reply, "s1", OVERSIZED)
    bad.manifest.token_count += 1  # tampered: the MAC no longer verifies
    _, err = await _outcome(dstub.Decode(bad))
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
    assert error_info(err).reason == "MAC"
    events = integrity_events(dec)
    assert [(e["check"], e["stage"], e["request_id"]) for e in events] == [
        ("MAC", "manifest", "s1")
    ]
    assert res.reservation_id not in dec.servicer.reservations
    # the untouched manifest now finds the reservation released (quarantined, given back)
    _, err = await _outcome(dstub.Decode(_decode_request(res, reply, "s1", SAMPLING)))
    assert err is not None and error_info(err).reason == RESERVATION_RELEASED
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="s1"))
    await _all_free(dec.rt.pool)


async def test_a_valid_manifest_with_too_many_new_tokens_is_invalid_and_keeps_its_reservation(
    nodes,  # noqa: F811
):
    """Control: the same oversized call with the untouched manifest is INVALID_ARGUMENT, with no
    integrity event; the reservation is kept as it was, and a corrected Decode then decodes."""
    dec, _, dstub, pstub = nodes
    res, call = await reserve_and_prefill(dstub, pstub, "s2", PROMPT, SAMPLING, max_new=2)
    reply = await call
    _, err = await _outcome(dstub.Decode(_decode_request(res, reply, "s2", OVERSIZED)))
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "max_new_tokens 50 is over the 2" in (err.details() or "")
    assert integrity_events(dec) == []
    assert res.reservation_id in dec.servicer.reservations
    tokens, err = await _outcome(dstub.Decode(_decode_request(res, reply, "s2", SAMPLING)))
    assert err is None and len(tokens) == 2
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="s2"))
    await _all_free(dec.rt.pool)


def integrity_log_lines(logs: list[dict]) -> list[dict]:
    return [line for line in logs if line.get("event") == "integrity check failed"]


async def test_the_integrity_log_line_names_the_reservations_tenant_not_the_claimed_one(
    nodes,  # noqa: F811
):
    """A Decode claiming another tenant (in the call and its manifest) fails check 1; the log
    line, like the event, names the reservation's tenant, the claim as ``claimed_tenant_id``."""
    dec, _, dstub, pstub = nodes
    res, call = await reserve_and_prefill(dstub, pstub, "v1", PROMPT, SAMPLING, max_new=2)
    reply = await call
    forged = _decode_request(res, reply, "v1", SAMPLING, tenant="t-forged")
    forged.manifest.tenant_id = "t-forged"
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as logs:
        _, err = await _outcome(dstub.Decode(forged))
    assert err is not None and error_info(err).reason == "RESERVATION"
    assert [(e["tenant_id"], e["request_id"]) for e in integrity_events(dec)] == [("t-c", "v1")]
    [line] = integrity_log_lines(logs)
    assert line["tenant_id"] == "t-c" and line["request_id"] == "v1"
    assert line["claimed_tenant_id"] == "t-forged"
    assert "claimed_request_id" not in line
    # the reservation's release is logged under its own tenant too
    [released] = [line for line in logs if line.get("event") == "reservation released"]
    assert released["tenant_id"] == "t-c" and released["reason"] == "integrity"
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="v1"))
    await _all_free(dec.rt.pool)


async def test_an_integrity_log_line_of_an_honest_call_has_no_claimed_ids(
    nodes,  # noqa: F811
):
    """Control: a failure where the call claims the reservation's own ids (a tampered manifest)
    logs those ids, and no ``claimed_*`` field."""
    dec, _, dstub, pstub = nodes
    res, call = await reserve_and_prefill(dstub, pstub, "v2", PROMPT, SAMPLING, max_new=2)
    reply = await call
    bad = _decode_request(res, reply, "v2", SAMPLING)
    bad.manifest.first_token += 1
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as logs:
        _, err = await _outcome(dstub.Decode(bad))
    assert err is not None and error_info(err).reason == "MAC"
    [line] = integrity_log_lines(logs)
    assert line["tenant_id"] == "t-c" and line["request_id"] == "v2"
    assert not any(key.startswith("claimed_") for key in line)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="v2"))
    await _all_free(dec.rt.pool)


async def test_a_decode_after_its_release_is_checked_for_nothing(
    nodes,  # noqa: F811
):
    """A Decode whose reservation was released is UNAVAILABLE RESERVATION_RELEASED whatever its
    manifest says (a late Decode, not a forgery): no manifest check, no integrity event. Control:
    the same forged manifest before the release is DATA_LOSS, reported."""
    dec, _, dstub, pstub = nodes
    res, call = await reserve_and_prefill(dstub, pstub, "late", PROMPT, SAMPLING, max_new=2)
    reply = await call
    assert (await dstub.Release(prefill_pb2.ReleaseRequest(request_id="late"))).held
    forged = _decode_request(res, reply, "late", SAMPLING, tenant="t-forged")
    forged.manifest.tenant_id = "t-forged"
    forged.manifest.mac = b"not a mac"
    _, err = await _outcome(dstub.Decode(forged))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert error_info(err).reason == RESERVATION_RELEASED
    assert integrity_events(dec) == []
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="late"))

    res, call = await reserve_and_prefill(dstub, pstub, "live", PROMPT, SAMPLING, max_new=2)
    reply = await call
    forged = _decode_request(res, reply, "live", SAMPLING, tenant="t-forged")
    forged.manifest.tenant_id = "t-forged"
    forged.manifest.mac = b"not a mac"
    _, err = await _outcome(dstub.Decode(forged))
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
    assert [e["check"] for e in integrity_events(dec)] == ["RESERVATION"]
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="live"))
    await _all_free(dec.rt.pool)
