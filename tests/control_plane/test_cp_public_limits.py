"""The control plane's listeners refuse a message over control_plane.max_request_bytes before any
handler runs.

They used to accept 64 MiB, as node listeners do, and gRPC holds a whole message in memory before
the handler checks credentials: anyone who reached the public port, with no key, took the control
plane from 266 to 932 MiB and stalled its event loop for 875 ms with eight 60 MiB Generates. Each
negative test counts the handler's calls; its control sends the same call just under the limit
and sees it answered by the handler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cp_harness import Cluster, make_cluster

from control_plane.admin import AdminServicer
from control_plane.generation import GenerationServicer
from kvfence.auth import bearer_metadata
from kvfence.config import ConfigError, parse_config
from kvfence.proto.kvfence.v1 import client_pb2, client_pb2_grpc, control_pb2, control_pb2_grpc
from kvfence.server import MAX_MESSAGE_BYTES, client_channel_options

LIMIT = 64 << 10  # the smallest the config takes: small test messages
OVER = LIMIT + 1024
UNDER = LIMIT - 1024  # room for the rest of the message


@pytest.fixture
async def limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    """A control plane taking messages of up to LIMIT bytes, whose Generate and CreateTenant
    handlers record each call (patched before its servers start: they bind the handlers then)."""
    calls: list[str] = []
    generate, create = GenerationServicer.Generate, AdminServicer.CreateTenant

    async def spy_generate(self: Any, request: Any, context: Any) -> None:
        calls.append("Generate")
        await generate(self, request, context)

    async def spy_create(self: Any, request: Any, context: Any) -> Any:
        calls.append("CreateTenant")
        return await create(self, request, context)

    monkeypatch.setattr(GenerationServicer, "Generate", spy_generate)
    monkeypatch.setattr(AdminServicer, "CreateTenant", spy_create)
    c = await make_cluster(tmp_path, max_request_bytes=LIMIT)
    c.calls = calls  # type: ignore[attr-defined]
    yield c
    await c.close()


async def generate(target: str, api_key: str, text: str) -> grpc.StatusCode:
    """The status a Generate of ``text`` ends with (OK when it streamed to its end)."""
    # The clients' options: they send messages of up to 64 MiB, as the review's client did.
    async with grpc.aio.insecure_channel(target, options=client_channel_options()) as channel:
        stub = client_pb2_grpc.GenerationStub(channel)
        request = client_pb2.GenerateRequest(text=text, max_new_tokens=1)
        try:
            async for _ in stub.Generate(request, metadata=bearer_metadata(api_key), timeout=10):
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("key", ["none", "tenant"])
async def test_an_oversized_generate_is_refused_before_its_handler(
    limited: Cluster, key: str
) -> None:
    api_key = limited.api_key if key == "tenant" else "not-a-key"
    calls: list[str] = limited.calls  # type: ignore[attr-defined]
    assert await generate(limited.target, api_key, "x" * OVER) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert calls == [] and limited.node_calls() == 0
    # control: just under the limit the handler answers: no key, UNAUTHENTICATED; the tenant's
    # key, over the admissible limit (a byte a token, context window 256)
    want = grpc.StatusCode.INVALID_ARGUMENT if key == "tenant" else grpc.StatusCode.UNAUTHENTICATED
    assert await generate(limited.target, api_key, "x" * UNDER) == want
    assert calls == ["Generate"]
    # and a prompt that fits is served
    if key == "tenant":
        assert await generate(limited.target, api_key, "x" * 8) == grpc.StatusCode.OK


async def test_an_oversized_admin_request_is_refused_before_its_handler(limited: Cluster) -> None:
    calls: list[str] = limited.calls  # type: ignore[attr-defined]
    async with grpc.aio.insecure_channel(
        limited.admin_target, options=client_channel_options()
    ) as channel:
        admin = control_pb2_grpc.AdminStub(channel)

        async def create(name: str) -> grpc.StatusCode:
            try:
                await admin.CreateTenant(
                    control_pb2.CreateTenantRequest(name=name),
                    metadata=bearer_metadata(limited.cp.admin_token),
                    timeout=10,
                )
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        assert await create("x" * OVER) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert calls == []
        # control: just under, the handler refuses the name itself; a good one is created
        assert await create("x" * UNDER) == grpc.StatusCode.INVALID_ARGUMENT
        assert await create("beta") == grpc.StatusCode.OK
        assert calls == ["CreateTenant", "CreateTenant"]


async def test_the_default_limit_takes_the_largest_prompts_admission_measures(
    tmp_path: Path,
) -> None:
    """16 MiB by default: room for an 8 MiB text (tests/control_plane/test_cp_admission.py sends
    one) and a million token ids (5 bytes each at most), well under the node listeners' 64 MiB."""
    c = await make_cluster(tmp_path)
    try:
        assert c.cp.cfg.control_plane.max_request_bytes == 16 << 20
        assert 5 * 1_000_000 < 8 << 20 < c.cp.cfg.control_plane.max_request_bytes
        assert c.cp.cfg.control_plane.max_request_bytes < MAX_MESSAGE_BYTES
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("value", "ok"),
    [(64 << 10, True), ((64 << 10) - 1, False), (64 << 20, True), ((64 << 20) + 1, False)],
    ids=["smallest", "under-64KiB", "largest", "over-64MiB"],
)
def test_max_request_bytes_bounds(value: int, ok: bool) -> None:
    data = {"model": {"name": "m"}, "control_plane": {"max_request_bytes": value}}
    if ok:
        assert parse_config(data, environ={}).control_plane.max_request_bytes == value
    else:
        with pytest.raises(ConfigError, match="max_request_bytes"):
            parse_config(data, environ={})
