"""Prefill passes on one engine thread, several prompts to a pass.

A prompt that arrives while the engine thread is busy waits in a queue; when the thread is free it
takes every prompt waiting, in arrival order, up to ``max_batch_tokens`` prompt tokens (the first
always, however long), and runs them in one forward pass (``Engine.prefill_many``). On this
CPU, one torch thread, a pass over four prompts of ~32 tokens of the bundled 24.5M-parameter model
costs 543 µs per prompt token against 781 for a pass of one; the colocated scheduler batches its
prefills the same way. A prompt that arrives to an idle thread runs at once, alone. One that waits
runs in a longer pass than it would alone: that, and the requests a pass releases together, is
the cost, which the token bound keeps small (benchmarks/prefill_batching.py, and the default's
reasons in kvfence/config.py).

A prompt's future is a ``concurrent.futures.Future``: cancelling it before its pass starts drops
the prompt (its pages were never touched); once its pass has started it runs to the end, and the
future's done callbacks fire when the pass is over, so a caller can hold its pages until then.

Each prompt fails alone: a page found at the wrong generation fails that prompt (IntegrityError)
and the others of the pass go on; if a whole pass raises, each of its prompts is run again by
itself so that only the one at fault fails (a warning names them: ``request_ids`` and
``tenant_ids``, in the same order).

``on_pass`` (the ``prefill_pass_prompts`` metric) sees each pass that gave its prompts their
results, first tokens or failures, with its number of prompts; so every prompt taken from the
queue is counted exactly once, and the histogram's sum is the number of prompts prefilled. A
batched pass that raised gave none: it is not counted, and its prompts are, once each, in the
passes of one they are run again in (counting both counted them twice).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

import kernels
from kvfence import logging as kvlog
from kvfence.kv.pool import PagePool, PageRef
from kvfence.model.sampling import SamplingParams, sample

log = kvlog.get_logger("prefill.batcher")


@dataclass
class _Prompt:
    tokens: list[int]
    refs: list[PageRef]
    sampling: SamplingParams
    request_id: str = ""  # for the lines about its pass (the engine thread has no request context)
    tenant_id: str = ""
    future: Future[int] = field(default_factory=Future)


class PrefillBatcher:
    """Queues prompts and runs them in batched forward passes on one thread (module docstring)."""

    def __init__(
        self,
        engine: Any,
        pool: PagePool,
        max_batch_tokens: int = 128,
        on_pass: Callable[[int], None] | None = None,
    ):
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self.engine = engine
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        # Called on the engine thread with the prompt count of each pass that gave its prompts
        # their results (module docstring).
        self.on_pass = on_pass
        # One engine thread: the model never runs on the event loop, and passes do not interleave.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prefill-engine")
        self._lock = threading.Lock()
        self._waiting: deque[_Prompt] = deque()
        self._draining = False  # a drain is queued on, or running on, the engine thread
        self._closed = False
        self.passes = 0  # passes counted as on_pass counts them (the tests read these two)
        self.prompts = 0  # prompts in them: each prompt run, once

    def submit(
        self,
        tokens: list[int],
        refs: list[PageRef],
        sampling: SamplingParams,
        *,
        request_id: str = "",
        tenant_id: str = "",
    ) -> Future[int]:
        """Queue one prompt; the future resolves to its first token (sampling draw 0).

        ``refs`` are exactly the pages the prompt fills: the pass zeroes the unused tail of the
        last of them, and with a page more it would zero that one, leaving the tail of the page
        actually written as the page's previous owner left it. ``request_id`` and ``tenant_id``
        name the prompt in the lines logged about its pass."""
        needed = -(-len(tokens) // self.pool.page_size)
        if len(refs) != needed:
            raise ValueError(
                f"a prompt of {len(tokens)} tokens fills {needed} pages, not {len(refs)}"
            )
        prompt = _Prompt(tokens, refs, sampling, request_id, tenant_id)
        with self._lock:
            if self._closed:
                raise RuntimeError("prefill batcher is closed")
            self._waiting.append(prompt)
            if not self._draining:
                self._draining = True
                self._thread.submit(self._drain)
        return prompt.future

    def close(self, wait: bool = True) -> None:
        """Cancel what has not started; with ``wait``, block until the pass that has is over.
        From a coroutine use :meth:`aclose`: a pass can take seconds, the event loop must not
        stop for it."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
        for prompt in waiting:
            prompt.future.cancel()
        self._thread.shutdown(wait=wait)

    async def aclose(self) -> None:
        """:meth:`close` for the event loop: nothing is queued or started from the moment it is
        called (as ``close``), and it returns once the running pass is over, waiting for it on
        an executor thread so the loop serves everything else meanwhile."""
        self.close(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.shutdown, True)

    # ---- the engine thread -------------------------------------------------------------------
    def _take(self) -> list[_Prompt]:
        """The next pass: waiting prompts in order, within the token budget, not cancelled."""
        batch: list[_Prompt] = []
        tokens = 0
        with self._lock:
            while self._waiting:
                nxt = self._waiting[0]
                if batch and tokens + len(nxt.tokens) > self.max_batch_tokens:
                    break
                self._waiting.popleft()
                if nxt.future.set_running_or_notify_cancel():  # False: cancelled while waiting
                    batch.append(nxt)
                    tokens += len(nxt.tokens)
            if not batch:
                self._draining = False
        return batch

    def _drain(self) -> None:
        while batch := self._take():
            try:
                firsts = self._run(batch)
            except Exception as err:  # every future must resolve, whatever the pass raised
                if len(batch) == 1:
                    self._count_pass(1)  # its prompt's result: this failure
                    batch[0].future.set_exception(err)
                    continue
                # Off the event loop, outside any request's log context: the line names them.
                log.warning(
                    "prefill pass failed; running its prompts one by one",
                    error=repr(err),
                    request_ids=[p.request_id for p in batch],
                    tenant_ids=[p.tenant_id for p in batch],
                )
                # This pass gave no result: not counted; each rerun is, as a pass of one.
                firsts = []
                for prompt in batch:
                    try:
                        firsts.extend(self._run([prompt]))
                    except Exception as one_err:
                        firsts.append(one_err)
                    self._count_pass(1)
            else:
                self._count_pass(len(batch))
            for prompt, first in zip(batch, firsts, strict=True):
                if isinstance(first, BaseException):
                    prompt.future.set_exception(first)
                else:
                    prompt.future.set_result(first)

    def _count_pass(self, prompts: int) -> None:
        self.passes += 1
        self.prompts += prompts
        if self.on_pass is not None:
            try:
                self.on_pass(prompts)
            except Exception:  # a metric must not stop the engine thread
                log.exception("prefill pass callback failed")

    def _run(self, batch: Sequence[_Prompt]) -> list[int | BaseException]:
        """One forward pass: first tokens (or the prompt's IntegrityError), tails zeroed."""
        logits, errors = self.engine.prefill_many(
            [p.tokens for p in batch], [p.refs for p in batch]
        )
        firsts: list[int | BaseException] = list(
            sample(logits, [p.sampling for p in batch], [0] * len(batch))
        )
        page_size = self.pool.page_size
        tails, last_pages = [], []
        for i, (prompt, err) in enumerate(zip(batch, errors, strict=True)):
            if err is not None:
                firsts[i] = err
                continue
            tail = len(prompt.tokens) % page_size
            if tail:
                tails.append(tail)
                last_pages.append(prompt.refs[-1].page_id)
        if last_pages:
            # The last page's unused slots would otherwise carry whatever the page held before.
            # On the pool's device, as kernels.page_checksums puts them: the kernel refuses ids on
            # another one, so on a CUDA pool CPU ids would fail every prompt whose last page is
            # partly filled.
            device = self.pool.kv.device
            kernels.scrub_pages(
                self.pool.kv,
                torch.tensor(last_pages, dtype=torch.int64, device=device),
                torch.tensor(tails, dtype=torch.int64, device=device),
            )
        return firsts
