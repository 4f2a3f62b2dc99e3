"""A real multi-process kvfence stack for tests: ``kvfence up`` on loopback, real gRPC and UCX.

``Stack`` starts ``python -m kvfence up`` on free ports with its own state directory, waits for
``up.json``, and offers clients for tenants, the admin API and each node's Stats. ``stop()`` sends
SIGTERM and checks that every process it started has exited.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
import yaml

from kvfence.client import AdminClient, Client
from kvfence.proto.kvfence.v1 import prefill_pb2, prefill_pb2_grpc


def free_port_pair() -> int:
    """A port p with p and p + 1 free (public and admin listeners)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


class Stack:
    """``kvfence up`` as a subprocess (see module docstring)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        prefill: int = 1,
        decode: int = 1,
        config: dict[str, Any] | None = None,
        args: list[str] | None = None,
    ):
        self.state_dir = state_dir
        self.prefill = prefill
        self.decode = decode
        self.config = config or {}
        self.args = args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.up: dict[str, Any] = {}
        self.children: list[psutil.Process] = []

    def start(self, timeout: float = 180.0) -> Stack:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        port = free_port_pair()
        cmd = [
            sys.executable, "-m", "kvfence", "up",
            "--port", str(port),
            "--state-dir", str(self.state_dir),
            "--prefill", str(self.prefill),
            "--decode", str(self.decode),
            *self.args,
        ]  # fmt: skip
        if self.config:
            base = self.state_dir / "base-config.yaml"
            base.write_text(yaml.safe_dump(self.config))
            cmd += ["--config", str(base)]
        env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        self.log = (self.state_dir / "up.out").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        up_json = self.state_dir / "up.json"
        deadline = time.monotonic() + timeout
        while not up_json.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvfence up failed:\n{self.output()}")
            time.sleep(0.2)
        self.up = json.loads(up_json.read_text())
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        return self

    def output(self) -> str:
        out = (self.state_dir / "up.out").read_text(errors="replace")[-4000:]
        for log in sorted((self.state_dir / "logs").glob("*.log")):
            out += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
        return out

    @property
    def target(self) -> str:
        return str(self.up["target"])

    tls_ca: Path | None = None  # CA of the control plane's certificate, when it serves TLS

    def admin(self) -> AdminClient:
        return AdminClient(self.up["admin_target"], self.up["admin_token"], tls_ca=self.tls_ca)

    def client(self, api_key: str | None = None) -> Client:
        return Client(self.target, api_key or self.up["api_keys"]["demo"], tls_ca=self.tls_ca)

    def create_tenant(self, name: str, **limits: Any) -> str:
        with self.admin() as admin:
            return str(admin.create_tenant(name, **limits).api_key)

    def node_stats(self) -> dict[str, prefill_pb2.NodeStats]:
        """Stats of every registered node, by node id."""
        with self.admin() as admin:
            nodes = admin.list_nodes().nodes
        stats = {}
        for node in nodes:
            with grpc.insecure_channel(node.grpc_address) as ch:
                stats[node.node_id] = (
                    prefill_pb2_grpc.PrefillStub(ch).Stats(prefill_pb2.StatsRequest(), timeout=5)
                    if node.role == "prefill"
                    else _decode_stats(ch)
                )
        return stats

    def wait_pools_free(self, timeout: float = 20.0) -> dict[str, prefill_pb2.NodeStats]:
        """Poll until every node's pool is entirely free; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.node_stats()
            if all(s.free_pages == s.total_pages for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in self.children:
            try:
                child.wait(timeout=10)
            except psutil.TimeoutExpired:
                child.kill()
        self.log.close()
        self.proc = None


def _decode_stats(ch: grpc.Channel) -> prefill_pb2.NodeStats:
    from kvfence.proto.kvfence.v1 import decode_pb2_grpc

    return decode_pb2_grpc.DecodeStub(ch).Stats(prefill_pb2.StatsRequest(), timeout=5)


class Cluster:
    """Control plane and nodes as separate ``kvfence serve`` processes, so a test can kill or
    restart one node while the rest keep running (``kvfence up`` stops everything instead)."""

    def __init__(self, state_dir: Path, *, prefill: int = 1, decode: int = 1, **up_options: Any):
        from kvfence.cli.stack import build_up_config

        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        base = up_options.pop("config", {})
        opts = {
            "model": None,
            "context_window": None,
            "prefill_pool_tokens": 1024,
            "decode_pool_tokens": 1024,
            "page_size": 16,
            **up_options,
        }
        self.cfg = build_up_config(base, port=free_port_pair(), state_dir=state_dir, **opts)
        self.cfg_path = state_dir / "cluster.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.cfg))
        self.roles = {f"prefill-{i}": "prefill" for i in range(prefill)}
        self.roles.update({f"decode-{i}": "decode" for i in range(decode)})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.up = {
            "target": self.cfg["control_plane"]["listen"],
            "admin_target": self.cfg["control_plane"]["admin_listen"],
        }

    def _spawn(self, name: str, role: str) -> None:
        env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        env["KVFENCE__NODE__NODE_ID"] = name
        log = (self.state_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kvfence", "serve", role, "--config", str(self.cfg_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def start(self, timeout: float = 180.0) -> Cluster:
        self._spawn("control-plane", "control-plane")
        token = self.state_dir / "admin_token"
        self._wait(token.exists, timeout, "control plane did not start")
        self.up["admin_token"] = token.read_text().strip()
        for name, role in self.roles.items():
            self._spawn(name, role)
        self.wait_registered(set(self.roles), timeout)
        return self

    def _wait(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} (exited: {dead})\n{self.output()}")
            time.sleep(0.2)

    def wait_registered(self, names: set[str], timeout: float = 120.0) -> None:
        def registered() -> bool:
            try:
                with self.admin() as admin:
                    nodes = {n.node_id for n in admin.list_nodes().nodes if n.healthy}
            except Exception:
                return False
            return names <= nodes

        self._wait(registered, timeout, f"nodes {sorted(names)} did not register")

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def restart(self, name: str) -> None:
        if name in self.procs:
            self.kill(name)
        self._spawn(name, self.roles[name])

    def output(self) -> str:
        return "".join(
            f"\n--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
            for p in sorted(self.state_dir.glob("*.log"))
        )

    def stop(self) -> None:
        for name in sorted(self.procs, key=lambda n: n == "control-plane"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    # the same client helpers as Stack
    tls_ca: Path | None = None
    target = Stack.target
    admin = Stack.admin
    create_tenant = Stack.create_tenant
    node_stats = Stack.node_stats
    wait_pools_free = Stack.wait_pools_free

    def client(self, api_key: str) -> Client:
        return Client(self.target, api_key, tls_ca=self.tls_ca)


STOP_TIMEOUT_S = 20.0
