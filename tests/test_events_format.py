"""``kvfence events --follow`` against events that anyone allowed to publish under
``kvfence/v1/<cluster>/events/`` can send: none of them may end the operator's live view.

``format_event`` passed any number to ``datetime.fromtimestamp`` (ts=1e20: OverflowError, NaN:
ValueError) and put ``seq`` into rich markup unescaped (``[/dim]``: MarkupError); ``follow``'s
dedupe hashed ``seq`` (a list: TypeError) and its JSON decoding let a RecursionError through.
Controls: well-formed events format exactly as before.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import string
from typing import Any

import aiomqtt
import pytest
from fixtures_mqtt import start_mosquitto
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from test_events import make_cli
from typer.testing import CliRunner

from kvfence.cli.events import format_event
from kvfence.events import follow

CLUSTER = "t1"
GOOD = {
    "seq": 17,
    "ts": 1796055705.503105,
    "kind": "integrity_violation",
    "cluster": "prod",
    "node_id": "decode-0",
    "check": "mac",
    "request_id": "r-1",
}


def render(markup: str) -> str:
    """What the operator sees: the markup printed by rich (raises what rich raises)."""
    screen = io.StringIO()
    console = Console(
        file=screen, color_system=None, width=100_000, highlight=False, soft_wrap=True
    )
    console.print(markup)
    return screen.getvalue().rstrip("\n")


# --- controls: well-formed events look exactly as they did ------------------------------------


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (
            GOOD,
            "16:21:45.503 [dim]decode-0[/dim] #17 [bold red]integrity_violation[/bold red] "
            'check="mac" request_id="r-1"',
        ),
        (
            {
                "seq": 3,
                "ts": 1700000000,
                "kind": "node_joined",
                "cluster": "prod",
                "node_id": "prefill-1",
                "role": "prefill",
                "models": ["m[1]", {"a": None}],
                "pages": 12.5,
            },
            '22:13:20.000 [dim]prefill-1[/dim] #3 [cyan]node_joined[/cyan] role="prefill" '
            'models=["m[1]", {"a": null}] pages=12.5',
        ),
        ({"kind": "request_failed"}, "? [dim]?[/dim] #? [cyan]request_failed[/cyan]"),
    ],
)
def test_a_well_formed_event_formats_as_before(event: dict[str, Any], expected: str) -> None:
    # (the strings are what the formatter gave before the fix, copied from its output)
    assert format_event(event) == expected
    render(expected)


def test_a_well_formed_payload_with_brackets_shows_as_sent() -> None:
    event = {**GOOD, "reason": "[bold]x[/bold]", "path": "a\\b"}
    seen = render(format_event(event))
    assert seen == (
        '16:21:45.503 decode-0 #17 integrity_violation check="mac" request_id="r-1" '
        'reason="[bold]x[/bold]" path="a\\\\b"'
    )


# --- malformed events ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ts", [1e20, -1e20, math.nan, math.inf, -math.inf, 10**30, "yesterday", True, None, [1]]
)
def test_an_unusable_ts_shows_as_a_question_mark(ts: object) -> None:
    seen = render(format_event({**GOOD, "ts": ts}))
    assert seen.startswith("? decode-0 #17 integrity_violation "), seen


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq", "[/dim]"),
        ("seq", "[bold]"),
        ("seq", "\\"),
        ("node_id", "[/dim]"),
        ("node_id", "evil\\"),
        ("node_id", "evil\\\\"),
        ("node_id", "evil\\\\\\"),
        ("kind", "[/cyan]"),
        ("kind", "[/bold red]x\\\\\\"),
        ("kind", "node_joined\\"),
        ("cluster", "[/dim]"),
        ("[/dim]", "[/dim]"),
        ("key\\", "v"),
    ],
)
def test_markup_in_any_field_is_shown_as_text(field: str, value: str) -> None:
    seen = render(format_event({**GOOD, field: value}))
    if field == "cluster":  # not shown
        assert seen == render(format_event(GOOD))
    elif field == "seq":
        assert f" decode-0 #{value} integrity_violation " in seen, seen
    elif field in ("node_id", "kind"):
        assert f" {value} " in seen, seen
    else:
        assert seen.endswith(f" {field}={json.dumps(value)}"), seen


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq", [1, "[/dim]"]),
        ("seq", {"a": "[/dim]"}),
        ("seq", 2**64),
        ("seq", math.nan),
        ("node_id", None),
        ("node_id", 7),
        ("kind", ["integrity_violation"]),
        ("kind", {"[/dim]": 1}),
        ("payload", math.nan),
        ("payload", [[[[["[/dim]"]]]]]),
    ],
)
def test_fields_of_any_json_type_format(field: str, value: object) -> None:
    render(format_event({**GOOD, field: value}))


def test_deeply_nested_values_format() -> None:
    deep = json.loads("[" * 900 + "]" * 900)  # what json.loads still decodes
    for field in ("seq", "node_id", "kind", "ts", "payload"):
        render(format_event({**GOOD, field: deep}))


def test_control_characters_do_not_reach_the_terminal() -> None:
    """A publisher must not drive the operator's terminal (ESC sequences: clear the screen, set
    the title, ...): they are shown escaped."""
    event = {**GOOD, "node_id": "n\x1b[2J", "kind": "k\x07", "seq": "\x1b]0;x\x07", "\x1b[1m": 1}
    seen = render(format_event(event))
    assert "\x1b" not in seen and "\x07" not in seen
    assert "n\\x1b[2J" in seen and "k\\x07" in seen and "\\x1b]0;x\\x07" in seen


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(alphabet=string.printable + "[]/\\#@\x1b\u202e", max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.fixed_dictionaries(
        {},
        optional={k: JSON for k in ("seq", "ts", "kind", "cluster", "node_id")},
    ),
    payload=st.dictionaries(st.text(alphabet="[]/\\ab=\x1b", max_size=6), JSON, max_size=3),
)
def test_any_event_formats_and_prints(header: dict[str, Any], payload: dict[str, Any]) -> None:
    seen = render(format_event({**payload, **header}))
    assert "\x1b" not in seen


# --- the live view, end to end ------------------------------------------------------------------


async def test_the_live_view_survives_malformed_events() -> None:
    """``kvfence events --follow`` over a broker that holds (retained, so the CLI gets them at
    subscribe) malformed events and one well-formed one: every event is shown and the command
    ends at ``--limit`` with status 0, instead of a traceback at the first malformed one."""
    bad = [
        {**GOOD, "seq": "[/dim]", "kind": "node_lost"},
        {**GOOD, "seq": 2, "ts": 1e20, "kind": "node_joined"},
        {**GOOD, "seq": 3, "ts": math.nan, "kind": "request_failed"},
        {**GOOD, "seq": [4], "kind": "transfer_failed"},  # unhashable: follow's dedupe
    ]
    with start_mosquitto() as broker:
        async with aiomqtt.Client(broker.host, broker.port) as pub:
            topics = f"kvfence/v1/{CLUSTER}/events"
            for event in bad:
                await pub.publish(f"{topics}/{event['kind']}", json.dumps(event), 1, True)
            # not JSON to Python (too deep): skipped, not counted
            await pub.publish(f"{topics}/admission_rejected", "[" * 100_000, 1, True)
            await pub.publish(f"{topics}/integrity_violation", json.dumps(GOOD), 1, True)
        args = ["events", "-f", "--mqtt-port", str(broker.port), "--cluster", CLUSTER]
        args += ["--limit", str(len(bad) + 1)]
        result = await asyncio.wait_for(asyncio.to_thread(CliRunner().invoke, make_cli(), args), 20)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 0, result.output
    assert "#[/dim] [cyan]" not in result.output  # shown as text, not markup
    lines = [ln for ln in result.output.splitlines() if "decode-0 #" in ln]
    assert len(lines) == len(bad) + 1, result.output
    assert any(ln.startswith("16:21:45.503 decode-0 #17 integrity_violation") for ln in lines)
    assert any("decode-0 #[/dim] node_lost" in ln for ln in lines)
    assert sum(ln.startswith("? decode-0 #") for ln in lines) == 2  # ts 1e20 and NaN


async def test_follow_dedupes_unhashable_keys_and_skips_undecodable_payloads() -> None:
    """follow() on its own: a seq that is a list is deduped like any other (re-sent twice,
    yielded once); a payload nested too deep for Python is skipped. Control: the well-formed
    event after them arrives."""
    with start_mosquitto() as broker:
        got: list[dict[str, Any]] = []

        async def run_follow() -> None:
            async for event in follow(CLUSTER, broker.host, broker.port):
                got.append(event)
                if event.get("seq") == GOOD["seq"]:
                    return

        task = asyncio.create_task(run_follow())
        topic = f"kvfence/v1/{CLUSTER}/events/node_lost"
        odd = {**GOOD, "seq": [1, {"a": 2}], "ts": {"b": [3]}}
        async with aiomqtt.Client(broker.host, broker.port) as pub:
            while not got:  # the follower subscribes at its own pace
                await pub.publish(topic, json.dumps(odd), qos=1)
                await asyncio.sleep(0.05)
            await pub.publish(topic, json.dumps(odd), qos=1)  # a re-sent duplicate
            await pub.publish(topic, "[" * 100_000, qos=1)
            await pub.publish(topic, json.dumps(GOOD), qos=1)
            await asyncio.wait_for(task, 5)
    assert got == [odd, GOOD]
