"""The chart refuses controlPlane.refusedRoomMaxS over half of transfer.reservationTimeoutS, as
kvfence's config does (kvfence/config.py, refused_room_bound_s): the chart always sets
control_plane.refused_room_max_s, so kvfence would refuse it at the control plane's start; the
template check fails `helm install` instead, naming both values."""

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
    return tmp_path_factory.mktemp("helm-home-refused-room")


def values_file(folder: Path, values: dict[str, Any]) -> Path:
    """A values file (`--set` gives the chart a fractional number as a string), named by its
    content: test_helm_chart caches renders by file name."""
    text = yaml.safe_dump(values)
    path = folder / f"refused-room-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    path.write_text(text)
    return path


def _values(refused: float | None, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"transfer": {"reservationTimeoutS": timeout}}
    if refused is not None:
        out["controlPlane"] = {"refusedRoomMaxS": refused}
    return out


@pytest.mark.parametrize(("refused", "timeout"), [(None, 8), (4.5, 8), (30, 59)])
def test_the_chart_refuses_a_value_over_half_the_timeout(
    helm_home: Path, tmp_path: Path, refused: float | None, timeout: float
) -> None:
    rc, _, err = template(helm_home, values=[values_file(tmp_path, _values(refused, timeout))])
    assert rc != 0
    given = 5 if refused is None else refused  # the chart's default, set explicitly
    assert f"controlPlane.refusedRoomMaxS {given} exceeds {timeout / 2:g}" in err, err
    assert f"transfer.reservationTimeoutS {timeout}" in err, err
    # kvfence refuses the same config.
    data = {
        "control_plane": {"refused_room_max_s": given},
        "transfer": {"reservation_timeout_s": timeout},
    }
    with pytest.raises(ConfigError, match=r"control_plane\.refused_room_max_s"):
        parse_config(data, environ={})


@pytest.mark.parametrize(
    ("refused", "timeout", "expected"), [(None, 60, 5.0), (4, 8, 4.0), (30, 60, 30.0)]
)
def test_values_within_the_bound_render(
    helm_home: Path, tmp_path: Path, refused: float | None, timeout: float, expected: float
) -> None:
    """Control for the refusals above: the bound itself, and the defaults, render and load."""
    docs = render(helm_home, values=[values_file(tmp_path, _values(refused, timeout))])
    text = find(docs, "ConfigMap", f"{FULLNAME}-config")
    cfg = parse_config(yaml.safe_load(text["data"]["config.yaml"]), environ={})
    assert cfg.control_plane.refused_room_max_s == expected
    assert cfg.transfer.reservation_timeout_s == timeout
