"""The control plane with real prefill and decode nodes (tiny model, UCX over TCP), in process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from control_plane.service import ControlPlane
from control_plane.tenants import TenantLimits
from kvfence.client import AsyncClient
from kvfence.config import Role, parse_config
from kvfence.errors import InvalidArgument
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node


@dataclass
class RealStack:
    cp: ControlPlane
    tiny: Path
    client: AsyncClient  # tenant "acme"


@contextlib.asynccontextmanager
async def real_stack(tmp_path: Path) -> AsyncIterator[RealStack]:
    """A control plane, one decode and one prefill node on the tiny model (prefill pool 256
    tokens, decode 384), and a client of tenant "acme"."""
    tiny = ensure_tiny_model(tmp_path / "tiny")
    data = {
        "model": {"path": str(tiny)},
        "kv": {
            "page_size": 16,
            "prefill_pool": {"num_pages": 16},
            "decode_pool": {"num_pages": 24},
        },
        "control_plane": {
            "state_dir": str(tmp_path),
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
        },
    }
    cp = ControlPlane(parse_config(data, environ={}))  # the real model info: same fingerprint
    ports = await cp.start()
    data["control_plane"]["address"] = f"127.0.0.1:{ports.public}"
    cfg = parse_config(data, environ={})
    nodes = [await start_node(cfg, Role.DECODE), await start_node(cfg, Role.PREFILL)]
    try:
        _, key, _ = cp.tenants.create_tenant("acme", TenantLimits())
        async with AsyncClient(f"127.0.0.1:{ports.public}", key, timeout=30) as client:
            yield RealStack(cp, tiny, client)
    finally:
        for node in reversed(nodes):
            await node.stop(grace=1)
        await cp.stop(grace=1)


async def test_generate_through_real_nodes(tmp_path: Path) -> None:
    async with real_stack(tmp_path) as stack:
        client, cp = stack.client, stack.cp
        [model] = await client.list_models()
        assert model.admissible_limit == 16 * 16  # the prefill pool, not the 2048 window
        result = await client.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True)
        assert len(result.token_ids) == 6 and result.finish_reason == "length"
        assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 6
        rpcs = cp.node_rpcs()
        with pytest.raises(InvalidArgument, match="admissible limit of 256"):
            await client.generate(prompt_ids=[5] * 250, max_new_tokens=7)
        assert cp.node_rpcs() == rpcs


PROMPT = [40, 41, 42, 43, 44]
NEW = 40


async def test_stop_strings_through_real_nodes_match_the_colocated_engine(tmp_path: Path) -> None:
    """Stop strings through the whole disaggregated path: the tokens, text and finish reason
    are the colocated engine's."""
    async with real_stack(tmp_path) as stack:
        colo = ColocatedEngine.from_path(stack.tiny, page_size=16, num_pages=32)
        [free] = colo.generate(
            [GenerationRequest(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True))]
        )
        n = len(free.text)
        cases = [
            (free.text[3:5],),  # met early
            (free.text[n - 4 : n - 1], free.text[n // 2 : n // 2 + 2]),  # the earliest wins
            tuple(free.text[i : i + 30] for i in range(0, n - 30, 5)),  # many long ones
            ("\x01\x02 never",),  # control: never met
        ]
        reasons = []
        for stops in cases:
            params = SamplingParams(max_new_tokens=NEW, stop=stops, ignore_eos=True)
            [want] = colo.generate([GenerationRequest(PROMPT, params)])
            got = await stack.client.generate(
                prompt_ids=PROMPT, max_new_tokens=NEW, stop=stops, ignore_eos=True
            )
            assert (got.token_ids, got.text, got.finish_reason) == (
                want.token_ids, want.text, want.finish_reason
            ), stops  # fmt: skip
            reasons.append(got.finish_reason)
        assert reasons == ["stop", "stop", "stop", "length"]
