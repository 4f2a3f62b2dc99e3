"""Operator commands over the admin API: tenants, nodes, model access, requests in flight, and
the tenant database's backup (over the API) and restore (offline, on the state directory).

Every command takes ``--target`` (admin HOST:PORT, env KVFENCE_ADMIN_TARGET),
``--admin-token`` (env KVFENCE_ADMIN_TOKEN; else the local stack's, from ``./.kvfence/up.json``
while its ``kvfence up`` runs and ``--target`` is its admin address: never sent elsewhere),
``--tls-ca`` (the CA of a control plane that serves TLS) and with it ``--tls-server-name`` (env
KVFENCE_ADMIN_TLS_SERVER_NAME: the name the control plane's certificate carries, when it does not
name the host of ``--target``; through a port-forward). Listings render as rich tables, or as JSON
with ``--json``. An unreachable target, a refused token or an unusable CA file, a missing admin
token, or a target that does not serve the Admin API (the public port, say), is reported in one
line on stderr with exit status 1; an out-of-range option, or ``--tls-server-name`` without
``--tls-ca``, is a usage error (exit status 2).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvfence import MAX_TIMEOUT_S

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from kvfence.client import AdminClient

EXIT_ERROR = 1
EXIT_USAGE = 2
UP_FILE = Path(".kvfence") / "up.json"  # `kvfence up` writes it; its admin target and token

TARGET = typer.Option(
    "127.0.0.1:50052", "--target", envvar="KVFENCE_ADMIN_TARGET", help="Admin API HOST:PORT."
)
TOKEN = typer.Option(
    None,
    "--admin-token",
    envvar="KVFENCE_ADMIN_TOKEN",
    help="Admin token. Without it (or with KVFENCE_ADMIN_TOKEN empty): the local stack's, from "
    "./.kvfence/up.json while its kvfence up runs and --target is its admin address, never for "
    "another target.",
)
TLS_CA = typer.Option(None, "--tls-ca", help="CA bundle for a TLS endpoint.")
TLS_SERVER_NAME = typer.Option(
    None,
    "--tls-server-name",
    envvar="KVFENCE_ADMIN_TLS_SERVER_NAME",
    help="TLS: the name the control plane's certificate carries, when it is not the host of "
    "--target (through a port-forward: the control plane's Service name).",
)
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
LIMIT_MAX = 2**31 - 1  # uint32 on the wire; the tenant store keeps them below 2^31


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    tenants, model = groups["tenants"], groups["model"]
    tenants.command("create")(tenants_create)
    tenants.command("list")(tenants_list)
    tenants.command("create-key")(tenants_create_key)
    tenants.command("revoke-key")(tenants_revoke_key)
    tenants.command("set-limits")(tenants_set_limits)
    tenants.command("backup")(tenants_backup)
    tenants.command("restore")(tenants_restore)
    model.command("status")(model_status)
    model.command("offline")(model_offline)
    model.command("online")(model_online)
    app.command("nodes")(nodes)
    app.command("requests")(requests)
    app.command("abort")(abort)


# -- plumbing --------------------------------------------------------------------------------------


def _fail(message: str, code: int = EXIT_ERROR) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


def unimplemented_admin(
    target: str, token: str, tls_ca: str | None = None, tls_server_name: str | None = None
) -> str:
    """What to say of an Admin call answered UNIMPLEMENTED: the wrong port (``wrong_api``), or a
    control plane of an older release that lacks this one method (the Admin API grew over
    releases: a newer CLI against a control plane not yet upgraded). ListTenants, which every
    release serves, tells them apart: UNIMPLEMENTED there too is the wrong port."""
    from kvfence.client import AdminClient, wrong_api
    from kvfence.errors import KvfenceError

    try:
        with AdminClient(
            target, token, tls_ca=tls_ca, tls_server_name=tls_server_name, timeout=5.0
        ) as probe:
            probe.list_tenants()
    except KvfenceError as err:
        if err.code.name == "UNIMPLEMENTED":
            return wrong_api(target, "admin")
        if err.code.name not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            # Gone or failing since: neither case can be told.
            return (
                f"{target} does not implement this command (UNIMPLEMENTED), and did not answer "
                f"again ({err.code.name}): the public port, or a control plane of an older release"
            )
    return (
        f"the control plane at {target} does not implement this command (UNIMPLEMENTED): an "
        "older release? Upgrade it, or use the kvfence CLI of its release"
    )


def check_tls_server_name(
    tls_ca: str | None, tls_server_name: str | None, envvar: str = "KVFENCE_ADMIN_TLS_SERVER_NAME"
) -> str | None:
    """Why ``--tls-server-name`` (or ``envvar``) cannot be used with this ``--tls-ca`` (None: it
    can)."""
    if tls_server_name is None:
        return None
    if not tls_server_name.strip():
        return "--tls-server-name is empty"
    if tls_ca is None:
        return (
            f"--tls-server-name (or {envvar}) needs --tls-ca: it is the name a TLS endpoint's "
            "certificate carries, and without --tls-ca there is no TLS"
        )
    return None


def tls_hint(target: str, message: str, tls_ca: str | None, tls_server_name: str | None) -> str:
    """What to do about a TLS connection refused because the certificate names another host."""
    if tls_ca is None or not any(
        s in message for s in ("Hostname Verification", "is not in peer certificate")
    ):
        return ""
    if tls_server_name is not None:
        return f" (the certificate does not name {tls_server_name}, the --tls-server-name given)"
    host = target.rsplit(":", 1)[0].strip("[]")
    return (
        f" (the certificate does not name {host}: pass the name it carries with "
        "--tls-server-name, e.g. through a port-forward)"
    )


def _host_and_port(target: str) -> tuple[str, str]:
    """``target``'s host (brackets of an IPv6 address dropped) and port (empty when it names
    none)."""
    target = target.strip()
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if target.count(":") == 1:  # HOST:PORT; more colons: a bare IPv6 address
        host, _, port = target.partition(":")
        return host, port
    return target, ""


def is_loopback(target: str) -> bool:
    """Whether ``target`` (HOST:PORT, [IPv6]:PORT, or a bare host) names this machine by a
    loopback address: 127.0.0.0/8, ::1 or localhost. Anything else, a gRPC scheme included, is
    not."""
    host = _host_and_port(target)[0]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _same_address(a: str, b: str) -> bool:
    """Whether two HOST:PORT targets are one address: one port, and one host or both loopback."""
    (host_a, port_a), (host_b, port_b) = _host_and_port(a), _host_and_port(b)
    if not port_a or port_a != port_b:
        return False
    return host_a.lower() == host_b.lower() or (is_loopback(a) and is_loopback(b))


def _local_stack() -> dict[str, Any] | None:
    """``./.kvfence/up.json`` of a ``kvfence up`` that runs now (its pid alive), else None."""
    try:
        up = json.loads(UP_FILE.read_text())
        pid = int(up["pid"])
        if not (isinstance(up["admin_target"], str) and isinstance(up["admin_token"], str)):
            return None
    except (OSError, ValueError, KeyError, TypeError):  # none, unreadable, or not up's
        return None
    if pid <= 0:  # kill(0 or -n, 0) would ask about a process group
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # `up` was killed (-9) and left its up.json behind
        return None
    except PermissionError:
        pass  # alive, another user's
    return dict(up)


def _local_token(target: str) -> str | None:
    """The local stack's admin token, for its own admin address only.

    Sent anywhere else it is a credential another control plane has no business seeing: an
    operator in the checkout who points KVFENCE_ADMIN_TARGET at production and forgets the token
    would send it there, through a port-forward's 127.0.0.1:50052 (the RUNBOOK's) too, which is
    the local stack's default admin address: so loopback is not enough, the local stack must be
    running (``up.json`` is there only while its ``up`` runs, and names its pid) and serve its
    admin API at ``target``, which a port-forward then cannot hold."""
    up = _local_stack()
    if up is None or not _same_address(target, up["admin_target"]):
        return None
    return str(up["admin_token"]).strip()


def _no_token(target: str) -> str:
    said = (
        f"no admin token for {target}: pass --admin-token or set KVFENCE_ADMIN_TOKEN (a Helm "
        "release's: key token of its admin-token Secret; the local stack's is read from "
        f"{UP_FILE} while its kvfence up runs, for its own admin address only)"
    )
    up = _local_stack()
    if up is not None:
        said += f"; the local stack here serves its admin API at {up['admin_target']}"
    return said


@contextmanager
def _admin(
    target: str, token: str | None, tls_ca: str | None = None, tls_server_name: str | None = None
) -> Iterator[AdminClient]:
    """An AdminClient; any error becomes one line on stderr and exit status 1 (2 for usage)."""
    import grpc

    from kvfence.auth import unsendable
    from kvfence.client import AdminClient
    from kvfence.errors import KvfenceError
    from kvfence.tls import TlsError

    bad_name = check_tls_server_name(tls_ca, tls_server_name)
    if bad_name is not None:
        raise _fail(bad_name, EXIT_USAGE)
    if token is None:
        token = _local_token(target)
    if not token:
        raise _fail(_no_token(target))
    why = unsendable(token)
    if why is not None:
        raise _fail(f"the admin token cannot be sent: {why}")
    try:
        client = AdminClient(
            target, token, tls_ca=tls_ca, tls_server_name=tls_server_name, timeout=10.0
        )
    except TlsError as err:
        raise _fail(f"--tls-ca: {err}") from None
    try:
        with client:
            yield client
    except KvfenceError as err:
        if err.code == grpc.StatusCode.UNAVAILABLE:
            hint = tls_hint(target, err.message, tls_ca, tls_server_name)
            raise _fail(f"cannot reach the admin API at {target}: {err.message}{hint}") from None
        if err.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise _fail(f"admin token refused by {target}: {err.message}") from None
        if err.code == grpc.StatusCode.UNIMPLEMENTED:
            raise _fail(unimplemented_admin(target, token, tls_ca, tls_server_name)) from None
        raise _fail(f"{err.code.name}: {err.message}") from None


def _dict(msg: Message) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        msg, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True))


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        # As text, not rich markup: "[fd00::5]:50061", an IPv6 node's address, lost its host as
        # a style tag, and nodes choose their ids and versions.
        table.add_row(*(Text(str(v)) for v in row))
    # Piped output (grep, tests) gets full cell contents instead of an 80-column squeeze.
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 240).print(table)


def _limit(n: int) -> str:
    return str(n) if n else "-"


# -- tenants ---------------------------------------------------------------------------------------


def tenants_create(
    name: str = typer.Argument(..., help="Tenant name."),
    max_concurrent: int = typer.Option(
        0, "--max-concurrent", min=0, max=LIMIT_MAX, help="0 = unlimited."
    ),
    max_tokens: int = typer.Option(
        0, "--max-tokens", min=0, max=LIMIT_MAX, help="Per request; 0 = admissible limit."
    ),
    scrub_on_free: bool = typer.Option(False, "--scrub-on-free", help="Zero pages on free."),
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Create a tenant and print its API key (shown only this once)."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        resp = admin.create_tenant(
            name,
            max_concurrent_requests=max_concurrent,
            max_tokens_per_request=max_tokens,
            scrub_on_free=scrub_on_free,
        )
    if as_json:
        _print_json({"tenant": resp.tenant.name, "api_key": resp.api_key, "key_id": resp.key_id})
        return
    typer.echo(f"tenant {resp.tenant.name} created; key id {resp.key_id}")
    typer.echo(f"API key (shown once, store it now): {resp.api_key}")


def tenants_list(
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """List tenants with their limits and keys."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        tenants = admin.list_tenants()
    if as_json:
        _print_json([_dict(t) for t in tenants])
        return
    rows = []
    for t in tenants:
        keys = ", ".join(k.key_id + (" (revoked)" if k.revoked else "") for k in t.keys)
        lim = t.limits
        rows.append(
            [
                t.name,
                _limit(lim.max_concurrent_requests),
                _limit(lim.max_tokens_per_request),
                "yes" if lim.scrub_on_free else "no",
                keys,
            ]
        )
    _table("tenants", ["name", "max concurrent", "max tokens", "scrub", "keys"], rows)


def tenants_create_key(
    name: str = typer.Argument(..., help="Tenant name."),
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Issue another API key for a tenant (rotation) and print it (shown only this once)."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        resp = admin.create_key(name)
    if as_json:
        _print_json({"tenant": name, "api_key": resp.api_key, "key_id": resp.key_id})
        return
    typer.echo(f"tenant {name}: new key id {resp.key_id}")
    typer.echo(f"API key (shown once, store it now): {resp.api_key}")


def tenants_revoke_key(
    key_id: str = typer.Argument(..., help="Key id (see `tenants list`)."),
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Revoke an API key: requests with it are refused from now on, and the ones in flight end."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        admin.revoke_key(key_id)
    typer.echo(f"key {key_id} revoked")


def tenants_set_limits(
    name: str = typer.Argument(..., help="Tenant name."),
    max_concurrent: int | None = typer.Option(
        None, "--max-concurrent", min=0, max=LIMIT_MAX, help="0 = unlimited."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=0, max=LIMIT_MAX, help="0 = admissible limit."
    ),
    scrub_on_free: bool | None = typer.Option(
        None,
        "--scrub-on-free/--no-scrub-on-free",
        help="Zero the tenant's pages when they are freed, or stop doing so.",
    ),
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Change a tenant's limits; options not given keep their current value."""
    if max_concurrent is None and max_tokens is None and scrub_on_free is None:
        raise _fail(
            "nothing to change: give --max-concurrent, --max-tokens or --scrub-on-free", EXIT_USAGE
        )
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        # Only the options given travel: the control plane keeps the others as they are then
        # (reading them here first would undo another operator's change made in between).
        tenant = admin.set_limits(
            name,
            max_concurrent_requests=max_concurrent,
            max_tokens_per_request=max_tokens,
            scrub_on_free=scrub_on_free,
        )
    if as_json:
        _print_json(_dict(tenant))
        return
    lim = tenant.limits
    typer.echo(
        f"tenant {tenant.name}: max concurrent {_limit(lim.max_concurrent_requests)}, "
        f"max tokens {_limit(lim.max_tokens_per_request)}, "
        f"scrub on free {'yes' if lim.scrub_on_free else 'no'}"
    )


def tenants_backup(
    out_file: Path = typer.Argument(
        ...,
        help="File to write (owner-only: it holds key hashes); - writes it to stdout (to pipe it "
        "into an encryption tool), never to a terminal.",
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT_FILE if it exists."),
    timeout: float = typer.Option(
        120.0, "--timeout", min=1.0, max=MAX_TIMEOUT_S, help="Seconds for the transfer."
    ),
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Back up the tenant database of a running control plane to a file (or stdout: -).

    A consistent snapshot of tenants, limits, API key hashes and the model's kill switch, checked,
    then written owner-only (0600) or piped (never to a terminal); `kvfence tenants restore` puts
    it back.
    """
    import tempfile

    from control_plane.tenants import (
        NotATenantDatabase,
        check_database,
        create_private,
        newer_schema_note,
    )
    from kvfence.cli.generate import _is_terminal

    # "-": the backup alone on stdout (the pipe carries nothing else), what is said about it on
    # stderr. It was once written to a file named "-" in the working directory, unencrypted,
    # with nothing sent down the pipe.
    to_stdout = str(out_file) == "-"
    if to_stdout:
        if _is_terminal(sys.stdout.buffer):
            raise _fail(
                "refusing to write the backup (binary, with API key hashes) to a terminal: "
                "redirect or pipe it",
                EXIT_USAGE,
            )
    elif out_file.is_dir():
        raise _fail(f"{out_file} is a directory")
    elif not out_file.parent.is_dir():
        raise _fail(f"cannot write {out_file}: no directory {out_file.parent}")
    elif out_file.exists() and not force:
        raise _fail(f"{out_file} exists; pass --force to overwrite it")
    where = "the backup to stdout" if to_stdout else str(out_file)
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        data = admin.backup_tenants(timeout=timeout)
    # Written to a private file and checked there (SQLite checks a file), then sent as checked:
    # moved into place beside OUT_FILE (never a half-written backup under its name, never
    # readable by others, not even for a moment), or for stdout copied from a directory only
    # this user can enter.
    with contextlib.ExitStack() as cleanup:
        try:
            if to_stdout:
                scratch = cleanup.enter_context(
                    tempfile.TemporaryDirectory(prefix="kvfence-backup-")
                )
                tmp = Path(scratch) / "tenants.backup"
            else:
                tmp = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
            f = create_private(tmp)
        except OSError as err:
            raise _fail(f"cannot write {where}: {_os_error(err)}") from None
        cleanup.callback(tmp.unlink, missing_ok=True)  # only once made here: never another's
        try:
            with f:
                f.write(data)
                # On disk before it takes OUT_FILE's name; a plain copy only checked need not be.
                if not to_stdout:
                    f.flush()
                    os.fsync(f.fileno())
            checked = check_database(tmp, "the backup")
            size = tmp.stat().st_size
            if to_stdout:
                _write_stdout(tmp.read_bytes())
            elif force:
                os.replace(tmp, out_file)
            else:
                _link_new(tmp, out_file)
        except FileExistsError:
            raise _fail(f"{out_file} exists; pass --force to overwrite it") from None
        except NotATenantDatabase as err:
            raise _fail(str(err)) from None
        except OSError as err:
            raise _fail(f"cannot write {where}: {_os_error(err)}") from None
    owner_only = "" if to_stdout else ", owner-only"
    typer.echo(
        f"backed up {checked.tenants} tenants and {checked.keys} API keys to "
        f"{'stdout' if to_stdout else out_file} ({size} bytes{owner_only}: it holds API key "
        "hashes)",
        err=to_stdout,
    )
    if checked.newer:  # this CLI is older than the control plane's database (a rollback?)
        typer.echo(
            f"note: {newer_schema_note(checked.schema_version, 'the tenant database')}",
            err=to_stdout,
        )


def _write_stdout(data: bytes) -> None:
    out = sys.stdout.buffer
    try:
        out.write(data)
        out.flush()
    except OSError as err:  # the reader went (a broken pipe): it did not get the whole backup
        with contextlib.suppress(OSError):  # and Python's own flush at exit must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        raise _fail(f"cannot write the backup to stdout: {_os_error(err)}") from None


def _link_new(tmp: Path, out_file: Path) -> None:
    """``tmp`` under the name ``out_file``, which must not exist (FileExistsError)."""
    try:
        os.link(tmp, out_file)  # atomic: fails if OUT_FILE appeared meanwhile
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links
        if out_file.exists():
            raise FileExistsError(out_file) from None
        os.replace(tmp, out_file)


def _os_error(err: OSError) -> str:
    if err.strerror is None:
        return str(err)
    return err.strerror + (f": {err.filename}" if err.filename else "")


def tenants_restore(
    backup: Path = typer.Argument(
        ..., help="A file written by `kvfence tenants backup`; - reads it from stdin."
    ),
    state_dir: Path = typer.Option(
        ...,
        "--state-dir",
        help="The control plane's state directory (control_plane.state_dir; "
        "/var/lib/kvfence in the Helm chart).",
    ),
    from_another_database: Annotated[
        bool,
        typer.Option(
            "--from-another-database",
            help="Restore a backup of another tenant database (another id) over this state "
            "directory's, which holds tenants: that database's tenants and keys then work here, "
            "and this one's are refused. For moving tenants between state directories, or into "
            "one where a database was started afresh; refused without it.",
        ),
    ] = False,
) -> None:
    """Restore the tenant database of a state directory from a backup (offline).

    Refused while a control plane runs on that directory, for a file that is not a sound
    kvfence tenant database, and (unless --from-another-database) for a backup of another
    tenant database than the directory's when that one holds tenants. The database it replaces
    is kept beside it as tenants.sqlite3.bak-<time>. The model's kill switch comes back as it
    was at the backup; keys revoked since the backup stay revoked.
    """
    from control_plane.tenants import (
        IDENTITY_SCHEMA,
        AnotherDatabase,
        IdentityCheck,
        NotATenantDatabase,
        StateDirInUse,
        newer_schema_note,
        restore,
    )

    try:
        if str(backup) == "-":  # e.g. through `kubectl exec -i`, into a pod without tar
            source: Path | BinaryIO = sys.stdin.buffer
            name = "the backup on stdin"
        else:
            source, name = backup, str(backup)
        done = restore(state_dir, source, name, from_another_database=from_another_database)
    except StateDirInUse as err:
        raise _fail(f"{err}; stop it first") from None
    except (NotATenantDatabase, AnotherDatabase) as err:
        raise _fail(f"refusing to restore: {err}") from None
    except OSError as err:
        raise _fail(f"cannot restore: {_os_error(err)}") from None
    kept = f"the previous one is kept as {done.previous}" if done.previous else "there was none"
    restored_id = (
        f"database {done.identity.database_id}, created {done.identity.created_at}"
        if done.identity
        else "a database without an id"
    )
    typer.echo(
        f"restored {done.tenants} tenants and {done.keys} API keys ({restored_id}) into "
        f"{done.path} from {'stdin' if str(backup) == '-' else backup}; {kept}"
    )
    # Which database the backup is of: said wherever it was not, or could not be, compared.
    unchecked = "whether the backup is of the database it replaced was not checked"
    before_ids = f"a release before schema {IDENTITY_SCHEMA}"
    if done.identity is None:
        not_compared = done.identity_check is IdentityCheck.BACKUP_WITHOUT_ID
        typer.echo(
            f"note: the backup carries no database id ({before_ids} took it)"
            + (f", so {unchecked}" if not_compared else "")
            + "; the control plane gives the restored database an id when it opens it"
        )
    if done.identity_check is IdentityCheck.DATABASE_WITHOUT_ID:
        typer.echo(
            f"note: the database it replaced carries no database id ({before_ids} wrote it, and "
            f"no control plane of this release has opened it), so {unchecked}"
        )
    elif done.identity_check is IdentityCheck.UNREADABLE:
        typer.echo(f"note: the database it replaced could not be read (damaged?), so {unchecked}")
    if done.identity_check in (IdentityCheck.UNREADABLE, IdentityCheck.NO_DATABASE):
        typer.echo(
            "note: with no readable database to carry revocations over from, keys revoked since "
            'the backup work again: revoke them anew (the control plane logged "api key revoked" '
            "with each key_id)"
        )
    elif done.identity_check is IdentityCheck.ANOTHER_DATABASE and done.replaced_identity:
        typer.echo(
            f"warning: --from-another-database: the database it replaced was another one "
            f"(database {done.replaced_identity.database_id}, created "
            f"{done.replaced_identity.created_at}): its tenants' keys are refused from now on, "
            "the restored database's work"
        )
    if done.kept_revoked:
        n = len(done.kept_revoked)
        typer.echo(
            f"kept {n} API key{'s' if n != 1 else ''} revoked that the backup had live (revoked "
            f"since it was taken): {', '.join(done.kept_revoked)}"
        )
    if done.newer:  # a backup a later release took, restored after a rollback
        typer.echo(
            f"warning: {newer_schema_note(done.schema_version, 'the backup')}: settings that "
            "release added have no effect here; check `kvfence model status` once it runs"
        )
    # The kill switch comes back as it was at the backup: say so where that changes it.
    offline = {a.model: a for a in done.access if not a.online}
    for a in offline.values():
        typer.echo(
            f"model {a.model} is offline in the restored database (since {a.since}: {a.reason}): "
            f"a control plane serving {a.model} starts with it offline; `kvfence model online` "
            "there when it should serve (one serving another model ignores it)"
        )
    for a in done.access_before or ():
        if not a.online and a.model not in offline:
            typer.echo(
                f"warning: model {a.model} was offline in the replaced database (since "
                f"{a.since}: {a.reason}) and is online in the restored one: the control plane "
                "starts serving it; `kvfence model offline` again if that is not over"
            )


# -- cluster ---------------------------------------------------------------------------------------


def nodes(
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Registered nodes: pools, heartbeats, draining, release, and the enforced limit.

    Draining: shutting down, sent no new requests.
    """
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        resp = admin.list_nodes()
    if as_json:
        _print_json(_dict(resp))
        return
    rows = [
        [
            n.node_id,
            n.role,
            n.grpc_address,
            n.pool_tokens,
            f"{n.free_pages}/{n.total_pages}",
            n.quarantined_pages,
            "yes" if n.healthy else "NO",
            f"{n.last_heartbeat_age_s:.1f}s",
            "yes" if n.draining else "no",
            n.kvfence_version or "?",
        ]
        for n in resp.nodes
    ]
    _table(
        f"nodes (context window {resp.context_window}, admissible limit {resp.admissible_limit})",
        [
            "node",
            "role",
            "address",
            "pool tokens",
            "free/total",
            "quarantined",
            "healthy",
            "hb",
            "draining",
            "version",
        ],
        rows,
    )


def _print_status(status: Any, as_json: bool) -> None:
    if as_json:
        _print_json(_dict(status))
        return
    # "OFFLINE (reason)" first, as before the time was kept: scripts may look for it.
    since = f" since {status.offline_since}" if status.offline_since else ""
    state = "online" if status.online else f"OFFLINE ({status.reason}){since}"
    typer.echo(
        f"model {status.name}: {state}; context window {status.context_window}, "
        f"admissible limit {status.admissible_limit}"
    )


def model_status(
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Whether the model is online, its context window and enforced limit.

    Offline: since when, and why.
    """
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        _print_status(admin.model_status(), as_json)


def model_offline(
    reason: str = typer.Option("", "--reason", help="Shown to clients in the UNAVAILABLE error."),
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Take the model offline: new and queued requests fail with UNAVAILABLE at once.

    The control plane saves it before it answers: it stays offline across restarts until
    `kvfence model online`.
    """
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        _print_status(admin.set_model_access(False, reason), as_json)


def model_online(
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Put the model back online."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        _print_status(admin.set_model_access(True), as_json)


def requests(
    as_json: bool = JSON,
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Requests in flight, with their state and nodes."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        infos = admin.list_requests()
    if as_json:
        _print_json([_dict(r) for r in infos])
        return
    rows = [
        [
            r.request_id,
            r.tenant_id,
            r.state,
            r.prefill_node or "-",
            r.decode_node or "-",
            f"{r.prompt_tokens}+{r.max_new_tokens}",
            f"{r.age_s:.1f}s",
        ]
        for r in infos
    ]
    _table("requests", ["request", "tenant", "state", "prefill", "decode", "tokens", "age"], rows)


def abort(
    request_id: str = typer.Argument(..., help="Request id (see `kvfence requests`)."),
    target: str = TARGET,
    admin_token: str | None = TOKEN,
    tls_ca: str | None = TLS_CA,
    tls_server_name: str | None = TLS_SERVER_NAME,
) -> None:
    """Abort a request in flight: CANCELLED for the client, released on every node."""
    with _admin(target, admin_token, tls_ca, tls_server_name) as admin:
        aborted = admin.abort_request(request_id)
    typer.echo(f"request {request_id} {'aborted' if aborted else 'was already ending'}")
