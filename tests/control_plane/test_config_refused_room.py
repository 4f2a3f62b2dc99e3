"""``control_plane.refused_room_max_s`` is checked against ``transfer.reservation_timeout_s``.

Requests waiting for prefill room fail NO_CAPACITY after RESERVATION_USE_FRACTION (0.75) x the
reservation timeout; a prefill node that refused for room is left out of routing up to
refused_room_max_s. Out as long as requests wait, it failed every one of them though it had room
again, and nothing said so. Now the value must be at most half the reservation timeout
(kvfence/config.py, refused_room_bound_s): set above it, the config does not load; left at its
default, the 5 s is cut to the bound, and the control plane routes by what was cut.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from cp_fakes import FakeNode
from cp_harness import eventually, make_cluster
from typer.testing import CliRunner

from control_plane.pipeline import RESERVATION_USE_FRACTION
from kvfence.cli import check as check_cli
from kvfence.config import (
    PREFILL_ROOM_WAIT_FRACTION,
    ClusterConfig,
    ConfigError,
    parse_config,
    refused_room_bound_s,
)
from kvfence.errors import ResourceExhausted


def _load(refused: float | None, timeout: float | None, env: dict[str, str] | None = None) -> Any:
    data: dict[str, Any] = {}
    if refused is not None:
        data["control_plane"] = {"refused_room_max_s": refused}
    if timeout is not None:
        data["transfer"] = {"reservation_timeout_s": timeout}
    return parse_config(data, environ=env or {})


def test_the_bound_follows_the_pipelines_wait() -> None:
    """The config's copy of the wait fraction is the pipeline's: the bound tracks the real wait."""
    assert PREFILL_ROOM_WAIT_FRACTION == RESERVATION_USE_FRACTION
    assert refused_room_bound_s(60.0) == 30.0
    assert refused_room_bound_s(8.0) == 4.0


@pytest.mark.parametrize(
    ("refused", "timeout", "bound"),
    [
        (5.0, 8.0, "4"),  # the default value, given, with a lowered timeout
        (4.01, 8.0, "4"),  # just over
        (30.0, 59.0, "29.5"),  # within the field's own 0-30 range, over the bound
    ],
)
def test_an_explicit_value_over_the_bound_is_refused(
    refused: float, timeout: float, bound: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _load(refused, timeout)
    message = str(err.value)
    assert f"control_plane.refused_room_max_s ({refused:g})" in message
    assert f"transfer.reservation_timeout_s ({timeout:g})" in message
    assert f"at most {bound} s" in message
    assert "NO_CAPACITY" in message
    assert "<root>" not in message and "(got " not in message


def test_an_explicit_value_from_the_environment_names_its_variable() -> None:
    env = {"KVFENCE__CONTROL_PLANE__REFUSED_ROOM_MAX_S": "6"}
    with pytest.raises(ConfigError) as err:
        _load(None, 8.0, env)
    message = str(err.value)
    assert "control_plane.refused_room_max_s (6)" in message
    assert "transfer.reservation_timeout_s (8)" in message
    assert "(from KVFENCE__CONTROL_PLANE__REFUSED_ROOM_MAX_S)" in message
    # Control: the same variable under the bound loads.
    env["KVFENCE__CONTROL_PLANE__REFUSED_ROOM_MAX_S"] = "3"
    assert _load(None, 8.0, env).control_plane.refused_room_max_s == 3.0


@pytest.mark.parametrize(
    ("refused", "timeout"),
    [(4.0, 8.0), (3.9, 8.0), (0.4, 1.0), (30.0, 60.0), (30.0, None), (29.5, 59.0)],
)
def test_an_explicit_value_within_the_bound_loads(refused: float, timeout: float | None) -> None:
    """Control for the refusals: the bound itself and values under it are kept as given."""
    assert _load(refused, timeout).control_plane.refused_room_max_s == refused


@pytest.mark.parametrize(("timeout", "effective"), [(1.0, 0.5), (4.0, 2.0), (8.0, 4.0)])
def test_the_default_is_cut_to_the_bound_for_a_lowered_timeout(
    timeout: float, effective: float
) -> None:
    cfg = _load(None, timeout)
    assert cfg.control_plane.refused_room_max_s == effective
    # Still unset: a config built from this one with another timeout cuts the default afresh.
    assert "refused_room_max_s" not in cfg.control_plane.model_fields_set
    # Written out (as the config tests do) it is explicit, at the bound, and loads again.
    again = ClusterConfig.model_validate(cfg.model_dump())
    assert again.control_plane.refused_room_max_s == effective


@pytest.mark.parametrize("timeout", [None, 10.0, 60.0, 3600.0])
def test_the_default_stays_5_s_where_the_timeout_allows_it(timeout: float | None) -> None:
    assert _load(None, timeout).control_plane.refused_room_max_s == 5.0


async def test_the_control_plane_routes_by_the_cut_default(tmp_path: Path) -> None:
    """reservation_timeout_s 4: requests wait 3 s for prefill room. A prefill node refuses for
    room without saying its free pages, its heartbeats never show more, and then has room again:
    left out the cut 2 s it is back in time and the waiting request is served. (Left out the
    uncut 5 s, the request failed NO_CAPACITY at 3 s, the node idle with room.)"""
    c = await make_cluster(
        tmp_path, prefill_nodes=0, node_timeout_s=60.0, transfer={"reservation_timeout_s": 4.0}
    )
    try:
        assert c.cp.registry.refused_room_max_s == 2.0
        node = FakeNode("prefill", "prefill-0", c.script, heartbeat_s=0.05)
        assert (await c.add_node(node)).accepted
        node.servicer.refuse = ResourceExhausted("prefill pool full", reason="PREFILL_POOL_FULL")
        call = asyncio.create_task(c.client(timeout=8).generate(prompt_ids=[10], max_new_tokens=2))
        await eventually(lambda: "Prefill" in node.methods())
        registered = c.cp.registry.get(node.node_id)
        assert registered is not None
        refused_at = registered.refused_at
        node.servicer.refuse = None
        assert (await asyncio.wait_for(call, 6)).usage.completion_tokens == 2
        assert node.methods().count("Prefill") == 2
        # Served by the second Prefill, after the cut time out: the refusal did leave it out.
        assert time.monotonic() - refused_at >= 2.0
    finally:
        await c.close()


def _check_config(path: Path) -> Any:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keeps check-config a subcommand
        pass

    check_cli.register(app, {})
    return CliRunner().invoke(app, ["check-config", "--static", str(path)])


def test_check_config_reports_the_bound_like_other_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "transfer:\n  reservation_timeout_s: 8\ncontrol_plane:\n  refused_room_max_s: 5\n"
    )
    result = _check_config(path)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("check-config: invalid configuration:")
    assert "control_plane.refused_room_max_s (5)" in result.stderr
    assert "transfer.reservation_timeout_s (8)" in result.stderr
    # Control: the same file within the bound runs the check (exit 0: the pools hold the window).
    path.write_text(
        "transfer:\n  reservation_timeout_s: 8\ncontrol_plane:\n  refused_room_max_s: 4\n"
    )
    assert _check_config(path).exit_code == 0
