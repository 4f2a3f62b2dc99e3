"""``kvfence generate``'s exit codes (kvfence/cli/generate.py): 0 the generation completed, 1 the
request was sent and failed (the control plane refused or failed it, could not be reached, or is
not the public API), 2 nothing was sent (usage, bad local input). Both used to exit 2, so a script
could not tell "called it wrong" from "the service refused".

Each code is checked on the same command with a stand-in Client that records whether anything was
sent, and the codes that need no server (an unreachable target, an unusable CA file) with the real
Client."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import typer
from fake_client import FakeClientBase
from test_tls import make_ca
from typer.testing import CliRunner

from kvfence import client as client_mod
from kvfence.cli import generate as generate_cli
from kvfence.client import GenerationChunk, Usage, build_request
from kvfence.errors import (
    IntegrityError,
    InvalidArgument,
    KvfenceError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

BASE = ("generate", "--target", "127.0.0.1:9", "--api-key", "k")


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    app = typer.Typer()
    generate_cli.register(app, {})
    app.command("noop")(lambda: None)  # a group, so the command is named
    return CliRunner().invoke(app, list(args), env=env)


def assert_exit(result: Any, code: int, *needles: str) -> None:
    """Exit ``code``, one line on stderr naming ``needles``, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.stderr, result.stderr


class Server:
    """What the stand-in Client's server does: answer, or fail the call with ``error`` after
    ``before`` chunks of text. ``sent`` records each request that reached it."""

    def __init__(self) -> None:
        self.error: KvfenceError | None = None
        self.before = 0
        self.sent: list[Any] = []


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Server:
    srv = Server()

    class FakeClient(FakeClientBase):
        def stream(self, prompt: str | None, **kw: Any) -> Iterator[GenerationChunk]:
            srv.sent.append(build_request(prompt, **kw))  # what the real one puts on the wire
            if srv.error is None:
                yield GenerationChunk("r", [1, 2], "ok")
                yield GenerationChunk("r", [], "!", "length", Usage(1, 2))
                return
            for _ in range(srv.before):
                yield GenerationChunk("r", [1], "x")
            raise srv.error

    monkeypatch.setattr(client_mod, "Client", FakeClient)
    return srv


# -- 0: the generation completed (the positive control of every case below) ----------------------


@pytest.mark.parametrize("args", [["--prompt-ids", "1"], ["hello"], ["--json", "hello"]])
def test_a_completed_generation_exits_0(server: Server, args: list[str]) -> None:
    result = invoke(*BASE, *args)
    assert_exit(result, 0)
    assert len(server.sent) == 1 and result.stderr == ""
    assert "ok!" in result.stdout


# -- 1: the request was sent and failed ----------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        Unavailable("model test-model is offline"),
        ResourceExhausted("tenant acme is at its concurrency limit"),
        IntegrityError("page checksum mismatch", reason="CHECKSUM_MISMATCH"),
        Unauthenticated("invalid API key"),
        # the control plane's own INVALID_ARGUMENT (over the admissible limit): it was sent
        InvalidArgument("prompt_tokens (1) + max_new_tokens (1000) > 64"),
    ],
    ids=lambda e: e.code.name,
)
@pytest.mark.parametrize("before", [0, 1], ids=["at-once", "mid-stream"])
def test_a_request_the_service_fails_exits_1(
    server: Server, error: KvfenceError, before: int
) -> None:
    server.error, server.before = error, before
    result = invoke(*BASE, "--prompt-ids", "1")
    assert_exit(result, 1, f"{error.code.name}: {error.message}")
    assert len(server.sent) == 1
    assert result.stdout == ("x\n" if before else "")


def test_the_wrong_api_exits_1(server: Server) -> None:
    """The admin port answers UNIMPLEMENTED: the request reached a server, which refused it."""
    server.error = KvfenceError("Method not found!")
    server.error.code = grpc.StatusCode.UNIMPLEMENTED  # as from_rpc_error builds it
    result = invoke(*BASE, "--prompt-ids", "1")
    assert_exit(result, 1, "127.0.0.1:9 does not serve the kvfence public API (UNIMPLEMENTED)")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on leaving: nothing listens there


def test_an_unreachable_target_exits_1() -> None:
    """The real Client, at a port nothing listens on."""
    target = f"127.0.0.1:{_closed_port()}"
    result = invoke(
        "generate", "--target", target, "--api-key", "k", "--prompt-ids", "1", "--timeout", "10"
    )
    assert_exit(result, 1, "UNAVAILABLE")


# -- 2: nothing was sent ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt-ids", "1", "--no-such-option"], "No such option"),
        (["--prompt-ids", "1", "-n", "0"], "--max-new-tokens"),
        (["--prompt-ids", "1,-2"], "token ids must be in"),
        (["--prompt-ids", "1", "--seed", "-1"], "--seed"),
        (["hello", "--prompt-ids", "1"], "give exactly one of PROMPT or --prompt-ids"),
        ([], "give exactly one of PROMPT or --prompt-ids"),
        # undecodable argv bytes arrive as lone surrogates: the wire cannot carry them
        (["--stop", "\udcff", "hello"], "INVALID_ARGUMENT: stop[0] is not valid UTF-8"),
        (["\udcff"], "INVALID_ARGUMENT: prompt is not valid UTF-8"),
        (["--prompt-ids", "1", "--tls-server-name", "cp.example"], "needs --tls-ca"),
    ],
)
def test_usage_and_bad_local_input_exit_2(server: Server, args: list[str], needle: str) -> None:
    result = invoke(*BASE, *args)
    assert_exit(result, 2, needle)
    assert server.sent == []


@pytest.mark.parametrize("key", ["", " "])
def test_an_empty_api_key_exits_2(server: Server, key: str) -> None:
    """``--api-key "$KEY"`` with KEY unset. Control: any key is sent (the server judges it)."""
    result = invoke("generate", "--api-key", key, "--prompt-ids", "1")
    assert_exit(result, 2, "--api-key (or KVFENCE_API_KEY) is empty")
    assert server.sent == []
    assert_exit(invoke("generate", "--api-key", "k", "--prompt-ids", "1"), 0)
    assert len(server.sent) == 1


def test_no_api_key_exits_2(server: Server) -> None:
    result = invoke("generate", "--prompt-ids", "1", env={"KVFENCE_API_KEY": ""})
    assert_exit(result, 2, "--api-key")
    assert server.sent == []
    # control: the key from the environment
    assert_exit(invoke("generate", "--prompt-ids", "1", env={"KVFENCE_API_KEY": "k"}), 0)


def test_an_unusable_ca_file_exits_2(tmp_path: Path) -> None:
    """The real Client reads the CA file before connecting. Control: a CA file that reads is
    used, and the request fails at the (absent) server instead: exit 1."""
    base = ["generate", "--target", f"127.0.0.1:{_closed_port()}", "--api-key", "k"]
    base += ["--prompt-ids", "1", "--timeout", "10"]
    result = invoke(*base, "--tls-ca", str(tmp_path / "missing.pem"))
    assert_exit(result, 2, "--tls-ca", "does not exist")
    not_pem = tmp_path / "not-pem.txt"
    not_pem.write_text("hello")
    assert_exit(invoke(*base, "--tls-ca", str(not_pem)), 2, "--tls-ca", "not PEM")
    make_ca(tmp_path, "ca")
    assert_exit(invoke(*base, "--tls-ca", str(tmp_path / "ca.pem")), 1, "UNAVAILABLE")


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("sk-demo\r", "'\\r' at offset 7: a key is printable ASCII (a key file with Windows"),
        ("sk\ndemo", "'\\n' at offset 2"),
        ("ключ", "'к' at offset 0"),
    ],
)
def test_a_key_grpc_cannot_send_exits_2_saying_why(key: str, needle: str) -> None:
    """The real Client: gRPC refuses such a header value before it connects, with "INTERNAL:
    Invalid metadata" and lines of C-core log. Control: a printable key is sent, and the request
    fails at the (absent) server: exit 1."""
    base = ["generate", "--target", f"127.0.0.1:{_closed_port()}", "--prompt-ids", "1"]
    result = invoke(*base, "--api-key", key, "--timeout", "10")
    assert_exit(result, 2, "--api-key (or KVFENCE_API_KEY) cannot be sent", needle)
    assert result.stderr.count("\n") == 1
    assert_exit(invoke(*base, "--api-key", "sk-demo", "--timeout", "10"), 1, "UNAVAILABLE")


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "1000000.5", "1e10", "inf"])
def test_a_timeout_not_above_0_or_too_large_exits_2(server: Server, timeout: str) -> None:
    """A deadline already past, or one beyond what gRPC can set, would fail DEADLINE_EXCEEDED
    with nothing sent. Control: a positive one is sent."""
    result = invoke(*BASE, "--prompt-ids", "1", "--timeout", timeout)
    assert_exit(result, 2, "--timeout must be above 0 and at most 1000000 seconds")
    assert server.sent == []
    assert_exit(invoke(*BASE, "--prompt-ids", "1", "--timeout", "0.5"), 0)
    assert len(server.sent) == 1


@pytest.mark.parametrize("timeout", ["1e10", "inf"])
def test_a_timeout_grpc_cannot_set_is_refused_before_the_real_client_calls(timeout: str) -> None:
    """The real Client, at a port nothing listens on: gRPC's deadline overflows, and the call
    failed at once DEADLINE_EXCEEDED (exit 1, as if sent). Control: the largest timeout taken
    reaches the connection attempt, UNAVAILABLE."""
    base = ["generate", "--target", f"127.0.0.1:{_closed_port()}", "--api-key", "k"]
    base += ["--prompt-ids", "1", "--timeout"]
    assert_exit(invoke(*base, timeout), 2, "--timeout must be above 0 and at most")
    assert_exit(invoke(*base, "1000000"), 1, "UNAVAILABLE")
