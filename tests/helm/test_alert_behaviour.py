"""The alert rules' behaviour: ``promtool test rules`` on synthetic series.

test_alert_rules.py checks that the rules name what the services expose; this checks what the
rules do with it: alert_rules_test.yaml and alert_rules_backup_test.yaml feed each alert series
(with the labels Prometheus and the chart's PodMonitor attach) and say when it must fire, with
which labels and annotations, and when it must not. Expressions these cases showed wrong are
kept below: the cases must still catch them.

promtool comes from ``.tools/bin/promtool`` (``make promtool`` installs it, from Debian's
``prometheus`` package); a missing binary fails these tests.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = ROOT / ".tools" / "bin" / "promtool"
RULES = ROOT / "helm" / "kvfence" / "files" / "kvfence-alerts.yaml"
CASES = Path(__file__).with_name("alert_rules_test.yaml")
BACKUP_CASES = Path(__file__).with_name("alert_rules_backup_test.yaml")
RULE_FILES_ENTRY = "../../helm/kvfence/files/kvfence-alerts.yaml"  # as the case files name RULES


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL.is_file() and os.access(PROMTOOL, os.X_OK), (
        f"no promtool at {PROMTOOL}: run `make promtool`"
    )
    return subprocess.run(
        [str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, check=False
    )


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"promtool exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def alerts() -> set[str]:
    doc = yaml.safe_load(RULES.read_text())
    return {rule["alert"] for group in doc["groups"] for rule in group["rules"]}


def test_promtool_is_installed() -> None:
    proc = promtool("--version")
    assert proc.returncode == 0 and "promtool, version" in proc.stdout, output(proc)


def test_the_rule_file_passes_promtool_check() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, output(proc)


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_must_not() -> None:
    """In one test group (the same series, evaluated at several times) for each alert."""
    paired: set[str] = set()
    named: set[str] = set()
    for path in (CASES, BACKUP_CASES):
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == [RULE_FILES_ENTRY], path
        for group in doc["tests"]:
            fires: set[str] = set()
            silent: set[str] = set()
            for case in group.get("alert_rule_test", []):
                named.add(case["alertname"])
                (fires if case.get("exp_alerts") else silent).add(case["alertname"])
            paired |= fires & silent
    assert named <= alerts(), named - alerts()
    assert paired == alerts(), f"no case that fires and one that must not: {alerts() - paired}"


def test_the_alerts_behave_as_the_cases_say() -> None:
    proc = promtool("test", "rules", str(CASES), str(BACKUP_CASES))
    assert proc.returncode == 0, output(proc)


# Expressions the cases showed wrong, with the evaluations of alert_rules_test.yaml they fail.
OLD_EXPRESSIONS: dict[str, tuple[str, str, set[str]]] = {
    # increase() reads a series born at 1 (a failure before the pod's first scrape), a pod gone
    # after one scrape, and a step hidden by a scrape gap as no increase.
    "integrity-increase-only": (
        "KvfenceIntegrityCheckFailed",
        "sum by (namespace, job, service, check) (increase(kvfence_integrity_failures_total[10m]))"
        " > 0",
        {"22m", "30m", "3m", "11m", "52m"},
    ),
    # An instant `counter > 0 unless counter offset 10m`: misses the pod whose one sample is
    # stale before a rule evaluation sees it, and fires again on an old failure after a gap.
    "integrity-instant-unless-offset": (
        "KvfenceIntegrityCheckFailed",
        "sum by (namespace, job, service, check) (increase(kvfence_integrity_failures_total[10m]))"
        " > 0 or sum by (namespace, job, service, check) (kvfence_integrity_failures_total > 0"
        " unless kvfence_integrity_failures_total offset 10m)",
        {"3m", "11m", "52m"},
    ),
    "events-increase-only": (
        "KvfenceEventsDropped",
        "sum by (namespace, job, service) (increase(kvfence_events_dropped_total[15m])) > 0",
        {"22m"},
    ),
    # The replaced control plane's last value (offline) outvoted its successor's (online) for
    # the 10 min of last_over_time.
    "model-offline-last-over-time": (
        "KvfenceModelOffline",
        "time() - max by (namespace, job, model) (last_over_time("
        'kvfence_model_offline_since_timestamp_seconds{service="control-plane"}[10m]) > 0'
        ") > 1800",
        {"43m", "49m"},
    ),
    # Fired at a new pod's first non-zero samples, and for 30 min after a pod was deleted.
    "pages-min-over-time-only": (
        "KvfencePagesQuarantined",
        "min by (namespace, job, pod, service) ("
        'min_over_time(kvfence_pages{state="quarantined"}[30m])) > 0',
        {"21m", "24m", "53m", "1h10m"},
    ),
    # Every request counted in the ratio, refused logins too: a flood of junk keys diluted real
    # requests all failing to under 5%.
    "requests-failing-logins-in-denominator": (
        "KvfenceRequestsFailing",
        'sum by (namespace, job) (rate(kvfence_requests_total{service="control-plane",'
        'status=~"INTERNAL|DATA_LOSS|UNAVAILABLE|DEADLINE_EXCEEDED|UNKNOWN"}[5m]))'
        ' / sum by (namespace, job) (rate(kvfence_requests_total{service="control-plane"}[5m]))'
        " > 0.05 and on (namespace, job) max by (namespace, job)"
        ' (kvfence_model_online{service="control-plane"}) == 1',
        {"25m"},
    ),
    # Only UNAUTHENTICATED left out: tenant keys refused PERMISSION_DENIED still diluted it.
    "requests-failing-permission-denied-in-denominator": (
        "KvfenceRequestsFailing",
        'sum by (namespace, job) (rate(kvfence_requests_total{service="control-plane",'
        'status=~"INTERNAL|DATA_LOSS|UNAVAILABLE|DEADLINE_EXCEEDED|UNKNOWN"}[5m]))'
        ' / sum by (namespace, job) (rate(kvfence_requests_total{service="control-plane",'
        'status!="UNAUTHENTICATED"}[5m]))'
        " > 0.05 and on (namespace, job) max by (namespace, job)"
        ' (kvfence_model_online{service="control-plane"}) == 1',
        {"25m"},
    ),
}


def with_expr(alert: str, expr: str) -> dict[str, Any]:
    doc = yaml.safe_load(RULES.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"] if rule["alert"] == alert]
    assert len(rules) == 1, alert
    assert " ".join(rules[0]["expr"].split()) != " ".join(expr.split()), "the rule is still this"
    rules[0]["expr"] = expr
    return doc


@pytest.mark.parametrize("name", sorted(OLD_EXPRESSIONS))
def test_the_cases_catch_an_old_expression(name: str, tmp_path: Path) -> None:
    alert, expr, failing = OLD_EXPRESSIONS[name]
    rules = tmp_path / "kvfence-alerts.yaml"
    rules.write_text(yaml.safe_dump(with_expr(alert, expr), sort_keys=False))
    text = CASES.read_text()
    assert RULE_FILES_ENTRY in text
    cases = tmp_path / "cases.yaml"
    cases.write_text(text.replace(RULE_FILES_ENTRY, str(rules)))
    proc = promtool("test", "rules", str(cases))
    assert proc.returncode != 0, output(proc)
    found = re.findall(r"alertname: (\w+), time: (\w+),", proc.stdout + proc.stderr)
    assert found, output(proc)
    assert {a for a, _ in found} == {alert}, output(proc)
    assert {t for _, t in found} == failing, output(proc)


# Grouped by namespace alone (the rules before they grouped by job too), two releases in one
# namespace masked each other: one with no decode node, or all its requests failing, went unseen
# beside a healthy one; two serving one model name with their own limits read as a drop; and an
# alert named no release. The evaluations of the two-release cases such rules fail; every other
# case (one release) they pass, which shows those cases test the rest of each rule, not this.
NAMESPACE_ONLY_FAILS = {
    ("KvfenceNoNodes", "14m"),  # qwen's lost decode nodes hidden by llama's
    ("KvfenceRequestsFailing", "30m"),  # qwen's 100% diluted to 3%; llama's 9% + qwen's offline
    ("KvfenceAdmissibleLimitDropped", "1h30m"),  # two releases' own limits read as a drop
    ("KvfenceModelOffline", "40m"),  # the later switch's time hid the earlier's
    ("KvfenceModelOffline", "55m"),
    ("KvfenceIntegrityCheckFailed", "21m"),  # two releases' failures summed into one alert
    ("KvfenceEventsDropped", "21m"),
    ("KvfenceOutOfCapacity", "20m"),  # 3 min in one release, 10 in the other: 15 in the namespace
    ("KvfenceTransfersSlow", "20m"),  # qwen's slow transfers lost among llama's fast ones
}


def test_the_two_release_cases_catch_rules_grouped_by_namespace_alone(tmp_path: Path) -> None:
    doc = yaml.safe_load(RULES.read_text())
    grouped = set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            by_namespace = rule["expr"].replace("(namespace, job", "(namespace")
            if by_namespace != rule["expr"]:
                grouped.add(rule["alert"])
            # what the rules were: `job` nowhere else in an expression
            assert not re.search(r"\bjob\b", by_namespace), rule["alert"]
            rule["expr"] = by_namespace
    # every rule over kvfence's own series, not KvfenceTargetDown (per target: `job` is among
    # its labels as it is) nor KvfenceTenantBackupStale (per CronJob, each release's own)
    assert grouped == alerts() - {"KvfenceTargetDown", "KvfenceTenantBackupStale"}, grouped
    rules = tmp_path / "kvfence-alerts.yaml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False))
    # The cases as such rules would have them: no `job` label, an empty one in the summary.
    cases = yaml.safe_load(CASES.read_text())
    cases["rule_files"] = [str(rules)]
    for group in cases["tests"]:
        for case in group.get("alert_rule_test", []):
            if case["alertname"] not in grouped:
                continue
            for alert in case.get("exp_alerts") or []:
                job = alert["exp_labels"].pop("job")
                alert["exp_annotations"] = {
                    k: v.replace(job, "") for k, v in alert["exp_annotations"].items()
                }
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump(cases, sort_keys=False))
    proc = promtool("test", "rules", str(path))
    assert proc.returncode != 0, output(proc)
    found = re.findall(r"name: (.+),\n\s*alertname: (\w+), time: (\w+),", proc.stdout + proc.stderr)
    assert {name for name, _, _ in found} <= {
        g["name"] for g in cases["tests"] if g["name"].startswith("two releases:")
    }, output(proc)
    assert {(a, t) for _, a, t in found} == NAMESPACE_ONLY_FAILS, output(proc)
