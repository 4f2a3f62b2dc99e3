"""The alert rules (helm/kvfence/files/kvfence-alerts.yaml) against the code and the runbook.

A rule that names a metric or label value the services never expose is silent forever, which is
worse than no rule: these tests parse every expression (promql-parser) and check each selector's
metric, labels and literal label values against kvfence's own metrics and status vocabularies,
and check that every alert has its RUNBOOK.md section and every section its alert.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import promql_parser
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "control_plane"))
from cp_fakes import EventRecorder, make_model_info
from cp_harness import make_cfg

from control_plane import admission
from control_plane.service import ControlPlane
from kvfence.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm" / "kvfence" / "files" / "kvfence-alerts.yaml"
RUNBOOK = ROOT / "RUNBOOK.md"

# Labels Prometheus or the chart's PodMonitor attach to every target, not the services.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "kvfence_component"}
# Series of others that a rule may use, with their labels: kube-state-metrics' CronJob metrics
# (the chart's scheduled tenant backup).
EXTERNAL_SERIES = {
    "kube_cronjob_status_last_successful_time": {"cronjob"},
    "kube_cronjob_created": {"cronjob"},
}
SERVICES = {"control-plane", "prefill", "decode"}
# Literal values a selector may ask of a label, per label: what the code can emit.
KNOWN_VALUES: dict[str, set[str]] = {
    "service": SERVICES,
    "status": {c.name for c in grpc.StatusCode},
    "reason": {
        v for k, v in vars(admission).items() if k.isupper() and isinstance(v, str) and k == v
    },
    "state": {"free", "held", "quarantined"},
    "role": {"prefill", "decode"},
}


def load_rules(text: str | None = None) -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text() if text is None else text)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def exposed_series() -> dict[str, set[str]]:
    """Every series name the services can expose, with the labels it carries."""
    families = list(Metrics("decode")._inner.collect())
    series: dict[str, set[str]] = {}
    for fam in families:
        labels = set(_declared_labels(fam.name)) | {"service"}
        if fam.type == "counter":
            series[fam.name + "_total"] = labels
        elif fam.type == "histogram":
            series[fam.name + "_bucket"] = labels | {"le"}
            series[fam.name + "_sum"] = labels
            series[fam.name + "_count"] = labels
        else:
            series[fam.name] = labels
    return series


def _declared_labels(family: str) -> tuple[str, ...]:
    m = Metrics("decode")
    for attr in vars(m).values():
        describe = getattr(attr, "describe", None)
        if describe is not None and any(f.name == family for f in describe()):
            return tuple(attr._labelnames)
    raise AssertionError(f"no metric object for family {family}")


def selectors(node: Any) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, op, value)]) of every vector selector in a parsed expression."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        matchers = [(m.name, str(m.op), m.value) for m in node.matchers.matchers]
        return [(node.name or "", matchers)]
    if kind == "MatrixSelector":
        return selectors(node.vector_selector)
    if kind == "BinaryExpr":
        return selectors(node.lhs) + selectors(node.rhs)
    if kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        return selectors(node.expr)
    if kind == "Call":
        return [s for arg in node.args for s in selectors(arg)]
    if kind in ("NumberLiteral", "StringLiteral"):
        return []
    raise AssertionError(f"unhandled PromQL node {kind}")


def problems(rules: list[dict[str, Any]]) -> list[str]:
    """What is wrong with ``rules`` against the code; [] when nothing is."""
    series = {**exposed_series(), **EXTERNAL_SERIES}
    out: list[str] = []
    for rule in rules:
        name = rule["alert"]
        try:
            expr = promql_parser.parse(rule["expr"])
        except ValueError as e:
            out.append(f"{name}: does not parse: {e}")
            continue
        for metric, matchers in selectors(expr):
            if metric == "up":
                continue
            if metric not in series:
                out.append(f"{name}: no service exposes {metric}")
                continue
            for label, op, value in matchers:
                if label not in series[metric] | TARGET_LABELS:
                    out.append(f"{name}: {metric} has no label {label}")
                allowed = KNOWN_VALUES.get(label)
                if allowed is None or not value:
                    continue
                values = value.split("|") if "Re" in op else [value]
                for v in values:
                    if v not in allowed:
                        out.append(f"{name}: {label}={v!r} is never emitted")
    return out


def test_every_rule_parses_and_names_what_the_services_expose() -> None:
    rules = load_rules()
    assert len(rules) >= 8
    assert problems(rules) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("kvfence_integrity_failures_total", "kvfence_integrity_failure_total", "no service"),
        ('status=~"INTERNAL|', 'status=~"INTERNAL_ERROR|', "is never emitted"),
        ('reason=~"NO_CAPACITY|', 'reason=~"NO_CAPACITIES|', "is never emitted"),
        ('kvfence_pages{state="quarantined"}', 'kvfence_pages{phase="quarantined"}', "no label"),
        ("(kvfence_events_dropped_total[15m])", "(kvfence_events_dropped_total[15m]", "parse"),
    ],
    ids=["metric", "status", "reason", "label", "syntax"],
)
def test_a_broken_rule_is_caught(old: str, new: str, expected: str) -> None:
    text = RULES.read_text()
    assert old in text
    found = problems(load_rules(text.replace(old, new, 1)))
    assert found and all(expected in p for p in found), found


def _walk(node: Any) -> list[Any]:
    """Every node of a parsed expression, ``node`` first."""
    kind = type(node).__name__
    if kind == "BinaryExpr":
        children = [node.lhs, node.rhs]
    elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        children = [node.expr]
    elif kind == "Call":
        children = list(node.args)
    elif kind == "MatrixSelector":
        children = [node.vector_selector]
    else:
        children = []
    return [node, *(n for child in children for n in _walk(child))]


def born_at_zero() -> set[str]:
    """Counters with labels of their own that a service exports from its start (at 0): a node's,
    and a control plane's own (``stalled_seconds_total{model}``, made as it is constructed)."""
    with tempfile.TemporaryDirectory() as state:
        cp = ControlPlane(
            make_cfg(Path(state)), model_info=make_model_info(), events=EventRecorder()
        )
        try:
            families = [*Metrics("decode")._inner.collect(), *cp.metrics.registry.collect()]
        finally:
            cp.tenants.close()
    return {f.name + "_total" for f in families if f.type == "counter" and f.samples}


def missed_first_increments(rules: list[dict[str, Any]]) -> list[str]:
    """Rules that fire on ``increase(C[R])`` of a counter C with labels of its own but cannot see
    C's first increment: such a series that does not exist until then is born at 1, and
    ``increase()`` reads a series born non-zero as no increase. C must be exported at 0 from the
    start (kvfence.errors.INTEGRITY_CHECKS for the integrity checks)."""
    series, exported = exposed_series(), born_at_zero()
    out = []
    for rule in rules:
        for n in _walk(promql_parser.parse(rule["expr"])):
            if type(n).__name__ != "Call" or n.func.name != "increase":
                continue
            (matrix,) = n.args
            metric = matrix.vector_selector.name
            if series[metric] - {"service"} and metric not in exported:
                out.append(f"{rule['alert']}: the first increment of {metric} is missed")
    return out


def test_a_counters_first_increment_alerts() -> None:
    """KvfenceIntegrityCheckFailed must fire for one forged manifest on a pod: a runbook
    walkthrough saw ``kvfence_integrity_failures_total{check="MAC"}`` appear at 1, which
    ``increase()`` alone reads as 0."""
    rules = load_rules()
    assert "kvfence_integrity_failures_total" in born_at_zero()
    assert missed_first_increments(rules) == []
    # control: the same rule on a labelled counter born at its first increment is caught
    (integrity,) = [r for r in rules if r["alert"] == "KvfenceIntegrityCheckFailed"]
    born_late = integrity["expr"].replace(
        "kvfence_integrity_failures_total", "kvfence_admission_rejections_total"
    )
    assert missed_first_increments([{**integrity, "expr": born_late}]) == [
        "KvfenceIntegrityCheckFailed: the first increment of kvfence_admission_rejections_total "
        "is missed"
    ]


def test_every_alert_has_a_runbook_section_and_every_section_an_alert() -> None:
    rules = load_rules()
    sections = set(re.findall(r"^## (Kvfence\w+)$", RUNBOOK.read_text(), re.M))
    alerts = {r["alert"] for r in rules}
    assert alerts == sections
    for rule in rules:
        assert rule["annotations"]["runbook"] == f"RUNBOOK.md#{rule['alert'].lower()}"
        assert rule["labels"]["severity"] in {"critical", "warning"}
