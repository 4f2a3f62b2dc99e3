"""The helpers that start the stack tests' stacks for less (``stack_starts``), on stand-ins for
stacks: no process is started here."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from stack_starts import running, seed_embedded_model

from kvfence.model.tiny import tiny_model_complete


class FakeStack:
    """start() and stop() as a Stack has them, recorded; start() waits for ``barrier``."""

    def __init__(self, name: str, barrier: threading.Barrier, fail: bool = False):
        self.name, self.barrier, self.fail = name, barrier, fail
        self.calls: list[str] = []

    def start(self) -> FakeStack:
        self.calls.append("start")
        self.barrier.wait()  # returns only once every stack's start has begun
        if self.fail:
            raise RuntimeError(f"{self.name} did not start")
        return self

    def stop(self) -> None:
        self.calls.append("stop")


def test_running_starts_every_stack_at_once_and_stops_each_once() -> None:
    barrier = threading.Barrier(3, timeout=10)  # one start after another would break it
    stacks = [FakeStack(n, barrier) for n in "abc"]
    with running(*stacks) as got:
        assert list(got) == stacks
        assert [s.calls for s in stacks] == [["start"]] * 3
    assert [s.calls for s in stacks] == [["start", "stop"]] * 3


def test_a_failed_start_stops_them_all_and_raises_its_error() -> None:
    barrier = threading.Barrier(2, timeout=10)
    ok, bad = FakeStack("ok", barrier), FakeStack("bad", barrier, fail=True)
    entered = False
    with pytest.raises(RuntimeError, match="bad did not start"), running(ok, bad):
        entered = True
    assert not entered
    assert ok.calls == ["start", "stop"] and bad.calls == ["start", "stop"]


def test_an_error_in_the_block_stops_them_all_and_is_raised_as_it_was() -> None:
    barrier = threading.Barrier(2, timeout=10)
    stacks = [FakeStack(n, barrier) for n in "ab"]
    with pytest.raises(KeyError, match="from the block"), running(*stacks):
        raise KeyError("from the block")
    assert [s.calls for s in stacks] == [["start", "stop"]] * 2


def test_a_seeded_state_dir_holds_the_whole_embedded_model(tmp_path: Path) -> None:
    assert seed_embedded_model(tmp_path / "state") == tmp_path / "state"
    assert tiny_model_complete(tmp_path / "state" / "models" / "tiny-llama")
