"""An idle decode node does not spin: UCX waits are completed by ucxx's notifier thread.

Without Python futures, ucxx awaits a pending UCX operation by yielding to the event loop in a
busy loop. A decode node always has a receive posted once prefill has pooled an endpoint to it
(it waits there for the next transfer's hello), so it burned a whole core while idle and its
decode thread fought that loop for the GIL. ``kvfence serve`` turns the futures on; the control
run with them off shows that this measurement does see the spin.
"""

from __future__ import annotations

import time

import pytest
from stack_harness import Stack
from stack_starts import running, seed_embedded_model


def cpu_fraction(proc, seconds: float = 2.0) -> float:
    """Share of one core ``proc`` used over ``seconds`` (user + system)."""
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    return (after.user + after.system - before.user - before.system) / seconds


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """A stack with ucxx's Python futures on ("1", as ``kvfence serve`` runs) and one with them
    off ("0"), started at once; each test stops its own once it has measured, so that no
    spinning decode node outlives its test."""
    by_futures = {
        futures: Stack(
            seed_embedded_model(tmp_path_factory.mktemp(f"futures-{futures}")),
            env={"UCXPY_ENABLE_PYTHON_FUTURE": futures},
        )
        for futures in ("1", "0")
    }
    with running(*by_futures.values()):
        yield by_futures


@pytest.mark.parametrize(("futures", "spins"), [("1", False), ("0", True)])
def test_an_idle_decode_node_after_a_transfer(stacks, futures, spins):
    stack = stacks[futures]
    try:
        with stack.client() as c:  # a transfer: prefill now holds a pooled endpoint to decode
            assert c.generate(prompt_ids=[5, 6, 7], max_new_tokens=2, ignore_eos=True).token_ids
        time.sleep(0.5)  # let the request's release and events settle
        used = cpu_fraction(stack.services()["decode"])
    finally:
        stack.stop()
    if spins:
        assert used > 0.4, f"control: decode used {used:.0%} of a core with futures off"
    else:
        assert used < 0.2, f"idle decode used {used:.0%} of a core"
