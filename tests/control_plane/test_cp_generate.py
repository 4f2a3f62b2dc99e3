"""Generate end to end against fake nodes: tokens, text, usage, the node RPCs and releases."""

from __future__ import annotations

import pytest
from cp_fakes import TEXT, script_tokens
from cp_harness import Cluster, eventually

from kvfence.errors import IntegrityError


async def test_generate_streams_tokens_text_and_usage(cluster: Cluster) -> None:
    n = len(script_tokens())
    result = await cluster.client().generate(prompt_ids=[10, 11, 12], max_new_tokens=n)
    assert result.token_ids == script_tokens()
    assert result.text == TEXT
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, n)
    assert result.request_id.startswith("req-")
    await eventually(lambda: "Release" in cluster.prefill[0].methods())
    assert cluster.prefill[0].methods() == ["Prefill", "Release"]
    # A finished decode stream gave its pages back itself: no Release RPC for it (a failed
    # request's are in test_cp_failures.py).
    assert cluster.decode[0].methods() == ["Reserve", "Decode"]
    reserve = cluster.decode[0].calls[0][1]
    assert (reserve.prompt_tokens, reserve.max_new_tokens, reserve.tenant_id) == (3, n, "acme")
    prefill = cluster.prefill[0].calls[0][1]
    assert list(prefill.prompt_token_ids) == [10, 11, 12]
    assert prefill.reservation.reservation_id == f"res-{result.request_id}"


async def test_text_prompt_is_tokenized(cluster: Cluster) -> None:
    await cluster.client().generate("hé", max_new_tokens=2)
    prefill = cluster.prefill[0].calls[0][1]
    assert list(prefill.prompt_token_ids) == [3 + b for b in "hé".encode()]


async def test_first_token_mismatch_is_data_loss(cluster: Cluster) -> None:
    cluster.script.first_token_override = 99
    with pytest.raises(IntegrityError) as err:
        await cluster.client().generate(prompt_ids=[10], max_new_tokens=4)
    assert err.value.reason == "FIRST_TOKEN_MISMATCH"
    await eventually(lambda: cluster.decode[0].methods()[-1] == "Release")
