"""``kvfence generate`` on a terminal shows the control characters of the model's text escaped
(an ESC sequence in an answer could clear the operator's screen, move the cursor or rewrite the
window title, a carriage return hide what came before); a pipe or a file, and ``--json``, get
the text exactly as it came (kvfence/cli/generate.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from fake_client import FakeClientBase
from typer.testing import CliRunner

from kvfence import client as client_mod
from kvfence.cli import generate as generate_cli
from kvfence.client import GenerationChunk, Usage

TEXT = "ok\x1b]0;pwned\x07 \x1b[2J\rhidden\tkept\n\x9bend"


@pytest.fixture
def answering(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Client whose answer is TEXT, in two messages."""

    class FakeClient(FakeClientBase):
        def stream(self, prompt: str | None, **_: Any) -> Iterator[GenerationChunk]:
            yield GenerationChunk("r", [1, 2], TEXT[:10])
            yield GenerationChunk("r", [], TEXT[10:], "length", Usage(1, 2))

    monkeypatch.setattr(client_mod, "Client", FakeClient)


def generate(*args: str) -> Any:
    app = typer.Typer()
    generate_cli.register(app, {})
    app.command("noop")(lambda: None)  # a group, so the command is named
    result = CliRunner().invoke(app, ["generate", "--api-key", "k", "--prompt-ids", "1", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_control_characters_are_escaped_on_a_terminal_only(
    answering: None, monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    monkeypatch.setattr(generate_cli, "_is_terminal", lambda stream: terminal)
    out = generate().stdout
    if terminal:
        assert out == ("ok\\x1b]0;pwned\\x07 \\x1b[2J\\x0dhidden\tkept\n\\x9bend\n"), repr(out)
        assert not any(c in out for c in "\x1b\x07\r\x9b")
    else:  # control: a pipe gets the text as it came
        assert out == TEXT + "\n"


def test_json_is_the_text_as_it_came_on_a_terminal_too(
    answering: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generate_cli, "_is_terminal", lambda stream: True)
    assert json.loads(generate("--json").stdout)["text"] == TEXT
