"""A decode reservation must name the node the control plane called and the UCX address that node
registered: prefill sends the request's KV to the reservation's address. A decode answer naming
another node or address was passed on to prefill unchecked (only its sizes were). It is refused
as a reservation of the wrong size is: the request fails RESERVATION_MISMATCH before prefill is
called, its Release reaches the node, and the node's id and addresses go to the log only.
Control: the same request, its reservation as the node registered it, is served (the real nodes'
registration and reservation: test_cp_real_nodes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cp_fakes import FakeDecode
from cp_harness import eventually, make_cluster
from structlog.testing import capture_logs

from kvfence.errors import KvfenceError


@pytest.mark.parametrize(
    "field, value",
    [
        ("decode_node_id", "decode-9"),
        ("decode_ucx_address", "10.0.0.9:13337"),
        ("decode_ucx_address", ""),
    ],
    ids=["another node", "another address", "no address"],
)
async def test_a_reservation_of_another_node_is_refused_before_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: str
) -> None:
    elsewhere = False
    reserve = FakeDecode.Reserve

    async def maybe_elsewhere(self: FakeDecode, request: Any, context: Any) -> Any:
        res = await reserve(self, request, context)
        if elsewhere:
            setattr(res, field, value)
        return res

    monkeypatch.setattr(FakeDecode, "Reserve", maybe_elsewhere)  # before the servers bind it
    cluster = await make_cluster(tmp_path)
    try:
        ok = await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)  # control
        assert ok.finish_reason == "length"
        prefills = cluster.prefill[0].methods().count("Prefill")
        elsewhere = True
        with capture_logs() as logs, pytest.raises(KvfenceError) as err:
            await cluster.client().generate(prompt_ids=[10], max_new_tokens=2)
        assert err.value.reason == "RESERVATION_MISMATCH"
        assert "decode-" not in err.value.message and "10.0.0.9" not in err.value.message
        assert cluster.prefill[0].methods().count("Prefill") == prefills  # its KV went nowhere
        [line] = [e for e in logs if e["event"].startswith("reservation does not name the node")]
        assert line["node_id"] == "decode-0" and line[f"reservation_{field[7:]}"] == value
        [failed] = cluster.events.of("request_failed")
        assert failed["reason"] == "RESERVATION_MISMATCH"
        await eventually(
            lambda: any(
                m == "Release" and r.request_id == failed["request_id"]
                for m, r in cluster.decode[0].calls
            )
        )
        await eventually(lambda: not cluster.cp.table)
    finally:
        await cluster.close()
