"""Routing's cool-down settings come from the control plane's config (``control_plane.
failures_to_cool``, ``failure_cooldown_s``, ``refused_room_max_s``), each control plane its own.

They were module constants of control_plane/routing.py (3 failures, 10 s, 5 s): an operator on
call could not tune them for a slow-restarting node type or a large fleet without a code change.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from cp_fakes import FakeNode
from cp_harness import Cluster, eventually, make_cluster

from control_plane.registry import Node
from control_plane.routing import prefill_candidates
from kvfence.config import ConfigError, parse_config
from kvfence.errors import KvfenceError, ResourceExhausted

COOLING = "node cooling down after failures"


async def _outcome(c: Cluster) -> str:
    try:
        await c.client().generate(prompt_ids=[10, 11], max_new_tokens=2)
    except KvfenceError:
        return "failed"
    return "ok"


def _candidate_ids(c: Cluster) -> list[str]:
    return [n.node_id for n in prefill_candidates(c.cp.registry, skip=set())]


def _registered(c: Cluster, node: FakeNode) -> Node:
    registered = c.cp.registry.get(node.node_id)
    assert registered is not None
    return registered


async def test_failures_to_cool_is_each_control_planes_own(tmp_path: Path) -> None:
    """Two control planes in one process, the same broken prefill node beside a healthy one in
    each: with failures_to_cool=1 the first failure cools the node and the next requests go to the
    other; the control, on defaults at the same time, still needs three (so neither reads the
    other's settings, nor a module-wide value). The log line gives each its own count and
    cool-down."""
    (tmp_path / "one").mkdir()
    (tmp_path / "default").mkdir()
    one = await make_cluster(
        tmp_path / "one", prefill_nodes=2, failures_to_cool=1, failure_cooldown_s=42.0
    )
    default = await make_cluster(tmp_path / "default", prefill_nodes=2)
    try:
        for c in (one, default):
            # INTERNAL: a broken engine, counted against the prefill node only. prefill-0 comes
            # first on a tie, so it draws the first request.
            c.prefill[0].servicer.refuse = KvfenceError("engine broken")
        outcomes: dict[str, list[str]] = {"one": [], "default": []}
        with structlog.testing.capture_logs() as logs:
            for _ in range(4):
                outcomes["one"].append(await _outcome(one))
                outcomes["default"].append(await _outcome(default))
        assert outcomes["one"] == ["failed", "ok", "ok", "ok"]
        assert outcomes["default"] == ["failed", "failed", "failed", "ok"]  # control
        assert one.prefill[0].methods().count("Prefill") == 1
        assert one.prefill[1].methods().count("Prefill") == 3
        assert default.prefill[0].methods().count("Prefill") == 3
        cooling = sorted(
            (e["failures_in_a_row"], e["seconds"], e["node_id"])
            for e in logs
            if e["event"] == COOLING
        )
        assert cooling == [(1, 42.0, "prefill-0"), (3, 10.0, "prefill-0")]
    finally:
        await one.close()
        await default.close()


@pytest.mark.parametrize("cooldown_s", [1.0, 0.0])
async def test_failure_cooldown_s_is_how_long_a_cooled_node_is_left_out(
    tmp_path: Path, cooldown_s: float
) -> None:
    """With failure_cooldown_s=1 a node cooled by a failure is left out (the next request goes
    to the other node), comes back once the configured time has passed (not the 10 s default), and
    the probe it then gets succeeds and clears it. With 0 (never cool) it is not left out at all:
    the next request goes to it, and the log line says seconds=0."""
    c = await make_cluster(
        tmp_path, prefill_nodes=2, failures_to_cool=1, failure_cooldown_s=cooldown_s
    )
    try:
        flaky, other = c.prefill
        flaky.servicer.refuse = KvfenceError("engine broken")
        with structlog.testing.capture_logs() as logs:
            assert await _outcome(c) == "failed"
        [line] = [e for e in logs if e["event"] == COOLING]
        assert line["seconds"] == cooldown_s
        failed_at = _registered(c, flaky).failed_at
        flaky.servicer.refuse = None
        assert await _outcome(c) == "ok"
        if cooldown_s == 0:  # never cools: still the first choice
            assert flaky.methods().count("Prefill") == 2 and "Prefill" not in other.methods()
            return
        assert flaky.methods().count("Prefill") == 1  # left out: the other node served it
        assert other.methods().count("Prefill") == 1
        await eventually(lambda: flaky.node_id in _candidate_ids(c), timeout=5.0)
        assert time.monotonic() - failed_at >= cooldown_s
        assert await _outcome(c) == "ok"  # the probe, on the node that cooled
        assert flaky.methods().count("Prefill") == 2
        assert _registered(c, flaky).failures == 0  # the success cleared it
    finally:
        await c.close()


async def test_refused_room_max_s_is_how_long_a_full_prefill_node_is_left_out(
    tmp_path: Path,
) -> None:
    """A prefill node refuses for room without saying how many pages are free, and its
    heartbeats never show more than before (its pages came back unseen): it is left out only
    refused_room_max_s (0.3 here), then the waiting request is served on it, long before the 5 s
    default."""
    c = await make_cluster(tmp_path, prefill_nodes=0, node_timeout_s=60.0, refused_room_max_s=0.3)
    try:
        node = FakeNode("prefill", "prefill-0", c.script, heartbeat_s=0.05)
        assert (await c.add_node(node)).accepted
        node.servicer.refuse = ResourceExhausted("prefill pool full", reason="PREFILL_POOL_FULL")
        call = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: "Prefill" in node.methods())
        refused_at = _registered(c, node).refused_at
        node.servicer.refuse = None
        assert (await asyncio.wait_for(call, 3)).usage.completion_tokens == 2
        assert node.methods().count("Prefill") == 2
        # Served by the second Prefill, not earlier: the refusal did leave the node out.
        assert _registered(c, node).refused_at == refused_at
        assert time.monotonic() - refused_at >= 0.3
    finally:
        await c.close()


def test_the_defaults_are_the_former_constants() -> None:
    cp = parse_config({}, environ={}).control_plane
    assert (cp.failures_to_cool, cp.failure_cooldown_s, cp.refused_room_max_s) == (3, 10.0, 5.0)


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("failures_to_cool", 0, "greater than or equal to 1"),
        ("failures_to_cool", 101, "less than or equal to 100"),
        ("failures_to_cool", 2.5, "valid integer"),
        ("failures_to_cool", "three", "valid integer"),
        ("failure_cooldown_s", -1, "greater than or equal to 0"),
        ("failure_cooldown_s", 3601, "less than or equal to 3600"),
        ("failure_cooldown_s", float("inf"), "finite number"),
        ("refused_room_max_s", 0, "greater than 0"),
        ("refused_room_max_s", -0.5, "greater than 0"),
        ("refused_room_max_s", 31, "less than or equal to 30"),
        ("refused_room_max_s", float("nan"), "finite number"),
    ],
)
def test_bad_cooldown_values_name_the_key_and_the_rule(key: str, value: Any, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"control_plane": {key: value}}, environ={})
    assert f"control_plane.{key}" in str(err.value)
    assert rule in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("failures_to_cool", 1),
        ("failures_to_cool", 100),
        ("failure_cooldown_s", 0),
        ("failure_cooldown_s", 3600),
        ("refused_room_max_s", 0.001),
        ("refused_room_max_s", 30),
    ],
)
def test_the_bounds_themselves_are_accepted(key: str, value: float) -> None:
    """Control for the refusals above: each bound is a value an operator may give."""
    cp = parse_config({"control_plane": {key: value}}, environ={}).control_plane
    assert getattr(cp, key) == value


def test_cooldown_keys_from_the_environment() -> None:
    env = {
        "KVFENCE__CONTROL_PLANE__FAILURES_TO_COOL": "1",
        "KVFENCE__CONTROL_PLANE__FAILURE_COOLDOWN_S": "30",
        "KVFENCE__CONTROL_PLANE__REFUSED_ROOM_MAX_S": "2.5",
    }
    cp = parse_config({}, environ=env).control_plane
    assert (cp.failures_to_cool, cp.failure_cooldown_s, cp.refused_room_max_s) == (1, 30.0, 2.5)
    with pytest.raises(ConfigError, match=r"failures_to_cool.*KVFENCE__CONTROL_PLANE__FAILURES"):
        parse_config({}, environ={"KVFENCE__CONTROL_PLANE__FAILURES_TO_COOL": "0"})
