"""Issue 6.2: fault injection in the transfer path, against real processes, UCX and MQTT.

Each fault hits one request of tenant B while tenant A's requests run concurrently. For every fault:
B's request fails with the expected status (never OK), A's outputs equal the colocated reference,
an event naming B's request reaches the MQTT broker, and after drain every pool is entirely free.
The events are the module's (one subscriber): each case looks only at those that arrived after it
started, and at those of B's request where the event names one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fixtures_mqtt import start_mosquitto
from stack_harness import Cluster
from stack_starts import seed_embedded_model

from kvfence.errors import KvfenceError
from kvfence.events import follow
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams

pytestmark = pytest.mark.slow

DATA_LOSS = {"DATA_LOSS"}
# fault -> statuses that are right for it (DESIGN.md "gRPC status mapping")
FAULTS = {
    "drop_page": DATA_LOSS,
    "duplicate_page": DATA_LOSS,
    "reorder_pages": DATA_LOSS,
    "truncate_pages": DATA_LOSS,
    "fewer_tokens": DATA_LOSS,
    "corrupt_byte": DATA_LOSS,
    "stale_generation": DATA_LOSS,
    "foreign_page": DATA_LOSS,
    "replay": DATA_LOSS,
    "wrong_mac": DATA_LOSS,
    "bad_auth": DATA_LOSS,
    "delay": {"DEADLINE_EXCEEDED", "UNAVAILABLE"},
}
# Faults the control plane's own manifest check catches (control_plane.verify.check_manifest:
# the token count against the prompt) before the manifest goes to decode: its request_failed
# event gives the check; decode never sees the manifest, so no event of decode's is to be had.
CONTROL_PLANE_CHECKS = {"fewer_tokens": "MANIFEST_MISMATCH"}


class EventCollector:
    """Subscribes to the cluster's event topics on a background thread."""

    def __init__(self, host: str, port: int, cluster: str):
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port, cluster), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "event subscriber did not start"

    def _run(self, host: str, port: int, cluster: str) -> None:
        async def main() -> None:
            stream = follow(cluster, host, port)
            self._ready.set()
            async for event in stream:
                self.events.append(event)
                if self._stop.is_set():
                    return

        with contextlib.suppress(Exception):
            asyncio.run(main())

    def mark(self) -> int:
        """Where the events received so far end: a case takes it before it starts."""
        return len(self.events)

    def since(self, mark: int) -> list[dict]:
        return self.events[mark:]

    def wait_for(self, pred, since: int, timeout: float = 10.0) -> dict | None:
        """The first event from ``since`` on (the case's ``mark()``) that satisfies ``pred``. The
        list is the module's, every case's events in it: searched whole, an event an earlier case
        left satisfied a later case's check whether or not that case made one of its own."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.since(since):
                if pred(event):
                    return event
            time.sleep(0.05)
        return None


@pytest.fixture(scope="module")
def broker():
    with start_mosquitto() as (host, port, _restart):
        yield host, port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, broker):
    host, port = broker
    state = seed_embedded_model(tmp_path_factory.mktemp("cluster"))
    fault_file = state / "faults.json"
    fault_file.write_text("[]")
    c = Cluster(
        state,
        prefill=1,
        decode=1,
        prefill_pool_tokens=1024,
        decode_pool_tokens=1024,
        config={
            "cluster": "faults",
            "node": {"fault_hook": True, "fault_file": str(fault_file)},
            "transfer": {"batch_timeout_s": 1.0, "max_batch_bytes": 3 * 16384},
            "events": {"mqtt_host": host, "mqtt_port": port},
        },
    ).start()
    c.fault_file = fault_file
    c.keys = {"tenant-a": c.create_tenant("tenant-a"), "tenant-b": c.create_tenant("tenant-b")}
    c.events = EventCollector(host, port, "faults")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    return ColocatedEngine.from_path(cluster.state_dir / "models" / "tiny-llama")


def prompt(n: int, salt: int) -> list[int]:
    return [(13 * i + 5 * salt) % 240 + 3 for i in range(n)]


A_CASES = [(37, 10, 1), (20, 12, 2)]


def a_expected(reference) -> list[list[int]]:
    """Tenant A's outputs from the colocated reference engine."""
    return [
        out.token_ids
        for out in reference.generate(
            [
                GenerationRequest(prompt(n, s), SamplingParams(max_new_tokens=m, ignore_eos=True))
                for n, m, s in A_CASES
            ]
        )
    ]


def run_a(cluster) -> list[list[int]]:
    with cluster.client(cluster.keys["tenant-a"]) as c:
        return [
            c.generate(prompt_ids=prompt(n, s), max_new_tokens=m, ignore_eos=True).token_ids
            for n, m, s in A_CASES
        ]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_fails_only_the_faulty_request(cluster, reference, fault):
    mark = cluster.events.mark()
    cluster.fault_file.write_text(json.dumps([{"kind": fault, "tenant_id": "tenant-b",
                                               "seconds": 2.5}]))  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(run_a, cluster)
            with cluster.client(cluster.keys["tenant-b"]) as c:
                stream = c.stream(prompt_ids=prompt(45, 9), max_new_tokens=6)
                got = []
                with pytest.raises(KvfenceError) as err:
                    for chunk in stream:
                        got.extend(chunk.token_ids)
            a_outputs = a.result(timeout=60)
    finally:
        cluster.fault_file.write_text("[]")
    assert err.value.code.name in FAULTS[fault], (fault, err.value)
    assert got == []  # not one token of a request whose KV could not be trusted
    assert a_outputs == a_expected(reference)
    # B's is the only request of tenant-b in this case: its event gives B's request id (the
    # client never learns the id of a request that failed before its first message).
    failed = cluster.events.wait_for(
        lambda e: (
            e.get("kind") == "request_failed"
            and e.get("tenant_id") == "tenant-b"
            and e.get("code") == err.value.code.name
        ),
        since=mark,
    )
    assert failed is not None, (f"no request_failed event for {fault}", cluster.events.since(mark))
    rid = failed["request_id"]

    def of_b(e: dict) -> bool:
        # Node events that name a request must name B's; a refused UCX hello's names only the
        # reservation, which the test never learns: for those, only the mark tells the cases apart.
        return e.get("request_id", rid) == rid

    if fault in ("bad_auth", "delay"):  # prefill's send failed: its event says why, not only that
        sent = cluster.events.wait_for(
            lambda e: (
                e.get("kind") == "transfer_failed"
                and e.get("node_id", "").startswith("prefill")
                and e.get("tenant_id") == "tenant-b"
                and e.get("request_id") == rid
            ),
            since=mark,
        )
        assert sent is not None and sent.get("detail"), (sent, cluster.events.since(mark))
    if fault in CONTROL_PLANE_CHECKS:
        assert failed["reason"] == CONTROL_PLANE_CHECKS[fault], failed
    elif FAULTS[fault] == DATA_LOSS:
        node_event = cluster.events.wait_for(
            lambda e: (
                e.get("kind") in ("integrity_violation", "transfer_failed")
                and e.get("node_id", "").startswith("decode")
                and e.get("seq", 0) > 0
                and of_b(e)
            ),
            since=mark,
        )
        assert node_event is not None, (f"no decode event for {fault}", cluster.events.since(mark))
    stats = cluster.wait_pools_free(timeout=30)
    assert all(s.free_pages == s.total_pages for s in stats.values()), stats


def test_control_without_fault_succeeds(cluster, reference):
    """Positive control for every case above: the same request with no fault is OK and exact."""
    with cluster.client(cluster.keys["tenant-b"]) as c:
        got = c.generate(prompt_ids=prompt(45, 9), max_new_tokens=6, ignore_eos=True)
    ref = reference.generate(
        [GenerationRequest(prompt(45, 9), SamplingParams(max_new_tokens=6, ignore_eos=True))]
    )[0]
    assert got.token_ids == ref.token_ids


def test_abort_storm_returns_every_page(cluster, reference):
    """Many requests cancelled at once; tenant A's concurrent work is unaffected."""
    keys = cluster.keys

    def cancel_after_first(i: int) -> int:
        with cluster.client(keys["tenant-b"]) as c:
            stream = c.stream(prompt_ids=prompt(30 + i, i), max_new_tokens=200, ignore_eos=True)
            n = 0
            try:
                for chunk in stream:
                    n += len(chunk.token_ids)
                    if n >= 1 or i % 3 == 0:
                        break
            except KvfenceError:
                pass
            stream.close()
            return n

    with ThreadPoolExecutor(12) as pool:
        a = pool.submit(run_a, cluster)
        list(pool.map(cancel_after_first, range(16)))
        a_outputs = a.result(timeout=120)
    assert a_outputs == a_expected(reference)
    stats = cluster.wait_pools_free(timeout=30)
    assert all(s.free_pages == s.total_pages for s in stats.values()), stats


def test_decode_restarted_mid_transfer(cluster, reference):
    cluster.fault_file.write_text(json.dumps([{"kind": "delay", "tenant_id": "tenant-b",
                                               "seconds": 3}]))  # fmt: skip
    try:
        with ThreadPoolExecutor(1) as pool:

            def b_request():
                with cluster.client(cluster.keys["tenant-b"]) as c:
                    return c.generate(prompt_ids=prompt(45, 2), max_new_tokens=4)

            fut = pool.submit(b_request)
            time.sleep(1.0)  # prefill is stalled mid-transfer now
            cluster.restart("decode-0")
            with pytest.raises(KvfenceError) as err:
                fut.result(timeout=60)
    finally:
        cluster.fault_file.write_text("[]")
    assert err.value.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    cluster.wait_registered({"decode-0", "prefill-0"})
    # control: the restarted decode node serves exact output again
    with cluster.client(cluster.keys["tenant-a"]) as c:
        got = c.generate(prompt_ids=prompt(37, 1), max_new_tokens=10, ignore_eos=True)
    ref = reference.generate(
        [GenerationRequest(prompt(37, 1), SamplingParams(max_new_tokens=10, ignore_eos=True))]
    )[0]
    assert got.token_ids == ref.token_ids
    stats = cluster.wait_pools_free(timeout=30)
    assert all(s.free_pages == s.total_pages for s in stats.values()), stats


def test_prefill_killed_mid_transfer(cluster, reference):
    """UNAVAILABLE for the request; decode's pages are quarantined until the receives settle, then
    freed; a restarted prefill node serves exact output again."""
    mark = cluster.events.mark()
    cluster.fault_file.write_text(json.dumps([{"kind": "kill", "tenant_id": "tenant-b"}]))
    try:
        with cluster.client(cluster.keys["tenant-b"]) as c, pytest.raises(KvfenceError) as err:
            c.generate(prompt_ids=prompt(60, 5), max_new_tokens=4)
    finally:
        cluster.fault_file.write_text("[]")
    assert err.value.code.name == "UNAVAILABLE"
    assert cluster.procs["prefill-0"].wait(10) == 17  # the fault hook's exit code
    assert cluster.events.wait_for(
        lambda e: (
            e.get("kind") == "request_failed"
            and e.get("tenant_id") == "tenant-b"
            and e.get("code") == "UNAVAILABLE"
        ),
        since=mark,
    ), cluster.events.since(mark)
    cluster.restart("prefill-0")
    cluster.wait_registered({"prefill-0", "decode-0"})
    with cluster.client(cluster.keys["tenant-a"]) as c:
        got = c.generate(prompt_ids=prompt(20, 6), max_new_tokens=6, ignore_eos=True)
    ref = reference.generate(
        [GenerationRequest(prompt(20, 6), SamplingParams(max_new_tokens=6, ignore_eos=True))]
    )[0]
    assert got.token_ids == ref.token_ids
    stats = cluster.wait_pools_free(timeout=30)
    assert all(s.free_pages == s.total_pages for s in stats.values()), stats


@pytest.mark.parametrize("when", ["transfer", "decode"])
def test_client_cancel(cluster, reference, when):
    """Tenant B gives up mid-transfer (deadline) or mid-decode (closes the stream): the request
    ends CANCELLED / DEADLINE_EXCEEDED with an event, A is unaffected, every page comes back."""
    mark = cluster.events.mark()
    if when == "transfer":
        cluster.fault_file.write_text(json.dumps([{"kind": "delay", "tenant_id": "tenant-b",
                                                   "seconds": 2.0}]))  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(run_a, cluster)
            with cluster.client(cluster.keys["tenant-b"]) as c:
                if when == "transfer":
                    c.timeout = 1.0
                    with pytest.raises(KvfenceError) as err:
                        c.generate(prompt_ids=prompt(45, 3), max_new_tokens=4)
                    code = err.value.code.name
                    assert code in ("DEADLINE_EXCEEDED", "CANCELLED")
                else:
                    stream = c.stream(prompt_ids=prompt(45, 3), max_new_tokens=300, ignore_eos=True)
                    assert next(stream).token_ids  # decoding now
                    stream.close()  # the client goes away mid-decode
                    code = "CANCELLED"
            a_outputs = a.result(timeout=60)
    finally:
        cluster.fault_file.write_text("[]")
    assert a_outputs == a_expected(reference)
    event = cluster.events.wait_for(
        lambda e: (
            e.get("kind") == "request_failed"
            and e.get("tenant_id") == "tenant-b"
            and e.get("code") in ("CANCELLED", "DEADLINE_EXCEEDED")
            and e.get("state_before") == ("PREFILLING" if when == "transfer" else "DECODING")
        ),
        since=mark,
    )
    assert event is not None, (f"no request_failed event for a cancel during {when} ({code})",
                               cluster.events.since(mark))  # fmt: skip
    stats = cluster.wait_pools_free(timeout=30)
    assert all(s.free_pages == s.total_pages for s in stats.values()), stats
