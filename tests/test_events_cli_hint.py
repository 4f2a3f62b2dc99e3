"""``kvfence events --follow`` that hears nothing: one hint on stderr, then it keeps waiting.

It used to subscribe to ``kvfence/v1/<cluster>/events/+`` and print nothing, forever, for a wrong
``--cluster`` (the default is "local"), a cluster that sends its events elsewhere, and an account
the broker's ACL does not let read them alike. Now, when nothing has arrived ``--hint-after``
seconds after subscribing, it prints one hint on stderr naming the cluster and topic, the clusters
whose retained node status (``kvfence/v1/<cluster>/nodes/<node>``) the account can read on that
broker, and what the silence may mean. The CLI runs as a subprocess (``python -m kvfence``) so
stdout (events) and stderr (the hint) are seen apart, against a real Mosquitto. Controls: the
right cluster with an event prints it and no hint; the right cluster that is only quiet gets a
hint that says so instead of "wrong --cluster".
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fixtures_mqtt import Mosquitto, start_mosquitto
from test_events import ACCOUNTS, PUBLISHER, WATCHER

from kvfence.cli.events import DEFAULT_HINT_AFTER_S, silence_hint
from kvfence.events import EventBus, clusters_seen

HINT_AFTER = "0.5"
HINT_HEAD = "events: no event from cluster"
# Longest a test waits for a line: generous for a loaded machine, still far from the default.
LINE_TIMEOUT_S = 15.0


class Cli:
    """A running ``kvfence events -f``: its stdout and stderr lines as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.started = time.monotonic()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            asyncio.create_task(self._read(proc.stdout, self.stdout)),
            asyncio.create_task(self._read(proc.stderr, self.stderr)),
        ]

    @staticmethod
    async def _read(stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            into.append(line.decode(errors="replace").rstrip("\n"))

    async def wait_for(self, lines: list[str], text: str) -> int:
        """The index of the first line of ``lines`` that contains ``text``; fails after
        LINE_TIMEOUT_S (with what the CLI wrote) or when the CLI exited without it."""
        deadline = time.monotonic() + LINE_TIMEOUT_S
        while True:
            for i, line in enumerate(lines):
                if text in line:
                    return i
            ended = self.proc.returncode is not None and all(r.done() for r in self._readers)
            assert not ended, f"exited {self.proc.returncode} without {text!r}: {self.stderr}"
            assert time.monotonic() < deadline, (
                f"no {text!r} in {LINE_TIMEOUT_S} s: {self.stdout} {self.stderr}"
            )
            await asyncio.sleep(0.02)

    async def exit_code(self) -> int:
        code = await asyncio.wait_for(self.proc.wait(), LINE_TIMEOUT_S)
        await asyncio.gather(*self._readers)
        return code

    async def interrupt(self) -> int:
        """Ctrl-C, as an operator stops it: exit 0."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
        return await self.exit_code()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@asynccontextmanager
async def run_cli(
    broker: Mosquitto, cluster: str, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[Cli]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvfence",
        "events",
        "--follow",
        "--mqtt-port",
        str(broker.port),
        "--cluster",
        cluster,
        "--json",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
        # Ctrl-C as at a terminal: a suite started in the background by a shell without job
        # control inherits SIGINT ignored, and so would the CLI (it never saw the interrupt).
        preexec_fn=_sigint_default,
    )
    cli = Cli(proc)
    try:
        yield cli
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def cluster_bus(
    broker: Mosquitto, cluster: str, node_id: str = "node-a", **kw: Any
) -> AsyncIterator[EventBus]:
    """A started bus of ``cluster`` whose node status the broker holds (retained)."""
    bus = EventBus(cluster, node_id, broker.host, broker.port, **kw)
    await bus.start()
    try:
        bus.publish_node_status({"role": "decode"})
        assert await bus.wait_drained(5)
        yield bus
    finally:
        await bus.stop()


async def connected(broker: Mosquitto, cli: Cli) -> float:
    """When (monotonic) the broker's log first shows the CLI's subscriber connected: its
    subscription follows at once, and the hint's delay counts from that (the process start
    would add Python's start-up, seconds on a loaded machine). The hint's own probe connects
    under the same prefix only once that delay is over."""
    while "as kvfence-follow-" not in broker.log_text():
        assert cli.proc.returncode is None, f"exited {cli.proc.returncode}: {cli.stderr}"
        assert time.monotonic() - cli.started < LINE_TIMEOUT_S, cli.stderr
        await asyncio.sleep(0.02)
    return time.monotonic()


def hint_of(cli: Cli, start: int) -> str:
    """The hint's lines from ``start`` (its head line) on, as one text."""
    return "\n".join(cli.stderr[start:])


async def test_a_wrong_cluster_gets_a_hint_naming_the_clusters_seen_and_keeps_waiting() -> None:
    with start_mosquitto() as broker:
        async with (
            cluster_bus(broker, "t1"),
            run_cli(broker, "nope", "--hint-after", HINT_AFTER, "--limit", "1") as cli,
        ):
            subscribed = await connected(broker, cli)
            at = await cli.wait_for(cli.stderr, HINT_HEAD)
            after_subscribing = time.monotonic() - subscribed
            await cli.wait_for(cli.stderr, "wrong --cluster?")  # its last line
            hint = hint_of(cli, at)
            assert "'nope'" in hint and "kvfence/v1/nope/events/+" in hint, hint
            assert "still waiting" in hint
            assert "clusters seen on this broker" in hint and "t1 (1/1 nodes online)" in hint
            assert "ACL" in hint and "events.mqtt_host" in hint
            # The flag set the wait, not the default: the hint names it, and came within half
            # the default of the subscription (about 1 s: the flag's 0.5 s and the probe), where
            # the default alone would take all of it.
            assert f"for {HINT_AFTER} s" in cli.stderr[at], cli.stderr[at]
            assert after_subscribing < DEFAULT_HINT_AFTER_S / 2, after_subscribing
            assert cli.stdout == [] and cli.proc.returncode is None
            # it keeps waiting: an event of that cluster, once it comes, is printed
            async with cluster_bus(broker, "nope", "node-n") as late:
                late.emit("node_joined")
                assert await cli.exit_code() == 0  # --limit 1 reached
            (line,) = cli.stdout
            event = json.loads(line)
            assert event["cluster"] == "nope" and event["kind"] == "node_joined"
            assert sum(HINT_HEAD in ln for ln in cli.stderr) == 1, cli.stderr


async def test_the_right_cluster_with_an_event_prints_it_and_no_hint() -> None:
    """Control for the one above: same flags, the cluster the bus publishes to."""
    with start_mosquitto() as broker:
        async with (
            cluster_bus(broker, "t1") as bus,
            run_cli(broker, "t1", "--hint-after", HINT_AFTER) as cli,
        ):
            # the CLI subscribes at its own pace: emit until it shows one
            while not cli.stdout:
                bus.emit("admission_rejected", request_id="r1")
                await asyncio.sleep(0.05)
                assert time.monotonic() - cli.started < LINE_TIMEOUT_S, cli.stderr
            # The window in which a silent cluster's hint comes (--hint-after, then the
            # broker's retained statuses: SEEN_SETTLE_S), several times over.
            await asyncio.sleep(6 * float(HINT_AFTER) + 1.0)
            assert await cli.interrupt() == 0
        event = json.loads(cli.stdout[0])
        assert event["cluster"] == "t1" and event["kind"] == "admission_rejected"
        assert not any(HINT_HEAD in ln for ln in cli.stderr), cli.stderr


async def test_the_right_cluster_that_is_only_quiet_gets_a_hint_that_says_so() -> None:
    """The cluster's node status is on the broker: it exists and is up, just quiet. The hint says
    that instead of suggesting a wrong --cluster (paired with the wrong-cluster test)."""
    with start_mosquitto() as broker:
        async with (
            cluster_bus(broker, "t1"),
            run_cli(broker, "t1", "--hint-after", HINT_AFTER) as cli,
        ):
            at = await cli.wait_for(cli.stderr, HINT_HEAD)
            await cli.wait_for(cli.stderr, "is on this broker")
            assert cli.proc.returncode is None  # still waiting
            assert await cli.interrupt() == 0
        hint = hint_of(cli, at)
        assert "'t1'" in hint and "1 of 1 node(s) online" in hint and "nothing to report" in hint
        assert "wrong --cluster" not in hint and cli.stdout == []


async def test_a_broker_without_any_cluster_says_none_can_be_seen() -> None:
    with start_mosquitto() as broker:
        async with run_cli(broker, "local", "--hint-after", HINT_AFTER) as cli:
            at = await cli.wait_for(cli.stderr, HINT_HEAD)
            await cli.wait_for(cli.stderr, "no cluster's node status can be read")
            assert await cli.interrupt() == 0
    hint = hint_of(cli, at)
    assert "'local'" in hint and "wrong broker (--mqtt-host, --mqtt-port)" in hint
    assert "clusters seen" not in hint


async def test_clusters_seen_are_those_the_account_may_read() -> None:
    """The Helm chart's reader account may read its own cluster's topics only, and the CLI's
    default cluster is "local": the hint names the cluster that account can see, not others on
    the same broker."""
    acl = "user kvfence\ntopic readwrite kvfence/v1/#\nuser watcher\ntopic read kvfence/v1/prod/#\n"
    with start_mosquitto(users=ACCOUNTS, acl=acl) as broker:
        async with (
            cluster_bus(broker, "prod", credentials=PUBLISHER),
            cluster_bus(broker, "staging", credentials=PUBLISHER),
        ):
            seen = await clusters_seen(broker.host, broker.port, credentials=PUBLISHER)
            assert set(seen) == {"prod", "staging"}  # control: both are on the broker
            seen = await clusters_seen(broker.host, broker.port, credentials=WATCHER)
            assert seen == {"prod": {"node-a": True}}
            account = ["--mqtt-username", WATCHER.username]
            password = {"KVFENCE_MQTT_PASSWORD": WATCHER.password}
            async with run_cli(
                broker, "local", "--hint-after", HINT_AFTER, *account, env=password
            ) as cli:
                at = await cli.wait_for(cli.stderr, HINT_HEAD)
                await cli.wait_for(cli.stderr, "wrong --cluster?")
                assert await cli.interrupt() == 0
    hint = hint_of(cli, at)
    assert "'local'" in hint and "prod (1/1 nodes online)" in hint and "staging" not in hint


def test_the_hint_escapes_names_and_bounds_the_list() -> None:
    """Anyone who may publish a node status names a cluster: control characters are shown
    escaped, and a broker with very many clusters gets a bounded list."""
    seen = {f"c{i:02d}": {"n": True} for i in range(25)}
    seen["\x1b[31mevil"] = {"n": False}
    hint = silence_hint("nope", "127.0.0.1", 1883, None, 10.0, seen)
    assert "\x1b" not in hint and "\\x1b[31mevil (0/1 nodes online)" in hint
    assert "c18 (1/1 nodes online)" in hint and "c19" not in hint and "and 6 more" in hint
    failed = silence_hint("nope", "h", 1, ["node_lost"], 0.5, None, "Operation timed out")
    assert "kvfence/v1/nope/events/node_lost" in failed
    assert "could not list the clusters on this broker: Operation timed out" in failed
    assert "wrong --cluster?" in failed
