"""Config loading: YAML plus KVFENCE__ overrides; bad values name the field and the rule."""

from __future__ import annotations

import pytest

from kvfence.config import ConfigError, Role, load_config, parse_config

INF = float("inf")


def test_yaml_and_env_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "kv:\n  page_size: 32\n  decode_pool: {num_pages: 100}\nnode: {role: prefill}\n"
    )
    cfg = load_config(
        path, environ={"KVFENCE__NODE__ROLE": "decode", "KVFENCE__KV__PAGE_SIZE": "64"}
    )
    assert cfg.node.role == Role.DECODE
    assert cfg.kv.page_size == 64
    assert cfg.kv.decode_pool.num_pages == 100
    assert cfg.decode.stream_interval == 1  # the default: every token as it is sampled
    assert cfg.prefill.max_batch_tokens == 128
    assert (
        load_config(path, environ={"KVFENCE__DECODE__STREAM_INTERVAL": "4"}).decode.stream_interval
        == 4
    )
    # control: without overrides the file's values stand
    plain = load_config(path, environ={})
    assert plain.node.role == Role.PREFILL and plain.kv.page_size == 32


@pytest.mark.parametrize(
    ("data", "field", "rule"),
    [
        ({"kv": {"page_size": 0}}, "kv.page_size", "greater than or equal to 1"),
        (
            {"kv": {"decode_pool": {"num_pages": 4, "memory_bytes": 10}}},
            "kv.decode_pool",
            "exactly one",
        ),
        ({"model": {"dtype": "int3"}}, "model.dtype", "pattern"),
        ({"node": {"role": "router"}}, "node.role", "control-plane"),
        ({"transfer": {"bogus": 1}}, "transfer.bogus", "Extra inputs"),
        ({"decode": {"stream_interval": 0}}, "decode.stream_interval", "greater than or equal"),
        ({"decode": {"max_batch": 0}}, "decode.max_batch", "greater than or equal to 1"),
        ({"prefill": {"max_batch_tokens": 0}}, "prefill.max_batch_tokens", "greater than or equal"),
    ],
)
def test_bad_values_name_field_and_rule(data, field, rule):
    with pytest.raises(ConfigError) as err:
        parse_config(data, environ={})
    assert field in str(err.value)
    assert rule in str(err.value)


def test_pool_from_memory_budget():
    cfg = parse_config(
        {"kv": {"page_size": 16, "decode_pool": {"memory_bytes": 1 << 20}}}, environ={}
    )
    from kvfence.config import ModelShape

    shape = ModelShape(num_layers=2, num_kv_heads=2, head_dim=32, context_window=2048)
    page_bytes = cfg.page_bytes(shape)
    assert page_bytes == 2 * 2 * 16 * 2 * 32 * 4
    assert cfg.kv.decode_pool.pages_for(page_bytes) == (1 << 20) // page_bytes


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", environ={})


@pytest.mark.parametrize(
    ("data", "field", "rule"),
    [
        # a timeout shorter than two heartbeats makes healthy nodes flap lost/joined
        (
            {"control_plane": {"heartbeat_interval_s": 3, "node_timeout_s": 1}},
            "control_plane",
            "node_timeout_s (1) must be at least 2 x heartbeat_interval_s (3)",
        ),
        (
            {"control_plane": {"heartbeat_interval_s": 1, "node_timeout_s": 1.5}},
            "control_plane",
            "at least 2 x heartbeat_interval_s",
        ),
        # node ids become an MQTT topic level: wildcards and separators would lose its events
        ({"node": {"node_id": "bad+node"}}, "node.node_id", "pattern"),
        ({"node": {"node_id": "#"}}, "node.node_id", "pattern"),
        ({"node": {"node_id": "a/b"}}, "node.node_id", "pattern"),
        ({"node": {"node_id": "two words"}}, "node.node_id", "pattern"),
        # "" is not "no broker" (that is null): the publisher would retry it forever
        ({"events": {"mqtt_host": ""}}, "events.mqtt_host", "empty broker host"),
        ({"events": {"mqtt_host": "  "}}, "events.mqtt_host", "empty broker host"),
        # a broker account is a username and a password file, both or neither
        ({"events": {"mqtt_username": "kvfence"}}, "events", "mqtt_password_file is not"),
        ({"events": {"mqtt_password_file": "/run/pw"}}, "events", "mqtt_username is not"),
        (
            {"events": {"mqtt_username": " ", "mqtt_password_file": "/run/pw"}},
            "events.mqtt_username",
            "empty MQTT username",
        ),
        # TLS to the broker: a client certificate needs its key (and the reverse), and is only
        # for TLS, which needs the CA
        (
            {"events": {"mqtt_tls_ca_file": "/ca", "mqtt_tls_cert_file": "/c"}},
            "events",
            "mqtt_tls_cert_file is set but mqtt_tls_key_file is not",
        ),
        (
            {"events": {"mqtt_tls_ca_file": "/ca", "mqtt_tls_key_file": "/k"}},
            "events",
            "mqtt_tls_key_file is set but mqtt_tls_cert_file is not",
        ),
        (
            {"events": {"mqtt_tls_cert_file": "/c", "mqtt_tls_key_file": "/k"}},
            "events",
            "without mqtt_tls_ca_file",
        ),
        ({"events": {"mqtt_tls_ca": "/ca"}}, "events.mqtt_tls_ca", "Extra inputs"),
        # infinite numbers passed gt=0: nodes could not register (OverflowError turning the
        # interval into ms), every request failed DEADLINE_EXCEEDED at its first node call
        (
            {"control_plane": {"heartbeat_interval_s": INF, "node_timeout_s": INF}},
            "control_plane.heartbeat_interval_s",
            "finite number",
        ),
        (
            {"control_plane": {"default_deadline_s": INF, "max_deadline_s": INF}},
            "control_plane.default_deadline_s",
            "finite number",
        ),
        # so did a finite deadline past what grpc takes as a timeout (about 7.5e9 s)
        (
            {"control_plane": {"default_deadline_s": 1e10, "max_deadline_s": 1e10}},
            "control_plane.default_deadline_s",
            "less than or equal to 1000000000",
        ),
        ({"transfer": {"batch_timeout_s": INF}}, "transfer.batch_timeout_s", "finite number"),
        ({"node": {"drain_timeout_s": INF}}, "node.drain_timeout_s", "finite number"),
        # nodes get the interval in whole ms: under 1 ms it was 0, a busy loop of heartbeats
        (
            {"control_plane": {"heartbeat_interval_s": 0.0004, "node_timeout_s": 1}},
            "control_plane.heartbeat_interval_s",
            "greater than or equal to 0.001",
        ),
    ],
)
def test_values_that_break_the_service_later_are_refused(data, field, rule):
    with pytest.raises(ConfigError) as err:
        parse_config(data, environ={})
    assert field in str(err.value)
    assert rule in str(err.value)


def test_nearest_good_values_are_accepted():
    fast = parse_config({"control_plane": {"heartbeat_interval_s": 0.001}}, environ={})
    assert fast.control_plane.heartbeat_interval_s == 0.001  # 1 ms: the shortest nodes can get
    long = parse_config(
        {"control_plane": {"default_deadline_s": 1e6, "max_deadline_s": 1e6}}, environ={}
    )
    assert long.control_plane.default_deadline_s == 1e6  # long, but finite
    cfg = parse_config(
        {
            "control_plane": {"heartbeat_interval_s": 3, "node_timeout_s": 6},  # exactly 2x
            "node": {"node_id": "decode-0.zone_a"},
            "events": {"mqtt_host": "mosquitto.observability.svc"},
        },
        environ={},
    )
    assert cfg.control_plane.node_timeout_s == 6
    assert cfg.node.node_id == "decode-0.zone_a"
    assert cfg.events.mqtt_host == "mosquitto.observability.svc"
    # the defaults: no node id (derived at start), no broker, 5 heartbeats per timeout
    plain = parse_config({"events": {"mqtt_host": None}}, environ={})
    assert plain.node.node_id == "" and plain.events.mqtt_host is None
    assert plain.control_plane.node_timeout_s == 5 * plain.control_plane.heartbeat_interval_s


def test_mqtt_account_is_a_username_and_a_password_file():
    # control for the refusals above: both, from the file or from the environment; the password
    # itself is never a config field (it would sit in the file in clear)
    cfg = parse_config(
        {"events": {"mqtt_username": "kvfence", "mqtt_password_file": "/run/mqtt/password"}},
        environ={},
    )
    assert cfg.events.mqtt_username == "kvfence"
    assert str(cfg.events.mqtt_password_file) == "/run/mqtt/password"
    env = {
        "KVFENCE__EVENTS__MQTT_USERNAME": "0123",  # kept as written, like every string field
        "KVFENCE__EVENTS__MQTT_PASSWORD_FILE": "/etc/kvfence/mqtt/password",
    }
    cfg = parse_config({}, environ=env)
    assert cfg.events.mqtt_username == "0123"
    assert str(cfg.events.mqtt_password_file) == "/etc/kvfence/mqtt/password"
    assert parse_config({}, environ={}).events.mqtt_username is None  # default: anonymous
    with pytest.raises(ConfigError, match="mqtt_password"):
        parse_config({"events": {"mqtt_password": "in-clear"}}, environ={})


def test_mqtt_tls_is_a_ca_and_optionally_a_client_certificate():
    # control for the TLS refusals above: the CA alone, the CA with a client certificate and its
    # key, from the file or from the environment; none of the files is read here (kvfence
    # check-config --static runs where the Secrets are not mounted)
    cfg = parse_config({"events": {"mqtt_tls_ca_file": "/nowhere/ca.crt"}}, environ={})
    assert str(cfg.events.mqtt_tls_ca_file) == "/nowhere/ca.crt"
    assert cfg.events.mqtt_tls_cert_file is None and cfg.events.mqtt_tls_key_file is None
    env = {
        "KVFENCE__EVENTS__MQTT_TLS_CA_FILE": "/etc/kvfence/mqtt-tls/ca.crt",
        "KVFENCE__EVENTS__MQTT_TLS_CERT_FILE": "/etc/kvfence/mqtt-tls/tls.crt",
        "KVFENCE__EVENTS__MQTT_TLS_KEY_FILE": "/etc/kvfence/mqtt-tls/tls.key",
    }
    cfg = parse_config({}, environ=env)
    assert str(cfg.events.mqtt_tls_ca_file) == "/etc/kvfence/mqtt-tls/ca.crt"
    assert str(cfg.events.mqtt_tls_cert_file) == "/etc/kvfence/mqtt-tls/tls.crt"
    assert str(cfg.events.mqtt_tls_key_file) == "/etc/kvfence/mqtt-tls/tls.key"
    plain = parse_config({}, environ={}).events  # default: no TLS
    assert (plain.mqtt_tls_ca_file, plain.mqtt_tls_cert_file, plain.mqtt_tls_key_file) == (
        None,
        None,
        None,
    )


def test_env_overrides_keep_strings_as_written():
    env = {
        "KVFENCE__NODE__NODE_ID": "0123",  # YAML: the octal int 83
        "KVFENCE__CLUSTER": "2024",  # YAML: an int, refused by the str field
        "KVFENCE__NODE__ADVERTISE": "10.0.0.1:7000",
        "KVFENCE__EVENTS__MQTT_HOST": "broker # not a comment",
    }
    cfg = parse_config({}, environ=env)
    assert cfg.node.node_id == "0123"
    assert cfg.cluster == "2024"
    assert cfg.node.advertise == "10.0.0.1:7000"
    assert cfg.events.mqtt_host == "broker # not a comment"
    # control: non-string fields are still parsed as YAML, and null unsets an optional field
    parsed = parse_config(
        {"events": {"mqtt_host": "broker"}, "node": {"metrics_port": 9000}},
        environ={
            "KVFENCE__KV__PAGE_SIZE": "64",
            "KVFENCE__KV__SCRUB_ON_FREE": "true",
            "KVFENCE__TRANSFER__BATCH_TIMEOUT_S": "2.5",
            "KVFENCE__KV__DECODE_POOL": "{num_pages: 5}",
            "KVFENCE__NODE__METRICS_PORT": "null",
            "KVFENCE__EVENTS__MQTT_HOST": "null",
        },
    )
    assert parsed.kv.page_size == 64 and parsed.kv.scrub_on_free is True
    assert parsed.transfer.batch_timeout_s == 2.5
    assert parsed.kv.decode_pool.num_pages == 5
    assert parsed.node.metrics_port is None and parsed.events.mqtt_host is None


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"KVFENCE__": "x"}, ["KVFENCE__", "malformed"]),
        ({"KVFENCE__NODE__": "x"}, ["KVFENCE__NODE__", "malformed"]),
        ({"KVFENCE__NODE____ROLE": "decode"}, ["KVFENCE__NODE____ROLE", "malformed"]),
        (
            {"KVFENCE__NODE": "x", "KVFENCE__NODE__ROLE": "decode"},
            ["KVFENCE__NODE", "KVFENCE__NODE__ROLE", "conflict"],
        ),
        (
            {"KVFENCE__NODE__ROLE": "decode", "KVFENCE__node__role": "prefill"},
            ["KVFENCE__NODE__ROLE", "KVFENCE__node__role", "conflict"],
        ),
        ({"KVFENCE__KV__PAGE_SIZE": "[1"}, ["KVFENCE__KV__PAGE_SIZE", "YAML"]),
        ({"KVFENCE__KV__PAGE_SIZE": "big"}, ["kv.page_size", "KVFENCE__KV__PAGE_SIZE"]),
        ({"KVFENCE__NODE": "x"}, ["node", "KVFENCE__NODE"]),
        ({"KVFENCE__NODE__NODE_ID": "bad+node"}, ["node.node_id", "KVFENCE__NODE__NODE_ID"]),
        ({"KVFENCE__EVENTS__MQTT_HOST": ""}, ["events.mqtt_host", "KVFENCE__EVENTS__MQTT_HOST"]),
    ],
)
def test_bad_env_overrides_are_config_errors_naming_the_variable(env, names):
    with pytest.raises(ConfigError) as err:
        parse_config({}, environ=env)
    for name in names:
        assert name in str(err.value)


def test_env_override_controls_for_the_rejected_shapes():
    # the same variables one at a time, well-formed, are accepted
    assert parse_config({}, environ={"KVFENCE__NODE__ROLE": "decode"}).node.role == Role.DECODE
    cfg = parse_config({}, environ={"KVFENCE__NODE": "{role: prefill, node_id: p-1}"})
    assert cfg.node.role == Role.PREFILL and cfg.node.node_id == "p-1"
    assert parse_config({}, environ={"KVFENCE__KV__PAGE_SIZE": "32"}).kv.page_size == 32
    # names without the prefix are not overrides at all
    unrelated = {"KVFENCE_": "x", "KVFENCEX__NODE": "x"}
    assert parse_config({}, environ=unrelated).node.role == Role.CONTROL_PLANE


def test_default_deadline_may_not_exceed_max_deadline() -> None:
    from kvfence.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="max_deadline_s"):
        parse_config({"control_plane": {"default_deadline_s": 600, "max_deadline_s": 60}}, {})
    # control: within the cap it parses
    cfg = parse_config({"control_plane": {"default_deadline_s": 60, "max_deadline_s": 600}}, {})
    assert cfg.control_plane.max_deadline_s == 600


def test_shutdown_refuse_window_is_a_non_negative_duration() -> None:
    """control_plane.shutdown_refuse_s: how long a stopping control plane keeps its listeners
    open refusing requests (SHUTTING_DOWN) before it closes them; negative is refused, 0 (close
    as soon as nothing runs) and the env override are accepted, default 1 s."""
    for bad in (-1, -0.5):
        with pytest.raises(ConfigError) as err:
            parse_config({"control_plane": {"shutdown_refuse_s": bad}}, environ={})
        assert "control_plane.shutdown_refuse_s" in str(err.value)
        assert "greater than or equal to 0" in str(err.value)
    with pytest.raises(ConfigError, match=r"greater than .* \(from KVFENCE__CONTROL_PLANE__SHUT"):
        parse_config({}, environ={"KVFENCE__CONTROL_PLANE__SHUTDOWN_REFUSE_S": "-2"})
    # control: the default, 0, and a value from the environment (as the chart sets it)
    assert parse_config({}, environ={}).control_plane.shutdown_refuse_s == 1.0
    zero = parse_config({"control_plane": {"shutdown_refuse_s": 0}}, environ={})
    assert zero.control_plane.shutdown_refuse_s == 0
    env = {"KVFENCE__CONTROL_PLANE__SHUTDOWN_REFUSE_S": "2.5"}
    assert parse_config({}, environ=env).control_plane.shutdown_refuse_s == 2.5
