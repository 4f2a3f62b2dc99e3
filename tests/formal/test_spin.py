"""The SPIN model of the transfer protocol: the real model verifies, every mutant is refuted.

The pairing is the point: the real model passing means something only because the same model
with one bug switched on fails, on the assertion that names the property that bug breaks.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

FORMAL = Path(__file__).resolve().parents[2] / "formal"


def _load_runner():
    spec = importlib.util.spec_from_file_location("kvfence_formal_run", FORMAL / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


run = _load_runner()
VARIANTS = {v.name: v for v in run.VARIANTS}


def _require_tools() -> None:
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            pytest.fail(
                f"`{tool}` is not installed: the formal model cannot be checked. Install SPIN "
                "with `make system-deps` (apt-get install spin) and gcc with build-essential.",
                pytrace=False,
            )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every variant, built and checked once in a temporary directory."""
    _require_tools()
    work = tmp_path_factory.mktemp("spin")
    return {r.variant: r for r in run.run_all(work)}


def test_real_model_has_no_error_in_a_complete_search(results):
    r = results["model"]
    assert r.problems == [], r.problems
    assert r.complete
    assert r.errors == 0, r.violation_text
    assert r.depth < run.MAX_DEPTH
    # a sanity floor: two tenants, page reuse, a lossy network give far more than this
    assert r.states_stored > 100_000


def test_witness_shows_the_hazard_is_reachable_in_the_real_model(results):
    """A late write into a quarantined page, and that page later read by another reservation."""
    r = results["witness"]
    assert r.errors >= 1
    assert r.violated == run.WITNESS
    assert r.replay_tag == run.WITNESS


@pytest.mark.parametrize(
    "name",
    [v.name for v in run.VARIANTS if v.name != "model" and v.name != "witness"],
)
def test_variant_has_its_expected_outcome(results, name):
    variant = VARIANTS[name]
    r = results[name]
    if variant.expect is None:
        assert r.complete and r.errors == 0, (r.problems, r.violation_text)
        return
    assert r.errors >= 1, f"{name}: the bug went unnoticed ({variant.about})"
    assert r.violated == variant.expect, r.violation_text
    # the trail replays to the same assertion, so the counterexample is real and reproducible
    assert r.trail is not None and Path(r.trail).exists()
    assert r.replay_tag == variant.expect
    assert r.replay_line is not None


def test_the_two_required_mutants_break_isolation_and_deferred_release(results):
    assert results["mutant_placeholder"].violated == run.P3
    assert results["mutant_placeholder_no_p3"].violated == run.P1
    assert results["mutant_release_on_timeout"].violated == run.P2
    assert results["mutant_release_on_timeout_no_p2"].violated == run.P1


def test_every_variant_is_ok(results):
    assert all(r.ok for r in results.values()), run.report(list(results.values()))


def test_no_build_files_land_in_the_repository(results):
    leftovers = sorted(p.name for p in FORMAL.iterdir() if p.name.startswith("pan"))
    leftovers += sorted(p.name for p in FORMAL.glob("*.trail"))
    assert leftovers == []


def test_missing_spin_is_reported_not_skipped(monkeypatch):
    monkeypatch.setattr(run.shutil, "which", lambda tool: None)
    with pytest.raises(run.ToolMissing, match="spin"):
        run.require_tools()


def test_decoding_races_are_reachable_in_the_real_model(results):
    """The decoding interleavings the properties must cover are not vacuous: with only a witness
    assertion added, pan finds a Release landing while a decode step's write is outstanding,
    and a duplicate Decode arriving while the first stream's sequence decodes."""
    for name, tag in (
        ("witness_decode_release", run.W_DECODE_RELEASE),
        ("witness_duplicate_decode", run.W_DUPLICATE_DECODE),
    ):
        r = results[name]
        assert r.errors is not None and r.errors >= 1, f"{name}: the race is unreachable"
        assert r.violated == tag and r.replay_tag == tag, r.violation_text


def test_a_lost_release_leaves_the_pages_to_decodes_own_timeout(results):
    """The control plane logs and forgets a failed Release, so a request can end with decode
    never told. The real model has that branch and still drains the pool (decode's per-batch
    timeout and reaper give the reservation back); with decode's timeout taken out the pages of
    such a request stay held when everything has stopped (P4)."""
    assert results["model"].errors == 0 and results["model"].complete
    r = results["mutant_no_decode_timeout"]
    assert r.errors is not None and r.errors >= 1, "a lost Release went unnoticed"
    assert r.violated == run.P4 and r.replay_tag == run.P4, r.violation_text


def test_a_terminal_request_is_never_resumed(results):
    """cp_to's guard is checked, not only modelled: without it a cancelled request is moved on
    (to FAILED by the abort that follows), which P5 refutes."""
    r = results["mutant_cp_resumes_terminal"]
    assert r.errors is not None and r.errors >= 1
    assert r.violated == run.P5 and r.replay_tag == run.P5, r.violation_text
    assert results["model"].errors == 0


def test_decode_mutants_break_deferred_free_and_entry(results):
    assert results["mutant_release_ignores_ops"].violated == run.P2
    assert results["mutant_release_ignores_ops_no_p2"].violated == run.P1
    assert results["mutant_add_after_release"].violated == run.P3
    assert results["mutant_add_after_release_no_p3"].errors == 0


def test_late_post_race_is_reachable_and_the_check_closes_it(results):
    """Decode posts a batch's receives only after the hello and the batch header (awaits), so a
    Release and another request's Reserve of the same pages can come in between. The handler
    does reach that point in the real model (the witness); without the check, and with the
    Release's endpoint abort not taking effect, the late receive lands in a page the reservation
    no longer owns (P2) and, P2 not asserted, in the next owner's verified page, which its decode
    reads (P1). With the check the real model verifies."""
    w = results["witness_post_after_release"]
    assert w.errors is not None and w.errors >= 1, "the late-post race is unreachable"
    assert w.violated == run.W_POST_AFTER_RELEASE and w.replay_tag == run.W_POST_AFTER_RELEASE
    assert results["mutant_post_after_release"].violated == run.P2
    assert results["mutant_post_after_release"].replay_tag == run.P2
    assert results["mutant_post_after_release_no_p2"].violated == run.P1
    assert results["mutant_post_after_release_no_p2"].replay_tag == run.P1
    assert results["model"].errors == 0 and results["model"].complete


def test_every_mutant_is_checked():
    """Every MUTANT_ switch the model defines is built by a variant, and each is refuted by one,
    but for the control-plane half of the placeholder bug, which decode's count/coverage check
    stops (that variant must verify)."""
    text = (FORMAL / "kvfence.pml").read_text()
    switches = set(re.findall(r"#ifn?def (MUTANT_\w+)", text))
    switches |= set(re.findall(r"defined\((MUTANT_\w+)\)", text))
    built = {d for v in run.VARIANTS for d in v.defines}
    refuted = {d for v in run.VARIANTS if v.expect is not None for d in v.defines}
    assert "MUTANT_POST_AFTER_RELEASE" in switches
    assert switches <= built, sorted(switches - built)
    assert switches - refuted == {"MUTANT_PLACEHOLDER_CP_ONLY"}, sorted(switches - refuted)
