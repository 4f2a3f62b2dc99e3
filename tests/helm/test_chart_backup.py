"""The chart's scheduled tenant backup (controlPlane.backup): render, NetworkPolicy, and its script.

The render tests check the CronJob (absent by default) and its pods against the other kvfence
pods: same image, user and container settings, the control plane's admin token Secret, the admin
Service as target. The script tests run the rendered command, its mounts mapped to temporary
folders: against a fake `kvfence` (it keeps exactly `keep` newest backups; a failed backup fails
the run and deletes nothing, the negative control of the good run) and against a real control
plane with the real CLI (the file is a tenant database; a refused token fails the run; over TLS
the certificate need name only the host the nodes reach the control plane by).
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_helm_chart import (
    CHART,
    FULLNAME,
    K8S_VERSION,
    RELEASE,
    TLS,
    container,
    find,
    helm,
    render,
    template,
)

BACKUP = ["controlPlane.backup.enabled=true"]
CRONJOB = f"{FULLNAME}-tenant-backup"
CLAIM = f"{FULLNAME}-tenant-backups"
BACKUP_NAME = re.compile(r"tenants-\d{8}T\d{6}Z\.backup")


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-backup")


def job_pod(docs: list[dict]) -> dict:
    return find(docs, "CronJob", CRONJOB)["spec"]["jobTemplate"]["spec"]["template"]


def job_container(docs: list[dict]) -> dict:
    (only,) = job_pod(docs)["spec"]["containers"]
    return only


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c["env"]}


def volume(pod_spec: dict, name: str) -> dict:
    (v,) = [v for v in pod_spec["volumes"] if v["name"] == name]
    return v


# --- render -------------------------------------------------------------------------------------


def test_no_scheduled_backup_by_default(helm_home: Path) -> None:
    def backup_objects(docs: list[dict]) -> set[tuple[str, str]]:
        return {
            (d["kind"], d["metadata"]["name"])
            for d in docs
            if d["metadata"]["name"] in (CRONJOB, CLAIM)
        }

    assert backup_objects(render(helm_home)) == set()
    # control: asked for, they render
    assert backup_objects(render(helm_home, sets=BACKUP)) == {
        ("CronJob", CRONJOB),
        ("PersistentVolumeClaim", CLAIM),
        ("NetworkPolicy", CRONJOB),
    }


@pytest.mark.parametrize(
    "sets",
    [BACKUP, [*BACKUP, *TLS, "controlPlane.backup.persistence.existingClaim=ops-backups"]],
    ids=["default", "tls+existing-claim"],
)
def test_backup_renders_pass_kubernetes_validate(helm_home: Path, sets: list[str]) -> None:
    for doc in render(helm_home, sets=sets):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_backup_cronjob(helm_home: Path) -> None:
    """Forbid concurrency, a starting deadline, history limits; the pods run the release's
    kvfence image as the chart's non-root user with the other pods' settings and no service
    account token, read the admin token from the control plane's Secret, reach the admin
    Service, and write to a PVC of their own that an uninstall keeps."""
    docs = render(helm_home, sets=BACKUP)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    spec = find(docs, "CronJob", CRONJOB)["spec"]
    assert spec["schedule"] == "0 3 * * *"
    assert "timeZone" not in spec
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["startingDeadlineSeconds"] == 600
    assert (spec["successfulJobsHistoryLimit"], spec["failedJobsHistoryLimit"]) == (3, 3)
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] == 0 and job["activeDeadlineSeconds"] == 600
    pod = job_pod(docs)
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "tenant-backup"
    pod_spec = pod["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["securityContext"] == values["podSecurityContext"]
    cp = find(docs, "Deployment", f"{FULLNAME}-control-plane")
    c = job_container(docs)
    assert c["securityContext"] == values["securityContext"] == container(cp)["securityContext"]
    assert c["image"] == container(cp)["image"]
    assert c["command"][:2] == ["python3", "-c"]
    assert c["command"][2].strip() == (CHART / "files" / "tenant-backup.py").read_text().strip()
    assert c["resources"]["requests"] and c["resources"]["limits"]
    env = env_of(c)
    assert env["BACKUP_KEEP"] == "7" and env["BACKUP_TIMEOUT_S"] == "120"
    assert "ADMIN_TLS_CA" not in env and "KVFENCE_ADMIN_TOKEN" not in env
    assert "ADMIN_TLS_SERVER_NAME" not in env
    admin = find(docs, "Service", f"{FULLNAME}-admin")
    (port,) = admin["spec"]["ports"]
    assert env["KVFENCE_ADMIN_TARGET"] == f"{FULLNAME}-admin.serving.svc:{port['port']}"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["backups"]["mountPath"] == env["BACKUP_DIR"] == "/backups"
    assert Path(env["ADMIN_TOKEN_FILE"]).parent == Path(mounts["admin-token"]["mountPath"])
    assert mounts["admin-token"]["readOnly"] is True
    # the token: the Secret and key the control plane reads
    cp_token = volume(cp["spec"]["template"]["spec"], "admin-token")
    assert volume(pod_spec, "admin-token") == cp_token
    assert Path(env["ADMIN_TOKEN_FILE"]).name == cp_token["secret"]["items"][0]["path"]
    assert volume(pod_spec, "backups")["persistentVolumeClaim"] == {"claimName": CLAIM}
    pvc = find(docs, "PersistentVolumeClaim", CLAIM)
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"


def test_backup_values_reach_the_cronjob(helm_home: Path) -> None:
    sets = [
        *BACKUP,
        "controlPlane.backup.schedule=*/30 * * * *",
        "controlPlane.backup.timeZone=Europe/Berlin",
        "controlPlane.backup.keep=3",
        "controlPlane.backup.persistence.existingClaim=ops-backups",
        "adminToken.existingSecret=ops-admin",
        "adminToken.key=admin",
    ]
    docs = render(helm_home, sets=sets)
    spec = find(docs, "CronJob", CRONJOB)["spec"]
    assert (spec["schedule"], spec["timeZone"]) == ("*/30 * * * *", "Europe/Berlin")
    env = env_of(job_container(docs))
    assert env["BACKUP_KEEP"] == "3"
    assert env["ADMIN_TOKEN_FILE"] == "/etc/kvfence/admin/admin"
    pod_spec = job_pod(docs)["spec"]
    assert volume(pod_spec, "admin-token")["secret"]["secretName"] == "ops-admin"
    assert volume(pod_spec, "backups")["persistentVolumeClaim"] == {"claimName": "ops-backups"}
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim" and "backup" in str(d)]
    for bad in ("controlPlane.backup.keep=0", "controlPlane.backup.kept=3"):
        rc, _, err = template(helm_home, sets=[*BACKUP, bad])
        assert rc != 0 and "backup" in err, bad


def test_backup_over_tls_verifies_with_the_nodes_ca(helm_home: Path) -> None:
    """With tls.enabled the admin port serves the public certificate, which the nodes verify
    against the internal CA, as a certificate for the host of control_plane.address: the job does
    the same (so the certificate need not name the admin Service it connects to), and gets that CA
    only, no key."""
    docs = render(helm_home, sets=[*BACKUP, *TLS])
    env = env_of(job_container(docs))
    assert env["ADMIN_TLS_CA"] == "/etc/kvfence/tls/ca.crt"
    config = yaml.safe_load(find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    assert config["tls"]["internal_ca"] == env["ADMIN_TLS_CA"]
    nodes_host = config["control_plane"]["address"].rsplit(":", 1)[0]
    assert env["ADMIN_TLS_SERVER_NAME"] == nodes_host == f"{FULLNAME}-control-plane.serving.svc"
    assert not env["KVFENCE_ADMIN_TARGET"].startswith(nodes_host + ":")  # another name: the admin
    tls = volume(job_pod(docs)["spec"], "tls-ca")["secret"]
    assert tls["secretName"] == f"{FULLNAME}-tls"
    assert tls["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_notes_name_the_backups(helm_home: Path) -> None:
    args = ["install", RELEASE, str(CHART), "--namespace", "serving", "--dry-run=client"]
    plain = helm(*args, tmp=helm_home)
    assert plain.returncode == 0, plain.stderr
    assert "on a schedule with\ncontrolPlane.backup.enabled=true" in plain.stdout
    proc = helm(*args, "--set", BACKUP[0], tmp=helm_home)
    assert proc.returncode == 0, proc.stderr
    notes = " ".join(proc.stdout.split("NOTES:", 1)[1].split())
    assert f"The CronJob {CRONJOB} backs the tenants up" in notes
    assert f"PersistentVolumeClaim {CLAIM}, keeping the newest 7" in notes


# --- NetworkPolicy --------------------------------------------------------------------------------


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        have = labels.get(expr["key"])
        ok = {
            "In": lambda e, h: h in e["values"],
            "NotIn": lambda e, h: h not in e["values"],
            "Exists": lambda e, h: h is not None,
            "DoesNotExist": lambda e, h: h is None,
        }[expr["operator"]](expr, have)
        if not ok:
            return False
    return True


def admits(peers: list[dict] | None, labels: dict[str, str]) -> bool:
    """Whether a rule's from/to peers (None: anyone) include a pod of this namespace."""
    if peers is None:
        return True
    return any("podSelector" in p and selects(p["podSelector"], labels) for p in peers)


def test_backup_pods_reach_the_admin_port_and_dns_only(helm_home: Path) -> None:
    docs = render(helm_home, sets=BACKUP)
    backup = job_pod(docs)["metadata"]["labels"]
    pods = {
        d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): d["spec"]["template"]["metadata"][
            "labels"
        ]
        for d in docs
        if d["kind"] == "Deployment"
    }
    assert set(pods) == {"control-plane", "prefill", "decode", "mosquitto"}
    # the control plane lets it in on the admin port
    ingress = find(docs, "NetworkPolicy", f"{FULLNAME}-control-plane")["spec"]["ingress"]
    (admin_rule,) = [r for r in ingress if {"port": 50052, "protocol": "TCP"} in r["ports"]]
    assert admits(admin_rule.get("from"), backup)
    # its own policy: it serves nothing, and reaches the control plane's admin port and DNS
    policy = find(docs, "NetworkPolicy", CRONJOB)["spec"]
    assert selects(policy["podSelector"], backup)
    assert not [n for n, labels in pods.items() if selects(policy["podSelector"], labels)]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["ingress"] == []
    to_pods, dns = policy["egress"]
    assert to_pods["ports"] == [{"port": 50052, "protocol": "TCP"}]
    assert [n for n, labels in pods.items() if admits(to_pods["to"], labels)] == ["control-plane"]
    assert "to" not in dns
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    # control: the same check finds the other pods a rule admits (the broker: the release's)
    mqtt_ingress = find(docs, "NetworkPolicy", f"{FULLNAME}-mosquitto")["spec"]["ingress"]
    assert all(admits(mqtt_ingress[0]["from"], labels) for labels in pods.values())
    # no NetworkPolicy: none for the job either
    docs = render(helm_home, sets=[*BACKUP, "networkPolicy.enabled=false"])
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]


# --- the script ---------------------------------------------------------------------------------

FAKE_KVFENCE = """#!/bin/sh
# A stand-in for `kvfence tenants backup OUT ...`: records what it was given, then does what
# FAKE_KVFENCE says.
printf '%s\\n' "$@" > "$FAKE_RECORD.args"
printf '%s' "$KVFENCE_ADMIN_TOKEN" > "$FAKE_RECORD.token"
printf '%s' "$KVFENCE_ADMIN_TARGET" > "$FAKE_RECORD.target"
case "$FAKE_KVFENCE" in
  ok) echo "a tenant database" > "$3"; echo "backed up to $3" ;;
  fail) echo "cannot reach the admin API at $KVFENCE_ADMIN_TARGET: refused" >&2; exit 1 ;;
  silent) ;;  # says nothing, writes nothing, exits 0
esac
"""


def job_bin(tmp: Path, kvfence: Path | None = None) -> Path:
    """A PATH folder with python3 (this interpreter) and kvfence (the fake, or ``kvfence``)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    if kvfence is None:
        (bin_dir / "kvfence").write_text(FAKE_KVFENCE)
        (bin_dir / "kvfence").chmod(0o755)
    else:
        (bin_dir / "kvfence").symlink_to(kvfence)
    return bin_dir


def run_job(
    docs: list[dict], tmp: Path, bin_dir: Path, token: str = "admin-secret\n", **env: str
) -> subprocess.CompletedProcess[str]:
    """The job's rendered command and env, each mount a folder of ``tmp`` (the admin token's
    holding ``token``), kvfence and python3 from ``bin_dir``."""
    c = job_container(docs)
    mounts = {m["mountPath"]: tmp / m["name"] for m in c["volumeMounts"]}
    for folder in mounts.values():
        folder.mkdir(exist_ok=True)

    def local(value: str) -> str:  # a path in the pod, here
        for path in sorted(mounts, key=len, reverse=True):
            if value == path or value.startswith(path + "/"):
                return str(mounts[path]) + value[len(path) :]
        return value

    (tmp / "admin-token" / Path(env_of(c)["ADMIN_TOKEN_FILE"]).name).write_text(token)
    environ = {k: local(v) for k, v in env_of(c).items()}
    environ.update(env)
    environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    environ["FAKE_RECORD"] = str(tmp / "fake")
    return subprocess.run(
        c["command"], env=environ, capture_output=True, text=True, timeout=60, check=False
    )


def backups(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if BACKUP_NAME.fullmatch(p.name))


OLD = [f"tenants-202401{day:02d}T030000Z.backup" for day in range(1, 10)]
NOT_OURS = ["tenants-before-migration.backup", "notes.txt"]


def fill(folder: Path) -> None:
    folder.mkdir()
    for name in [*OLD, *NOT_OURS]:
        (folder / name).write_text(name)


def test_the_job_keeps_exactly_the_newest_backups(helm_home: Path, tmp_path: Path) -> None:
    docs = render(helm_home, sets=[*BACKUP, "controlPlane.backup.keep=3"])
    fill(tmp_path / "backups")
    started = time.gmtime(time.time() - 1)
    proc = run_job(docs, tmp_path, job_bin(tmp_path), FAKE_KVFENCE="ok")
    assert proc.returncode == 0, proc.stderr
    left = backups(tmp_path / "backups")
    (new,) = set(left) - set(OLD)
    assert left == [*OLD[-2:], new]  # the new one and the two newest before it
    assert time.strptime(new, "tenants-%Y%m%dT%H%M%SZ.backup") >= started
    for name in NOT_OURS:  # files of other names are not the job's to delete
        assert (tmp_path / "backups" / name).read_text() == name
    assert (tmp_path / "fake.args").read_text().split() == [
        "tenants",
        "backup",
        str(tmp_path / "backups" / new),
        "--timeout",
        "120",
    ]
    # the token from the Secret's file, in the environment (not on the command line)
    assert (tmp_path / "fake.token").read_text() == "admin-secret"
    assert (tmp_path / "fake.target").read_text() == "kv-kvfence-admin.serving.svc:50052"
    assert "deleted the old backup" in proc.stderr and "3 backups kept" in proc.stderr


def test_a_killed_runs_temporary_file_is_deleted_by_the_next_run(
    helm_home: Path, tmp_path: Path
) -> None:
    """A run killed on its deadline leaves the CLI's temporary file (it holds key hashes): the
    next run deletes it once it is an hour old. Control: a fresh one (a run in progress, started
    by hand) and files of other names are left alone."""
    docs = render(helm_home, sets=BACKUP)
    folder = tmp_path / "backups"
    folder.mkdir()
    stale = folder / ".tenants-20240101T030000Z.backup.41.tmp"
    fresh = folder / ".tenants-20240102T030000Z.backup.42.tmp"
    other = folder / ".something.tmp"
    for path in (stale, fresh, other):
        path.write_text("partial")
    hour_ago = time.time() - 3700
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(other, (hour_ago, hour_ago))
    proc = run_job(docs, tmp_path, job_bin(tmp_path), FAKE_KVFENCE="ok")
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists() and fresh.exists() and other.exists()
    assert f"deleted {stale.name}" in proc.stderr


def test_a_new_backup_is_kept_whatever_the_old_names_say(helm_home: Path, tmp_path: Path) -> None:
    """A backup named after the new one (a clock set back since) does not push it out."""
    docs = render(helm_home, sets=[*BACKUP, "controlPlane.backup.keep=1"])
    (tmp_path / "backups").mkdir()
    (tmp_path / "backups" / "tenants-29991231T000000Z.backup").write_text("future")
    proc = run_job(docs, tmp_path, job_bin(tmp_path), FAKE_KVFENCE="ok")
    assert proc.returncode == 0, proc.stderr
    (left,) = backups(tmp_path / "backups")
    assert left.startswith("tenants-2") and not left.startswith("tenants-2999")


@pytest.mark.parametrize("fake", ["fail", "silent"])
def test_a_failed_backup_fails_the_job_and_deletes_nothing(
    helm_home: Path, tmp_path: Path, fake: str
) -> None:
    """Negative control of the test above: kvfence fails (or says it succeeded but wrote
    nothing): the run exits non-zero, so the Job fails, and every backup is still there."""
    docs = render(helm_home, sets=[*BACKUP, "controlPlane.backup.keep=3"])
    fill(tmp_path / "backups")
    proc = run_job(docs, tmp_path, job_bin(tmp_path), FAKE_KVFENCE=fake)
    assert proc.returncode != 0
    assert "FAILED" in proc.stderr and "no old one deleted" in proc.stderr
    assert backups(tmp_path / "backups") == OLD
    assert sorted(p.name for p in (tmp_path / "backups").iterdir()) == sorted([*OLD, *NOT_OURS])


def test_the_job_passes_the_tls_ca(helm_home: Path, tmp_path: Path) -> None:
    docs = render(helm_home, sets=[*BACKUP, *TLS])
    proc = run_job(docs, tmp_path, job_bin(tmp_path), FAKE_KVFENCE="ok")
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "fake.args").read_text().split()
    assert args[-4:] == [
        "--tls-ca",
        str(tmp_path / "tls-ca" / "ca.crt"),
        "--tls-server-name",
        f"{FULLNAME}-control-plane.serving.svc",
    ]


CP_HOST = f"{FULLNAME}-control-plane.serving.svc"


@asynccontextmanager
async def control_plane(state: Path, tls: dict[str, str] | None = None) -> AsyncIterator[Any]:
    """An in-process control plane (admin port on 127.0.0.1) with the tenant acme; no nodes."""
    from control_plane.model_info import ByteTokenizer, ModelInfo
    from control_plane.service import ControlPlane
    from control_plane.tenants import TenantLimits
    from kvfence.config import parse_config
    from kvfence.proto.kvfence.v1 import common_pb2

    raw: dict[str, Any] = {
        "model": {"name": "test-model"},
        "control_plane": {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "state_dir": str(state),
        },
    }
    if tls is not None:
        raw["tls"] = tls
    cfg = parse_config(raw, environ={})
    layout = common_pb2.KvLayout(
        page_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=32
    )
    info = ModelInfo("test-model", 256, "sha256:test-model", layout, 384, ByteTokenizer())
    cp = ControlPlane(cfg, model_info=info)
    cp.ports = await cp.start()
    try:
        cp.tenants.create_tenant("acme", TenantLimits())
        yield cp
    finally:
        await cp.stop(0.1)


async def test_the_job_over_tls_against_a_real_control_plane(
    helm_home: Path, tmp_path: Path
) -> None:
    """The rendered TLS script with the real `kvfence` CLI against a control plane whose
    certificate names only the host the nodes reach it by (not the admin Service, not the
    127.0.0.1 it is reached at here): the backup is taken. Negative control: the same run
    without the server name is refused by the certificate check and writes nothing."""
    from test_tls import make_ca, make_leaf

    pki = tmp_path / "pki"
    pki.mkdir()
    make_ca(pki, "ca")
    make_leaf(pki, "public", "ca", "serverAuth", san=f"DNS:{CP_HOST}")
    tls = {"public_cert": str(pki / "public.pem"), "public_key": str(pki / "public.key")}
    (tmp_path / "tls-ca").mkdir()
    (tmp_path / "tls-ca" / "ca.crt").write_bytes((pki / "ca.pem").read_bytes())
    async with control_plane(tmp_path / "state", tls) as cp:
        docs = render(helm_home, sets=[*BACKUP, *TLS])
        bin_dir = job_bin(tmp_path, Path(sys.executable).parent / "kvfence")
        target = f"127.0.0.1:{cp.ports.admin}"

        def run(**env: str) -> subprocess.CompletedProcess[str]:
            token = cp.admin_token + "\n"
            return run_job(docs, tmp_path, bin_dir, token, KVFENCE_ADMIN_TARGET=target, **env)

        refused = await asyncio.to_thread(run, ADMIN_TLS_SERVER_NAME="")
        assert refused.returncode != 0
        assert "does not name 127.0.0.1" in refused.stderr and "FAILED" in refused.stderr
        assert backups(tmp_path / "backups") == []
        done = await asyncio.to_thread(run)
        assert done.returncode == 0, done.stderr
        (name,) = backups(tmp_path / "backups")
        with sqlite3.connect(tmp_path / "backups" / name) as db:
            assert db.execute("SELECT name FROM tenants").fetchall() == [("acme",)]


async def test_the_job_against_a_real_control_plane(helm_home: Path, tmp_path: Path) -> None:
    """The rendered script with the real `kvfence` CLI against an in-process control plane: a
    refused token fails the run and writes nothing (negative control); the right one writes an
    owner-only tenant database holding the control plane's tenants."""
    async with control_plane(tmp_path / "state") as cp:
        docs = render(helm_home, sets=BACKUP)
        bin_dir = job_bin(tmp_path, Path(sys.executable).parent / "kvfence")
        target = f"127.0.0.1:{cp.ports.admin}"

        def run(token: str) -> subprocess.CompletedProcess[str]:
            return run_job(docs, tmp_path, bin_dir, token, KVFENCE_ADMIN_TARGET=target)

        refused = await asyncio.to_thread(run, "not-the-token")
        assert refused.returncode != 0
        assert "admin token refused" in refused.stderr and "FAILED" in refused.stderr
        assert backups(tmp_path / "backups") == []
        done = await asyncio.to_thread(run, cp.admin_token + "\n")
        assert done.returncode == 0, done.stderr
        (name,) = backups(tmp_path / "backups")
        path = tmp_path / "backups" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT name FROM tenants").fetchall() == [("acme",)]
