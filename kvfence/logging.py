"""structlog set-up: JSON lines in services, console rendering in the CLI.

Per-request fields (``request_id``, ``tenant_id``) are bound through structlog's contextvars, so
every line logged while a request is handled carries them, whichever module logs it. Prompt text is
never logged by kvfence code; log token counts instead.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import structlog

_configured_mode: str | None = None


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at write time (test runners and CLIs swap it), and a log line
    that cannot be written is dropped: logging must never fail a request."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (ValueError, OSError):
            return 0

    def flush(self) -> None:
        with suppress(ValueError, OSError):
            sys.stderr.flush()


def configure(mode: str = "json", level: str = "INFO") -> None:
    """Configure structlog once per process; ``mode`` is "json" (services) or "console" (CLI)."""
    global _configured_mode
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: Any
    if mode == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    _configured_mode = mode


def get_logger(name: str) -> Any:
    """A structlog logger tagged with the component name."""
    return structlog.get_logger(component=name)


@contextmanager
def request_context(request_id: str, tenant_id: str, **extra: Any) -> Iterator[None]:
    """Bind request_id and tenant_id (and ``extra``) to every log line inside the block."""
    tokens = structlog.contextvars.bind_contextvars(
        request_id=request_id, tenant_id=tenant_id, **extra
    )
    try:
        yield
    finally:
        # ValueError: the block was left in another context than it was entered in (an async
        # generator, a streaming RPC handler, closed by the task that cancelled it). The
        # bindings were made in the first context; there is nothing of them to undo here.
        with suppress(ValueError):
            structlog.contextvars.reset_contextvars(**tokens)


class BurstLog:
    """A log line for something that can come in floods (refused connections or calls, whoever
    reaches a port sets how often): the first occurrence is logged at once (``emit(n)``, n
    occurrences since the last line), later ones at most once per ``interval_s``. The rest of a
    burst is logged when the interval is over (a timer on the running loop), not at the next
    occurrence, which may never come."""

    def __init__(self, emit: Callable[[int], None], interval_s: float):
        self._emit = emit
        self.interval_s = interval_s
        self._unlogged = 0
        self._after = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def note(self) -> None:
        """One occurrence (on the event loop)."""
        self._unlogged += 1
        now = time.monotonic()
        if now >= self._after:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._after - now, self.flush)

    def flush(self) -> None:
        """Log the occurrences since the last line (if any)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._unlogged:
            return
        self._emit(self._unlogged)
        self._unlogged = 0
        self._after = time.monotonic() + self.interval_s
