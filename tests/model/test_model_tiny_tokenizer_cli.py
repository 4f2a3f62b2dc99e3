"""The embedded model, the tokenizers and the local CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvfence.cli import GROUPS, app
from kvfence.cli.local import register
from kvfence.model.loader import fingerprint, load_model
from kvfence.model.tiny import TINY_CONFIG, ensure_tiny_model, write_tiny_model
from kvfence.tokenizer import PLACEHOLDER, ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "héllo wörld 🙂\n\tend"


def test_init_tiny_is_deterministic(tmp_path: Path, tiny_dir: Path) -> None:
    a, b = write_tiny_model(tmp_path / "a"), write_tiny_model(tmp_path / "b")
    assert fingerprint(a) == fingerprint(b) == fingerprint(tiny_dir)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    loaded = load_model(a)
    assert loaded.shape.model_dump() == {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "context_window": 2048,
    }  # fmt: skip
    assert loaded.eos_token_ids == (2,) and loaded.args.vocab_size == TINY_CONFIG["vocab_size"]


def test_ensure_tiny_model_repairs_an_incomplete_folder(tmp_path: Path) -> None:
    target = ensure_tiny_model(tmp_path / "m")
    digest = fingerprint(target)
    (target / "model.safetensors").unlink()
    assert ensure_tiny_model(tmp_path / "m") == target
    assert fingerprint(target) == digest
    assert ensure_tiny_model(target) == target  # control: a complete folder is left as it is


def test_fingerprint_changes_with_one_weight_byte(tmp_path: Path) -> None:
    d = write_tiny_model(tmp_path / "t")
    before = fingerprint(d)
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (d / "model.safetensors").write_bytes(bytes(raw))
    assert fingerprint(d) != before


def test_the_text_fingerprint_follows_eos_ids_and_tokenizer_not_weights(tmp_path: Path) -> None:
    """Registration compares the weights' fingerprint and, beside it, the text fingerprint: the
    EOS ids in force and the tokenizer. A folder whose generation_config.json or tokenizer.json
    changed keeps its weights' fingerprint. Control: the control plane's view of a folder and a
    node's load of it agree (else every node would be refused)."""
    from control_plane.model_info import load_model_info
    from kvfence.config import parse_config

    a = write_tiny_model(tmp_path / "a")
    node = load_model(a)
    cp = load_model_info(parse_config({"model": {"path": str(a)}}, environ={}))
    assert node.text_fingerprint and node.text_fingerprint == cp.text_fingerprint
    b = write_tiny_model(tmp_path / "b")
    gen = json.loads((b / "generation_config.json").read_text())
    (b / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 250]}))
    assert fingerprint(b) == fingerprint(a)
    assert load_model(b).text_fingerprint != node.text_fingerprint
    c = write_tiny_model(tmp_path / "c")
    tok = json.loads((c / "tokenizer.json").read_text())
    tok["added_tokens"] = tok.get("added_tokens", [])[:-1]  # one special token fewer
    (c / "tokenizer.json").write_text(json.dumps(tok))
    assert fingerprint(c) == fingerprint(a)
    assert load_model(c).text_fingerprint != node.text_fingerprint
    # the same tokenizer written otherwise (another tokenizers release adds default-valued
    # keys; re-saved, minified, CRLF) is the same: refusing it refused a whole deployment
    d = write_tiny_model(tmp_path / "d")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["model"].pop("ignore_merges", None)  # as tokenizers 0.15 writes it
    (d / "tokenizer.json").write_bytes(json.dumps(tok, indent=1).replace("\n", "\r\n").encode())
    assert load_model(d).text_fingerprint == node.text_fingerprint


@pytest.mark.parametrize("kind", ["json", "bytes"])
def test_tokenizer_round_trip_and_unrenderable_ids(kind: str, tiny_dir: Path) -> None:
    tok = HFTokenizer(tiny_dir / "tokenizer.json") if kind == "json" else ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == [3 + b for b in TEXT.encode()]  # both agree on the byte ids
    assert tok.decode(ids) == TEXT
    assert tok.decode([*ids[:5], 383, 10**6, -1, *ids[5:7]]) == "héll" + PLACEHOLDER * 3 + "o "
    assert tok.decode([0, 1, 2]) == ""  # specials render as nothing
    assert tok.decode([3 + 0xF0]) == PLACEHOLDER  # a character cut after its first byte


def test_load_tokenizer_falls_back_to_bytes(tmp_path: Path, tiny_dir: Path) -> None:
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(tiny_dir), HFTokenizer)
    # A tokenizer in a format kvfence does not read is refused, never replaced by bytes.
    for name in ("tokenizer.model", "vocab.json"):
        other = tmp_path / name.replace(".", "_")
        other.mkdir()
        (other / name).write_text("{}")
        with pytest.raises(ValueError, match=f"has its tokenizer as {name}"):
            load_tokenizer(other)


@pytest.fixture(scope="module")
def cli() -> Any:
    if not any(c.name == "run" for c in app.registered_commands):
        register(app, GROUPS)
    return app


def test_cli_run_json_matches_the_engine(cli: Any, tiny_dir: Path) -> None:
    from kvfence.model.colocated import ColocatedEngine, GenerationRequest
    from kvfence.model.sampling import SamplingParams

    args = ["run", "--model", str(tiny_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "6"]
    result = CliRunner().invoke(cli, [*args, "--ignore-eos", "--page-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    engine = ColocatedEngine(load_model(tiny_dir), page_size=4, num_pages=8)
    (ref,) = engine.generate(
        [GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))]
    )
    assert got == {"token_ids": ref.token_ids, "text": ref.text, "finish_reason": "length"}


def test_cli_run_sampled_is_reproducible(cli: Any, tiny_dir: Path) -> None:
    args = ["run", "--model", str(tiny_dir), "hi", "--max-new-tokens", "8", "--json"]
    runs = [
        json.loads(CliRunner().invoke(cli, [*args, "--temperature", "1", "--seed", s]).stdout)
        for s in ("1", "1", "2")
    ]
    assert runs[0] == runs[1] and runs[0]["token_ids"] != runs[2]["token_ids"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "1", "hello"], "exactly one of"),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1", "--max-new-tokens", "5000"], "context window 2048"),
        (["--prompt-ids", "999"], "outside the vocabulary"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(
    cli: Any, tiny_dir: Path, extra: list[str], message: str
) -> None:
    result = CliRunner().invoke(cli, ["run", "--model", str(tiny_dir), *extra])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert result.stderr.startswith("error: ")


def test_cli_init_tiny(cli: Any, tmp_path: Path, tiny_dir: Path) -> None:
    result = CliRunner().invoke(cli, ["model", "init-tiny", str(tmp_path / "x")])
    assert result.exit_code == 0
    assert result.stdout.split() == [str(tmp_path / "x"), fingerprint(tiny_dir)]


def _wordpiece_json(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_text_bytes_per_token_bounds_every_encoding(tiny_dir: Path, tmp_path: Path) -> None:
    """The control plane refuses a text prompt of more than limit x ``max_text_bytes_per_token``
    bytes without tokenizing it: the bound must hold for any text (specials, multi-byte
    characters, long runs), or a prompt that fits would be refused."""
    texts = ["", "a", "</s><s><pad>", "héllo wörld ✓ 🙂", "ab" * 3000, "\n" * 500, "</s>" * 300]
    for tok in (HFTokenizer(tiny_dir / "tokenizer.json"), ByteTokenizer()):
        per = tok.max_text_bytes_per_token
        assert per is not None and per >= 1
        for text in texts:
            assert len(tok.encode(text)) * per >= len(text.encode("utf-8")), (text[:20], per)
    # a tokenizer with an unknown token maps a whole unknown word to one id: no bound exists
    wordpiece = HFTokenizer(_wordpiece_json(tmp_path / "wp.json"))
    assert len(wordpiece.encode("zzzzzzzzzzzzzzzzzzzz")) == 1
    assert wordpiece.max_text_bytes_per_token is None


def test_a_long_text_encodes_as_a_short_one_does(tiny_dir: Path) -> None:
    """Long texts take the call that releases the GIL (encode_batch): same ids as encode()."""
    from kvfence.tokenizer import UNLOCKED_ENCODE_CHARS

    tok = HFTokenizer(tiny_dir / "tokenizer.json")
    text = ("héllo </s> wörld " * UNLOCKED_ENCODE_CHARS)[:UNLOCKED_ENCODE_CHARS]
    assert tok.encode(text) == list(tok._tok.encode(text).ids)
    assert tok.encode(text[:100]) == list(tok._tok.encode(text[:100]).ids)  # control: short
