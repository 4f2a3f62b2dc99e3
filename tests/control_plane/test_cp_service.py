"""The service wrapper: serve() start/stop, server-side default deadline, graceful shutdown,
metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from cp_fakes import make_model_info
from cp_harness import Cluster, eventually, make_cfg, make_cluster

from control_plane.service import serve
from kvfence.errors import DeadlineExceeded, InvalidArgument, KvfenceError, Unavailable


async def test_serve_runs_until_stop_event(tmp_path: Path) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(make_cfg(tmp_path), stop, model_info=make_model_info()))
    await eventually(lambda: (tmp_path / "admin_token").exists())
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 5)


@pytest.mark.parametrize("grace", [None, 7.0])
async def test_serve_stops_with_the_configured_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grace: float | None
) -> None:
    """A stopping control plane gave running requests a fixed 5 s of the pod's 30 s; it now
    gives them control_plane.shutdown_grace_s (default 25 s)."""
    from control_plane import service

    seen: list[float] = []
    real_stop = service.ControlPlane.stop

    async def stop(self: service.ControlPlane, grace: float = 5.0, refuse_s: float = 0.0) -> None:
        seen.append(grace)
        await real_stop(self, 0)

    monkeypatch.setattr(service.ControlPlane, "stop", stop)
    cfg = make_cfg(tmp_path, **({} if grace is None else {"shutdown_grace_s": grace}))
    stop_event = asyncio.Event()
    task = asyncio.create_task(serve(cfg, stop_event, model_info=make_model_info()))
    await eventually(lambda: (tmp_path / "admin_token").exists())
    stop_event.set()
    await asyncio.wait_for(task, 5)
    assert seen == [25.0 if grace is None else grace]


async def test_default_deadline_applies_without_a_client_deadline(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, default_deadline_s=0.5)
    try:
        c.script.decode_hold = asyncio.Event()
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(c.client().generate(prompt_ids=[10], max_new_tokens=2), 3)
        await eventually(lambda: "Release" in c.decode[0].methods())
        c.script.decode_hold.set()
    finally:
        await c.close()


async def test_shutdown_fails_running_requests_and_releases(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path)
    c.script.decode_hold = asyncio.Event()
    client = c.client()
    call = asyncio.create_task(client.generate(prompt_ids=[10], max_new_tokens=2))
    await eventually(lambda: "Decode" in c.decode[0].methods())
    await c.cp.stop(grace=0.2)
    with pytest.raises(Unavailable, match="shutting down") as err:
        await call
    assert err.value.reason == "SHUTTING_DOWN"  # what an operator's alert can tell apart
    assert c.decode[0].methods()[-1] == "Release"
    c.script.decode_hold.set()
    await client.close()
    for node in [*c.decode, *c.prefill]:
        await node.stop()


async def test_shutdown_ends_within_its_bound_when_a_node_does_not_answer_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod's grace period is sized from stop()'s bound (service.STOP_TAIL_S beyond the
    grace). A decode node that never answers the interrupted request's Release held stop() for
    10 s more, then the early releases' 5 s more: past the chart's default grace period, so the
    pod was killed mid-stop. The control above it (a node that answers) ends at once."""
    from control_plane import routing, service

    monkeypatch.setattr(routing, "RELEASE_TIMEOUT_S", 60.0)  # longer than any budget
    c = await make_cluster(tmp_path)
    c.script.decode_hold = asyncio.Event()
    c.script.release_hold = asyncio.Event()
    client = c.client()
    call = asyncio.create_task(client.generate(prompt_ids=[10], max_new_tokens=2))
    await eventually(lambda: "Decode" in c.decode[0].methods())
    t0 = time.monotonic()
    # stop()'s documented bound, max(grace, refuse_s) + STOP_TAIL_S (15.2 s here), which the pod's
    # grace period is sized from; it takes about 5.7 s, and one that waited for the Release
    # would take RELEASE_TIMEOUT_S (60 s) and more: both far from the bound.
    await asyncio.wait_for(c.cp.stop(grace=0.2), 0.2 + service.STOP_TAIL_S)
    took = time.monotonic() - t0
    try:
        with pytest.raises(Unavailable, match="shutting down"):
            await asyncio.wait_for(call, 5)
        assert c.decode[0].methods()[-1] == "Release"  # asked, never answered
        # ... and given its wait (STOP_INTERRUPTED_S) first: a lower bound load cannot break
        assert took > service.STOP_INTERRUPTED_S - 0.5, took
    finally:
        c.script.release_hold.set()
        c.script.decode_hold.set()
        for task in list(c.cp.generation.tasks):  # still awaiting the Release, at most
            task.cancel()
        await client.close()
        for node in [*c.decode, *c.prefill]:
            await node.stop()


def test_the_stop_budget_adds_up() -> None:
    """STOP_TAIL_S, which the chart adds to the pod's grace period, covers every bounded wait
    after the grace: a node's Release fits in the interrupted requests' wait, and the bus's
    flush and disconnect from a broker that does not answer follow the listeners' close."""
    from control_plane import routing, service
    from kvfence import events

    assert routing.RELEASE_TIMEOUT_S < service.STOP_INTERRUPTED_S
    after = service.STOP_LISTENERS_S + service.STOP_FLUSH_S + events.PUBLISH_TIMEOUT_S + 1
    assert service.STOP_INTERRUPTED_S + after + 1 <= service.STOP_TAIL_S


async def test_metrics_count_requests_and_rejections(cluster: Cluster) -> None:
    await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
    with pytest.raises(InvalidArgument):
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=1000)
    ok = 'kvfence_requests_total{service="control-plane",status="OK"} 1.0'
    # Counted once its releases are over, which may be just after the client has its answer.
    await eventually(lambda: ok in cluster.cp.metrics.render().decode())
    text = cluster.cp.metrics.render().decode()
    assert (
        'kvfence_admission_rejections_total{reason="OVER_ADMISSIBLE_LIMIT",'
        'service="control-plane"} 1.0'
    ) in text


def state_counts(text: str) -> dict[str, float]:
    """request_state_seconds' observation count per state, from the exposition text."""
    out = {}
    for line in text.splitlines():
        if line.startswith("kvfence_request_state_seconds_count{"):
            state = line.split('state="')[1].split('"')[0]
            out[state] = float(line.rsplit(" ", 1)[1])
    return out


async def test_metrics_time_each_state_a_request_left(cluster: Cluster) -> None:
    with pytest.raises(InvalidArgument):  # rejected at admission: it left RECEIVED only
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=1000)
    assert state_counts(cluster.cp.metrics.render().decode()) == {"received": 1.0}
    t0 = time.monotonic()
    await cluster.client().generate(prompt_ids=[10, 11], max_new_tokens=3)
    wall = time.monotonic() - t0
    text = cluster.cp.metrics.render().decode()
    assert state_counts(text) == {
        "received": 2.0,
        **dict.fromkeys(["admitted", "reserved", "prefilling", "kv_verified", "decoding"], 1.0),
    }
    spent = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvfence_request_state_seconds_sum{")
    )
    assert 0 < spent <= wall + 0.01  # the states of one request (and a rejection) in its time


async def test_the_control_plane_publishes_its_retained_status(tmp_path: Path) -> None:
    """DESIGN: node status is retained at kvfence/v1/<cluster>/nodes/<node_id>; the control
    plane is one of the nodes an operator's dashboard shows: online while it serves, offline
    after it stops. A second one that cannot bind its ports must not overwrite it."""
    import json

    import aiomqtt
    from fixtures_mqtt import start_mosquitto

    from control_plane.service import ControlPlane
    from kvfence.config import parse_config
    from kvfence.events import node_topic
    from kvfence.server import BindError

    async def status() -> dict | None:
        async with aiomqtt.Client("127.0.0.1", broker.port) as client:
            await client.subscribe(node_topic("cp-status", "control-plane"), qos=1)
            try:
                async with asyncio.timeout(0.5):
                    async for message in client.messages:
                        if message.retain:
                            return dict(json.loads(bytes(message.payload)))
            except TimeoutError:
                return None
        return None

    async def wait_for(online: bool) -> dict:
        for _ in range(40):
            got = await status()
            if got is not None and got["online"] is online:
                return got
        raise AssertionError(f"no retained status with online={online}")

    with start_mosquitto() as broker:

        def cfg(state: str, **cp: str) -> object:
            base = make_cfg(tmp_path / state, **cp).model_dump()
            base["cluster"] = "cp-status"
            base["events"] = {"mqtt_host": "127.0.0.1", "mqtt_port": broker.port}
            return parse_config(base, environ={})

        first = ControlPlane(cfg("a"), model_info=make_model_info())
        ports = await first.start()
        try:
            online = await wait_for(True)
            assert online["role"] == "control-plane" and online["model"] == "test-model"
            assert online["grpc_address"] == f"127.0.0.1:{ports.public}"
            taken = f"127.0.0.1:{ports.public}"
            second = ControlPlane(cfg("b", listen=taken), model_info=make_model_info())
            with pytest.raises(BindError):
                await second.start()
            second.tenants.close()
            assert await status() == online  # still the running one's
        finally:
            await first.stop(grace=0)
        offline = await wait_for(False)
        assert offline["node_id"] == "control-plane"


@pytest.mark.parametrize("password", ["cp-secret", None])
async def test_the_control_plane_publishes_with_its_broker_account(
    tmp_path: Path, password: str | None
) -> None:
    """A broker that refuses anonymous clients (the chart's default): with its account in the
    config the control plane's events reach a subscriber; without it they are refused, and the
    bus says so (generation never waits on events)."""
    import json

    import aiomqtt
    from fixtures_mqtt import start_mosquitto

    from control_plane.service import ControlPlane
    from kvfence.config import parse_config
    from kvfence.events import node_topic

    reader = {"username": "reader", "password": "reader-secret"}
    with start_mosquitto(
        users={"kvfence": "cp-secret", **{reader["username"]: "reader-secret"}}
    ) as broker:
        base = make_cfg(tmp_path / "cp").model_dump()
        base["cluster"] = "cp-account"
        base["events"] = {"mqtt_host": "127.0.0.1", "mqtt_port": broker.port}
        if password is not None:
            (tmp_path / "mqtt-password").write_text(password)
            base["events"] |= {
                "mqtt_username": "kvfence",
                "mqtt_password_file": str(tmp_path / "mqtt-password"),
            }
        cp = ControlPlane(parse_config(base, environ={}), model_info=make_model_info())
        await cp.start()
        try:

            async def status() -> dict | None:
                async with aiomqtt.Client("127.0.0.1", broker.port, **reader) as client:
                    await client.subscribe(node_topic("cp-account", "control-plane"), qos=1)
                    try:
                        async with asyncio.timeout(0.5):
                            async for message in client.messages:
                                return dict(json.loads(bytes(message.payload)))
                    except TimeoutError:
                        return None
                return None

            assert cp.bus is not None
            if password is not None:
                got = None
                for _ in range(20):
                    if (got := await status()) is not None:
                        break
                assert got is not None and got["online"] is True
                assert cp.bus.last_error is None
            else:
                await eventually(lambda: cp.bus is not None and cp.bus.last_error is not None)
                assert "not authorized" in (cp.bus.last_error or "").lower()
                assert await status() is None
        finally:
            await cp.stop(grace=0)


async def test_one_info_line_per_request_and_its_states_at_debug(cluster: Cluster) -> None:
    """A request's state changes are debug lines and its end one info line carrying what an
    operator needs (a busy control plane logged six info lines per request). Control: the
    end line is there, with the request's numbers, for a finished and a refused request."""
    import structlog

    from kvfence import logging as kvlog

    before = structlog.get_config()
    kvlog.configure("json", "DEBUG")
    try:
        with structlog.testing.capture_logs() as logs:
            await cluster.client().generate(prompt_ids=[10, 11, 12], max_new_tokens=3)
            with pytest.raises(KvfenceError):
                await cluster.client().generate(prompt_ids=[10], max_new_tokens=10**6)
    finally:
        structlog.configure(**before)
    ended = [e for e in logs if e["event"] == "request ended"]
    states = [e for e in logs if e["event"] == "request state"]
    assert [e["log_level"] for e in ended] == ["info", "info"]
    assert states and {e["log_level"] for e in states} == {"debug"}
    ok, refused = ended
    assert (ok["dst"], ok["prompt_tokens"], ok["completion_tokens"]) == ("FINISHED", 3, 3)
    assert ok["decode_node"] == "decode-0" and ok["seconds"] > 0
    assert refused["dst"] == "REJECTED" and "OVER_ADMISSIBLE_LIMIT" in refused["reason"]
    assert {e["request_id"] for e in states} >= {ok["request_id"]}


@pytest.mark.parametrize("write_fails", [True, False])
async def test_a_response_write_that_fails_ends_the_request(
    tmp_path: Path, write_fails: bool
) -> None:
    """grpc may fail a write with an error rather than cancel the handler when the client has
    gone; only a cancel ended the request, so it decoded on, for no one, holding its pages and
    its tenant's concurrency. Control: writes that succeed get every token."""
    from kvfence.auth import bearer_metadata
    from kvfence.proto.kvfence.v1 import client_pb2

    c = await make_cluster(tmp_path)
    c.script.tokens_hold = asyncio.Event()  # decoding goes on until the test lets it
    written: list[object] = []

    class Context:
        def invocation_metadata(self):  # type: ignore[no-untyped-def]
            return bearer_metadata(c.api_key)

        def time_remaining(self) -> float:
            return 10.0

        async def send_initial_metadata(self, metadata: object) -> None:
            pass

        async def write(self, message: object) -> None:
            if write_fails:
                raise RuntimeError("the client has gone")
            written.append(message)

    request = client_pb2.GenerateRequest(token_ids=client_pb2.TokenIds(ids=[10]), max_new_tokens=4)
    try:
        handler = asyncio.create_task(c.cp.generation.Generate(request, Context()))
        await eventually(lambda: "Decode" in c.decode[0].methods(), timeout=5)
        if write_fails:
            with pytest.raises(RuntimeError):
                await asyncio.wait_for(handler, 5)  # the first token's write failed
            await eventually(lambda: not c.cp.table, timeout=5)  # ended, not decoding on
            assert "Release" in c.decode[0].methods()
        else:
            await eventually(lambda: bool(written), timeout=5)
            c.script.tokens_hold.set()
            await asyncio.wait_for(handler, 5)
            tokens = [t for m in written for t in m.token_ids]  # type: ignore[attr-defined]
            assert len(tokens) == 4
    finally:
        c.script.tokens_hold.set()
        await c.close()
