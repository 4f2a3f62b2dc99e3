"""A real Mosquitto broker for tests: ``with start_mosquitto() as (host, port, restart): ...``.

The yielded object also has ``stop()`` (SIGKILL, like a crash) and ``start()`` (same port) for tests
that need to act while the broker is down. The process is always killed on exit.

``start_mosquitto(users={"name": "password"})`` starts a broker that refuses anonymous clients and
knows those accounts (a password file made with ``mosquitto_passwd``, as the Helm chart does);
``acl=`` adds an ACL file (Mosquitto's format) that limits what each account may do.
``tls=BrokerTls(cert, key, ca)`` makes the listener TLS only (a plain client gets no answer).
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfence.localstack import free_port

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
HOST = "127.0.0.1"


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


def hand_to_broker(path: Path) -> None:
    """Let the broker read ``path`` (mode 0600): started as root, mosquitto drops to its own user
    before it reads its password and ACL files."""
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam("mosquitto")
    except KeyError:  # no such user: mosquitto stays root
        return
    os.chown(path, user.pw_uid, user.pw_gid)


def write_password_file(path: Path, users: dict[str, str]) -> None:
    """A Mosquitto password file (hashed entries) for ``users``, made with ``mosquitto_passwd``."""
    assert Path(MOSQUITTO_PASSWD).is_file(), f"no mosquitto_passwd at {MOSQUITTO_PASSWD}"
    entries = []
    for i, (name, password) in enumerate(users.items()):
        one = path.with_name(f"{path.name}.{i}")
        subprocess.run(
            [MOSQUITTO_PASSWD, "-c", "-b", str(one), name, password],
            check=True,
            capture_output=True,
            timeout=30,
        )
        entries.append(one.read_text())
        one.unlink()
    path.write_text("".join(entries))
    path.chmod(0o600)
    hand_to_broker(path)


@dataclasses.dataclass(frozen=True)
class BrokerTls:
    """A TLS listener: the broker's certificate and key (PEM) and the CA file Mosquitto is given
    (cafile); with ``require_certificate`` clients must present a certificate that CA signed."""

    cert: Path
    key: Path
    ca: Path
    require_certificate: bool = False

    def conf(self, workdir: Path) -> str:
        """The listener's TLS lines, with copies of the files in ``workdir`` that the broker can
        read (the key stays 0600)."""
        lines = []
        for option, src in (("cafile", self.ca), ("certfile", self.cert), ("keyfile", self.key)):
            copy = workdir / f"tls-{option}.pem"
            copy.write_bytes(Path(src).read_bytes())
            copy.chmod(0o600)
            hand_to_broker(copy)
            lines.append(f"{option} {copy}\n")
        if self.require_certificate:
            lines.append("require_certificate true\n")
        return "".join(lines)


class Mosquitto:
    """One broker on a fixed port that can be killed and started again."""

    def __init__(
        self,
        port: int,
        workdir: Path,
        users: dict[str, str] | None = None,
        acl: str | None = None,
        tls: BrokerTls | None = None,
    ):
        self.host = HOST
        self.port = port
        self.conf = workdir / "mosquitto.conf"
        self.log = workdir / "mosquitto.log"
        conf = f"listener {port} {HOST}\n"
        if tls is not None:  # the listener's own options: right after its line
            conf += tls.conf(workdir)
        conf += f"persistence false\nlog_dest file {self.log}\n"
        if users is None:
            assert acl is None, "an ACL needs accounts (users=)"
            conf += "allow_anonymous true\n"
        else:
            passwd = workdir / "passwd"
            write_password_file(passwd, users)
            conf += f"allow_anonymous false\npassword_file {passwd}\n"
        if acl is not None:
            acl_file = workdir / "acl"
            acl_file.write_text(acl)
            acl_file.chmod(0o600)
            hand_to_broker(acl_file)
            conf += f"acl_file {acl_file}\n"
        self.conf.write_text(conf)
        self.log.touch()
        self.log.chmod(0o666)  # mosquitto drops to its own user when started as root
        self.proc: subprocess.Popen[bytes] | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

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
def start_mosquitto(
    port: int | None = None,
    *,
    users: dict[str, str] | None = None,
    acl: str | None = None,
    tls: BrokerTls | None = None,
) -> Iterator[Mosquitto]:
    """Run Mosquitto on ``port`` (None = a free one); yields an object that unpacks to
    ``(host, port, restart_fn)`` and also offers ``stop()`` / ``start()``. With ``users``
    ({name: password}) it refuses anonymous clients and knows only those accounts; with ``tls``
    its listener speaks TLS only."""
    with tempfile.TemporaryDirectory(prefix="kvfence-mqtt-") as tmp:
        Path(tmp).chmod(0o755)
        broker = Mosquitto(port or free_port(), Path(tmp), users, acl, tls)
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()
