"""The isolation probe counts only B probes that *succeeded* while A's requests were in flight.

A deployment that refuses tenant B whenever tenant A is busy, and serves B once A is idle, never
let a B request share pages live with A's: the probe verified nothing there and must say
INCONCLUSIVE (exit 2), not PASS on probes that succeeded only after A's requests ended.

The runs are choreographed with events (no timing): one B probe per round (so B's requests run
one at a time), A's second canary request held until B's first under-load round has finished,
and B's second round sent only after that canary request has ended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import kvfence.probe as probe_mod
from kvfence.cli.probe import _print_report
from kvfence.client import ModelSummary
from kvfence.errors import InvalidArgument, Unavailable
from kvfence.probe import ProbeOptions, ProbeReport, run_isolation_probe
from tests.fake_client import FakeClientBase

LIMIT = 64
WAIT_S = 10.0  # a bound on every wait below, so a broken choreography fails instead of hanging


@dataclass
class _Chunk:
    token_ids: list[int]
    request_id: str = "req"
    text: str = ""


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(WAIT_S):
        raise AssertionError(f"choreography stuck waiting for {what}")


@dataclass
class _Stage:
    """Events shared by the fake clients and the progress sink of one run."""

    b_fails_while_a_busy: bool
    a_calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    a1_entered: threading.Event = field(default_factory=threading.Event)
    release_a1: threading.Event = field(default_factory=threading.Event)
    a1_ended: threading.Event = field(default_factory=threading.Event)
    b_after_a1: threading.Event = field(default_factory=threading.Event)
    first_round_seen: bool = False


class _Progress:
    """Releases A's held request after B's first under-load round, and holds the end of that A
    request until B has sent a probe after it (so B's second under-load round does run)."""

    def __init__(self, stage: _Stage) -> None:
        self.stage = stage
        self.canary_steps = 0

    def start(self, total: int) -> None:
        pass

    def step(self, phase: str, n: int = 1) -> None:
        st = self.stage
        if phase == "tenant A canary load":
            self.canary_steps += 1
            if self.canary_steps == 2:  # A's request 1, after the probe counted it as ended
                st.a1_ended.set()
                _wait(st.b_after_a1, "B's probe after A's load")
        elif phase == "tenant B under-load" and n == 1 and not st.first_round_seen:
            st.first_round_seen = True
            st.release_a1.set()
            _wait(st.a1_ended, "A's request 1 to end")


def _fake_client(stage: _Stage) -> type:
    class FakeClient(FakeClientBase):
        def __init__(self, target: str, key: str, **kw: object) -> None:
            self.key = key

        def list_models(self) -> list[ModelSummary]:
            return [
                ModelSummary(
                    name="m",
                    context_window=LIMIT,
                    admissible_limit=LIMIT,
                    online=True,
                    fingerprint="f",
                    page_size=1000,  # no page-boundary probe fits: one B probe per round
                )
            ]

        def stream(
            self,
            text: str | None = None,
            *,
            prompt_ids: list[int] | None = None,
            max_new_tokens: int = 16,
            **kw: object,
        ) -> Iterator[_Chunk]:
            st = stage
            if self.key == "A":
                with st.lock:
                    n = st.a_calls
                    st.a_calls += 1
                if n == 1:  # request 0 ends at once; request 1 is held until B's round 1 ended
                    st.a1_entered.set()
                    _wait(st.release_a1, "release of A's request 1")
                yield _Chunk([7] * max_new_tokens)
                return
            total = len(prompt_ids or text or "") + max_new_tokens
            if total > LIMIT:
                raise InvalidArgument("over the limit", reason="OVER_ADMISSIBLE_LIMIT")
            if st.a_calls and not st.release_a1.is_set():
                # under load: A's request 1 is (or is about to be) in flight
                _wait(st.a1_entered, "A's request 1 to start")
                if st.b_fails_while_a_busy:
                    raise Unavailable("no node while A is busy (simulated)", reason="NO_NODES")
            elif st.a1_ended.is_set():
                st.b_after_a1.set()
            yield _Chunk([5] * max_new_tokens)

    return FakeClient


def _run(monkeypatch: pytest.MonkeyPatch, *, b_fails_while_a_busy: bool) -> ProbeReport:
    stage = _Stage(b_fails_while_a_busy)
    monkeypatch.setattr(probe_mod, "Client", _fake_client(stage))
    opts = ProbeOptions(
        seed=1,
        requests=2,
        concurrency=1,
        probes=1,
        under_load_rounds=2,
        probe_max_new=8,
        text_canaries=False,
        timeout=WAIT_S,
    )
    report = run_isolation_probe("fake:1", "A", "B", options=opts, progress=_Progress(stage))
    # the choreography happened: round 1 overlapped A's held request, round 2 came after it
    assert report.under_load_rounds == 2
    assert report.probes_overlapping_load == 1
    return report


def _table(
    report: ProbeReport, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """What ``kvfence probe isolation`` prints for the report (its table), wide enough that no
    cell wraps."""
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "400")
    _print_report(report)
    return capsys.readouterr().out


def test_probes_that_failed_while_a_was_busy_verify_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run(monkeypatch, b_fails_while_a_busy=True)
    assert report.verdict == "INCONCLUSIVE" and report.exit_code == 2
    # the report stays truthful: one B probe overlapped A's load (and failed), one succeeded later
    assert report.canary_ok == 2
    assert report.probes_under_load_ok == 1
    assert report.probe_errors == {"UNAVAILABLE": 1}
    assert report.probes_overlapping_load_ok == 0
    assert any("were in flight failed" in w for w in report.warnings)
    assert report.to_dict()["probes_overlapping_load_ok"] == 0
    assert "(1 overlapped A's requests, 0 of them ok)" in _table(report, capsys, monkeypatch)


def test_control_probes_that_succeeded_while_a_was_busy_pass(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run(monkeypatch, b_fails_while_a_busy=False)
    assert report.probes_overlapping_load_ok == 1
    assert report.probe_errors == {}
    assert report.warnings == []
    assert report.verdict == "PASS" and report.exit_code == 0
    assert "(1 overlapped A's requests, 1 of them ok)" in _table(report, capsys, monkeypatch)


def test_report_needs_an_overlapping_probe_that_succeeded() -> None:
    verified = dict(
        canary_ok=8, probes_under_load_ok=4, probes_overlapping_load=2, probes_overlapping_load_ok=1
    )
    assert ProbeReport("t", **verified).exit_code == 0  # control
    failed = ProbeReport("t", **{**verified, "probes_overlapping_load_ok": 0})
    assert failed.inconclusive and failed.exit_code == 2 and failed.verdict == "INCONCLUSIVE"
