"""Production hazards a review of the chart found: what each pod mounts of the TLS Secret, the
IPC_LOCK capability, PodDisruptionBudgets a single replica cannot use, the external broker's
port, node timeouts kvfence refuses, generated tokens under renders without cluster access, the
startup probe's budget and ports a pod would bind twice."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_helm_chart import (
    CHART,
    FULLNAME,
    GPU_VALUES,
    K8S_VERSION,
    POD_ENV,
    RELEASE,
    container,
    find,
    helm,
    node_config,
    render,
    template,
)

from kvfence.config import TlsConfig
from kvfence.tls import (
    TlsError,
    internal_channel_credentials,
    internal_server_credentials,
    public_server_credentials,
    registry_channel_credentials,
)

TLS = ["tls.enabled=true", "tls.existingSecret=kvfence-tls"]
NODE_TLS_KEYS = ["ca.crt", "internal.crt", "internal.key"]
ALL_TLS_KEYS = ["public.crt", "public.key", *NODE_TLS_KEYS]
ROLES = ("control-plane", "prefill", "decode")


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-chart-review")


def pod_spec(docs: list[dict], role: str) -> dict:
    return find(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]


def validate(docs: list[dict]) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def refused(home: Path, sets: list[str], *needles: str) -> str:
    rc, _, err = template(home, sets=sets)
    assert rc != 0, f"rendered: {sets}"
    for needle in needles:
        assert needle in err, err
    return err


# --- 1. node pods never mount the public endpoint's key -------------------------------------------


def tls_volume(docs: list[dict], role: str) -> dict:
    (vol,) = [v for v in pod_spec(docs, role)["volumes"] if v["name"] == "tls"]
    return vol["secret"]


def mounted_tls(docs: list[dict], role: str, tmp: Path) -> TlsConfig:
    """What the kubelet would put in the pod's /etc/kvfence/tls (a stand-in PEM file per item
    of its volume), and the pod's kvfence tls config pointing there."""
    c = container(find(docs, "Deployment", f"{FULLNAME}-{role}"))
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    folder = tmp / role
    folder.mkdir()
    for item in tls_volume(docs, role)["items"]:
        (folder / item["path"]).write_text(f"-----BEGIN {item['key']}-----\n")
    tls = node_config(docs, role, POD_ENV).tls

    def here(path: Path | None) -> Path | None:
        if path is None:
            return None
        assert str(path).startswith(mount["mountPath"] + "/"), path
        return folder / path.relative_to(mount["mountPath"])

    files = ("public_cert", "public_key", "internal_ca", "internal_cert", "internal_key")
    return tls.model_copy(update={f: here(getattr(tls, f)) for f in files})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_mount_only_the_internal_tls_files(
    helm_home: Path, tmp_path: Path, role: str
) -> None:
    """A node pod mounts ca.crt, internal.crt and internal.key of the TLS Secret, never
    public.key (the public and admin endpoints' private key), and still builds every credential
    a node builds (kvfence/node_main.py: its mTLS server, its registry channel)."""
    docs = render(helm_home, sets=TLS)
    validate(docs)
    items = tls_volume(docs, role)["items"]
    assert [(i["key"], i["path"]) for i in items] == [(k, k) for k in NODE_TLS_KEYS]
    tls = mounted_tls(docs, role, tmp_path)
    assert internal_server_credentials(tls) is not None
    assert registry_channel_credentials(tls) is not None
    # what it lacks is exactly what serving the public endpoint needs
    with pytest.raises(TlsError, match=r"public\.key does not exist"):
        public_server_credentials(tls)


def test_the_control_plane_still_mounts_the_public_endpoints_files(
    helm_home: Path, tmp_path: Path
) -> None:
    docs = render(helm_home, sets=TLS)
    items = tls_volume(docs, "control-plane")["items"]
    assert [i["key"] for i in items] == ALL_TLS_KEYS
    tls = mounted_tls(docs, "control-plane", tmp_path)
    assert public_server_credentials(tls) is not None
    assert internal_channel_credentials(tls) is not None
    # every service's config still loads (ConfigMap plus pod env, validated by kvfence)
    for role in ROLES:
        assert node_config(docs, role, POD_ENV).tls.internal_server_name


# --- 2. IPC_LOCK only when asked for ------------------------------------------------------------

# What Pod Security "baseline" lets a container add (restricted: NET_BIND_SERVICE only).
BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip


def added_caps(docs: list[dict], role: str) -> set[str]:
    caps = container(find(docs, "Deployment", f"{FULLNAME}-{role}"))["securityContext"]
    return set(caps["capabilities"].get("add", []))


def test_rdma_adds_no_capability_a_non_root_pod_cannot_use(helm_home: Path) -> None:
    docs = render(helm_home, [GPU_VALUES])
    for role in ("prefill", "decode"):
        c = container(find(docs, "Deployment", f"{FULLNAME}-{role}"))
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1  # RDMA is on
        assert added_caps(docs, role) <= BASELINE_CAPS
        assert "IPC_LOCK" not in added_caps(docs, role)


def test_rdma_ipc_lock_is_added_when_asked_for(helm_home: Path) -> None:
    docs = render(helm_home, [GPU_VALUES], sets=["prefill.rdma.ipcLock=true"])
    assert added_caps(docs, "prefill") == {"IPC_LOCK"}
    assert "IPC_LOCK" not in added_caps(docs, "decode")
    validate(docs)


# --- 3. PodDisruptionBudgets --------------------------------------------------------------------


def pdbs(docs: list[dict]) -> dict[str, int]:
    return {
        d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): d["spec"]["maxUnavailable"]
        for d in docs
        if d["kind"] == "PodDisruptionBudget"
    }


def test_one_replica_gets_no_pdb_that_cannot_protect_it(helm_home: Path) -> None:
    assert pdbs(render(helm_home)) == {}  # prefill and decode run one replica by default
    docs = render(helm_home, sets=["decode.replicas=2"])
    assert pdbs(docs) == {"decode": 1}
    validate(docs)
    assert pdbs(render(helm_home, [GPU_VALUES])) == {"prefill": 1, "decode": 1}


def test_a_pdb_letting_every_pod_go_is_refused(helm_home: Path) -> None:
    refused(
        helm_home,
        ["prefill.replicas=2", "prefill.pdb.maxUnavailable=2"],
        "prefill.pdb.maxUnavailable 2 is not below prefill.replicas 2",
    )
    # control: below replicas it renders
    docs = render(helm_home, sets=["prefill.replicas=3", "prefill.pdb.maxUnavailable=2"])
    assert pdbs(docs) == {"prefill": 2}


# --- 4. the external broker's port; node timeout ------------------------------------------------

EXTERNAL = ["mqtt.enabled=false", "mqtt.auth.password=p"]


def broker_port(docs: list[dict]) -> object:
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    return yaml.safe_load(text)["events"]["mqtt_port"]


@pytest.mark.parametrize("port", ["0", "99999", "65536", "01777", "00"])
def test_external_broker_port_out_of_range_or_zero_padded_is_refused(
    helm_home: Path, port: str
) -> None:
    refused(helm_home, [*EXTERNAL, f"mqtt.externalUrl=mqtt://broker:{port}"], "externalUrl")


@pytest.mark.parametrize("port", [1, 1777, 65535])
def test_external_broker_port_renders_as_that_number(helm_home: Path, port: int) -> None:
    docs = render(helm_home, sets=[*EXTERNAL, f"mqtt.externalUrl=mqtt://broker:{port}"])
    assert broker_port(docs) == port
    for role in ROLES:
        events = node_config(docs, role, POD_ENV).events
        assert (events.mqtt_host, events.mqtt_port) == ("broker", port)


@pytest.mark.parametrize("check", ["true", "false"])
def test_node_timeout_under_two_heartbeats_is_refused(helm_home: Path, check: str) -> None:
    """kvfence refuses node_timeout_s < 2 x heartbeat_interval_s at start: without the
    pre-install hook (configCheck.enabled=false) every pod would crash-loop."""
    rc, _, err = template(
        helm_home, sets=[f"configCheck.enabled={check}", "controlPlane.nodeTimeoutS=1"]
    )
    assert rc != 0 and "controlPlane.nodeTimeoutS 1 is under 2 x" in err, err
    # control: exactly two heartbeats, and a shorter heartbeat, render and load
    for sets in (["controlPlane.nodeTimeoutS=2"], ["controlPlane.nodeTimeoutS=3"]):
        docs = render(helm_home, sets=[f"configCheck.enabled={check}", *sets])
        cp = node_config(docs, "prefill", POD_ENV).control_plane
        assert cp.node_timeout_s >= 2 * cp.heartbeat_interval_s


# --- 5. generated tokens ------------------------------------------------------------------------


def install_notes(home: Path, sets: list[str]) -> str:
    args = ["install", RELEASE, str(CHART), "--namespace", "serving", "--dry-run=client"]
    proc = helm(*args, *[a for s in sets for a in ("--set", s)], tmp=home)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


WARNING = "WARNING: the chart generated random values"


def test_notes_warn_while_the_chart_generates_secrets(helm_home: Path) -> None:
    notes = install_notes(helm_home, [])
    assert WARNING in notes
    for secret in ("admin-token (adminToken)", "node-token (nodeToken)", "mqtt (mqtt.auth)"):
        assert f"{FULLNAME}-{secret}" in notes
    assert "existingSecret" in notes.split(WARNING, 1)[1]
    # one Secret of one's own: the warning names the others only
    notes = install_notes(helm_home, ["adminToken.existingSecret=ops-admin"])
    assert WARNING in notes and "(adminToken)" not in notes and "(nodeToken)" in notes


@pytest.mark.parametrize(
    "sets",
    [
        [
            "adminToken.existingSecret=ops-admin",
            "nodeToken.existingSecret=ops-node",
            "mqtt.auth.existingSecret=ops-mqtt",
        ],
        [
            "adminToken.value=a",
            "nodeToken.value=n",
            "mqtt.auth.password=m",
            "mqtt.auth.readerPassword=r",
        ],
    ],
    ids=["existing-secrets", "values"],
)
def test_notes_do_not_warn_when_nothing_is_generated(helm_home: Path, sets: list[str]) -> None:
    assert WARNING not in install_notes(helm_home, sets)


# --- 6. startup probe budget --------------------------------------------------------------------


def startup_threshold(docs: list[dict], role: str) -> int:
    probe = container(find(docs, "Deployment", f"{FULLNAME}-{role}"))["startupProbe"]
    assert probe["periodSeconds"] == 5
    return probe["failureThreshold"]


def test_startup_timeout_sets_each_roles_startup_probe(helm_home: Path) -> None:
    docs = render(helm_home)
    assert {r: startup_threshold(docs, r) for r in ROLES} == dict.fromkeys(ROLES, 120)
    docs = render(
        helm_home, sets=["prefill.startupTimeoutS=1800", "controlPlane.startupTimeoutS=62"]
    )
    assert {r: startup_threshold(docs, r) for r in ROLES} == {
        "control-plane": 13,  # 62 s rounded up to whole 5 s periods
        "prefill": 360,
        "decode": 120,
    }
    validate(docs)


def test_startup_timeout_below_one_period_is_refused(helm_home: Path) -> None:
    refused(helm_home, ["decode.startupTimeoutS=4"], "startupTimeoutS")
    assert startup_threshold(render(helm_home, sets=["decode.startupTimeoutS=5"]), "decode") == 1


# --- 7. ports a pod would bind twice ------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["decode.ports.metrics=50071"], "decode.ports.grpc and decode.ports.metrics are both"),
        (["prefill.ports.ucx=9090"], "prefill.ports.ucx and prefill.ports.metrics are both"),
        (
            ["controlPlane.ports.metrics=50052"],
            "controlPlane.ports.admin and controlPlane.ports.metrics are both",
        ),
        (["prefill.ports.ucx=13345"], "prefill.ports.ucx 13345 lies inside prefill.ucx.tcpP"),
        (["decode.ports.grpc=13449"], "decode.ports.grpc 13449 lies inside"),
        (["decode.ports.metrics=13440"], "decode.ports.metrics 13440 lies inside"),
    ],
)
def test_a_port_bound_twice_in_a_pod_is_refused(
    helm_home: Path, sets: list[str], message: str
) -> None:
    refused(helm_home, sets, message)


def test_ports_beside_each_other_and_the_range_render(helm_home: Path) -> None:
    # controls: the same ports in other roles, and ports just outside the range
    docs = render(
        helm_home,
        sets=[
            "prefill.ports.metrics=9091",
            "decode.ports.metrics=50061",  # prefill's gRPC port: another pod
            "decode.ports.grpc=13450",
            "decode.ports.ucx=13439",
        ],
    )
    validate(docs)
    c = container(find(docs, "Deployment", f"{FULLNAME}-decode"))
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": 13450,
        "ucx": 13439,
        "metrics": 50061,
    }


def test_the_broker_port_renders_decimal_even_without_the_schema(helm_home: Path) -> None:
    """YAML reads a zero-padded number as octal (01777 = 1023): the config takes the port as a
    decimal number whatever the URL holds (the schema refuses the padding; `helm template
    --skip-schema-validation` skips that)."""
    args = ["template", RELEASE, str(CHART), "--namespace", "serving", "--skip-schema-validation"]
    sets = [*EXTERNAL, "mqtt.externalUrl=mqtt://broker:01777"]
    proc = helm(*args, *[a for s in sets for a in ("--set", s)], tmp=helm_home)
    assert proc.returncode == 0, proc.stderr
    assert broker_port([d for d in yaml.safe_load_all(proc.stdout) if d]) == 1777
