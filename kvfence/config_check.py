"""Pre-launch check: does every KV pool hold the model's whole context window?

The incident this guards against: a model served with a 1,048,576-token context window on prefill
pools that held 681,280 tokens, and nobody compared the two before launch. Admission limits requests
to ``min(context window, every pool's tokens)``; this check makes the gap visible before the cluster
starts and fails unless the operator clamps the context on purpose (``model.clamp_context``).

Two sources feed the same report:

- :func:`static_check` reads only the config file (pool sizes as configured), for CI and the Helm
  pre-install hook;
- the live check (``check-config --target``) asks the running nodes for their pools and passes what
  they report to :func:`evaluate` as :class:`PoolSample` values, one per node.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfence.config import ClusterConfig, ConfigError, ModelShape, Role


@dataclass(frozen=True)
class PoolSample:
    """One pool's size as configured (static) or as a node reports it (live)."""

    role: Role
    pages: int
    node_id: str = ""  # empty = every node of this role (static check)


@dataclass(frozen=True)
class PoolCheck:
    """The verdict on one pool; ``message`` carries the numbers it was decided on."""

    role: str
    node_id: str
    pages: int
    tokens: int
    ok: bool
    message: str


@dataclass(frozen=True)
class CheckReport:
    """Result of a config check; rendered as a table or JSON by ``kvfence check-config``."""

    source: str  # config file (static) or target address (live)
    model: str
    shape_source: str  # where num_layers / kv_heads / head_dim came from
    context_window: int
    context_source: str
    dtype: str
    page_size: int
    page_bytes: int
    clamp_context: bool
    pools: tuple[PoolCheck, ...]
    admissible_limit: int  # min(context window, every pool's tokens)
    ok: bool
    summary: str

    @property
    def clamped(self) -> bool:
        """True when admission will refuse some prompts the model's context window would allow."""
        return self.admissible_limit < self.context_window

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pools"] = [asdict(p) for p in self.pools]
        out["clamped"] = self.clamped
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def static_check(cfg: ClusterConfig, source: str = "<config>") -> CheckReport:
    """Check the pools as configured in ``cfg`` against its model's context window."""
    shape, shape_source = resolve_shape(cfg)
    if cfg.model.context_window is not None:
        context_window, context_source = cfg.model.context_window, "model.context_window"
    else:
        context_window, context_source = shape.context_window, shape_source
    page_bytes = cfg.page_bytes(shape)
    samples = [
        PoolSample(role, cfg.pool_for(role).pages_for(page_bytes))
        for role in (Role.PREFILL, Role.DECODE)
    ]
    return evaluate(
        source=source,
        model=cfg.model.name,
        shape_source=shape_source,
        context_window=context_window,
        context_source=context_source,
        dtype=cfg.model.dtype,
        page_size=cfg.kv.page_size,
        page_bytes=page_bytes,
        clamp_context=cfg.model.clamp_context,
        pools=samples,
    )


def evaluate(
    *,
    source: str,
    model: str,
    shape_source: str,
    context_window: int,
    context_source: str,
    dtype: str,
    page_size: int,
    page_bytes: int,
    clamp_context: bool,
    pools: Sequence[PoolSample],
) -> CheckReport:
    """Judge every pool against the context window; shared by the static and the live check."""
    if not pools:
        raise ValueError("a config check needs at least one pool")
    checks = tuple(_check_pool(p, page_size, context_window, clamp_context) for p in pools)
    limit = min(context_window, *(c.tokens for c in checks))
    ok = all(c.ok for c in checks)
    return CheckReport(
        source=source,
        model=model,
        shape_source=shape_source,
        context_window=context_window,
        context_source=context_source,
        dtype=dtype,
        page_size=page_size,
        page_bytes=page_bytes,
        clamp_context=clamp_context,
        pools=checks,
        admissible_limit=limit,
        ok=ok,
        summary=_summary(ok, limit, context_window, checks),
    )


def _check_pool(
    sample: PoolSample, page_size: int, context_window: int, clamp_context: bool
) -> PoolCheck:
    tokens = sample.pages * page_size
    name = f"{sample.role} pool" + (f" on {sample.node_id}" if sample.node_id else "")
    held = f"{name} holds {tokens} tokens ({sample.pages} pages x {page_size})"
    if sample.pages <= 0:
        ok, message = False, f"{name} has 0 pages: it cannot hold a single token"
    elif tokens >= context_window:
        ok, message = True, f"{held} >= context window {context_window}"
    elif clamp_context:
        ok = True
        message = (
            f"{held} < context window {context_window}; clamped: admission refuses requests over "
            f"{tokens} tokens (model.clamp_context is true)"
        )
    else:
        ok = False
        message = (
            f"{held} < context window {context_window}: prompts of {tokens + 1} to "
            f"{context_window} tokens cannot fit; enlarge the pool, lower model.context_window, "
            "or set model.clamp_context: true to refuse them on purpose"
        )
    return PoolCheck(str(sample.role), sample.node_id, sample.pages, tokens, ok, message)


def _summary(ok: bool, limit: int, context_window: int, checks: Sequence[PoolCheck]) -> str:
    failed = sum(not c.ok for c in checks)
    if not ok:
        return f"FAIL: {failed} of {len(checks)} pools cannot serve the context window"
    if limit < context_window:
        return f"OK (clamped): admissible limit {limit} tokens < context window {context_window}"
    return f"OK: admissible limit {limit} tokens = context window {context_window}"


def resolve_shape(cfg: ClusterConfig) -> tuple[ModelShape, str]:
    """The model's KV shape and its origin: the config, the checkpoint, or the tiny model."""
    if cfg.model.shape is not None:
        return cfg.model.shape, "model.shape"
    if cfg.model.path is None:
        from kvfence.model.tiny import TINY_CONFIG

        return shape_from_hf_config(TINY_CONFIG, "embedded tiny model"), "embedded tiny model"
    config_json = Path(cfg.model.path) / "config.json"
    try:
        hf_config = json.loads(config_json.read_text())
    except OSError as err:
        raise ConfigError(
            f"cannot read {config_json} for the model shape: {err.strerror}; "
            "give model.shape in the config when the checkpoint is not at hand"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config_json} is not valid JSON: {err}") from None
    return shape_from_hf_config(hf_config, str(config_json)), str(config_json)


def mistral_sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window of a Mistral ``config.json`` when it is below the context (Mistral
    enables it by ``sliding_window`` alone; Mistral-7B-v0.1: 4096 of 32768), else None."""
    if str(cfg.get("model_type", "llama")) != "mistral" or cfg.get("sliding_window") is None:
        return None
    window = int(cfg["sliding_window"])
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return window if window < int(cfg.get("max_position_embeddings", 2048)) else None


def shape_from_hf_config(hf_config: dict[str, Any], origin: str) -> ModelShape:
    """The KV shape from a Hugging Face ``config.json`` mapping."""
    # Multimodal checkpoints nest the language model's settings under text_config.
    if "num_hidden_layers" not in hf_config and isinstance(hf_config.get("text_config"), dict):
        hf_config = hf_config["text_config"]
    try:
        layers = int(hf_config["num_hidden_layers"])
        heads = int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
        context = int(hf_config["max_position_embeddings"])
        # what is served: a Mistral sliding window caps the context (kvfence.model.llama)
        context = min(context, mistral_sliding_window(hf_config) or context)
        return ModelShape(
            num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, context_window=context
        )
    except KeyError as err:
        raise ConfigError(f"{origin}: missing {err.args[0]} (needed for the KV shape)") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:
        raise ConfigError(f"{origin}: unusable model shape: {err}") from None
