"""The operator API (``Admin``), on its own listener, behind the admin token.

The token comes from ``control_plane.admin_token_file`` when set; otherwise it is generated at the
first start and kept in ``<state_dir>/admin_token`` (mode 0600), so restarts keep it. Every call
refused for its credential (none, a wrong one, a tenant API key) is counted in
``kvfence_auth_failures_total{listener="admin"}`` and logged throttled, without the credential.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from control_plane.admission import TENANT_CONCURRENCY, over_tenant_tokens
from control_plane.lifecycle import RequestState
from control_plane.pipeline import PipelineDeps
from control_plane.registry import Node
from control_plane.tenants import Tenant, TenantLimits, TenantStore
from kvfence.auth import ADMIN_TOKEN_FILE, load_or_create_token
from kvfence.config import ControlPlaneConfig
from kvfence.errors import (
    API_KEY_REVOKED,
    Cancelled,
    KvfenceError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvfence.logging import get_logger
from kvfence.proto.kvfence.v1 import control_pb2, control_pb2_grpc
from kvfence.server import abort, bearer_token

log = get_logger("admin")
R = TypeVar("R")
BACKUP_CHUNK_BYTES = 1 << 20  # well under the 64 MiB message limit of every channel


def load_admin_token(cp: ControlPlaneConfig) -> str:
    """The configured admin token, or the one generated at first start under ``state_dir``."""
    return load_or_create_token(cp.admin_token_file, Path(cp.state_dir), ADMIN_TOKEN_FILE, "kvfa_")


def tenant_pb(tenant: Tenant) -> control_pb2.Tenant:
    return control_pb2.Tenant(
        name=tenant.name,
        limits=limits_pb(tenant.limits),
        keys=[
            control_pb2.ApiKeyInfo(key_id=k.key_id, revoked=k.revoked, created_at=k.created_at)
            for k in tenant.keys
        ],
    )


def limits_pb(limits: TenantLimits) -> control_pb2.TenantLimits:
    return control_pb2.TenantLimits(
        max_concurrent_requests=limits.max_concurrent_requests,
        max_tokens_per_request=limits.max_tokens_per_request,
        scrub_on_free=limits.scrub_on_free,
    )


def limits_from_pb(pb: control_pb2.TenantLimits) -> TenantLimits:
    return TenantLimits(pb.max_concurrent_requests, pb.max_tokens_per_request, pb.scrub_on_free)


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def _admin_only(method: Handler[R]) -> Handler[R]:
    """Check the admin token first; turn KvfenceError into the call's status."""

    @functools.wraps(method)
    async def wrapper(self: AdminServicer, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            self.authorize(context, method.__name__)
            return await method(self, request, context)
        except KvfenceError as err:
            await abort(context, err)

    return wrapper


class AdminServicer(control_pb2_grpc.AdminServicer):
    """Tenants, nodes, model access, requests and the pool check, for operators."""

    def __init__(
        self,
        token: str,
        tenants: TenantStore,
        deps: PipelineDeps,
        clamp_context: bool,
        on_access_change: Callable[[bool, str], None],
    ):
        self._token = token
        self.tenants = tenants
        self.d = deps
        self.clamp_context = clamp_context
        self._on_access_change = on_access_change

    def authorize(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Raise unless the call carries the admin token. A refusal is counted in
        ``auth_failures_total{listener="admin"}`` and logged without the token, throttled
        (``Metrics.credential_refused``): a guessing loop on the admin port is seen."""
        token = bearer_token(context)
        err: KvfenceError
        if token is None:
            err = Unauthenticated("missing admin token ('authorization: Bearer <token>' metadata)")
            reason = "no admin token"
        elif hmac.compare_digest(token.encode(), self._token.encode()):
            return
        elif self.tenants.authenticate(token) is not None:
            # A live tenant key: its holder is a customer (or has one's key) probing the
            # operator API, worth an operator's notice as much as a wrong token.
            err = PermissionDenied("a tenant API key cannot use the admin API")
            reason = "a tenant API key"
        else:
            err = Unauthenticated("the admin token is not valid")
            reason = "wrong admin token"
        self.d.metrics.credential_refused(
            listener="admin",
            method=method,
            status=err.code.name,
            reason=reason,
            peer=context.peer(),
        )
        raise err

    # -- tenants -----------------------------------------------------------------------------------

    @_admin_only
    async def CreateTenant(
        self, request: control_pb2.CreateTenantRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.CreateTenantResponse:
        tenant, api_key, key_id = self.tenants.create_tenant(
            request.name, limits_from_pb(request.limits)
        )
        log.info("tenant created", tenant=tenant.name, key_id=key_id)
        return control_pb2.CreateTenantResponse(
            tenant=tenant_pb(tenant), api_key=api_key, key_id=key_id
        )

    @_admin_only
    async def ListTenants(
        self, request: control_pb2.ListTenantsRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ListTenantsResponse:
        # No names: every tenant, as before the field (the store's None; its empty list is none).
        # Named: those that exist, each with its keys, and no other tenant's read.
        tenants = self.tenants.list(list(request.names) or None)
        return control_pb2.ListTenantsResponse(tenants=[tenant_pb(t) for t in tenants])

    @_admin_only
    async def CreateKey(
        self, request: control_pb2.CreateKeyRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.CreateKeyResponse:
        api_key, key_id = self.tenants.create_key(request.tenant)
        log.info("api key created", tenant=request.tenant, key_id=key_id)
        return control_pb2.CreateKeyResponse(api_key=api_key, key_id=key_id)

    @_admin_only
    async def RevokeKey(
        self, request: control_pb2.RevokeKeyRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.RevokeKeyResponse:
        revoked = self.tenants.revoke_key(request.key_id)
        # "Refused from now on" covers the requests already sent with it: one queued for pages
        # could otherwise start up to max_deadline_s later (a leaked key's last word), and the
        # running ones stop too.
        digest = self.tenants.key_sha256(request.key_id)
        ended = [
            run.record.request_id
            for run in list(self.d.table)
            if digest
            and run.key_sha256 == digest
            and run.interrupt(
                Unauthenticated(
                    "the API key this request was sent with has been revoked",
                    reason=API_KEY_REVOKED,
                )
            )
        ]
        log.info("api key revoked", key_id=request.key_id, requests_ended=len(ended))
        return control_pb2.RevokeKeyResponse(revoked=revoked)

    @_admin_only
    async def SetLimits(
        self, request: control_pb2.SetLimitsRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.Tenant:
        tenant = self.tenants.set_limits(
            request.name, limits_from_pb(request.limits), request.fields
        )
        ended = self._apply_limits(tenant)
        log.info("tenant limits set", tenant=tenant.name, requests_ended=ended)
        return tenant_pb(tenant)

    def _apply_limits(self, tenant: Tenant) -> int:
        """New limits reach the tenant's requests in flight: each reserves (and chooses
        scrub_on_free) under them. Running ones (pages reserved) go on; waiting ones (no pages
        yet) that the limits refuse end as a new request would be refused: over the tokens per
        request, or, oldest kept first, beyond the concurrency limit less the running ones. An
        operator lowering an abusive tenant's limits otherwise watches its queue served for up
        to max_deadline_s. Requests already interrupted (aborted, say, still waiting for their
        tokenizer thread) are ending: they are not kept in place of a live one
        (``Run.live``). Returns how many requests ended."""
        runs = [r for r in self.d.table if r.record.tenant_id == tenant.name]
        for run in runs:
            run.tenant = tenant
        waiting_states = (RequestState.RECEIVED, RequestState.ADMITTED)
        waiting = [r for r in runs if r.record.state in waiting_states and r.live]
        running = [r for r in runs if r.record.state not in waiting_states]
        held = sum(1 for r in running if r.live)
        limits, ended = tenant.limits, 0
        for run in waiting:  # in the order they came (the table keeps it)
            rec = run.record
            err: KvfenceError | None = None
            if rec.prompt_tokens:  # known: its prompt was measured
                total = rec.prompt_tokens + rec.max_new_tokens
                err = over_tenant_tokens(tenant, total, ", set while the request waited")
            if (
                err is None
                and limits.max_concurrent_requests
                and (held >= limits.max_concurrent_requests)
            ):
                err = ResourceExhausted(
                    f"tenant {tenant.name}'s concurrency limit was set to "
                    f"{limits.max_concurrent_requests} while the request waited, with {held} "
                    "older requests in flight",
                    reason=TENANT_CONCURRENCY,
                )
            if err is not None and run.interrupt(err):
                ended += 1
            elif not rec.terminal:
                held += 1
        return ended

    @_admin_only
    async def BackupTenants(
        self, request: control_pb2.BackupTenantsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # The snapshot (SQLite's backup API, disk I/O) runs in a worker thread: requests and
        # heartbeats go on meanwhile, and so do changes to tenants (the snapshot is of one moment).
        data, digest = await asyncio.to_thread(self._snapshot)
        log.info("tenant database backed up", bytes=len(data), sha256=digest)
        view = memoryview(data)
        first = control_pb2.BackupTenantsChunk(
            data=bytes(view[:BACKUP_CHUNK_BYTES]), total_bytes=len(data), sha256=digest
        )
        await context.write(first)
        for start in range(BACKUP_CHUNK_BYTES, len(data), BACKUP_CHUNK_BYTES):
            chunk = bytes(view[start : start + BACKUP_CHUNK_BYTES])
            await context.write(control_pb2.BackupTenantsChunk(data=chunk))

    def _snapshot(self) -> tuple[bytes, str]:
        data = self.tenants.snapshot()
        return data, hashlib.sha256(data).hexdigest()

    # -- cluster -----------------------------------------------------------------------------------

    @_admin_only
    async def ListNodes(
        self, request: control_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ListNodesResponse:
        registry = self.d.registry
        return control_pb2.ListNodesResponse(
            nodes=[self._node_pb(n) for n in sorted(registry.nodes(), key=lambda n: n.node_id)],
            context_window=self.d.model.context_window,
            admissible_limit=registry.admissible_limit(),
        )

    def _node_pb(self, node: Node) -> control_pb2.NodeInfo:
        return control_pb2.NodeInfo(
            node_id=node.node_id,
            role=node.role,
            grpc_address=node.grpc_address,
            ucx_address=node.ucx_address,
            pool_tokens=node.pool_tokens,
            total_pages=node.total_pages,
            free_pages=node.free_pages,
            quarantined_pages=node.quarantined_pages,
            healthy=node.heartbeat_age_s <= self.d.registry.heartbeat_interval_s * 2,
            last_heartbeat_age_s=node.heartbeat_age_s,
            layout=node.layout,
            draining=node.draining,
            kvfence_version=node.kvfence_version,
        )

    def model_status(self) -> control_pb2.ModelStatus:
        return control_pb2.ModelStatus(
            name=self.d.model.name,
            online=self.d.access.online,
            reason=self.d.access.reason,
            offline_since="" if self.d.access.online else self.d.access.since,
            context_window=self.d.model.context_window,
            admissible_limit=self.d.registry.admissible_limit(),
        )

    @_admin_only
    async def GetModelStatus(
        self, request: control_pb2.ModelStatusRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ModelStatus:
        return self.model_status()

    @_admin_only
    async def SetModelAccess(
        self, request: control_pb2.SetModelAccessRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ModelStatus:
        self._on_access_change(request.online, request.reason)
        return self.model_status()

    @_admin_only
    async def ListRequests(
        self, request: control_pb2.ListRequestsRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ListRequestsResponse:
        infos = []
        for run in sorted(self.d.table, key=lambda r: r.record.created_at):
            rec = run.record
            infos.append(
                control_pb2.RequestInfo(
                    request_id=rec.request_id,
                    tenant_id=rec.tenant_id,
                    state=str(rec.state),
                    prefill_node=rec.prefill_node,
                    decode_node=rec.decode_node,
                    prompt_tokens=rec.prompt_tokens,
                    max_new_tokens=rec.max_new_tokens,
                    age_s=rec.age_s,
                )
            )
        return control_pb2.ListRequestsResponse(requests=infos)

    @_admin_only
    async def AbortRequest(
        self, request: control_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.AbortRequestResponse:
        run = self.d.table.get(request.request_id)
        if run is None:
            raise NotFound(f"request {request.request_id!r} is not in flight")
        aborted = run.interrupt(Cancelled("the request was aborted by an operator"))
        log.warning("request aborted by operator", request_id=request.request_id, aborted=aborted)
        return control_pb2.AbortRequestResponse(aborted=aborted)

    @_admin_only
    async def CheckConfig(
        self, request: control_pb2.CheckConfigRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.CheckConfigResponse:
        return check_config(self.d, self.clamp_context)


def check_config(d: PipelineDeps, clamp_context: bool) -> control_pb2.CheckConfigResponse:
    """Every registered pool against the context window (the incident's misconfiguration)."""
    window = d.model.context_window
    limit = d.registry.admissible_limit()
    pools = []
    for node in sorted(d.registry.nodes(), key=lambda n: (n.role, n.node_id)):
        fits = node.pool_tokens >= window
        if fits:
            message = f"pool of {node.pool_tokens} tokens holds the context window of {window}"
        else:
            message = (
                f"pool of {node.pool_tokens} tokens is smaller than the context window of "
                f"{window}; requests are limited to {limit} tokens"
                + ("" if clamp_context else " (set model.clamp_context to accept this)")
            )
        pools.append(
            control_pb2.PoolCheck(
                node_id=node.node_id,
                role=node.role,
                pool_tokens=node.pool_tokens,
                ok=fits or clamp_context,
                message=message,
            )
        )
    return control_pb2.CheckConfigResponse(
        ok=all(p.ok for p in pools),
        context_window=window,
        admissible_limit=limit,
        clamped=limit < window,
        pools=pools,
    )
