"""An alert that counts chosen reasons names each of them in its summary, the line an on-call
engineer reads first (RUNBOOK.md has the rest).

KvfenceOutOfCapacity counts NO_CAPACITY (no decode pages, or no prefill node with room) and
QUEUE_FULL, but its summary said "for want of decode pages": the page pointed at decode alone
when prefill was full.
"""

from __future__ import annotations

import re

from test_alert_rules import load_rules

REASONS = re.compile(r'\breason\s*=~?\s*"([^"]+)"')


def unnamed_reasons(rules: list[dict]) -> dict[str, list[str]]:
    """Per alert, the reasons its expression selects that its summary leaves out."""
    out = {}
    for rule in rules:
        reasons = [r for group in REASONS.findall(rule["expr"]) for r in group.split("|")]
        summary = rule["annotations"]["summary"]
        left_out = [r for r in reasons if not re.search(rf"\b{re.escape(r)}\b", summary)]
        if left_out:
            out[rule["alert"]] = left_out
    return out


def test_every_reason_an_alert_counts_is_in_its_summary() -> None:
    rules = load_rules()
    assert any(REASONS.search(r["expr"]) for r in rules)  # KvfenceOutOfCapacity at least
    assert unnamed_reasons(rules) == {}
    (capacity,) = [r for r in rules if r["alert"] == "KvfenceOutOfCapacity"]
    assert "prefill" in capacity["annotations"]["summary"]


def test_a_summary_that_leaves_a_reason_out_is_reported() -> None:
    rule = {
        "alert": "A",
        "expr": 'rate(x{reason=~"NO_CAPACITY|QUEUE_FULL"}[5m]) > 0',
        "annotations": {"summary": "refuses requests for want of decode pages (NO_CAPACITY)"},
    }
    assert unnamed_reasons([rule]) == {"A": ["QUEUE_FULL"]}
