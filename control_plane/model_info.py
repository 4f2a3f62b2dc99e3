"""What the control plane needs to know about the served model, behind one small type.

The control plane never runs the model; it needs the name, context window, fingerprint and KV layout
(to admit requests and vet nodes) and the tokenizer (to count prompt tokens and detokenize). Tests
inject a :class:`ModelInfo` of their own; services call :func:`load_model_info`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfence.config import ClusterConfig
from kvfence.model.args import ModelArgs
from kvfence.model.checkpoint import fingerprint, generation_eos, read_config, text_fingerprint
from kvfence.model.served import kv_layout, model_dir
from kvfence.proto.kvfence.v1 import common_pb2
from kvfence.tokenizer import load_tokenizer


class Tokenizer(Protocol):
    # kvfence.tokenizer.Tokenizer's bound: UTF-8 bytes of text one token can stand for, or None.
    max_text_bytes_per_token: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: token ``offset + b`` is byte ``b``; lower ids are specials."""

    max_text_bytes_per_token: int | None = 1

    def __init__(self, offset: int = 3):
        self.offset = offset

    def encode(self, text: str) -> list[int]:
        return [self.offset + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        raw = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return raw.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the control plane sees it."""

    name: str
    context_window: int
    fingerprint: str
    layout: common_pb2.KvLayout
    vocab_size: int
    tokenizer: Tokenizer
    eos_ids: frozenset[int] = frozenset()
    # kvfence.model.checkpoint.text_fingerprint of the EOS ids and tokenizer above ("": not
    # compared)
    text_fingerprint: str = ""

    @property
    def page_size(self) -> int:
        return int(self.layout.page_size)


def layout_text(layout: common_pb2.KvLayout) -> str:
    """A one-line rendering of a layout for messages that compare two of them."""
    return (
        f"page_size={layout.page_size} dtype={layout.dtype} layers={layout.num_layers} "
        f"kv_heads={layout.num_kv_heads} head_dim={layout.head_dim}"
    )


def load_model_info(cfg: ClusterConfig) -> ModelInfo:
    """The served model as the nodes see it: same folder, fingerprint, layout and tokenizer.

    Reads the checkpoint the nodes load (``kvfence.model.served.model_dir``: the configured path
    or the embedded tiny model), so a node serving other weights is refused at registration. The
    weights are read as bytes for the fingerprint, never loaded, so torch is not imported
    (``tests/control_plane/test_cp_no_torch.py``). Under ``kvfence up`` the embedded model's files
    are in place before the control plane starts (``up`` writes them first), so it never imports
    torch; a ``kvfence serve control-plane`` started alone on a state directory without them
    imports it once, to write them (``ensure_tiny_model``).
    """
    path = model_dir(cfg)
    hf = read_config(path)
    args = ModelArgs.from_hf_config(hf)
    shape = args.shape
    layout = kv_layout(cfg, shape)
    window = args.sliding_window
    if window is not None and (cfg.model.context_window or 0) > window:
        raise ValueError(
            f"model.context_window {cfg.model.context_window} is over the checkpoint's "
            f"sliding_window {window}: kvfence attends over the whole context, which gives the "
            f"model's outputs only up to its window"
        )
    if args.rope.rope_type == "dynamic" and (cfg.model.context_window or 0) > (
        args.max_position_embeddings
    ):
        raise ValueError(
            f"model.context_window {cfg.model.context_window} is over the checkpoint's "
            f"max_position_embeddings {args.max_position_embeddings} with dynamic rope scaling: "
            "past it the model rescales its rotary base by the sequence length, which kvfence "
            "does not, so the outputs would not be the model's"
        )
    eos = generation_eos(path) or args.eos_token_ids  # as the nodes' load_model resolves it
    return ModelInfo(
        name=cfg.model.name,
        context_window=cfg.model.context_window or shape.context_window,
        fingerprint=fingerprint(path),
        layout=layout,
        vocab_size=args.vocab_size,
        tokenizer=load_tokenizer(path),
        eos_ids=frozenset(eos),
        text_fingerprint=text_fingerprint(path, eos),
    )


@dataclass
class ModelAccess:
    """The operator's switch: offline turns new and queued requests into UNAVAILABLE.

    The control plane keeps it in its state database (``model_access``), so it survives restarts.
    """

    online: bool = True
    reason: str = ""
    since: str = ""  # UTC (tenants.UTC_FORMAT) it went online or offline; "" = never switched
