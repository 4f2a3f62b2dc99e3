"""The embedded default model: a small deterministic Llama checkpoint, so nothing is downloaded.

``TINY_CONFIG`` is its Hugging Face ``config.json``; static checks (``check-config --static``) read
the KV shape from it when the config names no checkpoint.

``python -m kvfence.model.tiny DIR`` runs :func:`ensure_tiny_model` on ``DIR`` and exits (0; 1 with
one line on stderr when it cannot write there): ``kvfence up`` writes a fresh state directory's
model that way before it starts the control plane, so that torch, which writing needs, is loaded
and let go of in a process of its own rather than in the long-lived control plane.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch, safetensors and tokenizers are imported inside the writers: static config checks import
# this module for TINY_CONFIG alone and must stay fast.

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 384,  # 256 byte tokens + specials, room to spare
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
TINY_SEED = 20260829

TINY_DIR_ENV = "KVFENCE_TINY_MODEL_DIR"
_WEIGHTS = "model.safetensors"


def _unrendered(vocab_size: int) -> list[int]:
    """Ids the byte tokenizer cannot render (and <pad>, <s>)."""
    return [0, 1, *range(259, vocab_size)]


def tiny_state_dict(
    config: dict[str, Any] = TINY_CONFIG, seed: int = TINY_SEED
) -> dict[str, torch.Tensor]:
    """The tiny model's weights, a pure function of ``config`` and ``seed`` (by default
    TINY_CONFIG and TINY_SEED; the benchmarks draw larger checkpoints the same way).

    Linear weights are scaled by 1/sqrt(fan_in) so activations stay O(1) through the layers, and
    the LM head by 4/sqrt(hidden) so logits spread over several units: a greedy run then produces
    varied tokens with clear margins instead of near-ties or a single repeated id. Drawn in
    float32 on the CPU generator, so every machine writes the same bytes.
    """
    import torch

    from kvfence.model.llama import ModelArgs, Transformer

    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):  # sorted: the draw order must not depend on module layout
        shape = shapes[name]
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            head = torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[1]))
            # Ids the byte tokenizer cannot render (and <pad>, <s>) rarely win, so text is readable.
            head[_unrendered(shape[0])] *= 0.25
            state[name] = head
        else:
            state[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return {k: v.contiguous() for k, v in state.items()}


def write_tiny_model(
    directory: Path | str, config: dict[str, Any] = TINY_CONFIG, seed: int = TINY_SEED
) -> Path:
    """Write the embedded model (config, weights, tokenizer) to ``directory``; same bytes always.
    ``config`` and ``seed`` draw another random Llama the same way (the byte tokenizer needs a
    vocabulary of at least 259)."""
    from safetensors.torch import save_file

    from kvfence.tokenizer import byte_level_tokenizer_json

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(
        json.dumps(gen_cfg, indent=2, sort_keys=True) + "\n"
    )
    (out / "tokenizer.json").write_text(byte_level_tokenizer_json())
    save_file(tiny_state_dict(config, seed), str(out / _WEIGHTS), metadata={"format": "pt"})
    return out


def default_tiny_dir(config: dict[str, Any] = TINY_CONFIG, seed: int = TINY_SEED) -> Path:
    """Where the services keep the embedded model: $KVFENCE_TINY_MODEL_DIR or the user cache.

    The folder name carries a hash of the config and seed, so changing either never reuses a
    stale copy. The variable names the embedded model's folder only, not another config's.
    """
    embedded = config == TINY_CONFIG and seed == TINY_SEED
    if embedded and os.environ.get(TINY_DIR_ENV):
        return Path(os.environ[TINY_DIR_ENV])
    canonical = json.dumps([config, seed], sort_keys=True, separators=(",", ":"))
    tag = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvfence" / f"{'tiny' if embedded else 'random'}-llama-{tag}"


def tiny_model_complete(directory: Path, config: dict[str, Any] = TINY_CONFIG) -> bool:
    """Whether ``directory`` holds the model of ``config`` whole (file names and config.json
    only: no torch), as :func:`ensure_tiny_model` then finds it and writes nothing."""
    cfg = directory / "config.json"
    names = ("generation_config.json", "tokenizer.json", _WEIGHTS)
    if not cfg.exists() or not all((directory / n).exists() for n in names):
        return False
    try:
        return bool(json.loads(cfg.read_text()) == config)
    except json.JSONDecodeError:
        return False


def ensure_tiny_model(
    directory: Path | str | None = None,
    config: dict[str, Any] = TINY_CONFIG,
    seed: int = TINY_SEED,
) -> Path:
    """The embedded model's folder (or that of another ``config``/``seed`` drawn the same way),
    written first if it is missing or incomplete.

    Safe when several processes start at once: each writes into its own temporary folder and
    renames it into place; a loser of the race discards its copy (the bytes are identical anyway).
    """
    target = Path(directory) if directory is not None else default_tiny_dir(config, seed)
    if tiny_model_complete(target, config):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_tiny_model(tmp, config, seed)
        if target.exists() and not tiny_model_complete(target, config):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not tiny_model_complete(target, config):  # not a lost race but a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    """``python -m kvfence.model.tiny DIR`` (module docstring)."""
    import signal
    import sys

    if len(argv) != 1:
        print("usage: python -m kvfence.model.tiny DIR", file=sys.stderr)
        return 2

    def stop(signum: int, frame: object) -> None:
        # An exit, not death by the signal: ensure_tiny_model's cleanup then removes the
        # half-written temporary folder that `up`, stopped during the write, would leave behind.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        out = ensure_tiny_model(Path(argv[0]))
    except OSError as err:
        why = err.strerror or err
        print(f"cannot write the embedded model to {argv[0]}: {why}", file=sys.stderr)
        return 1
    print(f"embedded model in {out}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
