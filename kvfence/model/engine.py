"""The model engine on a page pool: prefill a prompt into pages, decode batches from pages.

Slots: token ``pos`` of a sequence lives in ``pages[pos // page_size]`` at offset
``pos % page_size``; its flat slot is ``page_id * page_size + offset``::

    positions  0 .. ps-1 | ps .. 2ps-1 | ...
    pages      pages[0]  | pages[1]    | ...

Isolation rules this module keeps:

* prefill reads no page (causal attention over the prompt itself) and refuses to write into a page
  whose generation is not the one the caller holds;
* decode writes the new token's K/V only where the target page still carries the expected
  generation; a row whose page moved on is skipped and flagged, so a stale block table never writes
  into another owner's page;
* every page that decode attention reads is tag-checked *inside* ``kernels.paged_decode_attention``;
  a flagged row must never produce a token (the caller fails it with IntegrityError).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels
from kvfence.errors import IntegrityError
from kvfence.kv.pool import TORCH_DTYPES, PagePool, PageRef
from kvfence.model.llama import Transformer, causal_attend

# Expected generation for block-table padding: no page ever has it, so a kernel that read past a
# row's pages would flag the row instead of returning another owner's data.
_PAD_GEN = -1


@dataclass(frozen=True, slots=True)
class DecodeItem:
    """One sequence in a decode batch: its last token, that token's position, its block table."""

    token_id: int
    position: int
    pages: Sequence[PageRef]


class Engine:
    """Runs one model over one PagePool (see module docstring for the isolation rules)."""

    def __init__(self, model: Transformer, pool: PagePool):
        args = model.args
        if (pool.num_layers, pool.num_kv_heads, pool.head_dim) != (
            args.num_layers,
            args.num_kv_heads,
            args.head_dim,
        ):
            raise ValueError(
                f"pool layout (layers {pool.num_layers}, kv heads {pool.num_kv_heads}, head dim "
                f"{pool.head_dim}) does not fit the model ({args.num_layers}, {args.num_kv_heads}, "
                f"{args.head_dim})"
            )
        if TORCH_DTYPES[pool.dtype] != model.dtype or pool.kv.device != model.device:
            raise ValueError(
                f"pool is {pool.dtype} on {pool.kv.device}, "
                f"model is {model.dtype} on {model.device}"
            )
        self.model = model
        self.pool = pool
        self.device = model.device
        self.page_size = pool.page_size
        self.scale = args.head_dim**-0.5
        self.vocab_size = args.vocab_size

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], pages: Sequence[PageRef]) -> torch.Tensor:
        """Run the prompt, write every position's K/V (all layers) into ``pages``; return the last
        position's logits (vocab,) float32. Raises IntegrityError if a page is not at the generation
        in ``pages`` (nothing is written then)."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("empty prompt")
        self._check_tokens(token_ids)
        needed = -(-n // self.page_size)
        if len(pages) < needed:
            raise ValueError(f"{n} tokens need {needed} pages, got {len(pages)}")
        used = pages[:needed]
        ids = torch.tensor([p.page_id for p in used], device=self.device)
        want = torch.tensor([p.generation for p in used], device=self.device)
        if not torch.equal(self.pool.page_gen[ids], want):
            raise IntegrityError(
                "prefill target page is not at the generation this request holds",
                reason="PAGE_GENERATION",
            )
        pos = torch.arange(n, device=self.device)
        slots = ids[pos // self.page_size] * self.page_size + pos % self.page_size  # (T,)
        causal = causal_attend(self.scale)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kernels.write_kv_pages(k, v, self.pool.kv, layer, slots)
            return causal(layer, q, k, v)

        tokens = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        hidden = self.model(tokens, pos, attend)  # (T, D)
        return self.model.logits(hidden[-1:])[0]

    @torch.inference_mode()
    def decode_step(self, batch: Sequence[DecodeItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each item: (logits (B, vocab) float32, error_flags (B,) bool).

        A flagged row's logits are meaningless; the caller must fail that sequence."""
        if not batch:
            raise ValueError("empty decode batch")
        self._check_tokens([it.token_id for it in batch])
        ps, dev = self.page_size, self.device
        max_pages = max(len(it.pages) for it in batch)
        table = [[0] * max_pages for _ in batch]
        gens = [[_PAD_GEN] * max_pages for _ in batch]
        target_page, target_gen, slot = [], [], []
        for i, it in enumerate(batch):
            if not 0 <= it.position < len(it.pages) * ps:
                raise ValueError(
                    f"batch item {i}: position {it.position} is outside its {len(it.pages)} pages"
                )
            for j, ref in enumerate(it.pages):
                table[i][j], gens[i][j] = ref.page_id, ref.generation
            ref = it.pages[it.position // ps]
            target_page.append(ref.page_id)
            target_gen.append(ref.generation)
            slot.append(ref.page_id * ps + it.position % ps)
        # Host lists go to the device in one transfer each; nothing below synchronises.
        block_tables = torch.tensor(table, dtype=torch.int32, device=dev)  # (B, P)
        expected_gen = torch.tensor(gens, dtype=torch.int64, device=dev)  # (B, P)
        positions = torch.tensor([it.position for it in batch], dtype=torch.long, device=dev)
        seq_lens = (positions + 1).to(torch.int32)  # (B,) tokens incl. the current one
        tokens = torch.tensor([it.token_id for it in batch], dtype=torch.long, device=dev)
        page_ok = self.pool.page_gen[torch.tensor(target_page, device=dev)] == torch.tensor(
            target_gen, device=dev
        )
        slot_mapping = torch.where(page_ok, torch.tensor(slot, device=dev), -1)  # (B,) int64
        flags = ~page_ok

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nonlocal flags
            kernels.write_kv_pages(k, v, self.pool.kv, layer, slot_mapping)
            out, bad = kernels.paged_decode_attention(
                q, self.pool.kv, layer, block_tables, expected_gen, self.pool.page_gen,
                seq_lens, self.scale,
            )  # fmt: skip
            flags = flags | bad
            return out

        hidden = self.model(tokens, positions, attend)  # (B, D)
        return self.model.logits(hidden), flags
