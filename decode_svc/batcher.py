"""Continuous-batching decode on a dedicated thread, streaming tokens back to the event loop.

Only verified reservations are ever added. Each step feeds every running sequence's last token at
its position, writes that token's KV into the sequence's own page and attends over its pages
through the tag-checking kernel. A sequence whose block table no longer matches the pool's
generations is failed with an integrity error and produces no token.

The page each step writes into is counted as an outstanding operation in the pool for the duration
of the step, so a request released mid-step leaves that page QUARANTINED until the write is over —
never free while a kernel may still write into it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfence import logging as kvlog
from kvfence.detok import StopWatch
from kvfence.errors import Cancelled, IntegrityError, KvfenceError
from kvfence.kv.pool import PagePool, PageRef
from kvfence.model.engine import DecodeBatch
from kvfence.model.sampling import SamplingParams

log = kvlog.get_logger("decode.batcher")


@dataclass
class ActiveSeq:
    """One request in the decode batch."""

    seq_id: str
    pages: list[PageRef]  # the whole reservation, in order (the block table)
    prompt_len: int
    first_token: int
    params: SamplingParams
    # Called on the event loop with ("tokens", [ids]), ("finish", reason) or ("error",
    # KvfenceError).
    emit: Callable[[tuple[str, Any]], None]
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # accepted, not yet emitted (stream_interval)
    # The text of ``generated`` and the stop strings found in it, kept token by token on the
    # engine thread (kvfence.detok): the same answer as searching detokenize(generated).
    watch: StopWatch | None = field(default=None, repr=False)


class DecodeBatcher:
    """Runs engine decode steps for every active sequence on one thread."""

    def __init__(
        self,
        engine: Any,
        pool: PagePool,
        eos_ids: Sequence[int],
        detokenize: Callable[[list[int]], str],
        loop: asyncio.AbstractEventLoop,
        max_batch: int = 64,
        stream_interval: int = 1,
        on_step: Callable[[int], None] | None = None,
    ):
        self.engine = engine
        self.pool = pool
        self.eos_ids = frozenset(eos_ids)
        self.detokenize = detokenize
        self.loop = loop
        self.max_batch = max_batch
        self.stream_interval = stream_interval
        self.on_step = on_step  # called on the engine thread with each step's number of rows
        self._active: dict[str, ActiveSeq] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self.steps = 0
        self._rows = DecodeBatch(engine)
        # Events of the step being run, handed to the event loop together after it: one wakeup
        # per step instead of one per sequence and token.
        self._outbox: list[tuple[Callable[[tuple[str, Any]], None], tuple[str, Any]]] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def active(self) -> int:
        return len(self._active)

    def add(self, seq: ActiveSeq) -> None:
        """Enter a verified sequence; its first token (from prefill) is emitted at once."""
        # The first token is recorded before the engine thread can see the sequence: a step
        # must never find a sequence without its last token (it would fail the whole batch).
        if self._accept(seq, seq.first_token):
            return  # finished at its first token (EOS, a stop string, max_new_tokens 1)
        with self._lock:
            self._active[seq.seq_id] = seq
        self._wake.set()

    def remove(self, seq_id: str) -> bool:
        """Take a sequence out (cancel/release): no step claimed after this returns includes it.

        A step already running goes on with it: that step still writes the sequence's current
        page, counted as an operation in the pool since ``_claim`` (a release that follows leaves
        it QUARANTINED until the step's end), and still reads its other pages, which a release
        may free meanwhile: the tag-checking kernel refuses a page whose generation changed (every
        free bumps it). What that step produces for the sequence is not emitted as tokens."""
        with self._lock:
            return self._active.pop(seq_id, None) is not None

    def _post(self, seq: ActiveSeq, event: tuple[str, Any]) -> None:
        if self._outbox is not None and threading.current_thread() is self._thread:
            self._outbox.append((seq.emit, event))
        else:
            self.loop.call_soon_threadsafe(seq.emit, event)

    def _finish(self, seq: ActiveSeq, event: tuple[str, Any]) -> None:
        with self._lock:
            self._active.pop(seq.seq_id, None)
        self._post(seq, event)

    def _accept(self, seq: ActiveSeq, token: int) -> bool:
        """Record a sampled token, and finish the sequence when a stop condition holds.

        Same rules, in the same order, as the colocated scheduler: EOS (kept in the ids, finish
        "eos"), then a stop string in the text (finish "stop"), then max_new_tokens ("length").
        Tokens are emitted every ``stream_interval`` tokens, the first at once and the last ones
        before the finish. Returns whether the sequence finished."""
        seq.generated.append(token)
        seq.unsent.append(token)
        p = seq.params
        reason = None
        if token in self.eos_ids and not p.ignore_eos:
            reason = "eos"
        elif p.stop and self._stop_found(seq):
            reason = "stop"
        elif len(seq.generated) >= p.max_new_tokens:
            reason = "length"
        if reason is not None or len(seq.generated) == 1 or len(seq.unsent) >= self.stream_interval:
            self._post(seq, ("tokens", seq.unsent))
            seq.unsent = []
        if reason is not None:
            self._finish(seq, ("finish", reason))
        return reason is not None

    def _stop_found(self, seq: ActiveSeq) -> bool:
        """Whether a stop string is in the text of ``seq.generated``: every token is pushed once,
        an EOS that counts never (it ends the sequence first), so the cost of a step does not
        grow with the sequence's length, which would slow every row of the batch."""
        if seq.watch is None:
            seq.watch = StopWatch(self.detokenize, seq.params.stop)
        return seq.watch.push(seq.generated[seq.watch.token_count :]) is not None

    def _run(self) -> None:
        # Nothing may end this loop but stop() (or the event loop it serves closing): were the
        # thread to die, every request on the node would wait for tokens that never come. A
        # failure fails the rows it concerns.
        while not self._stop:
            # The rows _claim refuses are told through the outbox too: events reach the loop only
            # in the finally below, after end_ops, so a failing handoff cannot leave the step's
            # page writes counted (their pages would never be freed).
            self._outbox = []
            batch: list[ActiveSeq] = []
            writes: list[int] = []
            try:
                batch, writes = self._claim()
                if batch:
                    self._step(batch)
            except Exception:
                # The step is every row's: its error may name one row's data (a token id), which
                # another tenant's request must not read. The detail goes to the node's log.
                log.exception("decode step failed", rows=len(batch))
                for seq in batch:
                    self._finish(seq, ("error", _step_failed()))
            finally:
                try:
                    self.pool.end_ops(writes)
                except Exception:
                    log.exception("settling a decode step's page writes failed")
                outbox, self._outbox = self._outbox, None
                if outbox:
                    try:
                        self.loop.call_soon_threadsafe(_deliver, outbox)
                    except Exception:
                        if self.loop.is_closed():
                            # The node stopped without stop(): no stream is left to tell and
                            # nothing can add a row. Ending here says so once, not every step.
                            log.warning("decode engine stops: its event loop is closed")
                            self._stop = True
                        else:
                            log.exception("handing decode events to the event loop failed")
            if not batch:
                self._wake.wait(0.05)
                self._wake.clear()

    def _claim(self) -> tuple[list[ActiveSeq], list[int]]:
        """The next step's rows, and the page each writes into, counted as an operation in the
        pool; under the lock that remove() takes, so a release that follows a remove() finds
        these pages busy and quarantines them until the step's end_ops.

        A row that cannot step leaves the batch with an error instead: one whose next position
        lies past its pages (more tokens than it reserved), whose page is no longer held by it
        (released before it was added), or whose check itself raised (logged; that row only, told
        what a failed step tells)."""
        batch, writes = [], []
        with self._lock:
            for seq in list(self._active.values())[: self.max_batch]:
                try:
                    joined = self._join(seq)
                except Exception:
                    log.exception("a decode row could not join the step", reservation_id=seq.seq_id)
                    joined = _step_failed()
                if isinstance(joined, KvfenceError):
                    self._active.pop(seq.seq_id, None)
                    self._post(seq, ("error", joined))
                    continue
                batch.append(seq)
                writes.append(joined)
        return batch, writes

    def _join(self, seq: ActiveSeq) -> int | KvfenceError:
        """The page ``seq``'s step writes into, counted as an operation in the pool (the last
        thing done: a row that fails before it counted nothing), or why it cannot step."""
        index = self._position(seq) // self.pool.page_size
        if index >= len(seq.pages):
            return KvfenceError(
                f"position {self._position(seq)} is past the sequence's "
                f"{len(seq.pages)} reserved pages"
            )
        if not self.pool.owns(seq.seq_id, [seq.pages[index]]):
            return Cancelled("the sequence's pages were released")
        page_id = seq.pages[index].page_id
        try:
            self.pool.begin_ops([page_id])
        except ValueError as err:
            return KvfenceError(f"cannot write the sequence's page: {err}")
        return page_id

    @staticmethod
    def _position(seq: ActiveSeq) -> int:
        """The last accepted token sits at position prompt_len + len(generated) - 1."""
        return seq.prompt_len + len(seq.generated) - 1

    def _step(self, batch: list[ActiveSeq]) -> None:
        # The block tables stay in the DecodeBatch between steps; only joins and leaves touch them.
        self._rows.sync([s.pages for s in batch])
        tokens = self._rows.step_and_sample(
            [s.generated[-1] for s in batch],
            [self._position(s) for s in batch],
            [s.params for s in batch],
            [len(s.generated) for s in batch],
            pages_held=True,  # _claim counted each write page until the step's flags are read
        )
        self.steps += 1
        if self.on_step is not None:
            try:
                self.on_step(len(batch))
            except Exception:  # a metric must not fail the batch's requests
                log.exception("decode step callback failed")
        for seq, token in zip(batch, tokens, strict=True):
            if token is None:  # a tag check failed: this row produced no token
                self._finish(
                    seq,
                    (
                        "error",
                        IntegrityError(
                            "a KV page changed owner during decode", reason="PAGE_GENERATION"
                        ),
                    ),
                )
        for seq, token in zip(batch, tokens, strict=True):
            if token is None:
                continue
            with self._lock:
                still = seq.seq_id in self._active
            if still:
                self._accept(seq, token)


def _step_failed() -> KvfenceError:
    """What a row's stream is told when its step, or its check for the step, failed on this node:
    not the cause (logged), which may name another tenant's data."""
    return KvfenceError("decode step failed on this node (its log has the cause)")


def _deliver(events: list[tuple[Callable[[tuple[str, Any]], None], tuple[str, Any]]]) -> None:
    """Event loop: hand one step's events to their streams, in the order they happened."""
    for emit, event in events:
        emit(event)
