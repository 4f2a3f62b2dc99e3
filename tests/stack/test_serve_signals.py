"""Exit codes of ``kvfence serve`` around its stop: SIGTERM before the service's event loop has
taken the signals (the config still loading) ends the process with 0, as README says of a stop
while a node starts, not killed by the signal (-15); and a second SIGTERM after the stop is done,
in the teardown that follows it, does not turn the clean stop into a killed process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from stack_starts import seed_embedded_model

from kvfence.cli.stack import build_up_config
from kvfence.localstack import free_port_pair

SITE = Path(__file__).resolve().parent / "slow_teardown_site"


def _wait_for(cond: object, timeout: float, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert proc.poll() is None, f"{what}: the process exited {proc.returncode} first"
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _serve(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvfence", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def _writer_opens(fifo: Path) -> int | None:
    """A write end of ``fifo``, once a reader has it open (ENXIO before); None till then."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


@pytest.mark.parametrize("signalled", [True, False], ids=["sigterm", "control"])
def test_sigterm_while_the_config_loads_exits_0(tmp_path: Path, signalled: bool) -> None:
    """The config is a FIFO, so the process waits in ``load_config`` for as long as the test
    likes. SIGTERM there exits 0 (it was -15: the handlers came only with the event loop).
    Control: the same wait ended by a config that does not load exits 2, naming it, so the
    process was waiting where the test says."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    proc = _serve(["prefill", "--config", str(fifo)])
    fds: list[int] = []

    def reader_waits() -> bool:
        fd = _writer_opens(fifo)
        if fd is not None:
            fds.append(fd)
        return fd is not None

    try:
        _wait_for(reader_waits, 60, proc, "kvfence serve did not open its config")
        if signalled:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.stdout.read() if proc.stdout else ""
        else:
            os.write(fds[0], b"node: {no_such_key: 1}\n")
            os.close(fds.pop())
            out = proc.communicate(timeout=30)[0].decode()
            assert proc.returncode == 2 and "no_such_key" in out, out
    finally:
        for fd in fds:
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_second_sigterm_in_the_teardown_after_the_stop_exits_0(tmp_path: Path) -> None:
    """SIGTERM stops a control plane; a second one lands once its event loop has returned, in
    the teardown after it (made 3 s long here): the process still exits 0 (it was -15). The
    process was alive when the second signal was sent, so the signal did reach that window."""
    cfg = build_up_config(
        {"control_plane": {"shutdown_grace_s": 0.5, "shutdown_refuse_s": 0}},
        model=None, context_window=None, prefill_pool_tokens=256, decode_pool_tokens=256,
        page_size=16, port=free_port_pair(), state_dir=seed_embedded_model(tmp_path),
    )  # fmt: skip
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    mark = tmp_path / "teardown"
    env = {
        "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
        "KVFENCE_TEST_TEARDOWN_MARK": str(mark),
        "KVFENCE_TEST_TEARDOWN_S": "3",
    }
    proc = _serve(["control-plane", "--config", str(path)], env)
    try:
        _wait_for((tmp_path / "admin_token").exists, 120, proc, "the control plane did not start")
        proc.send_signal(signal.SIGTERM)
        _wait_for(mark.exists, 60, proc, "the stop did not reach its teardown")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
