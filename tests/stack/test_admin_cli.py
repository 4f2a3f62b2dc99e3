"""The operator CLI as a subprocess against a running `kvfence up` (issue 7)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stack_harness import Stack
from stack_starts import running, seed_embedded_model

from kvfence.errors import Unauthenticated, Unavailable

pytestmark = pytest.mark.slow


def kvfence(stack: Stack, *args: str, admin: bool = True) -> subprocess.CompletedProcess[str]:
    extra = ["--target", stack.up["admin_target"], "--admin-token", stack.up["admin_token"]]
    return subprocess.run(
        [sys.executable, "-m", "kvfence", *args, *(extra if admin else [])],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """This module's two stacks, started at once: one with pools smaller than the 2048-token
    context window (the incident's configuration), which most tests share, and a sound one, the
    last test's own."""
    incident = Stack(
        seed_embedded_model(tmp_path_factory.mktemp("admin")),
        args=["--prefill-pool-tokens", "1024", "--decode-pool-tokens", "768"],
    )
    sound = Stack(
        seed_embedded_model(tmp_path_factory.mktemp("sound")),
        args=["--prefill-pool-tokens", "2048", "--decode-pool-tokens", "4096"],
    )
    with running(incident, sound):
        yield {"incident": incident, "sound": sound}


@pytest.fixture(scope="module")
def stack(stacks):
    return stacks["incident"]


def test_tenants_create_list_revoke(stack):
    out = kvfence(stack, "tenants", "create", "acme", "--max-tokens", "64", "--json")
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    assert created["tenant"] == "acme" and created["api_key"]
    with stack.client(created["api_key"]) as c:  # the key works ...
        assert len(c.generate(prompt_ids=[4, 5], max_new_tokens=2, ignore_eos=True).token_ids) == 2
    listed = json.loads(kvfence(stack, "tenants", "list", "--json").stdout)
    acme = next(t for t in listed if t["name"] == "acme")
    key_id = acme["keys"][0]["key_id"]
    assert created["api_key"] not in json.dumps(listed)  # shown once, never listed
    assert kvfence(stack, "tenants", "revoke-key", key_id).returncode == 0
    with stack.client(created["api_key"]) as c, pytest.raises(Unauthenticated):  # ... then not
        c.generate(prompt_ids=[4, 5], max_new_tokens=2)


def test_nodes_and_bad_token(stack):
    out = kvfence(stack, "nodes", "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    roles = sorted(n["role"] for n in body["nodes"])
    assert roles == ["decode", "prefill"]
    bad = subprocess.run(
        [sys.executable, "-m", "kvfence", "nodes", "--target", stack.up["admin_target"],
         "--admin-token", "wrong"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_model_offline_refuses_at_admission_and_back(stack):
    """The kill switch's "UNAVAILABLE within a second" (README), for a request that comes once
    `model offline` has answered: refused at admission, by the switch, before any node is called
    (not after the nodes' work, a queue wait or a deadline). Control: the same request is served,
    calling the nodes, before and after."""
    with stack.client() as c:
        assert c.generate(prompt_ids=[7], max_new_tokens=1, ignore_eos=True).token_ids
        assert kvfence(stack, "model", "offline", "--reason", "incident drill").returncode == 0
        before = stack.node_rpc_counts()
        with pytest.raises(Unavailable) as err:
            c.generate(prompt_ids=[7], max_new_tokens=1)
        assert err.value.reason == "MODEL_OFFLINE" and "incident drill" in err.value.message
        assert stack.node_rpc_counts() == before  # no Reserve, no Prefill
        status = json.loads(kvfence(stack, "model", "status", "--json").stdout)
        assert status["online"] is False
        assert kvfence(stack, "model", "online").returncode == 0
        assert c.generate(prompt_ids=[7], max_new_tokens=1, ignore_eos=True).token_ids
        after = stack.node_rpc_counts()
        assert after.keys() == before.keys() and all(after[n] > before[n] for n in before)


def test_check_config_live_fails_on_incident_like_cluster(stack):
    out = kvfence(stack, "check-config", "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["context_window"] == 2048 and report["admissible_limit"] == 768
    assert [p["ok"] for p in report["pools"]] == [False, False]


def test_check_config_live_passes_on_a_sound_cluster(stacks):
    sound = stacks["sound"]
    out = kvfence(sound, "check-config", "--json")
    assert out.returncode == 0, out.stderr
    live = json.loads(out.stdout)
    assert live["admissible_limit"] == 2048
    # The live report's page size, dtype and bytes come from the nodes' registered layout and
    # must equal what the static check computes from the same config file.
    static = subprocess.run(
        [sys.executable, "-m", "kvfence", "check-config", "--static",
         str(sound.state_dir / "up-config.yaml"), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    want = json.loads(static.stdout)
    assert want["page_bytes"] > 0
    for key in ("page_size", "dtype", "page_bytes"):
        assert live[key] == want[key], key
