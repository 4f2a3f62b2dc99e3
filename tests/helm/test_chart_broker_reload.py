"""The bundled broker's certificate reloader (mqtt.tls.reloader).

Mosquitto reads its certificate at start and on SIGHUP; after cert-manager renews the Secret the
kubelet swaps the mounted files, and the reloader sidecar must SIGHUP the broker so that new
connections get the new certificate. The render tests check the sidecar's pod set-up; the end to
end tests run the real Mosquitto with the chart's config and the sidecar's rendered script, swap
the Secret's files as the kubelet does, and look at the certificate a new TLS connection gets:
cert 2 with the reloader, still cert 1 without it (which shows the check can fail).
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kubernetes_validate
import pytest
from test_helm_chart import (
    BROKER_TLS,
    FULLNAME,
    K8S_VERSION,
    ChartBroker,
    conf_lines,
    container,
    find,
    render,
    run_chart_broker,
    template,
    write_secret_volume,
)

INTERVAL_S = "0.2"  # the tests' polling interval (the chart's is mqtt.tls.reloader.intervalS)


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-reload")


def broker_pod(docs: list[dict]) -> dict:
    return find(docs, "Deployment", f"{FULLNAME}-mosquitto")["spec"]["template"]["spec"]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


# --- render -------------------------------------------------------------------------------------


def test_no_reloader_without_broker_tls(helm_home: Path) -> None:
    pod = broker_pod(render(helm_home))
    assert [c["name"] for c in pod["containers"]] == ["mosquitto"]
    assert "shareProcessNamespace" not in pod
    # with TLS but the reloader turned off: the broker alone, as before
    pod = broker_pod(render(helm_home, sets=[*BROKER_TLS, "mqtt.tls.reloader.enabled=false"]))
    assert [c["name"] for c in pod["containers"]] == ["mosquitto"]
    assert "shareProcessNamespace" not in pod
    # control: with TLS the sidecar is there
    pod = broker_pod(render(helm_home, sets=BROKER_TLS))
    assert [c["name"] for c in pod["containers"]] == ["mosquitto", "cert-reloader"]


def test_the_reloader_sidecar_render(helm_home: Path) -> None:
    """The sidecar shares the broker's process namespace (to signal it), runs the broker's
    image as the broker's user with the same locked-down container settings and tiny resources,
    mounts only the TLS Secret, read-only, and watches exactly the files the broker's config
    names."""
    docs = render(helm_home, sets=[*BROKER_TLS, "mqtt.tls.reloader.intervalS=30"])
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    deployment = find(docs, "Deployment", f"{FULLNAME}-mosquitto")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    broker, reloader = container(deployment, "mosquitto"), container(deployment, "cert-reloader")
    assert reloader["image"] == broker["image"]
    assert reloader["securityContext"] == broker["securityContext"]
    assert reloader["securityContext"]["readOnlyRootFilesystem"] is True
    assert reloader["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "runAsUser" not in reloader["securityContext"]  # the pod's: the broker's user
    assert reloader["resources"] == {
        "requests": {"cpu": "5m", "memory": "8Mi"},
        "limits": {"cpu": "50m", "memory": "32Mi"},
    }
    assert reloader["command"][:2] == ["sh", "-c"]
    assert "ports" not in reloader
    assert reloader["volumeMounts"] == [
        {"name": "tls", "mountPath": "/mosquitto/tls", "readOnly": True}
    ]
    env = env_of(reloader)
    assert env["RELOAD_INTERVAL_S"] == "30"
    assert env["RELOAD_PROCESS"] == "mosquitto" and broker["command"][0] == "mosquitto"
    named = {ln.split()[1] for ln in conf_lines(docs) if ln.split()[0].endswith("file")}
    named -= {"/mosquitto/auth/passwd", "/mosquitto/auth/acl"}  # password_file, acl_file
    assert set(env["RELOAD_FILES"].split()) == named and len(named) == 3


def test_reloader_values_are_checked(helm_home: Path) -> None:
    for bad in ("mqtt.tls.reloader.intervalS=0", "mqtt.tls.reloader.every=5"):
        rc, _, err = template(helm_home, sets=[*BROKER_TLS, bad])
        assert rc != 0, bad
        assert "reloader" in err, err
    assert template(helm_home, sets=[*BROKER_TLS, "mqtt.tls.reloader.intervalS=5"])[0] == 0


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca, and server-1 and server-2 from it (both name 127.0.0.1, where the broker listens)."""
    from test_tls import make_ca, make_leaf

    d = tmp_path_factory.mktemp("reload-pki")
    make_ca(d, "ca")
    make_leaf(d, "server-1", "ca", "serverAuth")
    make_leaf(d, "server-2", "ca", "serverAuth")
    return d


def secret_files(pki: Path, leaf: str) -> dict[str, bytes]:
    """The broker's Secret items as a cert-manager Certificate writes them."""
    files = {"tls.crt": f"{leaf}.pem", "tls.key": f"{leaf}.key", "ca.crt": "ca.pem"}
    return {k: (pki / f).read_bytes() for k, f in files.items()}


def as_secret(files: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in files.items()}


def der(pki: Path, leaf: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert((pki / f"{leaf}.pem").read_text())


def served_cert(port: int, ca: Path) -> bytes:
    """The certificate a new TLS connection to the broker gets (verified, name checked)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        cert = tls.getpeercert(binary_form=True)
    assert cert is not None
    return cert


@contextmanager
def tls_broker(docs: list[dict], pki: Path) -> Iterator[ChartBroker]:
    # A process name of its own: the reloader must signal this broker, no other on the machine.
    name = f"mosq-{uuid.uuid4().hex[:8]}"
    secret = {"mqtt-cert": as_secret(secret_files(pki, "server-1"))}
    with run_chart_broker(docs, secret, process_name=name) as broker:
        assert served_cert(broker.port, pki / "ca.pem") == der(pki, "server-1")
        yield broker


@contextmanager
def run_reloader(docs: list[dict], broker: ChartBroker, log: Path) -> Iterator[None]:
    """The sidecar's rendered command and env, its mount mapped to the broker's folder, polling
    every INTERVAL_S, for the test broker's process name."""
    reloader = container(find(docs, "Deployment", f"{FULLNAME}-mosquitto"), "cert-reloader")
    env = {k: broker.local(v) for k, v in env_of(reloader).items()}
    env.update(RELOAD_INTERVAL_S=INTERVAL_S, RELOAD_PROCESS=broker.process_name)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            reloader["command"],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its sleeps go with it
        )
    try:
        deadline = time.monotonic() + 5
        while "watching" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "watching" in log.read_text(), log.read_text()
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def wait_for_cert(port: int, ca: Path, want: bytes, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        got = served_cert(port, ca)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_the_reloader_makes_the_broker_serve_a_renewed_certificate(
    helm_home: Path, two_certs: Path, tmp_path: Path
) -> None:
    docs = render(helm_home, sets=BROKER_TLS)
    ca = two_certs / "ca.pem"
    log = tmp_path / "reloader.log"
    with tls_broker(docs, two_certs) as broker, run_reloader(docs, broker, log):
        # nothing changed: no signal, through several polls
        time.sleep(5 * float(INTERVAL_S))
        assert "SIGHUP" not in log.read_text()
        assert served_cert(broker.port, ca) == der(two_certs, "server-1")
        # the renewal, as the kubelet writes it: names and their mtimes unchanged
        write_secret_volume(broker.root / "tls", secret_files(two_certs, "server-2"))
        got = wait_for_cert(broker.port, ca, der(two_certs, "server-2"), timeout=5)
        assert got == der(two_certs, "server-2"), log.read_text()
        assert broker.process.poll() is None  # reloaded, not restarted
        (sent,) = [ln for ln in log.read_text().splitlines() if "SIGHUP" in ln]
        assert sent.endswith(f"to {broker.process_name} (pid {broker.process.pid})"), sent


def test_without_the_reloader_the_broker_keeps_the_old_certificate(
    helm_home: Path, two_certs: Path
) -> None:
    """Control for the test above: the same swap with no reloader running leaves the broker
    serving the old certificate (what the reloader is for)."""
    docs = render(helm_home, sets=BROKER_TLS)
    ca = two_certs / "ca.pem"
    with tls_broker(docs, two_certs) as broker:
        write_secret_volume(broker.root / "tls", secret_files(two_certs, "server-2"))
        got = wait_for_cert(broker.port, ca, der(two_certs, "server-2"), timeout=1.5)
        assert got == der(two_certs, "server-1")
