"""The paged KV pool: page-major storage, per-page generation tags, owners and deferred release.

Storage is ``kv[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` so that one page is
one contiguous buffer (one UCX message). ``page_gen[num_pages]`` (int64, on the pool's device) is
the tag the attention kernel compares with the generation a block table expects.

Page life::

    FREE --allocate--> RESERVED --> RECEIVING --> READY --> IN_USE
                          |             |           |          |
                          +-------------+-----+-----+----------+
                                              | release(): no operation outstanding
                                              v
                                     FREE (generation bumped, optionally scrubbed)
    any held state --quarantine()--> QUARANTINED --release() and ops settled--> FREE

An *operation* is anything that may still write into a page (a posted UCX receive, a kernel in
flight).
``begin_ops``/``end_ops`` count them; a released page with operations outstanding stays QUARANTINED
and is freed by the ``end_ops`` call that settles the last one. So a page is never handed to a new
owner while a write into it may be outstanding, and every free bumps the generation, so a block
table that still names the page fails the tag check.

Allocation returns ``None`` when there is no room now and raises ``ValueError`` for a request that
can never fit. All methods are thread-safe (the decode engine thread and the event loop share a
pool).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from kvfence.config import DTYPE_BYTES

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PageState(IntEnum):
    FREE = 0
    RESERVED = 1
    RECEIVING = 2
    READY = 3
    IN_USE = 4
    QUARANTINED = 5


# Forward moves a holder may make; QUARANTINED is entered through quarantine() only.
_ALLOWED = {
    PageState.RESERVED: {PageState.RECEIVING, PageState.READY, PageState.IN_USE},
    PageState.RECEIVING: {PageState.READY},
    PageState.READY: {PageState.IN_USE},
    PageState.IN_USE: set(),
    PageState.QUARANTINED: set(),
}


@dataclass(frozen=True, slots=True)
class PageRef:
    """A page as one request sees it: the id and the generation it was allocated at."""

    page_id: int
    generation: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    total: int
    free: int
    held: int
    quarantined: int


def ucx_bytes(t: torch.Tensor) -> Any:
    """``t``'s memory as bytes UCX can send or receive into, same shape but the last dimension in
    bytes: a numpy view on the CPU, the CUDA tensor itself on a GPU (UCX takes both)."""
    raw = t.view(torch.uint8)
    return raw if raw.is_cuda else raw.numpy()


class PagePool:
    """Fixed-size pool of KV pages with generation tags (see module docstring)."""

    def __init__(
        self,
        num_pages: int,
        *,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        scrub_on_free: bool = False,
    ):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.scrub_on_free = scrub_on_free
        # (P, L, 2, page_size, kv_heads, head_dim)
        self.kv = torch.zeros(
            (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim),
            dtype=TORCH_DTYPES[dtype],
            device=device,
        )
        self.page_gen = torch.zeros(num_pages, dtype=torch.int64, device=device)
        # Each page's bytes as a UCX-sendable buffer, and page_gen as numpy where the pool is on
        # the CPU: indexing them costs no torch dispatch, which on a transfer's path also means
        # no release of the GIL to ucxx's notifier thread (measured: tens of µs per call there).
        self._buffers: Any = ucx_bytes(self.kv.view(num_pages, -1))
        self._gen_host: Any = self.page_gen.numpy() if self.kv.device.type == "cpu" else None
        # Host mirrors: bookkeeping must not synchronise with the device.
        self._gen = [0] * num_pages
        self._state = [PageState.FREE] * num_pages
        self._owner: list[str | None] = [None] * num_pages
        self._ops = [0] * num_pages
        self._released = [False] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._by_owner: dict[str, list[int]] = {}
        self._want_scrub: set[int] = set()  # released pages whose owner asked for a scrub
        # On a GPU a scrub is a kernel queued on a stream, but a freed page's next owner may
        # receive into it over UCX (RDMA, CUDA copies), which no stream orders: a zeroing still
        # queued could land after the new KV and wipe it (a CHECKSUM failure for an innocent
        # request). Scrubs run on a stream of their own, waited for before the page is free:
        # a page's memset, not whatever the decode stream has queued.
        self._scrub_stream: Any = (
            torch.cuda.Stream(device=self.kv.device) if self.kv.device.type == "cuda" else None
        )
        self._lock = threading.RLock()

    @classmethod
    def page_bytes_for(
        cls, *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: str
    ) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.page_bytes_for(
            num_layers=self.num_layers,
            page_size=self.page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
        )

    @property
    def pool_tokens(self) -> int:
        """Tokens the whole pool can hold: the bound on any one request's prompt + new tokens."""
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stats(self) -> PoolStats:
        with self._lock:
            quarantined = sum(1 for s in self._state if s == PageState.QUARANTINED)
            return PoolStats(
                self.num_pages, len(self._free), self.num_pages - len(self._free), quarantined
            )

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int, owner: str) -> list[PageRef] | None:
        """Take ``n`` pages for ``owner`` (state RESERVED); None when there is no room now."""
        if n <= 0 or n > self.num_pages:
            raise ValueError(f"cannot allocate {n} pages from a pool of {self.num_pages}")
        with self._lock:
            if owner in self._by_owner:
                raise ValueError(f"owner {owner!r} already holds pages")
            if n > len(self._free):
                return None
            ids = [self._free.popleft() for _ in range(n)]
            refs = []
            for pid in ids:
                self._bump(pid)
                self._state[pid] = PageState.RESERVED
                self._owner[pid] = owner
                self._released[pid] = False
                refs.append(PageRef(pid, self._gen[pid]))
            self._by_owner[owner] = ids
            return refs

    def set_state(self, owner: str, state: PageState) -> None:
        """Move every page of ``owner`` forward to ``state`` (RECEIVING, READY or IN_USE)."""
        with self._lock:
            for pid in self._pages(owner):
                if state not in _ALLOWED[self._state[pid]]:
                    move = f"{self._state[pid].name} -> {state.name}"
                    raise ValueError(f"page {pid} of {owner!r}: {move} not allowed")
                self._state[pid] = state

    def quarantine(self, owner: str) -> None:
        """Mark ``owner``'s pages as failed: they stay held until released and settled."""
        with self._lock:
            for pid in self._by_owner.get(owner, []):
                self._state[pid] = PageState.QUARANTINED

    # ---- outstanding operations --------------------------------------------------------------
    def begin_ops(self, page_ids: list[int]) -> None:
        """Count an operation that may write into each page (e.g. a posted receive); all of
        them or, when one is free (ValueError), none: a count left on the others would keep
        them from ever being freed."""
        with self._lock:
            for pid in page_ids:
                if self._owner[pid] is None:
                    raise ValueError(f"operation on free page {pid}")
            for pid in page_ids:
                self._ops[pid] += 1

    def end_ops(self, page_ids: list[int]) -> list[int]:
        """Settle one operation per page; returns the pages this freed (released and settled)."""
        freed = []
        with self._lock:
            for pid in page_ids:
                if self._ops[pid] <= 0:
                    raise ValueError(f"page {pid} has no outstanding operation")
                self._ops[pid] -= 1
                if self._ops[pid] == 0 and self._released[pid]:
                    self._free_page(pid)
                    freed.append(pid)
        return freed

    def outstanding_ops(self, owner: str) -> int:
        with self._lock:
            return sum(self._ops[pid] for pid in self._by_owner.get(owner, []))

    # ---- release -----------------------------------------------------------------------------
    def release(self, owner: str, *, scrub: bool = False) -> list[int]:
        """Give back ``owner``'s pages. Pages with operations outstanding stay QUARANTINED and are
        freed when the last one settles. Returns the pages freed now. Idempotent."""
        freed = []
        with self._lock:
            # A copy: _free_page removes pid from this very list.
            for pid in list(self._by_owner.get(owner, [])):
                if self._released[pid]:
                    continue
                self._released[pid] = True
                if scrub:
                    self._want_scrub.add(pid)
                if self._ops[pid] == 0:
                    self._free_page(pid)
                    freed.append(pid)
                else:
                    self._state[pid] = PageState.QUARANTINED
        return freed

    def _free_page(self, pid: int) -> None:
        owner = self._owner[pid]
        assert owner is not None, f"page {pid} freed twice"
        if self.scrub_on_free or pid in self._want_scrub:
            if self._scrub_stream is None:
                self.kv[pid].zero_()
            else:
                with torch.cuda.stream(self._scrub_stream):
                    self.kv[pid].zero_()
                self._scrub_stream.synchronize()
            self._want_scrub.discard(pid)
        self._bump(pid)
        self._state[pid] = PageState.FREE
        self._owner[pid] = None
        self._released[pid] = False
        pages = self._by_owner[owner]
        pages.remove(pid)
        if not pages:
            del self._by_owner[owner]
        self._free.append(pid)

    def _bump(self, pid: int) -> None:
        self._gen[pid] += 1
        if self._gen_host is not None:
            self._gen_host[pid] = self._gen[pid]  # the same memory as page_gen
        else:
            self.page_gen[pid] = self._gen[pid]

    # ---- queries -----------------------------------------------------------------------------
    def page_buffer(self, page_id: int) -> Any:
        """Page ``page_id``'s bytes, one contiguous buffer that UCX sends from or receives into
        (numpy on the CPU, the CUDA tensor on a GPU)."""
        return self._buffers[page_id]

    def _pages(self, owner: str) -> list[int]:
        if owner not in self._by_owner:
            raise KeyError(f"owner {owner!r} holds no pages")
        return self._by_owner[owner]

    def pages_of(self, owner: str) -> list[PageRef]:
        with self._lock:
            return [PageRef(pid, self._gen[pid]) for pid in self._by_owner.get(owner, [])]

    def owner_of(self, page_id: int) -> str | None:
        return self._owner[page_id]

    def state_of(self, page_id: int) -> PageState:
        return self._state[page_id]

    def generation(self, page_id: int) -> int:
        return self._gen[page_id]

    def owns(self, owner: str, refs: list[PageRef]) -> bool:
        """True when every ref is held by ``owner`` at its current generation (and not released)."""
        with self._lock:
            return all(
                self._owner[r.page_id] == owner
                and self._gen[r.page_id] == r.generation
                and not self._released[r.page_id]
                for r in refs
            )

    def owners(self) -> list[str]:
        with self._lock:
            return list(self._by_owner)

    def check_integrity(self) -> None:
        """Assert the pool's invariants; raises AssertionError naming the first one broken."""
        with self._lock:
            free = list(self._free)
            assert len(free) == len(set(free)), "a page is on the free list twice"
            held = [pid for pages in self._by_owner.values() for pid in pages]
            assert len(held) == len(set(held)), "a page has two owners"
            assert len(free) + len(held) == self.num_pages, (
                f"free {len(free)} + held {len(held)} != total {self.num_pages}"
            )
            for pid in free:
                assert self._state[pid] == PageState.FREE, (
                    f"free-listed page {pid} is {self._state[pid].name}"
                )
                assert self._owner[pid] is None, f"free page {pid} has owner {self._owner[pid]!r}"
                assert self._ops[pid] == 0, f"free page {pid} has outstanding operations"
            for owner, pages in self._by_owner.items():
                for pid in pages:
                    assert self._owner[pid] == owner, f"page {pid} owner mismatch"
                    assert self._state[pid] != PageState.FREE, f"held page {pid} is FREE"
                    if self._released[pid]:
                        assert self._ops[pid] > 0, f"released page {pid} settled but not freed"
            gens = self.page_gen.tolist()
            assert gens == self._gen, "device generations differ from the host mirror"
