"""The control plane never runs the model, so importing it must not load torch (seconds of start-up
and hundreds of MB of memory per process): what it shares with the nodes (stop strings,
detokenization, the checkpoint's config, fingerprints and KV layout) lives in torch-free modules
(kvfence.model.stops, kvfence.detok, kvfence.model.args, kvfence.model.checkpoint,
kvfence.model.served), and ``kvfence serve control-plane`` imports UCX's (torch-importing)
kvfence.transfer only for the nodes.

Each check runs in a fresh interpreter: this test process has long loaded torch for others. The
import checks cover what the module pulls in; the running control plane (start-up, the model info
it reads, its serving loop) is checked where it runs, in the libraries mapped into its process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfence.cli.stack import build_up_config
from kvfence.localstack import free_port, free_port_pair
from kvfence.model.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]

# What `kvfence serve control-plane` runs (kvfence.cli.stack imports serve from it).
CONTROL_PLANE_ENTRY = "control_plane.service"
# A node's service: it runs the model, so torch is there when imported.
DECODE_ENTRY = "decode_svc.service"

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps({m: m in sys.modules for m in ("torch", "numpy")}))
"""


def loaded_after_import(module: str) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_control_plane_import_loads_no_torch() -> None:
    loaded = loaded_after_import(CONTROL_PLANE_ENTRY)
    assert loaded["torch"] is False
    # numpy only came in with torch: nothing in the control plane needs it either.
    assert loaded["numpy"] is False


@pytest.mark.timeout(180)
def test_probe_sees_torch_where_it_is_imported() -> None:
    # Positive control: the same probe reports torch for a module that does import it.
    assert loaded_after_import(DECODE_ENTRY)["torch"] is True


# Shared objects whose path names them, as /proc/<pid>/maps lists them (libtorch_cpu.so, numpy's
# _multiarray_umath...so): loaded by an import of torch or numpy, whoever imported it.
TORCH_LIBRARY = "libtorch"
NUMPY_LIBRARY = "_multiarray_umath"
START_S = 120.0


@dataclass
class Service:
    proc: subprocess.Popen[bytes]
    log: Path

    def mapped(self, library: str) -> list[str]:
        """The files mapped into the process now whose path holds ``library``."""
        with Path(f"/proc/{self.proc.pid}/maps").open() as maps:
            return sorted({line.split()[-1] for line in maps if library in line})


def serve(role: str, config: Path, log: Path) -> Service:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence", "serve", role, "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    return Service(proc, log)


def wait_serving(service: Service, address: str) -> None:
    """Returns once the service's health says SERVING: Watch streams every change, and with
    wait_for_ready it waits for the listener to come up too."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        try:
            for reply in stub.Watch(request, timeout=START_S, wait_for_ready=True):
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as err:
            raise AssertionError(
                f"{address} not SERVING ({err.code().name}; exit {service.proc.poll()}): "
                f"{service.log.read_text()[-2000:]}"
            ) from None
    raise AssertionError(f"{address}: health stream ended: {service.log.read_text()[-2000:]}")


def stop(service: Service) -> None:
    if service.proc.poll() is None:
        service.proc.terminate()
    try:
        service.proc.wait(30)
    except subprocess.TimeoutExpired:
        service.proc.kill()
        service.proc.wait()


@dataclass
class Stack:
    config: Path
    logs: Path
    control_plane: Service


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """``kvfence serve control-plane`` at SERVING, on the embedded model as ``kvfence up`` uses it.

    The model's folder is in place, as every start on a state directory after the first finds
    it: the first start writes its weights, with torch (``ensure_tiny_model``), once."""
    base = tmp_path_factory.mktemp("no-torch")
    state = base / "state"
    shutil.copytree(ensure_tiny_model(), state / "models" / "tiny-llama")
    data = build_up_config(
        {"control_plane": {"shutdown_grace_s": 0.5, "shutdown_refuse_s": 0}},
        model=None, context_window=None, prefill_pool_tokens=256, decode_pool_tokens=256,
        page_size=16, port=free_port_pair(), state_dir=state,
    )  # fmt: skip
    config = base / "cluster.yaml"
    config.write_text(yaml.safe_dump(data))
    cp = serve("control-plane", config, base / "control-plane.log")
    try:
        wait_serving(cp, data["control_plane"]["listen"])
        yield Stack(config, base, cp)
    finally:
        stop(cp)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_serving_control_plane_has_not_loaded_torch(stack: Stack) -> None:
    assert stack.control_plane.mapped(TORCH_LIBRARY) == []
    assert stack.control_plane.mapped(NUMPY_LIBRARY) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_serving_node_of_that_control_plane_has_loaded_torch(stack: Stack) -> None:
    # Positive control: the same look at a process that runs the model, started as `kvfence up`
    # starts it on the same config, finds torch (and numpy) among its mapped libraries.
    listen = f"127.0.0.1:{free_port()}"
    config = yaml.safe_load(stack.config.read_text())
    config["node"]["listen"] = listen
    path = stack.logs / "decode.yaml"
    path.write_text(yaml.safe_dump(config))
    decode = serve("decode", path, stack.logs / "decode.log")
    try:
        wait_serving(decode, listen)
        assert decode.mapped(TORCH_LIBRARY) != []
        assert decode.mapped(NUMPY_LIBRARY) != []
    finally:
        stop(decode)
