"""Static pre-launch check: KV pools against the context window (the incident's missing check)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvfence.cli import check as check_cli
from kvfence.config import ClusterConfig, ConfigError, Role, parse_config
from kvfence.config_check import PoolSample, evaluate, static_check
from kvfence.model.tiny import TINY_CONFIG

# The incident: 1,048,576-token context window, prefill pools of 681,280 tokens.
INCIDENT_CONTEXT = 1_048_576
INCIDENT_POOL_TOKENS = 681_280
# 46 layers x (K, V) x 64 tokens x 4 kv heads x 128 x 2 bytes (bfloat16)
INCIDENT_SHAPE = {"num_layers": 46, "num_kv_heads": 4, "head_dim": 128, "context_window": 1_048_576}
INCIDENT_PAGE_BYTES = 46 * 2 * 64 * 4 * 128 * 2
INCIDENT_PAGES = INCIDENT_POOL_TOKENS // 64  # 10,645


def make_config(
    *,
    prefill: dict[str, int] | None = None,
    decode: dict[str, int] | None = None,
    clamp: bool = False,
    **model: Any,
) -> ClusterConfig:
    """The incident's model and page layout; pools sound unless given."""
    data = {
        "model": {
            "name": "glm-5.3",
            "dtype": "bfloat16",
            "clamp_context": clamp,
            "shape": INCIDENT_SHAPE,
            **model,
        },
        "kv": {
            "page_size": 64,
            "prefill_pool": prefill or {"num_pages": 32_768},
            "decode_pool": decode or {"num_pages": 32_768},
        },
    }
    return parse_config(data, environ={})


def incident_config(clamp: bool = False) -> ClusterConfig:
    # A byte budget whose last partial page does not count.
    memory = INCIDENT_PAGES * INCIDENT_PAGE_BYTES + INCIDENT_PAGE_BYTES - 1
    return make_config(prefill={"memory_bytes": memory}, clamp=clamp)


def test_incident_config_fails_with_both_numbers() -> None:
    report = static_check(incident_config())

    assert report.ok is False
    assert report.context_window == INCIDENT_CONTEXT
    assert report.page_bytes == INCIDENT_PAGE_BYTES
    prefill, decode = report.pools
    assert (prefill.role, prefill.pages, prefill.tokens, prefill.ok) == (
        "prefill",
        INCIDENT_PAGES,
        INCIDENT_POOL_TOKENS,
        False,
    )
    assert "681280" in prefill.message and "1048576" in prefill.message
    assert "clamp_context" in prefill.message  # says how to accept it on purpose
    assert (decode.role, decode.ok) == ("decode", True)
    assert report.admissible_limit == INCIDENT_POOL_TOKENS
    assert report.summary.startswith("FAIL")


def test_incident_config_passes_when_clamped_on_purpose() -> None:
    report = static_check(incident_config(clamp=True))

    assert report.ok is True
    assert report.clamped is True
    assert report.admissible_limit == INCIDENT_POOL_TOKENS
    assert report.pools[0].ok is True
    assert "clamped" in report.pools[0].message
    assert report.summary.startswith("OK (clamped)")


def test_sound_config_passes_at_the_full_context_window() -> None:
    report = static_check(make_config())

    assert report.ok is True
    assert report.clamped is False
    assert report.admissible_limit == INCIDENT_CONTEXT
    assert [(p.role, p.pages, p.tokens, p.ok) for p in report.pools] == [
        ("prefill", 32_768, 2_097_152, True),
        ("decode", 32_768, 2_097_152, True),
    ]


def test_pool_exactly_the_context_window_passes_one_page_less_fails() -> None:
    exact = INCIDENT_CONTEXT // 64
    assert static_check(make_config(decode={"num_pages": exact})).ok is True
    short = static_check(make_config(decode={"num_pages": exact - 1}))
    assert short.ok is False
    assert short.pools[1].tokens == INCIDENT_CONTEXT - 64


@pytest.mark.parametrize(
    ("memory_bytes", "pages"),
    [
        (INCIDENT_PAGE_BYTES, 1),
        (2 * INCIDENT_PAGE_BYTES - 1, 1),
        (INCIDENT_PAGES * INCIDENT_PAGE_BYTES, INCIDENT_PAGES),
        (INCIDENT_PAGES * INCIDENT_PAGE_BYTES + INCIDENT_PAGE_BYTES - 1, INCIDENT_PAGES),
        ((INCIDENT_PAGES + 1) * INCIDENT_PAGE_BYTES, INCIDENT_PAGES + 1),
    ],
)
def test_memory_bytes_derives_whole_pages(memory_bytes: int, pages: int) -> None:
    report = static_check(make_config(prefill={"memory_bytes": memory_bytes}, clamp=True))
    assert report.page_bytes == 6_029_312
    assert (report.pools[0].pages, report.pools[0].tokens) == (pages, pages * 64)


def test_zero_page_pool_fails_even_when_clamped() -> None:
    empty = static_check(make_config(decode={"memory_bytes": INCIDENT_PAGE_BYTES - 1}, clamp=True))
    assert empty.ok is False
    assert (empty.pools[1].pages, empty.pools[1].ok) == (0, False)
    assert "0 pages" in empty.pools[1].message
    assert empty.admissible_limit == 0
    # Control: one page more is a (tiny, clamped) pool that passes.
    one = static_check(make_config(decode={"memory_bytes": INCIDENT_PAGE_BYTES}, clamp=True))
    assert one.ok is True
    assert one.admissible_limit == 64


def test_context_window_override_wins_over_the_shape() -> None:
    report = static_check(make_config(context_window=4096, prefill={"num_pages": 64}))
    assert (report.context_window, report.context_source) == (4096, "model.context_window")
    assert report.ok is True
    assert report.admissible_limit == 4096


def test_embedded_tiny_model_shape_when_no_path() -> None:
    report = static_check(parse_config({}, environ={}))

    tiny = TINY_CONFIG
    page_bytes = tiny["num_hidden_layers"] * 2 * 16 * tiny["num_key_value_heads"] * 32 * 4
    assert report.shape_source == "embedded tiny model"
    assert report.context_window == tiny["max_position_embeddings"] == 2048
    assert report.page_bytes == page_bytes
    assert report.ok is True


def write_checkpoint(folder: Path, **hf: Any) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def test_shape_from_checkpoint_config_json_with_defaults(tmp_path: Path) -> None:
    # No num_key_value_heads (= attention heads) and no head_dim (= hidden / heads).
    ckpt = write_checkpoint(
        tmp_path / "ckpt",
        num_hidden_layers=3,
        num_attention_heads=4,
        hidden_size=256,
        max_position_embeddings=1024,
    )
    cfg = parse_config({"model": {"path": str(ckpt), "dtype": "float16"}}, environ={})
    report = static_check(cfg)

    assert report.shape_source == str(ckpt / "config.json")
    assert report.context_window == 1024
    assert report.page_bytes == 3 * 2 * 16 * 4 * 64 * 2
    assert report.ok is True  # 256 pages x 16 = 4096 tokens


def test_shape_from_checkpoint_reads_kv_heads_and_head_dim(tmp_path: Path) -> None:
    ckpt = write_checkpoint(
        tmp_path / "ckpt",
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=96,
        hidden_size=512,
        max_position_embeddings=8192,
    )
    report = static_check(parse_config({"model": {"path": str(ckpt)}}, environ={}))
    assert report.page_bytes == 2 * 2 * 16 * 2 * 96 * 4
    assert report.ok is False  # 4096 tokens < 8192
    assert "4096" in report.pools[0].message and "8192" in report.pools[0].message


def test_missing_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    cfg = parse_config({"model": {"path": str(tmp_path / "nope")}}, environ={})
    with pytest.raises(ConfigError, match=r"config\.json.*model\.shape"):
        static_check(cfg)


def test_checkpoint_without_layers_is_a_config_error(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", num_attention_heads=4, hidden_size=64)
    cfg = parse_config({"model": {"path": str(ckpt)}}, environ={})
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        static_check(cfg)


def test_evaluate_per_node_samples_for_the_live_check() -> None:
    report = evaluate(
        source="10.0.0.1:50052",
        model="m",
        shape_source="control plane",
        context_window=1000,
        context_source="control plane",
        dtype="float16",
        page_size=10,
        page_bytes=1,
        clamp_context=False,
        pools=[PoolSample(Role.DECODE, 100, "decode-a"), PoolSample(Role.DECODE, 99, "decode-b")],
    )
    assert report.ok is False
    assert [(p.node_id, p.ok) for p in report.pools] == [("decode-a", True), ("decode-b", False)]
    assert "decode-b" in report.pools[1].message
    assert report.admissible_limit == 990


def test_report_json_round_trip() -> None:
    data = json.loads(static_check(incident_config()).to_json())
    assert data["ok"] is False
    assert data["clamped"] is True
    assert data["admissible_limit"] == INCIDENT_POOL_TOKENS
    assert data["context_window"] == INCIDENT_CONTEXT
    assert [p["tokens"] for p in data["pools"]] == [INCIDENT_POOL_TOKENS, 2_097_152]


# --- the command ------------------------------------------------------------------------------


def make_app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keeps check-config a subcommand
        pass

    check_cli.register(app, {})
    return app


def write_yaml(path: Path, cfg: ClusterConfig) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    return path


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(make_app(), ["check-config", *args])


def test_cli_static_incident_exits_1(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "incident.yaml", incident_config())
    result = run_cli("--static", str(path))
    assert result.exit_code == 1, result.output
    assert "681280" in result.output and "1048576" in result.output
    assert "FAIL" in result.output


def test_cli_static_sound_config_exits_0(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "sound.yaml", make_config())
    result = run_cli("--static", str(path))
    assert result.exit_code == 0, result.output
    assert "OK: admissible limit 1048576" in result.output


def test_cli_static_json(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "incident.yaml", incident_config(clamp=True))
    result = run_cli("--static", str(path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["ok"], data["admissible_limit"]) == (True, INCIDENT_POOL_TOKENS)


def test_cli_bad_config_exits_2_with_one_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("kv:\n  page_size: 0\n")
    result = run_cli("--static", str(path))
    assert result.exit_code == 2
    assert "kv.page_size" in result.stderr
    # Control: the same file with a valid page size runs the check.
    path.write_text("kv:\n  page_size: 16\n")
    assert run_cli("--static", str(path)).exit_code == 0


def test_cli_missing_file_exits_2(tmp_path: Path) -> None:
    result = run_cli("--static", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2
    assert "cannot read config file" in result.stderr


def test_cli_live_mode_needs_target_and_token() -> None:
    result = run_cli()
    assert result.exit_code == 2
    assert "--target" in result.stderr and "--admin-token" in result.stderr
    assert "not implemented" not in result.stderr


def test_cli_live_mode_unreachable_target_is_one_line() -> None:
    from stack_harness import free_port_pair

    result = run_cli("--target", f"127.0.0.1:{free_port_pair()}", "--admin-token", "t")
    assert result.exit_code == 2
    assert "UNAVAILABLE" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_static_and_target_together_is_a_usage_error(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "sound.yaml", make_config())
    result = run_cli("--static", str(path), "--target", "127.0.0.1:50052")
    assert result.exit_code == 2
    assert "not both" in result.stderr


def test_the_static_check_uses_a_mistral_sliding_window_as_the_context_window() -> None:
    from kvfence.config_check import shape_from_hf_config

    base = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    mistral = shape_from_hf_config({**base, "model_type": "mistral"}, "config.json")
    assert mistral.context_window == 4096  # what kvfence serves (kvfence.model.llama)
    # controls: the key means nothing to a Llama config, nor a window as long as the context
    llama = shape_from_hf_config({**base, "model_type": "llama"}, "config.json")
    assert llama.context_window == 32768
    wide = {**base, "model_type": "mistral", "sliding_window": 32768}
    assert shape_from_hf_config(wide, "config.json").context_window == 32768
