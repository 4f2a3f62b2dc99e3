"""Read a Hugging Face checkpoint folder without loading its weights: ``config.json``, the KV
shape, the fingerprints and the EOS ids in force.

The model fingerprint identifies exactly what a node serves: sha256 over the canonical config JSON
and, for every weight in name order, its name, dtype, shape and stored bytes (read from the
safetensors files as bytes, not as tensors). No torch here: the control plane fingerprints the
checkpoint its nodes must serve but never runs it. ``kvfence.model.loader``, which loads the
weights, re-exports these functions.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from kvfence.config import ModelShape
from kvfence.model.args import ModelArgs

_HASH_CHUNK = 1 << 22


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def read_config(path: Path | str) -> dict[str, Any]:
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is not a checkpoint folder: no config.json") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_path} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: top level must be an object")
    return cfg


def read_model_shape(path: Path | str) -> ModelShape:
    """The KV shape of a checkpoint from its config alone (no weights are read)."""
    return ModelArgs.from_hf_config(read_config(path)).shape


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shard index's files, or every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (ValueError, AttributeError) as err:  # not JSON, or JSON but not an object
            raise ValueError(f"{index} is not a valid shard index: {err}") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights")
    return files


def _read_header(f: Any) -> tuple[dict[str, Any], int]:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def fingerprint(path: Path | str) -> str:
    """sha256 hex of the canonical config and every weight's name, dtype, shape and bytes."""
    path = Path(path)
    h = hashlib.sha256(b"kvfence-model-v1\0")
    h.update(canonical_json(read_config(path)))
    entries: list[tuple[str, Path, dict[str, Any], int]] = []
    for file in weight_files(path):
        with file.open("rb") as f:
            header, data_start = _read_header(f)
        entries += [(name, file, info, data_start) for name, info in header.items()]
    names = [e[0] for e in entries]
    if len(names) != len(set(names)):
        raise ValueError(f"{path}: a weight name appears in two shards")
    for name, file, info, data_start in sorted(entries, key=lambda e: e[0]):
        start, end = info["data_offsets"]
        h.update(canonical_json([name, info["dtype"], info["shape"], end - start]))
        with file.open("rb") as f:
            f.seek(data_start + start)
            left = end - start
            while left:
                chunk = f.read(min(left, _HASH_CHUNK))
                if not chunk:
                    raise ValueError(f"{file.name}: weight {name} is truncated")
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def text_fingerprint(path: Path | str, eos_ids: tuple[int, ...]) -> str:
    """sha256 hex of what turns a model's token ids into a tenant's text and ends its
    generations: the EOS ids in force (``generation_config.json`` over ``config.json``) and how
    the tokenizer decodes (:func:`_decoding`). Not in :func:`fingerprint` (the weights): a folder
    whose generation_config.json or tokenizer.json changed keeps its weights, and a decode node
    with other EOS ids than the control plane ended requests the control plane called forged (or
    ran past an EOS it would have cut)."""
    path = Path(path)
    h = hashlib.sha256(b"kvfence-text-v1\0")
    h.update(canonical_json(sorted(set(eos_ids))))
    h.update(_decoding(path / "tokenizer.json"))
    return h.hexdigest()


def _decoding(tokenizer: Path) -> bytes:
    """What decides how ids become text, read from ``tokenizer.json``: the model's vocabulary,
    the added tokens (id, content, special: specials render as nothing) and the decoder, as
    canonical JSON. Not the file's bytes: the same tokenizer written by another ``tokenizers``
    release (which adds default-valued keys such as ``ignore_merges``), re-saved, minified or
    with other line endings must not read as another one, or a control plane and nodes on
    different images, or on copies of a folder, refuse each other. Encoding (normalizer,
    pre-tokenizer, merges) happens on the control plane only."""
    if not tokenizer.exists():
        return b"\0byte-tokenizer"
    raw = tokenizer.read_bytes()
    try:
        spec = json.loads(raw)
        model = spec.get("model") or {}
        added = [
            [int(a["id"]), str(a["content"]), bool(a.get("special", False))]
            for a in spec.get("added_tokens") or []
        ]
        return canonical_json(
            {
                "type": model.get("type"),
                "vocab": model.get("vocab"),
                "added": sorted(added),
                "decoder": spec.get("decoder"),
            }
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return raw  # not a tokenizer this release reads: the services refuse it at load anyway


def generation_eos(path: Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (which overrides config.json, as in transformers)."""
    gen = path / "generation_config.json"
    if not gen.exists():
        return ()
    value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
