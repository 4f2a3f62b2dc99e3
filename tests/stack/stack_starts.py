"""Starting real test stacks for less: a fresh state directory that already holds the embedded
model, and several stacks started (and stopped) at once.

On a state directory without the embedded model, ``kvfence up`` first writes it there in a
process of its own (``python -m kvfence.model.tiny``), and a control plane served alone
(``stack_harness.Cluster``) writes it itself: each imports torch and draws the weights, about
3 s of CPU at every such start, ahead of everything the test is about. A state directory used
before holds the model already, and then nothing is written (``tiny_model_complete``).
:func:`seed_embedded_model` gives a test's fresh directory the same bytes (copied from the user
cache, which the first call writes) so that its stack starts as it does on such a directory.
The write itself is tested where it is the point:
``tests/control_plane/test_cp_no_torch_first_start.py``.

A stack's start is mostly one process after another (``up``, its control plane, then the nodes)
waiting on the previous one, and its stop mostly waiting too: two stacks started at once on a
2-core machine were up in about half the time they took one after the other. :func:`running`
starts the stacks a module needs (each a stack of its own, as before) that way.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from kvfence.model.tiny import ensure_tiny_model

S = TypeVar("S", bound=Any)  # a stack_harness.Stack or Cluster: start() and stop()


def seed_embedded_model(state_dir: Path) -> Path:
    """Copy the embedded model to where ``up`` and the services look for it under
    ``state_dir`` (``models/tiny-llama``); returns ``state_dir``."""
    target = state_dir / "models" / "tiny-llama"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ensure_tiny_model(), target)
    return state_dir


def _each(stacks: tuple[S, ...], method: str) -> list[BaseException]:
    """``stack.<method>()`` of every stack, each in a thread of its own; the errors raised."""

    def call(stack: S) -> BaseException | None:
        try:
            getattr(stack, method)()
        except BaseException as err:  # raised by the caller once every call is done
            return err
        return None

    with ThreadPoolExecutor(max_workers=max(1, len(stacks))) as pool:
        return [e for e in pool.map(call, stacks) if e is not None]


@contextmanager
def running(*stacks: S) -> Iterator[tuple[S, ...]]:
    """Start ``stacks`` at once and stop them all at once when the block ends, whatever ends it.
    A start that fails stops its own stack (``start``'s contract); the others are stopped and
    the first error is raised. Stopping a stack the block stopped already does nothing."""
    try:
        started = _each(stacks, "start")
        if started:
            raise started[0]
        yield stacks
    finally:
        stopped = _each(stacks, "stop")
    if stopped:  # only when nothing else is being raised
        raise stopped[0]
