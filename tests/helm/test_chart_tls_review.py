"""The chart's tls.internalServerName: every pod mounts one internal.crt (a Secret), which cannot
name the pod IPs the nodes advertise and the control plane dials, so with tls.enabled the
rendered config always carries tls.internal_server_name, the name internal.crt must carry
(default <fullname>-node.<namespace>.svc), and the control plane verifies node certificates
against it."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from test_helm_chart import FULLNAME, K8S_VERSION, POD_ENV, find, node_config, render, template

TLS = ["tls.enabled=true", "tls.existingSecret=kvfence-tls"]
DEFAULT_NAME = f"{FULLNAME}-node.serving.svc"  # the release renders into namespace "serving"


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-tls-review")


def config_of(docs: list[dict], role: str):
    """The kvfence config the role's pod loads (ConfigMap plus env), validated by kvfence."""
    return node_config(docs, role, POD_ENV)


@pytest.mark.parametrize("role", ["control-plane", "prefill", "decode"])
def test_tls_config_names_what_node_certificates_are_verified_against(
    helm_home: Path, role: str
) -> None:
    docs = render(helm_home, sets=TLS)
    tls = config_of(docs, role).tls
    assert tls.internal_server_name == DEFAULT_NAME
    assert str(tls.internal_cert) == "/etc/kvfence/tls/internal.crt"
    named = render(helm_home, sets=[*TLS, "tls.internalServerName=kvfence-node.example.org"])
    assert config_of(named, role).tls.internal_server_name == "kvfence-node.example.org"
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_without_tls_the_config_carries_no_name(helm_home: Path) -> None:
    docs = render(helm_home, sets=["tls.internalServerName=kvfence-node.example.org"])
    assert config_of(docs, "control-plane").tls.internal_server_name is None
    assert (
        "internal_server_name"
        not in find(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    )


def test_values_schema_refuses_a_name_a_certificate_cannot_carry(helm_home: Path) -> None:
    for bad in ("two words", "node:50071", "*.svc"):
        rc, _, err = template(helm_home, sets=[*TLS, f"tls.internalServerName={bad}"])
        assert rc != 0 and "internalServerName" in err, err
    rc, _, err = template(helm_home, sets=[*TLS, "tls.internalServerName=node.svc"])
    assert rc == 0, err
