"""RUNBOOK.md names every reason an operator sees on the control plane's refusals and every
`check` of kvfence_integrity_failures_total, in its tables, read from the code.

Alerts, events and metrics carry these strings (`admission_rejected` and `request_failed` events,
`kvfence_admission_rejections_total{reason}`, `kvfence_integrity_failures_total{check}`, which
every service exports at 0 for each check). A value the runbook never names leaves whoever is on
call guessing: MODEL_OFFLINE, API_KEY_REVOKED, INVALID_PARAMETERS and RESERVATION_MISMATCH, and
seven of the checks, were once missing.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

from control_plane import admission, pipeline
from kvfence import errors

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "RUNBOOK.md"
SOURCES = ("kvfence", "control_plane", "prefill_svc", "decode_svc")


def reason_constants(module: ModuleType) -> set[str]:
    """The module's reason strings: the constants whose value is their name (QUEUE_FULL =
    "QUEUE_FULL")."""
    return {v for k, v in vars(module).items() if isinstance(v, str) and k.isupper() and k == v}


def refusal_reasons() -> set[str]:
    """Every reason the control plane refuses or ends a request with by name: admission's refusals
    (the labels of kvfence_admission_rejections_total), the pipeline's (the kill switch, a
    shutdown, no nodes) and the shared ones of kvfence.errors (a revoked key, bad parameters, a
    node draining or restarted, a reservation released)."""
    return reason_constants(admission) | reason_constants(pipeline) | reason_constants(errors)


def section(markdown: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## ``."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert m is not None, f"no section {heading!r}"
    return m.group(1)


def first_column_names(text: str) -> set[str]:
    """The backticked UPPER_CASE names in the first cell of each row of the tables in ``text``."""
    names = set()
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"\|\s*-", line):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def in_code(name: str) -> bool:
    """Whether the sources hold ``name`` as a string literal: the docs must not invent one."""
    quoted = re.compile(rf"[\"']{name}[\"']")
    return any(
        quoted.search(path.read_text())
        for package in SOURCES
        for path in (ROOT / package).rglob("*.py")
    )


def test_every_refusal_reason_is_in_the_runbooks_reason_table() -> None:
    reasons = refusal_reasons()
    # the code's own: a lookup that found nothing would pass anything
    assert {"MODEL_OFFLINE", "INVALID_PARAMETERS", "API_KEY_REVOKED", "QUEUE_FULL"} <= reasons
    table = first_column_names(section(RUNBOOK.read_text(), "Reasons a request fails"))
    assert sorted(reasons - table) == []
    # the one reason that is the control plane's check of a node's answer, not a bug of its own
    assert "RESERVATION_MISMATCH" in table


def test_every_integrity_check_is_in_the_runbooks_check_table() -> None:
    table = first_column_names(section(RUNBOOK.read_text(), "KvfenceIntegrityCheckFailed"))
    assert sorted(errors.INTEGRITY_CHECKS - table) == []
    assert sorted(table - errors.INTEGRITY_CHECKS) == []  # a label no service exports


def test_every_name_in_the_reason_table_is_the_codes() -> None:
    table = first_column_names(section(RUNBOOK.read_text(), "Reasons a request fails"))
    assert sorted(name for name in table if not in_code(name)) == []


def test_the_table_reader_sees_rows_and_skips_the_rest() -> None:
    """Control: names in a table's first column count; in its other columns, in prose or in the
    separator row, they do not; a name the code never uses is found out."""
    text = (
        "| reason | status |\n|---|---|\n| `NO_NODES`, `NODE_LOST` | UNAVAILABLE `X` |\n"
        "`QUEUE_FULL` in prose\n"
    )
    assert first_column_names(text) == {"NO_NODES", "NODE_LOST"}
    assert in_code("NO_NODES")
    assert not in_code("NO_SUCH_REASON_ANYWHERE")
