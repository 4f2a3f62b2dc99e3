"""The chart's GPU values say what the services do with a GPU today: nothing. A node loads the
model and its KV pool in host memory and runs on the CPU whatever the machine has
(``NodeRuntime.build``), so `gpu.enabled` only requests the device, and the memory to size is the
host's.

The values once read as GPU serving (ci/gpu-rdma-values.yaml: "an 8B-class model in bfloat16 on
GPU nodes"): each pod held an idle GPU while its 48 GiB pool and 15 GiB of weights sat in host
memory nobody had sized for them. When the services serve from the device, the first test here
fails, and these comments are to change with the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvfence.config import Role, parse_config
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node import NodeRuntime

CHART = Path(__file__).resolve().parents[1] / "helm" / "kvfence"


def test_a_node_holds_its_model_and_pool_in_host_memory(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "model": {"path": str(ensure_tiny_model())},
            "kv": {"decode_pool": {"num_pages": 8}},
            "control_plane": {"state_dir": str(tmp_path)},
        },
        environ={},
    )
    on_device = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    rt = NodeRuntime.build(cfg, Role.DECODE)
    assert rt.pool.kv.device.type == "cpu"
    assert rt.pool.page_gen.device.type == "cpu"
    assert {p.device.type for p in rt.engine.model.parameters()} == {"cpu"}
    if torch.cuda.is_available():  # a GPU machine: the build put nothing on it
        assert torch.cuda.memory_allocated() == on_device


def prose(comment: str) -> str:
    """A YAML comment block as one line of text, without its ``#``s."""
    return " ".join(" ".join(line.strip().lstrip("#") for line in comment.splitlines()).split())


def comment_above(text: str, key_line: re.Match[str]) -> str:
    """The comment lines right above a key (and the key line's own comment)."""
    lines = text[: key_line.start()].splitlines()
    above = []
    for line in reversed(lines):
        if not line.strip().startswith("#"):
            break
        above.append(line)
    words = [line.strip().lstrip("#") for line in reversed(above)] + [key_line.group(0)]
    return " ".join(" ".join(words).split())


def gpu_comments(values: str) -> list[str]:
    """Each role's `gpu:` block in values.yaml with the comments that describe it."""
    return [comment_above(values, m) for m in re.finditer(r"^  gpu:.*$", values, re.M)]


def test_the_values_say_gpu_enabled_only_requests_the_device() -> None:
    values = (CHART / "values.yaml").read_text()
    header = prose(values.split("\nclusterName:")[0])
    assert "gpu.enabled only requests the device" in header
    assert "load the model and the KV pools in host memory and run on the CPU" in header
    blocks = gpu_comments(values)
    assert len(blocks) == 2  # prefill's and decode's
    for block in blocks:
        assert "host memory" in block, block
    ci = prose((CHART / "ci" / "gpu-rdma-values.yaml").read_text().split("\nmodel:")[0])
    assert "not GPU serving today" in ci
    assert "gpu.enabled only requests the device" in ci


def test_a_gpu_block_without_the_note_is_seen() -> None:
    """Control for ``gpu_comments``: a block whose comments say nothing of host memory."""
    values = "prefill:\n  # Requests the device.\n  gpu:\n    enabled: false\n"
    assert gpu_comments(values) == ["Requests the device. gpu:"]
