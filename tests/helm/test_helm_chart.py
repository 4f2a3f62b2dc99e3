"""The Helm chart: lint, render, Kubernetes schema validation, values schema, and the config hook.

helm comes from ``.tools/bin/helm`` (``make helm`` installs it); a missing binary fails these tests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import aiomqtt
import kubernetes_validate
import pytest
import yaml
from asyncwait import eventually
from fixtures_mqtt import MOSQUITTO, free_port, hand_to_broker, wait_for_port

from control_plane import service as cp_service
from kvfence import node_main
from kvfence.config import ClusterConfig, Role, parse_config
from kvfence.events import EventBus, MqttCredentials, MqttTls, is_auth_refusal, is_tls_failure

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / ".tools" / "bin" / "helm"
CHART = ROOT / "helm" / "kvfence"
GPU_VALUES = CHART / "ci" / "gpu-rdma-values.yaml"
INCIDENT_VALUES = Path(__file__).with_name("incident-values.yaml")
K8S_VERSION = "1.35.0"  # the Kubernetes client version of the pinned helm (v4.1)
RELEASE = "kv"
FULLNAME = "kv-kvfence"
POD_ENV = {"POD_NAME": "pod-0", "POD_IP": "10.1.2.3"}


def helm(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    assert HELM.is_file() and os.access(HELM, os.X_OK), f"no helm at {HELM}: run `make helm`"
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(tmp / "cache"),
        "HELM_CONFIG_HOME": str(tmp / "config"),
        "HELM_DATA_HOME": str(tmp / "data"),
    }
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home")


@cache
def _template(values: tuple[str, ...], sets: tuple[str, ...], home: Path) -> tuple[int, str, str]:
    args = ["template", RELEASE, str(CHART), "--namespace", "serving"]
    for f in values:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args, tmp=home)
    return proc.returncode, proc.stdout, proc.stderr


def template(
    home: Path, values: Sequence[Path] = (), sets: Sequence[str] = ()
) -> tuple[int, str, str]:
    return _template(tuple(str(v) for v in values), tuple(sets), home)


def render(home: Path, values: Sequence[Path] = (), sets: Sequence[str] = ()) -> list[dict]:
    rc, out, err = template(home, values, sets)
    assert rc == 0, err
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(deployment: dict, name: str | None = None) -> dict:
    """The pod's container ``name``, or its only one."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        (only,) = containers
        return only
    (named,) = [c for c in containers if c["name"] == name]
    return named


def hook_config(docs: list[dict]) -> str:
    return find(docs, "ConfigMap", f"{FULLNAME}-config-check")["data"]["config.yaml"]


# --- lint and render ---------------------------------------------------------------------------


def test_helm_binary_is_installed() -> None:
    assert HELM.is_file(), f"no helm at {HELM}: `make helm` installs it"


@pytest.mark.parametrize("values", [(), (GPU_VALUES,)], ids=["default", "gpu-rdma"])
def test_helm_lint_strict(helm_home: Path, values: tuple[Path, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for f in values:
        args += ["-f", str(f)]
    proc = helm(*args, tmp=helm_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", [(), (GPU_VALUES,)], ids=["default", "gpu-rdma"])
def test_rendered_manifests_pass_kubernetes_validate(
    helm_home: Path, values: tuple[Path, ...]
) -> None:
    docs = render(helm_home, values)
    assert len(docs) >= 12
    for doc in docs:
        # Raises on any schema violation; strict rejects unknown fields.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_catches_a_broken_manifest(helm_home: Path) -> None:
    # Control for the test above: the validator does reject a wrong manifest.
    deployment = find(render(helm_home), "Deployment", f"{FULLNAME}-decode")
    container(deployment)["resoures"] = {}  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=False)


def test_default_release_contents(helm_home: Path) -> None:
    docs = render(helm_home)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in [
        ("Deployment", "control-plane"),
        ("Deployment", "prefill"),
        ("Deployment", "decode"),
        ("Deployment", "mosquitto"),
        ("Service", "control-plane"),
        ("Service", "admin"),
        ("Service", "mosquitto"),
        ("PersistentVolumeClaim", "control-plane-state"),
        ("ConfigMap", "config"),
        ("ConfigMap", "config-check"),
        ("Job", "config-check"),
        ("Secret", "admin-token"),
        ("NetworkPolicy", "control-plane"),
        ("NetworkPolicy", "prefill"),
        ("NetworkPolicy", "decode"),
    ]:
        assert (kind, f"{FULLNAME}-{name}") in kinds
    # one replica per role: no PodDisruptionBudget could protect it (values.yaml, prefill.pdb)
    assert "PodDisruptionBudget" not in {kind for kind, _ in kinds}


@pytest.mark.parametrize("role", ["control-plane", "prefill", "decode"])
def test_services_run_kvfence_serve_with_grpc_probes(helm_home: Path, role: str) -> None:
    c = container(find(render(helm_home), "Deployment", f"{FULLNAME}-{role}"))
    assert c["command"] == ["kvfence", "serve", role, "--config", "/etc/kvfence/config.yaml"]
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": grpc_port}
    assert c["resources"]["requests"] and c["resources"]["limits"]


def test_admin_service_stays_cluster_ip_when_public_is_exposed(helm_home: Path) -> None:
    docs = render(helm_home, sets=["controlPlane.service.type=LoadBalancer"])
    public = find(docs, "Service", f"{FULLNAME}-control-plane")["spec"]
    admin = find(docs, "Service", f"{FULLNAME}-admin")["spec"]
    assert public["type"] == "LoadBalancer"
    assert [p["port"] for p in public["ports"]] == [50051]
    assert admin["type"] == "ClusterIP"
    assert [p["port"] for p in admin["ports"]] == [50052]


def test_control_plane_state_on_a_pvc(helm_home: Path) -> None:
    docs = render(helm_home)
    spec = find(docs, "Deployment", f"{FULLNAME}-control-plane")["spec"]
    assert spec["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == (
        f"{FULLNAME}-control-plane-state"
    )
    mounts = {m["name"]: m["mountPath"] for m in container({"spec": spec})["volumeMounts"]}
    assert mounts["state"] == "/var/lib/kvfence"


def _peers(rule: dict) -> list[str]:
    return [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in rule["from"]]


def test_network_policies_fence_grpc_and_ucx(helm_home: Path) -> None:
    docs = render(helm_home)
    for role, grpc_port in (("prefill", 50061), ("decode", 50071)):
        rules = find(docs, "NetworkPolicy", f"{FULLNAME}-{role}")["spec"]["ingress"]
        grpc_rules = [r for r in rules if {"port": grpc_port, "protocol": "TCP"} in r["ports"]]
        assert len(grpc_rules) == 1
        assert _peers(grpc_rules[0]) == ["control-plane"]
    decode_rules = find(docs, "NetworkPolicy", f"{FULLNAME}-decode")["spec"]["ingress"]
    ucx_rules = [r for r in decode_rules if any(p["port"] == 13437 for p in r["ports"])]
    assert len(ucx_rules) == 1
    assert _peers(ucx_rules[0]) == ["prefill"]
    assert {"port": 13440, "endPort": 13449, "protocol": "TCP"} in ucx_rules[0]["ports"]


def test_gpu_rdma_values_request_devices_and_ucx(helm_home: Path) -> None:
    docs = render(helm_home, [GPU_VALUES])
    for role, replicas in (("prefill", 2), ("decode", 4)):
        deployment = find(docs, "Deployment", f"{FULLNAME}-{role}")
        assert deployment["spec"]["replicas"] == replicas
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        for kind in ("limits", "requests"):
            assert c["resources"][kind]["nvidia.com/gpu"] == 1
            assert c["resources"][kind]["rdma/hca_shared_devices_a"] == 1
        # the pods run as a non-root user: IPC_LOCK would do nothing (rdma.ipcLock)
        assert "add" not in c["securityContext"]["capabilities"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc,tcp"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert env["UCX_IB_GID_INDEX"] == "3"
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    # External broker: no Mosquitto in the release, its address in the config.
    assert not [d for d in docs if d["metadata"]["name"].endswith("mosquitto")]
    assert "mqtt_host: mosquitto.observability.svc" in hook_config(docs).replace('"', "")


def test_default_values_request_no_devices(helm_home: Path) -> None:
    c = container(find(render(helm_home), "Deployment", f"{FULLNAME}-decode"))
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "add" not in c["securityContext"]["capabilities"]


@pytest.mark.parametrize("values", [(), (GPU_VALUES,)], ids=["default", "gpu-rdma"])
def test_config_map_and_pod_env_load_as_kvfence_config(
    helm_home: Path, values: tuple[Path, ...]
) -> None:
    docs = render(helm_home, values)
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    assert text == hook_config(docs)  # the hook checks exactly what the services load
    for role in Role:
        c = container(find(docs, "Deployment", f"{FULLNAME}-{role}"))
        env = dict(POD_ENV)
        for e in c["env"]:
            if "value" in e:  # Kubernetes expands $(VAR) from earlier entries
                env[e["name"]] = (
                    e["value"]
                    .replace("$(POD_IP)", env["POD_IP"])
                    .replace("$(POD_NAME)", env["POD_NAME"])
                )
        cfg = parse_config(yaml.safe_load(text), environ=env)
        assert cfg.node.role == role
        assert cfg.node.node_id == "pod-0"
        # Prometheus scrapes the pod's address on the port the pod declares (the default host,
        # 127.0.0.1, would refuse it)
        (metrics_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
        assert (cfg.node.metrics_host, cfg.node.metrics_port) == ("0.0.0.0", metrics_port)
        if role != Role.CONTROL_PLANE:
            assert cfg.node.advertise.startswith("10.1.2.3:")
            assert cfg.node.ucx_host == "10.1.2.3"


def test_batching_values_reach_the_config(helm_home: Path) -> None:
    def batching(sets: list[str]) -> tuple[int, int, int]:
        text = find(render(helm_home, sets=sets), "ConfigMap", f"{FULLNAME}-config")
        cfg = parse_config(yaml.safe_load(text["data"]["config.yaml"]), environ={})
        return cfg.decode.max_batch, cfg.decode.stream_interval, cfg.prefill.max_batch_tokens

    assert batching([]) == (64, 1, 128)  # control: the defaults, as kvfence's own
    sets = ["decode.maxBatch=128", "decode.streamInterval=4", "prefill.maxBatchTokens=512"]
    assert batching(sets) == (128, 4, 512)


def test_queue_node_wait_and_transfer_cap_values_reach_the_config(helm_home: Path) -> None:
    def knobs(sets: list[str]) -> tuple[int, float, int]:
        text = find(render(helm_home, sets=sets), "ConfigMap", f"{FULLNAME}-config")
        cfg = parse_config(yaml.safe_load(text["data"]["config.yaml"]), environ={})
        cp = cfg.control_plane
        return (
            cp.admission_queue_per_tenant,
            cp.no_node_wait_s,
            cfg.transfer.max_unverified_connections,
        )

    assert knobs([]) == (64, 10.0, 256)  # control: the defaults, as kvfence's own
    sets = [
        "controlPlane.admissionQueuePerTenant=8",
        "controlPlane.noNodeWaitS=0",
        "transfer.maxUnverifiedConnections=32",
    ]
    assert knobs(sets) == (8, 0.0, 32)


def test_hook_configmap_is_created_before_the_hook_job(helm_home: Path) -> None:
    docs = render(helm_home)
    cm = find(docs, "ConfigMap", f"{FULLNAME}-config-check")["metadata"]["annotations"]
    job = find(docs, "Job", f"{FULLNAME}-config-check")
    annotations = job["metadata"]["annotations"]
    assert cm["helm.sh/hook"] == annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(cm["helm.sh/hook-weight"]) < int(annotations["helm.sh/hook-weight"])
    pod = job["spec"]["template"]["spec"]
    assert container(job)["command"] == [
        "kvfence",
        "check-config",
        "--static",
        "/etc/kvfence/config.yaml",
    ]
    assert pod["volumes"][0]["configMap"]["name"] == f"{FULLNAME}-config-check"
    assert job["spec"]["backoffLimit"] == 0


# --- values.schema.json and the template check --------------------------------------------------

TINY_CONTEXT = 2048  # kvfence.model.tiny.TINY_CONFIG max_position_embeddings
PATH_WITH_SHAPE = [
    "model.path=/models/m",
    "model.shape.numLayers=2",
    "model.shape.numKvHeads=2",
    "model.shape.headDim=32",
    "model.shape.contextWindow=4096",
]


@pytest.mark.parametrize(
    ("bad", "fixed", "error"),
    [
        (["prefill.replicas=-1"], ["prefill.replicas=0"], "/prefill/replicas"),
        (["decode.replicas=-2"], ["decode.replicas=3"], "/decode/replicas"),
        (["decode.streamInterval=0"], ["decode.streamInterval=4"], "/decode/streamInterval"),
        (["prefill.maxBatchTokens=0"], ["prefill.maxBatchTokens=1"], "/prefill/maxBatchTokens"),
        (["controlPlane.replicas=-1"], ["controlPlane.replicas=0"], "/controlPlane/replicas"),
        (["model.name=null"], ["model.name=glm"], "missing property 'name'"),
        (["model.name="], ["model.name=glm"], "/model/name"),
        (["model=null"], ["model.name=glm"], "missing property 'model'"),
        # A checkpoint path needs its shape: the pre-install hook cannot read the checkpoint.
        (["model.path=/models/m"], PATH_WITH_SHAPE, "/model/shape"),
        # Pools as page counts against the context window (a template `fail`: JSON schema cannot
        # compare two values). The embedded model's window is 2048 = 128 pages of 16.
        (["decode.pool.numPages=127"], ["decode.pool.numPages=128"], "decode.pool holds 2032"),
        (
            ["model.contextWindow=8192"],
            ["model.contextWindow=8192", "model.clampContext=true"],
            "< model context window 8192",
        ),
        (
            ["model.contextWindow=8192"],
            ["model.contextWindow=8192", "prefill.pool.numPages=512", "decode.pool.numPages=512"],
            "prefill.pool holds 4096 tokens",
        ),
        (
            [*PATH_WITH_SHAPE, "kv.pageSize=8"],
            [*PATH_WITH_SHAPE, "kv.pageSize=8", "model.clampContext=true"],
            "< model context window 4096",
        ),
        (
            ["prefill.pool.memoryBytes=1000000"],
            ["prefill.pool.memoryBytes=1000000", "prefill.pool.numPages=null"],
            "/prefill/pool",
        ),
        (["prefill.drainTimeoutS=-1"], ["prefill.drainTimeoutS=0"], "/prefill/drainTimeoutS"),
        # A Mosquitto account name goes into the password file (name:hash) and the ACL.
        (["mqtt.auth.username=a:b"], ["mqtt.auth.username=a-b"], "/mqtt/auth/username"),
        (["mqtt.auth.username=a b"], ["mqtt.auth.username=ab"], "/mqtt/auth/username"),
        (
            ["mqtt.auth.readerUsername=kvfence"],
            ["mqtt.auth.readerUsername="],
            "needs a name of its own",
        ),
        (
            ["mqtt.auth.readerPasswordKey=password"],
            ["mqtt.auth.readerPasswordKey=pw2"],
            "need keys of their own",
        ),
        # A pod killed before its drain ends fails the requests the drain was waiting for.
        (
            ["decode.drainTimeoutS=60", "decode.terminationGracePeriodSeconds=60"],
            ["decode.drainTimeoutS=60", "decode.terminationGracePeriodSeconds=61"],
            "decode.terminationGracePeriodSeconds 60 must exceed decode.drainTimeoutS 60",
        ),
    ],
)
def test_bad_values_are_rejected_and_the_fix_renders(
    helm_home: Path, bad: list[str], fixed: list[str], error: str
) -> None:
    rc, _, err = template(helm_home, sets=bad)
    assert rc != 0
    assert error in err, err
    rc, out, err = template(helm_home, sets=fixed)
    assert rc == 0, err
    assert "kind: Deployment" in out


def test_template_check_uses_the_tiny_models_context_window(helm_home: Path) -> None:
    from kvfence.model.tiny import TINY_CONFIG

    assert TINY_CONFIG["max_position_embeddings"] == TINY_CONTEXT


# --- the pre-install hook's check ---------------------------------------------------------------


def check_config_static(config_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the hook's command, ``kvfence check-config --static``, on a rendered config."""
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    script = Path(sys.executable).with_name("kvfence")
    if script.is_file():
        cmd = [str(script)]
    else:  # the console script exists only after `pip install -e .`
        cmd = [sys.executable, "-c", "from kvfence.cli import main; main()"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE__")}
    return subprocess.run(
        [*cmd, "check-config", "--static", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )


def test_hook_fails_the_release_on_the_incident_config(helm_home: Path, tmp_path: Path) -> None:
    # The incident's values pass the schema and the template check (the prefill pool is in bytes)...
    docs = render(helm_home, [INCIDENT_VALUES])
    # ...and the hook's check stops them.
    proc = check_config_static(hook_config(docs), tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "681280" in proc.stdout and "1048576" in proc.stdout


def test_hook_passes_the_incident_config_when_clamped(helm_home: Path, tmp_path: Path) -> None:
    docs = render(helm_home, [INCIDENT_VALUES], sets=["model.clampContext=true"])
    proc = check_config_static(hook_config(docs), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK (clamped): admissible limit 681280" in proc.stdout


@pytest.mark.parametrize("values", [(), (GPU_VALUES,)], ids=["default", "gpu-rdma"])
def test_hook_passes_sound_configs(
    helm_home: Path, tmp_path: Path, values: tuple[Path, ...]
) -> None:
    proc = check_config_static(hook_config(render(helm_home, values)), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: admissible limit" in proc.stdout


def test_tls_needs_material_and_switches_probes_to_tcp(helm_home: Path) -> None:
    rc, _, err = template(helm_home, sets=["tls.enabled=true"])
    assert rc != 0
    assert "tls.existingSecret" in err
    docs = render(helm_home, sets=["tls.enabled=true", "tls.existingSecret=kvfence-tls"])
    c = container(find(docs, "Deployment", f"{FULLNAME}-decode"))
    # Kubernetes gRPC probes cannot speak TLS.
    assert c["readinessProbe"]["tcpSocket"] == {"port": 50071}
    assert "grpc" not in c["readinessProbe"]
    volumes = find(docs, "Deployment", f"{FULLNAME}-decode")["spec"]["template"]["spec"]["volumes"]
    (tls,) = [v["secret"] for v in volumes if v["name"] == "tls"]
    assert (tls["secretName"], tls["defaultMode"]) == ("kvfence-tls", 0o440)
    # a node mounts the internal files only, never public.key
    assert [i["key"] for i in tls["items"]] == ["ca.crt", "internal.crt", "internal.key"]
    assert "internal_ca: /etc/kvfence/tls/ca.crt" in hook_config(docs)
    assert not [d for d in docs if d["metadata"]["name"] == f"{FULLNAME}-tls"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_existing_admin_token_secret_is_used(helm_home: Path) -> None:
    docs = render(helm_home, sets=["adminToken.existingSecret=ops-admin", "adminToken.key=tok"])
    # only the node token's (and the MQTT passwords') Secret is rendered; the admin token comes
    # from the existing one
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [
        f"{FULLNAME}-node-token",
        f"{FULLNAME}-mqtt",
    ]
    spec = find(docs, "Deployment", f"{FULLNAME}-control-plane")["spec"]["template"]["spec"]
    secret = next(v["secret"] for v in spec["volumes"] if v["name"] == "admin-token")
    assert (secret["secretName"], secret["items"]) == ("ops-admin", [{"key": "tok", "path": "tok"}])
    assert "admin_token_file: /etc/kvfence/admin/tok" in hook_config(docs)


def test_node_token_reaches_control_plane_and_every_node(helm_home: Path) -> None:
    docs = render(helm_home)
    assert "node_token_file: /etc/kvfence/node/token" in hook_config(docs)
    for name in ("control-plane", "prefill", "decode"):
        spec = find(docs, "Deployment", f"{FULLNAME}-{name}")["spec"]["template"]["spec"]
        secret = next(v["secret"] for v in spec["volumes"] if v["name"] == "node-token")
        assert secret["secretName"] == f"{FULLNAME}-node-token"
        mounts = spec["containers"][0]["volumeMounts"]
        assert {"name": "node-token", "mountPath": "/etc/kvfence/node", "readOnly": True} in mounts
    # control: an existing Secret replaces the generated one
    docs = render(helm_home, sets=["nodeToken.existingSecret=ops-node"])
    assert f"{FULLNAME}-node-token" not in [d["metadata"]["name"] for d in docs]
    spec = find(docs, "Deployment", f"{FULLNAME}-decode")["spec"]["template"]["spec"]
    assert next(v for v in spec["volumes"] if v["name"] == "node-token")["secret"][
        "secretName"
    ] == ("ops-node")


@pytest.mark.parametrize("values", [(), (GPU_VALUES,)], ids=["default", "gpu-rdma"])
def test_every_pod_can_reach_its_model(helm_home: Path, values: tuple[Path, ...]) -> None:
    """Each service finds its checkpoint on a volume of its own pod: the configured model.path on
    the model volume (the control plane reads config.json and the tokenizer too), or, with none
    set, the embedded model that a node writes under state_dir, on a writable volume (the root
    filesystem is read-only). Both used to be missing: nodes could not write the embedded model,
    and a control plane with model.path set found no config.json."""
    docs = render(helm_home, values)
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    for role in Role:
        deployment = find(docs, "Deployment", f"{FULLNAME}-{role}")
        c = container(deployment)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        cfg = parse_config(yaml.safe_load(text), environ=dict(POD_ENV))
        if cfg.model.path is not None:
            where, writable = Path(cfg.model.path), False
        else:
            where, writable = cfg.control_plane.state_dir / "models" / "tiny-llama", True
        mounts = [m for m in c["volumeMounts"] if where.is_relative_to(Path(m["mountPath"]))]
        assert mounts, f"{role}: nothing mounted at {where}"
        if writable:
            assert not mounts[-1].get("readOnly", False), f"{role}: {where} is read-only"
        volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert {m["name"] for m in mounts} <= volumes


# --- MQTT broker accounts -------------------------------------------------------------------------

MQTT_PASSWORD_FILE = "/etc/kvfence/mqtt/password"


def mosquitto_data(docs: list[dict]) -> dict[str, str]:
    return find(docs, "ConfigMap", f"{FULLNAME}-mosquitto")["data"]


def conf_lines(docs: list[dict]) -> list[str]:
    lines = mosquitto_data(docs)["mosquitto.conf"].splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def mounted_file(deployment: dict, path: str, name: str | None = None) -> tuple[str, str]:
    """(Secret name, key) of the Secret item a pod's container (``name``, or its only one) sees
    at ``path``."""
    pod = deployment["spec"]["template"]["spec"]
    (mount,) = [
        m
        for m in container(deployment, name)["volumeMounts"]
        if Path(path).parent == Path(m["mountPath"])
    ]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    (item,) = [i for i in volume["secret"]["items"] if i["path"] == Path(path).name]
    return volume["secret"]["secretName"], item["key"]


def test_bundled_broker_requires_an_account_by_default(helm_home: Path) -> None:
    """The bundled Mosquitto refused no one (allow_anonymous true): anyone who could reach it
    read every tenant's events and could publish forged ones. By default it now refuses anonymous
    clients, knows the accounts from a Secret, and every kvfence service (all publish events)
    loads the kvfence account: its username and a password file that is the Secret's key."""
    docs = render(helm_home)
    lines = conf_lines(docs)
    assert "allow_anonymous false" in lines and "allow_anonymous true" not in lines
    assert "password_file /mosquitto/auth/passwd" in lines
    assert "acl_file /mosquitto/auth/acl" in lines
    acl = mosquitto_data(docs)["acl"].split()
    grants = ["topic", "readwrite", "kvfence/v1/kvfence/#"]
    assert acl == ["user", "kvfence", *grants, "user", "kvfence-reader", "topic", "read", grants[2]]
    secret = find(docs, "Secret", f"{FULLNAME}-mqtt")
    assert set(secret["data"]) == {"password", "reader-password"}
    assert all(len(base64.b64decode(v)) == 48 for v in secret["data"].values())  # generated
    # The broker's password file is made at pod start by its own image's mosquitto_passwd.
    broker = find(docs, "Deployment", f"{FULLNAME}-mosquitto")
    (init,) = broker["spec"]["template"]["spec"]["initContainers"]
    assert init["image"] == container(broker, "mosquitto")["image"]
    assert "mosquitto_passwd -c -b" in init["command"][-1]
    assert {"name": "MQTT_USERNAME", "value": "kvfence"} in init["env"]
    for role in Role:
        cfg = node_config(docs, role, POD_ENV)
        assert cfg.events.mqtt_username == "kvfence"
        assert str(cfg.events.mqtt_password_file) == MQTT_PASSWORD_FILE
        deployment = find(docs, "Deployment", f"{FULLNAME}-{role}")
        assert mounted_file(deployment, MQTT_PASSWORD_FILE) == (f"{FULLNAME}-mqtt", "password")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_anonymous_broker_only_when_asked_for(helm_home: Path) -> None:
    """mqtt.auth.enabled=false is the explicit (unsafe) opt-out: the old anonymous broker, no
    password Secret, and kvfence connects without an account."""
    docs = render(helm_home, sets=["mqtt.auth.enabled=false"])
    lines = conf_lines(docs)
    assert "allow_anonymous true" in lines and "allow_anonymous false" not in lines
    assert not [ln for ln in lines if ln.startswith(("password_file", "acl_file"))]
    assert "acl" not in mosquitto_data(docs)
    assert f"{FULLNAME}-mqtt" not in [d["metadata"]["name"] for d in docs]
    broker = find(docs, "Deployment", f"{FULLNAME}-mosquitto")["spec"]["template"]["spec"]
    assert "initContainers" not in broker
    for role in Role:
        cfg = node_config(docs, role, POD_ENV)
        assert cfg.events.mqtt_host is not None and cfg.events.mqtt_username is None
        volumes = find(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]
        assert "mqtt-password" not in [v["name"] for v in volumes["volumes"]]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


EXTERNAL = ["mqtt.enabled=false", "mqtt.externalUrl=mqtt://broker.example:1883"]


def test_external_broker_takes_an_existing_secret(helm_home: Path) -> None:
    # An external broker's password cannot be generated: without one the render says what to do.
    rc, _, err = template(helm_home, sets=EXTERNAL)
    assert rc != 0 and "mqtt.auth.existingSecret" in err and "mqtt.auth.enabled=false" in err
    sets = [*EXTERNAL, "mqtt.auth.existingSecret=ops-mqtt", "mqtt.auth.username=svc-kvfence"]
    docs = render(helm_home, sets=sets)
    assert not [d for d in docs if d["kind"] == "Secret" and "mqtt" in d["metadata"]["name"]]
    assert not [d for d in docs if d["metadata"]["name"].endswith("mosquitto")]
    for role in Role:
        cfg = node_config(docs, role, POD_ENV)
        assert (cfg.events.mqtt_host, cfg.events.mqtt_username) == ("broker.example", "svc-kvfence")
        deployment = find(docs, "Deployment", f"{FULLNAME}-{role}")
        assert mounted_file(deployment, str(cfg.events.mqtt_password_file)) == (
            "ops-mqtt",
            "password",
        )
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # or the password as a value: the chart renders a Secret with it (no reader account: that one
    # is the bundled broker's)
    docs = render(helm_home, sets=[*EXTERNAL, "mqtt.auth.password=ext-pw"])
    data = find(docs, "Secret", f"{FULLNAME}-mqtt")["data"]
    assert data == {"password": base64.b64encode(b"ext-pw").decode()}
    # control: an external broker that takes anonymous clients, said so explicitly
    docs = render(helm_home, sets=[*EXTERNAL, "mqtt.auth.enabled=false"])
    assert node_config(docs, "decode", POD_ENV).events.mqtt_username is None


def write_secret_volume(folder: Path, files: dict[str, bytes]) -> None:
    """Lay out (or update) a Secret volume as the kubelet does: the files in a new folder,
    `..data` a symlink to it, swapped in by a rename (atomic), and each name a symlink through
    `..data`. An update changes no name's mtime: only contents tell."""
    folder.mkdir(exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix="..kvfence_", dir=folder))
    fresh.chmod(0o755)
    for name, data in files.items():
        (fresh / name).write_bytes(data)
    link = folder / "..data_tmp"
    link.symlink_to(fresh.name)
    old = (folder / "..data").resolve() if (folder / "..data").is_symlink() else None
    link.rename(folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    if old is not None:
        shutil.rmtree(old)


@dataclasses.dataclass
class ChartBroker:
    """The bundled broker running as the chart deploys it (see run_chart_broker)."""

    port: int
    root: Path  # the pod's volumes, a folder each (Secret ones laid out as the kubelet does)
    process_name: str  # what the broker's process is called (its /proc/PID/comm)
    process: subprocess.Popen[bytes]
    local: Callable[[str], str]  # a path of the pod (or text naming some), on this machine


@contextmanager
def run_chart_broker(
    docs: list[dict],
    user_secrets: dict[str, dict[str, str]] | None = None,
    process_name: str = "mosquitto",
) -> Iterator[ChartBroker]:
    """Run the bundled broker as the chart deploys it: the pod's volumes laid out in a temporary
    folder (ConfigMap files, Secret items, emptyDir), the init container's script run with its
    env, then Mosquitto with the rendered config, on a free local port, as a process named
    ``process_name`` (a name of its own lets a test signal this broker and no other).
    ``user_secrets``: {name: {key: base64}} of the Secrets the chart does not render (the
    existingSecret ones)."""
    deployment = find(docs, "Deployment", f"{FULLNAME}-mosquitto")
    pod = deployment["spec"]["template"]["spec"]
    data = mosquitto_data(docs)
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    secrets.update(user_secrets or {})
    with tempfile.TemporaryDirectory(prefix="kvfence-chart-mqtt-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # mosquitto, started as root, drops to its own user
        for volume in pod["volumes"]:
            where = root / volume["name"]
            if "configMap" in volume:
                where.mkdir()
                for key, text in data.items():
                    (where / key).write_text(text)
            elif "secret" in volume:
                named = secrets[volume["secret"]["secretName"]]
                items = volume["secret"]["items"]
                write_secret_volume(
                    where, {i["path"]: base64.b64decode(named[i["key"]]) for i in items}
                )
            else:
                where.mkdir()
        mounts = [m for c in pod["containers"] for m in c["volumeMounts"]]
        for init in pod.get("initContainers", []):
            mounts += init["volumeMounts"]

        def local(text: str) -> str:
            for m in sorted(mounts, key=lambda m: -len(m["mountPath"])):
                text = text.replace(m["mountPath"], str(root / m["name"]))
            return text

        for init in pod.get("initContainers", []):
            env = {**os.environ, **{e["name"]: e["value"] for e in init.get("env", [])}}
            cmd = [local(part) for part in init["command"]]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
        for made in (root / "auth").glob("*") if (root / "auth").exists() else ():
            hand_to_broker(made)
        port = free_port()
        broker = container(deployment, "mosquitto")
        args = broker["command"]
        assert args[:2] == ["mosquitto", "-c"]
        conf = Path(local(args[2]))
        conf.write_text(
            local(conf.read_text()).replace(
                f"listener {broker['ports'][0]['containerPort']}", f"listener {port} 127.0.0.1"
            )
        )
        (root / "bin").mkdir()
        (root / "bin" / process_name).symlink_to(MOSQUITTO)  # the kernel names it after the link
        process = subprocess.Popen(
            [str(root / "bin" / process_name), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port("127.0.0.1", port)
            yield ChartBroker(port, root, process_name, process, local)
        finally:
            process.kill()
            process.wait(timeout=5)


@contextmanager
def chart_broker(
    docs: list[dict], user_secrets: dict[str, dict[str, str]] | None = None
) -> Iterator[int]:
    """run_chart_broker's port."""
    with run_chart_broker(docs, user_secrets) as broker:
        yield broker.port


def chart_account(docs: list[dict], key: str) -> MqttCredentials:
    a = yaml.safe_load(find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    users = {"password": a["events"]["mqtt_username"], "reader-password": "kvfence-reader"}
    value = find(docs, "Secret", f"{FULLNAME}-mqtt")["data"][key]
    return MqttCredentials(users[key], base64.b64decode(value).decode())


def chart_events_config(docs: list[dict], port: int, tmp_path: Path, **env: str) -> ClusterConfig:
    """kvfence's own config, as a control plane pod loads it (with the chart's kvfence password
    where the pod mounts it: here, in ``tmp_path``), pointed at a broker on ``port``."""
    password = tmp_path / "password"
    password.write_bytes(
        base64.b64decode(find(docs, "Secret", f"{FULLNAME}-mqtt")["data"]["password"])
    )
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    environ = {
        "KVFENCE__EVENTS__MQTT_HOST": "127.0.0.1",
        "KVFENCE__EVENTS__MQTT_PORT": str(port),
        "KVFENCE__EVENTS__MQTT_PASSWORD_FILE": str(password),
        **env,
    }
    return parse_config(yaml.safe_load(text), environ=environ)


async def receive_events(client: aiomqtt.Client, timeout: float) -> list[dict]:
    got: list[dict] = []

    async def collect() -> None:
        async for message in client.messages:
            assert isinstance(message.payload, bytes)
            got.append(json.loads(message.payload))

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(collect(), timeout)
    return got


def connect(port: int, account: MqttCredentials | None) -> aiomqtt.Client:
    return aiomqtt.Client(
        "127.0.0.1",
        port,
        username=None if account is None else account.username,
        password=None if account is None else account.password,
    )


async def test_the_charts_broker_takes_the_charts_accounts_only(
    helm_home: Path, tmp_path: Path
) -> None:
    """End to end with the real Mosquitto: the chart's password file (hashed by the init
    container's script from the rendered Secret) and ACL. kvfence, configured as the chart
    configures it, delivers its events; the reader account receives them (positive control); an
    anonymous client, a wrong password and kvfence without its account are refused; the reader
    cannot publish a forged event."""
    docs = render(helm_home)
    publisher, reader = chart_account(docs, "password"), chart_account(docs, "reader-password")
    with chart_broker(docs) as port:
        cfg = chart_events_config(docs, port, tmp_path)
        bus = EventBus.from_config(cfg, "control-plane-0")
        assert bus.credentials == publisher
        topic = f"kvfence/v1/{cfg.cluster}/events/#"
        async with connect(port, reader) as sub:
            await sub.subscribe(topic, qos=1)
            await bus.start()
            try:
                seqs = [bus.emit("integrity_violation", check="mac") for _ in range(3)]
                assert await bus.wait_drained(5), bus.last_error
                got = await receive_events(sub, 1.0)
                assert [e["seq"] for e in got] == seqs
                # the reader may not publish: a forged event never reaches a subscriber
                forged = {"seq": 99, "kind": "integrity_violation", "node_id": "control-plane-0"}
                async with connect(port, reader) as forger:
                    await forger.publish(
                        topic[:-1] + "integrity_violation", json.dumps(forged), qos=1
                    )
                assert await receive_events(sub, 0.5) == []
            finally:
                await bus.stop()
        for account in (None, MqttCredentials(publisher.username, "not-" + publisher.password)):
            with pytest.raises(aiomqtt.MqttError) as err:
                async with connect(port, account):
                    pass
            assert is_auth_refusal(err.value), err.value
        anonymous = EventBus(cfg.cluster, "control-plane-1", "127.0.0.1", port)
        await anonymous.start()
        try:
            anonymous.emit("node_joined")
            await eventually(lambda: anonymous.last_error is not None, timeout=4)
            assert "not authori" in (anonymous.last_error or "").lower()
            assert anonymous.pending == 1
        finally:
            await anonymous.stop(flush_timeout=0.1)


async def test_bundled_broker_without_a_reader_account(helm_home: Path) -> None:
    """readerUsername "" leaves the kvfence account alone in the Secret, the ACL and the password
    file, and the broker still starts and takes it."""
    docs = render(helm_home, sets=["mqtt.auth.readerUsername="])
    assert set(find(docs, "Secret", f"{FULLNAME}-mqtt")["data"]) == {"password"}
    acl = mosquitto_data(docs)["acl"].split()
    assert acl == ["user", "kvfence", "topic", "readwrite", "kvfence/v1/kvfence/#"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    publisher = chart_account(docs, "password")
    with chart_broker(docs) as port:
        async with connect(port, publisher) as client:
            await client.subscribe("kvfence/v1/kvfence/events/#", qos=1)
            await client.publish("kvfence/v1/kvfence/events/node_lost", b"{}", qos=1)
            assert await receive_events(client, 1.0) == [{}]
        with pytest.raises(aiomqtt.MqttError) as err:
            async with connect(port, MqttCredentials("kvfence-reader", "x")):
                pass
        assert is_auth_refusal(err.value)


async def test_the_charts_anonymous_broker_takes_anyone(helm_home: Path) -> None:
    """Control for the refusals above: with the opt-out the same broker set-up lets an anonymous
    client publish and subscribe (what mqtt.auth.enabled=false warns about)."""
    docs = render(helm_home, sets=["mqtt.auth.enabled=false"])
    with chart_broker(docs) as port:
        async with connect(port, None) as sub:
            await sub.subscribe("kvfence/v1/kvfence/events/#", qos=1)
            async with connect(port, None) as anyone:
                await anyone.publish("kvfence/v1/kvfence/events/node_lost", b"{}", qos=1)
            assert await receive_events(sub, 1.0) == [{}]


# --- MQTT over TLS --------------------------------------------------------------------------------

MQTT_TLS_CA = "/etc/kvfence/mqtt-tls/ca.crt"
BROKER_TLS = ["mqtt.tls.enabled=true", "mqtt.tls.existingSecret=mqtt-cert"]


def test_the_broker_speaks_no_tls_by_default(helm_home: Path) -> None:
    """Control for the TLS renders below: by default nothing about TLS is rendered (the broker
    config, kvfence's config, the pods' volumes are as before mqtt.tls existed)."""
    docs = render(helm_home)
    lines = conf_lines(docs)
    assert lines[0] == "listener 1883"
    assert not [ln for ln in lines if ln.startswith(("cafile", "certfile", "keyfile"))]
    broker = find(docs, "Deployment", f"{FULLNAME}-mosquitto")["spec"]["template"]["spec"]
    assert [v["name"] for v in broker["volumes"]] == ["config", "auth", "secret"]
    for role in Role:
        assert node_config(docs, role, POD_ENV).events.mqtt_tls_ca_file is None
        pod = find(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]
        assert "mqtt-tls" not in [v["name"] for v in pod["volumes"]]
    assert "mqtt_tls" not in hook_config(docs)


def test_bundled_broker_tls_render(helm_home: Path, tmp_path: Path) -> None:
    """mqtt.tls: the broker's listener gets the certificate files of the Secret (and keeps its
    accounts), every kvfence service verifies it against the Secret's ca.crt, mounted where its
    config points; the pre-install check still passes (it reads no file)."""
    docs = render(helm_home, sets=BROKER_TLS)
    lines = conf_lines(docs)
    assert lines[:4] == [
        "listener 1883",
        "cafile /mosquitto/tls/ca.crt",
        "certfile /mosquitto/tls/tls.crt",
        "keyfile /mosquitto/tls/tls.key",
    ]
    assert "allow_anonymous false" in lines and "password_file /mosquitto/auth/passwd" in lines
    broker = find(docs, "Deployment", f"{FULLNAME}-mosquitto")
    for name in ("ca.crt", "tls.crt", "tls.key"):
        assert mounted_file(broker, f"/mosquitto/tls/{name}", "mosquitto") == ("mqtt-cert", name)
    for role in Role:
        cfg = node_config(docs, role, POD_ENV)
        assert str(cfg.events.mqtt_tls_ca_file) == MQTT_TLS_CA
        assert cfg.events.mqtt_tls_cert_file is None and cfg.events.mqtt_username == "kvfence"
        deployment = find(docs, "Deployment", f"{FULLNAME}-{role}")
        assert mounted_file(deployment, MQTT_TLS_CA) == ("mqtt-cert", "ca.crt")
        # only the CA: the broker's key stays in the broker's pod
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "mqtt-tls"]
        assert [i["key"] for i in volume["secret"]["items"]] == ["ca.crt"]
    assert f"mqtt_tls_ca_file: {MQTT_TLS_CA}" in hook_config(docs)
    # the user's Secret: not rendered
    assert "mqtt-cert" not in [d["metadata"]["name"] for d in docs]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    proc = check_config_static(hook_config(docs), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_external_broker_tls_takes_a_ca_secret(helm_home: Path) -> None:
    sets = [*EXTERNAL, "mqtt.auth.existingSecret=ops-mqtt", "mqtt.tls.enabled=true"]
    rc, _, err = template(helm_home, sets=sets)
    assert rc != 0 and "mqtt.tls.existingSecret" in err and "ca.crt" in err
    docs = render(helm_home, sets=[*sets, "mqtt.tls.existingSecret=ops-mqtt-ca"])
    assert not [d for d in docs if d["metadata"]["name"].endswith("mosquitto")]
    for role in Role:
        cfg = node_config(docs, role, POD_ENV)
        assert cfg.events.mqtt_host == "broker.example"
        assert str(cfg.events.mqtt_tls_ca_file) == MQTT_TLS_CA
        deployment = find(docs, "Deployment", f"{FULLNAME}-{role}")
        assert mounted_file(deployment, MQTT_TLS_CA) == ("ops-mqtt-ca", "ca.crt")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_an_mqtts_external_url_needs_tls_and_defaults_to_8883(helm_home: Path) -> None:
    base = ["mqtt.enabled=false", "mqtt.auth.existingSecret=ops-mqtt"]
    tls = ["mqtt.tls.enabled=true", "mqtt.tls.existingSecret=ops-mqtt-ca"]
    rc, _, err = template(helm_home, sets=[*base, "mqtt.externalUrl=mqtts://broker.example"])
    assert rc != 0 and "is TLS: set mqtt.tls.enabled=true" in err
    for url, port in (("mqtts://broker.example", 8883), ("ssl://broker.example:9883", 9883)):
        docs = render(helm_home, sets=[*base, *tls, f"mqtt.externalUrl={url}"])
        cfg = node_config(docs, Role.DECODE, POD_ENV)
        assert (cfg.events.mqtt_host, cfg.events.mqtt_port) == ("broker.example", port)
        assert str(cfg.events.mqtt_tls_ca_file) == MQTT_TLS_CA
    # control: plain mqtt:// keeps 1883
    docs = render(helm_home, sets=[*base, "mqtt.externalUrl=mqtt://broker.example"])
    assert node_config(docs, Role.DECODE, POD_ENV).events.mqtt_port == 1883


def test_broker_tls_without_a_secret_fails_the_render(helm_home: Path) -> None:
    rc, _, err = template(helm_home, sets=["mqtt.tls.enabled=true"])
    assert rc != 0
    assert "mqtt.tls.enabled: give mqtt.tls.existingSecret" in err
    assert "tls.crt, tls.key and ca.crt" in err
    rc, _, err = template(helm_home, sets=["mqtt.tls.enabled=yes"])  # the schema: a boolean
    assert rc != 0 and "/mqtt/tls/enabled" in err
    rc, _, err = template(helm_home, sets=[*BROKER_TLS, "mqtt.tls.secret=x"])
    assert rc != 0 and "additional properties 'secret' not allowed" in err
    assert template(helm_home, sets=BROKER_TLS)[0] == 0  # control


def test_notes_follow_events_over_tls(helm_home: Path) -> None:
    """The NOTES' events command takes the CA, and the broker's own name (the certificate names
    the Service, not the port-forward's 127.0.0.1)."""
    args = ["install", RELEASE, str(CHART), "--namespace", "serving", "--dry-run=client"]
    plain = helm(*args, tmp=helm_home)
    assert plain.returncode == 0, plain.stderr
    assert "--mqtt-tls-ca" not in plain.stdout
    proc = helm(*args, *[a for s in BROKER_TLS for a in ("--set", s)], tmp=helm_home)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "get secret mqtt-cert" in notes and "{.data.ca\\.crt}" in notes
    assert (
        f"--mqtt-tls-ca mqtt-ca.crt --mqtt-tls-server-name {FULLNAME}-mosquitto.serving.svc"
        in notes
    )


def test_notes_reach_the_admin_api_over_tls(helm_home: Path) -> None:
    """With tls.enabled the admin port serves the public certificate, which names the control
    plane's Service, not the port-forward's 127.0.0.1: the NOTES' admin commands take the CA and
    that name. Control: without TLS they take neither."""
    args = ["install", RELEASE, str(CHART), "--namespace", "serving", "--dry-run=client"]
    plain = helm(*args, tmp=helm_home)
    assert plain.returncode == 0, plain.stderr
    notes = plain.stdout.split("NOTES:", 1)[1]
    assert "--tls-ca" not in notes and "KVFENCE_ADMIN_TLS_SERVER_NAME" not in notes
    tls = ["--set", "tls.enabled=true", "--set", "tls.existingSecret=kvfence-tls"]
    proc = helm(*args, *tls, tmp=helm_home)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "get secret kvfence-tls" in notes and "{.data.ca\\.crt}" in notes
    assert f"export KVFENCE_ADMIN_TLS_SERVER_NAME={FULLNAME}-control-plane.serving.svc" in notes
    starts = ("kvfence tenants create", "kvfence check-config")
    commands = [line for line in notes.splitlines() if line.strip().startswith(starts)]
    assert len(commands) == 2
    for line in commands:
        assert line.endswith("--tls-ca kvfence-ca.crt"), line
    # the public API (generate, probe) through its port-forward, and the backup by hand
    assert f"--tls-server-name {FULLNAME}-control-plane.serving.svc" in notes
    assert "`kvfence tenants backup FILE` (with --tls-ca, as in step 1)" in notes


@pytest.fixture(scope="module")
def mqtt_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_tls import make_ca, make_leaf

    d = tmp_path_factory.mktemp("chart-mqtt-pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", "serverAuth")  # names 127.0.0.1, where chart_broker listens
    return d


def cert_manager_secret(pki: Path) -> dict[str, str]:
    """The Secret a cert-manager Certificate would write for the broker."""
    files = {"tls.crt": "server.pem", "tls.key": "server.key", "ca.crt": "ca.pem"}
    return {k: base64.b64encode((pki / f).read_bytes()).decode() for k, f in files.items()}


def tls_client(port: int, account: MqttCredentials | None, ca: Path | None) -> aiomqtt.Client:
    return aiomqtt.Client(
        "127.0.0.1",
        port,
        username=None if account is None else account.username,
        password=None if account is None else account.password,
        tls_context=None if ca is None else MqttTls(ca).context(),
        timeout=1,
    )


async def test_the_charts_tls_broker_takes_tls_clients_with_the_ca_only(
    helm_home: Path, tmp_path: Path, mqtt_pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end with the real Mosquitto and the rendered TLS config: kvfence, configured as
    the chart configures it (the CA at the path its config names), delivers over TLS and the
    reader receives (positive control); a plain client gets no answer, a client with another
    CA fails the handshake, and a kvfence bus without TLS keeps its events and says why."""
    docs = render(helm_home, sets=BROKER_TLS)
    with chart_broker(docs, {"mqtt-cert": cert_manager_secret(mqtt_pki)}) as port:
        # the pod's mount of the Secret's ca.crt
        ca = tmp_path / Path(MQTT_TLS_CA).name
        ca.write_bytes(base64.b64decode(cert_manager_secret(mqtt_pki)["ca.crt"]))
        cfg = chart_events_config(docs, port, tmp_path, KVFENCE__EVENTS__MQTT_TLS_CA_FILE=str(ca))
        bus = EventBus.from_config(cfg, "control-plane-0")
        assert bus.tls is not None and bus.tls.ca_file == ca
        reader = chart_account(docs, "reader-password")
        async with tls_client(port, reader, ca) as sub:
            await sub.subscribe(f"kvfence/v1/{cfg.cluster}/events/#", qos=1)
            await bus.start()
            try:
                seqs = [bus.emit("integrity_violation", check="mac") for _ in range(3)]
                assert await bus.wait_drained(5), bus.last_error
                got = await receive_events(sub, 1.0)
                assert [e["seq"] for e in got] == seqs
            finally:
                await bus.stop()
        with pytest.raises(aiomqtt.MqttError) as err:  # plain MQTT: the listener never answers
            async with tls_client(port, reader, None):
                pass
        assert "timed out" in str(err.value)
        with pytest.raises(aiomqtt.MqttError) as err:
            async with tls_client(port, reader, mqtt_pki / "other-ca.pem"):
                pass
        assert is_tls_failure(err.value) and "certificate verify failed" in str(err.value)
        monkeypatch.setattr("kvfence.events.PUBLISH_TIMEOUT_S", 1.0)  # the no-answer wait
        plain = EventBus(
            cfg.cluster, "control-plane-1", "127.0.0.1", port, credentials=bus.credentials
        )
        await plain.start()
        try:
            plain.emit("node_joined")
            await eventually(lambda: plain.last_error is not None, timeout=8)
            assert "timed out" in (plain.last_error or "") and plain.pending == 1
        finally:
            await plain.stop(flush_timeout=0.1)


# --- IPv6 pods ------------------------------------------------------------------------------------


def node_config(docs: list[dict], role: str, pod_env: dict[str, str]):
    """The kvfence config a pod of ``role`` loads: the ConfigMap plus its env as Kubernetes
    expands it (``$(VAR)`` from earlier entries and the downward API, given as ``pod_env``)."""
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    env = dict(pod_env)
    for e in container(find(docs, "Deployment", f"{FULLNAME}-{role}"))["env"]:
        if "value" in e:
            value = e["value"]
            for name in ("POD_IP", "POD_NAME"):
                value = value.replace(f"$({name})", pod_env[name])
            env[e["name"]] = value
    return parse_config(yaml.safe_load(text), environ=env)


@pytest.mark.parametrize(("role", "port"), [("prefill", 50061), ("decode", 50071)])
def test_ipv6_pod_advertises_a_bracketed_grpc_address(
    helm_home: Path, role: str, port: int
) -> None:
    """On an IPv6-only cluster the pod IP is an IPv6 literal. The chart advertises
    ``$(POD_IP):port``, which gRPC cannot dial unbracketed (it reads "fd00::1:50061" as a host
    without a port); the node must advertise ``[fd00::1]:50061``."""
    docs = render(helm_home)
    cfg = node_config(docs, role, {"POD_NAME": "pod-0", "POD_IP": "fd00::1"})
    assert cfg.node.advertise == f"[fd00::1]:{port}"
    # UCX takes the host alone (the KV receiver's address is split at its last colon)
    assert cfg.node.ucx_host == "fd00::1"
    # control: an IPv4 pod advertises its address as before
    cfg = node_config(docs, role, dict(POD_ENV))
    assert cfg.node.advertise == f"10.1.2.3:{port}"
    assert cfg.node.ucx_host == "10.1.2.3"


# --- draining on SIGTERM ------------------------------------------------------------------------


def grace_and_drain(docs: list[dict], role: str) -> tuple[int, float]:
    """A node pod's terminationGracePeriodSeconds and the drain timeout its kvfence config has."""
    pod = find(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]
    return pod["terminationGracePeriodSeconds"], node_config(
        docs, role, POD_ENV
    ).node.drain_timeout_s


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_pods_outlast_their_drain(helm_home: Path, tmp_path: Path, role: str) -> None:
    """A node pod's grace period (after which Kubernetes kills it) exceeds the drain timeout
    its kvfence config gets, by what a node's stop may take after the drain when the broker or
    a transfer hangs (node_main.STOP_TAIL_S): by default 40 s against 25 s (kvfence's own
    default). A longer drain moves the grace with it; an explicit grace is kept; the other role
    is untouched (control)."""
    tail = int(node_main.STOP_TAIL_S)
    other = "decode" if role == "prefill" else "prefill"
    docs = render(helm_home)
    assert grace_and_drain(docs, role) == (25 + tail, 25.0)
    assert parse_config({}, environ={}).node.drain_timeout_s == 25.0
    docs = render(helm_home, sets=[f"{role}.drainTimeoutS=120"])
    assert grace_and_drain(docs, role) == (120 + tail, 120.0)
    assert grace_and_drain(docs, other) == (25 + tail, 25.0)
    sets = [f"{role}.drainTimeoutS=5", f"{role}.terminationGracePeriodSeconds=8"]
    assert grace_and_drain(render(helm_home, sets=sets), role) == (8, 5.0)
    fractional = tmp_path / "drain.yaml"
    fractional.write_text(f"{role}: {{drainTimeoutS: 2.5}}\n")
    assert grace_and_drain(render(helm_home, [fractional]), role) == (3 + tail, 2.5)


def test_the_control_plane_pod_outlasts_its_shutdown_grace(helm_home: Path) -> None:
    """The control plane lets running requests finish for shutdownGraceS on SIGTERM; its pod's
    grace period must be longer, or Kubernetes kills it with them, by what its stop may take
    after the grace when a node or the broker hangs (service.STOP_TAIL_S): default 40 s against
    25 s; a longer grace moves the pod's with it; one not longer fails the render (control: an
    explicit longer one is kept)."""
    tail = int(cp_service.STOP_TAIL_S)

    def grace_and_stop(docs: list[dict]) -> tuple[int, float]:
        pod = find(docs, "Deployment", f"{FULLNAME}-control-plane")["spec"]["template"]["spec"]
        cfg = node_config(docs, "control-plane", POD_ENV)
        return pod["terminationGracePeriodSeconds"], cfg.control_plane.shutdown_grace_s

    assert grace_and_stop(render(helm_home)) == (25 + tail, 25.0)
    longer = render(helm_home, sets=["controlPlane.shutdownGraceS=60"])
    assert grace_and_stop(longer) == (60 + tail, 60.0)
    sets = ["controlPlane.shutdownGraceS=5", "controlPlane.terminationGracePeriodSeconds=8"]
    assert grace_and_stop(render(helm_home, sets=sets)) == (8, 5.0)
    rc, _, err = template(helm_home, sets=["controlPlane.terminationGracePeriodSeconds=20"])
    assert rc != 0 and "must exceed controlPlane.shutdownGraceS 25" in err


def test_the_control_plane_pod_outlasts_its_refuse_window(helm_home: Path, tmp_path: Path) -> None:
    """On SIGTERM the control plane keeps its listeners open, refusing new requests
    SHUTTING_DOWN, for shutdownRefuseS (alongside shutdownGraceS): the values reach its config
    (default 1 s), a window longer than the grace moves the pod's grace period with it, one the
    pod would not outlast fails the render, and a negative one is refused (control: the
    defaults keep 40 s)."""
    tail = int(cp_service.STOP_TAIL_S)

    def grace_and_refuse(docs: list[dict]) -> tuple[int, float]:
        pod = find(docs, "Deployment", f"{FULLNAME}-control-plane")["spec"]["template"]["spec"]
        cfg = node_config(docs, "control-plane", POD_ENV)
        return pod["terminationGracePeriodSeconds"], cfg.control_plane.shutdown_refuse_s

    assert grace_and_refuse(render(helm_home)) == (25 + tail, 1.0)
    none = render(helm_home, sets=["controlPlane.shutdownRefuseS=0"])
    assert grace_and_refuse(none) == (25 + tail, 0)
    longer = render(helm_home, sets=["controlPlane.shutdownRefuseS=40"])
    assert grace_and_refuse(longer) == (40 + tail, 40.0)
    fractional = tmp_path / "refuse.yaml"
    fractional.write_text("controlPlane: {shutdownRefuseS: 2.5, shutdownGraceS: 0}\n")
    assert grace_and_refuse(render(helm_home, [fractional])) == (3 + tail, 2.5)
    sets = ["controlPlane.shutdownRefuseS=30", "controlPlane.terminationGracePeriodSeconds=28"]
    rc, _, err = template(helm_home, sets=sets)
    assert rc != 0 and "must exceed controlPlane.shutdownRefuseS 30" in err
    rc, _, err = template(helm_home, sets=["controlPlane.shutdownRefuseS=-1"])
    assert rc != 0 and "shutdownRefuseS" in err


# --- Secrets in the pods' checksum ----------------------------------------------------------------

# Every Secret the chart renders by default, with given values: a generated one is drawn anew at
# each `helm template` (no cluster to look up), and would change the checksums on every render.
TOKENS = [
    "adminToken.value=admin-a",
    "nodeToken.value=node-a",
    "mqtt.auth.password=mqtt-a",
    "mqtt.auth.readerPassword=reader-a",
]
TLS = [
    "tls.enabled=true",
    "tls.publicCert=PUBCERT",
    "tls.publicKey=PUBKEY",
    "tls.internalCa=CA",
    "tls.internalCert=INTCERT",
    "tls.internalKey=INTKEY",
]
ROLES = ("control-plane", "prefill", "decode")


def pod_annotations(docs: list[dict]) -> dict[str, dict[str, str]]:
    return {
        role: find(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["metadata"][
            "annotations"
        ]
        for role in ROLES
    }


def restarted(
    before: list[str], after: list[str], home: Path, deployments: Sequence[str] = ROLES
) -> set[str]:
    """The Deployments whose pod template changes between two `helm upgrade`s: Kubernetes rolls
    exactly those (a Secret itself changes in place)."""
    a = {r: find(render(home, sets=before), "Deployment", f"{FULLNAME}-{r}") for r in deployments}
    b = {r: find(render(home, sets=after), "Deployment", f"{FULLNAME}-{r}") for r in deployments}
    return {r for r in deployments if a[r]["spec"]["template"] != b[r]["spec"]["template"]}


@pytest.mark.parametrize(
    ("change", "consumers"),
    [
        ("adminToken.value=admin-b", {"control-plane"}),
        ("nodeToken.value=node-b", {"control-plane", "prefill", "decode"}),
        ("tls.internalKey=INTKEY-2", {"control-plane", "prefill", "decode"}),
        ("tls.publicCert=PUBCERT-2", {"control-plane", "prefill", "decode"}),
        # every kvfence service publishes events with the kvfence account; the bundled broker
        # hashes it (and the reader's, which only it knows) at start
        ("mqtt.auth.password=mqtt-b", {"control-plane", "prefill", "decode", "mosquitto"}),
        ("mqtt.auth.readerPassword=reader-b", {"mosquitto"}),
    ],
)
def test_rotating_a_secret_restarts_the_pods_that_read_it(
    helm_home: Path, change: str, consumers: set[str]
) -> None:
    """The control plane reads its tokens, and every service its TLS files, once at start: a
    rotated Secret must change the pod template of every Deployment that mounts it, or its pods
    keep the old value."""
    base = [*TOKENS, *TLS]
    every = (*ROLES, "mosquitto")
    assert restarted(base, [*base, change], helm_home, every) == consumers
    # control: the same values again (a second render: renders are cached by their arguments)
    # restart nothing
    assert restarted(base, base[::-1], helm_home, every) == set()


def test_unrelated_change_restarts_no_pod_for_secrets(helm_home: Path) -> None:
    # Positive control: a change that touches neither the config nor a Secret rolls nothing, so
    # the checksum above is not one that changes on every render.
    assert restarted(TOKENS, [*TOKENS, "mqtt.resources.limits.memory=512Mi"], helm_home) == set()
    # and the config checksum still rolls every service on a config change
    assert restarted(TOKENS, [*TOKENS, "kv.scrubOnFree=true"], helm_home) == set(ROLES)


def _secrets_checksum(
    secrets: dict[str, dict], names: list[str], keys: dict[str, list[str]] | None = None
) -> str:
    # What the chart hashes: {secret name: its data} of the Secrets a pod mounts (only the `keys`
    # it mounts of some), as Go's json.Marshal writes it (keys sorted, no spaces).
    keys = keys or {}
    used = {
        n: {k: v for k, v in secrets[n]["data"].items() if n not in keys or k in keys[n]}
        for n in names
        if n in secrets
    }
    text = json.dumps(used, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("sets", [[], TLS], ids=["generated-tokens", "generated-tokens+tls"])
def test_secrets_checksum_is_the_rendered_secrets(helm_home: Path, sets: list[str]) -> None:
    """The checksum describes exactly the Secrets rendered beside it, generated tokens included
    (the token is drawn once per render, not once per template that needs it)."""
    docs = render(helm_home, sets=sets)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    admin, node, tls = (f"{FULLNAME}-{s}" for s in ("admin-token", "node-token", "tls"))
    assert (tls in secrets) == bool(sets)
    pods = pod_annotations(docs)
    mqtt = f"{FULLNAME}-mqtt"
    assert set(secrets[mqtt]["data"]) == {"password", "reader-password"}
    # kvfence's pods mount the kvfence account's password only
    publisher = {mqtt: ["password"]}
    assert pods["control-plane"]["checksum/secrets"] == _secrets_checksum(
        secrets, [admin, node, tls, mqtt], publisher
    )
    for role in ("prefill", "decode"):
        assert pods[role]["checksum/secrets"] == _secrets_checksum(
            secrets, [node, tls, mqtt], publisher
        )
    broker = find(docs, "Deployment", f"{FULLNAME}-mosquitto")["spec"]["template"]["metadata"]
    assert broker["annotations"]["checksum/secrets"] == _secrets_checksum(secrets, [mqtt])


def test_user_provided_secrets_get_no_checksum(helm_home: Path) -> None:
    """An existingSecret is not rendered by the chart, so no checksum can follow it (values.yaml
    says to restart the pods after rotating one); the chart's own Secrets still count."""
    docs = render(helm_home, sets=["adminToken.existingSecret=ops-admin", "nodeToken.value=n"])
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    node, mqtt = f"{FULLNAME}-node-token", f"{FULLNAME}-mqtt"
    for role, pod in pod_annotations(docs).items():
        assert pod["checksum/secrets"] == _secrets_checksum(
            secrets, [node, mqtt], {mqtt: ["password"]}
        ), role
    everything_external = [
        "adminToken.existingSecret=ops-admin",
        "nodeToken.existingSecret=ops-node",
        "tls.enabled=true",
        "tls.existingSecret=ops-tls",
        "mqtt.auth.existingSecret=ops-mqtt",
    ]
    docs = render(helm_home, sets=everything_external)
    assert not [d for d in docs if d["kind"] == "Secret"]
    for pod in pod_annotations(docs).values():
        assert "checksum/secrets" not in pod
        assert "checksum/config" in pod


# --- monitoring ----------------------------------------------------------------------------------

MONITORING = ("monitoring.podMonitor.enabled=true", "monitoring.prometheusRule.enabled=true")


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_monitoring_objects_are_off_by_default(helm_home: Path) -> None:
    kinds = {d["kind"] for d in render(helm_home)}
    assert not kinds & {"PodMonitor", "PrometheusRule"}
    # control: asked for, both render
    kinds = {d["kind"] for d in render(helm_home, sets=MONITORING)}
    assert {"PodMonitor", "PrometheusRule"} <= kinds


def test_pod_monitor_scrapes_the_metrics_port_of_every_kvfence_service(helm_home: Path) -> None:
    """The PodMonitor's selector picks exactly the control plane, prefill and decode pods (not
    the broker's), each of which serves its metrics on the port it names, and it copies the
    component label the KvfenceTargetDown alert selects on."""
    docs = render(helm_home, sets=(*MONITORING, "monitoring.podMonitor.labels.release=prom"))
    pm = find(docs, "PodMonitor", FULLNAME)
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    selected = set()
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]
        if not _selects(pm["spec"]["selector"], pod["metadata"]["labels"]):
            continue
        selected.add(d["metadata"]["name"].removeprefix(f"{FULLNAME}-"))
        ports = {p["name"]: p["containerPort"] for p in container(d)["ports"]}
        env = {e["name"]: e.get("value") for e in container(d)["env"]}
        assert endpoint["port"] in ports
        assert env["KVFENCE__NODE__METRICS_PORT"] == str(ports[endpoint["port"]])
        assert env["KVFENCE__NODE__METRICS_HOST"] == "0.0.0.0"
    assert selected == {"control-plane", "prefill", "decode"}
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel["kvfence_component"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_component"
    ]


def test_prometheus_rule_is_the_alert_rule_file(helm_home: Path) -> None:
    """The PrometheusRule carries files/kvfence-alerts.yaml unchanged (its {{ $labels }}
    templates are Prometheus', and Helm must not have expanded them)."""
    docs = render(helm_home, sets=MONITORING)
    rule = find(docs, "PrometheusRule", FULLNAME)
    want = yaml.safe_load((CHART / "files" / "kvfence-alerts.yaml").read_text())
    assert rule["spec"] == want
    summaries = [r["annotations"]["summary"] for g in want["groups"] for r in g["rules"]]
    assert any("{{ $labels." in s for s in summaries)


def test_helm_lint_strict_with_monitoring(helm_home: Path) -> None:
    args = [a for s in MONITORING for a in ("--set", s)]
    proc = helm("lint", "--strict", str(CHART), *args, tmp=helm_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # control: a value the schema does not know fails the same lint
    proc = helm(
        "lint",
        "--strict",
        str(CHART),
        *args,
        "--set",
        "monitoring.podMonitor.intervall=1m",
        tmp=helm_home,
    )
    assert proc.returncode != 0


def test_runbook_label_selectors_match_the_pods(helm_home: Path) -> None:
    """RUNBOOK.md's `kubectl ... -l KEY=VALUE` must find the release's pods: a selector on a
    label the pod templates lack (it named app.kubernetes.io/part-of) finds nothing during an
    incident."""
    import re

    runbook = " ".join((ROOT / "RUNBOOK.md").read_text().split())  # commands wrap lines
    keys = set(re.findall(r"-l ([\w./-]+)=", runbook))
    assert keys, "the runbook names no label selector"
    pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in render(helm_home)
        if d["kind"] == "Deployment" and d["metadata"]["name"] != f"{FULLNAME}-mosquitto"
    ]
    assert len(pods) == 3
    for key in keys:
        assert all(key in labels for labels in pods), key
    # control: the key the runbook used to name is not on the pods
    assert not any("app.kubernetes.io/part-of" in labels for labels in pods)
