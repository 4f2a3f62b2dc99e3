"""A port that a kvfence server already holds cannot be bound a second time (no SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfence.server import BindError, GrpcServer


async def start(listen: str) -> GrpcServer:
    return await GrpcServer.start(listen, [], ["kvfence.v1.Test"])


async def health_of(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


async def test_second_server_on_a_taken_port_fails_naming_the_address() -> None:
    first = await start("127.0.0.1:0")
    try:
        address = f"127.0.0.1:{first.port}"
        with pytest.raises(BindError, match=f"cannot listen on {address}") as err:
            await start(address)
        assert isinstance(err.value, OSError)  # what callers already catch
        assert "in use" in str(err.value)
        # the first server is untouched and still answers
        assert await health_of(first.port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await first.stop(grace=0)


async def test_free_port_binds_and_a_released_port_binds_again() -> None:
    first = await start("127.0.0.1:0")
    port = first.port
    assert port > 0
    other = await start("127.0.0.1:0")  # control: a free port binds next to it
    try:
        assert other.port not in (0, port)
    finally:
        await other.stop(grace=0)
    await first.stop(grace=0)
    again = await start(f"127.0.0.1:{port}")  # control: the port is free once released
    try:
        assert again.port == port
        assert await health_of(port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await again.stop(grace=0)


async def test_serve_exits_with_a_message_naming_the_taken_address(tmp_path) -> None:
    held = await start("127.0.0.1:0")
    try:
        address = f"127.0.0.1:{held.port}"
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "control_plane": {
                        "listen": address,
                        "admin_listen": "127.0.0.1:0",
                        "state_dir": str(tmp_path / "state"),
                    }
                }
            )
        )
        proc = await _run(
            [sys.executable, "-m", "kvfence", "serve", "control-plane", "--config", str(cfg)]
        )
    finally:
        await held.stop(grace=0)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvfence serve control-plane: cannot listen on " + address), last


async def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    # In a thread: the held server must keep running on this loop while the child tries to bind.
    return await asyncio.to_thread(
        subprocess.run, cmd, capture_output=True, text=True, timeout=60, check=False
    )
