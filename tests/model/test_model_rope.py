"""Rope frequencies read from a config.json equal transformers' for the same file, including the
keys a checkpoint may leave out or put at the top level (transformers' standardize_rope_params)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvfence.model.rope import RopeSpec, inv_freq_and_scale

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
BASE = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
}


def hf_inv_freq(model_type: str, cfg: dict[str, Any], tmp_path: Path) -> tuple[torch.Tensor, float]:
    """The frequencies and attention scaling of the model transformers builds from a config.json
    holding ``cfg`` (its model, not its config object alone: the model applies the top-level
    pretraining length when it is built)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"vocab_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **small, "model_type": model_type}))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    rotary = model.model.rotary_emb
    return rotary.inv_freq, float(rotary.attention_scaling)


def ours(cfg: dict[str, Any]) -> tuple[torch.Tensor, float]:
    spec = RopeSpec.from_config(json.loads(json.dumps(cfg)))  # as read from the file
    return inv_freq_and_scale(spec, cfg["head_dim"], cfg["max_position_embeddings"])


@pytest.mark.parametrize(
    "name, model_type, cfg",
    [
        # control: every key where transformers reads it
        ("llama3 complete", "llama", {
            **BASE, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32},
        }),
        # no pretraining length: transformers takes max_position_embeddings (kvfence took 8192)
        ("llama3 without original length", "llama", {**BASE, "rope_scaling": LLAMA3}),
        # a top-level pretraining length wins over the rope dict's (Phi3-style configs)
        ("yarn, top-level original length", "qwen2", {
            **BASE, "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "rope_scaling": {
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            },
        }),
        ("yarn without original length", "qwen2", {
            **BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        }),
    ],
)  # fmt: skip
def test_rope_frequencies_equal_transformers(
    name: str, model_type: str, cfg: dict, tmp_path: Path
) -> None:
    want, want_scale = hf_inv_freq(model_type, cfg, tmp_path)
    got, scale = ours(cfg)
    assert torch.equal(got, want.float()), name
    assert scale == pytest.approx(want_scale, rel=1e-12), name


@pytest.mark.parametrize("missing", ["low_freq_factor", "high_freq_factor"])
def test_llama3_without_its_frequency_factors_is_refused(missing: str) -> None:
    """transformers has no default for them: kvfence used to guess 1 and 4."""
    rope = {k: v for k, v in LLAMA3.items() if k != missing}
    with pytest.raises(ValueError, match=f"llama3' needs '{missing}'"):
        RopeSpec.from_config({**BASE, "rope_scaling": rope})
    RopeSpec.from_config({**BASE, "rope_scaling": LLAMA3})  # control: complete, accepted


# A transformers-5-saved config (theta inside rope_parameters, no top-level rope_theta).
V5 = {k: v for k, v in BASE.items() if k != "rope_theta"}
V5_YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}


@pytest.mark.parametrize(
    "name, rope_scaling",
    [
        # an operator pastes a model card's long-context snippet into a v5-saved default config
        ("another type", {"type": "linear", "factor": 4.0}),
        ("another factor", {"type": "yarn", "factor": 2.0}),
        # transformers takes theta from rope_scaling, else the top level, else 10000
        ("another theta", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0}),
        ("an extra key", {"type": "yarn", "factor": 4.0, "beta_fast": 16}),
    ],
)  # fmt: skip
def test_rope_parameters_and_rope_scaling_that_disagree_are_refused(
    name: str, rope_scaling: dict
) -> None:
    """transformers 5 lets rope_scaling win over rope_parameters; kvfence read rope_parameters
    first and served another rotation than HF, silently. Two rope dicts that say different
    things are refused now, naming both."""
    cfg = {**V5, "rope_parameters": V5_YARN, "rope_scaling": rope_scaling}
    with pytest.raises(ValueError, match=r"both 'rope_parameters'.*'rope_scaling'.*keep one"):
        RopeSpec.from_config(cfg)


@pytest.mark.parametrize(
    "name, cfg",
    [
        # the old type spelling and a theta folded in from the default
        ("type spelling, default theta", {**V5, "rope_scaling": {"type": "yarn", "factor": 4}}),
        ("same dict", {**V5, "rope_scaling": dict(V5_YARN)}),
        # theta from the top level on the rope_scaling side
        ("top-level theta", {
            **V5, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        }),
        # an empty dict is no rope dict (as transformers: `rope_scaling or rope_parameters`)
        ("empty rope_scaling", {**V5, "rope_scaling": {}}),
    ],
)  # fmt: skip
def test_rope_parameters_and_rope_scaling_that_agree_load_as_either(name: str, cfg: dict) -> None:
    """The control: both keys present and saying the same thing once normalised."""
    alone = RopeSpec.from_config({**V5, "rope_parameters": V5_YARN})
    assert RopeSpec.from_config({**cfg, "rope_parameters": V5_YARN}) == alone, name
    assert alone.rope_type == "yarn" and alone.theta == 10000.0 and alone.get("factor") == 4.0
