"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) without ``transformers``.

The model fingerprint identifies exactly what a node serves: sha256 over the canonical config JSON
and, for every weight in name order, its name, dtype, shape and stored bytes. It does not depend on
how the weights are sharded. Prefill and decode compare fingerprints before any KV crosses between
them, so a node with other weights (or another config) can never feed a request's cache. What needs
no weights in memory (config, shape, fingerprints, EOS ids) is in :mod:`kvfence.model.checkpoint`,
without torch, and importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvfence.config import ModelShape

# Torch-free (the control plane fingerprints the checkpoint); still importable from here.
from kvfence.model.checkpoint import canonical_json as canonical_json
from kvfence.model.checkpoint import fingerprint as fingerprint
from kvfence.model.checkpoint import generation_eos as generation_eos
from kvfence.model.checkpoint import read_config as read_config
from kvfence.model.checkpoint import read_model_shape as read_model_shape
from kvfence.model.checkpoint import text_fingerprint as text_fingerprint
from kvfence.model.checkpoint import weight_files as weight_files
from kvfence.model.llama import ModelArgs, Transformer
from kvfence.model.rope import inv_freq_and_scale

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Buffers some checkpoints carry but the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A checkpoint in memory: its architecture, weights, config and fingerprint."""

    path: Path
    args: ModelArgs
    model: Transformer
    config: dict[str, Any]
    fingerprint: str
    eos_token_ids: tuple[int, ...]
    text_fingerprint: str = ""  # text_fingerprint(): EOS ids and tokenizer

    @property
    def shape(self) -> ModelShape:
        return self.args.shape

    @property
    def dtype(self) -> str:
        return {v: k for k, v in TORCH_DTYPES.items()}[self.model.dtype]


def load_model(
    path: Path | str, *, dtype: str = "float32", device: str | torch.device = "cpu"
) -> LoadedModel:
    """Read config, weights and fingerprint; ValueError if the folder is no usable checkpoint."""
    path = Path(path)
    cfg = read_config(path)
    args = ModelArgs.from_hf_config(cfg)
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    with torch.device("meta"):
        model = Transformer(args)
    state: dict[str, torch.Tensor] = {}
    stored_in: dict[str, Path] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    state[name] = f.get_tensor(name).to(device=device, dtype=TORCH_DTYPES[dtype])
                    stored_in[name] = file
        except SafetensorError as err:  # truncated or otherwise broken: no traceback at start
            raise ValueError(f"{file} is not a readable safetensors file: {err}") from None
    if args.tie_word_embeddings and "lm_head.weight" in state:
        # transformers 5 ties only when the stored head is the embedding; given another head it
        # serves that one. A file that says "tied" and holds two different matrices is
        # ambiguous, so it is refused rather than either matrix guessed.
        head, embed = state.pop("lm_head.weight"), state.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            raise ValueError(
                f"{stored_in['lm_head.weight']}: tie_word_embeddings is true but lm_head.weight "
                "differs from the embedding model.embed_tokens.weight"
            )
    tied = {"lm_head.weight"} if args.tie_word_embeddings else set()
    expected = set(model.state_dict()) - tied
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:  # a weight whose shape disagrees with the config
        raise ValueError(f"{path}: {str(err).splitlines()[-1].strip()}") from None
    # The rope buffer was built on the meta device; recompute it for real.
    inv_freq, _ = inv_freq_and_scale(args.rope, args.head_dim, args.max_position_embeddings)
    model.inv_freq = inv_freq.to(device)
    model.tie_weights()
    model.eval().requires_grad_(False)
    eos = generation_eos(path) or args.eos_token_ids
    return LoadedModel(path, args, model, cfg, fingerprint(path), eos, text_fingerprint(path, eos))
