"""Prefill and decode nodes in process, driven the way the control plane drives them."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from kvfence.auth import bearer_metadata, with_token
from kvfence.config import Role, parse_config
from kvfence.errors import error_info
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvfence.transfer import InboundState


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def make_cfg(tiny_dir, tmp_path, **over):
    data = {
        "model": {"path": str(tiny_dir)},
        "kv": {
            "page_size": 16,
            "prefill_pool": {"num_pages": 16},
            "decode_pool": {"num_pages": 24},
        },
        "control_plane": {"state_dir": str(tmp_path)},
        "transfer": {"max_batch_bytes": 40000, "batch_timeout_s": 5},
    }
    for k, v in over.items():
        data.setdefault(k, {}).update(v)
    return parse_config(data, environ={})


@contextlib.asynccontextmanager
async def node_pair(tiny_dir, tmp_path, **over):
    """A decode and a prefill node, unregistered, and stubs that call them as the control plane
    does (with the node token): ``(dec, pre, dstub, pstub)``; both stopped at the end. ``over``:
    config sections to override (``make_cfg``)."""
    cfg = make_cfg(tiny_dir, tmp_path, **over)
    dec = await start_node(cfg, Role.DECODE, register=False)
    pre = await start_node(cfg, Role.PREFILL, register=False)
    try:
        async with (
            grpc.aio.insecure_channel(dec.address) as dch,
            grpc.aio.insecure_channel(pre.address) as pch,
        ):
            yield (
                dec,
                pre,
                with_token(decode_pb2_grpc.DecodeStub(dch), dec.node_token),
                with_token(prefill_pb2_grpc.PrefillStub(pch), pre.node_token),
            )
    finally:
        await pre.stop(grace=1)
        await dec.stop(grace=1)


@pytest.fixture
async def nodes(tiny_dir, tmp_path):
    async with node_pair(tiny_dir, tmp_path) as pair:
        yield pair


async def reserve_and_prefill(
    dstub, pstub, request_id, prompt, sampling=None, res=None, tenant="t-c", max_new=4
):
    """Reserve on decode (unless ``res`` is given), then the Prefill call, not yet awaited."""
    sampling = sampling or common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    res = res or await dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id=request_id,
            tenant_id=tenant,
            prompt_tokens=len(prompt),
            max_new_tokens=max_new,
        )
    )
    call = pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id,
            tenant_id=tenant,
            prompt_token_ids=prompt,
            sampling=sampling,
            reservation=res,
        )
    )
    return res, call


async def run_request(dstub, pstub, request_id, tenant, prompt, max_new, sampling=None):
    sampling = sampling or common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    res, call = await reserve_and_prefill(
        dstub, pstub, request_id, prompt, sampling, tenant=tenant, max_new=max_new
    )
    pre = await call
    tokens, finish, verified = [], "", False
    async for msg in dstub.Decode(
        decode_pb2.DecodeRequest(
            request_id=request_id,
            tenant_id=tenant,
            reservation_id=res.reservation_id,
            manifest=pre.manifest,
            sampling=sampling,
        )
    ):
        verified = verified or msg.verified
        tokens.extend(msg.token_ids)
        finish = msg.finish_reason or finish
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id=request_id))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id=request_id))
    return res, pre, tokens, finish, verified


@pytest.mark.parametrize("prompt_len", [15, 16, 17, 33])
async def test_disaggregated_equals_colocated(nodes, tiny_dir, prompt_len):
    dec, pre, dstub, pstub = nodes
    prompt = [(7 * i + 3) % 300 + 3 for i in range(prompt_len)]
    _, p, tokens, finish, verified = await run_request(dstub, pstub, "r1", "t-a", prompt, 12)
    ref = ColocatedEngine.from_path(tiny_dir).generate(
        [GenerationRequest(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))]
    )[0]
    assert verified
    assert tokens == ref.token_ids
    assert finish == ref.finish_reason == "length"
    assert p.manifest.token_count == prompt_len
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages
    dec.rt.pool.check_integrity()


async def test_tampered_manifest_is_data_loss_and_pages_come_back(nodes):
    dec, pre, dstub, pstub = nodes
    prompt = list(range(3, 40))
    res = await dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id="r2", tenant_id="t-b", prompt_tokens=37, max_new_tokens=4
        )
    )
    sampling = common_pb2.SamplingParams(max_new_tokens=4)
    p = await pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="r2",
            tenant_id="t-b",
            prompt_token_ids=prompt,
            sampling=sampling,
            reservation=res,
        )
    )
    bad = common_pb2.KvManifest()
    bad.CopyFrom(p.manifest)
    bad.token_count -= 1  # the incident: fewer tokens than reserved
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in dstub.Decode(
            decode_pb2.DecodeRequest(
                request_id="r2",
                tenant_id="t-b",
                reservation_id=res.reservation_id,
                manifest=bad,
                sampling=sampling,
            )
        ):
            pass
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert error_info(err.value).reason == "MAC"  # tampering breaks the MAC first
    assert any(e["kind"] == "integrity_violation" for e in dec.bus.recent)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r2"))
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages
    # control: the same path with an untouched manifest succeeds on a fresh reservation
    _, _, tokens, finish, verified = await run_request(dstub, pstub, "r3", "t-b", prompt, 4)
    assert verified and len(tokens) >= 1 and finish in ("length", "eos")


async def test_a_duplicate_prefill_is_refused_without_freeing_the_first(nodes):
    _, pre, dstub, pstub = nodes
    pool = pre.rt.pool
    prompt = list(range(3, 40))  # 3 pages
    res, first = await reserve_and_prefill(dstub, pstub, "dup", prompt)
    await first  # control: the first call succeeds; its pages stay held until Release
    assert pool.num_free == pool.num_pages - 3
    _, again = await reserve_and_prefill(dstub, pstub, "dup", prompt, res=res)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await again
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already prefilled" in err.value.details()
    # the refusal did not hand the first call's pages back (they could be reused while held)
    assert pool.num_free == pool.num_pages - 3 and "dup" in pre.servicer.held
    held = await pstub.Release(prefill_pb2.ReleaseRequest(request_id="dup"))
    assert held.held and pool.num_free == pool.num_pages
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="dup"))
    pool.check_integrity()


@contextlib.contextmanager
def held_pass(engine):
    """Hold prefill's forward passes at their start until ``go`` is set: yields (entered, go),
    threading events (the pass runs on the engine thread); restores the engine on exit."""
    import threading

    entered, go = threading.Event(), threading.Event()
    real_prefill = engine.prefill_many

    def held_prefill(prompts, pages):
        entered.set()
        assert go.wait(30)
        return real_prefill(prompts, pages)

    engine.prefill_many = held_prefill
    try:
        yield entered, go
    finally:
        go.set()
        engine.prefill_many = real_prefill


@pytest.mark.parametrize("release_queued", [True, False])
async def test_a_prompt_released_while_queued_for_its_pass_never_runs(nodes, release_queued):
    """A prompt waiting behind another's pass is released (the control plane, or the reaper,
    which releases exactly the prompts queued too long): its pass ran all the same, on pages no
    one owned, and the live prompts behind it waited for it. Now it is dropped from the queue
    and its call fails UNAVAILABLE, RESERVATION_RELEASED. Control: not released, both run."""
    from asyncwait import eventually

    _, pre, dstub, pstub = nodes
    pool, batcher = pre.rt.pool, pre.servicer.batcher
    with held_pass(pre.rt.engine) as (entered, go):
        _, first = await reserve_and_prefill(dstub, pstub, "first", list(range(3, 20)))
        first_call = asyncio.ensure_future(first)
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        _, second = await reserve_and_prefill(dstub, pstub, "second", list(range(3, 40)))
        second_call = asyncio.ensure_future(second)
        assert await eventually(lambda: "second" in pre.servicer.held)
        if release_queued:
            assert (await pstub.Release(prefill_pb2.ReleaseRequest(request_id="second"))).held
        go.set()
        await first_call
        if release_queued:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await second_call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(err.value).reason == "RESERVATION_RELEASED"
            assert batcher.prompts == 1
        else:
            assert (await second_call).manifest.token_count == 37
            assert batcher.prompts == 2
    for rid in ("first", "second"):
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id=rid))
        await dstub.Release(prefill_pb2.ReleaseRequest(request_id=rid))
    assert await eventually(lambda: pool.num_free == pool.num_pages)
    pool.check_integrity()


@pytest.mark.parametrize("release_midway", [True, False])
async def test_pages_released_during_the_forward_pass_are_not_reused_before_it_ends(
    nodes, release_midway
):
    from kvfence.kv.pool import PageState

    _, pre, dstub, pstub = nodes
    pool = pre.rt.pool
    with held_pass(pre.rt.engine) as (entered, go):
        prompt = list(range(3, 40))  # 3 pages
        _, call = await reserve_and_prefill(dstub, pstub, "mid", prompt)
        task = asyncio.ensure_future(call)
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        pages = [r.page_id for r in pre.servicer.held["mid"].pages]
        if release_midway:
            held = await pstub.Release(prefill_pb2.ReleaseRequest(request_id="mid"))
            assert held.held
            # the engine thread still writes them: quarantined, not free, whatever else asks
            assert {pool.state_of(p) for p in pages} == {PageState.QUARANTINED}
            assert pool.num_free == pool.num_pages - 3
            other = pool.allocate(pool.num_free, "someone-else")
            assert other is not None and not {r.page_id for r in other} & set(pages)
            pool.release("someone-else")
        go.set()
        if release_midway:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await task
            # the reservation is over (as a late transfer's): not a cancel the client made
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(err.value).reason == "RESERVATION_RELEASED"
        else:  # control: the same held pass, not released, completes and keeps its pages
            reply = await task
            assert reply.manifest.token_count == len(prompt)
            assert pool.num_free == pool.num_pages - 3
            await pstub.Release(prefill_pb2.ReleaseRequest(request_id="mid"))
        assert pool.num_free == pool.num_pages  # every page back once the pass ended
        await dstub.Release(prefill_pb2.ReleaseRequest(request_id="mid"))
    pool.check_integrity()


@pytest.mark.parametrize("cancel_midway", [True, False])
async def test_the_page_gauge_shows_pages_freed_when_a_cancelled_calls_pass_ends(
    nodes, cancel_midway
):
    """A Prefill call cancelled (client gone, deadline) while its pass runs leaves its pages
    quarantined until the pass ends; the pass's end freed them but published nothing, so on an
    idle node the gauge showed them quarantined until the next call (KvfencePagesQuarantined
    after 30 min, for pages that were free). Control: the same held pass, not cancelled."""
    from asyncwait import eventually

    _, pre, dstub, pstub = nodes
    pool = pre.rt.pool

    def gauge(state: str) -> float:
        return pre.metrics.pages.labels(state=state)._value.get()

    with held_pass(pre.rt.engine) as (entered, go):
        _, call = await reserve_and_prefill(dstub, pstub, "gauge", list(range(3, 40)))
        task = asyncio.ensure_future(call)
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        if cancel_midway:
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await eventually(lambda: "gauge" not in pre.servicer.held)
            assert gauge("quarantined") == 3  # the pass still writes them
        go.set()
        if cancel_midway:
            assert await eventually(lambda: pool.num_free == pool.num_pages)
        else:
            assert (await task).manifest.token_count == 37
            await pstub.Release(prefill_pb2.ReleaseRequest(request_id="gauge"))
        # no other call on the node: the gauge must follow the pool by itself
        assert await eventually(lambda: gauge("quarantined") == 0, timeout=2)
        assert (gauge("free"), gauge("held")) == (pool.num_pages, 0)
        await dstub.Release(prefill_pb2.ReleaseRequest(request_id="gauge"))


@pytest.mark.parametrize(
    "prompt, sampling, ok",
    [
        ([5, 6, 7, 10**6], None, False),  # a token outside the vocabulary
        ([5, 6, 7, 8], None, True),  # control
        ([5, 6, 7, 8], common_pb2.SamplingParams(max_new_tokens=4, temperature=0.7), False),
        ([5, 6, 7, 8], common_pb2.SamplingParams(max_new_tokens=4, temperature=0.7, seed=3), True),
    ],
)
async def test_bad_prefill_input_is_invalid_argument(nodes, prompt, sampling, ok):
    _, pre, dstub, pstub = nodes
    _, call = await reserve_and_prefill(dstub, pstub, "bad-in", prompt, sampling)
    if ok:
        assert (await call).manifest.token_count == len(prompt)
    else:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="bad-in"))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="bad-in"))
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages


@pytest.mark.parametrize("mismatch", ["more-tokens", "fewer-tokens", "fewer-pages", None])
async def test_a_reservation_that_does_not_match_the_prompt_is_invalid_argument(nodes, mismatch):
    """Prefill writes the prompt's KV into the reservation's pages and signs its token count:
    a reservation made for another token count, or with fewer pages than the prompt fills, is
    refused INVALID_ARGUMENT before anything is computed or sent (decode's transfer is still
    waiting for its hello), and leaves nothing held: the same call with the reservation as
    decode issued it then prefills. Control (None): that reservation, whose pages are exactly
    the prompt's (20 tokens and 4 new in pages of 16), prefills at once."""
    dec, pre, dstub, pstub = nodes
    prompt = list(range(3, 23))
    res = await dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id="mis", tenant_id="t-c", prompt_tokens=len(prompt), max_new_tokens=4
        )
    )
    assert len(res.pages) == 2
    if mismatch is not None:
        bad = prefill_pb2.Reservation()
        bad.CopyFrom(res)
        if mismatch == "more-tokens":
            bad.prompt_tokens += 1  # still within the two pages
        elif mismatch == "fewer-tokens":
            bad.prompt_tokens -= 1
        else:
            del bad.pages[1:]
        _, call = await reserve_and_prefill(dstub, pstub, "mis", prompt, res=bad)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(
            f"prompt of 20 tokens does not match the reservation "
            f"({bad.prompt_tokens} tokens, {len(bad.pages)} pages)"
        )
        assert "mis" not in pre.servicer.held
        assert pre.rt.pool.num_free == pre.rt.pool.num_pages
        transfer = dec.servicer.receiver.transfers[res.reservation_id]
        assert transfer.state == InboundState.EXPECTING and transfer.received == []
    _, call = await reserve_and_prefill(dstub, pstub, "mis", prompt, res=res)
    assert (await call).manifest.token_count == len(prompt)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="mis"))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="mis"))
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_a_node_serves_its_metrics_where_configured(tiny_dir, tmp_path, host):
    import urllib.request

    cfg = make_cfg(tiny_dir, tmp_path, node={"metrics_port": 0, "metrics_host": host})
    dec = await start_node(cfg, Role.DECODE, register=False)
    pre = await start_node(cfg, Role.PREFILL, register=False)
    dch = grpc.aio.insecure_channel(dec.address)
    pch = grpc.aio.insecure_channel(pre.address)
    try:
        assert pre.metrics._server.server_address[0] == host
        await run_request(
            with_token(decode_pb2_grpc.DecodeStub(dch), dec.node_token),
            with_token(prefill_pb2_grpc.PrefillStub(pch), pre.node_token),
            "m",
            "t",
            [5, 6, 7],
            2,
        )
        url = f"http://127.0.0.1:{pre.metrics.port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        for node in (pre, dec):  # exported from the start (at 0 but for a stall meanwhile)
            labels = {"model": cfg.model.name, "service": node.metrics.service}
            assert (
                node.metrics.registry.get_sample_value("kvfence_stalled_seconds_total", labels)
                is not None
            )
    finally:
        await dch.close()
        await pch.close()
        await pre.stop(grace=1)
        await dec.stop(grace=1)
    assert 'kvfence_prefill_pass_prompts_count{service="prefill"} 1.0' in body
    assert pre.metrics.port is None  # stopped with the node


async def _all_free(pool, within_s: float = 5.0) -> None:
    """Wait for every page of ``pool`` to be free (a step or receive in flight holds its page
    quarantined until it ends); fail after ``within_s``."""
    for _ in range(int(within_s / 0.02)):
        if pool.num_free == pool.num_pages:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{pool.num_pages - pool.num_free} pages still held")


async def _outcome(stream) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """The tokens a Decode stream yielded, and the error it ended with (None: it finished)."""
    tokens: list[int] = []
    try:
        async for msg in stream:
            tokens.extend(msg.token_ids)
    except grpc.aio.AioRpcError as err:
        return tokens, err
    return tokens, None


def _decode_request(res, pre_reply, request_id, sampling, tenant="t-c"):
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        tenant_id=tenant,
        reservation_id=res.reservation_id,
        manifest=pre_reply.manifest,
        sampling=sampling,
    )


@pytest.mark.parametrize("release_first", [True, False])
async def test_a_release_while_verified_is_written_ends_that_stream_and_no_other(
    nodes, release_first
):
    """grpc.aio writes ``verified`` while the Decode handler is suspended; a Release served in
    that gap gave the pages back, and the handler then added the sequence anyway: its first step
    raised on the engine thread, which died, and every later request on the node hung."""
    dec, _, dstub, pstub = nodes
    prompt = list(range(3, 23))
    sampling = common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "r1", prompt, sampling, max_new=8)
    reply = await call
    # Drive the handler's generator as grpc.aio does: one message, the write, the next message.
    aborted: list[grpc.StatusCode] = []

    class Context:  # what the handler uses of its context here: the node token, ending the call
        def invocation_metadata(self):
            return bearer_metadata(dec.node_token)

        async def abort_with_status(self, status):
            aborted.append(status.code)
            raise asyncio.CancelledError  # how grpc.aio's abort ends a handler

    handler = dec.servicer.Decode(_decode_request(res, reply, "r1", sampling), Context())
    first = await handler.__anext__()
    assert first.verified
    if release_first:
        await dec.servicer.Release(prefill_pb2.ReleaseRequest(request_id="r1"), Context())
    tokens = []
    try:
        async for msg in handler:
            tokens.extend(msg.token_ids)
    except asyncio.CancelledError:
        pass
    if release_first:
        assert aborted == [grpc.StatusCode.CANCELLED] and tokens == []
    else:  # control: the same handler, not released, streams every token
        assert aborted == [] and len(tokens) == 8
    assert dec.servicer.batcher._thread.is_alive()
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="r1"))
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages
    # Another request on the node is served as before.
    _, _, tokens, finish, verified = await run_request(dstub, pstub, "r2", "t-d", prompt, 8)
    assert verified and len(tokens) == 8 and finish == "length"


@pytest.mark.parametrize("asked, ok", [(40, False), (1, True)])
async def test_decode_asking_more_tokens_than_reserved_is_invalid_argument(nodes, asked, ok):
    """More new tokens than the reservation was made for would run past its pages (it killed
    the engine thread)."""
    dec, _, dstub, pstub = nodes
    prompt = list(range(3, 19))  # 16 tokens + 1 new: 2 pages
    reserved = common_pb2.SamplingParams(max_new_tokens=1, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "over", prompt, reserved, max_new=1)
    reply = await call
    sampling = common_pb2.SamplingParams(max_new_tokens=asked, ignore_eos=True)
    tokens, err = await _outcome(dstub.Decode(_decode_request(res, reply, "over", sampling)))
    if ok:  # control: as many as reserved
        assert err is None and len(tokens) == 1
    else:
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the 1 this reservation was made for" in (err.details() or "")
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="over"))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="over"))
    assert dec.servicer.batcher._thread.is_alive()
    assert dec.rt.pool.num_free == dec.rt.pool.num_pages


@pytest.mark.parametrize("ending", ["finished", "cancelled"])
async def test_decode_gives_pages_back_when_its_stream_ends_without_a_release(nodes, ending):
    """The control plane's Release can be lost (it logs and goes on): decode must not depend on
    it once the stream that read the pages has ended."""
    dec, _, dstub, pstub = nodes
    pool = dec.rt.pool
    prompt = list(range(3, 23))
    max_new = 4 if ending == "finished" else 200
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "gone", prompt, sampling, max_new=max_new)
    reply = await call
    stream = dstub.Decode(_decode_request(res, reply, "gone", sampling))
    held_while_streaming = None
    async for msg in stream:
        if msg.token_ids and held_while_streaming is None:
            # control: the pages are held while the stream reads them
            held_while_streaming = pool.num_pages - pool.num_free
            if ending == "cancelled":
                stream.cancel()
                break
    assert held_while_streaming == len(res.pages)
    await _all_free(pool)  # the handler's cleanup runs as the cancellation reaches it
    assert not dec.servicer.reservations
    late = await dstub.Release(prefill_pb2.ReleaseRequest(request_id="gone"))
    assert not late.held  # the control plane's Release, when it comes, finds nothing
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="gone"))
    pool.check_integrity()


async def test_a_decode_cancelled_before_its_kv_is_verified_gives_the_pages_back(
    tiny_dir, tmp_path
):
    from asyncwait import eventually

    """The Decode call goes (the client cancelled) while decode waits for the transfer to
    complete, and the control plane's Release is lost: the pages were held until the reaper,
    transfer.reservation_timeout_s after Reserve. Now they come back at once. Control: another
    reservation, whose Decode was not cancelled, stays held."""
    transfer = {"batch_timeout_s": 20, "reservation_timeout_s": 60.0}
    async with node_pair(tiny_dir, tmp_path, transfer=transfer) as (dec, _, dstub, _):
        pool = dec.rt.pool
        reserved = {}
        for rid in ("cancelled", "kept"):
            reserved[rid] = await dstub.Reserve(
                decode_pb2.ReserveRequest(
                    request_id=rid, tenant_id="t", prompt_tokens=20, max_new_tokens=2
                )
            )
        res = reserved["cancelled"]
        manifest = common_pb2.KvManifest(
            request_id="cancelled", tenant_id="t", reservation_id=res.reservation_id
        )
        call = dstub.Decode(
            decode_pb2.DecodeRequest(
                request_id="cancelled",
                tenant_id="t",
                reservation_id=res.reservation_id,
                manifest=manifest,
                sampling=common_pb2.SamplingParams(max_new_tokens=2),
            )
        )
        reading = asyncio.ensure_future(call.read())
        # The handler waits for the transfer (no prefill sent one) when the call goes.
        assert await eventually(lambda: dec.servicer.rpc_count >= 3)
        await asyncio.sleep(0.2)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reading
        kept_pages = len(reserved["kept"].pages)
        assert await eventually(lambda: pool.num_pages - pool.num_free == kept_pages, timeout=5)
        assert list(dec.servicer.by_request) == ["kept"]
        assert not (await dstub.Release(prefill_pb2.ReleaseRequest(request_id="cancelled"))).held
        assert (await dstub.Release(prefill_pb2.ReleaseRequest(request_id="kept"))).held
        await _all_free(pool)


async def test_a_release_mid_decode_ends_the_stream_cancelled(nodes):
    """A Release while the stream is open (an operator's abort reaching decode first, a
    control plane that forgot the node) must end that stream, not leave it waiting."""
    dec, _, dstub, pstub = nodes
    prompt = list(range(3, 23))
    sampling = common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "mid-d", prompt, sampling, max_new=200)
    reply = await call
    stream = dstub.Decode(_decode_request(res, reply, "mid-d", sampling))
    got = 0

    async def consume():
        nonlocal got
        async for msg in stream:
            got += len(msg.token_ids)
            if got and got < 1000:
                await dstub.Release(prefill_pb2.ReleaseRequest(request_id="mid-d"))
                got += 1000  # release once

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(consume(), 10)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert 1000 < got < 1200  # it ended well before its 200 tokens
    # The page the step in flight writes stays quarantined until that step is over.
    await _all_free(dec.rt.pool)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="mid-d"))


async def test_a_duplicate_decode_fails_the_request_and_ends_its_first_stream(nodes):
    """A second Decode for a reservation already decoding fails check 1 (DATA_LOSS, pages
    quarantined, a security event); the first stream must end too, not wait forever."""
    dec, _, dstub, pstub = nodes
    prompt = list(range(3, 23))
    sampling = common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "twice", prompt, sampling, max_new=200)
    reply = await call
    first = dstub.Decode(_decode_request(res, reply, "twice", sampling))
    got = []

    async def consume():
        async for msg in first:
            got.extend(msg.token_ids)

    task = asyncio.ensure_future(consume())
    while not got:  # control: the first stream is decoding
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as dup:
        async for _ in dstub.Decode(_decode_request(res, reply, "twice", sampling)):
            pass
    assert dup.value.code() == grpc.StatusCode.DATA_LOSS
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await asyncio.wait_for(task, 10)
    assert ended.value.code() == grpc.StatusCode.CANCELLED and len(got) < 200
    assert any(e["kind"] == "integrity_violation" for e in dec.bus.recent)
    await _all_free(dec.rt.pool)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="twice"))


@pytest.mark.parametrize("scrub", [True, False])
async def test_a_scrubbing_tenants_kv_is_zeroed_on_both_nodes_when_freed(nodes, scrub):
    """DESIGN: a released page is scrubbed for tenants that ask. Prefill holds the same prompt
    KV as decode; it used to be told nothing and kept it in its free pages. The control: a
    tenant that did not ask keeps the cheaper release (its bytes stay until overwritten)."""
    dec, pre, dstub, pstub = nodes
    prompt = list(range(3, 35))  # 2 pages
    sampling = common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
    res = await dstub.Reserve(
        decode_pb2.ReserveRequest(
            request_id="s1", tenant_id="t-s", prompt_tokens=len(prompt), max_new_tokens=2,
            scrub_on_free=scrub,
        )
    )  # fmt: skip
    reply = await pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="s1", tenant_id="t-s", prompt_token_ids=prompt, sampling=sampling,
            reservation=res, scrub_on_free=scrub,
        )
    )  # fmt: skip
    source = [r.page_id for r in pre.rt.pool.pages_of("s1")]
    async for _ in dstub.Decode(_decode_request(res, reply, "s1", sampling, tenant="t-s")):
        pass
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="s1"))
    await _all_free(dec.rt.pool)
    assert pre.rt.pool.num_free == pre.rt.pool.num_pages
    written = {
        "prefill": [int(pre.rt.pool.kv[p].count_nonzero()) for p in source],
        "decode": [int(dec.rt.pool.kv[p.page_id].count_nonzero()) for p in res.pages[:2]],
    }
    if scrub:
        assert written == {"prefill": [0, 0], "decode": [0, 0]}
    else:
        assert all(n > 0 for counts in written.values() for n in counts), written


async def test_a_prompt_the_closed_engine_refuses_leaves_no_page_held(nodes):
    """Shutting down, the prefill batcher refuses new prompts; the call fails and its pages go
    back (they were counted busy for a pass that never came). Control: before the close, the
    same call succeeds."""
    _, pre, dstub, pstub = nodes
    pool = pre.rt.pool
    prompt = list(range(3, 40))
    _, ok = await reserve_and_prefill(dstub, pstub, "before", prompt)
    assert (await ok).manifest.token_count == len(prompt)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="before"))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="before"))
    pre.servicer.batcher.close()
    _, refused = await reserve_and_prefill(dstub, pstub, "after", prompt)
    with pytest.raises(grpc.aio.AioRpcError):
        await refused
    assert pool.num_free == pool.num_pages
    pool.check_integrity()
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="after"))


async def test_prefill_counts_and_reports_its_own_tag_check(nodes, monkeypatch):
    """A page found at another generation in prefill's forward pass fails the call DATA_LOSS and
    is counted, as an event and an error line, by prefill, where the check ran (the control
    plane counts only its own checks). Control: the same call with the pages as they are."""
    import structlog

    from kvfence.kv.pool import PageRef

    _, pre, dstub, pstub = nodes
    prompt = list(range(3, 40))
    _, ok = await reserve_and_prefill(dstub, pstub, "ok", prompt)
    assert (await ok).manifest.token_count == len(prompt)

    def count(check: str) -> float:
        labels = {"service": "prefill", "check": check}
        value = pre.metrics.registry.get_sample_value("kvfence_integrity_failures_total", labels)
        return value or 0.0

    assert count("PAGE_GENERATION") == 0
    engine = pre.servicer.batcher.engine
    real = engine.prefill_many

    def stale_pages(prompts, pages):  # as if the pages changed owner before the pass read them
        return real(prompts, [[PageRef(r.page_id, r.generation + 1) for r in p] for p in pages])

    monkeypatch.setattr(engine, "prefill_many", stale_pages)
    with structlog.testing.capture_logs() as logs:
        _, bad = await reserve_and_prefill(dstub, pstub, "stale", prompt)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bad
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert error_info(err.value).reason == "PAGE_GENERATION"
    assert count("PAGE_GENERATION") == 1
    (line,) = [e for e in logs if e["event"] == "integrity check failed"]
    assert line["stage"] == "prefill" and line["check"] == "PAGE_GENERATION"
    for request_id in ("ok", "stale"):
        await pstub.Release(prefill_pb2.ReleaseRequest(request_id=request_id))
        await dstub.Release(prefill_pb2.ReleaseRequest(request_id=request_id))


@pytest.mark.parametrize(
    ("refused", "counted"), [(False, 1), (True, 0)], ids=["prefill-saw-it", "decode-refused"]
)
async def test_prefill_counts_a_broken_transfer_only_when_it_made_the_check(
    nodes, monkeypatch, refused, counted
):
    """A transfer whose answer broke the protocol is prefill's check: counted by prefill. One
    decode refused is decode's check, counted there (tests/test_transfer.py), not here as well.
    Either way the call fails DATA_LOSS with the transfer's reason."""
    import prefill_svc.service as prefill_service
    from kvfence.transfer import TransferError

    _, pre, dstub, pstub = nodes

    async def broken(*args, **kwargs):
        raise TransferError("an answer that is not an object", reason="PROTOCOL", refused=refused)

    monkeypatch.setattr(prefill_service, "send_pages", broken)
    _, call = await reserve_and_prefill(dstub, pstub, "broken", list(range(3, 20)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert error_info(err.value).reason == "PROTOCOL"
    labels = {"service": "prefill", "check": "PROTOCOL"}
    assert pre.metrics.registry.get_sample_value("kvfence_integrity_failures_total", labels) == (
        counted
    )
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="broken"))
    await dstub.Release(prefill_pb2.ReleaseRequest(request_id="broken"))


async def test_decode_counts_every_way_a_stream_ends(nodes):
    """requests_total on decode counted only finished streams: a refused manifest or a stream
    the control plane cancelled never showed."""
    dec, _, dstub, pstub = nodes
    prompt = list(range(3, 23))
    await run_request(dstub, pstub, "ok", "t-m", prompt, 4)  # control: OK
    sampling = common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "bad", prompt, sampling)
    reply = await call
    tampered = _decode_request(res, reply, "bad", sampling)
    tampered.manifest.token_count -= 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in dstub.Decode(tampered):
            pass
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="bad"))
    long = common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "gone", prompt, long, max_new=200)
    reply = await call
    stream = dstub.Decode(_decode_request(res, reply, "gone", long))
    async for msg in stream:
        if msg.token_ids:
            stream.cancel()
            break
    await _all_free(dec.rt.pool)
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="gone"))
    text = dec.metrics.render().decode()
    for status in ("OK", "DATA_LOSS", "CANCELLED"):
        assert f'kvfence_requests_total{{service="decode",status="{status}"}} 1.0' in text, status


@pytest.mark.parametrize("change", ["none", "model", "layout"])
async def test_a_manifest_for_another_model_or_layout_is_data_loss(nodes, change):
    """Manifest check 6: KV written by a prefill node serving another model (or laid out
    otherwise) is refused even when its MAC is valid, i.e. signed by a node that holds the
    reservation's secret. The control re-signs an unchanged manifest, which goes through."""
    from kvfence import manifest as mf

    dec, _, dstub, pstub = nodes
    prompt = list(range(3, 23))
    sampling = common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
    res, call = await reserve_and_prefill(dstub, pstub, "m6", prompt, sampling, max_new=2)
    request = _decode_request(res, await call, "m6", sampling)
    if change == "model":
        request.manifest.model_fingerprint = "0" * 64
    elif change == "layout":
        request.manifest.layout.num_layers += 1
    mf.sign(request.manifest, res.secret)
    tokens, err = await _outcome(dstub.Decode(request))
    if change == "none":
        assert err is None and len(tokens) == 2
    else:
        assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
        assert error_info(err).reason == change.upper()
    await pstub.Release(prefill_pb2.ReleaseRequest(request_id="m6"))
    await _all_free(dec.rt.pool)
