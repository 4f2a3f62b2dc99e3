"""``kvfence probe isolation``: the two-tenant canary test against a running deployment.

A thin layer over :mod:`kvfence.probe`: a rich progress bar on stderr while it runs (when stderr
is a terminal), then a summary table on stdout, or one JSON object with ``--json``. Exit status 0
when clean, 1 on a leak or an accepted over-length request, 2 when the probe could not run
(unreachable target, refused key: one line on stderr) or verified nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvfence import MAX_TIMEOUT_S
from kvfence.cli.generate import TLS_SERVER_NAME

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from kvfence.probe import ProbeReport


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    groups["probe"].command("isolation")(isolation)


class _RichProgress:
    """``kvfence.probe.ProgressSink`` drawing one bar."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.task: TaskID | None = None

    def start(self, total: int) -> None:
        self.task = self.progress.add_task("connecting", total=total)

    def step(self, phase: str, n: int = 1) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=n, description=phase)


def isolation(
    target: str = typer.Option(
        "127.0.0.1:50051", "--target", envvar="KVFENCE_TARGET", help="Public API HOST:PORT."
    ),
    tenant_a_key: str = typer.Option(
        ..., "--tenant-a-key", envvar="KVFENCE_TENANT_A_KEY", help="API key of tenant A (load)."
    ),
    tenant_b_key: str = typer.Option(
        ..., "--tenant-b-key", envvar="KVFENCE_TENANT_B_KEY", help="API key of tenant B (probes)."
    ),
    requests: int = typer.Option(32, "--requests", min=1, help="Tenant A canary requests."),
    concurrency: int = typer.Option(8, "--concurrency", min=1, help="Tenant A requests in flight."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of every canary (repeatable run)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    timeout: float = typer.Option(
        60.0, "--timeout", min=0.001, max=MAX_TIMEOUT_S, help="Per-request deadline, s."
    ),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="CA bundle for a TLS endpoint."),
    tls_server_name: str | None = TLS_SERVER_NAME,
    fail_on_divergence: bool = typer.Option(
        False,
        "--fail-on-divergence",
        help="Exit 1 when a probe's output under load differs from its solo run (for "
        "deployments whose outputs do not depend on the batch).",
    ),
) -> None:
    """Two-tenant canary test against a running deployment.

    Does tenant B ever see tenant A's data, and are over-length requests rejected before any
    token?"""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from kvfence.cli.admin import check_tls_server_name
    from kvfence.probe import EXIT_ERROR, ProbeOptions, ProbeSetupError, run_isolation_probe

    err_console = Console(stderr=True)
    bad_name = check_tls_server_name(
        None if tls_ca is None else str(tls_ca), tls_server_name, "KVFENCE_TLS_SERVER_NAME"
    )
    if bad_name is not None:
        typer.echo(f"kvfence probe isolation: {bad_name}", err=True)
        raise typer.Exit(EXIT_ERROR)
    options = ProbeOptions(
        requests=requests,
        concurrency=concurrency,
        timeout=timeout,
        seed=seed,
        fail_on_divergence=fail_on_divergence,
    )
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )
    try:
        with progress:
            report = run_isolation_probe(
                target,
                tenant_a_key,
                tenant_b_key,
                options=options,
                tls_ca=tls_ca,
                tls_server_name=tls_server_name,
                progress=_RichProgress(progress),
            )
    except ProbeSetupError as err:
        typer.echo(f"kvfence probe isolation: {err}", err=True)
        if as_json:
            typer.echo(json.dumps({"verdict": "ERROR", "exit_code": EXIT_ERROR, "error": str(err)}))
        raise typer.Exit(EXIT_ERROR) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    else:
        _print_report(report)
    raise typer.Exit(report.exit_code)


_VERDICT_STYLE = {
    "PASS": "bold green",
    "WARN": "bold yellow",
    "INCONCLUSIVE": "bold yellow",
    "FAIL": "bold red",
    "LEAK": "bold red",
    "DIVERGED": "bold red",
}


def _print_report(report: ProbeReport) -> None:
    console = Console()
    head = (
        f"target {report.target}  model {report.model}  admissible_limit "
        f"{report.admissible_limit}  page_size {report.page_size}  seed {report.seed}  "
        f"{report.duration_s:.1f}s"
    )
    table = Table(title="kvfence isolation probe", caption=escape(head))
    table.add_column("check")
    table.add_column("result")
    table.add_column("details")

    def row(check: str, ok: bool | None, details: str) -> None:
        mark = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]warn[/]"}[ok]
        table.add_row(check, mark, escape(details))

    row(
        "tenant A canary load",
        True if report.canary_ok else None,
        f"{report.canary_ok}/{report.canary_requests} ok ({report.canary_text_requests} text), "
        f"{report.canary_tokens} canary tokens, {report.canary_busy} busy, "
        f"{report.canary_errors} errors",
    )
    errors = ", ".join(f"{k} {v}" for k, v in sorted(report.probe_errors.items())) or "no errors"
    row(
        "tenant B probes",
        True if report.probes_under_load_ok else None,
        f"{report.probe_ok}/{report.probe_requests} ok, rounds under load: "
        f"{report.under_load_rounds} ({report.probes_overlapping_load} overlapped A's requests, "
        f"{report.probes_overlapping_load_ok} of them ok), "
        f"{report.probe_busy} busy, {errors}",
    )
    leak_detail = "no canary n-gram or marker in tenant B's output"
    if report.leaks:
        first, d = report.leaks[0], report.to_dict()
        leak_detail = (
            f"{len(report.leaks)} canary hits in {d['leaked_requests']} requests; "
            f"first: {first.phase} probe {first.probe} "
            f"({first.request_id}): {first.evidence}"
        )
    row("cross-tenant leak", not report.leaks, leak_detail)
    fails = report.over_length_failures
    ol_detail = f"{len(report.over_length) - len(fails)}/{len(report.over_length)} rejected"
    for r in fails:
        ol_detail += (
            f"; {r.name} ({r.prompt_tokens}+{r.max_new_tokens}) {r.outcome}: {r.status}"
            + (f" {r.reason}" if r.reason else "")
            + f", {r.tokens_yielded} tokens"
        )
    row("over-length rejected (INVALID_ARGUMENT, OVER_ADMISSIBLE_LIMIT)", not fails, ol_detail)
    at = report.at_limit
    if at is not None:
        row(
            "at limit not rejected",
            True if at.outcome == "accepted" else None,
            f"{at.prompt_tokens}+{at.max_new_tokens}: {at.outcome} ({at.status})",
        )
    row(
        "greedy output vs solo baseline",
        True if not report.diverged else None,
        f"{report.diverged} of {report.compared} diverged",
    )
    console.print(table)
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    style = _VERDICT_STYLE.get(report.verdict, "bold")
    console.print(f"verdict: [{style}]{report.verdict}[/]")
