"""`kvfence up` serves and leaves nothing running after SIGTERM; foreign nodes are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import yaml
from stack_harness import Stack
from stack_starts import running, seed_embedded_model

pytestmark = pytest.mark.slow

# the stacks' names name their state directories, which every service's command line holds: no
# role in them ("decode" would match every service of that stack's, not its decode node alone)
KILLED = {"up": "killed-1", "decode": "killed-2"}
FRESH = ("clean", "kill-switch", *KILLED.values(), "token-file")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A fresh stack for each test below that starts one of its own, all started at once (and
    those a test left running stopped at once at the end): each test still has its stack to
    itself, and kills or stops it as it did. "clean"'s state directory was used before (an
    earlier run's log is there); "token-file"'s base config names control_plane.admin_token_file."""
    root = tmp_path_factory.mktemp("fresh")
    logs = root / "clean" / "logs"
    logs.mkdir(parents=True)
    (logs / "cp.log").write_text("an earlier run's line\n")
    token = root / "admin-token"
    token.write_text("kvfa_operators_own\n")
    config = {"token-file": {"control_plane": {"admin_token_file": str(token)}}}
    stacks = {
        name: Stack(seed_embedded_model(root / name), config=config.get(name)) for name in FRESH
    }
    with running(*stacks.values()):
        yield stacks


def test_up_serves_and_stops_cleanly(fresh):
    stack = fresh["clean"]
    logs = stack.state_dir / "logs"
    procs = [psutil.Process(stack.proc.pid), *stack.children]
    assert len(procs) == 4  # up, control plane, one prefill, one decode
    out = (stack.state_dir / "up.out").read_text()
    assert f"kvfence ready: {stack.target}" in out and "kvfence generate" in out
    with stack.client() as c:
        result = c.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3
    up_json = stack.state_dir / "up.json"
    up = json.loads(up_json.read_text())
    assert set(up) >= {"target", "admin_token", "api_keys"} and "demo" in up["api_keys"]
    assert up_json.stat().st_mode & 0o077 == 0  # credentials: owner only
    stack.stop()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert not up_json.exists()  # a stopped stack leaves no "serving here" behind
    # this run logged afresh, and the run before it is kept one deep
    assert "an earlier run's line" not in (logs / "cp.log").read_text()
    assert "control plane stopped" in (logs / "cp.log").read_text()
    assert (logs / "cp.log.1").read_text() == "an earlier run's line\n"


def test_up_serves_with_the_admin_token_file_its_base_config_names(fresh):
    """With control_plane.admin_token_file in the base config the control plane reads that file
    and writes none in the state directory, where up waited for one: 60 s, then "control plane
    did not start" of a control plane that had. up now uses the named file (the default, a
    token written in the state directory, is test_up_serves_and_stops_cleanly)."""
    stack = fresh["token-file"]
    assert stack.up["admin_token"] == "kvfa_operators_own"
    with stack.admin() as admin:
        assert len(admin.list_nodes().nodes) == 2
    assert not (stack.state_dir / "admin_token").exists()


def test_up_says_how_to_undo_a_kill_switch_it_starts_with(fresh):
    """The kill switch is kept in the state directory: `up` on one where the model was taken
    offline printed "kvfence ready" and a generate command that failed UNAVAILABLE. It now says
    the model is offline, why, and the command that undoes it, which works."""
    import time

    from kvfence.errors import Unavailable

    stack = fresh["kill-switch"]
    state = stack.state_dir
    try:
        with stack.admin() as admin:
            admin.set_model_access(False, "incident 42")
    finally:
        stack.stop()
    out = (state / "up.out").read_text()
    assert "kvfence ready" in out and "OFFLINE" not in out  # control: it was online at start

    stack = Stack(state).start()
    try:
        deadline = time.monotonic() + 30
        while "kill switch" not in (out := (state / "up.out").read_text()):
            assert time.monotonic() < deadline, stack.output()
            time.sleep(0.1)
        assert "model tiny-llama is OFFLINE (incident 42) since 20" in out
        with stack.client() as c, pytest.raises(Unavailable):
            c.generate(prompt_ids=[1, 2], max_new_tokens=2)
        (command,) = [line.strip() for line in out.splitlines() if "kvfence model online" in line]
        venv_bin = os.path.dirname(sys.executable)
        env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}"}
        done = subprocess.run(
            ["bash", "-c", command], cwd=state, env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        with stack.client() as c:
            assert c.generate(prompt_ids=[1, 2], max_new_tokens=2, ignore_eos=True).token_ids
    finally:
        stack.stop()


def test_node_with_other_model_is_refused(fresh, tmp_path):
    # the token-file test's stack, which it leaves running: a foreign node is refused by any
    # control plane, whatever file its admin token comes from (a start and stop is seconds)
    stack = fresh["token-file"]
    from kvfence.model.tiny import ensure_tiny_model

    other = ensure_tiny_model(tmp_path / "other")
    cfg_file = stack.state_dir / "up-config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text())
    # Same architecture, one weight changed: a different fingerprint.
    import torch
    from safetensors.torch import load_file, save_file

    weights = next(other.glob("*.safetensors"))
    state = load_file(weights)
    name = sorted(state)[0]
    state[name] = state[name] + 1e-3
    save_file(state, weights)
    cfg["model"]["path"] = str(other)
    other_cfg = tmp_path / "other.yaml"
    other_cfg.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "KVFENCE__NODE__NODE_ID": "intruder"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence", "serve", "decode", "--config", str(other_cfg)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "fingerprint" in (proc.stderr + proc.stdout)
    with stack.admin() as admin:
        ids = sorted(n.node_id for n in admin.list_nodes().nodes)
    # control: the stack's own nodes, with the right model, were accepted
    assert ids == ["decode-0", "prefill-0"]
    del torch


@pytest.mark.parametrize("victim", ["up", "decode"])
def test_the_stack_stops_whole_when_up_or_a_service_is_killed(fresh, victim):
    """kill -9 of `kvfence up` (the OOM killer, a lost container) cannot be passed on by up
    itself: its services, in sessions of their own, kept serving with their ports bound. The
    kernel now sends them SIGTERM when up dies. A service killed instead stops the rest, and up
    says so in its exit status (it exited 0)."""
    import signal
    import time

    stack = fresh[KILLED[victim]]
    try:
        children = list(stack.children)
        assert len(children) == 3
        with stack.client() as c:  # control: they serve while up lives
            assert c.generate(prompt_ids=[1, 2], max_new_tokens=2, ignore_eos=True).token_ids
        if victim == "up":
            os.kill(stack.proc.pid, signal.SIGKILL)
        else:
            (decode,) = [p for p in children if "decode" in " ".join(p.cmdline())]
            decode.kill()
            assert stack.proc.wait(timeout=60) == 1
            assert not (stack.state_dir / "up.json").exists()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children
        ):
            time.sleep(0.2)
        alive = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"services outlived {victim}: {alive}"
    finally:
        stack.stop()


def test_up_gives_the_control_plane_a_grace_under_its_own_kill_timeout(tmp_path):
    """`up` kills what is left STOP_GRACE_S after SIGTERM; the control plane's default grace
    (25 s, for a pod) would have it killed with requests running instead of failing them
    cleanly, and the nodes' default drain the same. Control: a base config's own value is
    kept."""
    from kvfence.cli.stack import STOP_GRACE_S, build_up_config
    from kvfence.config import parse_config

    opts = dict(
        model=None, context_window=None, prefill_pool_tokens=256, decode_pool_tokens=256,
        page_size=16, port=0, state_dir=tmp_path,
    )  # fmt: skip
    cfg = build_up_config({}, **opts)
    assert cfg["control_plane"]["shutdown_grace_s"] < STOP_GRACE_S
    # its listeners stay open refusing requests for shutdown_refuse_s (alongside the grace, not
    # after it), then give what still answers 1 s: all of it before `up` kills it
    cp = parse_config(cfg, environ={}).control_plane
    assert max(cp.shutdown_grace_s, cp.shutdown_refuse_s) + 1 < STOP_GRACE_S
    own = build_up_config({"control_plane": {"shutdown_grace_s": 1.5}}, **opts)
    assert own["control_plane"]["shutdown_grace_s"] == 1.5
    # the nodes' drain on SIGTERM (25 s by default) too, plus the 1 s they give calls after it
    assert cfg["node"]["drain_timeout_s"] + 1 < STOP_GRACE_S
    own = build_up_config({"node": {"drain_timeout_s": 2}}, **opts)
    assert own["node"]["drain_timeout_s"] == 2
