"""The chart's routing cool-down values (controlPlane.failuresToCool, failureCooldownS,
refusedRoomMaxS) reach the control plane's config, and the values schema refuses what kvfence's
config would refuse (so a bad value fails `helm install`, not the control plane's start)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_helm_chart import FULLNAME, find, render, template

from kvfence.config import ConfigError, parse_config


@pytest.fixture(scope="session")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm-home-cooldown")


def values_file(folder: Path, control_plane: dict[str, Any]) -> Path:
    """A values file: `--set` gives a fractional number to the chart as a string. Named by its
    content: test_helm_chart caches renders by file name."""
    text = yaml.safe_dump({"controlPlane": control_plane})
    path = folder / f"cooldown-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    path.write_text(text)
    return path


def cooldown(home: Path, folder: Path, control_plane: dict[str, Any]) -> tuple[int, float, float]:
    docs = render(home, values=[values_file(folder, control_plane)])
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")
    cp = parse_config(yaml.safe_load(text["data"]["config.yaml"]), environ={}).control_plane
    return cp.failures_to_cool, cp.failure_cooldown_s, cp.refused_room_max_s


def test_cooldown_values_reach_the_config(helm_home: Path, tmp_path: Path) -> None:
    # control: the defaults, as kvfence's own
    assert cooldown(helm_home, tmp_path, {}) == (3, 10.0, 5.0)
    given = {"failuresToCool": 1, "failureCooldownS": 0, "refusedRoomMaxS": 2.5}
    assert cooldown(helm_home, tmp_path, given) == (1, 0.0, 2.5)


@pytest.mark.parametrize(
    ("value", "bad", "config_key", "rule"),
    [
        ("failuresToCool", 0, "failures_to_cool", "minimum"),
        ("failuresToCool", 101, "failures_to_cool", "maximum"),
        ("failuresToCool", 2.5, "failures_to_cool", "want integer"),
        ("failureCooldownS", -1, "failure_cooldown_s", "minimum"),
        ("failureCooldownS", 3601, "failure_cooldown_s", "maximum"),
        ("refusedRoomMaxS", 0, "refused_room_max_s", "exclusiveMinimum"),
        ("refusedRoomMaxS", 30.5, "refused_room_max_s", "maximum"),
    ],
)
def test_the_schema_refuses_what_the_config_refuses(
    helm_home: Path, tmp_path: Path, value: str, bad: float, config_key: str, rule: str
) -> None:
    rc, _, err = template(helm_home, values=[values_file(tmp_path, {value: bad})])
    assert rc != 0
    assert f"/controlPlane/{value}" in err and rule in err, err
    with pytest.raises(ConfigError, match=f"control_plane.{config_key}"):
        parse_config({"control_plane": {config_key: bad}}, environ={})


@pytest.mark.parametrize(
    "given",
    [
        {"failuresToCool": 1, "failureCooldownS": 3600, "refusedRoomMaxS": 30},
        {"failuresToCool": 100, "failureCooldownS": 0, "refusedRoomMaxS": 0.001},
    ],
)
def test_the_bounds_render(helm_home: Path, tmp_path: Path, given: dict[str, float]) -> None:
    """Control for the refusals above: the bounds themselves render and parse."""
    expected = (given["failuresToCool"], given["failureCooldownS"], given["refusedRoomMaxS"])
    assert cooldown(helm_home, tmp_path, given) == expected
