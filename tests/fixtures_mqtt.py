"""A real Mosquitto broker for tests: ``with start_mosquitto() as (host, port, restart): ...``.

The yielded object also has ``stop()`` (SIGKILL, like a crash) and ``start()`` (same port) for tests
that need to act while the broker is down. The process is always killed on exit.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s") from None
            time.sleep(0.02)


class Mosquitto:
    """One broker on a fixed port that can be killed and started again."""

    def __init__(self, port: int, workdir: Path):
        self.host = HOST
        self.port = port
        self.conf = workdir / "mosquitto.conf"
        self.log = workdir / "mosquitto.log"
        self.conf.write_text(
            f"listener {port} {HOST}\nallow_anonymous true\npersistence false\n"
            f"log_dest file {self.log}\n"
        )
        self.log.touch()
        self.log.chmod(0o666)  # mosquitto drops to its own user when started as root
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None, "broker already running"
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(self.host, self.port)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __iter__(self) -> Iterator[object]:
        restart: Callable[[], None] = self.restart
        return iter((self.host, self.port, restart))


@contextmanager
def start_mosquitto(port: int | None = None) -> Iterator[Mosquitto]:
    """Run Mosquitto on ``port`` (None = a free one); yields an object that unpacks to
    ``(host, port, restart_fn)`` and also offers ``stop()`` / ``start()``."""
    with tempfile.TemporaryDirectory(prefix="kvfence-mqtt-") as tmp:
        Path(tmp).chmod(0o755)
        broker = Mosquitto(port or free_port(), Path(tmp))
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()
