"""Continuous-batching decode scheduler.

A sequence enters one of two ways:

* ``add(seq_id, prompt_ids, sampling)`` (colocated): it waits until the pool can hold
  ``prompt + max_new_tokens`` tokens, then the scheduler allocates its pages (owner = seq_id),
  prefills it and samples the first token. The scheduler releases those pages when it finishes.
* ``add_prefilled(seq_id, prompt_len, first_token, pages, sampling)``: its KV pages were filled
  elsewhere (as a verified transfer fills them) and its first token is known. The caller owns
  those pages and releases them after the sequence's final output. The decode node does not
  use this scheduler: its ``DecodeBatcher`` (``decode_svc/batcher.py``) steps the verified
  sequences; this entry keeps the split path testable against the colocated one in-process.

Status moves only inside ``step()``::

    WAITING --admit--> RUNNING --EOS / stop / max tokens--> FINISHED
                          \\--tag check failed--> FAILED (error = IntegrityError)
    WAITING | RUNNING --abort()--> ABORTED

``add*``/``abort`` may be called from any thread (they go through an inbox); ``step()`` runs on
one thread, the engine's, and reports a :class:`StepOutput` per sequence that changed, both as its
return value and through ``on_output``. Every generated token is reported exactly once, the first
token of a prefilled sequence included (in its first output). Finished, failed and aborted
sequences are reported once with ``finished=True`` and then forgotten.
"""

from __future__ import annotations

import threading
from collections import abc, deque
from dataclasses import dataclass, field
from enum import IntEnum

from kvfence.detok import StopWatch
from kvfence.errors import IntegrityError
from kvfence.kv.pool import PageRef
from kvfence.model.engine import DecodeBatch, Engine
from kvfence.model.sampling import SamplingParams, sample, stream_safe_len
from kvfence.tokenizer import Tokenizer


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    FAILED = 3
    ABORTED = 4


class FinishReason:
    STOP = "stop"  # a stop string
    LENGTH = "length"  # max_new_tokens
    EOS = "eos"


@dataclass
class Sequence:
    """One request inside the scheduler (state changes only in Scheduler.step)."""

    seq_id: str
    prompt_ids: list[int]  # empty for a prefilled sequence (its prompt lives in the pages)
    prompt_len: int
    sampling: SamplingParams
    pages: list[PageRef] = field(default_factory=list)
    owns_pages: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    error: IntegrityError | None = None
    emitted_tokens: int = 0
    emitted_chars: int = 0
    # The text rendered token by token (stop strings, streamed text): kvfence.detok.
    watch: StopWatch | None = field(default=None, repr=False)

    @property
    def last_position(self) -> int:
        """Position of the newest token (whose K/V the next decode step writes)."""
        return self.prompt_len + len(self.output_ids) - 1


@dataclass(frozen=True)
class StepOutput:
    """What changed for one sequence in one step.

    ``text_delta`` is text safe to stream now (always empty before the final output unless the
    scheduler streams text); on the final output ``text`` is the whole generated text (cut before
    a stop string, EOS not rendered) and ``token_ids`` every generated id.
    """

    seq_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None
    status: SequenceStatus = SequenceStatus.RUNNING
    error: IntegrityError | None = None
    text: str | None = None
    token_ids: list[int] | None = None


class Scheduler:
    """Admits, batches and finishes sequences on one Engine (see module docstring)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: abc.Sequence[int] = (),
        max_batch_size: int = 64,
        max_prefill_tokens: int = 4096,
        stream_text: bool = False,
        on_output: abc.Callable[[StepOutput], None] | None = None,
    ):
        """``max_prefill_tokens`` bounds the prompt tokens prefilled in one forward pass (a longer
        prompt runs alone). ``stream_text=True`` renders each sequence's text at every step and
        streams it in ``text_delta``; by default (like the decode node, which streams ids) the text
        is rendered only where it is read: stop strings and the final output, whose ids and text
        are the same either way."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        self.engine = engine
        self.pool = engine.pool
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.stream_text = stream_text
        self.on_output = on_output
        self._batch = DecodeBatch(engine)  # block tables of the running sequences, kept
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._inbox: deque[Sequence | str] = deque()  # new sequences, or seq ids to abort
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    # ---- any thread --------------------------------------------------------------------------
    def add(self, seq_id: str, prompt_ids: abc.Sequence[int], sampling: SamplingParams) -> None:
        """Queue a prompt; ValueError if it can never run (too long for the model or the pool)."""
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("empty prompt")
        self.engine.check_tokens(prompt)
        self._check_fits(len(prompt), sampling)
        self._push(Sequence(seq_id, prompt, len(prompt), sampling.with_seed(), owns_pages=True))

    def add_prefilled(
        self,
        seq_id: str,
        prompt_len: int,
        first_token: int,
        pages: abc.Sequence[PageRef],
        sampling: SamplingParams,
    ) -> None:
        """Queue a sequence whose prompt K/V is already in ``pages`` (owned by the caller) and
        whose first token (draw 0) was sampled by the prefill node."""
        if prompt_len < 1:
            raise ValueError("prompt_len must be >= 1")
        if sampling.missing_seed:
            raise ValueError("a sampled request needs the seed the prefill node used")
        self.engine.check_tokens([first_token])
        self._check_fits(prompt_len, sampling)
        need = prompt_len + sampling.max_new_tokens - 1  # the last token's K/V is never written
        if len(pages) * self.pool.page_size < need:
            raise ValueError(
                f"{len(pages)} pages cannot hold the {need} tokens this request writes"
            )
        seq = Sequence(seq_id, [], prompt_len, sampling, list(pages), output_ids=[first_token])
        self._push(seq)

    def abort(self, seq_id: str) -> None:
        """Stop a sequence at the next step boundary (never mid-step, so no kernel still reads its
        pages when the caller releases them after the ABORTED output)."""
        with self._lock:
            self._inbox.append(seq_id)

    def _check_fits(self, prompt_len: int, sampling: SamplingParams) -> None:
        total = prompt_len + sampling.max_new_tokens
        window = self.engine.model.args.shape.context_window  # a sliding window caps it
        if total > window:
            raise ValueError(
                f"prompt {prompt_len} + max_new_tokens {sampling.max_new_tokens} = {total} "
                f"exceeds the context window {window}"
            )
        if total > self.pool.pool_tokens:
            raise ValueError(f"{total} tokens can never fit a pool of {self.pool.pool_tokens}")

    def _push(self, seq: Sequence) -> None:
        with self._lock:
            if seq.seq_id in self._ids:
                raise ValueError(f"sequence {seq.seq_id!r} already exists")
            self._ids.add(seq.seq_id)
            self._inbox.append(seq)

    # ---- engine thread -----------------------------------------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.running or self._inbox)

    def step(self) -> list[StepOutput]:
        """Admit what fits, decode one token for every running sequence, report changes."""
        touched: dict[str, Sequence] = {}  # insertion-ordered; one output per sequence per step
        self._drain_inbox(touched)
        self._admit(touched)
        batch = [s for s in self.running if s.status == SequenceStatus.RUNNING]
        if batch:
            self._decode(batch, touched)
        self.running = [s for s in self.running if s.status == SequenceStatus.RUNNING]
        result = [self._report(seq) for seq in touched.values()]
        if self.on_output is not None:
            for out in result:
                self.on_output(out)
        return result

    def _drain_inbox(self, touched: dict[str, Sequence]) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if isinstance(item, Sequence):
                self.waiting.append(item)
                continue
            for seq in [*self.waiting, *self.running]:
                if seq.seq_id == item and seq.status <= SequenceStatus.RUNNING:
                    self._end(seq, SequenceStatus.ABORTED, touched)
            self.waiting = deque(s for s in self.waiting if s.status == SequenceStatus.WAITING)

    def _admit(self, touched: dict[str, Sequence]) -> None:
        # FIFO without overtaking: a big request at the head is not starved by small ones.
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if seq.owns_pages:
                need = -(-(seq.prompt_len + seq.sampling.max_new_tokens) // self.pool.page_size)
                pages = self.pool.allocate(need, seq.seq_id)
                if pages is None:
                    break
                seq.pages = pages
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        self._prefill([s for s in admitted if s.owns_pages], touched)
        for seq in admitted:
            if seq.status == SequenceStatus.RUNNING:
                self._after_token(seq, touched)

    def _prefill(self, seqs: list[Sequence], touched: dict[str, Sequence]) -> None:
        """Prefill ``seqs`` in as few forward passes as the token budget allows; sample draw 0."""
        chunk: list[Sequence] = []
        tokens = 0
        for seq in [*seqs, None]:
            if chunk and (seq is None or tokens + seq.prompt_len > self.max_prefill_tokens):
                logits, errors = self.engine.prefill_many(
                    [s.prompt_ids for s in chunk], [s.pages for s in chunk]
                )
                firsts = sample(logits, [s.sampling for s in chunk], [0] * len(chunk))
                for s, err, tok in zip(chunk, errors, firsts, strict=True):
                    if err is not None:
                        self._end(s, SequenceStatus.FAILED, touched, error=err)
                    else:
                        s.output_ids.append(tok)
                chunk, tokens = [], 0
            if seq is not None:
                chunk.append(seq)
                tokens += seq.prompt_len

    def _decode(self, batch: list[Sequence], touched: dict[str, Sequence]) -> None:
        self._batch.sync([s.pages for s in batch])
        tokens = self._batch.step_and_sample(
            [s.output_ids[-1] for s in batch],
            [s.prompt_len + len(s.output_ids) - 1 for s in batch],  # s.last_position
            [s.sampling for s in batch],
            [len(s.output_ids) for s in batch],
        )
        for seq, tok in zip(batch, tokens, strict=True):
            if tok is not None:
                seq.output_ids.append(tok)
                self._after_token(seq, touched)
                continue
            err = IntegrityError(
                f"sequence {seq.seq_id}: a KV page changed owner (generation tag mismatch)",
                reason="PAGE_GENERATION",
            )
            self._end(seq, SequenceStatus.FAILED, touched, error=err)

    def _after_token(self, seq: Sequence, touched: dict[str, Sequence]) -> None:
        tok, params = seq.output_ids[-1], seq.sampling
        ids = seq.output_ids
        eos = tok in self.eos and not params.ignore_eos
        last = len(ids) >= params.max_new_tokens
        cut = None
        # The text is rendered when something reads it: the stream, a stop string, the end. When
        # it is read at every token, it is kept incrementally: the same text as
        # tokenizer.decode(ids) (without the EOS that ends the run), at a cost per token that
        # does not grow with the sequence (kvfence.detok).
        if self.stream_text or params.stop:
            if seq.watch is None:
                seq.watch = StopWatch(self.tokenizer, params.stop)
            if not eos:  # every earlier token was pushed: an EOS that counts ends the run
                cut = seq.watch.push(ids[seq.watch.token_count :])
            if self.stream_text or eos or cut is not None or last:
                seq.text = seq.watch.text()
        elif eos or last:
            seq.text = self.tokenizer.decode(ids[:-1] if eos else ids)
        if eos:
            seq.finish_reason = FinishReason.EOS
        elif cut is not None:
            seq.text, seq.finish_reason = seq.text[:cut], FinishReason.STOP
        elif last:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            self._end(seq, SequenceStatus.FINISHED, touched)
        touched[seq.seq_id] = seq

    def _end(
        self,
        seq: Sequence,
        status: SequenceStatus,
        touched: dict[str, Sequence],
        error: IntegrityError | None = None,
    ) -> None:
        seq.status, seq.error = status, error
        if seq.owns_pages and seq.pages:
            self.pool.release(seq.seq_id)
        with self._lock:
            self._ids.discard(seq.seq_id)
        touched[seq.seq_id] = seq

    def _report(self, seq: Sequence) -> StepOutput:
        """Everything about ``seq`` not yet reported; a final output if it ended."""
        if seq.status == SequenceStatus.RUNNING and not self.stream_text:
            # The common case, every step for every running sequence: new ids, no text yet.
            new = seq.output_ids[seq.emitted_tokens :]
            seq.emitted_tokens = len(seq.output_ids)
            return StepOutput(seq.seq_id, new, "")
        if seq.status == SequenceStatus.RUNNING:
            if self.stream_text:
                safe = max(stream_safe_len(seq.text, seq.sampling.stop), seq.emitted_chars)
            else:
                safe = seq.emitted_chars
        else:
            safe = len(seq.text)
        ok = seq.status in (SequenceStatus.RUNNING, SequenceStatus.FINISHED)
        out = StepOutput(
            seq.seq_id,
            seq.output_ids[seq.emitted_tokens :] if ok else [],
            seq.text[seq.emitted_chars : safe] if ok else "",
            finished=seq.status != SequenceStatus.RUNNING,
            finish_reason=seq.finish_reason,
            status=seq.status,
            error=seq.error,
            text=seq.text if seq.status == SequenceStatus.FINISHED else None,
            token_ids=list(seq.output_ids) if seq.status == SequenceStatus.FINISHED else None,
        )
        seq.emitted_tokens, seq.emitted_chars = len(seq.output_ids), safe
        return out
