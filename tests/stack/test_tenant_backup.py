"""Back up the tenant database of a running `kvfence up` with the CLI, lose it, restore it offline,
and serve the backed-up keys again (real processes: the control plane holds the state directory's
lock in its own process, which the restore must respect)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from stack_harness import Stack
from stack_starts import seed_embedded_model

from kvfence.errors import Unauthenticated

pytestmark = pytest.mark.slow


def kvfence(
    *args: str, stack: Stack | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    extra = []
    if stack is not None:
        extra = ["--target", stack.up["admin_target"], "--admin-token", stack.up["admin_token"]]
    out = subprocess.run(
        [sys.executable, "-m", "kvfence", *args, *extra],
        capture_output=True,
        input=stdin,
        timeout=120,
    )
    return subprocess.CompletedProcess(
        out.args, out.returncode, out.stdout.decode(errors="replace"), out.stderr.decode()
    )


def new_key(stack: Stack, *args: str) -> tuple[str, str]:
    """(api_key, key_id) of `kvfence tenants create|create-key ... --json`."""
    out = kvfence("tenants", *args, "--json", stack=stack)
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    return str(created["api_key"]), str(created["key_id"])


def serves(stack: Stack, api_key: str) -> bool:
    with stack.client(api_key) as c:
        try:
            c.generate(prompt_ids=[4, 5], max_new_tokens=2, ignore_eos=True)
        except Unauthenticated:
            return False
    return True


def test_backup_restore_round_trip(tmp_path: Path) -> None:
    state = tmp_path / "state"
    backup = tmp_path / "tenants.backup"
    stack = Stack(seed_embedded_model(state)).start()
    try:
        acme, _ = new_key(stack, "create", "acme", "--max-tokens", "64")
        acme_2, acme_2_id = new_key(stack, "create-key", "acme")
        beta, _ = new_key(stack, "create", "beta")
        out = kvfence("tenants", "backup", str(backup), stack=stack)
        assert out.returncode == 0, out.stderr
        assert stat.S_IMODE(backup.stat().st_mode) == 0o600
        # after the backup: another tenant, another key, a revocation
        gamma, _ = new_key(stack, "create", "gamma")
        acme_3, _ = new_key(stack, "create-key", "acme")
        assert kvfence("tenants", "revoke-key", acme_2_id, stack=stack).returncode == 0
        assert not serves(stack, acme_2) and serves(stack, gamma) and serves(stack, acme_3)

        # the control plane (another process) holds the state directory: restore refuses
        out = kvfence("tenants", "restore", "--state-dir", str(state), str(backup))
        assert out.returncode == 1 and "in use" in out.stderr, out.stderr
        assert not list(state.glob("tenants.sqlite3.bak-*"))
        # and so does a second control plane on the same state directory
        out = kvfence("serve", "control-plane", "--config", str(state / "up-config.yaml"))
        assert out.returncode == 1, out.stderr
        assert f"the state directory {state} is in use (a control plane (pid" in out.stderr
        assert serves(stack, gamma)
    finally:
        stack.stop()

    # The database is lost. The lock file stays: the stopped control plane's lock went with its
    # process, and a lock file alone must not block the restore.
    assert (state / "tenants.sqlite3.lock").exists()
    for name in ("tenants.sqlite3", "tenants.sqlite3-wal", "tenants.sqlite3-shm"):
        (state / name).unlink(missing_ok=True)
    # control: with the control plane stopped it restores (from stdin, as the runbook does
    # through `kubectl exec -i`)
    out = kvfence("tenants", "restore", "--state-dir", str(state), "-", stdin=backup.read_bytes())
    assert out.returncode == 0, out.stderr
    assert "restored 3 tenants" in out.stdout, out.stdout  # demo (from `up`), acme, beta
    assert "keys revoked since the backup work again: revoke them anew" in out.stdout

    stack = Stack(state).start()
    try:
        for key in (acme, acme_2, beta):  # acme_2 was revoked after the backup: valid again
            assert serves(stack, key), key
        for key in (gamma, acme_3):
            assert not serves(stack, key), key
        assert serves(stack, stack.api_key)  # `up` reissues the demo key on the restored database
        listed = json.loads(kvfence("tenants", "list", "--json", stack=stack).stdout)
        assert sorted(t["name"] for t in listed) == ["acme", "beta", "demo"]
        [acme_t] = [t for t in listed if t["name"] == "acme"]
        assert acme_t["limits"]["max_tokens_per_request"] == 64
    finally:
        stack.stop()
