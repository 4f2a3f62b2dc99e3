"""Decode at the edges of a request's life: a stream closed as its first message is written, a
Decode that comes after its reservation expired, a first token that is not the model's.

Each was found by review and reproduced: the first pinned the reservation's pages for good (no
cleanup ran, and the reaper only reaps reservations never verified); the second was reported
as an integrity failure (DATA_LOSS, an ``integrity_violation`` event and the critical alert)
though nothing was forged; the third failed every request in the decode step with it, and told
each of them the other request's token.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from asyncwait import eventually
from test_prefill_decode import (  # noqa: F401  (tiny_dir: a fixture)
    _all_free,
    _decode_request,
    _outcome,
    node_pair,
    reserve_and_prefill,
    tiny_dir,
)

from kvfence import manifest as mf
from kvfence.auth import bearer_metadata
from kvfence.errors import RESERVATION_RELEASED, error_info
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2


def integrity_failures(node) -> float:
    text = node.metrics.render().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvfence_integrity_failures_total{")
    )


@pytest.mark.parametrize("closed_at_verified", [True, False])
async def test_a_stream_closed_as_verified_is_written_gives_its_pages_back(
    tiny_dir,  # noqa: F811
    tmp_path,
    closed_at_verified,
):
    """grpc.aio closes the handler's generator where it is suspended when the call ends (the
    control plane gone, a cancel) while ``verified`` is being written. Control: the same
    handler read to its end gives them back too."""
    async with node_pair(tiny_dir, tmp_path) as (dec, _, dstub, pstub):
        prompt = list(range(3, 23))
        sampling = common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True)
        res, call = await reserve_and_prefill(dstub, pstub, "r1", prompt, sampling, max_new=8)
        reply = await call

        class Context:
            def invocation_metadata(self):
                return bearer_metadata(dec.node_token)

            async def abort_with_status(self, status):
                raise asyncio.CancelledError

        handler = dec.servicer.Decode(_decode_request(res, reply, "r1", sampling), Context())
        assert (await handler.__anext__()).verified
        pool = dec.rt.pool
        assert pool.num_pages - pool.num_free == len(res.pages)  # held while it decodes
        tokens: list[int] = []
        if closed_at_verified:
            await handler.aclose()
        else:
            async for msg in handler:
                tokens.extend(msg.token_ids)
            assert len(tokens) == 8
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r1"))
        await _all_free(pool)
        assert not dec.servicer.reservations and not dec.servicer.busy()
        pool.check_integrity()


@pytest.mark.parametrize("late", [True, False])
async def test_a_decode_after_its_reservation_expired_is_not_an_integrity_failure(
    tiny_dir,  # noqa: F811
    tmp_path,
    late,
):
    """The reaper releases a reservation whose Decode has not come within
    transfer.reservation_timeout_s (counted from Reserve: a long prefill queue counts). Its late
    Decode is UNAVAILABLE RESERVATION_RELEASED (retry), with no integrity report. Control: the
    same Decode in time decodes; a Decode naming a reservation never issued is still DATA_LOSS
    RESERVATION, reported."""
    transfer = {"reservation_timeout_s": 1.0}
    async with node_pair(tiny_dir, tmp_path, transfer=transfer) as (dec, _, dstub, pstub):
        prompt = list(range(3, 23))
        sampling = common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
        res, call = await reserve_and_prefill(dstub, pstub, "slow", prompt, sampling, max_new=2)
        reply = await call
        if late:
            assert await eventually(lambda: not dec.servicer.reservations, timeout=5)
        tokens, err = await _outcome(dstub.Decode(_decode_request(res, reply, "slow", sampling)))
        if late:
            assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert error_info(err).reason == RESERVATION_RELEASED
            assert "transfer.reservation_timeout_s" in (err.details() or "")
        else:
            assert err is None and len(tokens) == 2
        assert integrity_failures(dec) == 0
        assert not any(e["kind"] == "integrity_violation" for e in dec.bus.recent)
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="slow"))

        forged = _decode_request(res, reply, "slow", sampling)
        forged.reservation_id = forged.manifest.reservation_id = "res-never-issued"
        _, err = await _outcome(dstub.Decode(forged))
        assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
        assert error_info(err).reason == "RESERVATION"
        assert integrity_failures(dec) == 1
        await _all_free(dec.rt.pool)


async def _read_rest(stream) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """``_outcome`` for a stream already read from with ``read()`` (grpc forbids mixing)."""
    tokens: list[int] = []
    try:
        while (msg := await stream.read()) is not grpc.aio.EOF:
            tokens.extend(msg.token_ids)
    except grpc.aio.AioRpcError as err:
        return tokens, err
    return tokens, None


@pytest.mark.parametrize("bad", [True, False])
async def test_a_first_token_outside_the_vocabulary_fails_its_own_request_only(
    tiny_dir,  # noqa: F811
    tmp_path,
    bad,
):
    """Manifest check 6 (MODEL): prefill signs the first token, so a prefill bug gets a valid
    MAC on a token the model does not have. Decode took it into the shared step, which failed
    for every row, each row's error naming the bad token. Now that request alone fails
    DATA_LOSS MODEL and the other tenant's, in the same batch, finishes. Control: with a good
    first token both finish."""
    async with node_pair(tiny_dir, tmp_path) as (dec, _, dstub, pstub):
        sampling = common_pb2.SamplingParams(max_new_tokens=40, ignore_eos=True)
        res_a, call_a = await reserve_and_prefill(
            dstub, pstub, "a", list(range(3, 23)), sampling, tenant="tenant-a", max_new=40
        )
        res_b, call_b = await reserve_and_prefill(
            dstub, pstub, "b", list(range(5, 25)), sampling, tenant="tenant-b", max_new=40
        )
        reply_a, reply_b = await call_a, await call_b
        request_b = _decode_request(res_b, reply_b, "b", sampling, tenant="tenant-b")
        if bad:
            request_b.manifest.first_token = 4_000_000_000
            mf.sign(request_b.manifest, res_b.secret)
        stream_a = dstub.Decode(_decode_request(res_a, reply_a, "a", sampling, tenant="tenant-a"))
        first = await stream_a.read()
        assert first.verified  # tenant A's request decodes before B's joins its steps
        a, b = await asyncio.gather(_read_rest(stream_a), _outcome(dstub.Decode(request_b)))
        assert a[1] is None and len(a[0]) == 40, a
        if bad:
            assert b[1] is not None and b[1].code() == grpc.StatusCode.DATA_LOSS
            assert error_info(b[1]).reason == "MODEL"
            assert integrity_failures(dec) == 1
        else:
            assert b[1] is None and len(b[0]) == 40
            assert integrity_failures(dec) == 0
        for rid in ("a", "b"):
            await pstub.Release(prefill_pb2.ReleaseRequest(request_id=rid))
        await _all_free(dec.rt.pool)
        assert dec.servicer.batcher._thread.is_alive()


@pytest.mark.parametrize("released", [True, False])
async def test_a_reservation_released_while_its_decode_waits_is_not_an_integrity_failure(
    tiny_dir,  # noqa: F811
    tmp_path,
    released,
):
    """Decode waits a moment for the transfer's last acknowledgement before it checks the
    manifest; a Release (or the reaper) in that moment made the check fail as an integrity
    failure ("not receiving"). It is RESERVATION_RELEASED now. Control: not released, the same
    Decode, whose transfer never came, fails the RESERVATION check as before."""
    from kvfence.proto.kvfence.v1 import decode_pb2

    transfer = {"batch_timeout_s": 1}
    async with node_pair(tiny_dir, tmp_path, transfer=transfer) as (dec, _, dstub, _pstub):
        sampling = common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
        res = await dstub.Reserve(
            decode_pb2.ReserveRequest(
                request_id="w", tenant_id="t-c", prompt_tokens=20, max_new_tokens=2
            )
        )
        manifest = common_pb2.KvManifest(
            request_id="w", tenant_id="t-c", reservation_id=res.reservation_id, token_count=20
        )
        request = decode_pb2.DecodeRequest(
            request_id="w",
            tenant_id="t-c",
            reservation_id=res.reservation_id,
            manifest=manifest,
            sampling=sampling,
        )
        decoding = asyncio.create_task(_outcome(dstub.Decode(request)))
        await asyncio.sleep(0.3)  # in decode's wait for the transfer (no prefill ever sends it)
        if released:
            await dstub.Release(prefill_pb2.ReleaseRequest(request_id="w"))
        _, err = await asyncio.wait_for(decoding, 5)
        assert err is not None
        if released:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(err).reason == RESERVATION_RELEASED
            assert integrity_failures(dec) == 0
        else:
            assert err.code() == grpc.StatusCode.DATA_LOSS
            assert error_info(err).reason == "RESERVATION"
        await _all_free(dec.rt.pool)


@pytest.mark.parametrize("seeded", [False, True])
async def test_a_sampled_decode_without_a_seed_is_refused_and_fails_no_other_row(
    tiny_dir,  # noqa: F811
    tmp_path,
    seeded,
):
    """A sampled row with no seed raised inside the shared decode step: every row of it failed
    INTERNAL, another tenant's included (and the control plane counts INTERNAL against the
    node). Decode now refuses that call INVALID_ARGUMENT, as prefill does, before it joins a
    step. Control: the same call with a seed decodes beside the other tenant's."""
    async with node_pair(tiny_dir, tmp_path) as (dec, _, dstub, pstub):
        greedy = common_pb2.SamplingParams(max_new_tokens=40, ignore_eos=True)
        sampled = common_pb2.SamplingParams(max_new_tokens=8, temperature=0.7, seed=7)
        res_a, call_a = await reserve_and_prefill(
            dstub, pstub, "a", list(range(3, 23)), greedy, tenant="tenant-a", max_new=40
        )
        # Prefill refuses a seedless sampled request, so it is given the seeded parameters.
        res_b, call_b = await reserve_and_prefill(
            dstub, pstub, "b", list(range(5, 25)), sampled, tenant="tenant-b", max_new=8
        )
        reply_a, reply_b = await call_a, await call_b
        request_b = _decode_request(res_b, reply_b, "b", sampled, tenant="tenant-b")
        if not seeded:
            request_b.sampling.ClearField("seed")
        stream_a = dstub.Decode(_decode_request(res_a, reply_a, "a", greedy, tenant="tenant-a"))
        assert (await stream_a.read()).verified
        a, b = await asyncio.gather(_read_rest(stream_a), _outcome(dstub.Decode(request_b)))
        assert a[1] is None and len(a[0]) == 40, a
        if seeded:
            assert b[1] is None and len(b[0]) == 8, b
        else:
            assert b[1] is not None and b[1].code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "needs a seed" in (b[1].details() or "")
            assert b[0] == []
        assert integrity_failures(dec) == 0
        for rid in ("a", "b"):
            await pstub.Release(prefill_pb2.ReleaseRequest(request_id=rid))
            await dstub.Release(prefill_pb2.ReleaseRequest(request_id=rid))
        await _all_free(dec.rt.pool)
        assert dec.servicer.batcher._thread.is_alive()


@pytest.mark.parametrize("claimed", ["tenant-other", "tenant-a"])
async def test_a_decode_under_another_tenants_name_fails_check_1(
    tiny_dir,  # noqa: F811
    tmp_path,
    claimed,
):
    """Check 1 is "the same request and tenant": a Decode that names the reservation's request
    but another tenant, over an untouched manifest, decoded all the same (only the manifest's
    tenant was compared), its log lines naming the claimed tenant. Now it is DATA_LOSS
    RESERVATION, reported, the reservation quarantined and given back, as for a forged manifest.
    Control: the right tenant decodes."""
    async with node_pair(tiny_dir, tmp_path) as (dec, _, dstub, pstub):
        sampling = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)
        res, call = await reserve_and_prefill(
            dstub, pstub, "r1", list(range(3, 23)), sampling, tenant="tenant-a", max_new=4
        )
        reply = await call
        request = _decode_request(res, reply, "r1", sampling, tenant=claimed)
        tokens, err = await _outcome(dstub.Decode(request))
        if claimed == "tenant-a":
            assert err is None and len(tokens) == 4
            assert integrity_failures(dec) == 0
        else:
            assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
            assert error_info(err).reason == "RESERVATION" and tokens == []
            assert integrity_failures(dec) == 1
            assert res.reservation_id not in dec.servicer.reservations
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r1"))
        await _all_free(dec.rt.pool)


@pytest.mark.parametrize("caller", ["r-y", "r-x"], ids=["control-same-request", "other-request"])
async def test_a_decode_naming_another_request_over_its_reservation_is_refused(
    tiny_dir,  # noqa: F811
    tmp_path,
    caller,
):
    """Decode acts on a reservation only for the request it was made for: a call naming request
    r-x over r-y's reservation and r-y's untouched manifest (every manifest check compares the
    manifest with the reservation, both r-y's) must not decode r-y's KV. It is DATA_LOSS
    RESERVATION, reported, as for a reservation never issued; r-y's reservation is not touched,
    so r-y's own Decode still decodes. Control: the same call naming r-y decodes."""
    async with node_pair(tiny_dir, tmp_path) as (dec, _, dstub, pstub):
        sampling = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)
        res, call = await reserve_and_prefill(
            dstub, pstub, "r-y", list(range(3, 40)), sampling, max_new=4
        )
        reply = await call
        tokens, err = await _outcome(dstub.Decode(_decode_request(res, reply, caller, sampling)))
        if caller == "r-y":
            assert err is None and len(tokens) == 4
            assert integrity_failures(dec) == 0
        else:
            assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
            assert error_info(err).reason == "RESERVATION" and tokens == []
            assert integrity_failures(dec) == 1
            assert res.reservation_id in dec.servicer.reservations  # r-y's, left as it was
            tokens, err = await _outcome(dstub.Decode(_decode_request(res, reply, "r-y", sampling)))
            assert err is None and len(tokens) == 4
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r-y"))
        await _all_free(dec.rt.pool)
