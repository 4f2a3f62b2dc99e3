"""Metrics: the attribute contract, the service label, render() and the HTTP endpoint."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from kvfence import PROTOCOL_VERSION, __version__
from kvfence.metrics import Metrics


def make_metrics(service: str = "decode") -> Metrics:
    m = Metrics(service)
    m.requests_total.labels(status="ok").inc(3)
    m.admission_rejections_total.labels(reason="too_long").inc()
    m.integrity_failures_total.labels(check="checksum").inc(2)
    m.transfer_bytes_total.inc(4096)
    m.transfer_seconds.observe(0.003)
    m.pages.labels(state="free").set(10)
    m.pages.labels(state="held").set(5)
    m.pages.labels(state="quarantined").set(1)
    m.ttft_seconds.observe(0.2)
    m.inter_token_seconds.observe(0.02)
    m.prefill_pass_prompts.observe(3)
    m.decode_step_rows.observe(12)
    m.request_state_seconds.labels(state="prefilling").observe(0.04)
    m.rpcs_total.labels(method="Reserve").inc()
    m.events_dropped_total.inc(7)
    return m


EXPECTED = [
    'kvfence_requests_total{service="decode",status="ok"} 3.0',
    'kvfence_admission_rejections_total{reason="too_long",service="decode"} 1.0',
    'kvfence_integrity_failures_total{check="checksum",service="decode"} 2.0',
    'kvfence_transfer_bytes_total{service="decode"} 4096.0',
    'kvfence_transfer_seconds_count{service="decode"} 1.0',
    'kvfence_pages{service="decode",state="free"} 10.0',
    'kvfence_pages{service="decode",state="held"} 5.0',
    'kvfence_pages{service="decode",state="quarantined"} 1.0',
    'kvfence_ttft_seconds_count{service="decode"} 1.0',
    'kvfence_inter_token_seconds_bucket{le="0.025",service="decode"} 1.0',
    'kvfence_prefill_pass_prompts_bucket{le="4.0",service="decode"} 1.0',
    'kvfence_decode_step_rows_bucket{le="8.0",service="decode"} 0.0',
    'kvfence_decode_step_rows_bucket{le="16.0",service="decode"} 1.0',
    'kvfence_request_state_seconds_bucket{le="0.05",service="decode",state="prefilling"} 1.0',
    'kvfence_rpcs_total{method="Reserve",service="decode"} 1.0',
    'kvfence_events_dropped_total{service="decode"} 7.0',
    f'kvfence_build_info{{protocol="{PROTOCOL_VERSION}",service="decode",'
    f'version="{__version__}"}} 1.0',
]


def test_render_shows_every_metric_with_the_service_label() -> None:
    lines = make_metrics().render().decode().splitlines()
    for want in EXPECTED:
        assert want in lines, want
    samples = [ln for ln in lines if ln and not ln.startswith("#")]
    assert all(ln.startswith("kvfence_") and 'service="decode"' in ln for ln in samples)


def test_registries_are_separate_per_instance() -> None:
    a, b = make_metrics("prefill"), Metrics("prefill")  # same name twice: no duplicate error
    assert b'kvfence_requests_total{service="prefill",status="ok"} 3.0' in a.render()
    assert b"status=" not in b.render()  # b counted nothing


def test_serve_over_http_on_an_ephemeral_port() -> None:
    m = make_metrics()
    port = m.serve(0)
    try:
        assert port > 0 and m.port == port
        with pytest.raises(RuntimeError, match="already served"):
            m.serve(0)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        m.requests_total.labels(status="DATA_LOSS").inc()
        again = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        m.stop()
    for want in EXPECTED:
        assert want.encode() in body
    assert b'status="DATA_LOSS"' not in body and b'status="DATA_LOSS"' in again
    assert m.port is None
    m.stop()  # idempotent


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_serve_binds_the_host_it_is_given(host: str) -> None:
    m = Metrics("decode")
    port = m.serve(0, host)
    try:
        assert m._server is not None and m._server.server_address[0] == host
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"kvfence_pages" in body  # reachable either way from this machine
    finally:
        m.stop()


def test_serve_on_an_address_it_cannot_bind_names_it_and_the_setting() -> None:
    """A taken port raised the bare "[Errno 98] Address already in use", which `kvfence serve`
    printed as its one line: neither the address nor node.metrics_port. Now BindError, worded as
    the gRPC listeners' (kvfence.server), and nothing stays served. Control: a free port on the
    same host serves."""
    from kvfence.server import BindError

    first = Metrics("control-plane")
    port = first.serve(0)
    second = Metrics("decode")
    try:
        with pytest.raises(BindError) as err:
            second.serve(port)
        assert str(err.value) == (
            f"cannot serve metrics on 127.0.0.1:{port} (node.metrics_port): the address is in "
            "use by another process"
        )
        assert second.port is None
        # not a local address (TEST-NET-1): neither in use nor bindable, and said so
        with pytest.raises(BindError) as err:
            second.serve(0, "192.0.2.1")
        assert str(err.value).startswith(
            "cannot serve metrics on 192.0.2.1:0 (node.metrics_host, node.metrics_port): the "
            "address cannot be bound here ("
        )
        again = second.serve(0)  # control
        body = urllib.request.urlopen(f"http://127.0.0.1:{again}/metrics", timeout=5).read()
        assert b'service="decode"' in body
    finally:
        second.stop()
        first.stop()


# Raised as IntegrityError but never counted in kvfence_integrity_failures_total: the CLI's check
# of a downloaded backup and a damaged tenant database are not KV checks.
NOT_KV_CHECKS = {"BACKUP_MISMATCH", "TENANT_DATABASE_DAMAGED"}


def integrity_reasons_in_code() -> set[str]:
    """The literal reasons of every ``IntegrityError(...)`` in the services' code."""
    import ast

    root = Path(__file__).resolve().parents[1]
    found = set()
    for package in ("kvfence", "control_plane", "prefill_svc", "decode_svc", "kernels"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                name = getattr(func, "id", getattr(func, "attr", None))
                if not isinstance(node, ast.Call) or name != "IntegrityError":
                    continue
                reason = next((k.value for k in node.keywords if k.arg == "reason"), None)
                if isinstance(reason, ast.Constant):
                    found.add(reason.value)
    return found


def test_every_integrity_check_is_exported_at_zero_from_the_start() -> None:
    """A check's series born at its first failure is born at 1, which Prometheus's increase()
    reads as no increase: KvfenceIntegrityCheckFailed missed the first forged manifest on a pod.
    Every check the code can fail is exported at 0 from the start, by every service."""
    from kvfence.errors import INTEGRITY_CHECKS
    from kvfence.transfer import INTEGRITY_REASONS

    in_code = integrity_reasons_in_code()
    assert {"MAC", "CHECKSUM", "FIRST_TOKEN_MISMATCH", "PAGE_GENERATION"} <= in_code  # it finds
    assert in_code - NOT_KV_CHECKS <= INTEGRITY_CHECKS
    assert INTEGRITY_REASONS <= INTEGRITY_CHECKS  # the transfer's, raised from a variable
    for service in ("control-plane", "prefill", "decode"):
        registry = Metrics(service).registry
        for check in INTEGRITY_CHECKS:
            labels = {"service": service, "check": check}
            assert registry.get_sample_value("kvfence_integrity_failures_total", labels) == 0
