"""Local model commands: ``kvfence model init-tiny``, ``kvfence model info`` and ``kvfence run``.

``run`` generates in this process (the colocated engine), without any service. Bad input prints one
``error: ...`` line on stderr and exits with status 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _parse_ids(raw: str) -> list[int]:
    try:
        ids = [int(p) for p in raw.replace(" ", "").split(",") if p != ""]
    except ValueError:
        _fail(f"--prompt-ids must be comma-separated integers, got {raw!r}")
    if not ids:
        _fail("--prompt-ids is empty")
    return ids


def init_tiny(
    directory: Path = typer.Argument(..., help="Folder to write the checkpoint to."),
) -> None:
    """Write the embedded tiny Llama checkpoint (same bytes every time)."""
    from kvfence.model.loader import fingerprint
    from kvfence.model.tiny import write_tiny_model

    try:
        out = write_tiny_model(directory)
    except OSError as err:
        _fail(f"cannot write {directory}: {err.strerror}")
    typer.echo(f"{out} {fingerprint(out)}")


def info(
    model: Path | None = typer.Argument(None, help="Checkpoint folder (default: embedded tiny)."),
) -> None:
    """Print a checkpoint's KV shape and fingerprint as JSON."""
    from kvfence.model.loader import fingerprint, read_model_shape
    from kvfence.model.tiny import ensure_tiny_model

    folder = ensure_tiny_model() if model is None else model
    try:
        shape = read_model_shape(folder)
        digest = fingerprint(folder)
    except ValueError as err:
        _fail(str(err))
    typer.echo(json.dumps({"path": str(folder), "fingerprint": digest, **shape.model_dump()}))


def run(
    prompt: str | None = typer.Argument(None, help="Prompt text (or use --prompt-ids)."),
    model: Path | None = typer.Option(None, "--model", help="Checkpoint folder; default tiny."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="e.g. 1,2,3"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling, 0 to 1."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed (uint64)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Go on past an EOS token."),
    page_size: int = typer.Option(16, "--page-size", help="Tokens per KV page."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Generate locally with the colocated engine and print the generated text."""
    if (prompt is None) == (prompt_ids is None):
        _fail("give exactly one of PROMPT or --prompt-ids")
    if page_size < 1:
        _fail(f"--page-size must be >= 1, got {page_size}")
    from kvfence.model.colocated import ColocatedEngine, GenerationRequest
    from kvfence.model.loader import load_model
    from kvfence.model.sampling import SamplingParams
    from kvfence.model.tiny import ensure_tiny_model
    from kvfence.tokenizer import load_tokenizer

    try:
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
        )
        folder = ensure_tiny_model() if model is None else model
        loaded = load_model(folder, dtype=dtype)
        tokenizer = load_tokenizer(folder)
        ids = _parse_ids(prompt_ids) if prompt_ids is not None else tokenizer.encode(prompt or "")
        # A pool just big enough for this one request.
        pages = -(-(len(ids) + max_new_tokens) // page_size)
        engine = ColocatedEngine(loaded, tokenizer=tokenizer, page_size=page_size, num_pages=pages)
        (out,) = engine.generate([GenerationRequest(ids, sampling)])
    except ValueError as err:
        _fail(str(err))
    if as_json:
        payload = {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}
        typer.echo(json.dumps(payload))
    else:
        typer.echo(out.text)


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    groups["model"].command("init-tiny")(init_tiny)
    groups["model"].command("info")(info)
    app.command("run")(run)
