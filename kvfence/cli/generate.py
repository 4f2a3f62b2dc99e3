"""``kvfence generate``: stream a generation from a running cluster.

Text goes to stdout as it arrives; ``--json`` prints one object with the token ids, text, finish
reason and usage instead. ``--tls-server-name`` (env KVFENCE_TLS_SERVER_NAME) is the name the
certificate carries when it does not name the host of ``--target`` (through a port-forward).

Exit codes, so that a script can tell "called wrong" from "the service refused" (the admin
commands and ``kvfence events`` also exit 1 for a failure at or with the server and 2 for a usage
error, but the admin commands exit 1 for a missing token or an unusable CA):

- 0: the generation completed.
- 1 (EXIT_FAILED): the request was sent and failed: the control plane refused or failed it
  (``STATUS: message`` on stderr: UNAVAILABLE, RESOURCE_EXHAUSTED, UNAUTHENTICATED for a key it
  does not know, INVALID_ARGUMENT for a request over the model's limit ...), it could not be
  reached (or its TLS certificate was refused), or the target does not serve the public API (the
  admin port, say: told in those words).
- 2 (EXIT_USAGE): nothing was sent: click's own usage errors (an unknown option, an out-of-range
  number or token id, no ``--api-key``, both or neither of PROMPT and ``--prompt-ids``), an empty
  ``--api-key`` or one gRPC cannot send (not printable ASCII), a ``--timeout`` not above 0 or
  above ``MAX_TIMEOUT_S``, a prompt or ``--stop`` string that is not valid UTF-8, an unusable
  ``--tls-ca`` file, ``--tls-server-name`` without ``--tls-ca``.

Every error is one line on stderr.

On a terminal, the text's control characters (ESC, which starts the sequences that move the
cursor or rewrite the window title, carriage return, backspace...) are shown escaped (``\\x1b``):
the text is the model's, and the terminal is the operator's. Tabs and newlines stay; a pipe or a
file gets the text exactly as it came, and ``--json`` is unchanged.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import typer

from kvfence import MAX_TIMEOUT_S

# C0 controls but tab and newline, DEL and C1 controls (module docstring).
_TERMINAL_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _is_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


def for_terminal(text: str) -> str:
    """``text`` with the control characters a terminal would act on written as ``\\xNN``."""
    return _TERMINAL_CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# The public API's --tls-server-name (generate, probe isolation); the admin commands' is
# kvfence.cli.admin.TLS_SERVER_NAME, with its own environment variable.
TLS_SERVER_NAME = typer.Option(
    None,
    "--tls-server-name",
    envvar="KVFENCE_TLS_SERVER_NAME",
    help="TLS: the name the control plane's certificate carries, when it is not the host of "
    "--target (through a port-forward: the control plane's Service name).",
)

# Module docstring: 1 when the request was sent and failed, 2 when nothing was sent (click's own
# usage errors exit 2 too).
EXIT_FAILED = 1
EXIT_USAGE = 2
UINT32_MAX = 2**32 - 1  # max_new_tokens and token ids are uint32 on the wire
UINT64_MAX = 2**64 - 1  # the seed is uint64


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    app.command("generate")(generate)


def _parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(p) for p in raw.replace(" ", "").split(",") if p]
    except ValueError:
        raise typer.BadParameter(
            f"expected comma-separated integers, got {raw!r}", param_hint="'--prompt-ids'"
        ) from None
    bad = [i for i in ids if not 0 <= i <= UINT32_MAX]
    if bad:
        raise typer.BadParameter(
            f"token ids must be in 0..{UINT32_MAX}, got {bad[0]}", param_hint="'--prompt-ids'"
        )
    return ids


def generate(
    prompt: str | None = typer.Argument(None, help="Prompt text (or use --prompt-ids)."),
    target: str = typer.Option(
        "127.0.0.1:50051", "--target", envvar="KVFENCE_TARGET", help="Public API HOST:PORT."
    ),
    api_key: str = typer.Option(..., "--api-key", envvar="KVFENCE_API_KEY", help="Tenant key."),
    prompt_ids: str | None = typer.Option(
        None, "--prompt-ids", help="Prompt as token ids, e.g. 1,2,3."
    ),
    max_new_tokens: int = typer.Option(
        32, "--max-new-tokens", "-n", min=1, max=UINT32_MAX, help="Tokens to generate at most."
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Nucleus sampling, 0 to 1; 1 keeps every token."
    ),
    seed: int | None = typer.Option(
        None,
        "--seed",
        min=0,
        max=UINT64_MAX,
        help="Sampling seed (temperature above 0); unset, the control plane draws one.",
    ),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Go on past an EOS token (to a stop string or the limit)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end."),
    tls_ca: str | None = typer.Option(None, "--tls-ca", help="CA bundle for a TLS endpoint."),
    tls_server_name: str | None = TLS_SERVER_NAME,
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        help=f"Deadline in seconds: above 0, at most {MAX_TIMEOUT_S} (else exit 2). Unset, the "
        "client sets none and the control plane's control_plane.default_deadline_s applies.",
    ),
) -> None:
    """Generate from PROMPT (or --prompt-ids) and stream the text."""
    import grpc

    from kvfence.auth import unsendable
    from kvfence.cli.admin import check_tls_server_name, tls_hint
    from kvfence.client import (
        Client,
        GenerationAccumulator,
        build_request,
        check_timeout,
        wrong_api,
    )
    from kvfence.errors import InvalidArgument, KvfenceError
    from kvfence.tls import TlsError

    def usage(message: str) -> typer.Exit:
        typer.echo(message, err=True)
        return typer.Exit(EXIT_USAGE)

    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of PROMPT or --prompt-ids")
    if not api_key.strip():  # `--api-key "$KEY"` with KEY unset: no key to send
        raise usage("--api-key (or KVFENCE_API_KEY) is empty")
    why = unsendable(api_key)
    if why is not None:
        raise usage(f"--api-key (or KVFENCE_API_KEY) cannot be sent: {why}")
    try:  # past, or one gRPC cannot set: the clients' own check, as a usage error
        check_timeout(timeout)
    except InvalidArgument as err:
        raise usage(f"--{err.message}") from None
    bad_name = check_tls_server_name(tls_ca, tls_server_name, "KVFENCE_TLS_SERVER_NAME")
    if bad_name is not None:
        raise usage(bad_name)
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": stop,
        "ignore_eos": ignore_eos,
    }
    try:
        # What the wire cannot carry (a string that is not UTF-8 ...) is refused before anything
        # is sent, so that it exits 2 and an INVALID_ARGUMENT of the control plane's exits 1.
        build_request(prompt, ids, **params)
    except InvalidArgument as err:
        raise usage(f"{err.code.name}: {err.message}") from None
    try:
        client = Client(
            target, api_key, tls_ca=tls_ca, tls_server_name=tls_server_name, timeout=timeout
        )
    except TlsError as err:  # the CA file, read here: nothing was sent
        raise usage(f"--tls-ca: {err}") from None
    acc = GenerationAccumulator()
    on_terminal = _is_terminal(sys.stdout)
    try:
        with client:
            for chunk in client.stream(prompt, prompt_ids=ids, **params):
                acc.add(chunk)
                if not as_json and chunk.text:
                    sys.stdout.write(for_terminal(chunk.text) if on_terminal else chunk.text)
                    sys.stdout.flush()
    except KvfenceError as err:
        if not as_json and acc.text:
            sys.stdout.write("\n")
        if err.code == grpc.StatusCode.UNIMPLEMENTED:
            typer.echo(wrong_api(target, "public"), err=True)
            raise typer.Exit(EXIT_FAILED) from None
        hint = tls_hint(target, err.message, tls_ca, tls_server_name)
        typer.echo(f"{err.code.name}: {err.message}{hint}", err=True)
        raise typer.Exit(EXIT_FAILED) from None
    if as_json:
        res = acc.result()
        out = {
            "token_ids": res.token_ids,
            "text": res.text,
            "finish_reason": res.finish_reason,
            "usage": {
                "prompt_tokens": res.usage.prompt_tokens,
                "completion_tokens": res.usage.completion_tokens,
            },
        }
        typer.echo(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
