"""Real multi-process kvfence stacks for tests: loopback, real gRPC and UCX.

``Stack`` is :class:`kvfence.localstack.LocalStack` (``kvfence up`` as a subprocess); ``Cluster``
runs each service as its own ``kvfence serve`` process so a test can kill or restart one node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kvfence.client import Client
from kvfence.localstack import LocalStack as Stack
from kvfence.localstack import free_port_pair

__all__ = ["Cluster", "Stack", "free_port_pair"]


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
        self.config = self.cfg  # the resolved config (Stack.node_token reads it)
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

    def terminate(self, name: str) -> subprocess.Popen[bytes]:
        """SIGTERM one service (what Kubernetes sends a pod it deletes); its process, to wait on."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        return proc

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
    node_token = Stack.node_token
    node_stats = Stack.node_stats
    wait_pools_free = Stack.wait_pools_free

    def client(self, api_key: str) -> Client:
        return Client(self.target, api_key, tls_ca=self.tls_ca)


STOP_TIMEOUT_S = 20.0
