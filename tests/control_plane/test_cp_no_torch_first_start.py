"""`kvfence up` writes the embedded model before it starts the control plane.

The control plane never runs the model and imports no torch (test_cp_no_torch.py), but on a
fresh state directory it still wrote the embedded model's weights itself (``ensure_tiny_model``,
with torch): seconds of its start and ~430 MiB it then kept for its whole life. ``up`` now writes
them first, in a process of its own that exits (``python -m kvfence.model.tiny``), so that even a
first start's control plane never loads torch.
``kvfence serve control-plane`` started alone still writes them itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_cp_no_torch import NUMPY_LIBRARY, TORCH_LIBRARY, Service

from kvfence.cli.stack import build_up_config
from kvfence.config import load_config
from kvfence.localstack import LocalStack, free_port_pair
from kvfence.model.served import embedded_model_dir, model_dir
from kvfence.model.tiny import tiny_model_complete

ROOT = Path(__file__).resolve().parents[2]


def _service(process, log: Path) -> Service:
    # Service reads /proc/<pid>/maps of its proc's pid; a psutil.Process has one too.
    return Service(process, log)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_on_a_fresh_state_dir_starts_a_control_plane_that_never_loads_torch(tmp_path):
    state = tmp_path / "state"
    args = ["--prefill-pool-tokens", "256", "--decode-pool-tokens", "256"]
    with LocalStack(state, args=args) as stack:
        services = stack.services()
        logs = state / "logs"
        cp = _service(services["control-plane"], logs / "cp.log")
        # Shared libraries stay mapped once loaded: none of torch's now is none ever.
        assert cp.mapped(TORCH_LIBRARY) == []
        assert cp.mapped(NUMPY_LIBRARY) == []
        # Positive control: the same look at a node of the same stack finds torch, the model
        # the control plane read is there whole, and the stack serves on it.
        decode = _service(services["decode"], logs / "decode-0.log")
        assert decode.mapped(TORCH_LIBRARY) != []
        assert tiny_model_complete(state / "models" / "tiny-llama")
        assert not [p.name for p in (state / "models").iterdir() if p.name != "tiny-llama"]
        with stack.client() as client:
            out = client.generate(prompt_ids=[1, 2], max_new_tokens=2, ignore_eos=True)
        assert len(out.token_ids) == 2
        # The writer's line leads the control plane's log, then the control plane's own.
        cp_log = (logs / "cp.log").read_text()
        assert cp_log.startswith(f"embedded model in {state.resolve() / 'models' / 'tiny-llama'}")
        assert "control plane started" in cp_log


def test_a_model_that_cannot_be_written_fails_up_naming_the_writer(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "models").write_text("a file where the models folder goes\n")
    port = free_port_pair()
    env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    out = subprocess.run(
        [sys.executable, "-m", "kvfence", "up", "--state-dir", str(state), "--port", str(port)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    target = state.resolve() / "models" / "tiny-llama"
    assert (
        f"kvfence up: model-writer exited with 1: cannot write the embedded model to {target}: "
        in out.stderr
    ), out.stderr
    assert "kvfence ready" not in out.stdout
    # It failed before any service started: the control plane never logged a line.
    assert "control plane" not in (state / "logs" / "cp.log").read_text()
    assert not (state / "up.json").exists()


def _writer(directory: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvfence.model.tiny", str(directory)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_a_writer_stopped_mid_write_leaves_no_half_written_folder(tmp_path):
    models = tmp_path / "models"
    proc = _writer(models / "tiny-llama")
    try:
        deadline = time.monotonic() + 30
        # Its temporary folder is there: the write has begun (torch is still loading).
        while not list(models.glob(".tiny-llama-*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # what `up` sends when it is stopped meanwhile
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(models.iterdir()) == []
    assert proc.returncode == 128 + signal.SIGTERM  # it exited, through its cleanup
    # Control: left to run, the same command writes the model whole, and nothing else.
    proc = _writer(models / "tiny-llama")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == f"embedded model in {models / 'tiny-llama'}\n"
    assert [p.name for p in models.iterdir()] == ["tiny-llama"]
    assert tiny_model_complete(models / "tiny-llama")


def test_a_control_plane_served_alone_still_writes_a_missing_model(tmp_path):
    """Outside `up` nobody writes the model first: the control plane's own model_dir does, as
    before (importing torch: this process has it anyway)."""
    state = tmp_path / "state"
    data = build_up_config(
        {}, model=None, context_window=None, prefill_pool_tokens=256, decode_pool_tokens=256,
        page_size=16, port=free_port_pair(), state_dir=state,
    )  # fmt: skip
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    folder = state.resolve() / "models" / "tiny-llama"
    assert embedded_model_dir(cfg) == folder
    assert not folder.exists()
    assert model_dir(cfg) == folder
    assert tiny_model_complete(folder)
    # A config naming its checkpoint has no embedded model for `up` to write.
    data["model"]["path"] = str(folder)
    path.write_text(yaml.safe_dump(data))
    assert embedded_model_dir(load_config(path)) is None
