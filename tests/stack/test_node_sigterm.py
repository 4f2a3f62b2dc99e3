"""SIGTERM to a ``kvfence serve decode`` process (a pod deleted, a rolling upgrade, a node drain)
while it streams: the node drains, so the stream finishes OK and the process then exits by itself.
Before the drain existed the stream failed (NODE_LOST, or cut at the end of a 5 s grace): the
control below, with ``node.drain_timeout_s: 0``, still shows that."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_harness import Cluster
from stack_starts import running, seed_embedded_model

from kvfence.errors import KvfenceError

pytestmark = pytest.mark.slow

SITE = Path(__file__).resolve().parent / "slow_decode_site"
TOKENS = 100  # at 30 ms a step: a 3 s stream


DRAIN_TIMEOUTS_S = (20, 0)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Cluster]]:
    """A cluster for each drain timeout, started at once (the services take the environment
    they are spawned with: the slow decode steps); each test stops its own."""
    by_drain = {
        drain: Cluster(
            seed_embedded_model(tmp_path_factory.mktemp(f"drain-{drain}")),
            config={
                "node": {"drain_timeout_s": drain},
                "control_plane": {"heartbeat_interval_s": 0.2, "node_timeout_s": 2},
            },
        )
        for drain in DRAIN_TIMEOUTS_S
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("KVFENCE_TEST_DECODE_STEP_S", "0.03")
        with running(*by_drain.values()):
            yield by_drain


@pytest.mark.parametrize("drain_timeout_s", DRAIN_TIMEOUTS_S)
def test_sigterm_mid_stream_drains_the_decode_node(
    clusters: dict[int, Cluster], drain_timeout_s: int
) -> None:
    cluster = clusters[drain_timeout_s]
    try:
        key = cluster.create_tenant("acme")
        tokens: list[int] = []
        finish = ""
        proc = None
        seen_draining = False
        with cluster.client(key) as client:
            stream = client.stream(prompt_ids=[5, 6, 7], max_new_tokens=TOKENS, ignore_eos=True)
            if drain_timeout_s == 0:
                with pytest.raises(KvfenceError):
                    for _chunk in stream:
                        if proc is None:
                            proc = cluster.terminate("decode-0")
                assert proc is not None
                assert proc.wait(20) == 0
                return
            for chunk in stream:
                tokens.extend(chunk.token_ids)
                finish = chunk.finish_reason or finish
                if proc is None:
                    proc = cluster.terminate("decode-0")
                    deadline = time.monotonic() + 2
                    while not seen_draining and time.monotonic() < deadline:
                        with cluster.admin() as admin:
                            nodes = {n.node_id: n for n in admin.list_nodes().nodes}
                        seen_draining = nodes["decode-0"].draining
                        assert not nodes["prefill-0"].draining
                        time.sleep(0.05)
        assert finish == "length" and len(tokens) == TOKENS
        assert seen_draining, "kvfence nodes never showed decode-0 draining"
        assert proc is not None
        assert proc.wait(20) == 0  # it stops by itself once the stream is done
        log = (cluster.state_dir / "decode-0.log").read_text()
        assert '"node drained"' in log and "drain timed out" not in log
    finally:
        cluster.stop()
