"""KV page transfer from prefill to decode over UCX (TCP on loopback here, RDMA where available).

One UCX endpoint per transfer. The wire, in order::

    prefill -> decode   HELLO {reservation_id, request_id, auth}        auth = HMAC(secret,
    reservation)
    decode  -> prefill  {ok} | {ok: false, error}                       unknown/bad auth: dropped
    repeat:
      prefill -> decode BATCH {indices: [i, ...]}                       at most max_batch_bytes of
      pages decode posts one tagged receive per page straight into reserved page ``pages[i]``
      prefill -> decode the pages, tag PAGE_TAG + k
      decode  -> prefill {ok} once every receive of the batch completed (per-batch timeout)
    prefill -> decode   BATCH {done: true};   decode -> prefill {ok}

The receiver decides where bytes land: a sender names only an index into *its* reservation's prompt
pages, so a sender bug can at worst leave a reserved page unwritten or wrongly written — which the
manifest's coverage and checksum checks catch. Every posted receive is counted as an outstanding
operation on its page in the pool; the first error aborts the endpoint, which cancels all posted
receives, and only when they have settled are the operations ended (a released page stays
QUARANTINED until then).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from kvfence import logging as kvlog
from kvfence.kv.pool import PagePool, PageRef, PageState

LEN_TAG = 1
BODY_TAG = 2
REPLY_LEN_TAG = 3
REPLY_BODY_TAG = 4
PAGE_TAG = 1 << 20
LINGER_TAG = 99  # never sent: a receive on it ends when the peer closes
MAX_CONTROL_BYTES = 1 << 20

log = kvlog.get_logger("transfer")


# Reasons that mean the bytes or the protocol were wrong (not merely slow or lost): DATA_LOSS.
INTEGRITY_REASONS = frozenset(
    {"DUPLICATE_PAGE", "COVERAGE", "PROTOCOL", "BAD_AUTHENTICATOR", "REPLAY", "UNKNOWN_RESERVATION"}
)


class TransferError(Exception):
    """A transfer that did not complete; ``reason`` is a short machine-readable cause."""

    def __init__(self, message: str, reason: str = "TRANSFER_FAILED", timeout: bool = False):
        super().__init__(message)
        self.reason = reason
        self.timeout = timeout


def authenticator(secret: bytes, reservation_id: str) -> str:
    return hmac.new(
        secret, b"kvfence-ucx-hello|" + reservation_id.encode(), hashlib.sha256
    ).hexdigest()


def page_buffer(t: torch.Tensor) -> Any:
    """A UCX-sendable view of one contiguous page (numpy on CPU, the CUDA tensor on GPU)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


async def _within(ep: Any, aws: list[Any], timeout: float | None) -> list[Any]:
    """Await UCX operations with a timeout, never abandoning one that is still posted.

    A UCX request writes into (or reads from) its buffer until it completes. Cancelling only the
    asyncio side would let the buffer be freed while the transfer can still land in it, so on a
    timeout, an error or our own cancellation the endpoint is aborted first (which completes every
    posted request) and the requests are awaited before their buffers can go away.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            raise TransferError("timed out", "TIMEOUT", timeout=True)
        return [t.result() for t in tasks]
    finally:
        await _settle(ep, tasks)


async def _settle(ep: Any, tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Abort the endpoint if any operation is pending or failed, then wait until every one has
    completed, even if we are cancelled meanwhile (re-raised afterwards)."""
    if any(not t.done() or (not t.cancelled() and t.exception()) for t in tasks):
        with contextlib.suppress(Exception):
            ep.abort()
    cancelled = False
    while not all(t.done() for t in tasks):
        try:
            await asyncio.shield(asyncio.wait(tasks))
        except asyncio.CancelledError:
            cancelled = True
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: the caller sees the first error only
    if cancelled:
        raise asyncio.CancelledError


async def _send_json(ep: Any, obj: dict[str, Any], *, reply: bool = False) -> None:
    body = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    size = np.array([body.size], dtype=np.int64)
    await _within(
        ep,
        [
            ep.send(size, tag=REPLY_LEN_TAG if reply else LEN_TAG),
            ep.send(body, tag=REPLY_BODY_TAG if reply else BODY_TAG),
        ],
        None,
    )


async def _recv_json(ep: Any, *, reply: bool = False) -> dict[str, Any]:
    size = np.empty(1, dtype=np.int64)
    await ep.recv(size, tag=REPLY_LEN_TAG if reply else LEN_TAG)
    n = int(size[0])
    if not 0 < n <= MAX_CONTROL_BYTES:
        raise TransferError(f"control message of {n} bytes", reason="PROTOCOL")
    body = np.empty(n, dtype=np.uint8)
    await ep.recv(body, tag=REPLY_BODY_TAG if reply else BODY_TAG)
    obj = json.loads(body.tobytes())
    if not isinstance(obj, dict):
        raise TransferError("control message is not an object", reason="PROTOCOL")
    return obj


class InboundState(Enum):
    EXPECTING = "expecting"
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class InboundTransfer:
    """Decode's view of one reservation's incoming pages."""

    reservation_id: str
    request_id: str
    secret: bytes
    pages: list[PageRef]  # the prompt pages, in order (index i lands in pages[i])
    state: InboundState = InboundState.EXPECTING
    received: list[int] = field(default_factory=list)
    error: str = ""
    bytes_received: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ep: Any = None
    task: asyncio.Task[None] | None = None


Reporter = Callable[[str, dict[str, Any]], None]


class KvReceiver:
    """Decode's UCX listener: receives pages straight into reserved page buffers."""

    def __init__(
        self,
        pool: PagePool,
        *,
        host: str,
        port: int = 0,
        max_batch_bytes: int,
        batch_timeout_s: float,
        report: Reporter,
    ):
        self.pool = pool
        self.host = host
        self.port = port
        self.max_batch_bytes = max_batch_bytes
        self.batch_timeout_s = batch_timeout_s
        self.report = report
        self.transfers: dict[str, InboundTransfer] = {}
        self._listener: Any = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        import ucxx

        self._listener = ucxx.create_listener(self._on_connect, port=self.port)
        self.port = self._listener.port

    async def stop(self) -> None:
        for t in list(self.transfers.values()):
            self.cancel(t.reservation_id)
        for task in list(self._handlers):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 5)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def expect(
        self, reservation_id: str, request_id: str, secret: bytes, pages: Sequence[PageRef]
    ) -> InboundTransfer:
        t = InboundTransfer(reservation_id, request_id, secret, list(pages))
        self.transfers[reservation_id] = t
        return t

    def cancel(self, reservation_id: str) -> InboundTransfer | None:
        """Stop a transfer: abort its endpoint so every posted receive is cancelled."""
        t = self.transfers.get(reservation_id)
        if t is None:
            return None
        if t.state in (InboundState.EXPECTING, InboundState.RECEIVING):
            t.state = InboundState.CANCELLED
            t.error = "cancelled"
            t.done.set()
        if t.ep is not None:
            with contextlib.suppress(Exception):
                t.ep.abort()
        return t

    def forget(self, reservation_id: str) -> None:
        self.transfers.pop(reservation_id, None)

    async def _on_connect(self, ep: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(ep)
        finally:
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ep.close(), 2)

    async def _serve(self, ep: Any) -> None:
        try:
            [hello] = await _within(ep, [_recv_json(ep)], self.batch_timeout_s)
        except Exception as err:
            self.report("transfer_failed", {"reason": "BAD_HELLO", "error": type(err).__name__})
            return
        rid = str(hello.get("reservation_id", ""))
        t = self.transfers.get(rid)
        auth = str(hello.get("auth", ""))
        problem = None
        if t is None:
            problem = "UNKNOWN_RESERVATION"
        elif not hmac.compare_digest(authenticator(t.secret, rid), auth):
            problem = "BAD_AUTHENTICATOR"
        elif t.state != InboundState.EXPECTING:
            problem = "REPLAY"  # a reservation accepts exactly one transfer
        if problem is not None:
            self.report(
                "integrity_violation",
                {"check": problem, "reservation_id": rid[:64], "stage": "ucx_hello"},
            )
            with contextlib.suppress(Exception):
                await _send_json(ep, {"ok": False, "error": problem}, reply=True)
            return
        assert t is not None
        t.state = InboundState.RECEIVING
        t.ep = ep
        self.pool.set_state(rid, PageState.RECEIVING)
        try:
            await _send_json(ep, {"ok": True}, reply=True)
            await self._receive_batches(ep, t)
            t.state = InboundState.COMPLETE
            t.done.set()
            await _send_json(ep, {"ok": True, "received": len(t.received)}, reply=True)
            # The sender closes first: closing here could cancel the final answer in flight,
            # and prefill would report a complete transfer as failed.
            await self._linger(ep)
        except Exception as err:
            if t.state == InboundState.RECEIVING:
                t.state = InboundState.FAILED
                t.error = getattr(err, "reason", type(err).__name__)
                self.report(
                    "transfer_failed",
                    {"reason": t.error, "reservation_id": rid, "request_id": t.request_id},
                )
            with contextlib.suppress(Exception):
                await _send_json(ep, {"ok": False, "error": t.error}, reply=True)
                await self._linger(ep)
        finally:
            t.ep = None
            t.done.set()

    async def _linger(self, ep: Any) -> None:
        """Keep the endpoint open until the sender closes it (or a batch timeout), so the sender
        reads decode's last answer (success, or the reason of a failure) instead of a connection
        reset. Page bytes a failed sender still sends match no posted receive and reach no page."""
        with contextlib.suppress(Exception):
            await _within(
                ep, [ep.recv(np.empty(1, np.uint8), tag=LINGER_TAG)], self.batch_timeout_s
            )

    async def _receive_batches(self, ep: Any, t: InboundTransfer) -> None:
        page_bytes = self.pool.page_bytes
        while True:
            [header] = await _within(ep, [_recv_json(ep)], self.batch_timeout_s)
            if header.get("done"):
                return
            indices = header.get("indices")
            if not isinstance(indices, list) or not indices:
                raise TransferError("batch without indices", reason="PROTOCOL")
            for i in indices:
                if not isinstance(i, int) or not 0 <= i < len(t.pages):
                    raise TransferError(f"page index {i} outside the reservation", "COVERAGE")
                if i in t.received or indices.count(i) > 1:
                    raise TransferError(f"page index {i} sent twice", reason="DUPLICATE_PAGE")
            if len(indices) * page_bytes > self.max_batch_bytes and len(indices) > 1:
                raise TransferError("batch over max_batch_bytes", reason="PROTOCOL")
            await self._receive_pages(ep, t, indices)
            t.received.extend(indices)
            t.bytes_received += len(indices) * page_bytes
            await _send_json(ep, {"ok": True}, reply=True)

    async def _receive_pages(self, ep: Any, t: InboundTransfer, indices: list[int]) -> None:
        pids = [t.pages[i].page_id for i in indices]
        self.pool.begin_ops(pids)
        try:
            # Every receive lands straight in a reserved page; on any failure the endpoint is
            # aborted and every receive has completed before the operations end.
            await _within(
                ep,
                [
                    ep.recv(page_buffer(self.pool.kv[pid]), tag=PAGE_TAG + k)
                    for k, pid in enumerate(pids)
                ],
                self.batch_timeout_s,
            )
        except TransferError as err:
            raise TransferError("page batch timed out", "TIMEOUT", timeout=True) from err
        except Exception as err:
            raise TransferError(f"page receive failed: {err!r}") from err
        finally:
            self.pool.end_ops(pids)


@dataclass
class OutboundPage:
    """One page to send: the destination index and the bytes (a view of prefill's page)."""

    index: int
    data: Any


async def send_pages(
    address: str,
    *,
    reservation_id: str,
    request_id: str,
    secret: bytes,
    pages: Sequence[OutboundPage],
    page_bytes: int,
    max_batch_bytes: int,
    batch_timeout_s: float,
    auth_override: str | None = None,
    stall_after_hello_s: float = 0.0,
) -> float:
    """Send ``pages`` to decode; returns seconds taken. Raises TransferError on the first error."""

    host, _, port = address.rpartition(":")
    start = time.perf_counter()
    per_batch = max(1, max_batch_bytes // page_bytes)
    hello = {
        "reservation_id": reservation_id,
        "request_id": request_id,
        "auth": auth_override or authenticator(secret, reservation_id),
    }
    # The handshake (UCX's own peer-info exchange, then our hello and decode's answer) is never
    # cut short, even when we are cancelled: tearing an endpoint down mid-handshake crashed ucxx
    # on the listening side. A cancellation takes effect once decode has answered the hello.
    opening = asyncio.ensure_future(_open(host, int(port), hello, batch_timeout_s))
    try:
        ep = await asyncio.shield(opening)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            opened = await asyncio.wait_for(asyncio.shield(opening), 2 * batch_timeout_s)
            opened.abort()
        raise
    try:
        if stall_after_hello_s:  # fault hook only: a sender that stalls mid-transfer
            await asyncio.sleep(stall_after_hello_s)
        for b in range(0, len(pages), per_batch):
            batch = pages[b : b + per_batch]
            await _send_json(ep, {"indices": [p.index for p in batch]})
            await _send_batch(ep, batch, batch_timeout_s)
        await _send_json(ep, {"done": True})
        await _expect_ok(ep, batch_timeout_s)
    except TransferError:
        raise
    except Exception as err:
        raise TransferError(f"transfer failed: {err!r}") from err
    finally:
        with contextlib.suppress(Exception):
            ep.abort()
    return time.perf_counter() - start


async def _open(host: str, port: int, hello: dict[str, Any], timeout: float) -> Any:
    """Connect to decode's listener and pass the hello; the endpoint is aborted on failure."""
    import ucxx

    try:
        ep = await asyncio.wait_for(ucxx.create_endpoint(host, port), timeout)
    except Exception as err:
        raise TransferError(
            f"cannot reach decode at {host}:{port}: {err!r}", "UNREACHABLE"
        ) from err
    try:
        await _send_json(ep, hello)
        await _expect_ok(ep, timeout)
    except BaseException as err:
        with contextlib.suppress(Exception):
            ep.abort()
        if isinstance(err, TransferError | asyncio.CancelledError):
            raise
        raise TransferError(f"transfer failed: {err!r}") from err
    return ep


async def _send_batch(ep: Any, batch: Sequence[OutboundPage], timeout: float) -> None:
    """Send one batch and wait for decode's verdict. A refusal can arrive while page sends are
    still pending (decode never posts receives for a bad batch), so wait for either."""
    sends = [asyncio.ensure_future(ep.send(p.data, tag=PAGE_TAG + k)) for k, p in enumerate(batch)]
    reply = asyncio.ensure_future(_recv_json(ep, reply=True))
    try:
        done, _ = await asyncio.wait(
            {*sends, reply}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if reply in done:
            _check_reply(reply.result())
        if not done:
            raise TransferError("transfer batch timed out", "TIMEOUT", timeout=True)
        results = await _within(ep, [*sends, reply], timeout)
        _check_reply(results[-1])
    finally:
        await _settle(ep, [*sends, reply])


async def _expect_ok(ep: Any, timeout: float) -> None:
    [reply] = await _within(ep, [_recv_json(ep, reply=True)], timeout)
    _check_reply(reply)


def _check_reply(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        reason = str(reply.get("error"))
        raise TransferError(f"decode refused: {reason}", reason, timeout=reason == "TIMEOUT")
