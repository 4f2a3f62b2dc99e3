"""Issue 6.1: the GLM-5.3 incident, reproduced against kvfence.

As in the incident, the model's context window (2048) is larger than the KV pools, and prefill and
decode pools differ (1024 and 768 tokens). Tenant A fills the pools with prompts carrying canary
token sequences; tenant B sends prompts at limit - 1, limit, limit + 1 and far over. At and under
the limit B gets exactly the colocated reference; over it, INVALID_ARGUMENT, no token and no node
RPC.
Nothing B receives contains A's canaries.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from stack_harness import Stack
from stack_starts import seed_embedded_model

from kvfence.errors import InvalidArgument, KvfenceError
from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams

pytestmark = pytest.mark.slow

CONTEXT, PREFILL_POOL, DECODE_POOL = 2048, 1024, 768


def canary(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def ngrams(ids: list[int], n: int = 4) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(
        seed_embedded_model(tmp_path_factory.mktemp("incident")),
        args=["--prefill-pool-tokens", str(PREFILL_POOL), "--decode-pool-tokens", str(DECODE_POOL)],
    ).start()
    s.keys = {"a": s.create_tenant("tenant-a"), "b": s.create_tenant("tenant-b")}
    yield s
    s.stop()


def test_incident_configuration_cannot_leak(stack):
    rng = random.Random(20260908)
    with stack.client(stack.keys["b"]) as b:
        [model] = b.list_models()
    assert model.context_window == CONTEXT
    limit = model.admissible_limit
    assert limit == DECODE_POOL  # min(context, every pool): the incident's missing clamp

    canaries: list[list[int]] = []
    # 1. A's long request holds almost the whole decode pool while B's over-length probes arrive.
    first = canary(rng, 100)
    canaries.append(first)
    a = stack.client(stack.keys["a"])
    a_stream = a.stream(prompt_ids=first, max_new_tokens=limit - 120, ignore_eos=True)
    next(a_stream)  # A is decoding: its pages are full of canary KV
    before = {k: s.rpc_count for k, s in stack.node_stats().items()}
    with stack.client(stack.keys["b"]) as b:
        for total in (limit + 1, limit * 3):
            got = []
            with pytest.raises(InvalidArgument) as err:
                for chunk in b.stream(prompt_ids=canary(rng, total - 16), max_new_tokens=16):
                    got.extend(chunk.token_ids)
            assert got == []
            assert f"{total}" in err.value.message and f"{limit}" in err.value.message
    after = {k: s.rpc_count for k, s in stack.node_stats().items()}
    assert after == before, "an over-length request reached a node"
    a_stream.close()
    a.close()

    # 2. A keeps the pools busy with canary prompts while B runs at limit - 1 and at the limit.
    stop = threading.Event()
    # (start, end) of each of A's generations that succeeded, and of each of B's calls: A's
    # load ran alongside B only if one of A's really went through the nodes while B's did.
    a_done: list[tuple[float, float]] = []
    b_calls: list[tuple[float, float]] = []
    a_ran = threading.Event()  # the first of A's generations succeeded

    def a_load() -> None:
        with stack.client(stack.keys["a"]) as c:
            while not stop.is_set():
                ids = canary(rng, 300)
                canaries.append(ids)  # sent: its KV may be in a pool, succeeded or not
                start = time.monotonic()
                try:
                    c.generate(prompt_ids=ids, max_new_tokens=64, ignore_eos=True)
                except KvfenceError:
                    time.sleep(0.05)
                else:
                    a_done.append((start, time.monotonic()))
                    a_ran.set()

    loaders = [threading.Thread(target=a_load) for _ in range(2)]
    for t in loaders:
        t.start()
    b_prompts = {total: [(11 * i + total) % 240 + 3 for i in range(total - 8)]
                 for total in (limit - 1, limit)}  # fmt: skip
    try:
        # B starts once A's load is under way, A's next generations in flight: started at once,
        # B's calls (under a tenth of a second each on an idle stack) could be over before A's
        # first one began.
        assert a_ran.wait(60), "none of A's generations succeeded"
        with stack.client(stack.keys["b"]) as b:
            got = {}
            for total, p in b_prompts.items():
                start = time.monotonic()
                got[total] = b.generate(prompt_ids=p, max_new_tokens=8, ignore_eos=True)
                b_calls.append((start, time.monotonic()))
    finally:
        stop.set()
        for t in loaders:
            t.join(60)

    ref = ColocatedEngine.from_path(stack.state_dir / "models" / "tiny-llama", num_pages=64)
    expected = ref.generate(
        [GenerationRequest(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
         for p in b_prompts.values()]
    )  # fmt: skip
    # A's load really ran alongside B: a generation of A's succeeded, overlapping a call of B's.
    assert any(a0 < b1 and b0 < a1 for a0, a1 in a_done for b0, b1 in b_calls), (a_done, b_calls)
    leaked = set().union(*(ngrams(c) for c in canaries)) - set().union(
        *(ngrams(p) for p in b_prompts.values())
    )
    for (total, result), exp in zip(got.items(), expected, strict=True):
        assert result.token_ids == exp.token_ids, f"B's output at {total} tokens differs"
        assert result.usage.prompt_tokens + 8 == total
        assert not (ngrams(result.token_ids) & leaked), "A's canary in B's output"
    stats = stack.wait_pools_free()
    assert all(s.free_pages == s.total_pages for s in stats.values())
