"""``kvfence probe isolation``: the two-tenant canary probe.

Positive control: against a healthy real stack the probe finds no leak and sees every over-length
request rejected. Negative control: against a fake Generation server that echoes tenant A's last
prompt into tenant B's output and accepts over-length prompts, the probe reports both and exits 1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import typer
from stack_harness import Stack
from stack_starts import seed_embedded_model
from typer.testing import CliRunner

from kvfence.cli.probe import register
from kvfence.errors import InvalidArgument
from kvfence.localstack import free_port
from kvfence.probe import (
    CanaryIndex,
    ProbeOptions,
    ProbeReport,
    ProbeSetupError,
    canary_ids,
    canary_marker,
    canary_text,
    run_isolation_probe,
)
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc, common_pb2

ADMISSIBLE_REASON = "OVER_ADMISSIBLE_LIMIT"  # the ErrorInfo reason of kvfence's admission
SMALL_POOLS = ["--prefill-pool-tokens", "1024", "--decode-pool-tokens", "768"]


def _cli() -> typer.Typer:
    app = typer.Typer()
    probe = typer.Typer()
    app.add_typer(probe, name="probe")
    register(app, {"probe": probe})
    return app


# ---------------------------------------------------------------------------------------------
# pure parts


def test_canaries_are_seedable_in_range_and_never_repeat_an_id() -> None:
    a = canary_ids(random.Random(7), 500, 3, 250)
    assert a == canary_ids(random.Random(7), 500, 3, 250)
    assert a != canary_ids(random.Random(8), 500, 3, 250)
    assert all(3 <= x < 250 for x in a)
    assert all(x != y for x, y in itertools.pairwise(a))
    marker = canary_marker(random.Random(1))
    assert marker == canary_marker(random.Random(1)) and marker.startswith("KVFCANARY")
    text = canary_text(marker, 100)
    assert len(text) == 100 and marker in text


def test_canary_index_finds_ngrams_and_ignores_what_b_saw_alone() -> None:
    index = CanaryIndex(4)
    index.add_ids(0, [10, 11, 12, 13, 14, 15])
    index.add_ids(1, [20, 21, 22, 23])
    index.add_marker(2, "KVFCANARY00ff")
    assert index.find_ids([1, 2, 11, 12, 13, 14, 9]) == [(2, 0, 1)]
    assert index.find_ids([10, 11, 12, 99, 13, 14, 15]) == []  # no 4 consecutive
    index.exclude([20, 21, 22, 23])  # e.g. tenant B's own solo output
    assert index.find_ids([20, 21, 22, 23]) == []
    assert index.find_text("xx KVFCANARY00ff yy") == [("KVFCANARY00ff", 2)]
    # another marker's prefix is still A's (B never sends it): a leak, of unknown origin
    assert index.find_text("KVFCANARY0000") == [("KVFCANARY", -1)]
    assert index.find_text("xx 00f yy") == []  # control


def test_same_key_twice_is_a_usage_error() -> None:
    with pytest.raises(ProbeSetupError, match="same"):
        run_isolation_probe("127.0.0.1:1", "k", "k")


# ---------------------------------------------------------------------------------------------
# negative control: a fake server that leaks and accepts over-length prompts

FAKE_LIMIT = 256
KEYS = {"Bearer key-a": "a", "Bearer key-b": "b"}


class LeakyGeneration(client_pb2_grpc.GenerationServicer):
    """Hands tenant A's previous prompt to tenant B as "stale KV", and checks no length."""

    def __init__(
        self, mode: str = "copy", over_length_reason: str = ADMISSIBLE_REASON, a_delay_s: float = 0
    ) -> None:
        # "copy": B gets A's ids and text verbatim; "piece": B's text carries 10 hex digits of
        # one of A's markers (no whole marker, no prefix, no id of A's); "clean": no leak.
        # Every mode but "copy" refuses over-length requests with INVALID_ARGUMENT and
        # ``over_length_reason`` as the ErrorInfo reason, as kvfence's admission does.
        self.mode = mode
        self.over_length_reason = over_length_reason
        # A's k-th request lasts k * a_delay_s: A's requests end one after another, so B's
        # probes run while some are in flight (with none, A's load may end before B's first
        # probe and the probe is inconclusive, exit 2)
        self.a_delay_s = a_delay_s
        self.a_requests = 0
        self.last_a_ids: list[int] = []
        self.last_a_text = ""
        self.b_requests = 0

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        meta = dict(context.invocation_metadata() or ())
        return KEYS.get(str(meta.get("authorization", "")))

    async def ListModels(self, request, context):
        if self._tenant(context) is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad key")
        model = client_pb2.ModelInfo(
            name="leaky",
            context_window=4096,
            admissible_limit=FAKE_LIMIT,
            online=True,
            fingerprint="f" * 64,
            page_size=16,
        )
        return client_pb2.ListModelsResponse(models=[model])

    async def Generate(
        self, request: client_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[client_pb2.GenerateResponse]:
        tenant = self._tenant(context)
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad key")
        ids = list(request.token_ids.ids)
        n = request.max_new_tokens
        text = ""
        if self.mode != "copy" and len(ids) + n > FAKE_LIMIT:  # only "copy" also accepts these
            err = InvalidArgument("over the limit", reason=self.over_length_reason)
            await context.abort_with_status(err.to_status())
        if tenant == "a":
            self.a_requests += 1
            await asyncio.sleep(self.a_delay_s * self.a_requests)
            if ids:
                self.last_a_ids = ids
            else:
                self.last_a_text = request.text
            out = [5] * n
        else:
            self.b_requests += 1
            if self.mode == "diverge":  # A's data changes B's output, copying none of it
                shift = 1 if self.last_a_ids or self.last_a_text else 0
                out = [(x * 7 + shift) % 200 + 3 for x in ids[:n]]
                out += [9] * (n - len(out))
            elif self.mode == "piece":
                out = [(x * 7) % 200 + 3 for x in ids[:n]]
                out += [9] * (n - len(out))
                marker_digits = len("KVFCANARY")
                text = self.last_a_text[marker_digits : marker_digits + 10]
            elif self.mode == "clean":
                out = [(x * 7) % 200 + 3 for x in ids[:n]]
                out += [9] * (n - len(out))
            elif self.last_a_ids:  # the bug: decode attends over pages another tenant wrote
                out = (self.last_a_ids * (n // len(self.last_a_ids) + 1))[:n]
                text = self.last_a_text[:64]
            else:
                out = [(x * 7) % 200 + 3 for x in ids[:n]]
                out += [9] * (n - len(out))
        rid = f"req-{tenant}-{random.getrandbits(32):08x}"
        for i in range(0, len(out), 4):
            last = i + 4 >= len(out)
            yield client_pb2.GenerateResponse(
                request_id=rid,
                token_ids=out[i : i + 4],
                text=text if last else "",
                finish_reason="length" if last else "",
                usage=common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(out))
                if last
                else None,
            )


@pytest.fixture()
def leaky_target() -> Iterator[str]:
    """The leaky fake, served by grpc.aio on its own event loop in a thread."""
    yield from _serve(LeakyGeneration())


def _serve(servicer: client_pb2_grpc.GenerationServicer) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port = free_port()
    stop = asyncio.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        client_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(None)

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        assert not thread.is_alive()
        loop.close()


def test_probe_reports_leak_and_over_length_acceptance(leaky_target: str) -> None:
    report = run_isolation_probe(
        leaky_target, "key-a", "key-b", options=ProbeOptions(requests=8, seed=3, timeout=10)
    )
    assert report.exit_code == 1 and report.verdict == "LEAK"
    kinds = {leak.kind for leak in report.leaks}
    assert kinds == {"token", "text"}, kinds
    assert {leak.phase for leak in report.leaks} >= {"under-load", "after-load"}
    assert len(report.over_length) == 4
    assert all(r.outcome == "accepted" and r.tokens_yielded > 0 for r in report.over_length)
    assert len(report.over_length_failures) == 4
    # B's outputs changed once A's data showed up in them
    assert report.diverged > 0 and any("DIVERGENCE" in w for w in report.warnings)
    d = report.to_dict()
    assert d["leak_count"] == len(report.leaks) and d["over_length_failures"] == 4


def test_a_piece_of_a_marker_in_b_text_is_a_leak() -> None:
    """KV read from another tenant's pages rarely reproduces its whole prompt: 10 of a marker's
    hex digits in B's text (no whole marker, no prefix, none of A's ids) used to pass."""
    for target in _serve(LeakyGeneration(mode="piece")):
        report = run_isolation_probe(
            target, "key-a", "key-b", options=ProbeOptions(requests=8, seed=3, timeout=10)
        )
    assert report.exit_code == 1 and report.verdict == "LEAK"
    assert {leak.kind for leak in report.leaks} == {"text"}


def test_over_length_rejection_counts_only_with_the_admissible_limit_reason() -> None:
    """An INVALID_ARGUMENT for another reason (a tenant's token limit, bad parameters) does not
    show the admissible limit enforced: it used to count as a correct rejection (exit 0)."""
    for reason in ("OVER_TENANT_TOKEN_LIMIT", "INVALID_PARAMETERS"):
        for target in _serve(LeakyGeneration(mode="clean", over_length_reason=reason)):
            report = run_isolation_probe(
                target, "key-a", "key-b", options=ProbeOptions(requests=8, seed=3, timeout=10)
            )
        assert report.leaks == []
        assert [r.outcome for r in report.over_length] == ["wrong-reason"] * 4, report.over_length
        assert {(r.status, r.reason) for r in report.over_length} == {("INVALID_ARGUMENT", reason)}
        assert len(report.over_length_failures) == 4
        assert report.exit_code == 1 and report.verdict == "FAIL"


def test_over_length_rejection_with_the_admissible_limit_reason_passes() -> None:
    """Positive control of the test above: the same fake with kvfence's reason passes."""
    for target in _serve(LeakyGeneration(mode="clean", a_delay_s=0.05)):
        report = run_isolation_probe(
            target, "key-a", "key-b", options=ProbeOptions(requests=8, seed=3, timeout=10)
        )
    assert [r.outcome for r in report.over_length] == ["rejected"] * 4, report.over_length
    assert all(r.reason == ADMISSIBLE_REASON for r in report.over_length)
    assert report.over_length_failures == [] and report.leaks == []
    assert report.exit_code == 0 and report.verdict in {"PASS", "WARN"}, report.warnings


def test_cli_names_the_reason_of_a_wrong_rejection() -> None:
    """The table tells the operator which reason came back, not only that a check failed."""
    args = ["probe", "isolation", "--tenant-a-key", "key-a", "--tenant-b-key", "key-b"]
    args += ["--requests", "6", "--seed", "1", "--timeout", "10"]
    for target in _serve(
        LeakyGeneration(mode="clean", over_length_reason="OVER_TENANT_TOKEN_LIMIT")
    ):
        wrong = CliRunner().invoke(_cli(), [*args, "--target", target], env={"COLUMNS": "400"})
    assert wrong.exit_code == 1, wrong.output
    assert "wrong-reason: INVALID_ARGUMENT OVER_TENANT_TOKEN_LIMIT" in " ".join(
        wrong.stdout.split()
    )
    # control: kvfence's own reason passes the same row
    for target in _serve(LeakyGeneration(mode="clean", a_delay_s=0.05)):
        right = CliRunner().invoke(_cli(), [*args, "--target", target], env={"COLUMNS": "400"})
    assert "4/4 rejected" in right.stdout and "wrong-reason" not in right.stdout


def test_the_probe_expects_the_control_planes_reason() -> None:
    """The probe cannot import the control plane (it runs against any deployment): its copy of
    the reason must equal admission's."""
    from control_plane.admission import OVER_ADMISSIBLE_LIMIT
    from kvfence.probe import OVER_ADMISSIBLE_LIMIT_REASON

    assert OVER_ADMISSIBLE_LIMIT_REASON == OVER_ADMISSIBLE_LIMIT == ADMISSIBLE_REASON


def test_canary_index_finds_pieces_of_markers_and_the_prefix() -> None:
    index = CanaryIndex(4)
    marker = "KVFCANARY0123456789abcdef"
    index.add_marker(2, marker)
    assert index.find_text(f"x {marker} y") == [(marker, 2)]
    assert index.find_text("..3456789a..") == [("3456789a", 2)]  # 8 of its digits
    assert index.find_text("KVFCANARY") == [("KVFCANARY", -1)]  # whose, unknown
    # controls: 7 digits, or text of B's own, are nothing
    assert index.find_text("..3456789..") == []
    assert index.find_text("an ordinary answer 42") == []


def test_the_probe_exit_code_needs_probes_during_the_load_and_can_fail_on_divergence() -> None:
    verified = dict(
        canary_ok=8, probes_under_load_ok=4, probes_overlapping_load=2, probes_overlapping_load_ok=2
    )
    assert ProbeReport("t", **verified).exit_code == 0  # control: clean
    # B never ran while A's requests were in flight: the live-sharing case went unverified
    late = ProbeReport(
        "t", **{**verified, "probes_overlapping_load": 0, "probes_overlapping_load_ok": 0}
    )
    assert late.inconclusive and late.exit_code == 2 and late.verdict == "INCONCLUSIVE"
    diverged = ProbeReport("t", **verified, compared=4, diverged=1)
    assert diverged.exit_code == 0  # a warning by default (batching may change rounding) ...
    strict = ProbeReport("t", **verified, compared=4, diverged=1, divergence_fails=True)
    assert strict.exit_code == 1 and strict.verdict == "DIVERGED"  # ... a failure if asked


def test_cli_fails_on_divergence_only_when_asked() -> None:
    args = ["probe", "isolation", "--tenant-a-key", "key-a", "--tenant-b-key", "key-b"]
    args += ["--requests", "6", "--seed", "1", "--timeout", "10", "--json"]
    # a fresh fake each: it remembers A
    for target in _serve(LeakyGeneration(mode="diverge", a_delay_s=0.05)):
        default = CliRunner().invoke(_cli(), [*args, "--target", target])
    for target in _serve(LeakyGeneration(mode="diverge", a_delay_s=0.05)):
        strict = CliRunner().invoke(_cli(), [*args, "--target", target, "--fail-on-divergence"])
    out = json.loads(default.stdout)
    assert out["leak_count"] == 0 and out["diverged"] > 0  # nothing copied, outputs changed
    assert default.exit_code == 0 and out["verdict"] == "WARN"  # control: a warning by default
    assert strict.exit_code == 1 and json.loads(strict.stdout)["verdict"] == "DIVERGED"


def test_cli_against_leaky_server_exits_1(leaky_target: str) -> None:
    args = ["probe", "isolation", "--target", leaky_target, "--tenant-a-key", "key-a"]
    args += ["--tenant-b-key", "key-b", "--requests", "6", "--seed", "1", "--timeout", "10"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 1, result.output
    assert "verdict: LEAK" in result.stdout
    assert "FAIL" in result.stdout and "0/4 rejected" in result.stdout
    result = CliRunner().invoke(_cli(), [*args, "--json"])
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout)
    assert out["verdict"] == "LEAK" and out["leak_count"] > 0
    assert out["over_length_failures"] == 4 and out["exit_code"] == 1


def test_cli_bad_key_exits_2_with_one_line(leaky_target: str) -> None:
    args = ["probe", "isolation", "--target", leaky_target, "--tenant-a-key", "key-a"]
    result = CliRunner().invoke(_cli(), [*args, "--tenant-b-key", "wrong"])
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tenant B key refused" in lines[0], result.stderr


def test_cli_unreachable_target_exits_2_with_one_line() -> None:
    target = f"127.0.0.1:{free_port()}"
    args = ["probe", "isolation", "--target", target, "--tenant-a-key", "a"]
    result = CliRunner().invoke(_cli(), [*args, "--tenant-b-key", "b", "--timeout", "5"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach {target}" in lines[0], result.stderr
    result = CliRunner().invoke(_cli(), [*args, "--tenant-b-key", "b", "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout)["verdict"] == "ERROR"


def test_cli_missing_ca_file_exits_2(tmp_path: Path) -> None:
    args = ["probe", "isolation", "--target", "127.0.0.1:1", "--tenant-a-key", "a"]
    args += ["--tenant-b-key", "b", "--tls-ca", str(tmp_path / "nope.pem")]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 2 and "does not exist" in result.stderr


# ---------------------------------------------------------------------------------------------
# positive control: a real kvfence stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(seed_embedded_model(tmp_path_factory.mktemp("probe") / "s"), args=SMALL_POOLS).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
def test_healthy_stack_passes(stack: Stack) -> None:
    key_a, key_b = stack.create_tenant("probe-a"), stack.create_tenant("probe-b")
    report = run_isolation_probe(
        stack.target, key_a, key_b, options=ProbeOptions(requests=8, seed=11, timeout=60)
    )
    assert report.leaks == [], report.leaks
    assert report.admissible_limit == 768 and report.page_size == 16
    assert [r.outcome for r in report.over_length] == ["rejected"] * 4, report.over_length
    assert all(r.status == "INVALID_ARGUMENT" and r.tokens_yielded == 0 for r in report.over_length)
    assert all(r.reason == ADMISSIBLE_REASON for r in report.over_length)
    assert report.at_limit is not None and report.at_limit.outcome in {"accepted", "not-verified"}
    assert report.canary_ok > 0 and report.probes_under_load_ok > 0 and report.compared > 0
    assert report.probes_overlapping_load_ok > 0  # B really ran while A's canaries were in flight
    assert report.exit_code == 0 and report.verdict in {"PASS", "WARN"}, report.warnings
    # nothing left behind: every page back on the free list
    stats = stack.wait_pools_free()
    assert all(s.free_pages == s.total_pages for s in stats.values())


@pytest.mark.slow
def test_module_entry_point_against_stack(stack: Stack) -> None:
    key_a, key_b = stack.create_tenant("probe-c"), stack.create_tenant("probe-d")
    env = {**os.environ, "KVFENCE_TENANT_B_KEY": key_b}
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence", "probe", "isolation", "--target", stack.target,
         "--tenant-a-key", key_a, "--requests", "6", "--seed", "5", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["verdict"] in {"PASS", "WARN"} and out["leak_count"] == 0
    assert out["over_length_rejected"] == out["over_length_probes"] == 4
    # a refused key is one line and status 2
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence", "probe", "isolation", "--target", stack.target,
         "--tenant-a-key", "kvf_not-a-key", "--requests", "1"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "tenant A key refused" in proc.stderr
