"""KV page transfer from prefill to decode over UCX (TCP on loopback here, RDMA where available).

Endpoints are reused: prefill keeps an :class:`EndpointPool` of idle, already-connected endpoints
per decode address, and one transfer uses one endpoint exclusively. Every transfer on an endpoint
starts with its own hello (its reservation and authenticator: authentication is per transfer).
The pool remembers, per idle endpoint, the protocol version decode said on it; that picks one of
two openings. On a *warm* endpoint (pooled, decode said v >= 4) a transfer is one round trip when
its pages fit in one batch::

    prefill -> decode   HELLO {reservation_id, request_id, auth, v: 4, batch: B0}
                        auth = HMAC(secret, reservation); B0 = the first batch's header (below)
    prefill -> decode   B0's pages right behind the hello, without waiting for an answer
                        decode verifies the hello (authenticator, reservation state) and only then
                        posts B0's receives straight into the reserved pages; pages that arrived
                        before that wait in UCX as unexpected messages, never in the pool
    decode  -> prefill  one answer for hello + B0: {ok, v: 4} once B0's receives completed (the
                        final {ok, v: 4, received: n} when B0 is the last batch), or the refusal
                        {ok: false, error} (of the hello: then no receive was ever posted)
    later batches as below (BATCH -> pages -> {ok}), stop-and-wait

On a *cold* endpoint (a new connection, or decode's version unknown or below 4) the hello is a
step of its own, as decode before v4 expects (and decode v4 still accepts)::

    prefill -> decode   HELLO {reservation_id, request_id, auth, v: 4}
    decode  -> prefill  {ok, v: 4} | {ok: false, error}
    repeat, for batches of at most max_batch_bytes of pages:
      prefill -> decode BATCH {indices: [i, ...], last: true on the last batch}
                        decode posts one tagged receive per page straight into reserved page
                        ``pages[i]``
      prefill -> decode the pages, tag page_tag(reservation_id, batch number, k): scoped to the
                        transfer, so no message an earlier transfer on the endpoint left behind
                        can match (a decode before v3 used PAGE_TAG + k)
      decode  -> prefill {ok} once every receive of the batch completed (per-batch timeout);
                        for the ``last`` batch this is the final {ok, received: n}
    (no page to send, or a decode that answered the hello without v >= 2:
     prefill -> decode  BATCH {done: true};   decode -> prefill final {ok, received: n};
     on a warm endpoint B0 is {done: true} and the one answer is the final one)

A control message (hello, header, answer) is its length as an int64, then its JSON body, two
UCX messages on tags LEN/BODY (REPLY_LEN/REPLY_BODY for decode's answers) -- the only form a
peer before v4 sends or takes. To a peer that said v >= 4 (decode in an answer on this endpoint,
prefill in its hello's ``v``) one that fits in ``FRAME_BYTES`` is one UCX message instead, a
frame on the LEN tag: the negated length, then the body. A v4 receiver takes either form with
one ``FRAME_BYTES`` receive on the LEN tag (an 8-byte length fills only its start), so
``FRAME_BYTES`` is part of the v4 wire. Measured here: a warm one-page transfer took 0.69 ms
with frames against 0.87 ms with two-message control messages. Stop-and-wait per
batch: prefill sends a batch's pages only with its header (the warm hello, or a BATCH) and the
next batch only after this one was acknowledged, so a transfer never has more than
``max_batch_bytes`` in flight.

After the final answer the endpoint is idle: decode waits for the next HELLO on it (up to its
``idle_timeout_s``, longer than prefill keeps an idle endpoint) or for prefill to close it; decode
never closes first right after a completed transfer, which could cancel its final answer in flight.
Prefill's reaper can come round to an idle endpoint later than decode's wait ends (it ticks every
``min(idle_timeout_s / 4, 5 s)``), and a prefill host can vanish without a reset: then decode
closes the endpoint, reporting nothing (an idle endpoint said no bad hello; prefill never leases
one idle longer than its own ``idle_timeout_s``, ``EndpointPool.take``). Prefill gives the endpoint
back to its pool (at most ``max_idle_per_peer`` idle per decode, closed after ``idle_timeout_s``
unused, all closed on shutdown). A refused hello or a failed transfer ends the endpoint on both
sides: prefill aborts it (after every posted operation completed) and never reuses it; decode
answers with the reason and waits for prefill to close it, meanwhile receiving into a scratch page
(never the pool) the pages the refused hello or batch header had right behind it: UCX would
otherwise keep them, unmatched, for as long as the process lives. It receives at most as many as
the reservation decode itself issued holds (not the sender's count of indices): for a reservation
it knows, its prompt pages; for one it released, the count it remembers with the id; for an id it
does not know, ``UNKNOWN_RESERVATION_STRAYS``. Only a hello that carries the reservation's
authenticator (a late one, for a reservation decode released, or a REPLAY) has that many drained:
for a known or released id without it, at most ``UNKNOWN_RESERVATION_STRAYS`` too, since an id
alone is no secret. Pages beyond that stay in UCX. After a verified hello, a batch header that is
malformed (a length no control message may have, a message on the length tag longer than
``FRAME_BYTES``, which is received no further than a frame holds, not JSON, not a JSON object, no
list of indices) fails the transfer ``PROTOCOL`` and is answered so, like any refused batch (it
names no pages, so none are drained). A hello with a ``batch`` is a warm one whatever the ``batch``
holds: one that is no header object, ``null`` included, is such a malformed header, never taken for
a cold hello (kvfence's sender leaves the key out of a cold hello). A malformed hello (a bad
length, not JSON, nested too deep to parse, not an object) is answered nothing: nothing is verified
yet, so decode reports ``BAD_HELLO`` and aborts the endpoint, on a new connection as on a pooled
one. A connection that ends before its first hello (the peer closed it, or its process died) is
reported ``PEER_GONE`` instead: no hello was malformed.
A late hello (for a reservation decode has released: refused ``RESERVATION_RELEASED``) is a
``transfer_failed`` event on decode, and on prefill too while the call is live, since it says the
system was slow (decode's reaper released the reservation first). Not when decode released it
because its request ended by its owner's decision (``KvReceiver.forget``'s ``request_ended``: the
control plane's Release, the Decode stream's end or cancel, the node's drain or stop; decode_svc
lists its releases) and the hello carries the reservation's authenticator: it only raced that end
(on a client cancel the control plane cancels the Prefill call and releases decode, and decode's
Release can land first). Decode then logs it at info, with the request's ids, reports nothing,
and adds ``request_ended: true`` to its refusal; prefill, reading it
(``TransferError.request_ended``), logs at info and reports nothing either, its call still
failing ``RESERVATION_RELEASED``. The key is additive: a prefill before it reads only the error,
and a decode before it never sends it. A hello without the authenticator is reported (bounded,
decode_svc) whatever the release was: an id alone must not silence a reaped one's event.
Such a release can also land while decode is receiving the transfer (its hello verified, a batch
header awaited or a batch's pages in flight), the Prefill call live for the same reason. Decode
then does not abort the endpoint, which answers nothing (prefill read a lost connection and
reported a failed transfer): it posts no further receive, lets the ones posted settle (one batch
at most, within ``batch_timeout_s``; their pages QUARANTINED until then, as after an abort), and
refuses the transfer at its next step with the same ``{ok: false, error: RESERVATION_RELEASED,
request_ended: true}``, logged at info and reported by neither side; a batch header read after
the release is refused so without being judged (as an abort left it unread), its pages drained
as for any refused batch (``KvReceiver.cancel``). Any refusal after a release says
``RESERVATION_RELEASED``, never an internal state name. Any other release (the
reaper's, a failed check, a timed-out drain's, the stop's) still aborts the transfer, and
prefill reports it. A prefill before the key reads a plain RESERVATION_RELEASED refusal.
A pooled endpoint whose peer went away (decode restarted) is skipped when UCX already saw that;
otherwise its hello fails, and prefill discards it and says the hello once more on a new
endpoint, but only when decode cannot have accepted anything: on a cold endpoint when decode did
not answer the hello (nothing of this transfer was sent but the hello), on a warm one only when
the hello itself never left (its send failed), since pages went out right behind it. A refusal,
a timeout or any later failure is final.
A cancelled send (a Release, a timed-out drain) ends at once, wherever it is, its endpoint
discarded as after a failure, its posted operations settled first (the abort completes them).
Only UCX's own connect of a new endpoint is never cut short, by a cancellation or by its timeout
(cut short mid-way it crashed the process): it goes on without the send, and the pool discards
its endpoint unused, without a hello, when it ends (``EndpointPool.connect``).

Reservation ids and a restarted decode. Decode issues ids ``<node>.<instance>.<uuid4 hex>``
(``KvReceiver.new_reservation_id``; :func:`reservation_origin` reads the first two parts): the node
part is the first 8 hex digits of a BLAKE2b hash of the decode node's id (:func:`node_tag`;
``DecodeServicer`` gives its receiver its node's id), the instance 8 hex digits drawn once per
receiver, i.e. per decode process. A decode container restarted in its pod keeps its node id (the
Helm chart sets it to the pod name) and listens at the same UCX address, so a transfer for a
reservation of the previous process reaches the new one, its hello naming an id of this node and
another instance: decode refuses it ``NODE_RESTARTED`` and reports a ``transfer_failed`` with that
reason (no integrity violation, no count), and prefill fails the call UNAVAILABLE, as for
``RESERVATION_RELEASED``: the node lost the request (DESIGN.md), and a retry reserves anew. Any
other unknown id stays ``UNKNOWN_RESERVATION``, an integrity violation (DATA_LOSS): one of this
process's own instance, one another decode node issued (a misrouted transfer, a stale address: that
node is alive, so nothing was lost to a restart), or one of any other shape, including the bare
uuid4 hex ids of releases before the instance part (so the first in-place restart after upgrading
from one still raises the alert for the requests then in flight). A node without a configured
``node.node_id`` is ``decode-<hostname>-<pid>``: a restart with another pid is another node. No
hello for an unknown id can be authenticated (the secret was the lost process's), so a peer on the
UCX port can pick which of the two it causes: both are hello events bounded alike (decode_svc), and
both drain at most ``UNKNOWN_RESERVATION_STRAYS`` stray pages. A restarted process that drew its
predecessor's instance (one chance in 2**32) sees that predecessor's ids as its own, and another
node whose id hashes to this one's node part (one in 2**32 per pair) as this node's:
``UNKNOWN_RESERVATION`` for the first, ``NODE_RESTARTED`` for the second.

The receiver decides where bytes land: a sender names only an index into *its* reservation's prompt
pages, so a sender bug can at worst leave a reserved page unwritten or wrongly written — which the
manifest's coverage and checksum checks catch. Every posted receive is counted as an outstanding
operation on its page in the pool; the first error aborts the endpoint, which cancels all posted
receives, and only when they have settled are the operations ended (a released page stays
QUARANTINED until then).

Exposure of decode's listener. Whoever reaches the UCX port can connect and say a hello; a wrong
one is refused (an integrity violation, or ``NODE_RESTARTED`` as above), but until it is
verified a connection costs decode a task, an endpoint and its buffers. So a connection waits
for its first hello at most ``batch_timeout_s`` (then BAD_HELLO), lingers after refusing it at
most that long again, and decode serves at most ``max_unverified``
(``transfer.max_unverified_connections``) connections
at once whose first hello is not verified yet: one beyond it is aborted at once, before anything
is read from it, counted per reason (``KvReceiver.rejected``, and the decode node's
``kvfence_transfer_connections_rejected_total{reason="unverified_limit"}``) and logged at
warning at most once per ``REJECT_LOG_INTERVAL_S`` (the line says how many were closed since the
last one). A connection whose hello was verified no longer counts (nor the later transfers on
it), so prefill's pooled endpoints keep working through a flood; a prefill that opens a new
connection meanwhile has its transfer fail at once (the endpoint is closed under its hello), not
hang. A refused hello's lingering connection drains at most ``UNKNOWN_RESERVATION_STRAYS``
stray pages unless it carried the authenticator of the reservation it named (above). A handler
that raises all the same (a case no check foresaw) ends its connection there: aborted, counted
(``KvReceiver.handler_errors``) and logged at error at most once per ``REJECT_LOG_INTERVAL_S``,
never left to ucxx. Before decode sees a connection at all, ucxx exchanges its own peer
information on it (a send and a receive, up to ``create_listener``'s ``connect_timeout``, 5 s,
each), and nothing here bounds how many connections are at that stage. Nor what a connection
sends besides its hello: messages on tags decode never receives stay in the UCX worker's queue of
unexpected messages for the life of the process (closing the endpoint does not free them, and UCX
offers no way to purge one endpoint's). A review's flood, 195 MiB in small messages from 50 short
connections with no hello, left decode's memory 390 MiB higher for good, and nothing above
counted it. So the UCX port must be reachable from prefill nodes only: a deployment requirement
(a NetworkPolicy for TCP; for RDMA, which NetworkPolicy does not reach, the fabric's own
partitioning), not a bound decode enforces.

The listener listens on every interface, whatever address the node binds its gRPC server to:
ucxx's ``create_listener`` (0.52, installed here) takes a port only, and binds the wildcard
address (``Listener.ip`` reads 0.0.0.0; ``UCX_NET_DEVICES`` does not change it, it only limits
UCX's own transport sockets). libucxx's C++ ``ListenerBuilder::host`` can bind one address, but
the Python binding does not call it. :class:`KvReceiver` is told the address the node binds
(``bind_host``, from ``node.listen``; empty for 0.0.0.0 / ::) and says at start, at warning,
when its listener ended up wider than that, so that the port is closed off by other means (a
firewall rule, a Kubernetes NetworkPolicy).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import hashlib
import hmac
import itertools
import json
import os
import re
import secrets
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import numpy as np
import torch

from kvfence import logging as kvlog
from kvfence.errors import NODE_RESTARTED, RESERVATION_RELEASED
from kvfence.kv.pool import PagePool, PageRef, PageState, ucx_bytes

LEN_TAG = 1
BODY_TAG = 2
REPLY_LEN_TAG = 3
REPLY_BODY_TAG = 4
PAGE_TAG = 1 << 20
LINGER_TAG = 99  # never sent: a receive on it ends when the peer closes
MAX_CONTROL_BYTES = 1 << 20
FRAME_BYTES = 4096  # a control message up to this size (with its length) is one UCX message
PROTOCOL_VERSION = 4  # decode's answers say it; see the module docstring
# From v4 on, decode takes the first batch with the hello, and both sides take a control message
# as one frame (to a peer that said v >= 4).
WARM_VERSION = 4

log = kvlog.get_logger("transfer")


# How many released reservation ids decode remembers (KvReceiver._released, with their page
# counts, authenticators and, for a request that ended, its request and tenant ids): about 340
# bytes each, 540 with those ids (measured with tracemalloc, a uuid4-hex request id), so at most
# about 4.4 MiB once full; a decode process's memory grows by that over its first 8192
# transfers, then stays.
RELEASED_REMEMBERED = 8192
# How many stray pages decode drains behind a refused hello that does not carry the authenticator
# of a reservation decode issued: one that names a reservation it does not know, or a known or
# released one with a wrong authenticator (``KvReceiver._linger``; reservation ids are no secret:
# they travel in cleartext hellos, events and logs). Any hello can say that, unauthenticated,
# with as many indices as fit in a control message, and each drained page costs a posted receive
# and a task for up to batch_timeout_s (measured here: a 100 KB hello of 16000 indices cost
# decode about 13 MiB and stalled its event loop for over half a second). So the number is a
# small constant: at most this many times ``max_unverified_connections`` receives are ever
# posted for unauthenticated hellos (4096 at the default 256, a few MiB). It is not 0 because a
# legitimate sender can name an id decode
# no longer knows: one so late that its reservation fell out of the last RELEASED_REMEMBERED
# released ids, its warm hello's batch 0 already sent. A batch that small (a short prompt) is
# drained whole; of a longer one the rest stays in UCX, a leak bounded by how rare such a
# sender is.
UNKNOWN_RESERVATION_STRAYS = 16

# A reservation id is "<node>.<instance>.<uuid4 hex>" (``KvReceiver.new_reservation_id``): the
# node part names the decode node (``node_tag``), the instance is random per receiver, i.e. per
# decode process, so a hello naming an id of this node and another instance is for a reservation
# of the process that served this node before a restart; one naming another node's is not.
_RESERVATION_ID = re.compile(r"([0-9a-f]{8})\.([0-9a-f]{8})\.[0-9a-f]{32}")


def node_tag(node_id: str) -> str:
    """A decode node's part of its reservation ids: 8 hex digits of a hash of its node id (a
    fixed width and alphabet whatever the id, and the same in every process of the node)."""
    return hashlib.blake2b(node_id.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()


def reservation_origin(reservation_id: str) -> tuple[str, str] | None:
    """``(node, instance)`` of a well-formed reservation id, None for any other string."""
    m = _RESERVATION_ID.fullmatch(reservation_id)
    return (m.group(1), m.group(2)) if m else None


# Decode logs connections it closed unserved (KvReceiver._reject) at most once per this many
# seconds: a flood must not become a flood of log lines.
REJECT_LOG_INTERVAL_S = 10.0
# How long a sender whose batch decode refused waits for the pages it already sent to be taken
# (decode drains them into scratch) before it aborts the endpoint.
REFUSED_SENDS_S = 1.0
# How long a stopping receiver waits for its connections' handlers (aborted, so they end at
# once unless ucxx hangs) before it cancels them.
HANDLERS_STOP_S = 1.5
# How long closing prefill's endpoint pool waits for connects no transfer waits for any more
# (``EndpointPool.connect``): on a live decode one takes milliseconds; only a peer whose UCX
# does not answer (a frozen process) holds one up to ucxx's handshake timeout.
ABANDONED_CONNECTS_STOP_S = 2.0
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})

# Reasons that mean the bytes or the protocol were wrong (not merely slow or lost): DATA_LOSS.
INTEGRITY_REASONS = frozenset(
    {"DUPLICATE_PAGE", "COVERAGE", "PROTOCOL", "BAD_AUTHENTICATOR", "REPLAY", "UNKNOWN_RESERVATION"}
)


class TransferError(Exception):
    """A transfer that did not complete; ``reason`` is a short machine-readable cause."""

    def __init__(
        self,
        message: str,
        reason: str = "TRANSFER_FAILED",
        timeout: bool = False,
        refused: bool = False,
        request_ended: bool = False,
    ):
        super().__init__(message)
        self.reason = reason
        self.timeout = timeout
        # decode answered and said no (as opposed to a broken or silent endpoint)
        self.refused = refused
        # decode refused a late transfer (RESERVATION_RELEASED) for a reservation it released
        # because its request ended by its owner's decision, not because anything was slow or
        # wrong (``KvReceiver.forget``): nothing for prefill to report either
        self.request_ended = request_ended


def use_ucx_futures() -> None:
    """Have ucxx complete UCX operations through Python futures (call before ucxx starts).

    Without them ucxx awaits every pending operation by yielding to the event loop in a busy
    loop: a node with any receive posted (decode always has one, waiting for the next hello on
    each pooled endpoint) kept a core at 100% and, through the GIL, slowed its decode steps 5-8x.
    With them a notifier thread completes the futures. That thread is bound to the event loop
    running when ucxx starts, so this is for processes with one event loop (the services, the
    benchmarks), and such a process must call :func:`stop_ucx_notifier` before it exits. An
    operator's own ``UCXPY_ENABLE_PYTHON_FUTURE`` wins.
    """
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    # In that mode ucxx warns on stdout, once per operation, whenever a burst of operations
    # outruns its pool of prepared futures (it makes one on the spot): harmless, but it floods
    # node logs and breaks the benchmarks' one-JSON-object stdout. Errors still print.
    os.environ.setdefault("UCXX_LOG_LEVEL", "ERROR")


def service_ucx_defaults() -> None:
    """UCX settings of a kvfence service process (call before ucxx starts; an operator's own
    environment wins): TCP on loopback when nothing is said, Python futures
    (:func:`use_ucx_futures`), and a listener that may take its port while connections of a
    previous process on it are in TIME_WAIT. UCX's TCP listener sets no SO_REUSEADDR unless
    told, so a decode container restarted in its pod (same network namespace, same fixed
    ``ucx_port``) failed to start, "Device is busy", for the minute after its previous process
    had served transfers. On Linux SO_REUSEADDR does not let a second process listen on a port
    that one is listening on."""
    os.environ.setdefault("UCX_TLS", "tcp,self")
    os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
    use_ucx_futures()


def stop_ucx_notifier() -> None:
    """Stop ucxx's notifier thread if this process started one: it is not a daemon thread, and
    once the event loop has closed it would keep the process from exiting."""
    core = sys.modules.get("ucxx.core")
    if core is not None:
        core.stop_notifier_thread()


def page_tag(reservation_id: str, batch: int, k: int, version: int = PROTOCOL_VERSION) -> int:
    """The UCX tag of the ``k``-th page of batch ``batch`` of a reservation's transfer, for a
    decode speaking protocol ``version`` (v3 and v4: scoped as below; before v3: ``PAGE_TAG + k``).

    An endpoint carries one transfer after another, so a page tag must not be one a previous
    transfer could have left a message under: a stray page send (a sender bug) sitting unmatched
    in UCX's queue would otherwise match the next transfer's receive and land in its page (the
    checksum would catch it, failing an innocent request). Since v4 the pages of batch 0 on a warm
    endpoint are *meant* to wait unmatched for a moment (they travel right behind the hello, before
    decode posted their receives), so they too must be told apart from anything older than this
    transfer: the tag names the reservation and the batch in its high bits (a reservation accepts
    one transfer only), and batch numbers count from 0 whichever opening carried batch 0. ucxx
    hashes it with the endpoint's own tag, so a message sent on one endpoint never matches a
    receive posted on another; it stays below 2**53 so that hashing keeps it distinct.
    """
    if not 0 <= k < PAGE_TAG:
        raise ValueError(f"page {k} of a batch is beyond {PAGE_TAG}")
    return _tag_base(reservation_id, batch, version) | k


def page_tags(
    reservation_id: str, batch: int, n: int, version: int = PROTOCOL_VERSION
) -> list[int]:
    """``page_tag`` of pages 0 .. n-1 of one batch, the scope computed once."""
    if not 0 <= n <= PAGE_TAG:
        raise ValueError(f"{n} pages in a batch, more than {PAGE_TAG}")
    base = _tag_base(reservation_id, batch, version)
    return [base | k for k in range(n)]


def _tag_base(reservation_id: str, batch: int, version: int) -> int:
    if version < 3:
        return PAGE_TAG
    # surrogatepass: a hello's reservation id is the peer's JSON, which may hold a lone
    # surrogate ("\ud800"); a plain encode() raised out of decode's handler on it.
    scope = f"{reservation_id}\x00{batch}".encode("utf-8", "surrogatepass")
    return (zlib.crc32(scope) << 21) | PAGE_TAG


def authenticator(secret: bytes, reservation_id: str) -> str:
    return hmac.new(
        secret, b"kvfence-ucx-hello|" + reservation_id.encode(), hashlib.sha256
    ).hexdigest()


def pages_per_batch(max_batch_bytes: int, page_bytes: int) -> int:
    """How many pages one batch holds: as many as fit in ``max_batch_bytes``, one at least. The
    sender cuts its batches by it and decode refuses a batch with more."""
    return max(1, max_batch_bytes // page_bytes)


def page_buffer(t: torch.Tensor) -> Any:
    """A UCX-sendable view of one contiguous page (numpy on CPU, the CUDA tensor on GPU)."""
    return ucx_bytes(t.reshape(-1))


def _send(ep: Any, buffer: Any, *, tag: int) -> Coroutine[Any, Any, Any]:
    return _op(ep.send(buffer, tag=tag))


def _recv(ep: Any, buffer: Any, *, tag: int) -> Coroutine[Any, Any, Any]:
    return _op(ep.recv(buffer, tag=tag))


async def _op(aw: Awaitable[Any]) -> Any:
    """Await one ucxx operation; a failure is raised as a copy without ucxx's traceback.

    ucxx keeps the exception of a failed request (e.g. every receive still posted when an
    endpoint closes) alive for good, and a traceback on it keeps every frame it passed through
    alive too, buffers and endpoints included: measured, 14 KiB of Python objects per endpoint
    that ever closed with a receive posted, which on decode is every one.
    """
    try:
        return await aw
    except Exception as err:
        err.__traceback__ = None
        try:
            fresh = copy.copy(err)
        except Exception:
            raise err from None  # not copyable: keep it (it carries no traceback now)
        raise fresh from None


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


def _json_ops(
    ep: Any, obj: dict[str, Any], *, reply: bool = False, frame: bool = False
) -> list[Any]:
    """The UCX sends of one control message, not yet awaited: its length (int64), then its JSON
    body; or, with ``frame`` (only to a peer that said v >= 4) and when it fits in
    ``FRAME_BYTES``, one message: the negated length, then the body."""
    data = json.dumps(obj).encode()
    len_tag, body_tag = (REPLY_LEN_TAG, REPLY_BODY_TAG) if reply else (LEN_TAG, BODY_TAG)
    if frame and 8 + len(data) <= FRAME_BYTES:
        one = np.frombuffer(struct.pack("=q", -len(data)) + data, dtype=np.uint8)
        return [_send(ep, one, tag=len_tag)]
    body = np.frombuffer(data, dtype=np.uint8)
    size = np.array([body.size], dtype=np.int64)
    return [_send(ep, size, tag=len_tag), _send(ep, body, tag=body_tag)]


async def _send_json(
    ep: Any, obj: dict[str, Any], *, reply: bool = False, frame: bool = False
) -> None:
    await _within(ep, _json_ops(ep, obj, reply=reply, frame=frame), None)


async def _recv_json(ep: Any, *, reply: bool = False) -> dict[str, Any]:
    """One control message in either form, parsed; a malformed one raises (awaited in
    ``_within``, which then aborts the endpoint: what a hello and an answer get)."""
    return _control_object(await _recv_control(ep, reply=reply))


async def _recv_control(ep: Any, *, reply: bool = False) -> bytes | TransferError:
    """The body of one control message in either form (a shorter message fills the start of the
    buffer), or the PROTOCOL error of a length no control message may have (a message on the
    length tag longer than a frame included).

    That error is returned, not raised: every receive posted for the message completed, so the
    endpoint is sound, while one raised inside ``_within`` aborts it before decode can answer
    the reason (``KvReceiver._receive_batches`` answers a malformed batch header)."""
    head = np.zeros(FRAME_BYTES, dtype=np.uint8)  # never parse stale heap bytes
    try:
        await _recv(ep, head, tag=REPLY_LEN_TAG if reply else LEN_TAG)
    except Exception as err:
        if not _truncated(err):
            raise
        # A message longer than a frame: UCX matched it whole and delivered only its first
        # FRAME_BYTES (nothing larger is allocated), failing the receive alone; the endpoint is
        # sound, so this is a length no control message may have, like the ones below.
        return TransferError("control message longer than a frame", reason="PROTOCOL")
    n = int(head[:8].view(np.int64)[0])
    if -(FRAME_BYTES - 8) <= n < 0:  # one frame: the body follows its length
        body = head[8 : 8 - n]
    elif 0 < n <= MAX_CONTROL_BYTES:  # the body is a message of its own
        body = np.empty(n, dtype=np.uint8)
        await _recv(ep, body, tag=REPLY_BODY_TAG if reply else BODY_TAG)
    else:
        return TransferError(f"control message of {n} bytes", reason="PROTOCOL")
    return body.tobytes()


def _truncated(err: Exception) -> bool:
    """Whether a receive failed because the message was longer than its buffer."""
    exceptions = sys.modules.get("ucxx.exceptions")  # loaded with ucxx, which made the receive
    return exceptions is not None and isinstance(err, exceptions.UCXMessageTruncatedError)


def _control_object(body: bytes | TransferError) -> dict[str, Any]:
    """A received control message as a JSON object; raises the PROTOCOL error of a bad length
    or of JSON that is not an object, and json's own error (a ValueError) for what is not JSON."""
    if isinstance(body, TransferError):
        raise body
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise TransferError("control message is not an object", reason="PROTOCOL")
    return obj


# What json raises on a body it cannot parse: not JSON or not UTF-8 (ValueError), or nested
# deeper than the interpreter's recursion limit (RecursionError, which is no ValueError). Decode
# takes both as a malformed control message, a hello's (BAD_HELLO) as a batch header's (PROTOCOL).
_UNPARSABLE = (ValueError, RecursionError)


def _batch_header_object(body: bytes | TransferError) -> dict[str, Any]:
    """A received batch header as a JSON object; anything else is PROTOCOL, not JSON included
    (a transfer failure's reason is one of decode's, never a parser's exception name)."""
    try:
        return _control_object(body)
    except _UNPARSABLE as err:
        raise TransferError(
            f"batch header is not JSON ({type(err).__name__})", reason="PROTOCOL"
        ) from None


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
    # Cancelled because its request ended by its owner's decision (``KvReceiver.cancel``'s
    # ``request_ended``): its handler, not aborted, refuses it saying so at its next step.
    ended: bool = False


Reporter = Callable[[str, dict[str, Any]], None]


class _Released(NamedTuple):
    """What decode remembers of a reservation it released (``KvReceiver.forget``)."""

    pages: int  # its prompt pages: how many strays a late hello with ``auth`` has drained
    auth: bytes  # the authenticator its hello carries (not the secret, which signs manifests)
    # (request_id, tenant_id) when it was released because its request ended by its owner's
    # decision; None when the release itself signals trouble (decode_svc's module docstring).
    ended: tuple[str, str] | None


def bind_host_of(listen: str) -> str:
    """The address a ``host:port`` listen address binds (IPv6 unbracketed), or "" where it binds
    every interface (0.0.0.0, ::, or no host)."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    if host in WILDCARD_HOSTS:
        return ""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


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
        idle_timeout_s: float = 60.0,
        bind_host: str = "",
        max_unverified: int = 256,
        on_reject: Callable[[str], None] | None = None,
        node_id: str | None = None,
    ):
        if max_unverified < 1:
            raise ValueError("max_unverified must be >= 1")
        self.pool = pool
        self.host = host
        self.port = port
        # The address the node binds (its gRPC listen address); "" = every interface. ucxx
        # cannot bind its listener to it (module docstring): start() says so when it matters.
        self.bind_host = bind_host
        self.listen_ip = ""  # the address the listener is bound to, as UCX says (after start)
        self.max_batch_bytes = max_batch_bytes
        self.batch_timeout_s = batch_timeout_s
        # How long an endpoint that completed a transfer waits for the next hello before decode
        # closes it; longer than prefill keeps an idle endpoint, so the sender closes first.
        self.idle_timeout_s = idle_timeout_s
        self.report = report
        self.transfers: dict[str, InboundTransfer] = {}
        # Reservations this node issued and has since released (bounded, oldest dropped): a hello
        # for one of them is a transfer that came too late (the reservation expired or the
        # request was aborted), not a forged reservation id, and must not raise a security
        # alarm. An id never issued here is still UNKNOWN_RESERVATION (one of this node's
        # previous process: NODE_RESTARTED, ``restarted``). Each id maps to how many prompt pages
        # the reservation had and the authenticator its hello carries (not the secret, which
        # also signs manifests): a late hello that carries it has its stray pages drained up to
        # that count, one that does not only as many as a hello for an unknown id (``_serve_one``);
        # and to whether its request had ended (``forget``).
        self._released: collections.OrderedDict[str, _Released] = collections.OrderedDict()
        # This node's and this process's parts of every reservation id it issues
        # (``new_reservation_id``): an unknown id with this node's part and another instance's is
        # a restart's lost reservation, not a forgery; one with another node's part is neither.
        # The node is the decode node's id (DecodeServicer sets it, ``node_tag``); by default the
        # host it advertises, so that receivers made directly on different hosts differ.
        self.node = node_tag(host if node_id is None else node_id)
        self.instance = secrets.token_hex(4)
        self._listener: Any = None
        self._stopped = False  # stop() began: a connection that reaches us now is not served
        self._handlers: set[asyncio.Task[None]] = set()
        self._endpoints: set[Any] = set()  # connected endpoints being served
        # Of those, the ones whose first hello is not verified yet (at most max_unverified).
        self._unverified: set[Any] = set()
        self.max_unverified = max_unverified
        self._on_reject = on_reject
        # Connections closed unserved, per reason (tests, metrics); the ones not logged yet, and
        # when the next log line may be written (``_reject``).
        self.rejected: collections.Counter[str] = collections.Counter()
        self._rejects_reason = ""
        self._reject_log = kvlog.BurstLog(self._log_rejects_line, REJECT_LOG_INTERVAL_S)
        # Connections whose handler raised (a bug here, never the peer's doing alone): aborted,
        # counted and logged at error at most once per REJECT_LOG_INTERVAL_S (``_handler_failed``).
        self.handler_errors = 0
        self._handler_error = ""  # the latest one, as text (the exception would keep frames)
        self._handler_error_log = kvlog.BurstLog(
            self._log_handler_errors_line, REJECT_LOG_INTERVAL_S
        )
        self.connections = 0  # endpoints accepted since start (tests, metrics)
        self.transfers_served = 0  # hellos accepted, over all endpoints
        self.warm_hellos = 0  # of those, hellos that carried their first batch (v4)
        self.answers = 0  # answers sent to prefill: one per round trip of a transfer
        self.strays_drained = 0  # pages of refused batches received into scratch (``_linger``)
        # Scratch receives posted for them, drained or not: bounded by decode's own reservations.
        self.strays_posted = 0
        # One page that drained strays land in, shared: nothing reads it.
        self._scratch: np.ndarray[Any, Any] | None = None

    @property
    def open_endpoints(self) -> int:
        return len(self._endpoints)

    @property
    def unverified(self) -> int:
        """Connections served now whose first hello is not verified yet."""
        return len(self._unverified)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def listens_wider_than_bound(self) -> bool:
        """The listener takes connections on every interface though the node binds one."""
        return bool(self.bind_host) and self.listen_ip in WILDCARD_HOSTS

    async def start(self) -> None:
        import ucxx

        # ucxx (0.52) takes no address here: the listener binds every interface.
        self._listener = ucxx.create_listener(self._on_connect, port=self.port)
        self.port = self._listener.port
        self.listen_ip = str(self._listener.ip)
        if self.listens_wider_than_bound:
            log.warning(
                "UCX transfer listener listens on every interface, not only the node's bind "
                "address: ucxx cannot bind it to one; close the port off by other means "
                "(firewall, NetworkPolicy)",
                bind_host=self.bind_host,
                listen_ip=self.listen_ip,
                port=self.port,
            )

    async def stop(self) -> None:
        self._stopped = True
        self._log_rejects()  # what a burst left unlogged
        self._handler_error_log.flush()
        for t in list(self.transfers.values()):
            self.cancel(t.reservation_id)
        # Idle endpoints wait for a next hello: abort them so their handlers end now (every
        # posted operation completes with an error and is awaited by the handler).
        for ep in list(self._endpoints):
            with contextlib.suppress(Exception):
                ep.abort()
        # Together, not one after another: a node's stop is bounded (node_main.STOP_TAIL_S).
        if handlers := set(self._handlers):
            _, stuck = await asyncio.wait(handlers, timeout=HANDLERS_STOP_S)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=0.5)
        if self._listener is not None:
            # ucxx counts a connection's handler as alive one more turn of the loop after it
            # ended, and warns ("Listener ... destroyed, but 1 client handler(s) is(are) still
            # alive") of a listener dropped before: a few turns, bounded like the handlers.
            deadline = time.monotonic() + 0.5
            while self._listener.active_clients and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            self._listener.close()
            self._listener = None

    def expect(
        self, reservation_id: str, request_id: str, secret: bytes, pages: Sequence[PageRef]
    ) -> InboundTransfer:
        t = InboundTransfer(reservation_id, request_id, secret, list(pages))
        self.transfers[reservation_id] = t
        return t

    def cancel(self, reservation_id: str, *, request_ended: bool = False) -> InboundTransfer | None:
        """Stop a transfer: abort its endpoint so every posted receive is cancelled (not with
        ``request_ended``: below).

        Only a transfer still receiving has its endpoint aborted. One that completed has no
        receive posted into its pages any more, but its handler may not have let go of the
        endpoint yet (it is sending, or has just sent, the final answer): prefill, which already
        read that answer, has given the endpoint back to its pool and may be running its next
        transfer on it. Aborting it then failed that other, innocent transfer with
        UCXXCanceledError, on a healthy decode that logged nothing about it.

        ``request_ended``: the reservation goes because its request ended by its owner's
        decision (the caller then ``forget``s it so), and the node goes on serving. A transfer
        still receiving is then not aborted: an abort answers nothing, and prefill, whose call
        may still be live (the control plane's Release of a client cancel can land before the
        Prefill call's cancel), read a lost connection and reported a failed transfer. Its
        handler posts no further receive (``_receive_pages`` checks the state before posting),
        lets the ones already posted settle (one batch at most, within ``batch_timeout_s``,
        their pages QUARANTINED until then as after an abort: ``PagePool.release``), and then
        refuses the transfer ``RESERVATION_RELEASED`` with ``request_ended: true``, as it
        refuses a late hello of such a reservation (``_serve_one``), draining the pages sent
        behind a batch header it refused. ucxx cannot cancel one endpoint's receives but by
        aborting it (its per-request cancel is not exposed, its worker-wide one would cancel
        every endpoint's)."""
        t = self.transfers.get(reservation_id)
        if t is None:
            return None
        receiving = t.state == InboundState.RECEIVING
        if t.state in (InboundState.EXPECTING, InboundState.RECEIVING):
            t.state = InboundState.CANCELLED
            t.error = "cancelled"
            t.ended = request_ended
            t.done.set()
        if receiving and t.ep is not None and not request_ended:
            with contextlib.suppress(Exception):
                t.ep.abort()
        return t

    def new_reservation_id(self) -> str:
        """A fresh reservation id: this receiver's node part, a dot, its instance, a dot, a uuid4
        in hex."""
        return f"{self.node}.{self.instance}.{uuid.uuid4().hex}"

    def restarted(self, reservation_id: str) -> bool:
        """Whether ``reservation_id`` has the shape of an id another process of this same node
        issued (before a restart): this node's part, another instance. Ids of this process, of
        another node (a misrouted transfer: that node is alive) and of any other shape do not."""
        origin = reservation_origin(reservation_id)
        return origin is not None and origin[0] == self.node and origin[1] != self.instance

    def released(self, reservation_id: str) -> bool:
        """Whether ``reservation_id`` is one this receiver expected and has forgotten since
        (among the last RELEASED_REMEMBERED)."""
        return reservation_id in self._released

    def forget(
        self, reservation_id: str, *, request_ended: bool = False, tenant_id: str = ""
    ) -> None:
        """Drop an expected transfer, remembering its id as released (``released``).

        ``request_ended``: the reservation was released because its request ended by its owner's
        decision (the control plane's Release, a Decode stream's end, the node's drain): a late
        hello of its prefill, which carries its authenticator, then only raced that end (a client
        cancel reaches decode's Release before prefill's cancel stops the send). It is logged at
        info with the request's ids (its own and ``tenant_id``), reported to no one, and its
        refusal says ``request_ended: true`` so that prefill does not report it either. Without
        it (the reaper's timeout, an integrity failure, a failed transfer) a late hello is a
        ``transfer_failed`` event: the system was slow, or something went wrong.
        """
        t = self.transfers.pop(reservation_id, None)
        if t is not None:
            expected = authenticator(t.secret, reservation_id).encode()
            ended = (t.request_id, tenant_id) if request_ended else None
            self._released[reservation_id] = _Released(len(t.pages), expected, ended)
            while len(self._released) > RELEASED_REMEMBERED:
                self._released.popitem(last=False)

    async def _on_connect(self, ep: Any) -> None:
        if self._stopped:
            # ucxx hands us a connection only once its own handshake is over, so one accepted
            # before stop() (or while it waits for the handlers) can arrive after it: served, it
            # would outlive the stopped node, a task and an endpoint waiting batch_timeout_s for
            # a hello and reporting to a stopped event bus. Close it at once instead.
            _abort(ep)
            return
        if len(self._unverified) >= self.max_unverified:
            # Nothing is read from it: it costs no more than ucxx's handshake already did.
            self._reject(ep, "unverified_limit")
            return
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._endpoints.add(ep)
        self._unverified.add(ep)  # until _serve_one verifies its first hello
        self.connections += 1
        try:
            await self._serve(ep)
        except Exception as err:
            # Last resort: a handler that raises (a peer's message no check above foresaw) must
            # not escape into ucxx, which logs a traceback per connection and answers nothing.
            self._handler_failed(ep, err)
        finally:
            self._unverified.discard(ep)
            self._endpoints.discard(ep)
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ep.close(), 2)

    def _reject(self, ep: Any, reason: str) -> None:
        """Close a connection at once, unserved; count it, and log at most once per
        ``REJECT_LOG_INTERVAL_S`` how many were closed since the last line."""
        _abort(ep)
        self.rejected[reason] += 1
        if self._on_reject is not None:
            with contextlib.suppress(Exception):  # a failing metric must not fail the handler
                self._on_reject(reason)
        self._rejects_reason = reason
        self._reject_log.note()

    def _log_rejects(self) -> None:
        """Log the connections closed unserved since the last line (if any)."""
        self._reject_log.flush()

    def _log_rejects_line(self, closed: int) -> None:
        log.warning(
            "UCX connections closed unserved",
            reason=self._rejects_reason,
            closed=closed,
            unverified=len(self._unverified),
            max_unverified=self.max_unverified,
            next_line_after_s=REJECT_LOG_INTERVAL_S,
        )

    def _handler_failed(self, ep: Any, err: Exception) -> None:
        """A connection's handler raised: end the endpoint (it serves nothing more), count it,
        and log at most once per ``REJECT_LOG_INTERVAL_S`` (a peer that can trigger it must not
        flood the log either)."""
        _abort(ep)
        self.handler_errors += 1
        self._handler_error = f"{type(err).__name__}: {err}"[:300]
        self._handler_error_log.note()

    def _log_handler_errors_line(self, failed: int) -> None:
        log.error(
            "UCX connection handler failed",
            error=self._handler_error,
            failed=failed,
            next_line_after_s=REJECT_LOG_INTERVAL_S,
        )

    async def _serve(self, ep: Any) -> None:
        """Serve successive transfers on one endpoint, one at a time, each with its own hello.

        After a completed transfer the endpoint waits for the next hello (up to
        ``idle_timeout_s``) or for the sender to close it; decode never closes first right after
        its final answer. After a refused hello or a failed transfer the endpoint serves nothing
        more: decode answers, waits for the sender to close, and closes it.
        """
        served = 0
        while True:
            wait = self.batch_timeout_s if served == 0 else self.idle_timeout_s
            try:
                [hello] = await _within(ep, [_recv_json(ep)], wait)
            except Exception as err:
                # Our own stop() aborting an endpoint that had said nothing yet is no failure.
                if self._stopped:
                    return
                timed_out = isinstance(err, TransferError) and err.timeout
                # A bad length or JSON that is no object (PROTOCOL), or no JSON at all.
                malformed = isinstance(err, _UNPARSABLE) or (
                    isinstance(err, TransferError) and not timed_out
                )
                if malformed or (timed_out and served == 0):
                    # A hello that came malformed, or none within batch_timeout_s on a new
                    # connection, is BAD_HELLO.
                    reason = "BAD_HELLO"
                elif served == 0:
                    # A connection whose receive failed before any hello (UCX saw the peer close
                    # or crash) is PEER_GONE, so that a prefill process killed mid-connection
                    # does not read as a forged hello.
                    reason = "PEER_GONE"
                else:
                    # After a completed transfer, the sender closing its idle endpoint is normal;
                    # so is no next hello within idle_timeout_s: prefill's reaper may come round
                    # to an idle endpoint later than that (EndpointPool._reap), or its host went
                    # away without a reset. Prefill never leases an endpoint idle for longer
                    # than its own idle timeout (EndpointPool.take), so nothing was lost.
                    if timed_out:
                        log.debug("idle UCX endpoint closed: no next hello", wait_s=wait)
                    return
                self.report(
                    "transfer_failed",
                    {"reason": reason, "error": type(err).__name__, "stage": "ucx_hello"},
                )
                return
            strays: list[int] = []
            if not await self._serve_one(ep, hello, strays):
                await self._linger(ep, strays)
                return
            served += 1

    async def _serve_one(self, ep: Any, hello: dict[str, Any], strays: list[int]) -> bool:
        """One transfer after its hello; True when it completed and the endpoint can serve the
        next one. On failure ``strays`` holds the tags of pages the sender may have sent that
        decode never received (``_linger`` drains them)."""
        rid = str(hello.get("reservation_id", ""))
        t = self.transfers.get(rid)
        # As bytes: compare_digest raises on a non-ASCII str, which skipped the report below.
        auth = str(hello.get("auth", "")).encode("utf-8", "surrogatepass")
        # The reservation decode issued under this id, if it knows one: its prompt pages and the
        # authenticator its hello must carry (a released one's, remembered; ``forget``).
        gone = self._released.get(rid) if t is None else None
        issued: tuple[int, bytes] | None = None
        if t is not None:
            issued = (len(t.pages), authenticator(t.secret, rid).encode())
        elif gone is not None:
            issued = (gone.pages, gone.auth)
        authentic = issued is not None and hmac.compare_digest(issued[1], auth)
        problem = None
        if t is None:
            if issued is not None:
                problem = RESERVATION_RELEASED
            elif self.restarted(rid):
                # Reserved on this node's previous process (a container restarted in place, same
                # node id): the node lost the request, which DESIGN.md makes UNAVAILABLE, not a
                # security event. Another node's id is not this: that node is alive, the hello
                # was misrouted or forged, UNKNOWN_RESERVATION below.
                problem = NODE_RESTARTED
            else:
                problem = "UNKNOWN_RESERVATION"
        elif not authentic:
            problem = "BAD_AUTHENTICATOR"
        elif t.state != InboundState.EXPECTING:
            problem = "REPLAY"  # a reservation accepts exactly one transfer
        # A prefill that says v >= 4 takes an answer as one frame.
        frame = PROTOCOL_VERSION >= WARM_VERSION and _version(hello) >= WARM_VERSION
        if problem is not None:
            # A late transfer, or one for a restarted process, is a failed one; anything else is
            # a wrong hello.
            kind, field = (
                ("transfer_failed", "reason")
                if problem in (RESERVATION_RELEASED, NODE_RESTARTED)
                else ("integrity_violation", "check")
            )
            payload: dict[str, Any] = {
                field: problem,
                "reservation_id": rid[:64],
                "stage": "ucx_hello",
            }
            if problem == RESERVATION_RELEASED and not authentic:
                # Not its prefill's (ids are no secret): decode bounds these events like any
                # other hello anyone can send (decode_svc), unlike a genuine late one.
                payload["authenticated"] = False
            # Its prefill's hello for a reservation released because its request ended: it
            # raced that end (``forget``), nothing was slow or wrong. Only the authenticator
            # makes it so: with an id alone anyone could silence the event of a reaped one.
            ended = gone.ended if gone is not None and authentic else None
            if ended is not None:
                with kvlog.request_context(*ended):
                    log.info(
                        "late KV hello refused: its request had ended",
                        reason=problem,
                        reservation_id=rid[:64],
                        stage="ucx_hello",
                    )
            else:
                self.report(kind, payload)
            if PROTOCOL_VERSION >= WARM_VERSION:
                # Drain at most what decode itself reserved, never what the sender says; and
                # without the reservation's authenticator (a forged hello, or one for an id
                # decode does not know, forgot or issued before a restart) at most a small
                # constant. The drain is there for a genuine sender, whose hello carries the
                # authenticator (a late one: decode released the reservation; a REPLAY):
                # its pages behind the refused header are all taken, so they neither stay in
                # UCX for good nor hold up the sender's rendezvous sends.
                if authentic:
                    assert issued is not None
                    cap = issued[0]
                elif issued is not None:
                    cap = min(issued[0], UNKNOWN_RESERVATION_STRAYS)
                else:
                    cap = UNKNOWN_RESERVATION_STRAYS
                strays.extend(self._stray_tags(rid, 0, hello.get("batch"), cap))
            refusal: dict[str, Any] = {"ok": False, "error": problem}
            if ended is not None:
                refusal["request_ended"] = True  # additive: a prefill before it reads the error
            with contextlib.suppress(Exception):
                await self._answer(ep, refusal, frame)
            return False
        assert t is not None
        self._unverified.discard(ep)  # it said a verified hello: no longer under the cap
        # Only now, with the hello verified, may anything be received into the reserved pages:
        # the pages of a warm hello's batch have been waiting in UCX, unmatched, until here.
        # The key makes a hello warm, whatever it holds: kvfence's sender leaves it out of a
        # cold hello, so a "batch" of null is a malformed header (PROTOCOL below), not a cold
        # opening to answer on its own while the sender waits for batch 0's answer.
        warm = PROTOCOL_VERSION >= WARM_VERSION and "batch" in hello
        first = hello["batch"] if warm else None
        t.state = InboundState.RECEIVING
        t.ep = ep
        self.transfers_served += 1
        self.pool.set_state(rid, PageState.RECEIVING)
        try:
            # v2: this endpoint serves further hellos after a completed transfer, and a batch
            # marked ``last`` is answered by the final answer (no separate ``done``); v3: page
            # tags scoped to the transfer (``page_tag``); v4: a hello may carry the first batch,
            # then one answer acknowledges both (a hello without one is answered on its own).
            if not warm:
                await self._answer(ep, {"ok": True}, frame)
            else:
                self.warm_hellos += 1
                if not isinstance(first, dict):
                    raise TransferError("hello batch is not an object", reason="PROTOCOL")
            await self._receive_batches(ep, t, first, frame, strays)
            if t.state != InboundState.RECEIVING:  # released as the last receives completed
                raise _released_during_transfer()
            t.state = InboundState.COMPLETE
            t.done.set()
            # The sender closes first (or sends the next hello): closing here could cancel the
            # final answer in flight, and prefill would report a complete transfer as failed.
            await self._answer(ep, {"ok": True, "received": len(t.received)}, frame)
            return True
        except asyncio.CancelledError:
            # The handler task itself cancelled (stop() gave up waiting for it): the posted
            # receives were settled on the way out, so the transfer is over; left RECEIVING, it
            # would read as in progress until the reservation timed out.
            if t.state == InboundState.RECEIVING:
                t.state = InboundState.CANCELLED
                t.error = "cancelled"
            raise
        except Exception as err:
            # One of decode's reasons, never an exception's class name (a UCX error reading a
            # batch header or sending an answer is TRANSFER_FAILED, as in ``_receive_pages``):
            # reasons are a bounded set, which events and prefill's status carry on.
            reason = err.reason if isinstance(err, TransferError) else "TRANSFER_FAILED"
            if t.state == InboundState.RECEIVING:
                t.state = InboundState.FAILED
                t.error = reason
                payload = {"reason": reason, "reservation_id": rid, "request_id": t.request_id}
                if not isinstance(err, TransferError):
                    payload["error"] = type(err).__name__  # what failed, as a hello's event says
                self.report("transfer_failed", payload)
            failure: dict[str, Any] = {"ok": False, "error": t.error}
            if t.state == InboundState.CANCELLED:
                # ``cancel`` (only decode's release calls it), whatever failed after it (the
                # check before posting, a timeout of the posted receives): the reservation is
                # released, which the answer says in a reason prefill knows.
                failure["error"] = RESERVATION_RELEASED
            if t.ended:
                # Released for its request's end while receiving (``cancel``): what a late hello
                # of such a reservation is told, so that prefill reports nothing either.
                failure["request_ended"] = True
                gone = self._released.get(rid)
                tenant = gone.ended[1] if gone is not None and gone.ended is not None else ""
                with kvlog.request_context(t.request_id, tenant):
                    log.info(
                        "KV transfer refused: its request had ended",
                        reason=RESERVATION_RELEASED,
                        reservation_id=rid[:64],
                        received=len(t.received),
                    )
            with contextlib.suppress(Exception):
                await self._answer(ep, failure, frame)
            return False
        finally:
            t.ep = None
            t.done.set()

    async def _answer(self, ep: Any, answer: dict[str, Any], frame: bool) -> None:
        """Answer prefill; a success names the version this decode speaks."""
        self.answers += 1
        if answer.get("ok"):
            answer = {**answer, "v": PROTOCOL_VERSION}
        await _send_json(ep, answer, reply=True, frame=frame)

    async def _linger(self, ep: Any, strays: Sequence[int] = ()) -> None:
        """Keep the endpoint open until the sender closes it (or a batch timeout), so the sender
        reads decode's last answer (success, or the reason of a failure) instead of a connection
        reset.

        Page bytes a failed sender still sends match no posted receive and reach no page; but the
        pages of a batch whose header decode refused (``strays``: a refused warm hello's batch 0,
        a batch with bad indices, or one whose reservation was released before its receives
        were posted) were sent right behind it, and UCX keeps a message nobody
        receives for as long as the worker lives (measured: about 7 KiB of memory kept per
        refused warm hello of 4 pages of 32 KiB). They are received here into a scratch page
        that nothing reads, and so let go. The receives are posted at once, before the sender
        can close (here ucxx matched no message queued for an endpoint that had closed), and
        they are at most as many as decode's own reservation holds, and at most
        ``UNKNOWN_RESERVATION_STRAYS`` behind a hello without the authenticator of the reservation
        it names (``_serve_one``), whatever number of indices the sender put in the header.
        """
        ops = [_recv(ep, np.empty(1, np.uint8), tag=LINGER_TAG)]
        if strays and self._scratch is None:
            self._scratch = np.empty(self.pool.page_bytes, np.uint8)
        drains = [asyncio.ensure_future(_recv(ep, self._scratch, tag=tag)) for tag in strays]
        self.strays_posted += len(drains)
        with contextlib.suppress(Exception):
            await _within(ep, [*ops, *drains], self.batch_timeout_s)
        self.strays_drained += sum(_succeeded(d) for d in drains)

    def _stray_tags(self, rid: str, batch: int, header: Any, cap: int) -> list[int]:
        """The tags of the pages a sender sends behind the header of batch ``batch``, at most
        ``cap``: the size of the reservation decode issued (or a small constant for one it does
        not know), never the sender's own count alone. Not decode's ``max_batch_bytes``: a
        prefill whose batches are larger (BATCH_TOO_LARGE, mid-rollout) sent them all."""
        indices = header.get("indices") if isinstance(header, dict) else None
        if not isinstance(indices, list):
            return []
        return page_tags(rid, batch, min(len(indices), cap, PAGE_TAG), PROTOCOL_VERSION)

    async def _receive_batches(
        self,
        ep: Any,
        t: InboundTransfer,
        first: dict[str, Any] | None,
        frame: bool,
        strays: list[int],
    ) -> None:
        """Receive the batches of a verified transfer; ``first``: the header of batch 0 when the
        hello carried it (its pages may already be waiting in UCX). A batch refused before its
        receives were posted (bad indices, too large, or its reservation released while the
        header was awaited: ``_receive_pages``'s check) leaves its tags in ``strays``."""
        page_bytes = self.pool.page_bytes
        for batch in itertools.count():
            if batch == 0 and first is not None:
                header = first
            else:
                # Received here, parsed after: a header that arrived whole but is malformed (a
                # bad length, not JSON, not an object) fails the transfer PROTOCOL on a sound
                # endpoint, so decode answers the reason like any other refused header. Raised
                # inside _within, the error aborted the endpoint first, and prefill read only a
                # lost connection. The hello stays parsed inside (_serve): an unverified peer's
                # malformed hello gets no answer.
                [body] = await _within(ep, [_recv_control(ep)], self.batch_timeout_s)
                try:
                    header = _batch_header_object(body)
                except TransferError:
                    if t.state != InboundState.RECEIVING:  # released meanwhile: see below
                        raise _released_during_transfer() from None
                    raise
            if header.get("done"):
                return
            # Bounded by decode's own reservation, not by its max_batch_bytes: a batch refused as
            # BATCH_TOO_LARGE had every one of its pages sent behind the header.
            strays[:] = self._stray_tags(t.reservation_id, batch, header, len(t.pages))
            if t.state != InboundState.RECEIVING:
                # Released while the header was awaited (``cancel``'s ``request_ended`` leaves the
                # endpoint open): refused as released before the header is judged, as an abort
                # left it unread; its pages are drained as strays.
                raise _released_during_transfer()
            indices = header.get("indices")
            if not isinstance(indices, list) or not indices:
                raise TransferError("batch without indices", reason="PROTOCOL")
            seen = set(t.received)
            for i in indices:
                if type(i) is not int or not 0 <= i < len(t.pages):
                    raise TransferError(f"page index {i} outside the reservation", "COVERAGE")
                if i in seen:
                    raise TransferError(f"page index {i} sent twice", reason="DUPLICATE_PAGE")
                seen.add(i)
            if len(indices) > pages_per_batch(self.max_batch_bytes, page_bytes):
                # Not an integrity failure: prefill's transfer.max_batch_bytes is over decode's
                # (a rollout that raises it, half done), which no bytes or forgery explain.
                raise TransferError(
                    "batch over decode's transfer.max_batch_bytes", reason="BATCH_TOO_LARGE"
                )
            try:
                await self._receive_pages(ep, t, batch, indices)
            except TransferError as err:
                # Refused before any receive was posted (released while the header was awaited):
                # the pages behind this header are still strays, for _linger to drain. Any
                # other failure came after the receives were posted, which aborted the endpoint.
                if err.reason != RESERVATION_RELEASED:
                    strays.clear()
                raise
            strays.clear()  # received now
            if t.state != InboundState.RECEIVING:
                # Released while the batch's receives were posted, and they were left to settle
                # (``cancel``'s ``request_ended``): refused now, not acknowledged, so that no
                # further batch is sent.
                raise _released_during_transfer()
            t.received.extend(indices)
            t.bytes_received += len(indices) * page_bytes
            if header.get("last"):
                return  # the final answer acknowledges this batch
            await self._answer(ep, {"ok": True}, frame)

    async def _receive_pages(
        self, ep: Any, t: InboundTransfer, batch: int, indices: list[int]
    ) -> None:
        refs = [t.pages[i] for i in indices]
        pids = [r.page_id for r in refs]
        # The tags of the version this decode said it speaks (read now: tests play older ones).
        tags = page_tags(t.reservation_id, batch, len(pids), PROTOCOL_VERSION)
        # The reservation may have been released while this handler awaited the batch header
        # (decode's Release: cancel, free, forget), and its pages reserved again for another
        # request: a receive posted now would land in that request's pages. Only the endpoint's
        # abort stood in the way. Checked with no await before the receives are posted.
        if t.state != InboundState.RECEIVING or not self.pool.owns(t.reservation_id, refs):
            raise _released_during_transfer()
        self.pool.begin_ops(pids)
        try:
            # Every receive lands straight in a reserved page; on any failure the endpoint is
            # aborted and every receive has completed before the operations end.
            await _within(
                ep,
                [
                    _recv(ep, self.pool.page_buffer(pid), tag=tag)
                    for pid, tag in zip(pids, tags, strict=True)
                ],
                self.batch_timeout_s,
            )
        except TransferError as err:
            raise TransferError("page batch timed out", "TIMEOUT", timeout=True) from err
        except Exception as err:
            raise TransferError(f"page receive failed: {err!r}") from err
        finally:
            self.pool.end_ops(pids)


def _released_during_transfer() -> TransferError:
    """Decode's Release came while the transfer's handler ran (late, not forged)."""
    return TransferError(
        "the reservation was released during the transfer", reason=RESERVATION_RELEASED
    )


@dataclass
class OutboundPage:
    """One page to send: the destination index and the bytes (a view of prefill's page)."""

    index: int
    data: Any


class EndpointPool:
    """Prefill's idle, already-handshaken endpoints, per decode address ``(host, port)``.

    A transfer leases one endpoint exclusively (:meth:`take` or :meth:`connect`) and then either
    gives it back after a completed transfer (:meth:`give_back`: idle again, or closed when
    ``max_idle_per_peer`` are already idle for that address) or discards it (:meth:`discard`:
    aborted, never reused) after any error, timeout or cancellation. Idle endpoints are closed
    after ``idle_timeout_s`` by a reaper task that runs only while some are idle, and all of them
    by :meth:`close`. ``max_idle_per_peer=0`` turns pooling off (one endpoint per transfer).

    The pool remembers, per endpoint, the protocol version decode said on it (given to
    :meth:`give_back`, read with :meth:`peer_version` while leased; 0 = unknown, as for a new
    endpoint): it decides whether the next transfer may send its first batch with the hello.

    A connect (:meth:`connect`) that timed out or whose transfer was cancelled is never cut
    short: the pool keeps it until it ends, by itself, bounded by ucxx's own handshake timeouts,
    and discards its endpoint unused, without a hello. :meth:`close` waits for those up to
    ``ABANDONED_CONNECTS_STOP_S``.
    """

    def __init__(self, *, max_idle_per_peer: int = 32, idle_timeout_s: float = 30.0):
        if max_idle_per_peer < 0 or idle_timeout_s <= 0:
            raise ValueError("max_idle_per_peer must be >= 0 and idle_timeout_s > 0")
        self.max_idle_per_peer = max_idle_per_peer
        self.idle_timeout_s = idle_timeout_s
        # idle endpoints per address: (endpoint, idle since, decode's protocol version)
        self._idle: dict[tuple[str, int], list[tuple[Any, float, int]]] = {}
        self._leased: dict[Any, int] = {}  # leased endpoint -> decode's protocol version
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self._abandoned: set[asyncio.Future[Any]] = set()  # connects no one waits for
        # counters (tests, metrics, benchmarks)
        self.opened = 0  # endpoints created
        self.reused = 0  # transfers that started on an idle endpoint
        self.discarded = 0  # endpoints aborted after an error (or found dead)
        self.expired = 0  # idle endpoints closed after idle_timeout_s

    @property
    def open_endpoints(self) -> int:
        """Endpoints this pool holds now: idle plus leased to a running transfer."""
        return len(self._leased) + sum(len(v) for v in self._idle.values())

    @property
    def abandoned_connects(self) -> int:
        """Connects still running that timed out or whose transfer was cancelled."""
        return len(self._abandoned)

    def idle(self, host: str, port: int) -> int:
        return len(self._idle.get((host, port), []))

    def take(self, host: str, port: int) -> Any | None:
        """Lease the most recently used idle endpoint to ``(host, port)``, or None."""
        idle = self._idle.get((host, port), [])
        now = time.monotonic()
        while idle:
            ep, since, version = idle.pop()
            if ep.closed:  # UCX already saw the peer go away
                self.discarded += 1
                _abort(ep)
                continue
            if now - since >= self.idle_timeout_s:
                # The reaper has not come round to it yet, but decode may already have closed
                # its side (it waits idle_timeout_s + batch_timeout_s): never lease it.
                self.expired += 1
                _abort(ep)
                continue
            self._leased[ep] = version
            self.reused += 1
            return ep
        return None

    def peer_version(self, ep: Any) -> int:
        """The protocol version decode said on a leased endpoint (0: not known yet)."""
        return self._leased.get(ep, 0)

    async def connect(self, host: str, port: int, timeout: float) -> Any:
        """Lease a new endpoint (UCX's handshake only; the caller says hello).

        Neither ``timeout`` nor a cancellation cuts ucxx's connect short: it goes on without the
        caller, who gets UNREACHABLE (or its CancelledError) at once, and the pool discards the
        endpoint unused when it ends (``_abandon``), bounded by ucxx's own handshake timeouts.
        Cut short while ucxx exchanged its peer information, a connect crashed the process (a
        segfault in each of 3 runs here of up to 300 cancels, the listener in the same process);
        aborting the endpoint of a connect that had returned did not (2 runs of 300 aborts
        right after it)."""
        import ucxx

        if self._closed:
            raise TransferError("endpoint pool is closed", "UNREACHABLE")
        connecting = asyncio.ensure_future(ucxx.create_endpoint(host, port))
        try:
            await asyncio.wait({connecting}, timeout=timeout)
        except BaseException:
            self._abandon(connecting)
            raise
        if not connecting.done():
            self._abandon(connecting)
            raise TransferError(
                f"cannot reach decode at {host}:{port}: no connection within {timeout} s",
                "UNREACHABLE",
            )
        try:
            ep = connecting.result()
        except Exception as err:
            raise TransferError(
                f"cannot reach decode at {host}:{port}: {err!r}", "UNREACHABLE"
            ) from err
        self.opened += 1
        self._leased[ep] = 0
        return ep

    def give_back(
        self, host: str, port: int, ep: Any, *, reusable: bool = True, version: int | None = None
    ) -> None:
        """A leased endpoint whose transfer completed (every operation on it done): idle again,
        unless the pool is full for that address, closed, or ``reusable`` is False. ``version``:
        the protocol version decode said on it (None: keep what the pool knew)."""
        known = self._leased.pop(ep, 0)
        version = known if version is None else version
        idle = self._idle.get((host, port), [])
        if not reusable or self._closed or ep.closed or len(idle) >= self.max_idle_per_peer:
            _abort(ep)
            return
        idle.append((ep, time.monotonic(), version))
        self._idle[(host, port)] = idle
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def discard(self, ep: Any) -> None:
        """A leased endpoint after an error: abort it, never reuse it."""
        self._leased.pop(ep, None)
        self.discarded += 1
        _abort(ep)

    def _abandon(self, connecting: asyncio.Future[Any]) -> None:
        """A ucxx connect that :meth:`connect` no longer waits for (timed out, or cancelled): it
        runs to its end, and the endpoint it makes, if any, is aborted then, unused."""
        self._abandoned.add(connecting)
        connecting.add_done_callback(self._abandoned_done)

    def _abandoned_done(self, connecting: asyncio.Future[Any]) -> None:
        self._abandoned.discard(connecting)
        if not connecting.cancelled() and connecting.exception() is None:
            self.opened += 1
            self.discarded += 1
            _abort(connecting.result())

    def expire(self, now: float | None = None) -> None:
        """Close idle endpoints unused for ``idle_timeout_s``."""
        now = time.monotonic() if now is None else now
        for key, idle in list(self._idle.items()):
            keep = []
            for entry in idle:
                ep, since, _ = entry
                if now - since >= self.idle_timeout_s or ep.closed:
                    self.expired += 1
                    _abort(ep)
                else:
                    keep.append(entry)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def _reap(self) -> None:
        period = min(max(self.idle_timeout_s / 4, 0.05), 5.0)
        while self._idle:
            await asyncio.sleep(period)
            self.expire()

    async def close(self) -> None:
        """Close every idle endpoint and stop the reaper; endpoints still leased are closed when
        their transfer gives them back or discards them. Abandoned connects are waited for up
        to ``ABANDONED_CONNECTS_STOP_S`` (each discards its endpoint as it ends): one the event
        loop's end cancels would be cut short."""
        self._closed = True
        if self._abandoned:
            await asyncio.wait(set(self._abandoned), timeout=ABANDONED_CONNECTS_STOP_S)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for idle in self._idle.values():
            for ep, _, _ in idle:
                _abort(ep)
        self._idle.clear()


def _abort(ep: Any) -> None:
    with contextlib.suppress(Exception):
        ep.abort()


def host_port(address: str) -> tuple[str, int]:
    """The host and port of a decode UCX address, ``HOST:PORT`` (what :func:`send_pages`
    dials; the host as written, up to the last colon). ValueError when it is not one: no host, or
    a port that is not a number from 1 to 65535 in ASCII digits. Prefill checks a reservation's
    address with it before the forward pass (prefill_svc)."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


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
    endpoints: EndpointPool | None = None,
    auth_override: str | None = None,
    stall_after_hello_s: float = 0.0,
) -> float:
    """Send ``pages`` to decode; returns seconds taken. Raises TransferError on the first error.

    With ``endpoints`` the transfer runs on an idle endpoint of that pool when there is one (and
    gives it back when the transfer completed); without, on a new endpoint closed at the end. On a
    warm endpoint (decode said v >= 4 on it) the hello carries the first batch (module docstring).
    Cancelled, it ends at once, every posted operation settled; a connect it was waiting for goes
    on in the pool (:meth:`EndpointPool.connect`).
    """

    host, port = host_port(address)
    pool = endpoints if endpoints is not None else EndpointPool(max_idle_per_peer=0)
    start = time.perf_counter()
    per_batch = pages_per_batch(max_batch_bytes, page_bytes)
    batches = [pages[b : b + per_batch] for b in range(0, len(pages), per_batch)]
    hello = {
        "reservation_id": reservation_id,
        "request_id": request_id,
        "auth": auth_override or authenticator(secret, reservation_id),
        "v": PROTOCOL_VERSION,  # v >= 4: decode may answer in frames
    }
    ep: Any = None
    version = 0
    warm = False  # the hello carried batch 0 and decode acknowledged both
    pooled = pool.take(host, port)
    if pooled is not None and pool.peer_version(pooled) >= WARM_VERSION:
        # One round trip, cut short by a cancellation like any step (every operation is settled).
        try:
            version = await _warm_hello(
                pooled, hello, batches, reservation_id, batch_timeout_s, stall_after_hello_s
            )
            ep, warm = pooled, True
        except _HelloNotSent as err:
            # The hello never left, so decode cannot have accepted anything: say it once more on
            # a new endpoint. Any other failure is final (decode may have taken the hello).
            pool.discard(pooled)
            log.info("pooled endpoint failed its hello; retrying on a new one", error=str(err))
        except BaseException:
            pool.discard(pooled)
            raise
        pooled = None
    if ep is None:
        ep, version = await _open(pool, host, port, hello, batch_timeout_s, pooled)
    ok = False
    try:
        if stall_after_hello_s and not warm:  # fault hook only: a sender that stalls mid-transfer
            await asyncio.sleep(stall_after_hello_s)
        frame = version >= WARM_VERSION
        for k in range(1 if warm else 0, len(batches)):
            await _send_json(ep, _batch_header(batches, k, version), frame=frame)
            await _send_batch(ep, batches[k], _batch_tags(reservation_id, batches, k, version),
                              batch_timeout_s)  # fmt: skip
        if not warm and (version < 2 or not batches):
            await _send_json(ep, {"done": True}, frame=frame)
            await _expect_ok(ep, batch_timeout_s)
        ok = True
    except TransferError:
        raise
    except Exception as err:
        raise TransferError(f"transfer failed: {err!r}") from err
    finally:
        # Every operation of this transfer has completed by now (``_within``/``_settle``).
        if ok:
            # A decode before v2 lingers after its final answer and serves no second hello.
            pool.give_back(host, port, ep, reusable=version >= 2, version=version)
        else:
            pool.discard(ep)
    return time.perf_counter() - start


def _batch_header(
    batches: Sequence[Sequence[OutboundPage]], k: int, version: int
) -> dict[str, Any]:
    """The header of batch ``k`` (``done`` when there is no page at all)."""
    if not batches:
        return {"done": True}
    header: dict[str, Any] = {"indices": [p.index for p in batches[k]]}
    if version >= 2 and k == len(batches) - 1:
        header["last"] = True  # decode's final answer acknowledges it
    return header


def _batch_tags(
    reservation_id: str, batches: Sequence[Sequence[OutboundPage]], k: int, version: int
) -> list[int]:
    if not batches:
        return []
    return page_tags(reservation_id, k, len(batches[k]), version)


class _HelloNotSent(TransferError):
    """A warm hello whose own send failed: decode cannot have received it, so it accepted
    nothing (a UCX message is matched whole or not at all) and the hello may be said again."""


async def _warm_hello(
    ep: Any,
    hello: dict[str, Any],
    batches: Sequence[Sequence[OutboundPage]],
    reservation_id: str,
    timeout: float,
    stall: float,
) -> int:
    """On a warm endpoint: the hello carrying batch 0, batch 0's pages right behind it, and
    decode's one answer to both; returns decode's protocol version.

    Raises :class:`_HelloNotSent` when the hello's own send failed (the peer was gone before it
    left) and TransferError on every other failure; every operation has settled by then.
    """
    header = _batch_header(batches, 0, WARM_VERSION)
    hello_ops = [
        asyncio.ensure_future(op) for op in _json_ops(ep, {**hello, "batch": header}, frame=True)
    ]
    reply = asyncio.ensure_future(_recv_json(ep, reply=True))
    sends: list[asyncio.Future[Any]] = []
    try:
        try:
            if stall:  # fault hook only: a sender that stalls between its hello and its pages
                await asyncio.sleep(stall)
            tags = _batch_tags(reservation_id, batches, 0, WARM_VERSION)
            sends = [
                asyncio.ensure_future(_send(ep, p.data, tag=tag))
                for p, tag in zip(batches[0] if batches else [], tags, strict=True)
            ]
            answer = await _await_answer(ep, [*hello_ops, *sends], reply, timeout)
        finally:
            await _settle(ep, [*hello_ops, *sends, reply])
    except TransferError as err:
        if err.refused or err.timeout or all(_succeeded(op) for op in hello_ops):
            raise
        raise _HelloNotSent(str(err)) from err
    except Exception as err:
        if all(_succeeded(op) for op in hello_ops):
            raise TransferError(f"transfer failed: {err!r}") from err
        raise _HelloNotSent(f"hello not sent: {err!r}") from err
    version = _version(answer)
    if version < WARM_VERSION:
        # decode changed under an endpoint that said v >= 4: it cannot have taken the batch
        raise TransferError(f"warm hello answered by protocol {version!r}", reason="PROTOCOL")
    return version


def _succeeded(op: asyncio.Future[Any]) -> bool:
    return op.done() and not op.cancelled() and op.exception() is None


async def _open(
    pool: EndpointPool, host: str, port: int, hello: dict[str, Any], timeout: float, pooled: Any
) -> tuple[Any, int]:
    """A leased endpoint on which decode accepted ``hello`` (the two-step hello of a cold
    endpoint), and decode's protocol version; the endpoint is discarded on failure.

    ``pooled`` (an idle endpoint already leased, or None) is tried first. If its hello fails
    before decode answered (the peer restarted or closed it meanwhile; nothing of this transfer
    was sent but the hello), it is discarded and the hello is said once more on a new endpoint.
    A refusal or a timeout is final.

    A cancellation ends it at once: a hello's operations are settled (the endpoint aborted) and
    the endpoint discarded; a connect in progress goes on without it (``EndpointPool.connect``).
    """
    if pooled is not None:
        try:
            return pooled, await _hello(pooled, hello, timeout)
        except TransferError as err:
            pool.discard(pooled)
            if err.refused or err.timeout:
                raise
            log.info("pooled endpoint failed its hello; retrying on a new one", error=str(err))
        except BaseException:
            pool.discard(pooled)
            raise
    ep = await pool.connect(host, port, timeout)
    try:
        return ep, await _hello(ep, hello, timeout)
    except BaseException:
        pool.discard(ep)
        raise


async def _hello(ep: Any, hello: dict[str, Any], timeout: float) -> int:
    """Say hello; returns decode's protocol version (1 when its answer names none)."""
    try:
        await _send_json(ep, hello)
        [reply] = await _within(ep, [_recv_json(ep, reply=True)], timeout)
        _check_reply(reply)
        return _version(reply)
    except TransferError:
        raise
    except Exception as err:
        raise TransferError(f"transfer failed: {err!r}") from err


async def _send_batch(
    ep: Any, batch: Sequence[OutboundPage], tags: Sequence[int], timeout: float
) -> None:
    """Send one batch and wait for decode's verdict."""
    sends = [
        asyncio.ensure_future(_send(ep, p.data, tag=tag))
        for p, tag in zip(batch, tags, strict=True)
    ]
    reply = asyncio.ensure_future(_recv_json(ep, reply=True))
    try:
        await _await_answer(ep, sends, reply, timeout)
    finally:
        await _settle(ep, [*sends, reply])


async def _await_answer(
    ep: Any, sends: Sequence[asyncio.Future[Any]], reply: asyncio.Future[Any], timeout: float
) -> dict[str, Any]:
    """Decode's answer (``reply``, posted) to ``sends`` (posted); the caller settles them all.

    The answer wins: a refusal can arrive while sends are still pending (a rendezvous send waits
    for a receive, and decode posts only scratch ones, after refusing), and a send that fails
    because decode ended the endpoint after answering must not hide its reason.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # One waiter, woken by the answer or by the first failed send: waiting on every send anew
    # after each one completes cost O(pages^2) callbacks per batch.
    wake = loop.create_future()

    def on_done(f: asyncio.Future[Any]) -> None:
        if not wake.done() and (f is reply or f.cancelled() or f.exception() is not None):
            wake.set_result(None)

    ops = [reply, *sends]
    for f in ops:
        f.add_done_callback(on_done)
    try:
        await asyncio.wait([wake], timeout=timeout)
    finally:
        for f in ops:
            f.remove_done_callback(on_done)
    if not reply.done():
        if not wake.done():
            raise TransferError("transfer batch timed out", "TIMEOUT", timeout=True)
        await _settle(ep, ops)  # a send failed: abort; the answer, if any, is not coming now
    answer = reply.result()  # decode's verdict, or the endpoint's error
    if not answer.get("ok") and not all(s.done() for s in sends):
        # Refused with sends pending (rendezvous pages, sent behind a header decode refused):
        # decode receives those into scratch (KvReceiver._linger) and so lets them go. Give it
        # a moment before the caller aborts the endpoint, which otherwise could cut them off
        # half-matched on either side.
        await asyncio.wait(sends, timeout=min(max(deadline - loop.time(), 0.0), REFUSED_SENDS_S))
    _check_reply(answer)
    # decode acknowledged: it received every page, so the sends complete (or have completed)
    left = max(deadline - loop.time(), 0.0)
    if not all(s.done() for s in sends):
        _, pending = await asyncio.wait(sends, timeout=left)
        if pending:
            raise TransferError("transfer batch timed out", "TIMEOUT", timeout=True)
    for s in sends:
        s.result()
    return answer


async def _expect_ok(ep: Any, timeout: float) -> None:
    [reply] = await _within(ep, [_recv_json(ep, reply=True)], timeout)
    _check_reply(reply)


def _version(message: dict[str, Any]) -> int:
    """The protocol version a hello or an answer names (1 when it names none)."""
    version = message.get("v", 1)
    return version if isinstance(version, int) and not isinstance(version, bool) else 1


def _check_reply(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        reason = str(reply.get("error"))
        # Only a late transfer's refusal can say its request ended (``KvReceiver.forget``).
        ended = reason == RESERVATION_RELEASED and reply.get("request_ended") is True
        raise TransferError(
            f"decode refused: {reason}",
            reason,
            timeout=reason == "TIMEOUT",
            refused=True,
            request_ended=ended,
        )
