"""Config errors an operator meets before a service starts (``check-config --static``, the Helm
pre-install hook, reads the config through the same model).

- An error caused by a ``KVFENCE__`` variable names it, also when the error is about the section
  the variable set something in (its cross-field checks, a misspelled section name).
- ``tls.public_cert`` without ``tls.public_key`` (or the reverse) is refused at load.
- ``control_plane.admin_listen`` on ``control_plane.listen``'s port is refused at load.
- ``control_plane.admission_queue_per_tenant`` set larger than ``admission_queue`` is refused.
- Internal mTLS (``tls.internal_ca``/``internal_cert``/``internal_key``) without public TLS is
  refused at load and by ``check-config --static`` (REGISTRY_IN_CLEAR: the node token would reach
  the registry in clear); ``tls.internal_server_name`` without ``tls.internal_ca`` is refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvfence.config import REGISTRY_IN_CLEAR, ConfigError, load_config, parse_config


def _error(data: dict[str, object], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data, environ=env or {})
    return str(err.value)


# --- the variable behind an error -----------------------------------------------------------


def test_an_error_about_a_section_names_the_variables_that_set_something_in_it() -> None:
    # a section's own check (set exactly one of the two): the file gave one, the variable the other
    env = {"KVFENCE__KV__PREFILL_POOL__NUM_PAGES": "100"}
    msg = _error({"kv": {"prefill_pool": {"memory_bytes": 1 << 30}}}, env)
    assert "kv.prefill_pool" in msg and "(from KVFENCE__KV__PREFILL_POOL__NUM_PAGES)" in msg
    # two variables in the section: both named
    env = {
        "KVFENCE__KV__PREFILL_POOL__NUM_PAGES": "100",
        "KVFENCE__KV__PREFILL_POOL__MEMORY_BYTES": "1000000",
    }
    msg = _error({}, env)
    assert (
        "(from KVFENCE__KV__PREFILL_POOL__MEMORY_BYTES, KVFENCE__KV__PREFILL_POOL__NUM_PAGES)"
        in msg
    )
    # the username/password pair, and the heartbeat check
    msg = _error({}, {"KVFENCE__EVENTS__MQTT_USERNAME": "kv"})
    assert "mqtt_password_file" in msg and "(from KVFENCE__EVENTS__MQTT_USERNAME)" in msg
    msg = _error({}, {"KVFENCE__CONTROL_PLANE__NODE_TIMEOUT_S": "1"})
    assert "node_timeout_s" in msg and "(from KVFENCE__CONTROL_PLANE__NODE_TIMEOUT_S)" in msg
    # a section name that does not exist
    msg = _error({}, {"KVFENCE__CONTROLPLANE__LISTEN": "0.0.0.0:50051"})
    assert "controlplane" in msg and "(from KVFENCE__CONTROLPLANE__LISTEN)" in msg


def test_a_section_error_does_not_name_variables_of_fields_it_is_not_about() -> None:
    # The chart sets these on every control-plane pod: an error about the queue (from the file)
    # named them, sending the operator to the wrong place. Control: the queue's own variable is.
    chart = {
        "KVFENCE__CONTROL_PLANE__SHUTDOWN_GRACE_S": "20",
        "KVFENCE__CONTROL_PLANE__SHUTDOWN_REFUSE_S": "5",
    }
    queue = {"control_plane": {"admission_queue": 4, "admission_queue_per_tenant": 64}}
    msg = _error(queue, chart)
    assert "admission_queue_per_tenant (64)" in msg and "from KVFENCE__" not in msg
    env = {**chart, "KVFENCE__CONTROL_PLANE__ADMISSION_QUEUE": "4"}
    msg = _error({"control_plane": {"admission_queue_per_tenant": 64}}, env)
    assert "(from KVFENCE__CONTROL_PLANE__ADMISSION_QUEUE)" in msg


def test_control_an_error_in_the_field_a_variable_set_names_it_and_file_errors_name_none() -> None:
    # the direction that worked before: the variable's path holds the error's location
    msg = _error({}, {"KVFENCE__CONTROL_PLANE__LISTN": "0.0.0.0:50051"})
    assert "control_plane.listn" in msg and "(from KVFENCE__CONTROL_PLANE__LISTN)" in msg
    # the same section error from the file alone names no variable ...
    msg = _error({"kv": {"prefill_pool": {"memory_bytes": 1 << 30, "num_pages": 100}}})
    assert "kv.prefill_pool" in msg and "from KVFENCE__" not in msg
    # ... nor does one from the file with a variable set elsewhere
    env = {"KVFENCE__KV__DECODE_POOL__NUM_PAGES": "100"}
    msg = _error({"kv": {"prefill_pool": {"memory_bytes": 1 << 30, "num_pages": 100}}}, env)
    assert "kv.prefill_pool" in msg and "from KVFENCE__" not in msg
    # and a variable that is fine loads
    cfg = parse_config({}, environ={"KVFENCE__CONTROL_PLANE__NODE_TIMEOUT_S": "10"})
    assert cfg.control_plane.node_timeout_s == 10


# --- public TLS: both or neither -------------------------------------------------------------


def test_public_cert_without_key_and_key_without_cert_are_refused_at_load() -> None:
    msg = _error({"tls": {"public_cert": "/x.pem"}})
    assert "tls.public_cert is set but tls.public_key is not" in msg
    msg = _error({"tls": {"public_key": "/x.key"}})
    assert "tls.public_key is set but tls.public_cert is not" in msg
    # from the environment: the variable is named
    msg = _error({}, {"KVFENCE__TLS__PUBLIC_CERT": "/x.pem"})
    assert "tls.public_key is not" in msg and "(from KVFENCE__TLS__PUBLIC_CERT)" in msg


def test_control_public_tls_both_or_neither_loads() -> None:
    both = parse_config({"tls": {"public_cert": "/x.pem", "public_key": "/x.key"}}, environ={})
    assert both.tls.public_cert == Path("/x.pem") and both.tls.public_key == Path("/x.key")
    assert parse_config({}, environ={}).tls.public_cert is None


# --- the admin listener ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "admin"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("0.0.0.0:50051", "127.0.0.1:50051"),  # the wildcard takes the port on every interface
        ("127.0.0.1:50051", "[::]:50051"),
        # the same host or port spelt otherwise: each failed only at bind, after the model loaded
        ("localhost:50051", "127.0.0.1:50051"),
        ("[::1]:50051", "localhost:50051"),
        ("[::0]:50051", "127.0.0.1:50051"),
        ("[0:0::1]:50051", "[::1]:50051"),
        ("LocalHost:50051", "localhost:050051"),
        ("[::ffff:127.0.0.1]:50051", "127.0.0.1:50051"),
    ],
)
def test_admin_listen_on_the_public_port_is_refused(listen: str, admin: str) -> None:
    msg = _error({"control_plane": {"listen": listen, "admin_listen": admin}})
    assert "control_plane" in msg and "admin_listen" in msg and "take the same port" in msg


@pytest.mark.parametrize(
    ("listen", "admin"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50052"),  # the defaults
        ("127.0.0.1:0", "127.0.0.1:0"),  # ports of the system's choosing (tests, `kvfence up`)
        ("127.0.0.1:50051", "127.0.0.2:50051"),  # two addresses, one port each
        ("127.0.0.1:50051", "[::1]:50051"),  # loopback of each family
        ("localhost:50051", "127.0.0.2:50051"),
        ("localhost:50051", "localhost:50052"),
        ("[::1]:0", "localhost:00"),
    ],
)
def test_control_admin_listen_of_its_own_loads(listen: str, admin: str) -> None:
    cfg = parse_config({"control_plane": {"listen": listen, "admin_listen": admin}}, environ={})
    assert cfg.control_plane.admin_listen == admin


# --- the per-tenant share of the admission queue ----------------------------------------------


def test_per_tenant_share_larger_than_the_queue_is_refused() -> None:
    msg = _error({"control_plane": {"admission_queue": 4, "admission_queue_per_tenant": 64}})
    assert "admission_queue_per_tenant (64) must not exceed admission_queue (4)" in msg
    env = {"KVFENCE__CONTROL_PLANE__ADMISSION_QUEUE_PER_TENANT": "9"}
    msg = _error({"control_plane": {"admission_queue": 8}}, env)
    assert "admission_queue_per_tenant (9)" in msg
    assert "(from KVFENCE__CONTROL_PLANE__ADMISSION_QUEUE_PER_TENANT)" in msg


def test_control_per_tenant_share_within_the_queue_or_left_unset_loads() -> None:
    cp = parse_config(
        {"control_plane": {"admission_queue": 4, "admission_queue_per_tenant": 4}}, environ={}
    ).control_plane
    assert (cp.admission_queue, cp.admission_queue_per_tenant) == (4, 4)
    # left unset, the default (64) is cut to the queue as it loads: a lowered queue alone loads,
    # says the share in force, and a dump of it loads again (tests and tools dump configs)
    cfg = parse_config({"control_plane": {"admission_queue": 8}}, environ={})
    assert (cfg.control_plane.admission_queue, cfg.control_plane.admission_queue_per_tenant) == (
        8,
        8,
    )
    again = parse_config(cfg.model_dump(mode="json"), environ={}).control_plane
    assert (again.admission_queue, again.admission_queue_per_tenant) == (8, 8)


# --- check-config --static on the file of the review --------------------------------------------


def _check_static(config: dict[str, object], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "kvfence", "check-config", "--static", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_config_static_refuses_partial_public_tls(tmp_path: Path) -> None:
    bad = _check_static({"tls": {"public_cert": "/nonexistent.pem"}}, tmp_path)
    assert bad.returncode != 0
    assert "tls.public_key is not" in bad.stdout + bad.stderr
    # control: the same file without the half-set TLS passes
    good = _check_static({"control_plane": {"admission_queue": 8}}, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr


def test_load_config_refuses_the_reviews_file(tmp_path: Path) -> None:
    path = tmp_path / "partial_tls.yaml"
    path.write_text(
        "tls: {public_cert: /nonexistent.pem}\n"
        "control_plane: {admission_queue: 4, admission_queue_per_tenant: 64,"
        ' admin_listen: "127.0.0.1:50051"}\n'
    )
    with pytest.raises(ConfigError, match="take the same port"):
        load_config(path, environ={})
    # control: with its control_plane settings fixed, the TLS half is what is left to refuse
    path.write_text("tls: {public_cert: /nonexistent.pem}\n")
    with pytest.raises(ConfigError, match=r"tls\.public_key is not"):
        load_config(path, environ={})
    path.write_text("tls: {public_cert: /x.pem, public_key: /x.key}\n")
    assert load_config(path, environ={}).tls.public_key == Path("/x.key")


# --- internal mTLS needs public TLS; a node name to verify needs the internal CA ------------------

INTERNAL_TLS = {"internal_ca": "/ca.pem", "internal_cert": "/node.pem", "internal_key": "/node.key"}
PUBLIC_TLS = {"public_cert": "/x.pem", "public_key": "/x.key"}


def test_internal_mtls_without_public_tls_is_refused_at_load_and_by_check_config(
    tmp_path: Path,
) -> None:
    # nodes register (node token included) on the public listener: with mTLS between the
    # services and no public TLS, the token would go out in clear while the operator thinks the
    # cluster runs TLS
    assert REGISTRY_IN_CLEAR in _error({"tls": INTERNAL_TLS})
    env = {f"KVFENCE__TLS__{key.upper()}": value for key, value in INTERNAL_TLS.items()}
    msg = _error({}, env)
    assert REGISTRY_IN_CLEAR in msg
    assert (
        "(from KVFENCE__TLS__INTERNAL_CA, KVFENCE__TLS__INTERNAL_CERT, KVFENCE__TLS__INTERNAL_KEY)"
        in msg
    )
    bad = _check_static({"tls": INTERNAL_TLS}, tmp_path)
    assert bad.returncode != 0
    assert "node token would travel there in clear" in bad.stdout + bad.stderr


def test_control_internal_mtls_with_public_tls_loads(tmp_path: Path) -> None:
    both = {**INTERNAL_TLS, **PUBLIC_TLS}
    tls = parse_config({"tls": both}, environ={}).tls
    assert (tls.internal_ca, tls.public_cert) == (Path("/ca.pem"), Path("/x.pem"))
    good = _check_static({"tls": both}, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr


def test_internal_server_name_without_the_internal_ca_is_refused() -> None:
    # the control plane would call the nodes in clear: no node certificate the name is checked on
    msg = _error({"tls": {**PUBLIC_TLS, "internal_server_name": "kvfence-node"}})
    assert "internal_server_name without internal_ca" in msg
    msg = _error({}, {"KVFENCE__TLS__INTERNAL_SERVER_NAME": "kvfence-node"})
    assert "internal_server_name without internal_ca" in msg
    assert "(from KVFENCE__TLS__INTERNAL_SERVER_NAME)" in msg
    # control: with the internal CA (and the rest of the TLS set) the name loads
    tls = {**PUBLIC_TLS, **INTERNAL_TLS, "internal_server_name": "kvfence-node"}
    assert parse_config({"tls": tls}, environ={}).tls.internal_server_name == "kvfence-node"
