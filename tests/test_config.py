"""Config loading: YAML plus KVFENCE__ overrides; bad values name the field and the rule."""

from __future__ import annotations

import pytest

from kvfence.config import ConfigError, Role, load_config, parse_config


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
