"""Issue 6.6: hypothesis drives the real control plane and real nodes (in process, real gRPC and
UCX) with random admissions, aborts, timeouts, over-length requests and node losses, and checks the
pools' invariants after every step: integrity holds, and once the cluster is idle every page is
free and no request is left in flight."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from stack_harness import free_port_pair

from control_plane.service import ControlPlane
from control_plane.tenants import TenantLimits
from kvfence.client import AsyncClient
from kvfence.config import Role, parse_config
from kvfence.errors import KvfenceError
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node

pytestmark = pytest.mark.slow

# Statuses a request may legitimately end with under these rules; never OK with a short answer.
ALLOWED = {"CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}


class System:
    """Control plane + 1 prefill + 2 decode nodes on an event loop in a background thread."""

    def __init__(self, tmp) -> None:
        port = free_port_pair()
        self.cfg = parse_config(
            {
                "model": {"path": str(ensure_tiny_model(tmp / "tiny"))},
                "kv": {
                    "page_size": 16,
                    "prefill_pool": {"num_pages": 24},
                    "decode_pool": {"num_pages": 20},
                },
                "control_plane": {
                    "listen": f"127.0.0.1:{port}",
                    "admin_listen": f"127.0.0.1:{port + 1}",
                    "state_dir": str(tmp / "state"),
                    "heartbeat_interval_s": 0.2,
                    "node_timeout_s": 2.0,
                    "default_deadline_s": 20.0,
                },
                "transfer": {"batch_timeout_s": 2.0},
            },
            environ={},
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.cp = ControlPlane(self.cfg)
        await self.cp.start()
        self.nodes = [await start_node(self.cfg, Role.PREFILL)]
        for i in range(2):
            cfg = self.cfg.model_copy(
                update={"node": self.cfg.node.model_copy(update={"node_id": f"decode-{i}"})}
            )
            self.nodes.append(await start_node(cfg, Role.DECODE))
        _, key, _ = self.cp.tenants.create_tenant("tenant-a", TenantLimits())
        self.key = key
        self.client = AsyncClient(self.cfg.control_plane.listen, key)

    async def _stop(self) -> None:
        await self.client.close()
        for node in self.nodes:
            await node.stop(grace=1)
        await self.cp.stop(grace=1)

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def idle(self, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = len(self.cp.table) > 0
            pools = [n.rt.pool for n in self.nodes]
            registered = len(self.cp.registry.nodes()) == len(self.nodes)
            if not busy and registered and all(p.num_free == p.num_pages for p in pools):
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    s = System(tmp_path_factory.mktemp("lifecycle"))
    yield s
    s.stop()


def test_random_lifecycles_keep_pool_invariants(system):
    class Lifecycle(RuleBasedStateMachine):
        """One example = a few random steps against the shared system."""

        def __init__(self) -> None:
            super().__init__()
            self.s = system
            self.ok = 0

        async def _generate(self, n: int, max_new: int, timeout: float | None) -> str:
            try:
                result = await asyncio.wait_for(
                    self.s.client.generate(
                        prompt_ids=[(7 * i) % 200 + 3 for i in range(n)],
                        max_new_tokens=max_new,
                        ignore_eos=True,
                    ),
                    timeout,
                )
            except TimeoutError:
                return "DEADLINE_EXCEEDED"
            except KvfenceError as err:
                return err.code.name
            assert len(result.token_ids) == max_new  # OK always means the whole answer
            return "OK"

        @rule(
            n=st.integers(1, 120),
            max_new=st.integers(1, 40),
            concurrent=st.integers(1, 6),
        )
        def admissions(self, n, max_new, concurrent):
            async def many():
                return await asyncio.gather(
                    *(self._generate(n, max_new, None) for _ in range(concurrent))
                )

            statuses = self.s.call(many())
            assert set(statuses) <= ALLOWED | {"OK"}, statuses
            self.ok += statuses.count("OK")

        @rule(n=st.integers(1, 100), after=st.floats(0.0, 0.05))
        def client_timeout(self, n, after):
            status = self.s.call(self._generate(n, 30, after))
            assert status in ALLOWED | {"OK"}

        @rule(over=st.integers(1, 500))
        def over_length(self, over):
            limit = self.s.cp.registry.admissible_limit()
            status = self.s.call(self._generate(limit + over - 4, 4, None))
            assert status == "INVALID_ARGUMENT"

        @rule(which=st.integers(0, 2), during=st.booleans(), after=st.floats(0.0, 0.05))
        def node_loss(self, which, during, after):
            """The control plane loses a node (as after missed heartbeats), between requests or
            while one is in flight; the node, still alive, is told it was forgotten, drops what it
            held and registers again."""
            node = self.s.nodes[which]

            async def lose():
                req = asyncio.ensure_future(self._generate(60, 30, None)) if during else None
                await asyncio.sleep(after)
                registered = self.s.cp.registry.get(node.rt.node_id)
                if registered is not None:
                    self.s.cp.registry.lose(registered, "test: lost")
                return await req if req is not None else "OK"

            assert self.s.call(lose()) in ALLOWED | {"OK"}

        @invariant()
        def pools_consistent(self):
            for node in self.s.nodes:
                node.rt.pool.check_integrity()

        def teardown(self):
            assert self.s.idle(), [(n.rt.node_id, n.rt.pool.stats()) for n in self.s.nodes] + [
                len(self.s.cp.table)
            ]
            for node in self.s.nodes:
                node.rt.pool.check_integrity()

    Lifecycle.TestCase.settings = settings(
        max_examples=6,
        stateful_step_count=6,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    Lifecycle.TestCase().runTest()
