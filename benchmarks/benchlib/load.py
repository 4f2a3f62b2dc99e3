"""Closed-loop load through the public API: ``concurrency`` workers, each streaming one request
at a time, recording time to first token and the gaps between streamed chunks."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from kvfence.client import AsyncClient
from kvfence.errors import KvfenceError


@dataclass
class RequestTiming:
    ttft_s: float
    total_s: float
    tokens: int
    gaps_s: list[float] = field(default_factory=list)  # per token: a chunk's gap / its tokens
    chunk_gaps_s: list[float] = field(default_factory=list)  # between chunks after the first


@dataclass
class LoadResult:
    wall_s: float
    timings: list[RequestTiming]
    failures: list[str] = field(default_factory=list)  # "<error class>: <message>" per failure

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft(self) -> list[float]:
        return [t.ttft_s for t in self.timings]

    def gaps(self) -> list[float]:
        return [g for t in self.timings for g in t.gaps_s]

    def chunk_gaps(self) -> list[float]:
        return [g for t in self.timings for g in t.chunk_gaps_s]

    @property
    def chunks(self) -> int:
        """Messages that carried tokens."""
        return sum(len(t.chunk_gaps_s) + 1 for t in self.timings if t.tokens)


def make_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of byte-token ids (3..258), lengths in [lo, hi], the same for every seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def _one(client: AsyncClient, prompt: list[int], max_new: int) -> RequestTiming:
    t0 = time.perf_counter()
    first = last = 0.0
    gaps: list[float] = []
    chunk_gaps: list[float] = []
    tokens = 0
    async for chunk in client.stream(prompt_ids=prompt, max_new_tokens=max_new, ignore_eos=True):
        if not chunk.token_ids:
            continue
        now = time.perf_counter()
        if tokens == 0:
            first = now - t0
        else:
            gaps.append((now - last) / len(chunk.token_ids))
            chunk_gaps.append(now - last)
        last = now
        tokens += len(chunk.token_ids)
    return RequestTiming(first, time.perf_counter() - t0, tokens, gaps, chunk_gaps)


async def drive(
    target: str,
    api_key: str,
    prompts: list[list[int]],
    max_new: int,
    concurrency: int,
    during: Callable[[], AbstractContextManager[Any]] | None = None,
) -> LoadResult:
    """Run every prompt with at most ``concurrency`` in flight; wall time covers all of them.
    ``during`` (e.g. ``CpuMeter.measure``) is entered after the client's warm-up request and
    left when the last prompt is done, so it sees exactly the prompts' work."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []
    failures: list[str] = []
    async with AsyncClient(target, api_key, timeout=300) as client:
        await client.generate(prompt_ids=[5, 6, 7], max_new_tokens=2, ignore_eos=True)  # warm

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    timings.append(await _one(client, prompt, max_new))
                except KvfenceError as err:  # counted and reported, not fatal to the benchmark
                    failures.append(f"{type(err).__name__}: {str(err)[:300]}")

        with during() if during is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            await asyncio.gather(*[worker() for _ in range(concurrency)])
            wall = time.perf_counter() - t0
    return LoadResult(wall, timings, failures)


def run_load(
    target: str,
    api_key: str,
    prompts: list[list[int]],
    max_new: int,
    concurrency: int,
    during: Callable[[], AbstractContextManager[Any]] | None = None,
) -> LoadResult:
    return asyncio.run(drive(target, api_key, prompts, max_new, concurrency, during))
