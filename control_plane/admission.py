"""Admission: parameter checks, the admissible limit, tenant limits and the bounded wait queue.

Everything here runs before any node is contacted. The limit is what the incident lacked: a
request whose prompt plus new tokens does not fit in every pool that could serve it is refused
here, with the numbers, instead of being truncated or replaced by a placeholder downstream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import secrets
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from control_plane.model_info import ModelInfo
from control_plane.tenants import Tenant
from kvfence.errors import INVALID_PARAMETERS, InvalidArgument, ResourceExhausted
from kvfence.proto.kvfence.v1 import client_pb2, common_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

# ErrorInfo reasons (and admission_rejections_total labels) of admission refusals; and
# INVALID_PARAMETERS (kvfence.errors, which the client shares).
OVER_ADMISSIBLE_LIMIT = "OVER_ADMISSIBLE_LIMIT"
OVER_TENANT_TOKEN_LIMIT = "OVER_TENANT_TOKEN_LIMIT"
TENANT_CONCURRENCY = "TENANT_CONCURRENCY"
QUEUE_FULL = "QUEUE_FULL"
NO_CAPACITY = "NO_CAPACITY"


@dataclass(frozen=True)
class Prompt:
    """A validated request: prompt token ids and the sampling parameters the nodes get."""

    token_ids: list[int]
    sampling: common_pb2.SamplingParams

    @property
    def total_tokens(self) -> int:
        return len(self.token_ids) + self.sampling.max_new_tokens


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=INVALID_PARAMETERS)


def check_parameters(req: client_pb2.GenerateRequest, model: ModelInfo) -> None:
    """Everything :func:`validate` checks that needs no tokenizer: the model, the sampling
    parameters, the stop strings, and a prompt that is empty or holds ids outside the vocabulary.
    The pipeline runs it before the tenant's concurrency limit, so a request that can never be
    served is refused INVALID_ARGUMENT, not a retryable RESOURCE_EXHAUSTED."""
    if req.model and req.model != model.name:
        raise _invalid(f"unknown model {req.model!r}; this cluster serves {model.name!r}")
    if req.max_new_tokens < 1:
        raise _invalid(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
    # Refuses NaN too; and infinity, which would sample every token alike, specials included:
    # no caller means that, and a finite temperature that high says so plainly.
    if not (req.temperature >= 0 and math.isfinite(req.temperature)):
        raise _invalid(f"temperature must be >= 0 and finite, got {req.temperature}")
    if not 0 <= req.top_p <= 1:
        raise _invalid(f"top_p must be in [0, 1], got {req.top_p}")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in req.stop):
        raise _invalid(f"stop strings must be 1-{MAX_STOP_CHARS} characters long")
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        ids = req.token_ids.ids
        bad = [i for i in ids if i >= model.vocab_size]
        if bad:
            raise _invalid(
                f"{len(bad)} prompt token ids are >= the vocabulary size {model.vocab_size} "
                f"(first: {bad[0]})"
            )
        if not ids:
            raise _invalid("the prompt is empty")
    elif kind != "text" or not req.text:
        raise _invalid("the prompt is empty")


def validate(
    req: client_pb2.GenerateRequest, model: ModelInfo, text_ids: list[int] | None = None
) -> Prompt:
    """Check the parameters (:func:`check_parameters`) and tokenize (unless the caller did:
    ``text_ids``); raises InvalidArgument naming the bad field."""
    check_parameters(req, model)
    if req.WhichOneof("prompt") == "text":
        ids = text_ids if text_ids is not None else model.tokenizer.encode(req.text)
    else:
        ids = list(req.token_ids.ids)
    if not ids:  # a text that tokenizes to nothing
        raise _invalid("the prompt is empty")
    sampling = common_pb2.SamplingParams(
        max_new_tokens=req.max_new_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=list(req.stop),
        ignore_eos=req.ignore_eos,
    )
    if req.HasField("seed"):
        sampling.seed = req.seed
    elif req.temperature > 0:
        # Prefill draws the first token and decode the rest: both need the same seed, and
        # the request enters here, so a sampled request without one gets one here.
        sampling.seed = secrets.randbits(64)
    return Prompt(ids, sampling)


def prompt_tokens_at_least(
    req: client_pb2.GenerateRequest, model: ModelInfo
) -> tuple[int, str] | None:
    """A lower bound on the prompt's tokens known before tokenizing, with how it was found ("" when
    exact), or None (no prompt, or a tokenizer without a bound).

    The control plane tokenizes on behalf of the event loop that every tenant's requests and the
    nodes' heartbeats share: one prompt of megabytes held it for seconds (nodes were declared
    lost). A list of ids is as long as it is; a text of B bytes is at least B /
    ``max_text_bytes_per_token`` tokens. When that plus max_new_tokens is over the limit, no
    tokenizing can make it fit, and :func:`check_limit` refuses it first.
    """
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        return len(req.token_ids.ids), ""
    if kind != "text":
        return None
    per = getattr(model.tokenizer, "max_text_bytes_per_token", None)
    if not per:
        return None
    nbytes = len(req.text.encode("utf-8"))
    return -(-nbytes // per), f"a text of {nbytes} bytes; one token stands for at most {per}"


def check_limit(
    prompt_tokens: int, max_new_tokens: int, limit: int, context_window: int, bound: str = ""
) -> None:
    """Refuse a request that can never fit: prompt + max_new_tokens over the admissible limit.
    ``bound`` (from :func:`prompt_tokens_at_least`) says the prompt count is a lower bound."""
    p, m = prompt_tokens, max(max_new_tokens, 0)
    if p + m <= limit:
        return
    at_least = "at least " if bound else ""
    how = f": {bound}" if bound else ""
    raise InvalidArgument(
        f"prompt_tokens ({at_least}{p}{how}) + max_new_tokens ({m}) = {at_least}{p + m} exceeds "
        f"the admissible limit of {limit} tokens (model context window {context_window}, "
        f"smallest KV pool of the nodes serving it included)",
        reason=OVER_ADMISSIBLE_LIMIT,
        metadata={
            "prompt_tokens": str(p),
            "max_new_tokens": str(m),
            "admissible_limit": str(limit),
            "context_window": str(context_window),
        },
    )


def over_tenant_tokens(
    tenant: Tenant, total: int, when: str = "", *, bound: str = ""
) -> InvalidArgument | None:
    """The refusal of a request of ``total`` tokens (prompt + max_new) over the tenant's tokens
    per request (``when``: said after the limit), else None. ``bound`` (from
    :func:`prompt_tokens_at_least`) says ``total`` is a lower bound, and how it was found."""
    limit = tenant.limits.max_tokens_per_request
    if not limit or total <= limit:
        return None
    at_least = "at least " if bound else ""
    how = f" ({bound})" if bound else ""
    return InvalidArgument(
        f"prompt_tokens + max_new_tokens = {at_least}{total}{how} exceeds tenant "
        f"{tenant.name}'s limit of {limit} tokens per request{when}",
        reason=OVER_TENANT_TOKEN_LIMIT,
    )


def check_tenant(tenant: Tenant, total_tokens: int, active_requests: int, bound: str = "") -> None:
    """The tenant's own limits: tokens per request (never fits) and concurrency (not now).

    ``total_tokens`` is prompt + max_new_tokens; ``bound`` says it is a lower bound (before
    tokenizing, from :func:`prompt_tokens_at_least`), which refuses only what can never fit.
    ``active_requests``: the tenant's other live requests."""
    limits = tenant.limits
    too_long = over_tenant_tokens(tenant, total_tokens, bound=bound)
    if too_long is not None:
        raise too_long
    if limits.max_concurrent_requests and active_requests >= limits.max_concurrent_requests:
        raise ResourceExhausted(
            f"tenant {tenant.name} already has {active_requests} requests in flight "
            f"(limit {limits.max_concurrent_requests})",
            reason=TENANT_CONCURRENCY,
        )


class AdmissionQueue:
    """Requests waiting for decode capacity: bounded, tenants served in turn.

    Only the request at the head of the queue may try to reserve, and a newcomer queues behind
    it. Without that, a stream of small requests can keep taking the pages a large one waits for
    until its deadline passes (starvation). Every change of capacity or model access wakes the
    waiters; the head retries, the others check whether they are now the head.

    The head is the oldest request of the tenant whose turn it is. When it leaves (it reserved,
    failed or gave up), its tenant goes to the back of the turn order if it still has requests
    waiting, and the next tenant's oldest request becomes the head. First come first served
    across tenants would make one tenant's burst of 64 requests a wait of 64 reservations for
    every other tenant's next request; in turn, another tenant waits for at most one request of
    each tenant ahead of it. Within a tenant, requests are served in the order they came.

    One tenant may hold at most ``per_tenant`` places: without that bound, a tenant with no
    concurrency limit could fill the queue with long-deadline requests and every other tenant
    would be refused QUEUE_FULL until they expired.
    """

    def __init__(self, capacity: int, per_tenant: int | None = None):
        self.capacity = capacity
        self.per_tenant = capacity if per_tenant is None else min(per_tenant, capacity)
        # Tenants with requests waiting, in turn order (dicts keep insertion order): the first
        # one's oldest request is the head. No entry for a tenant that waits no more.
        self._turns: dict[str, collections.deque[object]] = {}
        self._waiting = 0
        self._changed = asyncio.Event()

    @property
    def waiting(self) -> int:
        return self._waiting

    def notify(self) -> None:
        """Wake every waiter (pages freed, node joined, model access changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def may_try(self, ticket: object) -> bool:
        """True when ``ticket`` may try to reserve now: nobody waits, or it heads the queue."""
        if not self._turns:
            return True
        return next(iter(self._turns.values()))[0] is ticket

    def waiting_for(self, tenant: str) -> int:
        queued = self._turns.get(tenant)
        return 0 if queued is None else len(queued)

    @contextlib.contextmanager
    def slot(self, ticket: object, tenant: str) -> Iterator[None]:
        """Hold a queue place for the block; ResourceExhausted at once when the queue, or the
        tenant's share of it, is full. The message tells a tenant its own count only."""
        if self.waiting_for(tenant) >= self.per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant} already has {self.waiting_for(tenant)} requests waiting for "
                f"capacity (at most {self.per_tenant})",
                reason=QUEUE_FULL,
            )
        if self._waiting >= self.capacity:
            raise ResourceExhausted(
                "the admission queue is full: no capacity for now, retry later", reason=QUEUE_FULL
            )
        self._turns.setdefault(tenant, collections.deque()).append(ticket)
        self._waiting += 1
        try:
            yield
        finally:
            self._leave(ticket, tenant)
            self.notify()  # the next request may now head the queue

    def _leave(self, ticket: object, tenant: str) -> None:
        queued = self._turns[tenant]
        was_head = queued[0] is ticket and next(iter(self._turns)) == tenant
        queued.remove(ticket)
        self._waiting -= 1
        if not queued:
            del self._turns[tenant]
        elif was_head:  # its turn is over: to the back, behind every other waiting tenant
            self._turns[tenant] = self._turns.pop(tenant)

    def changed(self, timeout: float) -> Coroutine[Any, Any, None]:
        """Return at the next notify() or after ``timeout`` seconds, whichever comes first.

        "Next" counts from this call, not from when the coroutine first runs: a caller that
        decides to wait wraps it in a task (``Run.guard``), which starts an iteration later, and a
        notify() in between (the waiters woken with it leaving and re-queueing) must not be lost.
        It was: every waiter then slept out its whole timeout (a heartbeat interval) with the head
        free to reserve."""
        return _wait_for_event(self._changed, timeout)


async def _wait_for_event(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), max(0.0, timeout))
