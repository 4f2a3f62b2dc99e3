"""Factories for model tests: the tiny model, pools and engines on it, random HF checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvfence.model.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dir: Path) -> Any:
    from kvfence.model.loader import load_model

    return load_model(tiny_dir)


@pytest.fixture
def make_pool() -> Callable[..., Any]:
    """make_pool(loaded, num_pages=32, page_size=16) -> a PagePool shaped for ``loaded``."""
    return _make_pool


def _make_pool(loaded: Any, num_pages: int = 32, page_size: int = 16) -> Any:
    from kvfence.kv.pool import PagePool

    s = loaded.shape
    return PagePool(
        num_pages,
        num_layers=s.num_layers,
        page_size=page_size,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        dtype=loaded.dtype,
    )
