"""The control plane with real prefill and decode nodes (tiny model, UCX over TCP), in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.service import ControlPlane
from control_plane.tenants import TenantLimits
from kvfence.client import AsyncClient
from kvfence.config import Role, parse_config
from kvfence.errors import InvalidArgument
from kvfence.model.tiny import ensure_tiny_model
from kvfence.node_main import start_node


async def test_generate_through_real_nodes(tmp_path: Path) -> None:
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
            [model] = await client.list_models()
            assert model.admissible_limit == 16 * 16  # the prefill pool, not the 2048 window
            result = await client.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True)
            assert len(result.token_ids) == 6 and result.finish_reason == "length"
            assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 6
            rpcs = cp.node_rpcs()
            with pytest.raises(InvalidArgument, match="admissible limit of 256"):
                await client.generate(prompt_ids=[5] * 250, max_new_tokens=7)
            assert cp.node_rpcs() == rpcs
    finally:
        for node in reversed(nodes):
            await node.stop(grace=1)
        await cp.stop(grace=1)
