"""``kvfence up`` as a subprocess for benchmarks: start, node stats, RSS sampling, sure stop.

A trimmed copy of ``tests/stack_harness.Stack`` (benchmarks do not import the test tree).
``stop()`` sends SIGTERM, waits, then kills whatever is left, the services included, so a failed
benchmark leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchlib import REPO


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
        return int(port)
    raise RuntimeError("no free port pair")


class BenchStack:
    """A local kvfence stack (control plane, prefill, decode processes) on loopback."""

    def __init__(self, state_dir: Path, *, args: list[str] | None = None):
        self.state_dir = state_dir
        self.args = args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.up: dict[str, Any] = {}
        self.children: list[psutil.Process] = []

    def start(self, timeout: float = 180.0) -> BenchStack:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "kvfence", "up",
            "--port", str(free_port_pair()),
            "--state-dir", str(self.state_dir),
            *self.args,
        ]  # fmt: skip
        env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        self._log = (self.state_dir / "up.out").open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        up_json = self.state_dir / "up.json"
        deadline = time.monotonic() + timeout
        while not up_json.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = (self.state_dir / "up.out").read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"kvfence up failed:\n{out}")
            time.sleep(0.1)
        self.up = json.loads(up_json.read_text())
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        return self

    @property
    def target(self) -> str:
        return str(self.up["target"])

    @property
    def api_key(self) -> str:
        return str(self.up["api_keys"]["demo"])

    def services(self) -> dict[str, psutil.Process]:
        """The service processes by role (``control-plane``, ``prefill``, ``decode``)."""
        out = {}
        for p in self.children:
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "serve" in cmd:
                role = cmd[cmd.index("serve") + 1]
                out[role if role not in out else f"{role}-{p.pid}"] = p
        return out

    def node_rpc_counts(self) -> dict[str, int]:
        """``rpc_count`` from every node's Stats RPC, by node id."""
        import grpc

        from kvfence.client import AdminClient
        from kvfence.proto.kvfence.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

        with AdminClient(self.up["admin_target"], self.up["admin_token"]) as admin:
            nodes = admin.list_nodes().nodes
        counts = {}
        for node in nodes:
            with grpc.insecure_channel(node.grpc_address) as ch:
                stub: Any = (
                    prefill_pb2_grpc.PrefillStub(ch)
                    if node.role == "prefill"
                    else decode_pb2_grpc.DecodeStub(ch)
                )
                counts[node.node_id] = int(
                    stub.Stats(prefill_pb2.StatsRequest(), timeout=5).rpc_count
                )
        return counts

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
            except psutil.Error:
                pass
        self._log.close()
        self.proc = None

    def __enter__(self) -> BenchStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RssSampler:
    """Samples the resident set size of named processes in a background thread; ``peaks()`` and
    ``reset()`` let a benchmark take the peak of each phase separately."""

    def __init__(self, procs: dict[str, psutil.Process], interval_s: float = 0.05):
        self.procs = procs
        self.interval_s = interval_s
        self._peak: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        for name, p in self.procs.items():
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            with self._lock:
                self._peak[name] = max(self._peak.get(name, 0), rss)

    def reset(self) -> None:
        with self._lock:
            self._peak.clear()
        self.sample()

    def peaks_mb(self) -> dict[str, float]:
        with self._lock:
            return {name: round(v / 2**20, 1) for name, v in sorted(self._peak.items())}

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
