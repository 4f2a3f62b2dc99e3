"""The object names README.md, RUNBOOK.md and the chart's comments give operators exist in the
chart's render, for the release name the README installs with (`kvfence`) and for another one.

The docs write the chart's full name as FULLNAME (values.yaml: `<fullname>`): the release name
when it contains "kvfence", else `<release>-kvfence`. They once wrote `RELEASE-kvfence-admin` and
so on, which for `helm install kvfence` names `kvfence-kvfence-admin`: no such object, in every
kubectl command of an incident.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_helm_chart import CHART, helm

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "RUNBOOK.md",
    CHART / "values.yaml",
    CHART / "files" / "kvfence-alerts.yaml",
]
# The full name as the docs write it (RELEASE-kvfence: the spelling that was wrong for a release
# named kvfence), then the rest of an object's name, then maybe a Service's DNS suffix.
NAME = re.compile(
    r"(?:FULLNAME|<fullname>|\bRELEASE-kvfence)((?:-[a-z0-9]+)*)(\.(?:NS|<namespace>)\.svc)?"
)
# Every object the docs can name: TLS for the certificate names, the backup, the monitoring.
SETS = [
    "tls.enabled=true",
    "tls.existingSecret=kvfence-tls",
    "controlPlane.backup.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.podMonitor.enabled=true",
]


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-runbook-names")


def rendered(home: Path, release: str, namespace: str) -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for s in SETS:
        args += ["--set", s]
    proc = helm(*args, tmp=home)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def doc_names() -> dict[str, list[str]]:
    """Each name the docs write (placeholders as written), with where."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in NAME.finditer(line):
                found.setdefault(m.group(0), []).append(f"{path.name}:{n}")
    return found


def missing_names(docs: list[dict], release: str, namespace: str) -> dict[str, list[str]]:
    """The names the docs write that the render of ``release`` lacks, with where."""
    names = {d["metadata"]["name"] for d in docs}
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    (cm,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    ]
    internal_name = yaml.safe_load(cm["data"]["config.yaml"])["tls"]["internal_server_name"]
    (pod_monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    fullname = pod_monitor["metadata"]["name"]  # the PodMonitor is named the full name itself
    missing = {}
    for written, where in doc_names().items():
        m = NAME.fullmatch(written)
        assert m is not None
        prefix = release + "-kvfence" if written.startswith("RELEASE-") else fullname
        name = prefix + m.group(1)
        if m.group(2):  # a DNS name: a Service's, or the name node certificates must carry
            dns = f"{name}.{namespace}.svc"
            ok = name in services or dns == internal_name
        else:
            ok = name in names
        if not ok:
            missing[f"{written} -> {name}"] = where
    return missing


@pytest.mark.parametrize(("release", "namespace"), [("kvfence", "prod"), ("llama", "inference")])
def test_the_names_the_docs_give_exist_in_the_render(
    helm_home: Path, release: str, namespace: str
) -> None:
    docs = rendered(helm_home, release, namespace)
    assert len(doc_names()) >= 10  # the admin Service, the Secrets, the CronJob, the PVCs ...
    assert missing_names(docs, release, namespace) == {}


def test_the_release_label_takes_the_plain_release_name(helm_home: Path) -> None:
    """`app.kubernetes.io/instance=RELEASE` is the release name, not the full name: FULLNAME
    must not replace RELEASE there."""
    runbook = (ROOT / "RUNBOOK.md").read_text()
    values = set(re.findall(r"app\.kubernetes\.io/instance=(\w+)", runbook))
    assert values == {"RELEASE"}
    for d in rendered(helm_home, "llama", "inference"):
        if d["kind"] == "Deployment":
            assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == (
                "llama"
            )


def test_a_name_the_render_lacks_is_reported(
    helm_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: the old spelling, RELEASE-kvfence-admin, names nothing for release kvfence but
    is right for llama; FULLNAME-admin is right for both."""
    monkeypatch.setattr(
        "test_runbook_names.doc_names",
        lambda: {"RELEASE-kvfence-admin": ["x:1"], "FULLNAME-admin": ["x:2"]},
    )
    assert missing_names(rendered(helm_home, "kvfence", "prod"), "kvfence", "prod") == {
        "RELEASE-kvfence-admin -> kvfence-kvfence-admin": ["x:1"]
    }
    assert missing_names(rendered(helm_home, "llama", "inference"), "llama", "inference") == {}
