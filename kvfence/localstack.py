"""A local kvfence stack as a subprocess: ``kvfence up`` on loopback, for tests, benchmarks and
scripts that need the real thing (separate processes, real gRPC and UCX).

``LocalStack`` starts ``python -m kvfence up`` on free ports with its own state directory, waits for
its own ``up.json`` (the one whose ``pid`` is that process's), and offers clients for tenants,
the admin API and each node's Stats (called with the cluster node token, as the nodes require).
``stop()`` sends SIGTERM, waits, and kills whatever is left, the services included (also those of
a ``start`` that failed, or whose ``up`` died), so a failed run leaves no process behind.
(``psutil`` comes with the ``test`` extra; it is imported only when a stack starts.)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvfence.auth import node_token_path, read_token, with_token
from kvfence.client import AdminClient, Client
from kvfence.proto.kvfence.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000


def _ephemeral_start() -> int:
    """The first port the kernel hands to outgoing connections (Linux default 32768)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address: a loopback-only listener there conflicts too
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port p with p .. p + count - 1 free, for a listener started after this returns.

    Drawn at random from below the kernel's ephemeral range: a port ``bind(0)`` hands out is an
    ephemeral one, which any process's next outgoing connection may take before the listener
    binds it (a busy test run saw UCX's bind fail "Address already in use" that way)."""
    draw = random.SystemRandom()
    high = _ephemeral_start() - count
    for _ in range(200):
        if high > _LOWEST_PORT:
            port = draw.randint(_LOWEST_PORT, high)
        else:  # an ephemeral range reaching down here: take what the kernel gives
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        if port + count <= 65536 and all(_bindable(p) for p in range(port, port + count)):
            return port
    raise RuntimeError(f"no {count} free consecutive port(s) found")


def free_port_pair() -> int:
    """A port p with p and p + 1 free (public and admin listeners)."""
    return free_port(2)


def _up_of(path: Path, pid: int) -> dict[str, Any] | None:
    """``up.json`` when the ``kvfence up`` process ``pid`` wrote it; None while it is another's
    or absent (``up`` writes it whole, by rename)."""
    try:
        up = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or not this run's: a stale file cut short, say
        return None
    return up if isinstance(up, dict) and up.get("pid") == pid else None


class LocalStack:
    """``kvfence up`` as a subprocess (see module docstring)."""

    tls_ca: Path | None = None  # CA of the control plane's certificate, when it serves TLS

    def __init__(
        self,
        state_dir: Path,
        *,
        prefill: int = 1,
        decode: int = 1,
        config: dict[str, Any] | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.state_dir = state_dir
        self.prefill = prefill
        self.decode = decode
        self.config = config or {}
        self.args = args or []
        self.env = env or {}  # added to this process's environment for `up` and its services
        self.proc: subprocess.Popen[bytes] | None = None
        self.up: dict[str, Any] = {}
        self.children: list[Any] = []  # psutil.Process of every service `up` started

    def start(self, timeout: float = 180.0) -> LocalStack:
        import psutil

        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "kvfence", "up",
            "--port", str(free_port_pair()),
            "--state-dir", str(self.state_dir),
            "--prefill", str(self.prefill),
            "--decode", str(self.decode),
            *self.args,
        ]  # fmt: skip
        if self.config:
            base = self.state_dir / "base-config.yaml"
            base.write_text(yaml.safe_dump(self.config))
            cmd += ["--config", str(base)]
        env = {
            **os.environ,
            "UCX_TLS": "tcp,self",
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            **self.env,
        }
        up_json = self.state_dir / "up.json"
        self._log = (self.state_dir / "up.out").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        # Only this run's up.json: one left by an earlier stack (killed before `up` could remove
        # it) would name a dead stack's ports and token, and one of a stack still running there
        # (whose lock refuses this `up`) is that stack's, to be left alone, not deleted.
        try:
            while (up := _up_of(up_json, self.proc.pid)) is None:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()  # first: the output then holds the services' last lines
                    raise RuntimeError(f"kvfence up failed:\n{self.output()}")
                time.sleep(0.1)
        except BaseException:  # Ctrl-C, anything: the stack it started must not outlive it
            self.stop()
            raise
        self.up = up
        try:
            self.children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:  # `up` is gone already: stop() finds its services (_services)
            self.children = []
        return self

    def output(self) -> str:
        """The tail of ``up``'s output and of every service log."""
        out = (self.state_dir / "up.out").read_text(errors="replace")[-4000:]
        for log in sorted((self.state_dir / "logs").glob("*.log")):
            out += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
        return out

    @property
    def target(self) -> str:
        return str(self.up["target"])

    @property
    def api_key(self) -> str:
        """The demo tenant's key that ``kvfence up`` created."""
        return str(self.up["api_keys"]["demo"])

    def admin(self) -> AdminClient:
        return AdminClient(self.up["admin_target"], self.up["admin_token"], tls_ca=self.tls_ca)

    def client(self, api_key: str | None = None) -> Client:
        return Client(self.target, api_key or self.api_key, tls_ca=self.tls_ca)

    def create_tenant(self, name: str, **limits: Any) -> str:
        with self.admin() as admin:
            return str(admin.create_tenant(name, **limits).api_key)

    def node_token(self) -> str:
        """The cluster node token: ``control_plane.node_token_file`` of the config, else the one
        the control plane generated in the state directory."""
        configured = (self.config.get("control_plane") or {}).get("node_token_file")
        return read_token(node_token_path(Path(configured) if configured else None, self.state_dir))

    def node_stats(self) -> dict[str, prefill_pb2.NodeStats]:
        """Stats of every registered node, by node id."""
        with self.admin() as admin:
            nodes = admin.list_nodes().nodes
        token = self.node_token()
        stats = {}
        for node in nodes:
            with grpc.insecure_channel(node.grpc_address) as ch:
                stub: Any = (
                    prefill_pb2_grpc.PrefillStub(ch)
                    if node.role == "prefill"
                    else decode_pb2_grpc.DecodeStub(ch)
                )
                stats[node.node_id] = with_token(stub, token).Stats(
                    prefill_pb2.StatsRequest(), timeout=5
                )
        return stats

    def node_rpc_counts(self) -> dict[str, int]:
        """Request-carrying RPCs each node has served, by node id."""
        return {node_id: int(s.rpc_count) for node_id, s in self.node_stats().items()}

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

    def services(self) -> dict[str, Any]:
        """The service processes (psutil) by role: ``control-plane``, ``prefill``, ``decode``."""
        import psutil

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

    def stop(self, timeout: float = 30.0) -> None:
        import psutil

        if self.proc is None:
            return
        services = self._services()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in services:
            try:
                child.wait(timeout=10)
            except psutil.TimeoutExpired:
                child.kill()
            except psutil.Error:
                pass
        self._log.close()
        self.proc = None

    def _services(self) -> list[Any]:
        """The processes this stack's ``up`` started: known once ``start`` returned, and found
        now when it failed before that (``up`` died, or its ``up.json`` never came). ``up`` names
        itself in each service's environment (``PARENT_ENV``), which finds them after ``up``
        itself died too (they then outlive it, stopping, until their SIGTERM is through). Never
        by the state directory: a refused second stack there must not stop the running one."""
        import psutil

        from kvfence.cli.stack import PARENT_ENV

        found = {p.pid: p for p in self.children}
        assert self.proc is not None
        up_pid = str(self.proc.pid)
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                found.setdefault(p.pid, p)
        for p in psutil.process_iter():
            if p.pid in found:
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get(PARENT_ENV) == up_pid:
                    found[p.pid] = p
        return list(found.values())

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
