"""``kvfence check-config``: do the KV pools hold the model's context window?

``--static FILE`` checks a config file without a cluster (CI, the Helm pre-install hook). The live
mode (``--target HOST:PORT --admin-token TOKEN``, and ``--tls-ca FILE`` when the control plane
serves TLS, with ``--tls-server-name NAME`` when its certificate does not name HOST) asks a running
cluster for the pools its nodes actually hold and renders the same
:class:`~kvfence.config_check.CheckReport`.

Exit codes: 0 the check passed, 1 it failed, 2 the check could not run (bad config, bad usage).
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvfence.cli.admin import TLS_SERVER_NAME
from kvfence.config import ConfigError, Role, load_config
from kvfence.config_check import CheckReport, PoolSample, evaluate, static_check

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    app.command("check-config")(check_config)


def check_config(
    static: Path | None = typer.Option(
        None, "--static", metavar="FILE", help="Check this config file; no cluster needed."
    ),
    target: str | None = typer.Option(
        None, "--target", help="Control plane admin address HOST:PORT (live check)."
    ),
    admin_token: str | None = typer.Option(
        None, "--admin-token", envvar="KVFENCE_ADMIN_TOKEN", help="Admin token (live check)."
    ),
    tls_ca: str | None = typer.Option(
        None, "--tls-ca", help="CA bundle for a TLS endpoint (live check)."
    ),
    tls_server_name: str | None = TLS_SERVER_NAME,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Does every KV pool hold the model's context window? Exit 0 yes, 1 no, 2 not checked.

    0: every pool holds it (or the config clamps the limit to the smallest pool); 1: a pool does
    not; 2: the check could not run (an unusable config file or option; live: no node registered,
    the target unreachable or not the admin port, no admin token or a refused one).
    """
    if static is not None and target is not None:
        _die("use either --static FILE or --target HOST:PORT, not both")
    report = (
        _static_report(static)
        if static is not None
        else _live_report(target, admin_token, tls_ca, tls_server_name)
    )
    if as_json:
        typer.echo(report.to_json())
    else:
        render_report(report, Console(highlight=False, soft_wrap=True))
    raise typer.Exit(EXIT_OK if report.ok else EXIT_FAILED)


def _static_report(path: Path) -> CheckReport:
    try:
        return static_check(load_config(path), source=str(path))
    except ConfigError as err:
        _die(f"check-config: {err}")


def _live_report(
    target: str | None, admin_token: str | None, tls_ca: str | None, tls_server_name: str | None
) -> CheckReport:
    """Pools as the running nodes report them, through the admin API at ``target``."""
    if not target or not admin_token:
        _die(
            "check-config without --static checks a running cluster and needs --target HOST:PORT "
            "(the admin port) and --admin-token TOKEN (or KVFENCE_ADMIN_TOKEN); "
            "to check a config file use --static FILE"
        )
    import grpc

    from kvfence.cli.admin import check_tls_server_name, tls_hint, unimplemented_admin
    from kvfence.client import AdminClient
    from kvfence.errors import KvfenceError
    from kvfence.kv.pool import PagePool
    from kvfence.tls import TlsError

    bad_name = check_tls_server_name(tls_ca, tls_server_name)
    if bad_name is not None:
        _die(f"check-config: {bad_name}")
    try:
        admin_client = AdminClient(
            target, admin_token, tls_ca=tls_ca, tls_server_name=tls_server_name
        )
    except TlsError as err:
        _die(f"check-config: --tls-ca: {err}")
    try:
        with admin_client as admin:
            resp = admin.check_config()
            status = admin.model_status()
            nodes = {n.node_id: n for n in admin.list_nodes().nodes}
    except KvfenceError as err:
        if err.code == grpc.StatusCode.UNIMPLEMENTED:
            said = unimplemented_admin(target, admin_token, tls_ca, tls_server_name)
            _die(f"check-config: {said}")
        hint = tls_hint(target, err.message, tls_ca, tls_server_name)
        _die(f"check-config: {target}: {err.code.name}: {err.message}{hint}")
    if not resp.pools:
        _die(f"check-config: no node is registered at {target}")
    layout = next(iter(nodes.values())).layout  # every registered node has the model's layout
    page_size = layout.page_size
    fits = all(p.pool_tokens >= resp.context_window for p in resp.pools)
    return evaluate(
        source=target,
        model=status.name,
        shape_source="registered nodes",
        context_window=resp.context_window,
        context_source="control plane",
        dtype=layout.dtype,
        page_size=page_size,
        page_bytes=PagePool.page_bytes_for(
            num_layers=layout.num_layers,
            page_size=layout.page_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
        ),
        clamp_context=resp.ok and not fits,  # the cluster accepts small pools only when clamped
        pools=[PoolSample(Role(p.role), p.pool_tokens // page_size, p.node_id) for p in resp.pools],
    )


def _die(message: str) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(EXIT_UNUSABLE)


def render_report(report: CheckReport, console: Console) -> None:
    """Print ``report`` as a header, one table row per pool, and the verdict."""
    console.print(
        escape(
            f"model {report.model} ({report.dtype}), context window {report.context_window} "
            f"tokens (from {report.context_source}); shape from {report.shape_source}; "
            f"page {report.page_size} tokens = {report.page_bytes} bytes"
        )
    )
    table = Table(title=escape(f"KV pools in {report.source}"))
    for column in ("role", "node", "pages", "tokens", "ok", "detail"):
        table.add_column(column, overflow="fold")
    for pool in report.pools:
        verdict = "[green]ok[/green]" if pool.ok else "[red]FAIL[/red]"
        table.add_row(
            pool.role,
            escape(pool.node_id or "(all)"),  # the node's own choice: not markup
            str(pool.pages),
            str(pool.tokens),
            verdict,
            escape(pool.message),
        )
    console.print(table)
    style = "red" if not report.ok else "yellow" if report.clamped else "green"
    console.print(f"[{style}]{report.summary}[/{style}]")
