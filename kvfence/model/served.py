"""What every process of a cluster agrees on about the served model without loading it: the
checkpoint folder (:func:`model_dir`, :func:`embedded_model_dir`) and the KV layout
(:func:`kv_layout`).

No torch here: the control plane (which never runs the model) and the nodes (``kvfence.node``,
which re-exports both) must resolve the same folder and layout, so they share these functions.
"""

from __future__ import annotations

from pathlib import Path

from kvfence.config import ClusterConfig, ModelShape
from kvfence.proto.kvfence.v1 import common_pb2


def embedded_model_dir(cfg: ClusterConfig) -> Path | None:
    """Where the embedded tiny model lives for ``cfg`` (under its state directory), or None when
    the config names a checkpoint of its own. Resolves the path only; writes nothing."""
    return None if cfg.model.path is not None else _tiny_dir(cfg)


def _tiny_dir(cfg: ClusterConfig) -> Path:
    return cfg.control_plane.state_dir / "models" / "tiny-llama"


def model_dir(cfg: ClusterConfig) -> Path:
    """The checkpoint folder: the configured one, or the embedded tiny model under state_dir.

    The tiny model's weights are written (with torch) the first time a state directory is used,
    by whichever process resolves the folder first; after that this reads file names only.
    ``kvfence up`` writes them before it starts any service (``python -m kvfence.model.tiny``),
    so its control plane never loads torch; a ``kvfence serve control-plane`` started alone on a
    fresh state directory still writes them itself, importing torch to do so."""
    if cfg.model.path is not None:
        return cfg.model.path
    from kvfence.model.tiny import ensure_tiny_model

    return ensure_tiny_model(_tiny_dir(cfg))


def kv_layout(cfg: ClusterConfig, shape: ModelShape) -> common_pb2.KvLayout:
    """The KV layout every node of the cluster must share (manifest check 6, registration)."""
    return common_pb2.KvLayout(
        page_size=cfg.kv.page_size,
        dtype=cfg.model.dtype,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
    )
