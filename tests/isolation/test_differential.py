"""Issue 6.3: many concurrent mixed requests from two tenants; every OK output equals the colocated
solo reference. A differing token is accepted only where the reference's top-2 logit gap at that
position was a near-tie (below 1e-4), which would show numerical noise rather than foreign KV."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from stack_harness import Stack
from stack_starts import seed_embedded_model

from kvfence.model.colocated import ColocatedEngine, GenerationRequest
from kvfence.model.sampling import SamplingParams

pytestmark = pytest.mark.slow
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(
        seed_embedded_model(tmp_path_factory.mktemp("diff")),
        prefill=1,
        decode=2,
        args=["--prefill-pool-tokens", "2048", "--decode-pool-tokens", "1024"],
    ).start()
    s.keys = {"a": s.create_tenant("tenant-a"), "b": s.create_tenant("tenant-b")}
    yield s
    s.stop()


def make_cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        sampled = i % 3 == 2
        cases.append(
            {
                "tenant": "a" if i % 2 else "b",
                "prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(1, 90))],
                "max_new": rng.randrange(1, 24),
                "temperature": 0.8 if sampled else 0.0,
                "top_p": 0.9 if sampled else 1.0,
                "seed": rng.randrange(1 << 32) if sampled else None,
            }
        )
    return cases


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_concurrent_outputs_equal_solo_reference(stack):
    cases = make_cases(36, seed=7)

    def run(case):
        with stack.client(stack.keys[case["tenant"]]) as c:
            return c.generate(
                prompt_ids=case["prompt"],
                max_new_tokens=case["max_new"],
                temperature=case["temperature"],
                top_p=case["top_p"],
                seed=case["seed"],
                ignore_eos=True,
            )

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(run, cases))
    ref = ColocatedEngine.from_path(stack.state_dir / "models" / "tiny-llama")
    near_ties = 0
    for case, got in zip(cases, results, strict=True):
        params = SamplingParams(
            max_new_tokens=case["max_new"],
            temperature=case["temperature"],
            top_p=case["top_p"],
            seed=case["seed"],
            ignore_eos=True,
        )
        want = ref.generate([GenerationRequest(case["prompt"], params)])[0]  # solo: batch of one
        at = first_difference(got.token_ids, want.token_ids)
        if at is None:
            continue
        gap = ref.logit_gaps(case["prompt"], want.token_ids)[at]
        assert gap < NEAR_TIE, (
            f"token {at} differs from the solo reference with a clear top-2 gap {gap:.3g}: "
            f"{case} got {got.token_ids} want {want.token_ids}"
        )
        near_ties += 1
    assert near_ties <= len(cases) // 10  # near-ties are rare; many would hide a real bug
    stats = stack.wait_pools_free()
    assert all(s.free_pages == s.total_pages for s in stats.values())


def test_near_tie_rule_is_not_vacuous(stack):
    """Control: the gap check does reject a real difference (another prompt's continuation)."""
    ref = ColocatedEngine.from_path(stack.state_dir / "models" / "tiny-llama")
    p1, p2 = [5, 6, 7, 8, 9] * 4, [40, 41, 42] * 6
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    o1, o2 = (ref.generate([GenerationRequest(p, params)])[0].token_ids for p in (p1, p2))
    at = first_difference(o2, o1)
    assert at is not None
    assert ref.logit_gaps(p1, o1)[at] >= NEAR_TIE
