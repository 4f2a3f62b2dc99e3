"""``kvfence serve ROLE`` (one service per process) and ``kvfence up`` (the local stack).

``up`` writes a cluster config into the state directory, starts the control plane, then N prefill
and M decode processes on loopback, waits until every node has registered, creates a demo tenant
(or, when an earlier ``up`` with this state directory created it, issues it a fresh key and
revokes its older ones: only the key in ``up.json`` works), writes ``<state-dir>/up.json``
``{"target", "admin_target", "admin_token", "api_keys": {"demo": ...}, "pid"}`` (owner-only,
atomically: it exists, whole, exactly while the stack serves) and prints ``kvfence ready:
<target>`` followed by a paste-ready ``kvfence generate`` command. Ctrl-C, SIGTERM or SIGHUP (the
terminal closed) stops every process it started (SIGTERM first, SIGKILL after a grace period)
and ``up`` exits 0, during start-up too (it then says ``kvfence up: stopped``); so does any of
them exiting, and ``up`` then exits 1 naming it and its exit status (during start-up, with the
last line it logged: the cause, where "nodes did not register" would name only the stage; a
stage that times out is still named as the stage).

When the config names no checkpoint and the state directory does not hold the embedded model
whole, ``up`` first writes it there (``models/tiny-llama``) in a process of its own, ``python -m
kvfence.model.tiny``, whose lines lead the control plane's log: writing needs torch, which the
control plane, started once the files are there, then never loads. (``kvfence serve
control-plane`` started alone on such a directory writes them itself, importing torch.)

One ``up`` per state directory: ``up`` holds an exclusive ``flock`` on ``<state-dir>/up.lock``
(naming its pid) for as long as it runs, taken before it writes anything there. A second ``up``
on the same state directory is refused (exit 2) and leaves the running stack, its logs and its
``up.json`` alone. ``up`` takes its control plane as started only once that process holds the
state directory's lock (``tenants.sqlite3.lock`` names it) and listens on the admin port: not
from an admin token file, which outlives every run, nor from another control plane answering.

Each service logs to ``<state-dir>/logs/<service>.log``. A new ``up`` moves the logs it finds
there to ``<service>.log.1`` (replacing the run before that) and starts afresh: the run that just
stopped is kept for a look, and a state directory reused for weeks does not keep every run's
lines. Within a run the files are not rotated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml

from kvfence.config import ConfigError, Role, load_config

if TYPE_CHECKING:
    from kvfence.client import AdminClient

STOP_GRACE_S = 10.0
LOCAL_SHUTDOWN_GRACE_S = 5.0  # the control plane's, under STOP_GRACE_S
LOCAL_DRAIN_TIMEOUT_S = 5.0  # the nodes' node.drain_timeout_s, under STOP_GRACE_S too
DEMO_TENANT = "demo"
# Signals that stop `up` and, through it, every service it started (they run in their own
# sessions, so a closed terminal's SIGHUP reaches only `up`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PARENT_ENV = "KVFENCE_STOP_WITH_PARENT"  # the pid of the `up` that started a service
PR_SET_PDEATHSIG = 1


def register(app: typer.Typer, groups: dict[str, typer.Typer]) -> None:
    serve = groups["serve"]

    def _serve(role: Role, config: Path | None) -> None:
        from kvfence import logging as kvlog

        _exit_on_stop_signals()
        kvlog.configure("json", os.environ.get("KVFENCE_LOG_LEVEL", "INFO"))
        _stop_with_parent()
        try:
            cfg = load_config(config)
        except ConfigError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        if role != Role.CONTROL_PLANE:
            # Only the nodes move KV over UCX. kvfence.transfer imports torch, which the control
            # plane never needs (seconds of its start and hundreds of MiB).
            from kvfence.transfer import service_ucx_defaults

            # One event loop per service process: ucxx's notifier thread can complete UCX futures.
            service_ucx_defaults()
        try:
            asyncio.run(_run_service(cfg, role))
        except KeyboardInterrupt:
            pass
        except Exception as err:
            typer.echo(f"kvfence serve {role.value}: {err}", err=True)
            raise typer.Exit(1) from None
        finally:
            # The stop is done (the loop's handlers went with it): a second SIGTERM or Ctrl-C in
            # what is left (UCX's notifier, the interpreter's exit, up to seconds) must not turn
            # a clean stop into a killed process (exit 143 or 130).
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            # ucxx starts only through kvfence.transfer: where that was never imported (the
            # control plane) there is no notifier thread to stop.
            if "kvfence.transfer" in sys.modules:
                from kvfence.transfer import stop_ucx_notifier

                stop_ucx_notifier()

    config_opt = typer.Option(None, "--config", "-c", help="Cluster config YAML.")

    @serve.command("control-plane")
    def serve_cp(config: Path | None = config_opt) -> None:
        """Run the control plane (public API, node registry, admin API)."""
        _serve(Role.CONTROL_PLANE, config)

    @serve.command("prefill")
    def serve_prefill(config: Path | None = config_opt) -> None:
        """Run a prefill node."""
        _serve(Role.PREFILL, config)

    @serve.command("decode")
    def serve_decode(config: Path | None = config_opt) -> None:
        """Run a decode node."""
        _serve(Role.DECODE, config)

    @app.command("up")
    def up(
        ctx: typer.Context,
        model: Path | None = typer.Option(None, help="Checkpoint folder (default: embedded tiny)."),
        prefill: int = typer.Option(1, min=1, help="Prefill processes."),
        decode: int = typer.Option(1, min=1, help="Decode processes."),
        context_window: int | None = typer.Option(None, min=1, help="Override the model's."),
        prefill_pool_tokens: int = typer.Option(
            4096, min=1, help="KV pool of each prefill, in tokens."
        ),
        decode_pool_tokens: int = typer.Option(
            4096, min=1, help="KV pool of each decode, in tokens."
        ),
        page_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
        port: int = typer.Option(50051, min=1, max=65534, help="Public port; admin is port+1."),
        state_dir: Path = typer.Option(Path(".kvfence"), help="State (tenants, tokens, up.json)."),
        config: Path | None = typer.Option(None, help="Base config; the options above win."),
    ) -> None:
        """Run the whole stack on loopback until Ctrl-C / SIGTERM / SIGHUP."""
        base: dict[str, Any] = {}
        if config is not None:
            try:
                load_config(config)  # a missing file, bad YAML or a non-mapping: one line, exit 2
            except ConfigError as err:
                typer.echo(f"kvfence up: {err}", err=True)
                raise typer.Exit(2) from None
            base = yaml.safe_load(config.read_text()) or {}
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            typer.echo(f"kvfence up: cannot create state dir {state_dir}: {err.strerror}", err=True)
            raise typer.Exit(2) from None
        # Before anything below writes to the state directory (up-config.yaml, the logs, up.json):
        # a second `up` there must leave a running stack exactly as it was. Let go when the
        # command ends (after run_stack stopped the stack), in-process too, as the CLI tests run.
        lock_fd = hold_up_lock(state_dir)
        ctx.call_on_close(lambda: os.close(lock_fd))
        cfg = build_up_config(
            base,
            model=model,
            context_window=context_window,
            prefill_pool_tokens=prefill_pool_tokens,
            decode_pool_tokens=decode_pool_tokens,
            page_size=page_size,
            port=port,
            state_dir=state_dir,
        )
        cfg_path = state_dir / "up-config.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        try:
            # As the services will read it: the file plus KVFENCE__* environment overrides.
            resolved = load_config(cfg_path)
        except ConfigError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        cp = resolved.control_plane
        owned = {
            "control_plane.state_dir": (Path(cp.state_dir).resolve(), state_dir.resolve()),
            "control_plane.listen": (cp.listen, cfg["control_plane"]["listen"]),
            "control_plane.admin_listen": (cp.admin_listen, cfg["control_plane"]["admin_listen"]),
            "control_plane.address": (cp.address, cfg["control_plane"]["address"]),
        }
        overridden = [k for k, (theirs, ours) in owned.items() if theirs != ours]
        if overridden:
            # up waits for the control plane, and calls it, where it told it to be.
            names = ", ".join(f"KVFENCE__{k.upper().replace('.', '__')}" for k in overridden)
            typer.echo(
                f"kvfence up: {names} overrides what up sets (--state-dir, --port): unset it",
                err=True,
            )
            raise typer.Exit(2)
        tls = [k for k, v in resolved.tls.model_dump().items() if v]
        if tls:
            # The local stack's listeners, and `up`'s own admin calls, are plain loopback: with
            # these set the control plane would serve TLS that `up` cannot speak, and `up` would
            # wait out its registration timeout reporting "nodes did not register".
            typer.echo(
                f"kvfence up: the config sets tls ({', '.join(sorted(tls))}): up runs "
                "every service on loopback without TLS; drop the tls settings (the base config's, "
                "KVFENCE__TLS__* variables: TLS is for a "
                "deployment: `kvfence serve ROLE --config` or the Helm chart)",
                err=True,
            )
            raise typer.Exit(2)
        if resolved.node.metrics_port:
            # Every service up starts (the control plane and each node, at least three) reads
            # this one config: the first would bind the port and every other would die on it,
            # failing the stack with "nodes did not register". 0 gives each a port of its own.
            typer.echo(
                f"kvfence up: the config sets node.metrics_port {resolved.node.metrics_port}: up "
                "runs several services from one config, and only one can listen there; use "
                '0 (each service takes a free port and logs it, "metrics served") or leave it '
                "unset (the base config's, or KVFENCE__NODE__METRICS_PORT)",
                err=True,
            )
            raise typer.Exit(2)
        token_file = resolved.control_plane.admin_token_file
        from kvfence.model.served import embedded_model_dir

        # Where the services will look for the embedded model (None: the config names a
        # checkpoint, written by whoever made it).
        model_dir = embedded_model_dir(resolved)
        raise typer.Exit(
            run_stack(cfg_path, cfg, state_dir, prefill, decode, token_file, model_dir)
        )


def _exit_on_stop_signals() -> None:
    """SIGTERM or SIGINT before the service's event loop takes them over
    (``install_shutdown_signals``): nothing has started yet (the config loads, modules import),
    so the process ends as a stop does, with 0, not killed by the signal."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


async def _run_service(cfg: Any, role: Role) -> None:
    from kvfence.server import install_shutdown_signals

    stop = asyncio.Event()
    install_shutdown_signals(stop)
    if role == Role.CONTROL_PLANE:
        from control_plane.service import serve as serve_cp

        await serve_cp(cfg, stop)
    else:
        from kvfence.node_main import serve_node

        await serve_node(cfg, role, stop)


def build_up_config(
    base: dict[str, Any],
    *,
    model: Path | None,
    context_window: int | None,
    prefill_pool_tokens: int,
    decode_pool_tokens: int,
    page_size: int,
    port: int,
    state_dir: Path,
) -> dict[str, Any]:
    """The cluster config ``up`` runs with: ``base`` overlaid with the command-line options."""
    cfg = json.loads(json.dumps(base))  # deep copy of plain data
    model_cfg = cfg.setdefault("model", {})
    if model is not None:
        model_cfg["path"] = str(model.resolve())
    if context_window is not None:
        model_cfg["context_window"] = context_window
    kv = cfg.setdefault("kv", {})
    kv["page_size"] = page_size
    kv["prefill_pool"] = {"num_pages": max(1, math.floor(prefill_pool_tokens / page_size))}
    kv["decode_pool"] = {"num_pages": max(1, math.floor(decode_pool_tokens / page_size))}
    cp = cfg.setdefault("control_plane", {})
    cp["listen"] = f"127.0.0.1:{port}"
    cp["admin_listen"] = f"127.0.0.1:{port + 1 if port else 0}"
    cp["address"] = cp["listen"]  # where the nodes register: this stack's control plane
    cp["state_dir"] = str(state_dir.resolve())
    # Running requests get a shorter grace than a pod's, within the STOP_GRACE_S after which
    # `up` kills what is left: a stopping control plane fails them cleanly (SHUTTING_DOWN)
    # instead of being killed with them. A base config's own value is kept.
    cp.setdefault("shutdown_grace_s", LOCAL_SHUTDOWN_GRACE_S)
    node = cfg.setdefault("node", {})
    node["listen"] = "127.0.0.1:0"
    # The nodes drain (finish what they hold) for as long, so they too stop by themselves first.
    node.setdefault("drain_timeout_s", LOCAL_DRAIN_TIMEOUT_S)
    return cfg


def _stop_with_parent() -> None:
    """A service that ``up`` started stops when ``up`` dies, however it dies (``kill -9``
    included, which ``up`` cannot pass on): the kernel sends it SIGTERM, its graceful stop
    (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op). ``up`` names itself in PARENT_ENV."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # `up` died before the request took effect
        typer.echo("kvfence serve: the kvfence up that started this service is gone", err=True)
        raise typer.Exit(1)


UP_LOCK = "up.lock"  # in the state directory; the file stays, the lock goes with the process


def hold_up_lock(state_dir: Path) -> int:
    """Take ``<state_dir>/up.lock`` and return its fd (closing it lets go; so does the kernel,
    however ``up`` ends, ``kill -9`` included), or exit 2 naming the ``up`` that holds it.

    Without it a second ``up`` on the state directory of a running one rotated that stack's logs,
    removed its ``up.json``, and revoked the demo key it had printed, before its own control plane
    failed on the tenant database's lock. The control plane's own lock (``tenants.sqlite3.lock``)
    stays: it also keeps a ``kvfence serve control-plane`` and a restore off the directory."""
    from kvfence.filelock import LockHeld, hold_lock

    path = state_dir / UP_LOCK
    try:
        # Its fd is not inherited (PEP 446): a service outliving `up` does not hold it.
        return hold_lock(path, str(os.getpid()))
    except OSError as err:  # opening it, or flock itself (ENOLCK on some network filesystems)
        typer.echo(f"kvfence up: cannot lock {path}: {err.strerror}", err=True)
        raise typer.Exit(2) from None
    except LockHeld as held:
        pid = held.held_by
        who = f"another kvfence up (pid {pid})" if pid.isdigit() else "another kvfence up"
        typer.echo(
            f"kvfence up: {who} is running on {state_dir}: stop it, or use another --state-dir "
            "and --port",
            err=True,
        )
        raise typer.Exit(2) from None


def rotate_logs(logs: Path) -> None:
    """Keep the last run's logs as ``*.log.1``, one run deep (see the module docstring)."""
    for log in logs.glob("*.log"):
        os.replace(log, log.with_name(log.name + ".1"))


def _spawn(
    role: str, cfg_path: Path, env: dict[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    return _spawn_logged(
        [sys.executable, "-m", "kvfence", "serve", role, "--config", str(cfg_path)], env, log_path
    )


def _spawn_logged(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """A child of ``up`` writing stdout and stderr to the end of ``log_path`` (the child holds
    its own copy of the file: ours is closed)."""
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only `up`, which stops the children in order
        )


MODEL_WRITER = "model-writer"  # the process that writes the embedded model before the services
MODEL_WRITE_S = 120.0  # torch's import and the weights' draw: seconds, a cold machine's more


def local_threads(n_nodes: int) -> int:
    """Torch threads per node process when ``n_nodes`` share this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, n_nodes))


def run_stack(
    cfg_path: Path,
    cfg: dict[str, Any],
    state_dir: Path,
    n_prefill: int,
    n_decode: int,
    admin_token_file: Path | None = None,
    embedded_model: Path | None = None,
) -> int:
    """Start every process, wait for registration, serve until a signal; returns the exit code.
    ``admin_token_file``: the config's ``control_plane.admin_token_file`` (overrides included).
    ``embedded_model``: the folder the services take the embedded model from (None when the
    config names a checkpoint), written first when it is not there whole.
    The caller holds the state directory's ``up.lock`` (:func:`hold_up_lock`)."""
    from control_plane.tenants import TENANTS_DB, lock_path
    from kvfence.auth import read_token
    from kvfence.client import AdminClient
    from kvfence.errors import KvfenceError
    from kvfence.model.tiny import tiny_model_complete

    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    stopping = False

    def stop_all(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    # First: a Ctrl-C from here on stops the start (exit 0), not a traceback or exit 1.
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop_all)
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    rotate_logs(logs)
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self")}
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # Every node process would otherwise start one torch thread per core, and on one machine
    # those threads spin against each other (and the control plane) for the same cores: share
    # the cores out instead. An operator's own OMP_NUM_THREADS wins.
    env.setdefault("OMP_NUM_THREADS", str(local_threads(n_prefill + n_decode)))
    env[PARENT_ENV] = str(os.getpid())
    target = cfg["control_plane"]["listen"]
    admin_target = cfg["control_plane"]["admin_listen"]
    # up.json says "this stack is serving, here": one left by an earlier run must not be read as
    # this run's, and it goes when the stack stops.
    up_path = state_dir / "up.json"
    up_path.unlink(missing_ok=True)
    try:
        if stopping:
            return _stopped()
        if embedded_model is not None and not tiny_model_complete(embedded_model):
            # The control plane reads the model's files but never runs it. Left to it, the first
            # start on a state directory imported torch to write them (seconds, and ~400 MiB it
            # then kept for its whole life); a process that writes them and exits keeps torch
            # where it is needed, the nodes. (Checked here, without torch: a later start on the
            # same state directory starts no writer.) Its lines lead the control plane's log,
            # of whose start it is the first step.
            writer = _spawn_logged(
                [sys.executable, "-m", "kvfence.model.tiny", str(embedded_model)],
                env,
                logs / "cp.log",
            )
            procs.append((MODEL_WRITER, writer))  # stopped with the rest on a stop or a failure
            why = _wait(lambda: writer.poll() is not None, MODEL_WRITE_S, lambda: stopping, [])
            if why == READY and writer.returncode != 0:
                why = (MODEL_WRITER, writer)
            if why != READY:
                return _not_ready(why, "the embedded model was not written", logs)
            procs.remove((MODEL_WRITER, writer))  # done: its exit is no service's failure
        control_plane = _spawn("control-plane", cfg_path, env, logs / "cp.log")
        procs.append(("control-plane", control_plane))
        # Where the control plane keeps its admin token: the base config's file when it names
        # one (the control plane only reads that), else the one it writes at first start.
        token_file = admin_token_file or state_dir / "admin_token"
        # Neither a token file (it outlives every run) nor an admin port that answers (another
        # control plane's: on this state directory, or on this port sharing a configured token
        # file) says that THIS run's control plane started. It has when it holds the state
        # directory's lock (the lock file names its pid; it reads or writes the admin token only
        # then), listens on the admin port itself, and answers there with the token.
        cp_lock = lock_path(state_dir / TENANTS_DB)
        admin_port = int(admin_target.rsplit(":", 1)[1])
        admin: AdminClient | None = None
        admin_token = ""

        def control_plane_started() -> bool:
            nonlocal admin, admin_token
            if admin is None:
                try:
                    held_by = cp_lock.read_text()
                except OSError:
                    return False
                if f"(pid {control_plane.pid} " not in held_by:
                    return False
                try:
                    admin_token = read_token(token_file)
                except (OSError, ValueError):
                    return False  # not written yet
                admin = AdminClient(admin_target, admin_token)
            if listens_on(control_plane.pid, admin_port) is False:
                return False
            try:
                admin.list_nodes()
            except KvfenceError:
                return False
            return True

        why = _wait(control_plane_started, 60, lambda: stopping, procs)
        if why != READY:
            return _not_ready(why, "control plane did not start", logs)
        assert admin is not None
        for i in range(n_prefill):
            node_env = {**env, "KVFENCE__NODE__NODE_ID": f"prefill-{i}"}
            procs.append(
                (f"prefill-{i}", _spawn("prefill", cfg_path, node_env, logs / f"prefill-{i}.log"))
            )
        for i in range(n_decode):
            node_env = {**env, "KVFENCE__NODE__NODE_ID": f"decode-{i}"}
            procs.append(
                (f"decode-{i}", _spawn("decode", cfg_path, node_env, logs / f"decode-{i}.log"))
            )

        def all_registered() -> bool:
            assert admin is not None
            try:
                return len(admin.list_nodes().nodes) >= n_prefill + n_decode
            except Exception:
                return False

        why = _wait(all_registered, 180, lambda: stopping, procs)
        if why != READY:
            return _not_ready(why, "nodes did not register", logs)
        try:
            api_key = demo_key(admin)
        except KvfenceError as err:
            return _fail(f"cannot issue the {DEMO_TENANT} tenant's key: {err.message}", logs)
        up = {
            "target": target,
            "admin_target": admin_target,
            "admin_token": admin_token,
            "api_keys": {DEMO_TENANT: api_key},
            "pid": os.getpid(),  # whose: a reader waiting for this run's tells it from a stale one
        }
        # Whole or absent, never half-written (readers poll for it) and never readable by others,
        # not even for a moment: it holds the admin token and an API key.
        tmp_path = state_dir / "up.json.tmp"
        tmp_path.unlink(missing_ok=True)
        fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(up, indent=2))
        os.replace(tmp_path, up_path)
        print(f"kvfence ready: {target}", flush=True)
        print(
            f"  kvfence generate --target {target} --api-key {api_key} "
            "--max-new-tokens 16 'Hello, kvfence'",
            flush=True,
        )
        print(f"  (logs in {logs}, credentials in {up_path}; Ctrl-C stops)", flush=True)
        _say_if_offline(admin, admin_target, token_file)
        failed = False
        while not stopping:
            for name, p in procs:
                if p.poll() is not None:
                    # A local stack with a service gone is not the stack that was asked for:
                    # stop the rest, and say so in the exit status.
                    print(
                        f"kvfence up: {name} exited with {p.returncode}; stopping the stack "
                        f"(see {logs})",
                        file=sys.stderr,
                    )
                    stopping = failed = True
            time.sleep(0.2)
        return 1 if failed else 0
    finally:
        _stop(procs)
        up_path.unlink(missing_ok=True)


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (from Linux's /proc: the
    socket inodes among its fds, in the kernel's TCP tables; gRPC listens on IPv6 sockets, with
    v4-mapped addresses, as often as on IPv4 ones). None where /proc cannot tell."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    sockets = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    listening = False  # any socket listening in the tables read: empty ones (WSL1) tell nothing
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            # sl, local_address (hex ip:port), rem_address, st, queues, timers, uid, timeout, inode
            fields = row.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            listening = True
            if int(fields[1].rsplit(":", 1)[1], 16) == port and f"socket:[{fields[9]}]" in sockets:
                return True
    return False if listening else None


def demo_key(admin: AdminClient) -> str:
    """An API key for the demo tenant that is the only one of its keys that works.

    The tenant database outlives the stack, so a second ``up`` with the same state directory finds
    the demo tenant an earlier run created: it gets a fresh key, and the keys issued before (which
    that run's ``up.json`` showed) are revoked.
    """
    # Asked by name (not every tenant and key of a state directory shared with real tenants);
    # picked by name too, as a control plane from before ListTenantsRequest.names answers all.
    existing = next((t for t in admin.list_tenants([DEMO_TENANT]) if t.name == DEMO_TENANT), None)
    if existing is None:
        return str(admin.create_tenant(DEMO_TENANT).api_key)
    fresh = admin.create_key(DEMO_TENANT)
    for key in existing.keys:
        if not key.revoked and key.key_id != fresh.key_id:
            admin.revoke_key(key.key_id)
    return str(fresh.api_key)


READY = "ready"
STOPPED = "stopped"
TIMED_OUT = "timed out"
# What _wait saw: READY, STOPPED (a stop signal), TIMED_OUT, or the (name, process) that exited.
WaitResult = str | tuple[str, "subprocess.Popen[bytes]"]


def _wait(cond: Any, timeout: float, stopping: Any, procs: list[Any]) -> WaitResult:
    """Poll ``cond`` until it holds; says why it stopped waiting otherwise (see WaitResult): a
    stage that failed is reported by its cause, not as the stage ("nodes did not register" of a
    control plane that could not bind its port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopping():
            return STOPPED
        # The first in start order: the control plane's exit is the cause of the nodes'.
        exited = next(((name, p) for name, p in procs if p.poll() is not None), None)
        if exited is not None:
            return exited
        if cond():
            return READY
        time.sleep(0.2)
    return TIMED_OUT


def _not_ready(why: WaitResult, stage: str, logs: Path) -> int:
    """Say why the start did not get past ``stage``; returns up's exit code."""
    if why == STOPPED:
        return _stopped()
    if isinstance(why, tuple):
        name, proc = why
        last = last_log_line(logs / _log_name(name))
        said = f": {last}" if last else ""
        print(
            f"kvfence up: {name} exited with {proc.returncode}{said}; see {logs}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return _fail(stage, logs)


def _stopped() -> int:
    """A stop signal during the start: as after it, the stack stops and up exits 0."""
    print("kvfence up: stopped", file=sys.stderr, flush=True)
    return 0


def _log_name(service: str) -> str:
    return "cp.log" if service in ("control-plane", MODEL_WRITER) else f"{service}.log"


def last_log_line(path: Path) -> str:
    """The last non-empty line of a service's log, readable: a structlog JSON line as its event
    and fields (an exception as its last line), anything else (a service's own one-line error
    before it exits, a gRPC core message) as it is. "" when there is none."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    try:
        entry = json.loads(line)
    except ValueError:
        return line
    if not isinstance(entry, dict) or "event" not in entry:
        return line
    fields = {k: v for k, v in entry.items() if k not in ("event", "level", "timestamp")}
    exception = str(fields.pop("exception", "")).strip()
    text = str(entry["event"])
    if fields:
        text += " (" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"
    if exception:
        text += ": " + exception.splitlines()[-1]
    return text


def _fail(message: str, logs: Path) -> int:
    print(f"kvfence up: {message}; see {logs}", file=sys.stderr)
    return 1


def _stop(procs: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """Nodes first, control plane last; SIGTERM, then SIGKILL after the grace period."""
    for _, p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for _, p in reversed(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _say_if_offline(admin: AdminClient, admin_target: str, token_file: Path) -> None:
    """The kill switch is kept in the state directory: a stack started on one where the model was
    taken offline serves nothing, and the generate command just printed would fail UNAVAILABLE.
    Say so, and how to undo it, rather than let that look like a broken stack."""
    from kvfence.errors import KvfenceError

    try:
        status = admin.model_status()
    except KvfenceError:
        return  # the stack is up; this is only advice
    if status.online:
        return
    print(
        f"kvfence up: model {status.name} is OFFLINE ({status.reason}) since "
        f"{status.offline_since or 'before this start'}: the kill switch saved in this state "
        "directory; every request gets UNAVAILABLE until\n"
        f"  KVFENCE_ADMIN_TOKEN=$(cat {token_file}) kvfence model online --target {admin_target}",
        file=sys.stderr,
        flush=True,
    )
