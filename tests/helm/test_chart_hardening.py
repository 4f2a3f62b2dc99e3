"""The chart against what the API server, Pod Security and kvfence would refuse after a render.

Each refusal has its valid neighbour beside it, which still renders (and passes
kubernetes_validate): UCX's TCP port ranges behind the NetworkPolicy, the node Deployments'
rollout strategy where pods hold devices, the pods' seccomp profile (Pod Security "restricted"),
controlPlane.maxDeadlineS against defaultDeadlineS, controlPlane.admissionQueuePerTenant against
admissionQueue, controlPlane.maxRequestBytes against kvfence's bounds, and the PodMonitor's
Prometheus durations.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_helm_chart import (
    BROKER_TLS,
    FULLNAME,
    GPU_VALUES,
    K8S_VERSION,
    check_config_static,
    container,
    find,
    hook_config,
    render,
    template,
)

from kvfence.config import ControlPlaneConfig, parse_config

NODE_ROLES = ("prefill", "decode")
EXAMPLE_RANGE = {"prefill": "13340-13349", "decode": "13440-13449"}


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-hardening")


def validate(docs: list[dict]) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def refused(home: Path, sets: list[str], values: tuple[Path, ...] = ()) -> str:
    """The render's error output; fails the test when the render succeeds."""
    rc, _, err = template(home, values, sets)
    assert rc != 0, f"rendered: {sets}"
    return err


def env_of(deployment: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container(deployment)["env"]}


def ucx_ports(docs: list[dict], role: str, peer: str) -> list[dict]:
    """The ports the role's NetworkPolicy opens to the pods of `peer` (UCX's rule)."""
    rules = find(docs, "NetworkPolicy", f"{FULLNAME}-{role}")["spec"]["ingress"]
    for rule in rules:
        peers = [
            p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for p in rule.get("from", [])
            if "podSelector" in p
        ]
        if peers == [peer]:
            return rule["ports"]
    return []


# --- UCX's TCP port range behind the NetworkPolicy ---------------------------------------------


@pytest.mark.parametrize("role", NODE_ROLES)
def test_an_empty_tcp_port_range_behind_the_network_policy_is_refused(
    helm_home: Path, role: str
) -> None:
    """ "" leaves UCX's TCP transport on an ephemeral port that the role's NetworkPolicy, on by
    default, cannot open: with UCX over TCP (the default "tcp,self") every KV transfer would be
    dropped. Refused, naming both ways out; each of them renders."""
    peer = "decode" if role == "prefill" else "prefill"
    err = refused(helm_home, [f"{role}.ucx.tcpPortRange="])
    assert f'{role}.ucx.tcpPortRange is "" with networkPolicy.enabled' in err, err
    assert f"the {role} NetworkPolicy cannot open to {peer} pods" in err, err
    assert f'Set {role}.ucx.tcpPortRange (e.g. "{EXAMPLE_RANGE[role]}")' in err, err
    assert "networkPolicy.enabled=false" in err, err

    # control: the default range is set and opened to the peer, port to endPort
    docs = render(helm_home)
    low, high = (int(p) for p in EXAMPLE_RANGE[role].split("-"))
    assert (
        env_of(find(docs, "Deployment", f"{FULLNAME}-{role}"))["UCX_TCP_PORT_RANGE"]
        == (EXAMPLE_RANGE[role])
    )
    assert {"port": low, "endPort": high, "protocol": "TCP"} in ucx_ports(docs, role, peer)

    # control: without the NetworkPolicy, "" renders (UCX picks its port), and so it does
    # without TCP in ucx.tls (RDMA bypasses NetworkPolicy; the listener port stays open)
    for sets in (
        [f"{role}.ucx.tcpPortRange=", "networkPolicy.enabled=false"],
        [f"{role}.ucx.tcpPortRange=", f"{role}.ucx.tls=rc\\,cuda_copy"],
    ):
        docs = render(helm_home, sets=sets)
        validate(docs)
        assert "UCX_TCP_PORT_RANGE" not in env_of(find(docs, "Deployment", f"{FULLNAME}-{role}"))


@pytest.mark.parametrize(
    ("tls", "takes_tcp"),
    [
        ("tcp,self", True),
        ("all", True),
        ("rc,cuda_copy,cuda_ipc,tcp", True),  # ci/gpu-rdma-values.yaml
        (" rc , TCP ", True),
        ("rc,ud:aux,tcp:aux", True),
        ("^rc", True),  # all but rc
        ("rc,cuda_copy", False),
        ("self,sm", False),
        ("^tcp", False),  # all but tcp
        ("^rc,tcp", False),
    ],
)
def test_which_ucx_tls_take_tcp(helm_home: Path, tls: str, takes_tcp: bool) -> None:
    """UCX_TLS syntax: a list, "all", or "^" (all but the list); a name may end ":aux"."""
    escaped = tls.replace(",", "\\,")  # --set splits at commas
    sets = ["decode.ucx.tcpPortRange=", f"decode.ucx.tls={escaped}"]
    rc, _, err = template(helm_home, sets=sets)
    if takes_tcp:
        assert rc != 0 and 'decode.ucx.tcpPortRange is ""' in err, err
    else:
        assert rc == 0, err


@pytest.mark.parametrize("role", NODE_ROLES)
@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            "13449-13440",
            '{role}.ucx.tcpPortRange "13449-13440" is reversed: give the low port first'
            " (13440-13449)",
        ),
        (
            "70000-70001",
            '{role}.ucx.tcpPortRange "70000-70001": both ports must lie within 1-65535',
        ),
        (
            "13440-70000",
            '{role}.ucx.tcpPortRange "13440-70000": both ports must lie within 1-65535',
        ),
        # the schema: no port 0, no leading zero (which sprig's int reads as octal), two ports
        ("0-10", "/{role}/ucx/tcpPortRange"),
        ("00080-00089", "/{role}/ucx/tcpPortRange"),
        ("13440", "/{role}/ucx/tcpPortRange"),
    ],
)
def test_a_tcp_port_range_the_api_server_would_refuse_is_refused(
    helm_home: Path, role: str, bad: str, error: str
) -> None:
    """A reversed or out-of-range pair would render a NetworkPolicy (port, endPort) that the API
    server refuses at install, after the pre-install hook has run."""
    err = refused(helm_home, [f"{role}.ucx.tcpPortRange={bad}"])
    assert error.format(role=role) in err, err


@pytest.mark.parametrize("role", NODE_ROLES)
@pytest.mark.parametrize("good", ["13440-13440", "1-9089", "60000-65535", "80-89"])
def test_a_tcp_port_range_within_bounds_renders(helm_home: Path, role: str, good: str) -> None:
    """Control for the refusals above: a one-port range and ranges reaching either bound render
    and validate (1-65535 itself would hold the role's own ports, which the chart refuses)."""
    peer = "decode" if role == "prefill" else "prefill"
    docs = render(helm_home, sets=[f"{role}.ucx.tcpPortRange={good}"])
    validate(docs)
    low, high = (int(p) for p in good.split("-"))
    assert {"port": low, "endPort": high, "protocol": "TCP"} in ucx_ports(docs, role, peer)


# --- rollout strategy of pods holding devices --------------------------------------------------

NO_SURGE = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def strategies(docs: list[dict]) -> dict[str, dict | None]:
    return {
        role: find(docs, "Deployment", f"{FULLNAME}-{role}")["spec"].get("strategy")
        for role in NODE_ROLES
    }


def test_pods_holding_devices_roll_out_without_surge(helm_home: Path) -> None:
    """Kubernetes' default rollout (maxSurge 25%, at least one pod) starts the new pod first: on a
    cluster with no spare GPU or HCA it stays Pending and the old pod is never removed. Pods
    requesting devices are replaced one at a time instead, each taking its predecessor's."""
    docs = render(helm_home, [GPU_VALUES])
    validate(docs)
    assert strategies(docs) == {"prefill": NO_SURGE, "decode": NO_SURGE}
    # control: the CPU defaults keep Kubernetes' default (a spare CPU pod is cheap)
    assert strategies(render(helm_home)) == {"prefill": None, "decode": None}


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["decode.gpu.enabled=true"], {"prefill": None, "decode": NO_SURGE}),
        (["prefill.rdma.enabled=true"], {"prefill": NO_SURGE, "decode": None}),
        # an extended resource given in resources, not through gpu / rdma
        (["prefill.resources.limits.amd\\.com/gpu=1"], {"prefill": NO_SURGE, "decode": None}),
        # a DRA resource claim
        (["decode.resources.claims[0].name=gpu"], {"prefill": None, "decode": NO_SURGE}),
        # native resources only: hugepages are not a device
        (["decode.resources.limits.hugepages-2Mi=1Gi"], {"prefill": None, "decode": None}),
    ],
)
def test_which_pods_hold_devices(
    helm_home: Path, sets: list[str], expected: dict[str, dict | None]
) -> None:
    assert strategies(render(helm_home, sets=sets)) == expected


def test_a_given_strategy_replaces_the_charts(helm_home: Path) -> None:
    """An operator with spare devices (or other needs) chooses: the value is used whole."""
    surge = {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    docs = render(
        helm_home,
        [GPU_VALUES],
        sets=[
            "decode.strategy.type=Recreate",
            "prefill.strategy.rollingUpdate.maxSurge=1",
            "prefill.strategy.rollingUpdate.maxUnavailable=0",
        ],
    )
    validate(docs)
    assert strategies(docs) == {"prefill": surge, "decode": {"type": "Recreate"}}
    # on a CPU role too
    docs = render(helm_home, sets=["decode.strategy.rollingUpdate.maxUnavailable=50%"])
    assert strategies(docs)["decode"] == {"rollingUpdate": {"maxUnavailable": "50%"}}


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            ["decode.strategy.type=Recreate", "decode.strategy.rollingUpdate.maxSurge=1"],
            "decode.strategy: type Recreate takes no rollingUpdate",
        ),
        (
            [
                "prefill.strategy.rollingUpdate.maxSurge=0",
                "prefill.strategy.rollingUpdate.maxUnavailable=0%",
            ],
            "prefill.strategy.rollingUpdate: maxSurge and maxUnavailable are both 0",
        ),
        (["decode.strategy.type=Rolling"], "/decode/strategy/type"),
        (["decode.strategy.rollingUpdate.maxSurge=-1"], "/decode/strategy/rollingUpdate/maxSurge"),
        (["decode.strategy.rollingUpdate.maxSurge=1.5"], "/decode/strategy/rollingUpdate/maxSurge"),
        (["decode.strategy.rollingUpdate.maxSurg=1"], "/decode/strategy/rollingUpdate"),
    ],
)
def test_a_strategy_the_api_server_would_refuse_is_refused(
    helm_home: Path, bad: list[str], error: str
) -> None:
    assert error in refused(helm_home, bad)


# --- seccomp: Pod Security "restricted" --------------------------------------------------------

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
# Every pod the chart can render: the services, the hook, the tenant backup, Mosquitto with its
# init container (accounts) and its certificate reloader (TLS).
ALL_PODS = ["controlPlane.backup.enabled=true", *BROKER_TLS]


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Every pod template in the render, by its owner's kind/name."""
    pods = {}
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if "template" in spec:
            pods[f"{d['kind']}/{d['metadata']['name']}"] = spec["template"]["spec"]
    return pods


def restricted_violations(pod: dict) -> list[str]:
    """What the Pod Security "restricted" level (Kubernetes' pod-security-standards) refuses in a
    pod spec, for the fields this chart sets."""
    found = []
    psc = pod.get("securityContext") or {}
    containers = pod.get("initContainers", []) + pod["containers"]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(key)
    for v in pod.get("volumes", []):
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']}")
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            found.append(f"{name}: capabilities.drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities.add")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
    return found


def test_every_pod_meets_pod_security_restricted(helm_home: Path) -> None:
    """Every pod, hooks and the backup included, sets seccompProfile RuntimeDefault at pod level:
    a namespace labelled pod-security.kubernetes.io/enforce=restricted admits them all."""
    docs = render(helm_home, sets=ALL_PODS)
    validate(docs)
    pods = pod_templates(docs)
    assert set(pods) == {
        f"Deployment/{FULLNAME}-control-plane",
        f"Deployment/{FULLNAME}-prefill",
        f"Deployment/{FULLNAME}-decode",
        f"Deployment/{FULLNAME}-mosquitto",
        f"Job/{FULLNAME}-config-check",
        f"CronJob/{FULLNAME}-tenant-backup",
    }
    for name, pod in pods.items():
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert restricted_violations(pod) == [], name
    # control: the check sees a pod without a profile
    broker = pods[f"Deployment/{FULLNAME}-mosquitto"]
    del broker["securityContext"]["seccompProfile"]
    assert restricted_violations(broker) == [
        "passwords: seccompProfile None",
        "mosquitto: seccompProfile None",
        "cert-reloader: seccompProfile None",
    ]


def test_the_seccomp_profile_and_the_brokers_pod_security_can_be_overridden(
    helm_home: Path,
) -> None:
    """The defaults merge with the operator's values: one key changes, the others stay."""
    localhost = {"type": "Localhost", "localhostProfile": "profiles/kvfence.json"}
    docs = render(
        helm_home,
        sets=[
            *ALL_PODS,
            "podSecurityContext.seccompProfile.type=Localhost",
            "podSecurityContext.seccompProfile.localhostProfile=profiles/kvfence.json",
            "mqtt.podSecurityContext.runAsUser=2000",
        ],
    )
    validate(docs)
    for name, pod in pod_templates(docs).items():
        psc = pod["securityContext"]
        if name.endswith("-mosquitto"):
            assert psc == {
                "runAsNonRoot": True,
                "runAsUser": 2000,
                "runAsGroup": 1883,
                "fsGroup": 1883,
                "seccompProfile": {"type": "RuntimeDefault"},
            }
        else:
            assert psc["seccompProfile"] == localhost, name
            assert psc["runAsUser"] == 10001, name
        assert restricted_violations(pod) == [], name
    # null drops a default (a cluster whose runtime has no seccomp)
    docs = render(
        helm_home,
        sets=[
            "podSecurityContext.seccompProfile=null",
            "mqtt.podSecurityContext.seccompProfile=null",
        ],
    )
    validate(docs)
    for name, pod in pod_templates(docs).items():
        assert "seccompProfile" not in pod["securityContext"], name
        assert pod["securityContext"]["runAsNonRoot"] is True, name


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            ["podSecurityContext.seccompProfile.type=Localhost"],
            "missing property 'localhostProfile'",
        ),
        (
            ["mqtt.podSecurityContext.seccompProfile.localhostProfile=p.json"],
            "/mqtt/podSecurityContext/seccompProfile/localhostProfile",
        ),
        (
            ["podSecurityContext.seccompProfile.type=Default"],
            "/podSecurityContext/seccompProfile/type",
        ),
        (["podSecurityContext.seccompProfle.type=RuntimeDefault"], "'seccompProfle' not allowed"),
        (["mqtt.podSecurityContext.runAsUser=-1"], "/mqtt/podSecurityContext/runAsUser"),
        (["mqtt.podSecurityContext.runAsNonRoot=yes"], "/mqtt/podSecurityContext/runAsNonRoot"),
    ],
)
def test_a_pod_security_context_the_api_server_would_refuse_is_refused(
    helm_home: Path, bad: list[str], error: str
) -> None:
    assert error in refused(helm_home, bad)


# --- deadlines ---------------------------------------------------------------------------------


def deadlines(docs: list[dict]) -> tuple[float, float]:
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    cp = parse_config(yaml.safe_load(text), environ={}).control_plane
    return cp.default_deadline_s, cp.max_deadline_s


def test_a_default_deadline_over_the_maximum_is_refused(helm_home: Path, tmp_path: Path) -> None:
    """kvfence refuses default_deadline_s > max_deadline_s at start (and the hook at install):
    the chart says so at render, and maxDeadlineS raises the maximum."""
    ours = ControlPlaneConfig()
    assert deadlines(render(helm_home)) == (ours.default_deadline_s, ours.max_deadline_s)
    err = refused(helm_home, ["controlPlane.defaultDeadlineS=4000"])
    assert "controlPlane.defaultDeadlineS 4000 exceeds controlPlane.maxDeadlineS 3600" in err, err
    # control: with the maximum raised, kvfence and its hook take both
    docs = render(
        helm_home, sets=["controlPlane.defaultDeadlineS=4000", "controlPlane.maxDeadlineS=7200"]
    )
    assert deadlines(docs) == (4000, 7200)
    proc = check_config_static(hook_config(docs), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # equal is allowed; so is kvfence's own bound, a billion seconds
    assert deadlines(render(helm_home, sets=["controlPlane.maxDeadlineS=120"])) == (120, 120)
    assert deadlines(render(helm_home, sets=["controlPlane.maxDeadlineS=1000000000"]))[1] == 1e9


@pytest.mark.parametrize(
    "bad",
    [
        "controlPlane.maxDeadlineS=0",
        "controlPlane.maxDeadlineS=1000000001",
        "controlPlane.defaultDeadlineS=1000000001",
    ],
)
def test_deadlines_out_of_kvfences_bounds_are_refused(helm_home: Path, bad: str) -> None:
    assert f"/controlPlane/{bad.split('.')[1].split('=')[0]}" in refused(helm_home, [bad])


# --- admission queue and request size ----------------------------------------------------------


def control_plane_of(docs: list[dict]) -> tuple[ControlPlaneConfig, dict]:
    """The control plane's config as kvfence loads it, and its section as the chart wrote it."""
    raw = yaml.safe_load(find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"])
    return parse_config(raw, environ={}).control_plane, raw["control_plane"]


def hook_passes(docs: list[dict], tmp_path: Path) -> None:
    proc = check_config_static(hook_config(docs), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_lowered_admission_queue_alone_passes_the_hook(helm_home: Path, tmp_path: Path) -> None:
    """kvfence refuses an admission_queue_per_tenant set over admission_queue, and cuts its unset
    default (64) to a lowered queue: the chart leaves the key out unless it is set, so lowering
    admissionQueue alone renders a config kvfence and its hook take, with the share cut to it."""
    # control: the defaults, as kvfence's own
    docs = render(helm_home)
    cp, _ = control_plane_of(docs)
    assert (cp.admission_queue, cp.admission_queue_per_tenant) == (256, 64)
    hook_passes(docs, tmp_path)
    docs = render(helm_home, sets=["controlPlane.admissionQueue=32"])
    cp, raw = control_plane_of(docs)
    assert "admission_queue_per_tenant" not in raw
    assert (cp.admission_queue, cp.admission_queue_per_tenant) == (32, 32)
    hook_passes(docs, tmp_path)


def test_a_per_tenant_share_over_the_admission_queue_is_refused(
    helm_home: Path, tmp_path: Path
) -> None:
    """Set explicitly, a share over the queue is what kvfence refuses at start: the chart says so
    at render, naming both values."""
    err = refused(
        helm_home, ["controlPlane.admissionQueue=32", "controlPlane.admissionQueuePerTenant=64"]
    )
    assert "controlPlane.admissionQueuePerTenant 64 exceeds controlPlane.admissionQueue 32" in err
    # an upgrade with --reuse-values carries an earlier chart's explicit 64: the way out is named
    assert "--set controlPlane.admissionQueuePerTenant=null" in err
    # control: a share equal to the queue, or under it, is written as set and passes the hook
    for share in (32, 8):
        docs = render(
            helm_home,
            sets=[
                "controlPlane.admissionQueue=32",
                f"controlPlane.admissionQueuePerTenant={share}",
            ],
        )
        cp, raw = control_plane_of(docs)
        assert raw["admission_queue_per_tenant"] == cp.admission_queue_per_tenant == share
        hook_passes(docs, tmp_path)


def test_max_request_bytes_reaches_the_config_the_hook_checks(
    helm_home: Path, tmp_path: Path
) -> None:
    """controlPlane.maxRequestBytes is written to the config file, which the pre-install hook
    checks (controlPlane.env never reaches it); null leaves kvfence's default."""
    cp, raw = control_plane_of(render(helm_home))  # control: the default, kvfence's own
    assert "max_request_bytes" not in raw
    assert cp.max_request_bytes == ControlPlaneConfig().max_request_bytes == 16 << 20
    for size in (64 << 10, 1 << 20, 64 << 20):  # kvfence's bounds are inclusive
        docs = render(helm_home, sets=[f"controlPlane.maxRequestBytes={size}"])
        cp, raw = control_plane_of(docs)
        assert raw["max_request_bytes"] == cp.max_request_bytes == size
        hook_passes(docs, tmp_path)


@pytest.mark.parametrize(
    "bad",
    [
        "controlPlane.maxRequestBytes=65535",
        "controlPlane.maxRequestBytes=67108865",
        "controlPlane.maxRequestBytes=16MiB",
        "controlPlane.maxRequestBytes=0",
    ],
)
def test_max_request_bytes_out_of_kvfences_bounds_is_refused(helm_home: Path, bad: str) -> None:
    # what kvfence would refuse at start (64 KiB..64 MiB), in every pod reading the config
    assert "/controlPlane/maxRequestBytes" in refused(helm_home, [bad])


# --- PodMonitor interval -----------------------------------------------------------------------

MONITOR = ["monitoring.podMonitor.enabled=true"]


@pytest.mark.parametrize("interval", ["30s", "1m30s", "1m", "1h30m15s", "500ms", "2d", "1w"])
def test_the_pod_monitor_takes_prometheus_durations(helm_home: Path, interval: str) -> None:
    docs = render(helm_home, sets=[*MONITOR, f"monitoring.podMonitor.interval={interval}"])
    (endpoint,) = find(docs, "PodMonitor", FULLNAME)["spec"]["podMetricsEndpoints"]
    assert endpoint["interval"] == interval


@pytest.mark.parametrize("interval", ["30", "1.5m", "30s1m", "1m 30s", "30x", "-1s", ""])
def test_the_pod_monitor_refuses_what_prometheus_refuses(helm_home: Path, interval: str) -> None:
    """Units largest first, each once, whole numbers (Prometheus' model.ParseDuration)."""
    err = refused(helm_home, [*MONITOR, f"monitoring.podMonitor.interval={interval}"])
    assert "/monitoring/podMonitor/interval" in err, err
