"""What the alert rules' per-release grouping takes from the chart: releases in one namespace
scraped under a `job` each.

Every rule of files/kvfence-alerts.yaml groups by (namespace, job) so that two releases in one
namespace neither hide each other's trouble nor merge their alerts (test_alert_behaviour.py runs
the two-release cases). Under the Prometheus Operator a PodMonitor without `jobLabel` labels its
targets job="<its namespace>/<its name>", so that holds while each release has its own
PodMonitor, named for the release, with no `jobLabel`, selecting only that release's pods (a pod
two PodMonitors select is scraped under both jobs, and counts in both releases).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_helm_chart import CHART, helm

NAMESPACE = "inference"
MONITORING = ("monitoring.podMonitor.enabled=true", "monitoring.prometheusRule.enabled=true")
RULES = CHART / "files" / "kvfence-alerts.yaml"


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-alerts-per-release")


def release(home: Path, name: str) -> list[dict]:
    args = ["template", name, str(CHART), "--namespace", NAMESPACE]
    for s in MONITORING:
        args += ["--set", s]
    proc = helm(*args, tmp=home)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def job_of(monitor: dict) -> str:
    """The `job` label the Prometheus Operator gives a PodMonitor's targets."""
    assert "jobLabel" not in monitor["spec"], monitor["spec"]["jobLabel"]
    return f"{NAMESPACE}/{monitor['metadata']['name']}"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_two_releases_in_one_namespace_are_scraped_under_a_job_each(helm_home: Path) -> None:
    docs = {name: release(helm_home, name) for name in ("qwen", "llama")}
    monitors = {}
    for name, objs in docs.items():
        (monitor,) = [d for d in objs if d["kind"] == "PodMonitor"]
        monitors[name] = monitor
    jobs = {name: job_of(m) for name, m in monitors.items()}
    assert jobs == {"qwen": "inference/qwen-kvfence", "llama": "inference/llama-kvfence"}
    # each PodMonitor selects its own release's kvfence pods, and none of the other's
    pods = {
        name: [
            d["spec"]["template"]["metadata"]["labels"]
            for d in objs
            if d["kind"] == "Deployment"
            and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
            in ("control-plane", "prefill", "decode")
        ]
        for name, objs in docs.items()
    }
    for name, monitor in monitors.items():
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        for other, labels in pods.items():
            picked = [selects(monitor["spec"]["selector"], pod) for pod in labels]
            assert len(picked) == 3
            assert all(picked) if other == name else not any(picked), (name, other)


def test_every_rule_over_kvfence_series_groups_by_job() -> None:
    """Every aggregation and vector match of a rule over kvfence's own series keeps `job` (an
    aggregation without it is what hid one release's trouble behind another's)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            if "kube_cronjob" in expr:  # kube-state-metrics' series: per CronJob, each release's
                continue
            groupings = re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
            if rule["alert"] == "KvfenceTargetDown":  # per target: no aggregation at all
                assert groupings == [], expr
                continue
            assert groupings, rule["alert"]
            for labels in groupings:
                assert "job" in [s.strip() for s in labels.split(",")], (rule["alert"], labels)
