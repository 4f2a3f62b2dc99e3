"""load_model refuses broken checkpoint folders with a ValueError naming what is wrong (the
services and ``kvfence run`` print it instead of a traceback), and loads the intact ones."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfence.model.loader import load_model, read_model_shape
from kvfence.model.tiny import TINY_CONFIG


def _weight_names(weights: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return list(f.keys())


@pytest.fixture
def copy(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint, to break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def test_a_truncated_safetensors_file_is_refused_naming_it(copy: Path) -> None:
    """It raised safetensors' own SafetensorError, which ``kvfence run`` printed as a traceback."""
    weights = copy / "model.safetensors"
    intact = load_model(copy)  # control: the same folder before the cut
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=re.escape(f"{weights} is not a readable safetensors")):
        load_model(copy)
    weights.write_bytes(data)
    assert load_model(copy).fingerprint == intact.fingerprint


@pytest.mark.parametrize("index_text", ["{not json", "[1]"])
def test_a_malformed_shard_index_is_refused_naming_it(copy: Path, index_text: str) -> None:
    """json.loads' own ValueError (or an AttributeError for JSON that is no object) named no
    file. Control: a well-formed index over the same weights loads as the unsharded folder."""
    intact = load_model(copy)
    index = copy / "model.safetensors.index.json"
    index.write_text(index_text)
    with pytest.raises(ValueError, match=re.escape(f"{index} is not a valid shard index")):
        load_model(copy)
    names = _weight_names(copy / "model.safetensors")
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    assert load_model(copy).fingerprint == intact.fingerprint


def _write_checkpoint(directory: Path, config: dict[str, Any]) -> Path:
    """A checkpoint whose weights have the shapes ``config`` implies, whatever
    ModelArgs.from_hf_config would say of it (the tiny writer validates through it)."""
    from safetensors.torch import save_file

    from kvfence.model.llama import ModelArgs, Transformer

    # ModelArgs of an accepted head_dim, then the one wanted
    args = ModelArgs.from_hf_config({**config, "head_dim": 32})
    args = dataclasses.replace(args, head_dim=config["head_dim"])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_an_odd_head_dim_is_refused_at_load(tmp_path: Path) -> None:
    """Rope rotates dimensions in pairs: an odd head_dim loaded and every request then failed
    with a RuntimeError; transformers refuses such a config. Control: an even one loads."""
    odd = _write_checkpoint(tmp_path / "odd", {**TINY_CONFIG, "head_dim": 15})
    with pytest.raises(ValueError, match="head_dim 15 is odd"):
        load_model(odd)
    with pytest.raises(ValueError, match="head_dim 15 is odd"):
        read_model_shape(odd)
    even = _write_checkpoint(tmp_path / "even", {**TINY_CONFIG, "head_dim": 16})
    assert load_model(even).args.head_dim == 16
    assert read_model_shape(even).head_dim == 16
