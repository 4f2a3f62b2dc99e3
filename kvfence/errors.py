"""One error base class and the DESIGN.md status taxonomy.

Every failure that reaches a client is a :class:`KvfenceError` subclass carrying its gRPC status
code, a machine-readable ``reason`` (``google.rpc.ErrorInfo.reason``) and metadata. Messages never
contain another request's data: build them from numbers and ids of the failing request only.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "kvfence.dev"
# ErrorInfo reason of a node that is shutting down and refuses new work (a Reserve or Prefill):
# UNAVAILABLE, and nothing was taken for the request, so the control plane tries another node.
NODE_DRAINING = "NODE_DRAINING"
# A Decode, or a UCX hello, for a reservation decode issued and has released since (after
# transfer.reservation_timeout_s without its Decode, or by a Release): the request was too slow
# or ended, nothing was read, so not an integrity failure. UNAVAILABLE: a retry reserves anew.
RESERVATION_RELEASED = "RESERVATION_RELEASED"
# A UCX hello, or a Decode, for a reservation of another process of the same decode node (same
# node id: it restarted in place since the Reserve, kvfence.transfer.reservation_origin): the
# node lost the request, nothing was read, so not an integrity failure. UNAVAILABLE: a retry
# reserves anew. An id another decode node issued is not this (UNKNOWN_RESERVATION).
NODE_RESTARTED = "NODE_RESTARTED"
# A request ended because the API key it was sent with was revoked while it waited or ran.
API_KEY_REVOKED = "API_KEY_REVOKED"
# INVALID_ARGUMENT for a request's parameters: the control plane's refusal
# (control_plane.admission) and the Python client's, of arguments the wire cannot carry.
INVALID_PARAMETERS = "INVALID_PARAMETERS"

# Every check whose failure a service counts in kvfence_integrity_failures_total{check}: the
# reasons of the IntegrityErrors the KV path raises (manifest, tag, stream checks) and the
# transfer's (kvfence.transfer.INTEGRITY_REASONS). Each service exports every one at 0 from its
# start, so that a check's first failure is an increase from 0: a series born at 1 is no increase
# to Prometheus's increase(), and KvfenceIntegrityCheckFailed would miss it. A test keeps this in
# step with the code.
INTEGRITY_CHECKS = frozenset(
    {
        # kvfence.manifest: decode's checks of a transfer manifest
        "RESERVATION", "MAC", "COUNT", "COVERAGE", "GENERATION", "CHECKSUM", "MODEL", "LAYOUT",
        # a page at another generation in a forward pass or decode step
        "PAGE_GENERATION",
        # the control plane's checks of prefill's answer and decode's stream
        "MANIFEST_MISMATCH", "FINISH_REASON", "FIRST_TOKEN_MISMATCH", "TOO_MANY_TOKENS",
        "STREAM_ORDER", "UNVERIFIED",
        # the UCX transfer: a wrong hello, a wrong batch, a broken protocol
        "UNKNOWN_RESERVATION", "BAD_AUTHENTICATOR", "REPLAY", "DUPLICATE_PAGE", "PROTOCOL",
    }
)  # fmt: skip


# The most of a message a status carries, in UTF-8 bytes. gRPC sends it twice (grpc-message,
# percent-encoded, and inside grpc-status-details-bin), and past its metadata limit (8 KiB) the
# client gets RESOURCE_EXHAUSTED instead of the status: a message that echoes a long input (a
# tenant name, a model name) must not turn a client's INVALID_ARGUMENT into "retry later".
MAX_STATUS_MESSAGE_BYTES = 1024


def _capped(message: str) -> str:
    data = message.encode()
    if len(data) <= MAX_STATUS_MESSAGE_BYTES:
        return message
    head = data[:MAX_STATUS_MESSAGE_BYTES].decode(errors="ignore")
    return f"{head}... ({len(data)} bytes, cut)"


class KvfenceError(Exception):
    """Base of every kvfence error; subclasses fix the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"
    # The node whose RPC failed with this error (the control plane's view); None when the check
    # that raised it ran here. A failed check is counted where it ran, once.
    reported_by: str | None = None

    def __init__(
        self, message: str, *, reason: str | None = None, metadata: Mapping[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}

    def to_status(self) -> grpc.Status:
        """A rich status with ``google.rpc.ErrorInfo`` for ``context.abort_with_status``; the
        message cut to MAX_STATUS_MESSAGE_BYTES (logs keep ``message`` whole)."""
        info = error_details_pb2.ErrorInfo(
            reason=self.reason, domain=ERROR_DOMAIN, metadata=self.metadata
        )
        detail = any_pb2.Any()
        detail.Pack(info)
        status = status_pb2.Status(
            code=getattr(code_pb2, self.code.name), message=_capped(self.message), details=[detail]
        )
        return rpc_status.to_status(status)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(KvfenceError):
    """Bad parameters, or prompt + max_new_tokens over the admissible limit. Never retry."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class ResourceExhausted(KvfenceError):
    """No capacity before the deadline, or a tenant quota. May succeed later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unauthenticated(KvfenceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(KvfenceError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class Unavailable(KvfenceError):
    """Model offline, node lost mid-request."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class DeadlineExceeded(KvfenceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class NotFound(KvfenceError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class Cancelled(KvfenceError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class IntegrityError(KvfenceError):
    """A manifest, tag, checksum, count or MAC check failed: DATA_LOSS, never OK with wrong data.

    ``reason`` names the check, e.g. ``MAC_MISMATCH``, ``CHECKSUM_MISMATCH``, ``PAGE_GENERATION``.
    """

    code = grpc.StatusCode.DATA_LOSS
    default_reason = "INTEGRITY"


_BY_CODE: dict[grpc.StatusCode, type[KvfenceError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        DeadlineExceeded,
        NotFound,
        Cancelled,
        IntegrityError,
    )
}


def error_info(err: grpc.aio.AioRpcError | grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ``ErrorInfo`` detail of a failed call, if the server attached one.

    None as well when the rich status disagrees with the call's code: grpc replaces the code
    (RESOURCE_EXHAUSTED) when the server's status overflowed the metadata limit, and from_call
    then raises ValueError; the code alone decides the error's class then."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except ValueError:
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def from_rpc_error(err: grpc.RpcError) -> KvfenceError:
    """Rebuild the typed error from a failed call, keeping code, message and ErrorInfo."""
    code = err.code()  # type: ignore[attr-defined]
    cls = _BY_CODE.get(code, KvfenceError)
    info = error_info(err)
    out = cls(
        err.details() or code.name,  # type: ignore[attr-defined]
        reason=info.reason if info else None,
        metadata=dict(info.metadata) if info else None,
    )
    if cls is KvfenceError:
        out.code = code
    return out
