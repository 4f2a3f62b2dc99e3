"""The transfer manifest: how prefill signs it and how decode verifies every field.

Decode accepts a transfer only if all six checks of DESIGN.md hold, in this order:

1. ``RESERVATION`` the reservation exists, is RECEIVING (transfer complete, never verified before)
   and belongs to the same request and tenant;
2. ``MAC`` HMAC-SHA256 under the reservation secret over the canonical encoding verifies;
3. ``COUNT`` ``token_count`` equals the reserved prompt tokens; ``COVERAGE`` the pages listed are
   exactly the first ``ceil(token_count / page_size)`` reserved pages in order, every listed page
   was received exactly once, and ``tokens_in_page`` adds up to ``token_count`` (full pages but the
   last);
4. ``GENERATION`` every ``(page_id, generation)`` matches the pool right now (check 3 already
   compares the listed generations with the reservation's, so a manifest carrying a stale one fails
   ``COVERAGE``; this one fails only when decode's own pool moved under the reservation);
5. ``CHECKSUM`` every page's checksum, recomputed over the memory that was received, matches (seeded
   with the reservation id and page index, so a correct copy of another page or a replay fails);
6. ``MODEL`` / ``LAYOUT`` fingerprint and layout equal decode's own, and (``MODEL``) the first token
   is a token of its model (it joins a decode step shared with other requests).

A failed check raises :class:`kvfence.errors.IntegrityError` whose ``reason`` is the check's name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfence.config import pages_needed
from kvfence.errors import IntegrityError
from kvfence.kv.pool import PageRef
from kvfence.proto.kvfence.v1 import common_pb2


def canonical_bytes(m: common_pb2.KvManifest) -> bytes:
    """Every manifest field but the MAC, in a fixed textual encoding (stable across versions).

    Strings are encoded as they are, never normalised: two Unicode forms of one text (NFC and
    NFD) are different bytes, so a MAC over one does not verify the other."""
    body = {
        "v": 1,
        "request_id": m.request_id,
        "tenant_id": m.tenant_id,
        "reservation_id": m.reservation_id,
        "model_fingerprint": m.model_fingerprint,
        "layout": layout_tuple(m.layout),
        "token_count": m.token_count,
        "first_token": m.first_token,
        "pages": [[p.page_id, p.generation, p.tokens_in_page, p.checksum] for p in m.pages],
        "checksum_algo": m.checksum_algo,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(m: common_pb2.KvManifest, secret: bytes) -> None:
    """Set ``m.mac`` to HMAC-SHA256(secret, canonical encoding)."""
    m.mac = hmac.new(secret, canonical_bytes(m), hashlib.sha256).digest()


def layout_tuple(layout: common_pb2.KvLayout) -> list[object]:
    return [
        layout.page_size,
        layout.dtype,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
    ]


@dataclass(frozen=True)
class Expected:
    """What decode knows about the reservation the manifest claims to fill."""

    request_id: str
    tenant_id: str
    reservation_id: str
    secret: bytes
    prompt_tokens: int
    pages: Sequence[PageRef]  # every reserved page, in order
    receiving: bool  # the reservation is in RECEIVING with its transfer complete
    received: Sequence[int]  # page indices received, in arrival order
    fingerprint: str
    layout: common_pb2.KvLayout
    vocab_size: int  # the first token must be a token of this model
    checksum_algo: str


def verify(
    m: common_pb2.KvManifest,
    exp: Expected | None,
    *,
    current_generation: Callable[[int], int],
    checksums: Callable[[list[int], list[int]], list[int]],
    checksum_seed: Callable[[str, int], int],
) -> None:
    """Run the six checks; raise IntegrityError(reason=<check>) on the first that fails.

    ``current_generation(page_id)`` reads the pool now; ``checksums(page_ids, seeds)`` recomputes
    checksums over the received memory.
    """
    # 1. reservation
    if exp is None:
        raise IntegrityError("manifest names an unknown reservation", reason="RESERVATION")
    if m.reservation_id != exp.reservation_id or m.request_id != exp.request_id:
        raise IntegrityError("manifest belongs to another request", reason="RESERVATION")
    if m.tenant_id != exp.tenant_id:
        raise IntegrityError("manifest belongs to another tenant", reason="RESERVATION")
    if not exp.receiving:
        raise IntegrityError(
            "reservation is not in RECEIVING with a complete transfer", reason="RESERVATION"
        )
    # 2. MAC
    want = hmac.new(exp.secret, canonical_bytes(m), hashlib.sha256).digest()
    if not hmac.compare_digest(want, m.mac):
        raise IntegrityError("manifest MAC does not verify", reason="MAC")
    # 3. count and coverage
    page_size = exp.layout.page_size
    if m.token_count != exp.prompt_tokens:
        raise IntegrityError(
            f"manifest carries {m.token_count} tokens, reservation has {exp.prompt_tokens}",
            reason="COUNT",
        )
    n = pages_needed(m.token_count, page_size)
    listed = [(p.page_id, p.generation) for p in m.pages]
    wanted = [(r.page_id, r.generation) for r in exp.pages[:n]]
    if listed != wanted:
        raise IntegrityError(
            f"manifest lists {len(listed)} pages; expected the first {n} reserved pages in order",
            reason="COVERAGE",
        )
    if sorted(exp.received) != list(range(n)):
        raise IntegrityError(
            f"received page indices {sorted(exp.received)[:8]}... do not cover 0..{n - 1} once",
            reason="COVERAGE",
        )
    for i, p in enumerate(m.pages):
        full = page_size if i < n - 1 else m.token_count - page_size * (n - 1)
        if p.tokens_in_page != full:
            raise IntegrityError(
                f"page {i} claims {p.tokens_in_page} tokens, expected {full}", reason="COVERAGE"
            )
    # 4. generations, right now
    for p in m.pages:
        if current_generation(p.page_id) != p.generation:
            raise IntegrityError(
                f"page {p.page_id} generation changed since the reservation", reason="GENERATION"
            )
    # 5. checksums over the received memory
    if m.checksum_algo != exp.checksum_algo:
        raise IntegrityError(
            f"checksum algorithm {m.checksum_algo!r}, decode uses {exp.checksum_algo!r}",
            reason="CHECKSUM",
        )
    seeds = [checksum_seed(exp.reservation_id, i) for i in range(n)]
    actual = checksums([p.page_id for p in m.pages], seeds)
    for i, (p, got) in enumerate(zip(m.pages, actual, strict=True)):
        if got != p.checksum:
            raise IntegrityError(f"checksum mismatch on page index {i}", reason="CHECKSUM")
    # 6. model and layout
    if m.model_fingerprint != exp.fingerprint:
        raise IntegrityError("manifest model fingerprint differs from decode's", reason="MODEL")
    if layout_tuple(m.layout) != layout_tuple(exp.layout):
        raise IntegrityError(
            f"manifest layout {layout_tuple(m.layout)} differs from decode's "
            f"{layout_tuple(exp.layout)}",
            reason="LAYOUT",
        )
    # The first token joins a decode step shared with other requests: one outside the vocabulary
    # would fail the whole step (every row's request), or on a GPU trip a device assert.
    if not 0 <= m.first_token < exp.vocab_size:
        raise IntegrityError(
            f"manifest's first token {m.first_token} is not a token of decode's model "
            f"(vocabulary {exp.vocab_size})",
            reason="MODEL",
        )
