"""Config keys in README.md and RUNBOOK.md: every one they name exists (in kvfence's config or the
chart's values), and the ones an operator needs where the text points at them are named.

The docs told operators to close decode's UCX port off, and spoke of "a token file" and of the
broker's host, without naming `node.ucx_port` (0 outside the chart: a random port),
`control_plane.admin_token_file` / `node_token_file` or `events.mqtt_port`.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kvfence.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "RUNBOOK.md")
VALUES = yaml.safe_load((ROOT / "helm" / "kvfence" / "values.yaml").read_text())
KEY = re.compile(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`")
FILE_SUFFIXES = (".yaml", ".crt", ".key", ".py", ".json", ".md")
# Where the docs send operators to a setting, the key that sets it.
NEEDED = {
    "node.ucx_port": "decode's UCX port, which must be closed off",
    "node.ucx_host": "the address decode advertises for it",
    "control_plane.admin_token_file": "the admin token file (else generated)",
    "control_plane.node_token_file": "the node token file (else generated)",
    "events.mqtt_host": "the broker",
    "events.mqtt_port": "the broker's port",
}


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside ``annotation`` (``X | None`` included), else the annotation."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        models = [a for a in typing.get_args(annotation) if isinstance(a, type)]
        models = [a for a in models if issubclass(a, BaseModel)]
        return models[0] if models else annotation
    return annotation


def in_config(parts: list[str]) -> bool:
    model: Any = ClusterConfig
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return False
        if part not in model.model_fields:
            return False
        model = _model_of(model.model_fields[part].annotation)
    return True


def in_values(parts: list[str]) -> bool:
    node: Any = VALUES
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def named_keys(text: str) -> set[str]:
    """The backticked dotted keys under a config section or a top-level values key."""
    sections = set(ClusterConfig.model_fields) | set(VALUES)
    return {
        k
        for k in KEY.findall(text)
        if k.split(".")[0] in sections and not k.endswith(FILE_SUFFIXES)
    }


def test_every_key_the_docs_name_exists() -> None:
    named = set().union(*(named_keys(p.read_text()) for p in DOCS))
    assert len(named) > 50  # a reader that found none would pass anything
    unknown = sorted(
        k for k in named if not in_config(k.split(".")) and not in_values(k.split("."))
    )
    assert unknown == []


def test_the_keys_operators_are_pointed_at_are_named() -> None:
    named = set().union(*(named_keys(p.read_text()) for p in DOCS))
    for key in NEEDED:
        assert in_config(key.split(".")), key
    assert sorted(set(NEEDED) - named) == []


def test_the_key_reader_tells_real_keys_from_typos() -> None:
    """Control: nested config keys and values keys resolve; a misspelt one does not."""
    assert in_config(["kv", "decode_pool", "num_pages"])
    assert in_config(["control_plane", "node_token_file"])
    assert not in_config(["node", "ucx_prot"])
    assert in_values(["decode", "ports", "ucx"])
    assert not in_values(["decode", "ports", "ucxx"])
    assert named_keys("`node.ucx_port`, `events.yaml`, `foo.bar`, node.listen") == {"node.ucx_port"}
