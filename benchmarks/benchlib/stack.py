"""The local stack benchmarks run (:class:`kvfence.localstack.LocalStack`), started and stopped
several at once, RSS sampling, the CPU time a load costs each process, and the same load on
several stacks in turn."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

import benchlib
from benchlib.load import LoadResult, drive, make_prompts, run_load
from kvfence.localstack import LocalStack, free_port_pair

_PORTS_LOCK = threading.Lock()
_PORTS_GIVEN: set[int] = set()  # every port of the pairs this process's stacks were given


class BenchStack(LocalStack):
    """:class:`LocalStack` (start / stop / services / node_rpc_counts / api_key) as the
    benchmarks run it, with two differences that only shorten its start and stop:

    * its public/admin port pair is never one that another stack of this process was given:
      :func:`started` starts stacks at once, and each ``up`` binds its pair seconds after it
      was picked (``--port``, after LocalStack's own, wins);
    * its control plane stops as soon as nothing runs (``control_plane.shutdown_refuse_s`` 0,
      unless the config sets it): the second it otherwise keeps refusing new requests is for
      clients and load balancers still sending, and a benchmark stops its stack once its load
      is done."""

    def __init__(
        self,
        state_dir: Path,
        *,
        config: dict[str, Any] | None = None,
        args: list[str] | None = None,
        **kwargs: Any,
    ):
        config = dict(config or {})
        config["control_plane"] = {"shutdown_refuse_s": 0, **config.get("control_plane", {})}
        super().__init__(state_dir, config=config, args=args, **kwargs)
        self._args = list(self.args)

    def start(self, timeout: float = 180.0) -> BenchStack:
        with _PORTS_LOCK:
            while True:
                port = free_port_pair()
                if not {port, port + 1} & _PORTS_GIVEN:
                    break
            _PORTS_GIVEN.update((port, port + 1))
        self.args = [*self._args, "--port", str(port)]
        super().start(timeout)
        return self


@contextmanager
def started(stacks: Sequence[LocalStack], at_once: bool = True) -> Iterator[Callable[[], None]]:
    """Start ``stacks`` and stop them all at once when the block ends, whatever ends it.

    ``at_once``: each stack starts in a thread of its own (a stack's control plane starts alone
    before its nodes do, leaving a core to another stack's processes: on 2 cores two stacks
    started at once were up in about 70% of the time they took one after the other); the block
    runs meanwhile, and the function it is given waits until every stack is up (raising the
    first start's error): call it before using one. Otherwise the stacks start one after
    another, in ``stacks``' order, before the block runs (for a benchmark where which stack
    started first matters)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(stacks)), thread_name_prefix="bench-stack")
    starts = []
    try:
        if at_once:
            starts = [pool.submit(stack.start) for stack in stacks]
        else:
            for stack in stacks:
                stack.start()

        def ready() -> None:
            for start in starts:
                start.result()

        yield ready
        ready()  # a start's error, where the block did not ask
    finally:
        wait(starts)  # a stack still starting cannot be stopped; one that failed stopped itself
        stops = [pool.submit(stack.stop) for stack in stacks]
        wait(stops)
        pool.shutdown()
        for stop in stops:
            stop.result()


class _Meter:
    """Counters read before and after each span :meth:`measure` covers, their growth summed in
    ``used``; a subclass says what it reads (``_now``)."""

    used: Counter[Any]

    def _now(self) -> dict[Any, float]:
        raise NotImplementedError

    @contextmanager
    def measure(self) -> Iterator[None]:
        before = self._now()
        yield
        for key, value in self._now().items():
            self.used[key] += value - before.get(key, 0.0)


class CpuMeter(_Meter):
    """User + system CPU seconds (threads included) of a stack's processes and of this one, the
    load generator, summed over the spans :meth:`measure` covers: where a token's cost goes when
    the stack, not the model, is the bound."""

    def __init__(self, stack: LocalStack):
        self.procs = {**stack.services(), "load_generator": psutil.Process()}
        self.used = Counter(dict.fromkeys(self.procs, 0.0))

    def _now(self) -> dict[str, float]:
        return {role: sum(p.cpu_times()[:2]) for role, p in self.procs.items()}

    def us_per_token(self, tokens: int) -> dict[str, float]:
        """Each process's CPU µs per delivered token over everything measured."""
        return {role: round(used / max(tokens, 1) * 1e6, 1) for role, used in self.used.items()}


# A stack started with this config serves every service's Prometheus metrics on a free port.
METRICS_CONFIG: dict[str, Any] = {"node": {"metrics_port": 0}}


class StackMetrics(_Meter):
    """The Prometheus metrics of a stack started with :data:`METRICS_CONFIG`, summed over the
    spans :meth:`measure` covers: how many rows the decode node's steps ran, and how long requests
    spent in each state of their lifecycle (control plane), under a given load.

    Each service logs the port it bound ("metrics served"); the service a port belongs to is the
    ``service`` label of what it serves."""

    def __init__(self, stack: LocalStack):
        self.urls: dict[str, str] = {}
        for log in sorted((stack.state_dir / "logs").glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if '"metrics served"' not in line:
                    continue
                url = f"http://127.0.0.1:{json.loads(line)['port']}/metrics"
                text = urllib.request.urlopen(url, timeout=10).read().decode()
                service = text.split('service="', 1)[1].split('"', 1)[0]
                self.urls[service] = url
        missing = {"control-plane", "prefill", "decode"} - set(self.urls)
        if missing:
            raise RuntimeError(f"no metrics port logged by {sorted(missing)}")
        self.used: Counter[tuple[str, str, str]] = Counter()

    def _now(self) -> Counter[tuple[str, str, str]]:
        """(service, sample name, its labels but the service) -> value, for every sample."""
        from prometheus_client.parser import text_string_to_metric_families

        out: Counter[tuple[str, str, str]] = Counter()
        for service, url in self.urls.items():
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = ",".join(
                        f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "service"
                    )
                    out[(service, sample.name, labels)] = sample.value
        return out

    def _mean(self, service: str, name: str, labels: str = "") -> float | None:
        count = self.used[(service, f"{name}_count", labels)]
        return self.used[(service, f"{name}_sum", labels)] / count if count else None

    def decode_rows_per_step(self) -> float | None:
        """The mean number of sequences in a decode step (None when no step ran)."""
        mean = self._mean("decode", "kvfence_decode_step_rows")
        return None if mean is None else round(mean, 2)

    def state_ms(self) -> dict[str, float]:
        """Mean milliseconds a request spent in each lifecycle state it left."""
        out = {}
        for service, name, labels in list(self.used):
            if service == "control-plane" and name == "kvfence_request_state_seconds_count":
                mean = self._mean(service, "kvfence_request_state_seconds", labels)
                if mean is not None:
                    out[labels.removeprefix("state=")] = round(mean * 1e3, 2)
        return out


class RssSampler:
    """Samples the resident set size of named processes in a background thread; ``peaks()`` and
    ``reset()`` let a benchmark take the peak of each phase separately."""

    def __init__(self, procs: dict[str, psutil.Process], interval_s: float = 0.05):
        self.procs = procs
        self.interval_s = interval_s
        self._peak: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        for name, p in self.procs.items():
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            with self._lock:
                self._peak[name] = max(self._peak.get(name, 0), rss)

    def reset(self) -> None:
        with self._lock:
            self._peak.clear()
        self.sample()

    def peaks_mib(self) -> dict[str, float]:
        with self._lock:
            return {name: round(v / 2**20, 1) for name, v in sorted(self._peak.items())}

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


PROMPT_TOKENS = (24, 40)  # the closed-loop load's prompt lengths (e2e.py's too)


def workload(model: str, new: int) -> dict[str, Any]:
    """The JSON description of that load."""
    return {
        "model": model,
        "prompt_tokens": list(PROMPT_TOKENS),
        "new_tokens": new,
        "greedy": True,
        "ignore_eos": True,
    }


def warm_up(
    stacks: Iterable[LocalStack], prompts: list[list[int]], new: int, concurrency: int
) -> None:
    """The first use of each stack's code paths, not measured (a stack's first requests cost
    more): ``prompts`` through every stack, the stacks at once."""

    async def every() -> None:
        await asyncio.gather(
            *(drive(s.target, s.api_key, prompts, new, concurrency) for s in stacks)
        )

    asyncio.run(every())


def compare_by_concurrency(
    stacks: Mapping[str, LocalStack], levels_c: list[int], new: int, rounds: int, quick: bool
) -> list[dict[str, Any]]:
    """Warm the stacks up (:func:`warm_up`), then :func:`compare_stacks` at each concurrency:
    ``max(4 * c, 16)`` requests (``max(2 * c, 4)`` when ``quick``) per stack and round."""
    warm_up(stacks.values(), make_prompts(4, *PROMPT_TOKENS), new, 4)
    levels = []
    for conc in levels_c:
        n = max(2 * conc, 4) if quick else max(4 * conc, 16)
        benchlib.log(f"concurrency {conc}: {n} requests x {rounds} rounds")
        sides = compare_stacks(stacks, conc, n, new, rounds)
        levels.append({"concurrency": conc, "requests": n, "rounds": rounds, **sides})
    return levels


def compare_stacks(
    stacks: Mapping[str, LocalStack], conc: int, n: int, new: int, rounds: int
) -> dict[str, Any]:
    """The same closed-loop load (``n`` prompts of 24-40 tokens, ``new`` tokens each,
    ``concurrency`` clients) on each stack, one at a time, in a new seeded order every round; per
    stack: tokens/s (median of the rounds), TTFT, the gap between the messages a client receives,
    tokens per message, failures, and each process's CPU µs per delivered token."""
    prompts = make_prompts(n, *PROMPT_TOKENS, seed=conc)
    cpu = {k: CpuMeter(s) for k, s in stacks.items()}
    runs: dict[str, list[LoadResult]] = {k: [] for k in stacks}
    for k in benchlib.turns(list(stacks), rounds, seed=conc):
        st = stacks[k]
        runs[k].append(run_load(st.target, st.api_key, prompts, new, conc, during=cpu[k].measure))
    out: dict[str, Any] = {}
    for k, rs in runs.items():
        failures = [f for r in rs for f in r.failures]
        tokens = sum(r.tokens for r in rs)
        assert tokens == new * (n * rounds - len(failures)), f"{k}: wrong token count"
        out[k] = {
            "tokens_per_s": benchlib.r(benchlib.median([r.tokens_per_s for r in rs]), 1),
            "ttft": benchlib.summary_ms([t for r in rs for t in r.ttft()]),
            "message_gap": benchlib.summary_ms([g for r in rs for g in r.chunk_gaps()]),
            "tokens_per_message": benchlib.r(tokens / max(1, sum(r.chunks for r in rs)), 2),
            "failed_requests": len(failures),
            "cpu_us_per_token": cpu[k].us_per_token(tokens),
        }
    return out
