"""Fake prefill and decode nodes: real gRPC servers that record every call and follow a script.

They register with the control plane's real NodeRegistry and heartbeat like real nodes, so the
control plane cannot tell them apart; a test scripts errors, holds and token streams, then asserts
on ``calls`` (exact method names and order). Like real nodes they refuse a call without the node
token they registered with (UNAUTHENTICATED, not recorded in ``calls``); ``presented`` keeps the
token every call carried, refused ones included.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import grpc

from control_plane.model_info import ByteTokenizer, ModelInfo
from kvfence import PROTOCOL_VERSION, __version__
from kvfence.auth import bearer_metadata
from kvfence.errors import KvfenceError, Unauthenticated
from kvfence.proto.kvfence.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvfence.server import abort, bearer_token

FINGERPRINT = "sha256:test-model"
TEXT_FINGERPRINT = "sha256:test-model-text"  # EOS ids and tokenizer (ModelInfo.text_fingerprint)
TEXT = "héllo wörld ✓ kvfence"  # multi-byte characters on purpose


def make_layout(**overrides: Any) -> common_pb2.KvLayout:
    fields = dict(page_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=32)
    fields.update(overrides)
    return common_pb2.KvLayout(**fields)


def make_model_info(context_window: int = 256) -> ModelInfo:
    return ModelInfo(
        name="test-model",
        context_window=context_window,
        fingerprint=FINGERPRINT,
        layout=make_layout(),
        vocab_size=384,
        tokenizer=ByteTokenizer(),
        eos_ids=frozenset({2}),
        text_fingerprint=TEXT_FINGERPRINT,
    )


def script_tokens() -> list[int]:
    """What the fake nodes 'generate': the bytes of TEXT, repeated as needed."""
    return ByteTokenizer().encode(TEXT)


@dataclass
class Script:
    """Shared by a test and its fake nodes: what to answer and when to wait."""

    tokens: list[int] = field(default_factory=script_tokens)
    finish_reason: str = "length"
    reserve_error: KvfenceError | None = None
    prefill_error: KvfenceError | None = None
    decode_error: KvfenceError | None = None  # sent after verified=true
    first_token_override: int | None = None  # prefill claims another first token
    # Fields of the manifest prefill returns set to these values instead (a prefill answering
    # for another request, tenant, reservation or prompt length), e.g. {"tenant_id": "globex"}.
    manifest_override: dict[str, Any] = field(default_factory=dict)
    prefill_hold: asyncio.Event | None = None
    decode_hold: asyncio.Event | None = None  # decode waits after verified=true
    release_hold: asyncio.Event | None = None  # decode's Release waits (a node that hangs)
    tokens_hold: asyncio.Event | None = None  # decode waits after its first tokens

    def generated(self, n: int) -> list[int]:
        return [self.tokens[i % len(self.tokens)] for i in range(n)]


class _NodeTokenFake:
    """The node token check of a real node (kvfence.node.NodeTokenCheck), recording each token."""

    node_token: str | None = None  # set when the fake registers

    def __init__(self) -> None:
        self.presented: list[tuple[str, str | None]] = []

    async def authenticate(self, method: str, context: Any) -> None:
        token = bearer_token(context)
        self.presented.append((method, token))
        if self.node_token is None or token != self.node_token:
            await abort(context, Unauthenticated(f"{method} needs the cluster node token"))


class FakeDecode(decode_pb2_grpc.DecodeServicer, _NodeTokenFake):
    def __init__(self, node_id: str, script: Script, page_size: int):
        _NodeTokenFake.__init__(self)
        self.node_id = node_id
        self.script = script
        self.page_size = page_size
        self.calls: list[tuple[str, Any]] = []
        self.entered = asyncio.Event()  # a Decode or Reserve call arrived
        self.refuse: KvfenceError | None = None  # this node's answer to Reserve (e.g. draining)

    def methods(self) -> list[str]:
        return [m for m, _ in self.calls]

    async def Reserve(self, request: Any, context: Any) -> prefill_pb2.Reservation:
        await self.authenticate("Reserve", context)
        self.calls.append(("Reserve", request))
        self.entered.set()
        if self.refuse is not None:
            await abort(context, self.refuse)
        if self.script.reserve_error is not None:
            await abort(context, self.script.reserve_error)
        pages = math.ceil((request.prompt_tokens + request.max_new_tokens) / self.page_size)
        return prefill_pb2.Reservation(
            reservation_id=f"res-{request.request_id}",
            decode_node_id=self.node_id,
            decode_ucx_address="127.0.0.1:1",
            pages=[common_pb2.PageRef(page_id=i, generation=1) for i in range(pages)],
            secret=b"secret",
            prompt_tokens=request.prompt_tokens,
            max_new_tokens=request.max_new_tokens,
        )

    async def Decode(self, request: Any, context: Any) -> Any:
        await self.authenticate("Decode", context)
        self.calls.append(("Decode", request))
        self.entered.set()
        yield decode_pb2.DecodeResponse(verified=True)
        if self.script.decode_hold is not None:
            await self.script.decode_hold.wait()
        if self.script.decode_error is not None:
            await abort(context, self.script.decode_error)
        tokens = self.script.generated(request.sampling.max_new_tokens)
        for i in range(0, len(tokens), 3):
            yield decode_pb2.DecodeResponse(token_ids=tokens[i : i + 3])
            if i == 0 and self.script.tokens_hold is not None:
                await self.script.tokens_hold.wait()
        yield decode_pb2.DecodeResponse(finish_reason=self.script.finish_reason)

    async def Release(self, request: Any, context: Any) -> prefill_pb2.ReleaseResponse:
        await self.authenticate("Release", context)
        self.calls.append(("Release", request))
        if self.script.release_hold is not None:
            await self.script.release_hold.wait()
        return prefill_pb2.ReleaseResponse(held=True)


class FakePrefill(prefill_pb2_grpc.PrefillServicer, _NodeTokenFake):
    def __init__(self, node_id: str, script: Script):
        _NodeTokenFake.__init__(self)
        self.node_id = node_id
        self.script = script
        self.calls: list[tuple[str, Any]] = []
        self.entered = asyncio.Event()
        self.refuse: KvfenceError | None = None  # this node's answer to Prefill (e.g. draining)

    def methods(self) -> list[str]:
        return [m for m, _ in self.calls]

    async def Prefill(self, request: Any, context: Any) -> prefill_pb2.PrefillResponse:
        await self.authenticate("Prefill", context)
        self.calls.append(("Prefill", request))
        self.entered.set()
        if self.refuse is not None:
            await abort(context, self.refuse)
        if self.script.prefill_hold is not None:
            await self.script.prefill_hold.wait()
        if self.script.prefill_error is not None:
            await abort(context, self.script.prefill_error)
        first = self.script.first_token_override
        if first is None:
            first = self.script.tokens[0]
        res = request.reservation
        manifest = common_pb2.KvManifest(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            reservation_id=res.reservation_id,
            model_fingerprint=FINGERPRINT,
            layout=make_layout(),
            token_count=len(request.prompt_token_ids),
            first_token=first,
        )
        for name, value in self.script.manifest_override.items():
            setattr(manifest, name, value)
        return prefill_pb2.PrefillResponse(manifest=manifest, pages_sent=1, bytes_sent=64)

    async def Release(self, request: Any, context: Any) -> prefill_pb2.ReleaseResponse:
        await self.authenticate("Release", context)
        self.calls.append(("Release", request))
        return prefill_pb2.ReleaseResponse(held=True)


class FakeNode:
    """A fake node's gRPC server plus its registration and heartbeats."""

    def __init__(
        self,
        role: str,
        node_id: str,
        script: Script,
        *,
        pool_tokens: int = 4096,
        page_size: int = 16,
        fingerprint: str = FINGERPRINT,
        text_fingerprint: str = TEXT_FINGERPRINT,
        layout: common_pb2.KvLayout | None = None,
        heartbeat_s: float = 0.05,
    ):
        self.role = role
        self.node_id = node_id
        self.pool_tokens = pool_tokens
        self.total_pages = pool_tokens // page_size
        self.free_pages = self.total_pages
        self.fingerprint = fingerprint
        self.text_fingerprint = text_fingerprint
        self.layout = layout or make_layout(page_size=page_size)
        self.heartbeat_s = heartbeat_s
        self.servicer: FakeDecode | FakePrefill
        if role == "decode":
            self.servicer = FakeDecode(node_id, script, page_size)
        else:
            self.servicer = FakePrefill(node_id, script)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.instance_id = "fake-process-1"  # a test sets another to play a restart in place
        # What its registration says it speaks (kvfence.PROTOCOL_VERSION; 0: a release that says
        # nothing); a test sets another to play a node of another release.
        self.protocol_version = PROTOCOL_VERSION
        self.kvfence_version = __version__
        self.draining = False  # what its heartbeats say
        self._beats: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def calls(self) -> list[tuple[str, Any]]:
        return self.servicer.calls

    def methods(self) -> list[str]:
        return self.servicer.methods()

    async def start(self) -> None:
        self.server = grpc.aio.server()
        if self.role == "decode":
            decode_pb2_grpc.add_DecodeServicer_to_server(self.servicer, self.server)
        else:
            prefill_pb2_grpc.add_PrefillServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def register(self, cp_port: int, node_token: str) -> control_pb2.RegisterResponse:
        self._metadata = bearer_metadata(node_token)
        self.servicer.node_token = node_token  # and requires it, as a real node does
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{cp_port}")
        stub = control_pb2_grpc.NodeRegistryStub(self._channel)
        resp = await stub.Register(self.register_request(), metadata=self._metadata)
        if resp.accepted:
            self._beats = asyncio.create_task(self._heartbeat(stub))
        return resp

    def register_request(self, instance_id: str | None = None) -> control_pb2.RegisterRequest:
        """This node's registration; ``instance_id`` another process's at the same address (a
        restart in place)."""
        return control_pb2.RegisterRequest(
            node_id=self.node_id,
            role=self.role,
            grpc_address=f"127.0.0.1:{self.port}",
            ucx_address="127.0.0.1:1" if self.role == "decode" else "",
            model_fingerprint=self.fingerprint,
            text_fingerprint=self.text_fingerprint,
            layout=self.layout,
            pool_tokens=self.pool_tokens,
            total_pages=self.total_pages,
            instance_id=self.instance_id if instance_id is None else instance_id,
            protocol_version=self.protocol_version,
            kvfence_version=self.kvfence_version,
        )

    async def _heartbeat(self, stub: control_pb2_grpc.NodeRegistryStub) -> None:
        while True:
            await stub.Heartbeat(
                control_pb2.HeartbeatRequest(
                    node_id=self.node_id,
                    free_pages=self.free_pages,
                    draining=self.draining,
                    instance_id=self.instance_id,
                ),
                metadata=self._metadata,
            )
            await asyncio.sleep(self.heartbeat_s)

    async def stop_heartbeats(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._beats
            self._beats = None

    async def stop(self) -> None:
        await self.stop_heartbeats()
        if self._channel is not None:
            await self._channel.close(None)
        if self.server is not None:
            await self.server.stop(0)


class EventRecorder:
    """Stands in for the EventBus: keeps every event emitted."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **payload: Any) -> int:
        self.events.append({"kind": kind, **payload})
        return len(self.events)

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]
