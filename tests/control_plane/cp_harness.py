"""An in-process control plane with fake nodes, on ephemeral ports (``make_cluster``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cp_fakes import EventRecorder, FakeNode, Script, make_model_info

from control_plane.model_info import ModelInfo
from control_plane.service import ControlPlane, Ports
from control_plane.tenants import TenantLimits
from kvfence.auth import bearer_metadata
from kvfence.client import AsyncClient
from kvfence.config import ClusterConfig, parse_config
from kvfence.proto.kvfence.v1 import control_pb2_grpc


def make_cfg(
    state_dir: Path, transfer: dict[str, Any] | None = None, **control_plane: Any
) -> ClusterConfig:
    cp = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "state_dir": str(state_dir),
        "heartbeat_interval_s": 0.05,
        "node_timeout_s": 0.5,
        "default_deadline_s": 10.0,
        "admission_queue": 8,
    }
    cp.update(control_plane)
    data = {"model": {"name": "test-model"}, "control_plane": cp, "transfer": transfer or {}}
    return parse_config(data, environ={})


@dataclass
class Cluster:
    cp: ControlPlane
    ports: Ports
    script: Script
    events: EventRecorder
    decode: list[FakeNode]
    prefill: list[FakeNode]
    api_key: str
    tenant: str = "acme"
    _closers: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports.public}"

    @property
    def admin_target(self) -> str:
        return f"127.0.0.1:{self.ports.admin}"

    def client(self, api_key: str | None = None, timeout: float | None = None) -> AsyncClient:
        c = AsyncClient(self.target, self.api_key if api_key is None else api_key, timeout=timeout)
        self._closers.append(c.close)
        return c

    def admin(self, token: str | None = None) -> tuple[control_pb2_grpc.AdminStub, Any]:
        """An async Admin stub and the metadata carrying ``token`` (default: the real one)."""
        channel = grpc.aio.insecure_channel(self.admin_target)
        self._closers.append(lambda: channel.close(None))
        token = self.cp.admin_token if token is None else token
        return control_pb2_grpc.AdminStub(channel), bearer_metadata(token)

    def node_calls(self) -> int:
        return sum(len(n.calls) for n in [*self.decode, *self.prefill])

    async def add_node(self, node: FakeNode) -> Any:
        await node.start()
        self._closers.append(node.stop)
        return await node.register(self.ports.public, self.cp.node_token)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()
        await self.cp.stop(grace=0.5)


async def make_cluster(
    tmp_path: Path,
    *,
    context_window: int = 256,
    decode_pool: int = 4096,
    prefill_pool: int = 4096,
    decode_nodes: int = 1,
    prefill_nodes: int = 1,
    limits: TenantLimits = TenantLimits(),
    **control_plane: Any,
) -> Cluster:
    script = Script()
    events = EventRecorder()
    cp = ControlPlane(
        make_cfg(tmp_path, **control_plane),
        model_info=make_model_info(context_window),
        events=events,
    )
    ports = await cp.start()
    _, api_key, _ = cp.tenants.create_tenant("acme", limits)
    cluster = Cluster(cp, ports, script, events, [], [], api_key)
    for i in range(decode_nodes):
        node = FakeNode("decode", f"decode-{i}", script, pool_tokens=decode_pool)
        assert (await cluster.add_node(node)).accepted
        cluster.decode.append(node)
    for i in range(prefill_nodes):
        node = FakeNode("prefill", f"prefill-{i}", script, pool_tokens=prefill_pool)
        assert (await cluster.add_node(node)).accepted
        cluster.prefill.append(node)
    return cluster


async def start_on(state: Path, model_info: ModelInfo | None = None) -> Cluster:
    """What make_cluster starts, on a state directory whose tenants exist already (a restart)."""
    events = EventRecorder()
    cp = ControlPlane(make_cfg(state), model_info=model_info or make_model_info(), events=events)
    ports = await cp.start()
    script = Script()
    c = Cluster(cp, ports, script, events, [], [], api_key="")
    for role, nodes in (("decode", c.decode), ("prefill", c.prefill)):
        node = FakeNode(role, f"{role}-0", script, pool_tokens=4096)
        assert (await c.add_node(node)).accepted
        nodes.append(node)
    return c


async def eventually(check: Callable[[], bool], timeout: float = 2.0) -> None:
    """Wait until ``check()`` holds (state that settles after an RPC returned)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
