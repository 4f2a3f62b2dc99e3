"""The pods RUNBOOK.md has operators apply (listing the backups, the restore) against what the
Pod Security "restricted" level refuses, with the chart tests' own checker.

The chart passes "restricted" (test_chart_hardening), so a namespace may enforce it; a RUNBOOK pod
that does not pass it is refused there by ``kubectl apply``, in the middle of a restore whose
first step has already scaled the control plane to zero.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import yaml
from test_chart_hardening import restricted_violations

RUNBOOK = Path(__file__).resolve().parents[2] / "RUNBOOK.md"
FENCE = re.compile(r"^( *)```[^\n]*\n(.*?)^\1```", re.M | re.S)
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?[^\n]*\n(.*?)^\s*\1\s*$", re.M | re.S)


def yaml_blocks(markdown: str) -> list[tuple[int, str]]:
    """The YAML a reader would feed kubectl: heredoc bodies in code blocks, and ```yaml blocks;
    each with its line number in the file."""
    found = []
    for fence in FENCE.finditer(markdown):
        indent, body = fence.group(1), fence.group(2)
        # A code block inside a list item is indented as the item; the reader copies it without.
        body = "".join(line.removeprefix(indent) for line in body.splitlines(keepends=True))
        start = markdown.count("\n", 0, fence.start()) + 2
        if fence.group(0).lstrip().startswith("```yaml"):
            found.append((start, body))
        for doc in HEREDOC.finditer(body):
            found.append((start + body.count("\n", 0, doc.start(2)), textwrap.dedent(doc.group(2))))
    return found


def pod_specs(doc: object) -> list[tuple[str, dict]]:
    """The pod specs a manifest holds: a Pod's own, a workload's template."""
    if not isinstance(doc, dict) or "kind" not in doc:
        return []
    name = f"{doc['kind']}/{(doc.get('metadata') or {}).get('name')}"
    spec = doc.get("spec") or {}
    if doc["kind"] == "Pod":
        return [(name, spec)]
    if doc["kind"] == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = (spec.get("template") or {}).get("spec")
    return [(name, template)] if template else []


def runbook_pods(markdown: str) -> list[tuple[str, dict]]:
    pods = []
    for line, block in yaml_blocks(markdown):
        for doc in yaml.safe_load_all(block):
            pods += [(f"RUNBOOK.md:{line} {name}", spec) for name, spec in pod_specs(doc)]
    return pods


def test_every_runbook_pod_meets_pod_security_restricted() -> None:
    pods = runbook_pods(RUNBOOK.read_text())
    # The backups pod and the restore pod at least: a parser that found none would pass anything.
    names = {where.rsplit(" ", 1)[1] for where, _ in pods}
    assert {"Pod/kvfence-backups", "Pod/kvfence-restore"} <= names, names
    refused = {where: found for where, pod in pods if (found := restricted_violations(pod))}
    assert refused == {}


def test_the_extraction_sees_a_refused_pod_in_a_list_item() -> None:
    """Control: an indented heredoc pod without a seccomp profile is found and refused."""
    markdown = textwrap.dedent(
        """\
        1. Start it:

           ```
           kubectl -n NS apply -f - <<YAML
           apiVersion: v1
           kind: Pod
           metadata: {name: p}
           spec:
             securityContext: {runAsNonRoot: true, runAsUser: 10001}
             containers:
               - name: c
                 image: $IMAGE
                 securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
           YAML
           ```
        """
    )
    ((where, pod),) = runbook_pods(markdown)
    assert where == "RUNBOOK.md:5 Pod/p"
    assert restricted_violations(pod) == ["c: seccompProfile None"]
    pod["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    assert restricted_violations(pod) == []
