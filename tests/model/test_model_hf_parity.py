"""kvfence greedy generation equals Hugging Face ``generate(do_sample=False)`` token for token.

Prompt lengths 15, 16, 17 and 33 with page_size 16 put the prompt's end just before, on and after a
page boundary, and decode crosses the next one. Batch 1 runs each prompt alone; batch 8 runs eight
prompts of mixed lengths in one continuous batch, so rows with different positions and block tables
share every step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.loader import load_model
from kvfence.model.sampling import SamplingParams

# Random checkpoints for the differential tests; `std` is the init range: large enough that top-2
# logit gaps are far above float rounding, so greedy tokens are a property of the weights.
HF_CASES: dict[str, dict[str, Any]] = {
    "llama-gqa2-hd32-untied": dict(
        model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "llama-mqa-hd64-tied-llama3": dict(
        model_type="llama", vocab_size=131, hidden_size=128, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32),
    ),
    "llama-mha-hd32-linear": dict(
        model_type="llama", vocab_size=257, hidden_size=128, intermediate_size=160,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        rope_theta=1000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    "qwen2-gqa4-hd32-tied": dict(
        model_type="qwen2", vocab_size=151, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "qwen2-gqa2-hd64-untied-yarn": dict(
        model_type="qwen2", vocab_size=203, hidden_size=128, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    ),
}  # fmt: skip


def make_hf_checkpoint(directory: Path, case: dict[str, Any], *, std: float = 0.15) -> Any:
    """Save a random HF model for ``case`` to ``directory`` and return it (eval mode)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kw = dict(case)
    model_type = kw.pop("model_type")
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[model_type]
    # No EOS: both sides then generate exactly max_new_tokens without masking any logit.
    config = config_cls(
        max_position_embeddings=kw.pop("max_position_embeddings", 256), initializer_range=std,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw,
    )  # fmt: skip
    torch.manual_seed(sum(map(ord, str(sorted(case.items())))))
    model = model_cls(config).eval()
    with torch.no_grad():  # unit norms everywhere are too regular; jitter them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # zero at init: give Qwen2's q/k/v biases a value
                p.copy_(0.5 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    return model


NEW_TOKENS = 12
BOUNDARY_LENGTHS = (15, 16, 17, 33)
BATCH_LENGTHS = (15, 16, 17, 33, 1, 5, 31, 48)


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(directory, HF_CASES[request.param])
    engine = ColocatedEngine(load_model(directory), page_size=16, num_pages=64)
    return request.param, hf, engine, directory


def prompt(length: int, vocab: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * salt + length)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def hf_greedy(hf: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def assert_same(engine: ColocatedEngine, ids: list[int], ours: list[int], ref: list[int]) -> None:
    if ours == ref:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
    gaps = engine.logit_gaps(ids, ref)
    pytest.fail(
        f"prompt of {len(ids)}: first divergence at token {first} "
        f"(ours {ours[first]}, HF {ref[first]}, HF top-2 gap there {gaps[first]:.2e}); "
        f"ours {ours}, HF {ref}"
    )


def test_batch_1_matches_hf(case: Any) -> None:
    name, hf, engine, _ = case
    vocab = HF_CASES[name]["vocab_size"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for length in BOUNDARY_LENGTHS:
        ids = prompt(length, vocab, salt=1)
        (out,) = engine.generate([GenerationRequest(ids, params)])
        assert out.finish_reason == "length"
        assert_same(engine, ids, out.token_ids, hf_greedy(hf, ids))


def test_batch_8_matches_hf(case: Any) -> None:
    name, hf, engine, _ = case
    vocab = HF_CASES[name]["vocab_size"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [prompt(n, vocab, salt=2) for n in BATCH_LENGTHS]
    outs = engine.generate([GenerationRequest(p, params) for p in prompts])
    assert [len(o.token_ids) for o in outs] == [NEW_TOKENS] * 8
    for ids, out in zip(prompts, outs, strict=True):
        assert_same(engine, ids, out.token_ids, hf_greedy(hf, ids))
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_pages  # every page came back


def test_prefill_logits_match_hf_forward(case: Any) -> None:
    """The control for the token tests: logits themselves agree, not just their argmax."""
    name, hf, engine, _ = case
    ids = prompt(17, HF_CASES[name]["vocab_size"], salt=3)
    pages = engine.pool.allocate(2, "probe")
    assert pages is not None
    try:
        ours = engine.engine.prefill(ids, pages)
    finally:
        engine.pool.release("probe")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_fingerprint_is_stable_and_sensitive(case: Any, tmp_path: Path) -> None:
    _, _, engine, directory = case
    again = load_model(directory)
    assert again.fingerprint == engine.loaded.fingerprint
    assert len(again.fingerprint) == 64
    # Control: the same weights under another theta are another model.
    import json

    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((directory / "config.json").read_text())
    cfg["max_position_embeddings"] = 128
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.safetensors").symlink_to(directory / "model.safetensors")
    assert load_model(other).fingerprint != again.fingerprint


def test_sharded_checkpoint_loads_with_the_same_fingerprint(case: Any, tmp_path: Path) -> None:
    """The shard index path: same weights split over several files are the same model."""
    _, hf, engine, _ = case
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = load_model(tmp_path)
    assert sharded.fingerprint == engine.loaded.fingerprint
    for name, tensor in engine.loaded.model.state_dict().items():
        assert torch.equal(sharded.model.state_dict()[name], tensor), name


def test_a_mistral_sliding_window_caps_the_context_window(tmp_path: Path) -> None:
    """Mistral turns sliding-window attention on by ``sliding_window`` alone. kvfence attends over
    the whole context, the same thing up to the window: the window becomes the context window,
    so a request that would reach past it is refused instead of answered differently. Within
    it, the tokens are HF's (the control)."""
    from control_plane.model_info import load_model_info
    from kvfence.config import parse_config

    window = 24
    hf = make_hf_checkpoint(
        tmp_path,
        dict(
            model_type="mistral", vocab_size=97, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=window,
        ),
    )  # fmt: skip
    loaded = load_model(tmp_path)
    assert loaded.model.args.shape.context_window == window  # not max_position_embeddings 256
    engine = ColocatedEngine(loaded, page_size=16, num_pages=64)
    ids = prompt(window - NEW_TOKENS, 97, salt=7)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [out] = engine.generate([GenerationRequest(ids, params)])
    assert_same(engine, ids, out.token_ids, hf_greedy(hf, ids))
    with pytest.raises(ValueError, match=f"exceeds the context window {window}"):
        engine.generate([GenerationRequest([*ids, 1], params)])
    # what admission enforces, and an operator override past the window is refused
    cfg = {"model": {"path": str(tmp_path)}}
    assert load_model_info(parse_config(cfg, environ={})).context_window == window
    over = {"model": {"path": str(tmp_path), "context_window": window + 1}}
    with pytest.raises(ValueError, match="over the checkpoint's sliding_window 24"):
        load_model_info(parse_config(over, environ={}))


def test_dynamic_rope_is_served_up_to_max_position_embeddings_and_no_further(
    tmp_path: Path,
) -> None:
    """Dynamic NTK rope is the default rotation up to max_position_embeddings and rescales its
    base past it, which kvfence does not: an operator's model.context_window over it gave tokens
    that were not the model's (48 positions of 32: logits 3.4 off HF's, another top token). It is
    refused now. Control: within it, the tokens are HF's, and a window at it is accepted."""
    from control_plane.model_info import load_model_info
    from kvfence.config import parse_config

    hf = make_hf_checkpoint(
        tmp_path,
        dict(
            model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_theta=10000.0, max_position_embeddings=32,
            rope_scaling=dict(rope_type="dynamic", factor=2.0),
        ),
    )  # fmt: skip
    engine = ColocatedEngine(load_model(tmp_path), page_size=16, num_pages=64)
    ids = prompt(32 - NEW_TOKENS, 97, salt=3)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [out] = engine.generate([GenerationRequest(ids, params)])
    assert_same(engine, ids, out.token_ids, hf_greedy(hf, ids))
    at = {"model": {"path": str(tmp_path), "context_window": 32}}
    assert load_model_info(parse_config(at, environ={})).context_window == 32
    over = {"model": {"path": str(tmp_path), "context_window": 48}}
    with pytest.raises(ValueError, match="max_position_embeddings 32 with dynamic rope"):
        load_model_info(parse_config(over, environ={}))


def _hf_from(directory: Path) -> Any:
    """transformers' model as it reads ``directory`` (after a test edited its files)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


def test_rope_scaling_added_to_a_v5_config_is_refused_unless_it_agrees(tmp_path: Path) -> None:
    """transformers 5 saves "rope_parameters"; an operator who then adds a model card's
    "rope_scaling" gets it applied by transformers, which lets rope_scaling win, while kvfence
    read rope_parameters and served other tokens than HF. Disagreeing dicts are refused; the
    control, a rope_scaling that says the same as rope_parameters in the old spelling (type,
    theta from the default), loads and gives HF's tokens."""
    import json

    make_hf_checkpoint(
        tmp_path,
        dict(
            model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rope_theta=10000.0, max_position_embeddings=256,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        ),
    )  # fmt: skip
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in cfg and "rope_theta" not in cfg  # as transformers 5 saves it
    snippet = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

    cfg["rope_scaling"] = {**snippet, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _hf_from(tmp_path).config.rope_parameters["factor"] == 2.0  # HF applies rope_scaling
    with pytest.raises(ValueError, match=r"both 'rope_parameters'.*'rope_scaling'.*keep one"):
        load_model(tmp_path)

    cfg["rope_scaling"] = snippet
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = _hf_from(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.args.rope.rope_type == "yarn"
    engine = ColocatedEngine(loaded, page_size=16, num_pages=16)
    ids = prompt(40, 97, salt=5)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [out] = engine.generate([GenerationRequest(ids, params)])
    assert_same(engine, ids, out.token_ids, hf_greedy(hf, ids))


def test_a_tied_checkpoint_with_another_lm_head_is_refused(tmp_path: Path) -> None:
    """tie_word_embeddings true, and the file also holds an lm_head.weight: transformers 5 serves
    that head when it differs from the embedding, kvfence dropped it and served the embedding.
    Such a file is ambiguous and refused, naming the file and keys. Control: a stored head equal
    to the embedding loads, tied, with HF's tokens."""
    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    make_hf_checkpoint(
        tied,
        dict(
            model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    )  # fmt: skip
    weights = tied / "model.safetensors"
    state = load_file(weights)
    assert "lm_head.weight" not in state  # transformers saves a tied head once
    embed = state["model.embed_tokens.weight"]

    save_file({**state, "lm_head.weight": embed.clone()}, str(weights), metadata={"format": "pt"})
    hf = _hf_from(tied)
    loaded = load_model(tied)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    engine = ColocatedEngine(loaded, page_size=16, num_pages=16)
    ids = prompt(20, 97, salt=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [out] = engine.generate([GenerationRequest(ids, params)])
    assert_same(engine, ids, out.token_ids, hf_greedy(hf, ids))

    other = {**state, "lm_head.weight": torch.randn_like(embed) * 0.3}
    save_file(other, str(weights), metadata={"format": "pt"})
    assert not torch.equal(_hf_from(tied).lm_head.weight, embed)  # HF serves the stored head
    with pytest.raises(
        ValueError, match=r"tie_word_embeddings is true but lm_head\.weight differs"
    ):
        load_model(tied)
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        load_model(tied)
