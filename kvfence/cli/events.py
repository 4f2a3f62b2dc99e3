"""``kvfence events --follow``: a live view of the cluster's event stream (MQTT).

Broker and cluster come from the flags, else from ``--config``, else 127.0.0.1:1883 / "local".
A broker that requires an account: ``--mqtt-username`` (env KVFENCE_MQTT_USERNAME) with the
password in ``--mqtt-password-file`` (env KVFENCE_MQTT_PASSWORD_FILE) or in the env variable
KVFENCE_MQTT_PASSWORD (never a flag: it would show in the shell history and the process list);
else ``events.mqtt_username`` / ``events.mqtt_password_file`` of ``--config``.
A broker that serves TLS: ``--mqtt-tls-ca`` (env KVFENCE_MQTT_TLS_CA), the CA that signed its
certificate (which must name the host connected to, or ``--mqtt-tls-server-name``: through a
port-forward), and for a broker that requires client certificates ``--mqtt-tls-cert`` +
``--mqtt-tls-key``; else ``events.mqtt_tls_*`` of ``--config``.
Silence is not always "no events": a wrong ``--cluster`` (the default is "local"), a broker
the cluster does not send to, or an account whose ACL does not cover the cluster's topics look
the same. So when nothing has arrived ``--hint-after`` seconds (default 10, 0: never) after the
subscription, it prints one hint on stderr (stdout carries only events) and keeps waiting: the
cluster and topic it listens on, the clusters this broker has a retained node status of that the
account may read (``clusters_seen``), and what the silence may mean.
Exit codes: 0 stopped by the user or ``--limit`` reached, 1 the broker cannot be reached, refused
the account, failed the TLS handshake or the connection dropped, 2 bad usage (among it a
``--cluster`` that cannot be an MQTT topic level: empty, or with "/", "+", "#" or NUL).
It connects with MQTT 5, and with MQTT 3.1.1 to a broker that answers "unsupported protocol
version".
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any, NoReturn

import aiomqtt
import typer
from rich.console import Console
from rich.markup import escape

from kvfence.config import ConfigError, load_config
from kvfence.events import (
    EVENT_KINDS,
    SECURITY_KINDS,
    TOPIC_RESERVED,
    TOPIC_ROOT,
    MqttCredentials,
    MqttTls,
    clusters_seen,
    event_topic,
    follow,
    is_auth_refusal,
    is_client_certificate_required,
    is_no_answer,
    is_tls_failure,
    read_mqtt_password,
)

EXIT_OK, EXIT_BROKER, EXIT_USAGE = 0, 1, 2
PASSWORD_ENV = "KVFENCE_MQTT_PASSWORD"
_HEADER_FIELDS = ("seq", "ts", "kind", "cluster", "node_id")
_TLS_FLAGS = ("--mqtt-tls-ca", "--mqtt-tls-cert", "--mqtt-tls-key")
# Seconds of silence after subscribing before the hint: long enough that a cluster that is up and
# busy has sent something, short enough for an operator who is waiting on it.
DEFAULT_HINT_AFTER_S = 10.0
# The hint names at most this many clusters (a shared broker may carry many).
_HINT_MAX_CLUSTERS = 20


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    app.command("events")(events)


def events(
    follow_: bool = typer.Option(
        False,
        "--follow",
        "-f",
        help="Required: stream events as they arrive (only the live view exists; without it, "
        "exit 2).",
    ),
    # No default in the signature: --config's events settings come before the built-in ones.
    mqtt_host: str | None = typer.Option(
        None,
        "--mqtt-host",
        help="Broker host.",
        show_default="127.0.0.1, or events.mqtt_host of --config",
    ),
    mqtt_port: int | None = typer.Option(
        None,
        "--mqtt-port",
        help="Broker port.",
        show_default="1883, or events.mqtt_port of --config",
    ),
    mqtt_username: str | None = typer.Option(
        None, "--mqtt-username", envvar="KVFENCE_MQTT_USERNAME", help="Broker account."
    ),
    mqtt_password_file: Path | None = typer.Option(
        None,
        "--mqtt-password-file",
        envvar="KVFENCE_MQTT_PASSWORD_FILE",
        help=f"File holding the account's password (or set {PASSWORD_ENV}).",
    ),
    mqtt_tls_ca: Path | None = typer.Option(
        None,
        "--mqtt-tls-ca",
        envvar="KVFENCE_MQTT_TLS_CA",
        help="TLS: the CA (PEM) that signed the broker's certificate.",
    ),
    mqtt_tls_cert: Path | None = typer.Option(
        None,
        "--mqtt-tls-cert",
        envvar="KVFENCE_MQTT_TLS_CERT",
        help="TLS: client certificate (PEM), for a broker that requires one.",
    ),
    mqtt_tls_key: Path | None = typer.Option(
        None, "--mqtt-tls-key", envvar="KVFENCE_MQTT_TLS_KEY", help="TLS: the client key (PEM)."
    ),
    mqtt_tls_server_name: str | None = typer.Option(
        None,
        "--mqtt-tls-server-name",
        envvar="KVFENCE_MQTT_TLS_SERVER_NAME",
        help="TLS: the name the broker's certificate carries, when it is not --mqtt-host "
        "(through a port-forward: the broker's Service name).",
    ),
    cluster: str | None = typer.Option(
        None,
        "--cluster",
        help="Cluster name, as the services' config gives it (the Helm chart's clusterName, "
        "default kvfence): with another, no event arrives.",
        show_default="local, or cluster of --config",
    ),
    kind: list[str] | None = typer.Option(
        None, "--kind", "-k", help=f"Only this kind (repeatable): {', '.join(EVENT_KINDS)}."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Exit after N events."),
    hint_after: float = typer.Option(
        DEFAULT_HINT_AFTER_S,
        "--hint-after",
        min=0.0,
        help="Seconds without any event before one hint on stderr (the clusters this broker "
        "has, what the silence may mean); it keeps waiting. 0: no hint.",
    ),
    config: Path | None = typer.Option(None, "--config", "-c", help="Cluster config file."),
) -> None:
    """Show the cluster's events (MQTT) live."""
    if not follow_:
        _exit("kvfence events needs --follow (only the live view exists)", EXIT_USAGE)
    unknown = sorted(set(kind or ()) - set(EVENT_KINDS))
    if unknown:
        _exit(
            f"events: unknown --kind {', '.join(unknown)}; valid kinds: {', '.join(EVENT_KINDS)}",
            EXIT_USAGE,
        )
    if cluster is not None and (not cluster or any(c in cluster for c in TOPIC_RESERVED)):
        # a topic level: "+" or "#" would subscribe to every cluster (or be refused by the
        # broker), "/" to a topic no cluster publishes to
        _exit(
            f"events: --cluster {cluster!r} cannot be a cluster name: it must be non-empty and "
            f"hold none of {', '.join(repr(c) for c in TOPIC_RESERVED)}",
            EXIT_USAGE,
        )
    host, port, name, credentials, tls = _target(
        config,
        mqtt_host,
        mqtt_port,
        cluster,
        mqtt_username,
        mqtt_password_file,
        (mqtt_tls_ca, mqtt_tls_cert, mqtt_tls_key),
        mqtt_tls_server_name,
    )
    console = Console(highlight=False, soft_wrap=True)
    try:
        asyncio.run(
            _stream(
                name,
                host,
                port,
                kind or None,
                as_json,
                limit,
                console,
                credentials,
                tls,
                hint_after=hint_after,
            )
        )
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_OK) from None
    except ConfigError as err:  # a TLS file that changed since _target read it
        _exit(f"events: {err}", EXIT_USAGE)
    except aiomqtt.MqttError as err:
        if is_auth_refusal(err):
            account = (
                f"the account {credentials.username!r}"
                if credentials is not None
                else "a connection without an account (give --mqtt-username and a password)"
            )
            _exit(f"events: MQTT broker {host}:{port} refused {account}: {err}", EXIT_BROKER)
        # a client without a certificate, for a broker that may require one
        give_cert = (
            f"give {tls.settings[1]} and {tls.settings[2]}"
            if tls is not None and tls.cert_file is None
            else None
        )
        if tls is not None and is_tls_failure(err):
            if give_cert is not None and is_client_certificate_required(err):
                _exit(
                    f"events: MQTT broker {host}:{port} requires a client certificate ({err}): "
                    f"{give_cert}",
                    EXIT_BROKER,
                )
            cert_hint = (
                f"; a broker that requires client certificates refuses a client without one: "
                f"{give_cert}"
                if give_cert is not None
                else ""
            )
            _exit(
                f"events: TLS handshake with MQTT broker {host}:{port} failed: {err} (the "
                f"broker's certificate must be signed by the CA in {tls.settings[0]} "
                f"{tls.ca_file} and name {tls.server_name or host}, and the broker must serve "
                f"TLS on port {port}{cert_hint})",
                EXIT_BROKER,
            )
        hint = ""
        if tls is None and is_no_answer(err):
            hint = (
                " (no answer to CONNECT: a broker that serves TLS on this port drops plain "
                "clients; give --mqtt-tls-ca)"
            )
        elif give_cert is not None and is_no_answer(err):
            hint = (
                " (no answer to CONNECT over TLS: a broker that requires client certificates "
                f"may drop a client without one; {give_cert})"
            )
        _exit(f"events: MQTT broker {host}:{port} unreachable or lost: {err}{hint}", EXIT_BROKER)


def _target(
    config: Path | None,
    host: str | None,
    port: int | None,
    cluster: str | None,
    username: str | None,
    password_file: Path | None,
    tls_files: tuple[Path | None, Path | None, Path | None],
    server_name: str | None = None,
) -> tuple[str, int, str, MqttCredentials | None, MqttTls | None]:
    try:
        cfg = load_config(config) if config is not None else None
    except ConfigError as err:
        _exit(f"events: {err}", EXIT_USAGE)
    password_env = os.environ.get(PASSWORD_ENV) or None
    what = "--mqtt-password-file"
    tls_what = _TLS_FLAGS
    if cfg is not None:
        host = host or cfg.events.mqtt_host
        port = port or cfg.events.mqtt_port
        cluster = cluster or cfg.cluster
        if username is None and password_file is None and password_env is None:
            username, password_file = cfg.events.mqtt_username, cfg.events.mqtt_password_file
            what = "events.mqtt_password_file"
        if tls_files == (None, None, None):  # the flags, else the config's, never a mix
            e = cfg.events
            tls_files = (e.mqtt_tls_ca_file, e.mqtt_tls_cert_file, e.mqtt_tls_key_file)
            tls_what = (
                "events.mqtt_tls_ca_file",
                "events.mqtt_tls_cert_file",
                "events.mqtt_tls_key_file",
            )
    return (
        host or "127.0.0.1",
        port or 1883,
        cluster or "local",
        _credentials(username, password_file, password_env, what),
        _tls(tls_files, tls_what, server_name),
    )


def _tls(
    files: tuple[Path | None, Path | None, Path | None],
    what: tuple[str, str, str],
    server_name: str | None,
) -> MqttTls | None:
    ca, cert, key = files
    if ca is None and cert is None and key is None:
        if server_name is not None:
            _exit(f"events: --mqtt-tls-server-name needs {what[0]} (TLS)", EXIT_USAGE)
        return None
    if server_name is not None and not server_name.strip():
        _exit("events: --mqtt-tls-server-name is empty", EXIT_USAGE)
    if (cert is None) != (key is None):
        given, missing = (what[1], what[2]) if key is None else (what[2], what[1])
        _exit(f"events: {given} without {missing}: give both, or neither", EXIT_USAGE)
    if ca is None:
        _exit(
            f"events: {what[1]} and {what[2]} need {what[0]} (the CA that signed the broker's "
            "certificate)",
            EXIT_USAGE,
        )
    tls = MqttTls(ca, cert, key, server_name, settings=what)
    try:
        tls.context()  # read now: a wrong file is a usage error, not a broker failure
    except ConfigError as err:
        _exit(f"events: {err}", EXIT_USAGE)
    return tls


def _credentials(
    username: str | None, password_file: Path | None, password_env: str | None, what: str
) -> MqttCredentials | None:
    if password_file is not None and password_env is not None:
        _exit(f"events: give the password once: --mqtt-password-file or {PASSWORD_ENV}", EXIT_USAGE)
    has_password = password_file is not None or password_env is not None
    if username is None and not has_password:
        return None
    if username is not None and not username.strip():
        _exit("events: --mqtt-username is empty", EXIT_USAGE)
    if username is None:
        _exit("events: a password without --mqtt-username: give both, or neither", EXIT_USAGE)
    if not has_password:
        _exit(
            f"events: --mqtt-username without a password: give --mqtt-password-file or set "
            f"{PASSWORD_ENV}",
            EXIT_USAGE,
        )
    try:
        password = read_mqtt_password(password_file, what) if password_file else password_env
    except ConfigError as err:
        _exit(f"events: {err}", EXIT_USAGE)
    assert password is not None
    return MqttCredentials(username, password)


async def _stream(
    cluster: str,
    host: str,
    port: int,
    kinds: list[str] | None,
    as_json: bool,
    limit: int | None,
    console: Console,
    credentials: MqttCredentials | None = None,
    tls: MqttTls | None = None,
    *,
    hint_after: float = 0.0,
) -> None:
    """Print the events of ``cluster``; with ``hint_after`` > 0, one hint on stderr when none
    has arrived that many seconds after subscribing (``_hint_on_silence``)."""
    seen = 0
    subscribed, got_event = asyncio.Event(), asyncio.Event()
    hint = None
    if hint_after > 0:
        hint = asyncio.create_task(
            _hint_on_silence(
                cluster, host, port, kinds, credentials, tls, hint_after, subscribed, got_event
            )
        )
    stream = follow(
        cluster, host, port, kinds, credentials=credentials, tls=tls, on_subscribed=subscribed.set
    )
    try:
        async for event in stream:
            got_event.set()
            if as_json:
                typer.echo(_json(event))
            else:
                console.print(format_event(event))
            seen += 1
            if limit is not None and seen >= limit:
                return
    finally:
        if hint is not None:
            hint.cancel()
            await asyncio.wait([hint])  # let a probe in flight close its connection


async def _hint_on_silence(
    cluster: str,
    host: str,
    port: int,
    kinds: list[str] | None,
    credentials: MqttCredentials | None,
    tls: MqttTls | None,
    after_s: float,
    subscribed: asyncio.Event,
    got_event: asyncio.Event,
) -> None:
    """Once ``after_s`` seconds have passed since the subscription without an event, ask the
    broker which clusters it has (a second, read-only connection) and print the hint on stderr,
    unless an event came meanwhile. Counted from the subscription, not the start: a slow or
    failing connection is reported as such, not as silence."""
    await subscribed.wait()
    try:
        await asyncio.wait_for(got_event.wait(), after_s)
        return
    except TimeoutError:
        pass
    seen: dict[str, dict[str, bool]] | None = None
    failure = None
    try:
        seen = await clusters_seen(host, port, credentials=credentials, tls=tls)
    except Exception as err:  # advice only: whatever fails here must not end the live view
        failure = str(err) or type(err).__name__
    if not got_event.is_set():
        typer.echo(silence_hint(cluster, host, port, kinds, after_s, seen, failure), err=True)


def silence_hint(
    cluster: str,
    host: str,
    port: int,
    kinds: list[str] | None,
    after_s: float,
    seen: dict[str, dict[str, bool]] | None,
    failure: str | None = None,
) -> str:
    """The hint for a cluster that sent nothing for ``after_s`` s: where it listens, then what
    ``seen`` (``clusters_seen``: {cluster: {node: online}}; None when it failed with
    ``failure``) says the silence means. Names from the broker are shown escaped (``_text``):
    anyone who may publish a node status chooses them."""
    name = _text(cluster)
    topics = ", ".join(event_topic(name, k) for k in (sorted(set(kinds)) if kinds else ["+"]))
    lines = [
        f"events: no event from cluster '{name}' for {after_s:g} s (broker {host}:{port}, "
        f"topic {topics}); still waiting."
    ]
    elsewhere = (
        f"cluster '{name}' sends no events to this broker (its config's events.mqtt_host is "
        f"unset or another broker), or this account may not read {TOPIC_ROOT}/{name}/# "
        "(the broker's ACL)"
    )
    if seen is None:
        lines.append(f"  could not list the clusters on this broker: {_text(failure)}")
        lines.append(f"  wrong --cluster? Else {elsewhere}.")
    elif cluster in seen:
        nodes = seen[cluster]
        online = sum(nodes.values())
        kinds_note = " of the kinds given (--kind)" if kinds else ""
        if online:
            lines.append(
                f"  cluster '{name}' is on this broker, {online} of {len(nodes)} node(s) online "
                f"(their retained status): it is up and has had nothing to report{kinds_note} "
                "(a request that succeeds emits no event), or this account may read its node "
                "status but not its events (the broker's ACL)."
            )
        else:
            lines.append(
                f"  cluster '{name}' is known to this broker, but none of its nodes "
                f"({len(nodes)}) is online (their last retained status): nothing of it runs to "
                "emit events."
            )
    elif seen:
        names = sorted(seen)
        shown = [f"{_text(c)} ({sum(seen[c].values())}/{len(seen[c])} nodes online)" for c in names]
        more = len(names) - _HINT_MAX_CLUSTERS
        listed = ", ".join(shown[:_HINT_MAX_CLUSTERS]) + (f" and {more} more" if more > 0 else "")
        lines.append(
            f"  clusters seen on this broker (retained node status this account may read): {listed}"
        )
        lines.append(f"  wrong --cluster? Else {elsewhere}.")
    else:
        lines.append(
            f"  no cluster's node status can be read on this broker ({TOPIC_ROOT}/+/nodes/+): "
            "wrong broker (--mqtt-host, --mqtt-port)? Else no kvfence cluster sends its events "
            "here (events.mqtt_host in its config), or this account may read none of them (the "
            f"broker's ACL), or --cluster '{name}' is wrong."
        )
    return "\n".join(lines)


def format_event(event: dict[str, Any]) -> str:
    """One rich-markup line: time, node, seq, kind (red for security kinds), payload.

    Never raises, whatever the event holds (anyone who may publish under the cluster's events
    topic can send anything): a ts that is no usable time shows as "?", every value is escaped
    for rich markup, and control characters (a terminal's escape sequences) are shown escaped.
    """
    when = _clock(event.get("ts"))
    kind = _text(event.get("kind", "?"))
    style = "bold red" if kind in SECURITY_KINDS else "cyan"
    rest = " ".join(f"{_text(k)}={_json(v)}" for k, v in event.items() if k not in _HEADER_FIELDS)
    node = _markup(_text(event.get("node_id", "?")), tag_follows=True)
    seq = _markup(_text(event.get("seq", "?")), tag_follows=False)
    head = f"{when} [dim]{node}[/dim] #{seq} [{style}]{_markup(kind, tag_follows=True)}[/{style}]"
    return f"{head} {_markup(rest, tag_follows=False)}".rstrip()


def _clock(ts: object) -> str:
    """``ts`` (seconds since the epoch) as UTC HH:MM:SS.mmm; "?" for anything else (a string, a
    bool, NaN, a number beyond the years a datetime holds)."""
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        return "?"
    try:
        return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S.%f")[:-3]
    except (OverflowError, OSError, ValueError):
        return "?"


def _text(value: object) -> str:
    """``value`` as text for the terminal: str() with non-printable characters escaped (ESC
    would let a publisher drive the operator's terminal); "?" when it cannot be made one."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # RecursionError (deeply nested), or a str() that fails
        return "?"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped_char(c) for c in text)


def _escaped_char(c: str) -> str:
    code = ord(c)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def _json(value: object) -> str:
    """``value`` as JSON (ASCII only: no control characters reach the terminal); "?" when it
    cannot be encoded (nested too deep)."""
    try:
        return json.dumps(value, default=str)
    except Exception:
        return "?"


def _markup(text: str, *, tag_follows: bool) -> str:
    """``text`` escaped for rich markup (``rich.markup.escape``), trailing backslashes included:
    before a tag each must be doubled (``escape`` leaves an even run as it is, which then halves,
    or with an odd one escapes, the tag), and elsewhere rich shows them as they are."""
    body = text.rstrip("\\")
    trailing = len(text) - len(body)
    return escape(body) + "\\" * (2 * trailing if tag_follows else trailing)


def _exit(message: str, code: int) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(code)
