"""kvfence.manifest on its own: the six checks of DESIGN.md "Transfer manifest", each failing with
its own reason and in DESIGN.md's order, the MAC over every field, and the canonical encoding;
and the checksum inputs both nodes build, which must be on the KV pool's device.

The checks run on a synthetic decode record (``Expected``) with stand-in generations and checksums,
except where a real ``PagePool`` and the real checksum kernel are the point.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

import kernels
from decode_svc.service import DecodeServicer
from kvfence import manifest as mf
from kvfence.errors import IntegrityError
from kvfence.kv.pool import PagePool, PageRef
from kvfence.proto.kvfence.v1 import common_pb2, prefill_pb2
from prefill_svc.service import PrefillServicer

PS = 4
LAYOUT = common_pb2.KvLayout(
    page_size=PS, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8
)
SECRET = b"s" * 32
RID = "res-1"
PROMPT = 6  # two prompt pages: 4 + 2 tokens
# Two prompt pages, then two for the new tokens; deliberately not in id order.
PAGES = [PageRef(7, 3), PageRef(2, 9), PageRef(11, 1), PageRef(5, 5)]
GEN = {p.page_id: p.generation for p in PAGES}
VOCAB = 100


def fake_sum(page_id: int, seed: int) -> int:
    """Stands in for a page's checksum: a function of the page and the seed only."""
    return (page_id * 1000003 + seed) & 0xFFFFFFFFFFFFFFFF


def seed_of(reservation_id: str, index: int) -> int:
    return (sum(reservation_id.encode()) * 31 + index) & 0x7FFFFFFF


def make_manifest(prompt: int = PROMPT) -> common_pb2.KvManifest:
    """What prefill sends for the reservation of ``expected()`` (unsigned)."""
    n = -(-prompt // PS)
    return common_pb2.KvManifest(
        request_id="r",
        tenant_id="t",
        reservation_id=RID,
        model_fingerprint="fp",
        layout=LAYOUT,
        token_count=prompt,
        first_token=5,
        checksum_algo="algo",
        pages=[
            common_pb2.ManifestPage(
                page_id=p.page_id,
                generation=p.generation,
                tokens_in_page=min(PS, prompt - i * PS),
                checksum=fake_sum(p.page_id, seed_of(RID, i)),
            )
            for i, p in enumerate(PAGES[:n])
        ],
    )


def expected(**over: Any) -> mf.Expected:
    fields: dict[str, Any] = dict(
        request_id="r",
        tenant_id="t",
        reservation_id=RID,
        secret=SECRET,
        prompt_tokens=PROMPT,
        pages=PAGES,
        receiving=True,
        received=[0, 1],
        fingerprint="fp",
        layout=LAYOUT,
        vocab_size=VOCAB,
        checksum_algo="algo",
    )
    fields.update(over)
    return mf.Expected(**fields)


def reason(
    m: common_pb2.KvManifest, exp: mf.Expected | None, gen: dict[int, int] | None = None
) -> str:
    """The reason verify fails with, or "OK"."""
    gens = GEN if gen is None else gen
    try:
        mf.verify(
            m,
            exp,
            current_generation=lambda pid: gens[pid],
            checksums=lambda ids, seeds: [fake_sum(i, s) for i, s in zip(ids, seeds, strict=True)],
            checksum_seed=seed_of,
        )
    except IntegrityError as err:
        return err.reason
    return "OK"


def signed(m: common_pb2.KvManifest, secret: bytes = SECRET) -> common_pb2.KvManifest:
    mf.sign(m, secret)
    return m


def test_a_valid_manifest_passes() -> None:
    assert reason(signed(make_manifest()), expected()) == "OK"
    # a prompt of whole pages (the last page full) too
    assert reason(signed(make_manifest(8)), expected(prompt_tokens=8, received=[1, 0])) == "OK"


# ---- each check with its own reason ---------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One way to break a check: a change to the manifest (before it is signed), to decode's
    record, to the pool's generations, or the secret prefill signs with."""

    manifest: Callable[[common_pb2.KvManifest], None] = lambda m: None
    exp: dict[str, Any] = dataclasses.field(default_factory=dict)
    gen: dict[int, int] = dataclasses.field(default_factory=dict)
    secret: bytes = SECRET


def _set(attr: str, value: Any) -> Callable[[common_pb2.KvManifest], None]:
    return lambda m: setattr(m, attr, value)


def _page(index: int, attr: str, value: Any) -> Callable[[common_pb2.KvManifest], None]:
    return lambda m: setattr(m.pages[index], attr, value)


def _tokens_shifted(m: common_pb2.KvManifest) -> None:
    # the same total, spread 3 + 3: every page but the last must be full
    m.pages[0].tokens_in_page, m.pages[1].tokens_in_page = 3, 3


def _pages_swapped(m: common_pb2.KvManifest) -> None:
    first, second = common_pb2.ManifestPage(), common_pb2.ManifestPage()
    first.CopyFrom(m.pages[0])
    second.CopyFrom(m.pages[1])
    m.pages[0].CopyFrom(second)
    m.pages[1].CopyFrom(first)


def _last_page_dropped(m: common_pb2.KvManifest) -> None:
    del m.pages[-1]


def _decode_page_listed(m: common_pb2.KvManifest) -> None:
    m.pages.add(page_id=PAGES[2].page_id, generation=PAGES[2].generation, tokens_in_page=0)


def _checksum_of_other_page(m: common_pb2.KvManifest) -> None:
    # a correct checksum, of page index 0's memory under index 1's seed: a copy of another page
    m.pages[1].checksum = fake_sum(PAGES[0].page_id, seed_of(RID, 1))


BREAKS: dict[str, list[Case]] = {
    "RESERVATION": [
        Case(exp={"reservation_id": "res-other"}),
        Case(exp={"request_id": "r-other"}),
        Case(exp={"tenant_id": "t-other"}),
        Case(exp={"receiving": False}),
    ],
    "MAC": [Case(secret=b"x" * 32), Case(manifest=_set("mac", b""))],
    "COUNT": [Case(exp={"prompt_tokens": PROMPT - 1}), Case(manifest=_set("token_count", 7))],
    "COVERAGE": [
        Case(manifest=_tokens_shifted),
        Case(manifest=_pages_swapped),
        Case(manifest=_last_page_dropped),
        Case(manifest=_decode_page_listed),
        Case(manifest=_page(0, "generation", PAGES[0].generation - 1)),  # stale generation
        Case(exp={"received": [0, 0]}),  # a page received twice, another never
        Case(exp={"received": [0]}),
    ],
    "GENERATION": [Case(gen={PAGES[1].page_id: PAGES[1].generation + 1})],
    "CHECKSUM": [
        Case(manifest=_page(1, "checksum", 12345)),
        Case(manifest=_checksum_of_other_page),
        Case(manifest=_set("checksum_algo", "none")),  # no downgrade to another algorithm
    ],
    "MODEL": [
        Case(manifest=_set("model_fingerprint", "fp-other")),
        Case(manifest=_set("first_token", VOCAB)),
    ],
    "LAYOUT": [Case(manifest=lambda m: setattr(m.layout, "head_dim", 16))],
}


def run_case(*cases: Case) -> str:
    m = make_manifest()
    exp_over: dict[str, Any] = {}
    gen = dict(GEN)
    secret = SECRET
    for case in cases:
        exp_over.update(case.exp)
        gen.update(case.gen)
        if case.secret != SECRET:
            secret = case.secret
    # prefill signs the changed fields; a change to the MAC itself comes after the signature
    for case in cases:
        case.manifest(m)
    mf.sign(m, secret)
    for case in cases:
        if _touches_mac(case):
            case.manifest(m)
    return reason(m, expected(**exp_over), gen)


def _touches_mac(case: Case) -> bool:
    probe = make_manifest()
    probe.mac = b"probe"
    case.manifest(probe)
    return probe.mac != b"probe"


@pytest.mark.parametrize(
    ("check", "case"),
    [(check, case) for check, cases in BREAKS.items() for case in cases],
)
def test_each_check_fails_with_its_own_reason(check: str, case: Case) -> None:
    assert run_case(case) == check


def test_an_unknown_reservation_fails_check_1() -> None:
    assert reason(signed(make_manifest()), None) == "RESERVATION"


ORDER = ["RESERVATION", "MAC", "COUNT", "COVERAGE", "GENERATION", "CHECKSUM", "MODEL", "LAYOUT"]


@pytest.mark.parametrize("first", range(len(ORDER)))
def test_checks_run_in_design_order(first: int) -> None:
    """Breaking check ``first`` and every one after it reports ``first``: the earliest check of
    DESIGN.md's list decides (MODEL's fingerprint before LAYOUT, both check 6)."""
    cases = [BREAKS[check][0] for check in ORDER[first:]]
    assert run_case(*cases) == ORDER[first]


def test_generation_fails_when_decodes_pool_moved_under_a_live_reservation() -> None:
    """Check 4 on a real pool and the real checksums: a manifest that verifies fails GENERATION
    once the pool has reused the reservation's pages (what check 3 cannot see: the manifest and
    decode's record of the reservation still agree)."""
    pool = PagePool(4, num_layers=2, page_size=PS, num_kv_heads=2, head_dim=8)
    refs = pool.allocate(4, RID)
    assert refs is not None
    pool.kv.copy_(torch.randn_like(pool.kv))  # the received KV
    decode: Any = SimpleNamespace(pool=pool)

    def checksums(ids: list[int], seeds: list[int]) -> list[int]:
        return DecodeServicer._checksums(decode, ids, seeds)

    m = make_manifest()
    seeds = [kernels.checksum_seed(RID, i) for i in range(2)]
    sums = checksums([r.page_id for r in refs[:2]], seeds)
    for i, ref in enumerate(refs[:2]):
        m.pages[i].page_id, m.pages[i].generation = ref.page_id, ref.generation
        m.pages[i].checksum = sums[i]
    m.checksum_algo = kernels.CHECKSUM_ALGO
    mf.sign(m, SECRET)
    exp = expected(pages=refs, checksum_algo=kernels.CHECKSUM_ALGO)

    def verify() -> str:
        try:
            mf.verify(
                m,
                exp,
                current_generation=pool.generation,
                checksums=checksums,
                checksum_seed=kernels.checksum_seed,
            )
        except IntegrityError as err:
            return err.reason
        return "OK"

    assert verify() == "OK"  # control: the pool as reserved
    pool.release(RID)
    again = pool.allocate(4, "res-2")
    assert again is not None and {r.page_id for r in again} == {r.page_id for r in refs}
    assert verify() == "GENERATION"


# ---- the MAC covers every field ---------------------------------------------------------------


def _changed(value: Any, fd: FieldDescriptor) -> Any:
    if fd.type == FieldDescriptor.TYPE_STRING:
        return value + "x"
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return value + b"x"
    if fd.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64):
        return value + 1
    raise AssertionError(f"no change defined for {fd.full_name} ({fd.type}): add one")


def _mutations(msg: Message, path: str) -> Iterator[tuple[str, Callable[[Message], None]]]:
    """One change per scalar field of ``msg`` (recursively; per element of repeated messages,
    plus one more element and one fewer), as (field path, apply to a copy)."""
    for fd in msg.DESCRIPTOR.fields:
        name = f"{path}{fd.name}"
        if name == "mac":
            continue
        if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.is_repeated:
            items = getattr(msg, fd.name)
            for i, item in enumerate(items):
                for sub, apply in _mutations(item, f"{name}[{i}]."):
                    yield sub, _on_item(fd.name, i, apply)
            yield f"{name}+1", lambda m, f=fd.name: getattr(m, f).add()
            yield f"{name}-1", lambda m, f=fd.name: getattr(m, f).pop()
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            for sub, apply in _mutations(getattr(msg, fd.name), f"{name}."):
                yield sub, _on_field(fd.name, apply)
        else:
            assert not fd.is_repeated, f"{name}: add a repeated scalar"
            yield name, _on_scalar(fd)


def _on_item(
    field_name: str, i: int, apply: Callable[[Message], None]
) -> Callable[[Message], None]:
    return lambda m: apply(getattr(m, field_name)[i])


def _on_field(field_name: str, apply: Callable[[Message], None]) -> Callable[[Message], None]:
    return lambda m: apply(getattr(m, field_name))


def _on_scalar(fd: FieldDescriptor) -> Callable[[Message], None]:
    return lambda m: setattr(m, fd.name, _changed(getattr(m, fd.name), fd))


def test_the_mac_covers_every_field() -> None:
    """Change any one field of a signed manifest (found from the message's descriptor, so a
    field added later is included): the MAC fails, also for a sender that claims the changed
    ids with this reservation's secret (check 1 passes)."""
    original = signed(make_manifest())
    mutations = dict(_mutations(original, ""))
    top = {fd.name for fd in common_pb2.KvManifest.DESCRIPTOR.fields} - {"mac"}
    assert {re.sub(r"[^a-z_].*", "", path) for path in mutations} == top
    assert "pages[1].checksum" in mutations and "layout.dtype" in mutations
    for path, apply in mutations.items():
        m = common_pb2.KvManifest()
        m.CopyFrom(original)
        apply(m)
        assert m != original, path
        assert mf.canonical_bytes(m) != mf.canonical_bytes(original), path
        claimed = expected(
            request_id=m.request_id, tenant_id=m.tenant_id, reservation_id=m.reservation_id
        )
        assert reason(m, claimed) == "MAC", path


def test_canonical_encoding_distinguishes_unicode_forms() -> None:
    """NFC and NFD of one text are different manifests: the encoding normalises nothing."""
    nfc = unicodedata.normalize("NFC", "t-\u00e9quipe")
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfc != nfd and unicodedata.normalize("NFC", nfd) == nfc
    for attr in ("tenant_id", "request_id", "model_fingerprint"):
        a, b = make_manifest(), make_manifest()
        setattr(a, attr, nfc)
        setattr(b, attr, nfd)
        assert mf.canonical_bytes(a) != mf.canonical_bytes(b), attr
    # signed for the NFC tenant, presented as the NFD one (which decode's record names)
    m = make_manifest()
    m.tenant_id = nfc
    mf.sign(m, SECRET)
    assert reason(m, expected(tenant_id=nfc)) == "OK"  # control
    m.tenant_id = nfd
    assert reason(m, expected(tenant_id=nfd)) == "MAC"


# ---- the checksum inputs are on the pool's device --------------------------------------------


@pytest.fixture
def recorded_checksum(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.device, ...]]:
    """kernels.page_checksum replaced by one that records the devices of its arguments and,
    as the kernels do, refuses ids or seeds on another device than the pool (never reading
    any data: the pool below is on the "meta" device, which holds none)."""
    calls: list[tuple[torch.device, ...]] = []

    def page_checksum(
        kv_pages: torch.Tensor, page_ids: torch.Tensor, seeds: torch.Tensor
    ) -> torch.Tensor:
        calls.append((kv_pages.device, page_ids.device, seeds.device))
        assert page_ids.device == kv_pages.device, "page ids not on the pool's device"
        assert seeds.device == kv_pages.device, "seeds not on the pool's device"
        assert page_ids.dtype == seeds.dtype == torch.int64
        return torch.zeros(page_ids.shape[0], dtype=torch.int64)

    monkeypatch.setattr(kernels, "page_checksum", page_checksum)
    return calls


def meta_pool(**extra: Any) -> SimpleNamespace:
    # a pool on a device that is not the CPU: what hard-coded CPU inputs would not match
    return SimpleNamespace(kv=torch.empty((12, 2, 2, PS, 2, 8), device="meta"), **extra)


def test_decode_checksum_inputs_are_on_the_pool_device(
    recorded_checksum: list[tuple[torch.device, ...]],
) -> None:
    decode: Any = SimpleNamespace(pool=meta_pool())
    sums = DecodeServicer._checksums(decode, [7, 2], [11, 12])
    assert sums == [0, 0]
    meta = torch.device("meta")
    assert recorded_checksum == [(meta, meta, meta)]


def test_prefill_checksum_inputs_are_on_the_pool_device(
    recorded_checksum: list[tuple[torch.device, ...]],
) -> None:
    prefill: Any = SimpleNamespace(
        pool=meta_pool(page_size=PS), rt=SimpleNamespace(fingerprint="fp", layout=LAYOUT)
    )
    req = prefill_pb2.PrefillRequest(
        request_id="r",
        tenant_id="t",
        reservation=prefill_pb2.Reservation(
            reservation_id=RID,
            pages=[{"page_id": p.page_id, "generation": p.generation} for p in PAGES],
        ),
    )
    m = PrefillServicer._manifest(prefill, req, [PageRef(0, 1), PageRef(3, 1)], 5, PROMPT)
    assert [p.page_id for p in m.pages] == [7, 2] and [p.checksum for p in m.pages] == [0, 0]
    meta = torch.device("meta")
    assert recorded_checksum == [(meta, meta, meta)]


def test_decode_checksums_on_a_cpu_pool_are_the_kernels() -> None:
    """Control: on a real (CPU) pool the helper gives the kernel's own checksums, as unsigned."""
    pool = PagePool(3, num_layers=2, page_size=PS, num_kv_heads=2, head_dim=8)
    pool.kv.copy_(torch.randn_like(pool.kv))
    seeds = [kernels.checksum_seed(RID, i) for i in range(2)]
    decode: Any = SimpleNamespace(pool=pool)
    got = DecodeServicer._checksums(decode, [2, 0], seeds)
    want = kernels.page_checksum(pool.kv, torch.tensor([2, 0]), torch.tensor(seeds))
    assert got == [int(x) & 0xFFFFFFFFFFFFFFFF for x in want.tolist()]
    assert got[0] != got[1]
