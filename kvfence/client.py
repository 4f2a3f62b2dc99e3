"""Python clients of a kvfence cluster: ``Client`` (sync), ``AsyncClient`` and ``AdminClient``.

::

    with Client("127.0.0.1:50051", api_key) as c:
        result = c.generate("Hello", max_new_tokens=16)
        for chunk in c.stream(prompt_ids=[5, 6, 7], max_new_tokens=8):
            print(chunk.text, end="")

Against a TLS endpoint pass ``tls_ca`` (the CA that signed its certificate), and ``tls_server_name``
when that certificate does not name the host of ``target`` (through a port-forward: 127.0.0.1).

Failures raise the typed errors of :mod:`kvfence.errors` (``InvalidArgument``, ``Unavailable``,
``IntegrityError`` ...), rebuilt from the gRPC status with its ErrorInfo reason; arguments the wire
cannot carry (see ``build_request``), and a ``timeout`` gRPC cannot set as a deadline (not above
0, or above ``MAX_TIMEOUT_S``), raise ``InvalidArgument`` before anything is sent. A
Generate stream that ends OK without its final message (finish reason and usage: a proxy cut it,
a faulty server) raises ``Unavailable`` with reason ``STREAM_TRUNCATED``, as the control plane
treats such a stream from decode: its answer may be incomplete. This interface is stable: tests
and operators depend on it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc

from kvfence import MAX_TIMEOUT_S
from kvfence.auth import bearer_metadata
from kvfence.errors import (
    INVALID_PARAMETERS,
    Cancelled,
    IntegrityError,
    InvalidArgument,
    Unavailable,
    from_rpc_error,
)
from kvfence.proto.kvfence.v1 import (
    client_pb2,
    client_pb2_grpc,
    control_pb2,
    control_pb2_grpc,
)
from kvfence.server import client_channel_options
from kvfence.tls import TlsError, read_pem


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` if gRPC can set it as a deadline (None: no deadline); InvalidArgument when it
    is not above 0 (a deadline already past), above ``MAX_TIMEOUT_S``, or not a number (NaN)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidArgument(f"timeout must be a number of seconds, not {timeout!r}")
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise InvalidArgument(
            f"timeout must be above 0 and at most {MAX_TIMEOUT_S} seconds, not {timeout:g}"
        )
    return float(timeout)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed message: its new tokens and the text that became final with this message;
    the last one has finish_reason and usage, no tokens, and maybe text.

    ``text`` is not the text of ``token_ids``: text that could still grow into a stop string, or
    the bytes of an incomplete character, is held back and arrives with a later message or the
    last one. Concatenating every message's text gives the answer."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    usage: Usage | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    request_id: str


@dataclass(frozen=True)
class ModelSummary:
    name: str
    context_window: int
    admissible_limit: int  # prompt + max_new_tokens the cluster actually accepts
    online: bool
    fingerprint: str
    page_size: int


def _truncated() -> Unavailable:
    """A Generate stream that ended OK without its final message. Its reason is the control
    plane's for a decode stream that does so (control_plane.verify; kvfence.errors has no
    constant for it)."""
    return Unavailable(
        "the Generate stream ended without its final message (finish reason and usage): the "
        "answer may be incomplete",
        reason="STREAM_TRUNCATED",
    )


@dataclass
class GenerationAccumulator:
    """Folds a stream's chunks into one :class:`GenerationResult`: ``add`` each, then ``result``
    (Unavailable STREAM_TRUNCATED without the final chunk: no finish reason or usage to give)."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage

    @property
    def complete(self) -> bool:
        """Whether the final chunk (finish reason and usage) was added."""
        return bool(self.finish_reason) and self.usage is not None

    def result(self) -> GenerationResult:
        # Never a made-up finish reason or usage: a stream cut short is not a result.
        if not self.complete:
            raise _truncated()
        assert self.usage is not None
        return GenerationResult(
            self.token_ids, "".join(self.text), self.finish_reason, self.usage, self.request_id
        )


UINT32_MAX = 2**32 - 1  # max_new_tokens and token ids on the wire
UINT64_MAX = 2**64 - 1  # the seed


def _check_range(name: str, value: int, high: int) -> None:
    if not 0 <= value <= high:
        raise InvalidArgument(
            f"{name} must be in 0..{high}, got {value}", reason=INVALID_PARAMETERS
        )


def _check_utf8(name: str, text: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as err:
        # The message names the position only: ascii-safe, and no prompt text in an error.
        raise InvalidArgument(
            f"{name} is not valid UTF-8 text (character {err.start} is a lone surrogate)",
            reason=INVALID_PARAMETERS,
        ) from None


def build_request(
    prompt: str | None,
    prompt_ids: Sequence[int] | None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    model: str = "",
) -> client_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; exactly one of ``prompt`` / ``prompt_ids``.

    InvalidArgument (reason INVALID_PARAMETERS, as the control plane's refusals) for what the wire
    cannot carry: a number outside its field's range (max_new_tokens and token ids are uint32, the
    seed uint64) or a string that is not valid UTF-8 (a lone surrogate, e.g. undecodable bytes of
    a command line). The rest (max_new_tokens 0, an empty prompt ...) the control plane checks."""
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("pass exactly one of prompt or prompt_ids")
    _check_range("max_new_tokens", max_new_tokens, UINT32_MAX)
    if seed is not None:
        _check_range("seed", seed, UINT64_MAX)
    for i, token in enumerate(prompt_ids or ()):
        _check_range(f"prompt_ids[{i}]", token, UINT32_MAX)
    _check_utf8("prompt", prompt or "")
    _check_utf8("model", model)
    for i, text in enumerate(stop):
        _check_utf8(f"stop[{i}]", text)
    req = client_pb2.GenerateRequest(
        model=model,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=list(stop),
        ignore_eos=ignore_eos,
    )
    if prompt is not None:
        req.text = prompt
    else:
        assert prompt_ids is not None
        req.token_ids.ids.extend(prompt_ids)
    if seed is not None:
        req.seed = seed
    return req


def _chunk(msg: client_pb2.GenerateResponse) -> GenerationChunk:
    usage = None
    if msg.HasField("usage"):
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens)
    return GenerationChunk(msg.request_id, list(msg.token_ids), msg.text, msg.finish_reason, usage)


def _is_final(chunk: GenerationChunk) -> bool:
    """The stream's final message: the control plane sends the finish reason and usage together,
    last, and ends the call OK only after it."""
    return bool(chunk.finish_reason) and chunk.usage is not None


def _models(resp: client_pb2.ListModelsResponse) -> list[ModelSummary]:
    return [
        ModelSummary(
            m.name, m.context_window, m.admissible_limit, m.online, m.fingerprint, m.page_size
        )
        for m in resp.models
    ]


def _credentials(tls_ca: Path | str | bytes | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None:
        return None
    ca = tls_ca if isinstance(tls_ca, bytes) else read_pem(tls_ca, "CA")
    return grpc.ssl_channel_credentials(root_certificates=ca)


def _options(
    tls_ca: Path | str | bytes | None, tls_server_name: str | None
) -> list[tuple[str, Any]]:
    """Channel options, with keepalive (``kvfence.server.client_channel_options``: a connection
    lost silently fails the call instead of hanging it); with ``tls_server_name`` the server's
    certificate must name that instead of the host of the target (also sent as SNI): through a
    port-forward, or a Service whose name the certificate does not carry. TlsError without
    ``tls_ca`` (no TLS, no certificate to check)."""
    options = client_channel_options()
    if tls_server_name is None:
        return options
    if not tls_server_name.strip():
        raise TlsError("the TLS server name is empty")
    if tls_ca is None:
        raise TlsError("a TLS server name needs the CA of a TLS endpoint (tls_ca)")
    return [*options, ("grpc.ssl_target_name_override", tls_server_name)]


def _sync_channel(
    target: str, tls_ca: Path | str | bytes | None, tls_server_name: str | None = None
) -> grpc.Channel:
    options = _options(tls_ca, tls_server_name)
    creds = _credentials(tls_ca)
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


class Client:
    """Blocking client of the public API."""

    def __init__(
        self,
        target: str,
        api_key: str,
        *,
        tls_ca: Path | str | bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = None,
    ):
        self.timeout = check_timeout(timeout)  # before anything is opened
        self.target = target
        self._metadata = bearer_metadata(api_key)
        self._channel = _sync_channel(target, tls_ca, tls_server_name)
        self._stub = client_pb2_grpc.GenerationStub(self._channel)

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> Iterator[GenerationChunk]:
        """Yield chunks as they are generated; leaving the loop early cancels the request.
        Unavailable STREAM_TRUNCATED after the last chunk when the stream ended OK without its
        final one (finish reason and usage)."""
        req = build_request(
            prompt,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        call = self._stub.Generate(req, metadata=self._metadata, timeout=self.timeout)
        try:
            complete = False
            for msg in call:
                chunk = _chunk(msg)
                complete = complete or _is_final(chunk)
                yield chunk
            if not complete:
                raise _truncated()
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op once the call has ended

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> GenerationResult:
        acc = GenerationAccumulator()
        for chunk in self.stream(
            prompt,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        ):
            acc.add(chunk)
        return acc.result()

    def list_models(self) -> list[ModelSummary]:
        try:
            resp = self._stub.ListModels(
                client_pb2.ListModelsRequest(), metadata=self._metadata, timeout=self.timeout
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return _models(resp)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client of the public API; the same methods as :class:`Client`, awaited."""

    def __init__(
        self,
        target: str,
        api_key: str,
        *,
        tls_ca: Path | str | bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = None,
    ):
        self.timeout = check_timeout(timeout)  # before anything is opened
        self.target = target
        self._metadata = bearer_metadata(api_key)
        options = _options(tls_ca, tls_server_name)
        creds = _credentials(tls_ca)
        if creds is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        self._stub = client_pb2_grpc.GenerationStub(self._channel)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> AsyncIterator[GenerationChunk]:
        """Async-iterate chunks; leaving the loop early (or cancelling) cancels the request.
        Unavailable STREAM_TRUNCATED as :meth:`Client.stream`."""
        req = build_request(
            prompt,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        call = self._stub.Generate(req, metadata=self._metadata, timeout=self.timeout)
        try:
            complete = False
            async for msg in call:
                chunk = _chunk(msg)
                complete = complete or _is_final(chunk)
                yield chunk
            if not complete:
                raise _truncated()
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation: it must stand
            # grpc.aio ends a call cut locally (its channel closed under it) with a bare
            # CancelledError that would read as a cancellation of the caller's task.
            raise Cancelled("the call was cancelled locally (its channel was closed)") from None
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> GenerationResult:
        acc = GenerationAccumulator()
        async for chunk in self.stream(
            prompt,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        ):
            acc.add(chunk)
        return acc.result()

    async def list_models(self) -> list[ModelSummary]:
        try:
            resp = await self._stub.ListModels(
                client_pb2.ListModelsRequest(), metadata=self._metadata, timeout=self.timeout
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return _models(resp)

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def wrong_api(target: str, api: Literal["admin", "public"]) -> str:
    """What to say when ``target`` answered UNIMPLEMENTED ("Method not found!"): it serves gRPC
    but not this API, which is what the control plane's other port does (``api``: "admin" for a
    call of the Admin API, "public" for one of the public API). ``kvfence up`` puts the admin port
    at the public port + 1 (kvfence.cli.stack), hence the hint."""
    if api == "admin":
        return (
            f"{target} does not serve the kvfence Admin API (UNIMPLEMENTED): is it the public "
            "port? (`kvfence up`'s admin port is the public port + 1)"
        )
    return (
        f"{target} does not serve the kvfence public API (UNIMPLEMENTED): is it the admin "
        "port? (`kvfence up`'s public port is the admin port - 1)"
    )


class AdminClient:
    """Blocking client of the operator API; returns the proto messages of ``control.proto``."""

    def __init__(
        self,
        target: str,
        admin_token: str,
        *,
        tls_ca: Path | str | bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = 10.0,
    ):
        self.timeout = check_timeout(timeout)  # before anything is opened
        self.target = target
        self._metadata = bearer_metadata(admin_token)
        self._channel = _sync_channel(target, tls_ca, tls_server_name)
        self._stub = control_pb2_grpc.AdminStub(self._channel)

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(
                request, metadata=self._metadata, timeout=self.timeout
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def create_tenant(
        self,
        name: str,
        *,
        max_concurrent_requests: int = 0,
        max_tokens_per_request: int = 0,
        scrub_on_free: bool = False,
    ) -> control_pb2.CreateTenantResponse:
        """Create a tenant with one API key; the response is the only place the key appears."""
        limits = control_pb2.TenantLimits(
            max_concurrent_requests=max_concurrent_requests,
            max_tokens_per_request=max_tokens_per_request,
            scrub_on_free=scrub_on_free,
        )
        return self._call("CreateTenant", control_pb2.CreateTenantRequest(name=name, limits=limits))

    def list_tenants(self, names: Sequence[str] = ()) -> list[control_pb2.Tenant]:
        """Every tenant, or those in ``names`` that exist. A control plane from before
        ``ListTenantsRequest.names`` answers every tenant whatever is asked: pick by name."""
        request = control_pb2.ListTenantsRequest(names=names)
        return list(self._call("ListTenants", request).tenants)

    def create_key(self, tenant: str) -> control_pb2.CreateKeyResponse:
        """Another API key for ``tenant`` (rotation); the response is the only place it appears."""
        return self._call("CreateKey", control_pb2.CreateKeyRequest(tenant=tenant))

    def revoke_key(self, key_id: str) -> bool:
        return bool(self._call("RevokeKey", control_pb2.RevokeKeyRequest(key_id=key_id)).revoked)

    def set_limits(
        self,
        name: str,
        *,
        max_concurrent_requests: int | None = None,
        max_tokens_per_request: int | None = None,
        scrub_on_free: bool | None = None,
    ) -> control_pb2.Tenant:
        """Set the limits given; those left None keep their value (the control plane merges them
        in one step, so a concurrent change of another limit is not undone)."""
        given = {
            "max_concurrent_requests": max_concurrent_requests,
            "max_tokens_per_request": max_tokens_per_request,
            "scrub_on_free": scrub_on_free,
        }
        fields = [k for k, v in given.items() if v is not None]
        if not fields:
            raise ValueError("set_limits: give at least one limit to set")
        # The limits not given are sent as they stand now: a control plane from before
        # SetLimitsRequest.fields writes all three, and must write those back, not zeros (that
        # lifted caps and scrub_on_free). One that knows ``fields`` ignores them. Only this
        # tenant is asked for (listing all 20,000 tenants of 10 keys each held the control
        # plane's event loop over a second), and picked by name: an older one answers all.
        current = {t.name: t.limits for t in self.list_tenants([name])}.get(name)
        limits = control_pb2.TenantLimits()
        if current is not None:
            limits.CopyFrom(current)
        for key in fields:
            setattr(limits, key, given[key])
        request = control_pb2.SetLimitsRequest(name=name, limits=limits, fields=fields)
        return self._call("SetLimits", request)

    def list_nodes(self) -> control_pb2.ListNodesResponse:
        return self._call("ListNodes", control_pb2.ListNodesRequest())

    def model_status(self) -> control_pb2.ModelStatus:
        return self._call("GetModelStatus", control_pb2.ModelStatusRequest())

    def set_model_access(self, online: bool, reason: str = "") -> control_pb2.ModelStatus:
        return self._call(
            "SetModelAccess", control_pb2.SetModelAccessRequest(online=online, reason=reason)
        )

    def list_requests(self) -> list[control_pb2.RequestInfo]:
        return list(self._call("ListRequests", control_pb2.ListRequestsRequest()).requests)

    def abort_request(self, request_id: str) -> bool:
        resp = self._call("AbortRequest", control_pb2.AbortRequestRequest(request_id=request_id))
        return bool(resp.aborted)

    def check_config(self) -> control_pb2.CheckConfigResponse:
        """Every registered node's pool against the context window and the enforced limit."""
        return self._call("CheckConfig", control_pb2.CheckConfigRequest())

    def backup_tenants(self, timeout: float | None = 120.0) -> bytes:
        """A consistent snapshot of the tenant database: a self-contained SQLite file holding
        tenants, limits and API key hashes (keep it private). ``kvfence tenants restore`` puts it
        back. IntegrityError if what arrived is not the whole file the control plane sent."""
        timeout = check_timeout(timeout)
        call = self._stub.BackupTenants(
            control_pb2.BackupTenantsRequest(), metadata=self._metadata, timeout=timeout
        )
        parts: list[bytes] = []
        total, digest = -1, ""
        try:
            for i, chunk in enumerate(call):
                if i == 0:
                    total, digest = chunk.total_bytes, chunk.sha256
                parts.append(chunk.data)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()
        data = b"".join(parts)
        if len(data) != total or hashlib.sha256(data).hexdigest() != digest:
            raise IntegrityError(
                f"the backup is incomplete or damaged: got {len(data)} bytes, the control plane "
                f"sent {max(total, 0)}",
                reason="BACKUP_MISMATCH",
            )
        return data

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
