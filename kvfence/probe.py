"""The two-tenant canary isolation probe: the GLM-5.3 reproduction as an operator tool.

Against any running kvfence deployment (only the public API and two tenant API keys are used):

1. **baseline** — tenant B sends its probe prompts alone (greedy, ``ignore_eos``), one at a time,
   and records the outputs;
2. **load** — tenant A fills the cluster concurrently with prompts made of unique random canary
   token sequences (and, when the model takes text, canary text), long enough to hold many pages;
3. **under load** — while A's load runs, B sends the same probes again (they include prompts sized
   to page boundaries); **after load** — once more, when the free pages hold A's stale data;
4. **over-length** — B sends prompts at the advertised ``admissible_limit``: ``prompt + max_new ==
   limit + 1`` and far over must be rejected with INVALID_ARGUMENT, ``google.rpc.ErrorInfo``
   reason ``OVER_ADMISSIBLE_LIMIT``, before any token; ``== limit`` must not be rejected as
   over-length (RESOURCE_EXHAUSTED there is "not verified", a warning).

Checks: any n-gram (``ngram`` consecutive ids) of A's canaries in B's output ids, or any of A's
canary markers, any 8 hex digits of one, or the marker prefix, in B's text or error messages, is
a LEAK; an over-length request that is not rejected with INVALID_ARGUMENT and reason
``OVER_ADMISSIBLE_LIMIT`` is a FAILURE: accepted, another status (``wrong-status``) or another
reason (``wrong-reason``, e.g. ``OVER_TENANT_TOKEN_LIMIT`` or ``INVALID_PARAMETERS``). A refusal
for another reason shows nothing about the admissible limit, and the probe's own requests are
valid, so the server refused them for something it should not have: a failure, like a wrong
status, not "inconclusive" (which means no canary load was verified; run the probe with a tenant B
that has no per-request token limit). B's greedy
output under load that differs from its solo baseline is a DIVERGENCE, reported as a warning
(batching can change float rounding; an operator should look, but it does not prove a leak by
itself), or as a failure with ``fail_on_divergence`` (``--fail-on-divergence``: for deployments
whose outputs do not depend on the batch, where it is the likeliest sign of a leak that copies
nothing verbatim). ``ProbeReport.exit_code`` is 0 when clean, 1 on a leak, an over-length
acceptance or (so asked) a divergence, 2 when the probe could not run or verified nothing (no
canary request succeeded, or no B probe succeeded while A's requests were in flight: a probe that
failed while they were in flight verified nothing).

Canary ids are drawn from ``[id_low, id_high)`` (default ``[3, 250)``: past the usual specials and
inside any vocabulary worth serving); everything random comes from one seedable generator.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from kvfence.client import Client, ModelSummary, wrong_api
from kvfence.errors import (
    InvalidArgument,
    KvfenceError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)

EXIT_CLEAN = 0
EXIT_FAILED = 1
EXIT_ERROR = 2

PHASE_BASELINE = "baseline"
PHASE_UNDER_LOAD = "under-load"
PHASE_AFTER_LOAD = "after-load"
PHASE_AT_LIMIT = "at-limit"
PHASE_OVER_LENGTH = "over-length"

# The ErrorInfo reason of a refusal over the admissible limit: control_plane.admission's
# OVER_ADMISSIBLE_LIMIT (a copy: the probe needs only the public API, not the control plane).
OVER_ADMISSIBLE_LIMIT_REASON = "OVER_ADMISSIBLE_LIMIT"

_MARKER_PREFIX = "KVFCANARY"
MARKER_PIECE = 8  # hex digits of one of A's markers that, in B's text, count as a leak


class ProbeSetupError(Exception):
    """The probe cannot run (bad arguments, unreachable target, refused key): exit status 2."""


class ProgressSink(Protocol):
    """Where the probe reports progress (the CLI draws a rich progress bar)."""

    def start(self, total: int) -> None: ...

    def step(self, phase: str, n: int = 1) -> None: ...


class _NoProgress:
    def start(self, total: int) -> None:
        pass

    def step(self, phase: str, n: int = 1) -> None:
        pass


@dataclass(frozen=True)
class ProbeOptions:
    requests: int = 32  # tenant A canary requests
    concurrency: int = 8  # tenant A requests in flight
    probes: int = 4  # tenant B random-length probes (page-boundary probes come on top)
    probe_max_new: int = 16  # tokens B asks for per probe
    canary_max_new: int = 8  # tokens A asks for per canary request
    max_canary_tokens: int = 1024  # cap on one canary prompt (keeps the probe cheap on big models)
    under_load_rounds: int = 3  # at most this many B rounds while A's load runs
    timeout: float = 60.0  # deadline of every request, seconds
    seed: int | None = None  # None: a fresh random seed (reported, so a run can be repeated)
    id_low: int = 3
    id_high: int = 250
    ngram: int = 4
    text_canaries: bool = True
    # A B output under load that differs from its solo baseline fails the probe (exit 1). Off by
    # default: batching may change float rounding and so a greedy token on some hardware; on a
    # deployment whose outputs do not depend on the batch, a divergence is the likeliest sign of
    # a leak that copies nothing verbatim.
    fail_on_divergence: bool = False

    def validate(self) -> None:
        if self.requests < 1:
            raise ProbeSetupError("--requests must be at least 1")
        if self.concurrency < 1 or self.probes < 0 or self.under_load_rounds < 1:
            raise ProbeSetupError("concurrency and rounds must be at least 1")
        if self.timeout <= 0:
            raise ProbeSetupError("--timeout must be positive")
        if self.ngram < 2:
            raise ProbeSetupError("n-gram length must be at least 2")
        if self.probe_max_new < self.ngram:
            raise ProbeSetupError(f"probe_max_new must be at least the n-gram length {self.ngram}")
        if self.id_low < 0 or self.id_high - self.id_low < 16:
            raise ProbeSetupError("canary id range must hold at least 16 ids")


# ----------------------------------------------------------------------------------------------
# canaries and leak detection (pure functions)


def canary_ids(rng: random.Random, length: int, low: int, high: int) -> list[int]:
    """``length`` random ids in ``[low, high)`` with no id equal to its predecessor.

    No immediate repeats: a model stuck on one id cannot match a canary n-gram by accident.
    """
    out: list[int] = []
    for _ in range(length):
        x = rng.randrange(low, high - 1)
        if out and x >= out[-1]:
            x += 1  # uniform over the range minus the previous id
        out.append(x)
    return out


def canary_marker(rng: random.Random) -> str:
    """A unique text marker, e.g. ``KVFCANARY3f9a0c17d2e4b6a8``."""
    return f"{_MARKER_PREFIX}{rng.getrandbits(64):016x}"


def canary_text(marker: str, length: int) -> str:
    """A prompt of about ``length`` characters (never more) that repeats ``marker``."""
    unit = f"{marker} "
    text = (unit * (length // len(unit) + 1))[:length]
    return text if len(text) >= len(marker) else marker[: max(1, length)]


def ngrams(ids: Sequence[int], n: int) -> Iterable[tuple[int, ...]]:
    for i in range(len(ids) - n + 1):
        yield tuple(ids[i : i + n])


@dataclass
class CanaryIndex:
    """Every n-gram of tenant A's canary prompts (and A's text markers), for leak lookups."""

    n: int
    grams: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)
    markers: dict[str, int] = field(default_factory=dict)  # marker -> A request index
    excluded: set[tuple[int, ...]] = field(default_factory=set)

    def add_ids(self, request_index: int, ids: Sequence[int]) -> None:
        for off, gram in enumerate(ngrams(ids, self.n)):
            self.grams.setdefault(gram, (request_index, off))

    def add_marker(self, request_index: int, marker: str) -> None:
        self.markers[marker] = request_index

    def exclude(self, ids: Sequence[int]) -> None:
        """N-grams tenant B saw on its own (its prompts, its solo outputs) prove nothing."""
        self.excluded.update(ngrams(ids, self.n))

    def find_ids(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(offset in ids, A request index, offset in A's prompt)`` of every canary n-gram."""
        hits = []
        for off, gram in enumerate(ngrams(ids, self.n)):
            where = self.grams.get(gram)
            if where is not None and gram not in self.excluded:
                hits.append((off, *where))
        return hits

    def find_text(self, text: str) -> list[tuple[str, int]]:
        """``(evidence, A request index)`` of A's markers in ``text``: a whole marker, any
        ``MARKER_PIECE`` hex digits of one (KV read from A's pages rarely reproduces a whole
        prompt: a piece is as much a leak), or the marker prefix alone (index -1: which of A's
        prompts it came from is not known). Neither occurs in B's own text by chance."""
        hits = []
        for marker, i in self.markers.items():
            if marker in text:
                hits.append((marker, i))
                continue
            digits = marker[len(_MARKER_PREFIX) :]
            for k in range(len(digits) - MARKER_PIECE + 1):
                if digits[k : k + MARKER_PIECE] in text:
                    hits.append((digits[k : k + MARKER_PIECE], i))
                    break
        if not hits and _MARKER_PREFIX in text:
            hits.append((_MARKER_PREFIX, -1))
        return hits


# ----------------------------------------------------------------------------------------------
# results


@dataclass
class Leak:
    kind: str  # "token" | "text"
    phase: str
    probe: str
    request_id: str  # tenant B's request that received the data
    canary_request: int  # index of tenant A's request the data came from
    canary_request_id: str
    offset: int  # where in B's output ids (or text) it starts
    evidence: str


@dataclass
class OverLengthResult:
    name: str
    prompt_tokens: int
    max_new_tokens: int
    limit: int
    outcome: str  # "rejected" (pass) | "accepted" | "wrong-status" | "wrong-reason"
    status: str  # gRPC status name, "OK" when the request completed
    tokens_yielded: int
    message: str = ""
    reason: str = ""  # the error's google.rpc.ErrorInfo reason, "" when the request completed

    @property
    def ok(self) -> bool:
        return self.outcome == "rejected"


@dataclass
class AtLimitResult:
    prompt_tokens: int
    max_new_tokens: int
    outcome: str  # "accepted" | "not-verified" | "rejected-as-over-length" | "error" | "skipped"
    status: str
    tokens: int = 0
    message: str = ""


@dataclass
class Divergence:
    phase: str
    probe: str
    position: int  # first differing output index
    baseline: list[int]
    observed: list[int]


@dataclass
class ProbeReport:
    target: str
    model: str = ""
    admissible_limit: int = 0
    page_size: int = 0
    seed: int = 0
    canary_requests: int = 0
    canary_ok: int = 0
    canary_busy: int = 0  # RESOURCE_EXHAUSTED
    canary_errors: int = 0
    canary_text_requests: int = 0
    canary_tokens: int = 0
    probe_requests: int = 0  # tenant B, every phase
    probe_ok: int = 0
    probe_busy: int = 0
    probe_errors: dict[str, int] = field(default_factory=dict)  # status name -> count
    probes_under_load_ok: int = 0
    probes_overlapping_load: int = 0  # B probes that ran while A requests were in flight
    # ... and of those, the ones that succeeded: only these verify the live-sharing case (a
    # probe refused while A's load ran got no pages to read A's data from); the verdict uses these
    probes_overlapping_load_ok: int = 0
    under_load_rounds: int = 0
    compared: int = 0
    diverged: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    over_length: list[OverLengthResult] = field(default_factory=list)
    at_limit: AtLimitResult | None = None
    warnings: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    divergence_fails: bool = False  # ProbeOptions.fail_on_divergence

    @property
    def over_length_failures(self) -> list[OverLengthResult]:
        return [r for r in self.over_length if not r.ok]

    @property
    def inconclusive(self) -> bool:
        """Nothing was verified: no canary load landed, no B probe ran against it, or none
        succeeded while A's requests were in flight (the case of the incident: pages shared
        live). Probes that overlapped A's load but failed do not count: e.g. a deployment that
        refuses B whenever A is busy would otherwise pass on probes that ran only after A."""
        return (
            self.canary_ok == 0
            or self.probes_under_load_ok == 0
            or self.probes_overlapping_load_ok == 0
        )

    @property
    def verdict(self) -> str:
        if self.leaks:
            return "LEAK"
        if self.over_length_failures:
            return "FAIL"
        if self.divergence_fails and self.diverged:
            return "DIVERGED"
        if self.inconclusive:
            return "INCONCLUSIVE"
        if self.warnings:
            return "WARN"
        return "PASS"

    @property
    def exit_code(self) -> int:
        if self.leaks or self.over_length_failures:
            return EXIT_FAILED
        if self.divergence_fails and self.diverged:
            return EXIT_FAILED
        if self.inconclusive:
            return EXIT_ERROR
        return EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["divergences"] = out["divergences"][:10]
        out["leaks"] = out["leaks"][:100]  # every n-gram hit counts; a sample is evidence enough
        out.update(
            verdict=self.verdict,
            exit_code=self.exit_code,
            leak_count=len(self.leaks),
            leaked_requests=len({(leak.phase, leak.probe, leak.request_id) for leak in self.leaks}),
            over_length_probes=len(self.over_length),
            over_length_rejected=sum(r.ok for r in self.over_length),
            over_length_failures=len(self.over_length_failures),
        )
        return out


# ----------------------------------------------------------------------------------------------
# the probe


@dataclass
class _Probe:
    name: str
    ids: list[int]


@dataclass
class _Outcome:
    ids: list[int]
    text: str
    request_id: str
    error: KvfenceError | None = None


def _one_line(text: str) -> str:
    return " ".join(text.split())


class IsolationProbe:
    """Runs the probe (see the module docstring); ``run()`` returns a :class:`ProbeReport`.

    Raises :class:`ProbeSetupError` when it cannot start: same key twice, unreadable CA, target
    unreachable, a key refused, no model online.
    """

    def __init__(
        self,
        target: str,
        tenant_a_key: str,
        tenant_b_key: str,
        *,
        options: ProbeOptions | None = None,
        tls_ca: Path | str | None = None,
        tls_server_name: str | None = None,
        progress: ProgressSink | None = None,
    ):
        self.target = target
        self.tls_server_name = tls_server_name
        self.keys = (tenant_a_key, tenant_b_key)
        self.opts = options or ProbeOptions()
        self.tls_ca = tls_ca
        self.progress: ProgressSink = progress or _NoProgress()
        seed = self.opts.seed if self.opts.seed is not None else secrets.randbits(32)
        self.rng = random.Random(seed)
        self.report = ProbeReport(
            target=target, seed=seed, divergence_fails=self.opts.fail_on_divergence
        )
        self.index = CanaryIndex(self.opts.ngram)
        self._canary_request_ids: dict[int, str] = {}
        self._lock = threading.Lock()
        self._text_ok = self.opts.text_canaries
        self._a_in_flight = 0

    # -- setup ----------------------------------------------------------------------------------

    def _clients(self) -> tuple[Client, Client]:
        try:
            a, b = (
                Client(
                    self.target,
                    key,
                    tls_ca=self.tls_ca,
                    tls_server_name=self.tls_server_name,
                    timeout=self.opts.timeout,
                )
                for key in self.keys
            )
        except (OSError, ValueError) as err:  # TlsError is a ValueError or OSError subclass
            raise ProbeSetupError(_one_line(str(err))) from None
        return a, b

    def _discover(self, a: Client, b: Client) -> ModelSummary:
        models: list[ModelSummary] = []
        for who, client in (("tenant A", a), ("tenant B", b)):
            try:
                models = client.list_models()
            except (Unauthenticated, PermissionDenied) as err:
                raise ProbeSetupError(
                    f"{who} key refused by {self.target}: {err.code.name}: {_one_line(err.message)}"
                ) from None
            except KvfenceError as err:
                if err.code == grpc.StatusCode.UNIMPLEMENTED:  # the admin port, say
                    raise ProbeSetupError(wrong_api(self.target, "public")) from None
                raise ProbeSetupError(
                    f"cannot reach {self.target}: {err.code.name}: {_one_line(err.message)}"
                ) from None
        online = [m for m in models if m.online]
        if not online:
            raise ProbeSetupError(f"{self.target} serves no online model")
        if len(online) > 1:
            self.report.warnings.append(
                f"{len(online)} models online; requests go to the cluster default, limits are "
                f"taken from {online[0].name}"
            )
        model = online[0]
        if model.admissible_limit < 2:
            raise ProbeSetupError(f"model {model.name} advertises admissible_limit 0")
        return model

    # -- plan -----------------------------------------------------------------------------------

    def _probe_set(self, limit: int, page: int, max_new: int) -> list[_Probe]:
        """B's probes: random lengths plus lengths on page boundaries (of the prompt and of
        ``prompt + max_new``, which is what decode reserves)."""
        room = limit - max_new
        lo, hi = self.opts.id_low, self.opts.id_high
        lengths: dict[str, int] = {}
        for k in range(self.opts.probes):
            lengths[f"random-{k}"] = self.rng.randint(1, max(1, min(room, 4 * page)))
        boundary = {
            "page-1": page - 1,
            "page": page,
            "page+1": page + 1,
            "2pages": 2 * page,
            "reserve=3pages": 3 * page - max_new,
            "reserve=3pages+1": 3 * page - max_new + 1,
            "4pages+1": 4 * page + 1,
        }
        for name, n in boundary.items():
            if 1 <= n <= room and n not in lengths.values():
                lengths[name] = n
        probes = [_Probe(name, canary_ids(self.rng, n, lo, hi)) for name, n in lengths.items()]
        for p in probes:
            self.index.exclude(p.ids)
        return probes

    def _canary_plan(self, limit: int, page: int) -> list[tuple[list[int] | None, str | None]]:
        """Per A request: prompt ids, or canary text (every fourth request, when enabled)."""
        # several requests in flight at once, each spanning many pages
        room = limit - self.opts.canary_max_new
        hi = max(1, min(room, self.opts.max_canary_tokens, limit // 2))
        lo = max(1, min(hi, max(2 * page, hi // 4)))
        plan: list[tuple[list[int] | None, str | None]] = []
        for i in range(self.opts.requests):
            n = self.rng.randint(lo, hi)
            if self._text_ok and i % 4 == 3:
                marker = canary_marker(self.rng)
                self.index.add_marker(i, marker)
                # one token per character at most for byte-level tokenizers: never over the limit
                plan.append((None, canary_text(marker, max(n, len(marker) + 1))))
            else:
                ids = canary_ids(self.rng, n, self.opts.id_low, self.opts.id_high)
                self.index.add_ids(i, ids)
                plan.append((ids, None))
        return plan

    # -- requests -------------------------------------------------------------------------------

    def _generate(
        self, client: Client, ids: list[int] | None, text: str | None, max_new: int
    ) -> _Outcome:
        out_ids: list[int] = []
        out_text: list[str] = []
        rid = ""
        try:
            for chunk in client.stream(
                text, prompt_ids=ids, max_new_tokens=max_new, temperature=0.0, ignore_eos=True
            ):
                rid = chunk.request_id or rid
                out_ids.extend(chunk.token_ids)
                out_text.append(chunk.text)
        except KvfenceError as err:
            return _Outcome(out_ids, "".join(out_text), rid, err)
        return _Outcome(out_ids, "".join(out_text), rid)

    def _record_b(self, outcome: _Outcome) -> None:
        with self._lock:
            self.report.probe_requests += 1
            if outcome.error is None:
                self.report.probe_ok += 1
            elif isinstance(outcome.error, ResourceExhausted):
                self.report.probe_busy += 1
            else:
                name = outcome.error.code.name
                self.report.probe_errors[name] = self.report.probe_errors.get(name, 0) + 1

    def _scan(self, phase: str, probe: str, outcome: _Outcome) -> None:
        """Look for A's canaries in what B received: ids, text and error message."""
        found: list[Leak] = []
        for off, a_idx, a_off in self.index.find_ids(outcome.ids):
            gram = outcome.ids[off : off + self.index.n]
            found.append(
                Leak(
                    "token",
                    phase,
                    probe,
                    outcome.request_id,
                    a_idx,
                    self._canary_request_ids.get(a_idx, ""),
                    off,
                    f"ids {gram} = tenant A prompt {a_idx} at offset {a_off}",
                )
            )
        texts = [outcome.text]
        if outcome.error is not None:
            texts.append(outcome.error.message)
        for text in texts:
            for marker, a_idx in self.index.find_text(text):
                found.append(
                    Leak(
                        "text",
                        phase,
                        probe,
                        outcome.request_id,
                        a_idx,
                        self._canary_request_ids.get(a_idx, ""),
                        text.find(marker),
                        f"text {marker!r} of tenant A's markers"
                        + (f" (prompt {a_idx})" if a_idx >= 0 else ""),
                    )
                )
        if found:
            with self._lock:
                self.report.leaks.extend(found)

    def _compare(self, phase: str, probe: _Probe, baseline: _Outcome, now: _Outcome) -> None:
        if baseline.error is not None or now.error is not None:
            return
        with self._lock:
            self.report.compared += 1
            if now.ids == baseline.ids:
                return
            self.report.diverged += 1
            pos = next(
                (i for i, (x, y) in enumerate(zip(baseline.ids, now.ids, strict=False)) if x != y),
                min(len(baseline.ids), len(now.ids)),
            )
            self.report.divergences.append(
                Divergence(phase, probe.name, pos, list(baseline.ids), list(now.ids))
            )

    def _canary(self, client: Client, i: int, ids: list[int] | None, text: str | None) -> None:
        if text is not None and not self._text_ok:
            # the model refused text earlier: send random ids of the same length instead
            ids = canary_ids(
                random.Random(f"{self.report.seed}/{i}"),
                len(text),
                self.opts.id_low,
                self.opts.id_high,
            )
            self.index.add_ids(i, ids)
            text = None
        with self._lock:
            self._a_in_flight += 1
        try:
            outcome = self._generate(client, ids, text, self.opts.canary_max_new)
        finally:
            with self._lock:
                self._a_in_flight -= 1
        if (
            text is not None
            and isinstance(outcome.error, InvalidArgument)
            and "limit" not in outcome.error.message
        ):
            self._text_ok = False  # e.g. a model served without a tokenizer
        with self._lock:
            self._canary_request_ids[i] = outcome.request_id
            self.report.canary_requests += 1
            self.report.canary_text_requests += text is not None
            if outcome.error is None:
                self.report.canary_ok += 1
                self.report.canary_tokens += len(ids) if ids is not None else len(text or "")
            elif isinstance(outcome.error, ResourceExhausted):
                self.report.canary_busy += 1
            else:
                self.report.canary_errors += 1
        self.progress.step("tenant A canary load")

    def _round(
        self,
        pool: ThreadPoolExecutor,
        client: Client,
        phase: str,
        probes: list[_Probe],
        baseline: dict[str, _Outcome],
        max_new: int,
    ) -> int:
        """B sends every probe once (concurrently); returns how many completed."""

        def call(probe: _Probe) -> tuple[_Outcome, bool]:
            busy = self._a_in_flight > 0
            outcome = self._generate(client, probe.ids, None, max_new)
            return outcome, busy or self._a_in_flight > 0

        futures = {pool.submit(call, p): p for p in probes}
        ok = 0
        for fut, probe in futures.items():
            outcome, overlapped = fut.result()
            if overlapped and phase == PHASE_UNDER_LOAD:
                with self._lock:
                    self.report.probes_overlapping_load += 1
                    self.report.probes_overlapping_load_ok += outcome.error is None
            self._record_b(outcome)
            self._scan(phase, probe.name, outcome)
            self._compare(phase, probe, baseline[probe.name], outcome)
            ok += outcome.error is None
            self.progress.step(f"tenant B {phase}")
        return ok

    def _over_length(
        self, client: Client, name: str, prompt: int, max_new: int, limit: int
    ) -> None:
        ids = canary_ids(self.rng, prompt, self.opts.id_low, self.opts.id_high)
        got: list[int] = []
        text: list[str] = []
        rid = ""
        status = "OK"
        message = ""
        reason = ""
        err: KvfenceError | None = None
        try:
            for chunk in client.stream(
                prompt_ids=ids, max_new_tokens=max_new, temperature=0.0, ignore_eos=True
            ):
                rid = chunk.request_id or rid
                got.extend(chunk.token_ids)
                text.append(chunk.text)
                if len(got) >= self.opts.probe_max_new:
                    break  # accepted: enough to show it, and to scan for a leak
        except KvfenceError as e:
            err = e
            status, message, reason = e.code.name, _one_line(e.message), e.reason
        if err is None or got:
            outcome = "accepted"
        elif not isinstance(err, InvalidArgument):
            outcome = "wrong-status"
        elif err.reason != OVER_ADMISSIBLE_LIMIT_REASON:
            outcome = "wrong-reason"  # refused, but not as over the admissible limit
        else:
            outcome = "rejected"
        self._scan(PHASE_OVER_LENGTH, name, _Outcome(got, "".join(text), rid, err))
        self.report.over_length.append(
            OverLengthResult(
                name, prompt, max_new, limit, outcome, status, len(got), message, reason
            )
        )
        self.progress.step("tenant B over-length")

    def _at_limit(self, client: Client, limit: int, max_new: int) -> None:
        prompt = limit - max_new
        ids = canary_ids(self.rng, prompt, self.opts.id_low, self.opts.id_high)
        outcome = self._generate(client, ids, None, max_new)
        self._record_b(outcome)
        self._scan(PHASE_AT_LIMIT, "at-limit", outcome)
        err = outcome.error
        if err is None:
            res = AtLimitResult(prompt, max_new, "accepted", "OK", len(outcome.ids))
        elif isinstance(err, ResourceExhausted):
            res = AtLimitResult(
                prompt, max_new, "not-verified", err.code.name, 0, _one_line(err.message)
            )
            self.report.warnings.append(
                f"at-limit request ({prompt} + {max_new} = {limit}) not verified: "
                f"RESOURCE_EXHAUSTED: {_one_line(err.message)}"
            )
        elif isinstance(err, InvalidArgument):
            res = AtLimitResult(
                prompt, max_new, "rejected-as-over-length", err.code.name, 0, _one_line(err.message)
            )
            self.report.warnings.append(
                f"the advertised admissible_limit {limit} is not accepted: a request of exactly "
                f"{limit} tokens got INVALID_ARGUMENT: {_one_line(err.message)}"
            )
        else:
            res = AtLimitResult(prompt, max_new, "error", err.code.name, 0, _one_line(err.message))
            self.report.warnings.append(
                f"at-limit request failed: {err.code.name}: {_one_line(err.message)}"
            )
        self.report.at_limit = res
        self.progress.step("tenant B at limit")

    # -- run ------------------------------------------------------------------------------------

    def run(self) -> ProbeReport:
        self.opts.validate()
        if self.keys[0] == self.keys[1]:
            raise ProbeSetupError("tenant A and tenant B keys are the same; use two tenants")
        started = time.monotonic()
        a, b = self._clients()
        try:
            model = self._discover(a, b)
            self._run(a, b, model)
        finally:
            a.close()
            b.close()
        self.report.duration_s = round(time.monotonic() - started, 2)
        return self.report

    def _run(self, a: Client, b: Client, model: ModelSummary) -> None:
        opts, rep = self.opts, self.report
        limit, page = model.admissible_limit, model.page_size or 16
        rep.model, rep.admissible_limit, rep.page_size = model.name, limit, page
        max_new = max(1, min(opts.probe_max_new, limit // 4))
        if max_new < opts.ngram:
            rep.warnings.append(f"limit {limit} too small for {opts.ngram}-gram token checks")
        probes = self._probe_set(limit, page, max_new)
        plan = self._canary_plan(limit, page)
        n_over = 4
        self.progress.start(
            len(probes) * (2 + opts.under_load_rounds) + len(plan) + n_over + 1  # +1: at limit
        )

        # (1) baseline: B alone, one probe at a time
        baseline: dict[str, _Outcome] = {}
        for p in probes:
            outcome = self._generate(b, p.ids, None, max_new)
            self._record_b(outcome)
            self._scan(PHASE_BASELINE, p.name, outcome)
            if outcome.error is None:
                self.index.exclude(outcome.ids)
            baseline[p.name] = outcome
            self.progress.step(f"tenant B {PHASE_BASELINE}")
        failed = [o.error for o in baseline.values() if o.error is not None]
        if failed:
            rep.warnings.append(
                f"{len(failed)} of {len(probes)} baseline probes failed "
                f"(first: {failed[0].code.name}: {_one_line(failed[0].message)}); "
                "they are not compared"
            )

        # (2) + (3) A's load, B's probes while it runs
        with ThreadPoolExecutor(opts.concurrency, thread_name_prefix="probe-a") as a_pool:
            first_done = threading.Event()
            load: list[Future[None]] = []
            for i, (ids, text) in enumerate(plan):
                fut = a_pool.submit(self._canary, a, i, ids, text)
                fut.add_done_callback(lambda _f: first_done.set())
                load.append(fut)
            # the first finished canary request has written and freed pages: probe from then on
            first_done.wait(timeout=opts.timeout)
            with ThreadPoolExecutor(
                max(1, min(4, len(probes))), thread_name_prefix="probe-b"
            ) as b_pool:
                rounds = 0
                while rounds < opts.under_load_rounds:
                    rep.probes_under_load_ok += self._round(
                        b_pool, b, PHASE_UNDER_LOAD, probes, baseline, max_new
                    )
                    rounds += 1
                    if all(f.done() for f in load):
                        break
                rep.under_load_rounds = rounds
                self.progress.step(
                    "tenant B under-load", len(probes) * (opts.under_load_rounds - rounds)
                )
                for f in load:
                    f.result()
                # (3b) A's data now sits in freed pages: what the GLM-5.3 incident read
                self._round(b_pool, b, PHASE_AFTER_LOAD, probes, baseline, max_new)

        # (4) over-length probes at the advertised limit, then exactly at the limit
        small = max(1, min(page, limit // 2))
        self._over_length(b, "prompt+max_new=limit+1", limit + 1 - max_new, max_new, limit)
        self._over_length(b, "max_new=limit+1-prompt", small, limit + 1 - small, limit)
        self._over_length(b, "prompt=2*limit", 2 * limit, max_new, limit)
        self._over_length(b, "max_new=4*limit", small, 4 * limit, limit)
        self._at_limit(b, limit, max_new)
        self._summarize()

    def _summarize(self) -> None:
        rep = self.report
        if rep.diverged:
            rep.warnings.append(
                f"DIVERGENCE: {rep.diverged} of {rep.compared} probe outputs under load differ "
                "from the solo baseline (not a leak by itself; worth a look)"
            )
        if rep.canary_ok == 0:
            rep.warnings.append(
                f"no tenant A canary request succeeded ({rep.canary_busy} busy, "
                f"{rep.canary_errors} failed): isolation not verified"
            )
        if rep.canary_ok and rep.probes_overlapping_load and not rep.probes_overlapping_load_ok:
            rep.warnings.append(
                f"all {rep.probes_overlapping_load} tenant B probes that ran while tenant A's "
                "requests were in flight failed (see probe_errors): inconclusive"
            )
        elif rep.canary_ok and rep.probes_under_load_ok and not rep.probes_overlapping_load:
            rep.warnings.append(
                "tenant A's load ended before tenant B's probes ran (only the after-load check "
                "saw A's data in freed pages): inconclusive; raise --requests"
            )
        if rep.canary_busy:
            rep.warnings.append(f"{rep.canary_busy} tenant A requests got RESOURCE_EXHAUSTED")
        if rep.probe_busy:
            rep.warnings.append(f"{rep.probe_busy} tenant B requests got RESOURCE_EXHAUSTED")
        integrity = rep.probe_errors.get(grpc.StatusCode.DATA_LOSS.name, 0)
        if integrity:
            rep.warnings.append(
                f"{integrity} tenant B requests failed with DATA_LOSS (the server caught corrupt "
                "KV and refused it; see its security events)"
            )


def run_isolation_probe(
    target: str,
    tenant_a_key: str,
    tenant_b_key: str,
    *,
    options: ProbeOptions | None = None,
    tls_ca: Path | str | None = None,
    tls_server_name: str | None = None,
    progress: ProgressSink | None = None,
) -> ProbeReport:
    """Run the probe once; see :class:`IsolationProbe`."""
    return IsolationProbe(
        target,
        tenant_a_key,
        tenant_b_key,
        options=options,
        tls_ca=tls_ca,
        tls_server_name=tls_server_name,
        progress=progress,
    ).run()


__all__ = [
    "EXIT_CLEAN",
    "EXIT_ERROR",
    "EXIT_FAILED",
    "OVER_ADMISSIBLE_LIMIT_REASON",
    "CanaryIndex",
    "IsolationProbe",
    "Leak",
    "OverLengthResult",
    "ProbeOptions",
    "ProbeReport",
    "ProbeSetupError",
    "ProgressSink",
    "canary_ids",
    "canary_marker",
    "canary_text",
    "run_isolation_probe",
]
