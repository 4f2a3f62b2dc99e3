"""Admission: the admissible limit, parameters, tenant limits and the wait queue.

Every refusal here must happen before any node RPC; each negative test counts the RPCs the fake
nodes received, and the at-limit control shows the same request shape does reach them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from cp_fakes import FakeNode
from cp_harness import Cluster, eventually, make_cluster

from control_plane.lifecycle import RequestState
from control_plane.tenants import TenantLimits
from kvfence.errors import InvalidArgument, KvfenceError, ResourceExhausted, Unavailable

PROMPT = list(range(10, 110))  # 100 tokens


@pytest.fixture
async def small_pools(tmp_path: Path):
    """Context window 256, decode pool 200 tokens, prefill pool 160: limit = 160."""
    c = await make_cluster(tmp_path, decode_pool=208, prefill_pool=160)
    yield c
    await c.close()


async def test_list_models_reports_the_enforced_limit(small_pools: Cluster) -> None:
    [model] = await small_pools.client().list_models()
    assert (model.context_window, model.admissible_limit, model.page_size) == (256, 160, 16)
    assert model.online and model.fingerprint == small_pools.cp.model.fingerprint


@pytest.mark.parametrize("max_new", [59, 60])
async def test_at_or_under_limit_reaches_the_nodes(small_pools: Cluster, max_new: int) -> None:
    result = await small_pools.client().generate(prompt_ids=PROMPT, max_new_tokens=max_new)
    assert result.usage.completion_tokens == max_new
    assert small_pools.decode[0].methods()[:2] == ["Reserve", "Decode"]
    assert small_pools.prefill[0].methods()[0] == "Prefill"


@pytest.mark.parametrize("max_new", [61, 10_000])
async def test_over_limit_is_refused_before_any_node_rpc(
    small_pools: Cluster, max_new: int
) -> None:
    with pytest.raises(InvalidArgument) as err:
        await small_pools.client().generate(prompt_ids=PROMPT, max_new_tokens=max_new)
    total = 100 + max_new
    assert err.value.reason == "OVER_ADMISSIBLE_LIMIT"
    assert f"= {total} exceeds the admissible limit of 160" in err.value.message
    assert err.value.metadata["admissible_limit"] == "160"
    assert small_pools.node_calls() == 0
    assert small_pools.cp.node_rpcs() == 0
    [event] = small_pools.events.of("admission_rejected")
    assert (event["reason"], event["prompt_tokens"], event["max_new_tokens"]) == (
        "OVER_ADMISSIBLE_LIMIT",
        100,
        max_new,
    )
    assert not small_pools.cp.table  # REJECTED requests leave nothing in flight


async def test_context_window_bounds_the_limit_when_pools_are_larger(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, context_window=128)
    try:
        with pytest.raises(InvalidArgument, match="admissible limit of 128"):
            await c.client().generate(prompt_ids=PROMPT, max_new_tokens=29)
        assert c.node_calls() == 0
        await c.client().generate(prompt_ids=PROMPT, max_new_tokens=28)
        assert c.node_calls() > 0
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt_ids": []}, "prompt is empty"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"prompt_ids": [1], "temperature": -0.5}, "temperature must be >= 0"),
        ({"prompt_ids": [1], "temperature": float("inf")}, "temperature must be >= 0 and finite"),
        ({"prompt_ids": [1], "temperature": float("nan")}, "temperature must be >= 0 and finite"),
        ({"prompt_ids": [1], "top_p": 1.5}, "top_p must be in [0, 1]"),
        ({"prompt_ids": [1, 384]}, ">= the vocabulary size 384"),
        ({"prompt_ids": [1], "stop": [""]}, "stop strings"),
    ],
)
async def test_bad_parameters_are_invalid_argument(
    cluster: Cluster, kwargs: dict, fragment: str
) -> None:
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(InvalidArgument) as err:
        await cluster.client().generate(**kwargs)
    assert fragment in err.value.message
    assert cluster.node_calls() == 0
    # Paired control: the same call with valid parameters goes through.
    await cluster.client().generate(prompt_ids=[1, 383], max_new_tokens=4, top_p=1.0)
    assert cluster.node_calls() > 0


async def test_tenant_token_limit(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, limits=TenantLimits(max_tokens_per_request=20))
    try:
        with pytest.raises(InvalidArgument) as err:
            await c.client().generate(prompt_ids=list(range(10, 20)), max_new_tokens=11)
        assert err.value.reason == "OVER_TENANT_TOKEN_LIMIT"
        assert c.node_calls() == 0
        await c.client().generate(prompt_ids=list(range(10, 20)), max_new_tokens=10)
        assert c.node_calls() > 0
    finally:
        await c.close()


async def test_tenant_concurrency_limit(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, limits=TenantLimits(max_concurrent_requests=1))
    try:
        c.script.decode_hold = asyncio.Event()
        first = asyncio.create_task(c.client().generate(prompt_ids=[10], max_new_tokens=2))
        await c.decode[0].servicer.entered.wait()
        with pytest.raises(ResourceExhausted) as err:
            await c.client().generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "TENANT_CONCURRENCY"
        c.script.decode_hold.set()
        await first  # the held request completes normally
        await c.client().generate(prompt_ids=[10], max_new_tokens=2)
    finally:
        await c.close()


@pytest.mark.parametrize("wait", [0.0, 0.6])
async def test_no_nodes_is_unavailable(tmp_path: Path, wait: float) -> None:
    """No decode node: UNAVAILABLE (NO_NODES), no node contacted. With ``no_node_wait_s: 0`` at
    once (as it always was); otherwise once that long has passed since the control plane started
    with none (nodes register again within a heartbeat of its restart), well before the
    request's deadline, not at it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    c = await make_cluster(tmp_path, decode_nodes=0, no_node_wait_s=wait)
    try:
        with pytest.raises(Unavailable, match="no decode node is registered") as err:
            await c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        failed = loop.time() - started
        assert err.value.reason == "NO_NODES"
        assert c.node_calls() == 0
        if wait:
            assert wait - 0.1 < failed < wait + 0.8, failed
        else:
            assert failed < 0.5, failed
        # After the wait, a new request fails at once: the wait is for nodes that just left.
        again = loop.time()
        with pytest.raises(Unavailable, match="no decode node"):
            await c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        assert loop.time() - again < 0.3
        assert {e["reason"] for e in c.events.of("admission_rejected")} == {"NO_NODES"}
    finally:
        await c.close()


async def test_a_control_plane_that_just_started_waits_for_its_nodes(tmp_path: Path) -> None:
    """A request that reaches a control plane before its nodes have registered (it just started,
    or restarted and they register again on their next heartbeat) waits for them, unadmitted,
    holding a queue place, and is served once they are there. It used to fail NO_NODES at once."""
    c = await make_cluster(tmp_path, decode_nodes=0, no_node_wait_s=5)
    try:
        call = asyncio.create_task(c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: c.cp.queue.waiting == 1)
        await asyncio.sleep(0.3)
        assert not call.done()
        [run] = list(c.cp.table)
        assert run.record.state == RequestState.RECEIVED
        node = FakeNode("decode", "decode-0", c.script)
        assert (await c.add_node(node)).accepted
        assert (await asyncio.wait_for(call, 5)).usage.completion_tokens == 2
        assert node.methods() == ["Reserve", "Decode"]
        assert c.events.of("admission_rejected") == []
    finally:
        await c.close()


async def test_requests_released_together_from_a_wait_are_served_without_sleeping_a_poll(
    tmp_path: Path,
) -> None:
    """Three tenants' requests wait for a prefill node; it registers and they all pass to the
    decode-page wait in one loop iteration, each leaving its first queue place (a notify) and
    taking a new one. The queue's wait read its event only when its task first ran, after those
    notifies: every waiter then slept a whole poll (the heartbeat interval, 10 s here) with
    decode free. Now all are served at once; the control is that they are served at all."""
    c = await make_cluster(
        tmp_path,
        prefill_nodes=0,
        heartbeat_interval_s=10.0,
        node_timeout_s=40.0,
        no_node_wait_s=30.0,
    )
    try:
        keys = [c.api_key] + [
            c.cp.tenants.create_tenant(name, TenantLimits())[1] for name in ("b", "cc")
        ]
        calls = [
            asyncio.create_task(
                c.client(key, timeout=30).generate(prompt_ids=[5], max_new_tokens=2)
            )
            for key in keys
        ]
        await eventually(lambda: c.cp.queue.waiting == 3)
        assert (await c.add_node(FakeNode("prefill", "prefill-0", c.script))).accepted
        start = asyncio.get_running_loop().time()
        results = await asyncio.wait_for(asyncio.gather(*calls), 20)
        assert [r.usage.completion_tokens for r in results] == [2, 2, 2]
        assert asyncio.get_running_loop().time() - start < 5.0  # not a 10 s poll
    finally:
        await c.close()


async def test_requests_waiting_for_prefill_room_do_not_resend_to_a_full_node(
    tmp_path: Path,
) -> None:
    """Every prefill node refuses for room while its last heartbeat still showed free pages.
    Requests waiting for room sent their whole prompt to every prefill node again at every
    wake-up, and every other request's end is one: 10 waiters and 30 ends, 600 refused
    Prefills. A node that refused counts as full until its next heartbeat now; one that shows
    room again is tried, and serves (the control). Prefill's NO_CAPACITY is counted where the
    capacity alert looks."""
    from kvfence.proto.kvfence.v1 import control_pb2

    c = await make_cluster(tmp_path, prefill_nodes=0, admission_queue=16, node_timeout_s=60.0)
    try:
        nodes = [FakeNode("prefill", f"prefill-{i}", c.script, heartbeat_s=30.0) for i in (0, 1)]
        for node in nodes:
            assert (await c.add_node(node)).accepted
            node.servicer.refuse = ResourceExhausted("pool full", reason="PREFILL_POOL_FULL")
        prefills = lambda: sum(n.methods().count("Prefill") for n in nodes)  # noqa: E731
        calls = [
            asyncio.create_task(
                c.client(timeout=20).generate(prompt_ids=[10, 11], max_new_tokens=2)
            )
            for _ in range(10)
        ]
        await eventually(
            lambda: (
                len(c.cp.table) == 10
                and all(r.record.state == RequestState.PREFILLING for r in c.cp.table)
            )
        )
        await asyncio.sleep(0.2)
        assert 2 <= prefills() <= 20  # each node refused, and at most once per request
        before = prefills()
        for _ in range(30):  # other requests ending
            c.cp.queue.notify()
            await asyncio.sleep(0.02)
        assert prefills() - before == 0
        for node in nodes:  # a heartbeat from a node still full does not reopen it
            full = control_pb2.HeartbeatRequest(
                node_id=node.node_id, free_pages=0, instance_id=node.instance_id
            )
            c.cp.registry.heartbeat(full)
        await asyncio.sleep(0.2)
        assert prefills() - before == 0
        nodes[1].servicer.refuse = None  # room again, and its heartbeat says so
        beat = control_pb2.HeartbeatRequest(
            node_id="prefill-1", free_pages=nodes[1].free_pages, instance_id=nodes[1].instance_id
        )
        c.cp.registry.heartbeat(beat)
        results = await asyncio.wait_for(asyncio.gather(*calls), 15)
        assert [r.usage.completion_tokens for r in results] == [2] * 10
        # one expired waiting for prefill room is seen where the capacity alert looks
        nodes[1].servicer.refuse = ResourceExhausted("pool full", reason="PREFILL_POOL_FULL")
        with pytest.raises(ResourceExhausted) as err:
            await c.client(timeout=1).generate(prompt_ids=[10, 11], max_new_tokens=2)
        assert err.value.reason == "NO_CAPACITY"
        labels = {"service": "control-plane", "reason": "NO_CAPACITY"}
        counted = c.cp.metrics.registry.get_sample_value(
            "kvfence_admission_rejections_total", labels
        )
        assert counted == 1
    finally:
        await c.close()


async def test_a_prefill_node_that_refused_is_tried_again_when_pages_on_it_are_released(
    tmp_path: Path,
) -> None:
    """A node refuses one request for room while another's Prefill runs on it. When that one's
    pages are released, the waiting request is served at once, not at the node's next heartbeat
    (30 s here): a first version of the full-node rule kept the node out until then, and at a
    1 s heartbeat a saturated prefill tier served 20 requests in 9 s instead of 0.6, 14 of them
    refused NO_CAPACITY with a 3 s deadline. Control: the refusal itself (the test above)."""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0)
    try:
        node = FakeNode("prefill", "prefill-0", c.script, heartbeat_s=30.0)
        assert (await c.add_node(node)).accepted
        c.script.prefill_hold = asyncio.Event()
        first = asyncio.create_task(
            c.client(timeout=20).generate(prompt_ids=[10], max_new_tokens=2)
        )
        await node.servicer.entered.wait()  # its Prefill runs (held) on the node
        node.servicer.refuse = ResourceExhausted("pool full", reason="PREFILL_POOL_FULL")
        second = asyncio.create_task(
            c.client(timeout=20).generate(prompt_ids=[11], max_new_tokens=2)
        )
        await eventually(lambda: node.methods().count("Prefill") == 2)  # refused
        node.servicer.refuse = None
        start = asyncio.get_running_loop().time()
        c.script.prefill_hold.set()  # the first finishes: its source pages are released
        results = await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert [r.usage.completion_tokens for r in results] == [2, 2]
        assert asyncio.get_running_loop().time() - start < 5.0  # not at the 30 s heartbeat
    finally:
        await c.close()


@pytest.mark.parametrize("says_free", [True, False])
async def test_a_prefill_node_that_refused_is_never_left_out_for_good(
    tmp_path: Path, says_free: bool
) -> None:
    """A node refuses for room; its pages come back in a way no release of this control plane
    answers (a pass cancelled mid-way), to exactly the free count its last heartbeat showed. The
    rule "reopen when a heartbeat shows more free pages than at the refusal" then never fired:
    the node stayed out while empty and every request failed NO_CAPACITY. The refusal now says
    how many pages were free (says_free), and without that (a node of an older release) the
    node is left out control_plane.refused_room_max_s at most. Control: served either way."""
    c = await make_cluster(
        tmp_path,
        prefill_nodes=0,
        node_timeout_s=60.0,
        refused_room_max_s=30.0 if says_free else 0.5,
    )
    try:
        node = FakeNode("prefill", "prefill-0", c.script, heartbeat_s=0.05)
        assert (await c.add_node(node)).accepted  # its heartbeats: all pages free, throughout
        metadata = {"free_pages": "0"} if says_free else None
        node.servicer.refuse = ResourceExhausted(
            "prefill pool has 0 free pages", reason="PREFILL_POOL_FULL", metadata=metadata
        )
        call = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: "Prefill" in node.methods())
        node.servicer.refuse = None  # its pages came back, unseen
        assert (await asyncio.wait_for(call, 6)).usage.completion_tokens == 2
    finally:
        await c.close()


async def test_requests_waiting_for_a_node_keep_the_queue_caps(tmp_path: Path) -> None:
    """Waiting for a node is waiting in the admission queue: a tenant over its share is refused
    QUEUE_FULL at once, another tenant still gets a place up to the queue's capacity, and then
    anyone is refused; every waiter is served once a node registers."""
    c = await make_cluster(
        tmp_path, decode_nodes=0, no_node_wait_s=5, admission_queue=3, admission_queue_per_tenant=2
    )
    try:
        _, other_key, _ = c.cp.tenants.create_tenant("other", TenantLimits())
        waiting = [
            asyncio.create_task(c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2))
            for _ in range(2)
        ]
        await eventually(lambda: c.cp.queue.waiting == 2)
        with pytest.raises(ResourceExhausted) as err:
            await c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "QUEUE_FULL" and "tenant acme" in err.value.message
        waiting.append(
            asyncio.create_task(
                c.client(other_key, timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
            )
        )
        await eventually(lambda: c.cp.queue.waiting == 3)
        with pytest.raises(ResourceExhausted) as err:
            await c.client(other_key, timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "QUEUE_FULL" and "queue is full" in err.value.message
        assert (await c.add_node(FakeNode("decode", "decode-0", c.script))).accepted
        for done in await asyncio.wait_for(asyncio.gather(*waiting), 5):
            assert done.usage.completion_tokens == 2
        assert c.cp.queue.waiting == 0
    finally:
        await c.close()


@pytest.mark.parametrize("max_new", [29, 28])
async def test_a_request_that_waited_for_nodes_meets_the_limit_of_those_that_came(
    tmp_path: Path, max_new: int
) -> None:
    """With no decode node the limit counts only the window and prefill's pool (256): a request
    of 100 + 29 tokens waits, and when a decode node with a 128-token pool registers it is
    refused OVER_ADMISSIBLE_LIMIT, before any node is contacted, rather than waiting for pages
    it can never have until its deadline. Control: 100 + 28 fits that node and is served."""
    c = await make_cluster(tmp_path, decode_nodes=0, no_node_wait_s=5)
    try:
        call = asyncio.create_task(
            c.client(timeout=3).generate(prompt_ids=PROMPT, max_new_tokens=max_new)
        )
        await eventually(lambda: c.cp.queue.waiting == 1)
        node = FakeNode("decode", "decode-0", c.script, pool_tokens=128)
        assert (await c.add_node(node)).accepted
        if max_new == 28:
            assert (await asyncio.wait_for(call, 5)).usage.completion_tokens == 28
            assert node.methods() == ["Reserve", "Decode"]
            return
        with pytest.raises(InvalidArgument) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.reason == "OVER_ADMISSIBLE_LIMIT"
        assert "admissible limit of 128" in err.value.message
        assert c.node_calls() == 0
    finally:
        await c.close()


async def test_offline_or_a_cancel_ends_a_request_waiting_for_a_node_at_once(
    tmp_path: Path,
) -> None:
    """A request waiting for a node is as queued as one waiting for pages: the kill switch
    refuses it at once (UNAVAILABLE, MODEL_OFFLINE), and a client that gives up leaves nothing
    behind (CANCELLED, its queue place freed)."""
    c = await make_cluster(tmp_path, decode_nodes=0, no_node_wait_s=5)
    try:
        call = asyncio.create_task(c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: c.cp.queue.waiting == 1)
        call.cancel()
        await eventually(lambda: not c.cp.table and c.cp.queue.waiting == 0)
        assert c.events.of("admission_rejected") == []  # cancelled, not refused
        call = asyncio.create_task(c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: c.cp.queue.waiting == 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        c.cp.set_access(False, "incident 9")
        with pytest.raises(Unavailable) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.reason == "MODEL_OFFLINE" and loop.time() - started < 0.5
        assert not c.cp.table and c.cp.queue.waiting == 0
        [refused] = c.events.of("admission_rejected")  # never admitted: REJECTED
        assert refused["reason"] == "MODEL_OFFLINE"
    finally:
        await c.close()


async def test_no_capacity_waits_until_the_deadline_then_resource_exhausted(
    cluster: Cluster,
) -> None:
    cluster.script.reserve_error = ResourceExhausted("pool full")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ResourceExhausted) as err:
        await cluster.client(timeout=0.8).generate(prompt_ids=[10], max_new_tokens=2)
    waited = loop.time() - started
    assert err.value.reason == "NO_CAPACITY"
    assert 0.5 < waited < 0.8
    assert cluster.decode[0].methods().count("Reserve") >= 2  # retried while waiting
    assert "Prefill" not in cluster.prefill[0].methods()
    # Control: once the node has room the same request succeeds.
    cluster.script.reserve_error = None
    await cluster.client(timeout=2).generate(prompt_ids=[10], max_new_tokens=2)


async def test_full_queue_refuses_at_once(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, admission_queue=1)
    try:
        c.script.reserve_error = ResourceExhausted("pool full")
        waiting = asyncio.create_task(
            c.client(timeout=3).generate(prompt_ids=[10], max_new_tokens=2)
        )
        while c.cp.queue.waiting == 0:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ResourceExhausted) as err:
            await c.client(timeout=3).generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "QUEUE_FULL"
        assert loop.time() - started < 0.5
        c.script.reserve_error = None  # the queued one gets through once there is room
        assert (await waiting).usage.completion_tokens == 2
    finally:
        await c.close()


async def test_errors_carry_grpc_codes(cluster: Cluster) -> None:
    with pytest.raises(KvfenceError) as err:
        await cluster.client().generate(prompt_ids=[1], max_new_tokens=1000)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_newcomer_never_overtakes_the_head_of_the_queue() -> None:
    """Only the head may try to reserve: no starvation of a large request by small ones."""
    from control_plane.admission import AdmissionQueue

    q = AdmissionQueue(capacity=2)
    big, small, late = object(), object(), object()
    assert q.may_try(small)  # control: with nobody waiting anyone may try
    with q.slot(big, "a"):
        assert q.may_try(big) and not q.may_try(late)
        with q.slot(small, "b"):
            assert not q.may_try(small)  # behind big
            with pytest.raises(ResourceExhausted) as err, q.slot(late, "c"):
                pass
            assert "retry later" in err.value.message
            assert "2" not in err.value.message  # nothing about how busy other tenants are
        assert q.may_try(big)
    assert q.waiting == 0 and q.may_try(late)


def test_tenants_take_turns_at_the_head_of_the_queue() -> None:
    """The head is the oldest request of the tenant whose turn it is; served, its tenant goes to
    the back. Another tenant's request waits for one of a busy tenant's, not for all of them."""
    from control_plane.admission import AdmissionQueue

    q = AdmissionQueue(capacity=8)
    held: dict[str, Any] = {}

    def arrive(name: str) -> None:  # tenant "a" of request "a2"
        held[name] = q.slot(name, name[0])
        held[name].__enter__()

    def serve_head() -> str:
        (head,) = [name for name in held if q.may_try(name)]
        held.pop(head).__exit__(None, None, None)
        return head

    for name in ("a1", "a2", "a3", "b1", "c1"):
        arrive(name)
    served = [serve_head()]
    arrive("d1")  # a newcomer joins the turn order behind a, whose turn just ended
    held.pop("c1").__exit__(None, None, None)  # one that is not the head gives up: no turn taken
    while held:
        served.append(serve_head())
    assert served == ["a1", "b1", "a2", "d1", "a3"]
    assert q.waiting == 0 and not q._turns

    # control: one tenant alone is served in the order its requests came
    for name in ("a1", "a2", "a3"):
        arrive(name)
    assert [serve_head() for _ in range(3)] == ["a1", "a2", "a3"]


async def test_a_tenant_behind_another_tenants_burst_is_served_next(tmp_path: Path) -> None:
    """Through the service: acme queues three requests while no decode node has room, then other
    queues one; when room comes, other's request is reserved second, not last."""
    c = await make_cluster(tmp_path)
    try:
        c.script.reserve_error = ResourceExhausted("pool full")
        _, other_key, _ = c.cp.tenants.create_tenant("other", TenantLimits())
        tasks = []
        for n, key in enumerate([c.api_key] * 3 + [other_key]):
            call = c.client(key, timeout=10).generate(prompt_ids=[10], max_new_tokens=2)
            tasks.append(asyncio.create_task(call))
            await eventually(lambda n=n: c.cp.queue.waiting == n + 1)
        (decode,) = c.decode
        first_after = len(decode.calls)
        c.script.reserve_error = None
        for done in await asyncio.gather(*tasks):
            assert done.usage.completion_tokens == 2
        reserved = [r.tenant_id for m, r in decode.calls[first_after:] if m == "Reserve"]
        assert reserved == ["acme", "other", "acme", "acme"]
    finally:
        await c.close()


def test_one_tenant_cannot_take_the_whole_queue() -> None:
    """A tenant holds at most ``per_tenant`` places: one with no concurrency limit used to fill
    the queue and lock every other tenant out (QUEUE_FULL) until its deadlines passed."""
    from control_plane.admission import AdmissionQueue

    q = AdmissionQueue(capacity=4, per_tenant=2)
    with q.slot(object(), "greedy"), q.slot(object(), "greedy"):
        with pytest.raises(ResourceExhausted) as err, q.slot(object(), "greedy"):
            pass
        assert err.value.reason == "QUEUE_FULL"
        assert "tenant greedy already has 2 requests waiting" in err.value.message
        # control: another tenant still gets a place, up to the queue's capacity
        with q.slot(object(), "other"), q.slot(object(), "other"):
            assert q.waiting == 4 and q.waiting_for("other") == 2
    assert q.waiting == 0 and q.waiting_for("greedy") == 0
    assert not q._turns  # nothing kept per tenant once it waits no more


@pytest.mark.parametrize("seed", [None, 12345])
async def test_a_sampled_request_reaches_both_nodes_with_one_seed(
    small_pools: Cluster, seed: int | None
) -> None:
    """Prefill draws the first token and decode the rest, from the same seed; a real prefill
    node refuses a sampled request without one. A client that sends none gets one drawn here
    (it used to be sent on without, and failed after its decode reservation was made)."""
    kwargs = {} if seed is None else {"seed": seed}
    await small_pools.client().generate(
        prompt_ids=[10, 11], max_new_tokens=2, temperature=0.8, **kwargs
    )
    [prefill] = [r for m, r in small_pools.prefill[0].calls if m == "Prefill"]
    [decode] = [r for m, r in small_pools.decode[0].calls if m == "Decode"]
    assert prefill.sampling.HasField("seed") and decode.sampling.HasField("seed")
    assert prefill.sampling.seed == decode.sampling.seed
    if seed is not None:  # control: the client's own seed is kept
        assert prefill.sampling.seed == seed
    # greedy requests need none and get none
    await small_pools.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
    greedy = [r for m, r in small_pools.prefill[0].calls if m == "Prefill"][-1]
    assert not greedy.sampling.HasField("seed")


# -- prompts too long to tokenize cheaply -----------------------------------------------------


def _spy_encode(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, sleep_s: float = 0.0):
    """Record (text length, ran on the event loop's thread) per tokenizer call."""
    import threading
    import time

    tok = cluster.cp.model.tokenizer
    real = tok.encode
    calls: list[tuple[int, bool]] = []

    def encode(text: str) -> list[int]:
        calls.append((len(text), threading.current_thread() is threading.main_thread()))
        if sleep_s and len(text) >= 1000:
            time.sleep(sleep_s)  # a slow tokenizer that releases the GIL, as encode_batch does
        return real(text)

    monkeypatch.setattr(tok, "encode", encode)
    return calls


@pytest.mark.parametrize("size", [157, 8 << 20], ids=["just-over", "8MiB"])
async def test_a_text_that_cannot_fit_is_refused_before_tokenizing(
    small_pools: Cluster, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """An 8 MiB prompt used to be tokenized on the event loop first, holding every tenant's
    requests and the nodes' heartbeats for seconds (nodes were declared lost). A text of more
    bytes than the limit allows tokens (one byte per token at most, here) cannot fit."""
    calls = _spy_encode(small_pools, monkeypatch)
    with pytest.raises(InvalidArgument) as err:
        await small_pools.client().generate("x" * size, max_new_tokens=4)
    assert err.value.reason == "OVER_ADMISSIBLE_LIMIT"
    assert f"prompt_tokens (at least {size}: a text of {size} bytes" in err.value.message
    assert calls == [] and small_pools.node_calls() == 0
    [event] = small_pools.events.of("admission_rejected")
    assert event["prompt_tokens"] == size
    # control: at the limit (156 bytes + 4 new tokens = 160) it is tokenized and served
    result = await small_pools.client().generate("x" * 156, max_new_tokens=4)
    assert result.usage.prompt_tokens == 156 and calls == [(156, True)]


async def test_a_long_text_is_tokenized_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt that fits is tokenized in a worker thread: the event loop keeps serving
    meanwhile. Control: a short one is tokenized in place (a thread would cost more)."""
    from kvfence.tokenizer import UNLOCKED_ENCODE_CHARS

    c = await make_cluster(tmp_path, context_window=16384, decode_pool=16384, prefill_pool=16384)
    try:
        calls = _spy_encode(c, monkeypatch, sleep_s=0.5)
        gaps: list[float] = []

        async def ticker() -> None:
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(0.01)
                gaps.append(loop.time() - t)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        long_text = "y" * UNLOCKED_ENCODE_CHARS
        result = await c.client().generate(long_text, max_new_tokens=2)
        tick.cancel()
        assert result.usage.prompt_tokens == UNLOCKED_ENCODE_CHARS
        assert calls == [(UNLOCKED_ENCODE_CHARS, False)]
        assert max(gaps) < 0.25, max(gaps)  # the 0.5 s of tokenizing held nothing
        await c.client().generate("y" * 100, max_new_tokens=2)
        assert calls[1] == (100, True)
    finally:
        await c.close()


async def test_a_clients_deadline_is_cut_to_max_deadline(tmp_path: Path) -> None:
    """A client's gRPC timeout of days used to be kept (up to 10^7 s): waiting for pages, the
    request held its queue place that long. Now it gives up at max_deadline_s. Control: a
    deadline under the cap is the client's own."""
    c = await make_cluster(tmp_path, max_deadline_s=1.0, default_deadline_s=1.0)
    try:
        c.script.reserve_error = ResourceExhausted("pool full")
        loop = asyncio.get_running_loop()
        for timeout, want in ((10**6, 1.0), (0.5, 0.5)):
            started = loop.time()
            with pytest.raises(ResourceExhausted) as err:
                await c.client(timeout=timeout).generate(prompt_ids=[10], max_new_tokens=2)
            waited = loop.time() - started
            assert err.value.reason == "NO_CAPACITY"
            assert want * 0.7 < waited < want + 0.5, (timeout, waited)
    finally:
        await c.close()


async def test_a_tenant_over_its_queue_share_is_refused_while_another_gets_in(
    tmp_path: Path,
) -> None:
    """Through the service: a tenant with its share of the queue (2 of 4) waiting is refused
    QUEUE_FULL at once; another tenant's request still queues, and is served once there is
    room."""
    c = await make_cluster(tmp_path, admission_queue=4, admission_queue_per_tenant=2)
    try:
        c.script.reserve_error = ResourceExhausted("pool full")
        waiting = [
            asyncio.create_task(c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2))
            for _ in range(2)
        ]
        while c.cp.queue.waiting < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted) as err:
            await c.client(timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "QUEUE_FULL" and "tenant acme" in err.value.message
        _, other_key, _ = c.cp.tenants.create_tenant("other", TenantLimits())
        other = asyncio.create_task(
            c.client(other_key, timeout=5).generate(prompt_ids=[10], max_new_tokens=2)
        )
        while c.cp.queue.waiting < 3:
            await asyncio.sleep(0.01)
        c.script.reserve_error = None
        for done in await asyncio.gather(*waiting, other):
            assert done.usage.completion_tokens == 2
    finally:
        await c.close()
