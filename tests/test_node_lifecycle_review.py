"""The node process's lifecycle against a real control plane in this event loop
(``kvfence.node.NodeAgent``, ``kvfence.node_main``): reconnecting after a long control-plane
outage, heartbeats that survive an error, one token per process, a refusal at runtime as fatal as
at start, SIGTERM during start-up, one missed heartbeat, and starts and stops that leave nothing
running when a step fails.

The registry's side (what it remembers of replaced processes) is
tests/test_node_lifecycle_review_registry.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from asyncwait import eventually
from fixtures_mqtt import free_port

from control_plane.registry import NodeRegistryServicer
from control_plane.service import ControlPlane
from kvfence.config import ClusterConfig, Role, parse_config
from kvfence.errors import Unauthenticated
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node import NodeAgent, RegistrationRefused
from kvfence.node_main import RunningNode, serve_node, start_node
from kvfence.proto.kvfence.v1 import control_pb2
from kvfence.server import abort
from kvfence.tls import TlsError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(autouse=True)
def _default_structlog() -> None:
    """structlog's defaults: a CLI test run before in this process may have pointed it at a
    stream that is closed by now."""
    structlog.reset_defaults()


class Events:
    """The control plane's events, kept (in place of its event bus)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **payload: Any) -> int:
        self.events.append({"kind": kind, **payload})
        return len(self.events)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def make_cfg(
    tiny: Path, state: Path, cp_port: int, *, hb: float = 0.1, timeout: float = 1.0, **over: Any
) -> ClusterConfig:
    data: dict[str, Any] = {
        "model": {"path": str(tiny)},
        "kv": {
            "page_size": 16,
            "prefill_pool": {"num_pages": 16},
            "decode_pool": {"num_pages": 24},
        },
        "control_plane": {
            "state_dir": str(state),
            "listen": f"127.0.0.1:{cp_port}",
            "admin_listen": "127.0.0.1:0",
            "address": f"127.0.0.1:{cp_port}",
            "heartbeat_interval_s": hb,
            "node_timeout_s": timeout,
        },
        "node": {"node_id": "node-0", "drain_timeout_s": 1},
    }
    for section, values in over.items():
        data.setdefault(section, {}).update(values)
    return parse_config(data, environ={})


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def node_threads() -> list[str]:
    """Threads a node starts (the engine's, the metrics server's and its request handlers', which
    a port probe here starts too and which end with it); not the gRPC poller or the loop's
    executor, which outlive any one node by design."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and "_poll_wrapper" not in t.name
        and not t.name.startswith("asyncio_")
    )


class CP:
    """A control plane on a fixed port, which a test can stop and start again."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.cp: ControlPlane | None = None
        self.events = Events()

    async def start(self) -> ControlPlane:
        self.events = Events()
        self.cp = ControlPlane(self.cfg, events=self.events)
        await self.cp.start()
        return self.cp

    async def stop(self) -> None:
        if self.cp is not None:
            await self.cp.stop(grace=0)
            self.cp = None

    def heartbeats(self, node_id: str = "node-0") -> int:
        assert self.cp is not None
        node = self.cp.registry.get(node_id)
        return -1 if node is None else node.heartbeats

    def registered(self, node_id: str = "node-0") -> bool:
        return self.cp is not None and self.cp.registry.get(node_id) is not None


async def beats_on(cp: CP, more: int, timeout: float = 10.0) -> bool:
    """Whether the control plane counts ``more`` heartbeats of node-0 than now."""
    start = cp.heartbeats()
    return await eventually(lambda: cp.heartbeats() >= start + more, timeout)


@pytest.fixture
async def stack(tiny_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[CP, list[RunningNode]]]:
    """A control plane (heartbeats every 0.1 s, node_timeout_s 1) and the nodes a test starts,
    all stopped at the end."""
    cp = CP(make_cfg(tiny_dir, tmp_path, free_port()))
    await cp.start()
    nodes: list[RunningNode] = []
    try:
        yield cp, nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):  # a test's failing step: the test reports it
                await node.stop(grace=0)
        await cp.stop()


# -- 1: reconnect backoff -------------------------------------------------------------------------

# Past this much of an outage, gRPC's default reconnect backoff (1 s, x1.6 each attempt, +-20%)
# has made at least 4 attempts, so the gap after the next one is at least 0.8 x 1.6^4 = 5.2 s.
LONG_OUTAGE_S = 8.0
HB_S = 1.0
# Reconnect attempts at most max(interval, 1 s) apart (+20% jitter), then the next beat (half an
# interval after a failed one) is answered "unknown" and the node registers again.
REREGISTER_WITHIN_S = 3 * HB_S


@pytest.mark.parametrize("long_outage", [True, False], ids=["8s-outage", "1s-outage"])
async def test_a_node_registers_again_soon_after_a_control_plane_outage(
    tiny_dir: Path, tmp_path: Path, long_outage: bool
) -> None:
    """After a control plane was down for a while, nodes took up to gRPC's 120 s reconnect
    backoff to register again (60 s down: 8.7 s; 150 s: 48.9 s), while the registry counts on a
    heartbeat or so. A listener on the control plane's port meanwhile drops every connection,
    which shows when the node dials; the control plane comes back right after one such attempt,
    when gRPC's own backoff would wait at least 5 s for the next. Control: a short outage (no
    backoff to speak of) re-registers as soon."""
    loop = asyncio.get_running_loop()
    cp = CP(make_cfg(tiny_dir, tmp_path, free_port(), hb=HB_S, timeout=2 * HB_S))
    await cp.start()
    node = await start_node(cp.cfg, Role.PREFILL)
    try:
        await cp.stop()
        port = int(cp.cfg.control_plane.listen.rsplit(":", 1)[1])
        down = loop.time()
        if long_outage:
            attempts: list[float] = []

            def dialled(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                attempts.append(loop.time())
                writer.close()

            listener = await asyncio.start_server(dialled, "127.0.0.1", port)
            try:
                assert await eventually(
                    lambda: bool(attempts) and attempts[-1] > down + LONG_OUTAGE_S, 40
                )
            finally:
                listener.close()
                await listener.wait_closed()
        else:
            await asyncio.sleep(1.0)  # the outage itself, not an assertion
        await cp.start()
        back = loop.time()
        assert await eventually(cp.registered, 60)
        took = loop.time() - back
        assert took < REREGISTER_WITHIN_S, f"registered again {took:.1f} s after the restart"
    finally:
        await node.stop(grace=0)
        await cp.stop()


# -- 2: heartbeats survive an error; stop runs every step -----------------------------------------


async def test_a_heartbeat_that_raises_does_not_end_the_heartbeats(
    stack: tuple[CP, list[RunningNode]], tiny_dir: Path, tmp_path: Path
) -> None:
    """The node's load() raising (or its callbacks, or reading the token) used to end the
    heartbeat task for good, silently: the node went on SERVING, dropped as lost and never
    registered again. Now it is logged once for the burst and the beats go on. Control: the
    beats before the failure count as usual."""
    cp, nodes = stack
    node = await start_node(cp.cfg, Role.PREFILL)
    nodes.append(node)
    assert node.agent is not None
    assert await beats_on(cp, 3)  # control
    real_load = node.agent.load
    failures = [3]

    def load() -> control_pb2.HeartbeatRequest:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("stats unavailable")
        return real_load()

    with structlog.testing.capture_logs() as logs:
        node.agent.load = load
        assert await eventually(lambda: failures[0] == 0, 5)
        assert await beats_on(cp, 5)
    assert cp.events.of("node_lost") == []
    raised = [e for e in logs if e["event"] == "heartbeat raised; the heartbeats go on"]
    assert raised and raised[0]["errors"] == 1  # the first at once, the rest of the burst later
    assert isinstance(raised[0]["exc_info"], RuntimeError)


async def test_a_token_file_emptied_for_a_moment_changes_nothing(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A token file truncated while it is rewritten (``echo TOKEN > file``) used to kill the
    heartbeat task of the next beat that read it. The node reads it once, at start: beats go on
    through it and after. Control: they count before it too."""
    token = tmp_path / "node_token"
    token.write_text("kvfn_test_token\n")
    cfg = make_cfg(
        tiny_dir, tmp_path / "state", free_port(), control_plane={"node_token_file": str(token)}
    )
    cp = CP(cfg)
    await cp.start()
    node = await start_node(cfg, Role.PREFILL)
    try:
        assert await beats_on(cp, 3)  # control
        token.write_text("")
        assert await beats_on(cp, 3)  # beats while the file is empty
        token.write_text("kvfn_test_token\n")
        assert await beats_on(cp, 3)
        assert cp.events.of("node_lost") == [] and cp.registered()
    finally:
        await node.stop(grace=0)
        await cp.stop()


@pytest.mark.parametrize("fails", [True, False], ids=["drain-fails", "clean"])
async def test_a_failing_stop_step_still_stops_the_rest(
    tiny_dir: Path, tmp_path: Path, fails: bool
) -> None:
    """A step of RunningNode.stop that raised (the heartbeat task's error, re-raised by the
    agent's stop, was one) skipped every later one: the gRPC port stayed served, the engine
    thread and the metrics server ran on. Now every step runs and the first failure is raised at
    the end. Control: a stop where nothing fails leaves the same nothing, and raises nothing."""
    grpc_port, metrics_port = free_port(), free_port()
    cfg = make_cfg(
        tiny_dir,
        tmp_path,
        free_port(),
        node={"listen": f"127.0.0.1:{grpc_port}", "metrics_port": metrics_port},
    )
    before = node_threads()
    node = await start_node(cfg, Role.DECODE, register=False)
    assert port_open(grpc_port) and port_open(metrics_port)
    assert "decode-engine" in node_threads()
    if fails:

        async def drain(timeout_s: float) -> bool:
            raise RuntimeError("held_counts broke")

        node.drain = drain  # type: ignore[method-assign]
    checked = False
    try:
        with structlog.testing.capture_logs() as logs:
            if fails:
                with pytest.raises(RuntimeError, match="held_counts broke"):
                    await node.stop(grace=0, drain_timeout_s=1)
            else:
                await node.stop(grace=0, drain_timeout_s=1)
        failed = [e["step"] for e in logs if e["event"] == "node stop step failed"]
        assert failed == (["drain"] if fails else [])
        assert not port_open(grpc_port) and not port_open(metrics_port)
        assert await eventually(lambda: node_threads() == before), node_threads()
        assert node.rt.pool.num_free == node.rt.pool.num_pages
        checked = True
    finally:
        if not checked:  # stop the rest by hand, or what is left running hangs the session
            with contextlib.suppress(Exception):
                await node.server.stop(0)
                await node.servicer.close()
                await node.receiver.stop()
                node.metrics.stop()


async def test_the_agents_stop_does_not_raise_what_its_heartbeat_task_did() -> None:
    """The heartbeat task's exception came out of NodeAgent.stop() and so out of the node's
    stop, skipping the rest of it; now it is logged."""
    agent = NodeAgent(
        f"127.0.0.1:{free_port()}",
        control_pb2.RegisterRequest(node_id="n"),
        lambda: control_pb2.HeartbeatRequest(node_id="n"),
        0.01,
    )

    async def heartbeat() -> bool:
        raise RuntimeError("boom")

    agent.heartbeat = heartbeat  # type: ignore[method-assign]
    agent.start_heartbeats()
    assert agent._task is not None
    assert await eventually(agent._task.done, 5)
    with structlog.testing.capture_logs() as logs:
        await agent.stop()
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["heartbeat task had failed"]


# -- 3 and 4: one token per process; a refusal at runtime is fatal --------------------------------


async def test_a_node_keeps_the_token_it_started_with(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent reread the token file each beat while the node's own RPC check kept the token
    of its start: after a rotation nodes registered with the new token and refused the control
    plane's calls, which carry the new one too. Now the node keeps its start's token both ways
    (a rotation takes a restart): the file changing under a running node and control plane
    changes nothing. Control: the beats before the change count too."""
    token = tmp_path / "node_token"
    token.write_text("kvfn_old_token\n")
    cfg = make_cfg(
        tiny_dir, tmp_path / "state", free_port(), control_plane={"node_token_file": str(token)}
    )
    cp = CP(cfg)
    await cp.start()
    node = await start_node(cfg, Role.PREFILL)
    try:
        assert await beats_on(cp, 3)  # control
        fresh = tmp_path / "node_token.new"
        fresh.write_text("kvfn_new_token\n")
        os.replace(fresh, token)  # as the kubelet updates a mounted Secret
        assert await beats_on(cp, 5)
        assert cp.events.of("node_lost") == [] and node.agent is not None
        assert node.agent.refused == ""
    finally:
        await node.stop(grace=0)
        await cp.stop()


async def _serving(cp: CP, cfg: ClusterConfig, stop: asyncio.Event) -> asyncio.Task[None]:
    task = asyncio.create_task(serve_node(cfg, Role.PREFILL, stop))
    assert await eventually(lambda: cp.registered() or task.done(), 30)
    assert not task.done()
    return task


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "control"])
async def test_a_heartbeat_refused_unauthenticated_stops_the_node(
    stack: tuple[CP, list[RunningNode]], monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """A control plane answering the node's heartbeat UNAUTHENTICATED (restarted on a rotated
    token the node does not hold) used to get a warning a beat, forever, from a node that stayed
    up unregistered. Now it is fatal, as at start: the node drains, stops (its port closed) and
    serve_node raises RegistrationRefused (``kvfence serve`` exits 1: the pod restarts on the
    current token). Control: with the token accepted, it keeps serving until stopped, and ends
    cleanly."""
    cp, _ = stack
    grpc_port = free_port()
    cfg = cp.cfg.model_copy(
        update={"node": cp.cfg.node.model_copy(update={"listen": f"127.0.0.1:{grpc_port}"})}
    )
    stop = asyncio.Event()
    task = await _serving(cp, cfg, stop)
    if refused:

        async def authenticate(
            self: Any, context: grpc.aio.ServicerContext, method: str = ""
        ) -> None:
            await abort(context, Unauthenticated("node registration needs the cluster node token"))

        monkeypatch.setattr(NodeRegistryServicer, "_authenticate", authenticate)
        with pytest.raises(RegistrationRefused, match="node token"):
            await asyncio.wait_for(task, 10)
    else:
        assert await beats_on(cp, 5)
        assert not task.done()
        stop.set()
        assert await asyncio.wait_for(task, 10) is None
    assert not port_open(grpc_port)


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "control"])
async def test_a_refused_re_registration_stops_the_node(
    stack: tuple[CP, list[RunningNode]], monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """The control plane forgot the node and, restarted on another release, refuses its
    re-registration: that used to be logged each beat while the node stayed up, unregistered,
    health SERVING; at start the same refusal is fatal, and now it is here too (serve_node
    drains, stops and raises). Control: a re-registration accepted keeps the node serving."""
    cp, _ = stack
    stop = asyncio.Event()
    task = await _serving(cp, cp.cfg, stop)
    assert cp.cp is not None
    registry = cp.cp.registry
    if refused:
        import control_plane.registry as registry_module

        monkeypatch.setattr(
            registry_module, "PROTOCOL_VERSION", registry_module.PROTOCOL_VERSION + 1
        )
    node = registry.get("node-0")
    assert node is not None
    registry.lose(node, "test")
    if refused:
        with pytest.raises(RegistrationRefused, match="protocol"):
            await asyncio.wait_for(task, 10)
        assert len(cp.events.of("node_refused")) == 1  # once, not a beat
    else:
        assert await eventually(cp.registered, 10)
        assert await beats_on(cp, 3)
        assert not task.done()
        stop.set()
        assert await asyncio.wait_for(task, 10) is None


# -- 5: SIGTERM during start-up -------------------------------------------------------------------


@pytest.mark.parametrize("cp_up", [False, True], ids=["while-registering", "control-started"])
async def test_sigterm_during_start_up_ends_it_at_once(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cp_up: bool
) -> None:
    """SIGTERM while the node still retried its registration (the control plane not up yet) was
    not looked at until start-up ended: the node joined the cluster it was leaving, or, the
    control plane staying down, stopped 30 s later with exit 1. Now the start is cancelled: the
    node stops at once, cleanly (serve_node returns: exit 0), nothing left running or bound.
    Control: SIGTERM after a start that registered drains and stops it, as ever."""
    grpc_port = free_port()
    cp = CP(make_cfg(tiny_dir, tmp_path, free_port(), node={"listen": f"127.0.0.1:{grpc_port}"}))
    registering = asyncio.Event()
    real_register = NodeAgent.register

    async def register(self: NodeAgent, timeout_s: float = 30.0) -> None:
        registering.set()
        await real_register(self, timeout_s)

    monkeypatch.setattr(NodeAgent, "register", register)
    if cp_up:
        await cp.start()
    before = node_threads()
    stop = asyncio.Event()
    try:
        task = asyncio.create_task(serve_node(cp.cfg, Role.DECODE, stop))
        await asyncio.wait_for(registering.wait(), 60)
        if cp_up:
            assert await eventually(cp.registered, 10)
        else:
            await asyncio.sleep(0.5)  # a few refused attempts: it is retrying
        stop.set()
        assert await asyncio.wait_for(task, 5) is None
        assert not port_open(grpc_port)
        assert await eventually(lambda: node_threads() == before), node_threads()
        if cp_up:
            assert [e["node"] for e in cp.events.of("node_joined")] == ["node-0"]
        else:
            await cp.start()  # what would have let the retry through
            assert not cp.registered()
            assert cp.events.of("node_joined") == []
    finally:
        await cp.stop()


# -- 6: one missed heartbeat ----------------------------------------------------------------------


@pytest.mark.parametrize("dropped_s", [0.0, 4.0], ids=["one-beat", "control-past-timeout"])
async def test_one_missed_heartbeat_does_not_drop_the_node(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dropped_s: float
) -> None:
    """The agent slept a full interval after each beat ended, and gave a beat max(interval, 1 s):
    one unanswered beat made about three intervals of silence, and a node timeout of three
    intervals dropped a healthy node (its requests failed NODE_LOST). Beats now go from the start
    of the last, and an unanswered one is followed at once: two intervals. Control: heartbeats
    lost for longer than node_timeout_s do drop it (and it registers again)."""
    loop = asyncio.get_running_loop()
    # One lost beat costs interval + max(interval, 1 s) = 2 s of silence (kvfence.node.NodeAgent):
    # a node timeout of 3 s covers it with a margin.
    cp = CP(make_cfg(tiny_dir, tmp_path, free_port(), hb=1.0, timeout=3.0))
    real = NodeRegistryServicer.Heartbeat
    lost_from = [float("inf")]
    dropped = [0]

    async def heartbeat(
        self: NodeRegistryServicer,
        request: control_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
    ) -> control_pb2.HeartbeatResponse:
        now = loop.time()
        if lost_from[0] <= now and (dropped[0] == 0 or now < lost_from[0] + dropped_s):
            dropped[0] += 1
            await asyncio.sleep(5)  # never answered: the node gives up on it first
            await context.abort(grpc.StatusCode.UNAVAILABLE, "lost")
        return await real(self, request, context)

    monkeypatch.setattr(NodeRegistryServicer, "Heartbeat", heartbeat)
    await cp.start()
    node = await start_node(cp.cfg, Role.PREFILL)
    try:
        assert await beats_on(cp, 1)
        lost_from[0] = loop.time()
        assert await eventually(lambda: dropped[0] >= 1, 5)
        if dropped_s:
            assert await eventually(lambda: bool(cp.events.of("node_lost")), 10)
            assert await eventually(cp.registered, 10)
        else:
            assert await beats_on(cp, 3)
            assert dropped[0] == 1
            assert cp.events.of("node_lost") == []
    finally:
        await node.stop(grace=0)
        await cp.stop()


@pytest.mark.parametrize("answer_s", [0.7, 0.0], ids=["slow-control-plane", "control-prompt"])
async def test_heartbeats_answered_late_still_count(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer_s: float
) -> None:
    """A loaded control plane answers a heartbeat late, here 0.7 of an interval: a beat given up
    before it is read never counts (grpc-aio drops the call unread), and with half an interval
    to answer every beat was given up and a healthy node dropped. Control: prompt answers."""
    cp = CP(make_cfg(tiny_dir, tmp_path, free_port(), hb=1.0, timeout=3.0))
    real = NodeRegistryServicer.Heartbeat

    async def heartbeat(
        self: NodeRegistryServicer,
        request: control_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
    ) -> control_pb2.HeartbeatResponse:
        await asyncio.sleep(answer_s)  # before it is counted: as a busy loop reads it late
        return await real(self, request, context)

    monkeypatch.setattr(NodeRegistryServicer, "Heartbeat", heartbeat)
    await cp.start()
    node = await start_node(cp.cfg, Role.PREFILL)
    try:
        assert await beats_on(cp, 4)
        assert cp.events.of("node_lost") == []
    finally:
        await node.stop(grace=0)
        await cp.stop()


# -- 7: a failed start leaves nothing running -----------------------------------------------------


@pytest.mark.parametrize("bad_tls", [True, False], ids=["tls-error", "control-clean-start"])
async def test_a_start_that_fails_leaves_nothing_running(
    tiny_dir: Path, tmp_path: Path, bad_tls: bool
) -> None:
    """registry_channel_credentials failing (tls.public_cert without tls.internal_ca) was called
    after the gRPC server, the UCX listener, the engine thread and the metrics server had
    started, none of which were stopped. Now the credentials come first, and whatever start-up
    started is stopped when a later step fails. Control: the same node without the TLS setting
    starts (serving both ports) and stops leaving nothing."""
    grpc_port, metrics_port = free_port(), free_port()
    over: dict[str, Any] = {
        "node": {"listen": f"127.0.0.1:{grpc_port}", "metrics_port": metrics_port}
    }
    if bad_tls:
        over["tls"] = {"public_cert": "/nonexistent/server.pem", "public_key": "/nonexistent/k"}
    cfg = make_cfg(tiny_dir, tmp_path, free_port(), **over)
    before = node_threads()
    if bad_tls:
        with pytest.raises(TlsError):
            await start_node(cfg, Role.DECODE)
    else:
        node = await start_node(cfg, Role.DECODE, register=False)
        assert port_open(grpc_port) and port_open(metrics_port)
        await node.stop(grace=0)
    assert not port_open(grpc_port) and not port_open(metrics_port)
    assert await eventually(lambda: node_threads() == before), node_threads()
