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
* both check the generations of the pages they write once per pass, before layer 0, so both count
  their writes as operations in the pool (``PagePool.begin_ops``) from before that check to after
  the last layer (on a GPU, until the stream has run it): a page released meanwhile stays
  QUARANTINED until then, so it cannot change owner between two layers' writes. Counts nest: a
  caller's own count (the prefill and decode services keep one) is unaffected. A decode caller
  whose count covers the step's writes may say so (``pages_held``) and spare the step its own;
* every page that decode attention reads is tag-checked *inside* the attention kernel, at every
  layer (``kernels.plan_decode_attention``: planned once a step, checked at each layer's call); a
  flagged row must never produce a token (the caller fails it with IntegrityError).

With a small model a decode step is dominated by per-step host work, not arithmetic, so the hot path
keeps it small: :class:`DecodeBatch` holds the block tables and expected generations as tensors that
change only when a sequence joins or leaves the batch, the write slots and target pages come from
the host's page lists (their generations are checked on the device with three tensor ops), the
attention plan keeps the OR of its layers' error flags (the CPU reference's changes only when a
layer flags a row), and
:meth:`Engine.prefill_many` prefills every admitted prompt in one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kvfence.errors import IntegrityError
from kvfence.kv.pool import TORCH_DTYPES, PagePool, PageRef
from kvfence.model.llama import Transformer, causal_attend
from kvfence.model.sampling import SamplingParams, sample

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

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """ValueError naming the first id outside the vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], pages: Sequence[PageRef]) -> torch.Tensor:
        """Run the prompt, write every position's K/V (all layers) into ``pages``; return the last
        position's logits (vocab,) float32. Raises IntegrityError if a page is not at the generation
        in ``pages`` (nothing is written then)."""
        logits, errors = self.prefill_many([token_ids], [pages])
        if errors[0] is not None:
            raise errors[0]
        return logits[0]

    @torch.inference_mode()
    def prefill_many(
        self, prompts: Sequence[Sequence[int]], pages: Sequence[Sequence[PageRef]]
    ) -> tuple[torch.Tensor, list[IntegrityError | None]]:
        """:meth:`prefill` for several prompts in one forward pass.

        Returns (logits (N, vocab) float32, one row per prompt, and errors): ``errors[i]`` is an
        IntegrityError when a page of prompt ``i`` is not at the generation in ``pages[i]``; that
        prompt is left out of the pass (nothing is written for it) and its logits row is
        meaningless. Raises ValueError (before anything runs) for an empty prompt, a token outside
        the vocabulary or too few pages.

        Tokens are laid out flat; attention stays causal *within* each prompt (SDPA per group of
        equal-length prompts, the same call a single prefill makes), so a prompt never attends to
        another one's tokens.
        """
        if len(prompts) != len(pages):
            raise ValueError("one page list per prompt")
        ps, dev = self.page_size, self.device
        used: list[list[PageRef]] = []
        for toks, refs in zip(prompts, pages, strict=True):
            n = len(toks)
            if n == 0:
                raise ValueError("empty prompt")
            self.check_tokens(toks)
            needed = -(-n // ps)
            if len(refs) < needed:
                raise ValueError(f"{n} tokens need {needed} pages, got {len(refs)}")
            used.append(list(refs[:needed]))
        flat = [r for refs in used for r in refs]
        if len({r.page_id for r in flat}) != len(flat):  # one write pass needs distinct slots
            raise ValueError("prompts of one prefill pass must not share pages")
        # Held before the generations are checked, so the check holds for every layer's write.
        held = self._hold([r.page_id for r in flat])
        try:
            ids = torch.tensor([r.page_id for r in flat], device=dev)
            want = torch.tensor([r.generation for r in flat], device=dev)
            current = (self.pool.page_gen[ids] == want).tolist()
            errors: list[IntegrityError | None] = []
            k = 0
            for refs in used:
                ok = all(current[k : k + len(refs)])
                k += len(refs)
                errors.append(
                    None
                    if ok
                    else IntegrityError(
                        "prefill target page is not at the generation this request holds",
                        reason="PAGE_GENERATION",
                    )
                )
            logits = torch.zeros(
                (len(prompts), self.vocab_size), dtype=torch.float32, device=dev
            )  # rows of failed prompts stay zero
            # Run the good prompts grouped by length (stable), so each group of equal-length
            # prompts is one contiguous (n, T) block of the flat layout.
            run = sorted(
                (i for i, e in enumerate(errors) if e is None), key=lambda i: len(prompts[i])
            )
            if not run:
                return logits, errors
            tokens: list[int] = []
            positions: list[int] = []
            slots: list[int] = []
            last: list[int] = []
            groups: list[tuple[int, int, int]] = []  # (start token, prompts, length)
            for i in run:
                toks, n = prompts[i], len(prompts[i])
                if groups and groups[-1][2] == n:
                    start, count, _ = groups[-1]
                    groups[-1] = (start, count + 1, n)
                else:
                    groups.append((len(tokens), 1, n))
                tokens.extend(toks)
                positions.extend(range(n))
                refs = used[i]
                slots.extend(refs[p // ps].page_id * ps + p % ps for p in range(n))
                last.append(len(tokens) - 1)
            tok_t = torch.tensor(tokens, dtype=torch.long, device=dev)
            pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
            # (T,) every token, own pages
            slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
            scale = self.scale

            def attend(
                layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
                kernels.write_kv_pages(k, v, self.pool.kv, layer, slot_t)
                return _grouped_causal(q, k, v, groups, scale)

            hidden = self.model(tok_t, pos_t, attend)  # (T, D)
            out = self.model.logits(hidden[torch.tensor(last, device=dev)])  # (len(run), vocab)
            logits[torch.tensor(run, device=dev)] = out
            return logits, errors
        finally:
            self._settle(held)

    @torch.inference_mode()
    def decode_step(self, batch: Sequence[DecodeItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each item: (logits (B, vocab) float32, error_flags (B,) bool).

        A flagged row's logits are meaningless; the caller must fail that sequence. (A loop that
        decodes the same sequences step after step should use :class:`DecodeBatch`, which keeps
        the block tables between steps.)"""
        if not batch:
            raise ValueError("empty decode batch")
        ps, dev = self.page_size, self.device
        max_pages = max(len(it.pages) for it in batch)
        table = [[0] * max_pages for _ in batch]
        gens = [[_PAD_GEN] * max_pages for _ in batch]
        for i, it in enumerate(batch):
            if not 0 <= it.position < len(it.pages) * ps:
                raise ValueError(
                    f"batch item {i}: position {it.position} is outside its {len(it.pages)} pages"
                )
            for j, ref in enumerate(it.pages):
                table[i][j], gens[i][j] = ref.page_id, ref.generation
        block_tables = torch.tensor(table, dtype=torch.int32, device=dev)  # (B, P)
        expected_gen = torch.tensor(gens, dtype=torch.int64, device=dev)  # (B, P)
        return self.decode_rows(
            [it.token_id for it in batch],
            [it.position for it in batch],
            [it.pages[it.position // ps] for it in batch],
            block_tables,
            expected_gen,
        )

    def _hold(self, page_ids: list[int]) -> list[int]:
        """Count a pass's (decode step's, prefill's) write into each page as an operation in the
        pool; returns the pages counted, for :meth:`_settle`.

        Taken before the pages' generations are checked, it makes that check good for the whole
        pass: a page that is current when checked cannot be freed, so cannot change owner, before
        the pass's last layer has written it (a release meanwhile leaves it QUARANTINED until
        ``end_ops``). A page that is already free is left out: its generation moved on when it
        was freed, so the check refuses the write. One already given to another owner is counted
        all the same (the check refuses it too); that owner's release merely waits for the
        pass."""
        try:
            self.pool.begin_ops(page_ids)
            return page_ids
        except ValueError:  # a free page among them: begin_ops counted none
            held = []
            for pid in page_ids:
                try:
                    self.pool.begin_ops([pid])
                except ValueError:
                    continue
                held.append(pid)
            return held

    def _settle(self, held: list[int]) -> None:
        """End :meth:`_hold`'s operations once the pass's writes are done: on a GPU, once the
        stream has run them (a page freed here may be written next by a transfer that no stream
        orders after them)."""
        if not held:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.pool.end_ops(held)

    @torch.inference_mode()
    def decode_rows(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        writes: Sequence[PageRef],
        block_tables: torch.Tensor,
        expected_gen: torch.Tensor,
        *,
        pages_held: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode_step` on prepared inputs: row ``i`` feeds ``token_ids[i]`` at
        ``positions[i]`` (which the caller has checked lies inside the row's pages) into page
        ``writes[i]`` (the row's page ``positions[i] // page_size``, as the caller holds it), with
        block table ``block_tables[i]`` (int32 (B, P)) and generations ``expected_gen[i]`` (int64
        (B, P), padding entries ``_PAD_GEN``).

        The write targets' generations are checked once, before layer 0, and each layer writes
        where that check allowed; so the step counts its write into each target as an operation
        in the pool (``begin_ops``) before the check and settles it after the last layer: a
        release meanwhile cannot hand the page to another owner between two layers' writes.
        ``pages_held=True`` says the caller has already counted one operation on every page of
        ``writes`` that lasts until the step's writes are done (the decode node's batcher does,
        from ``_claim`` until it has read the step's flags); the step then counts none of its
        own, which saves a pool round trip per step (measured at 1-2% of a tiny-model step of 64
        rows on the CPU). A caller that cannot promise that leaves it False."""
        self.check_tokens(token_ids)
        ps, dev = self.page_size, self.device
        held = [] if pages_held else self._hold([r.page_id for r in writes])
        try:
            # Host lists go to the device in one transfer; nothing below synchronises. The write
            # targets come from the caller's page lists, so finding them costs no tensor op; whether
            # they are still the caller's is checked against the pool's page_gen below.
            slots = [r.page_id * ps + p % ps for r, p in zip(writes, positions, strict=True)]
            targets = [r.page_id for r in writes]
            wanted = [r.generation for r in writes]
            inputs = torch.tensor(
                [token_ids, positions, slots, targets, wanted], dtype=torch.long, device=dev
            )  # (5, B)
            tokens, pos, slot, target, want = inputs.unbind(0)
            stale = self.pool.page_gen.index_select(0, target) != want
            # A stale target page is never written (slot -1) and the row is flagged.
            slot_mapping = torch.where(stale, -1, slot)  # (B,) int64
            seq_lens = (pos + 1).to(torch.int32)  # (B,) tokens incl. the current one
            # Planned once for the step's layers; every layer's call checks the pages it reads anew,
            # and the plan ORs the layers' flags (``attention.flags``).
            attention = kernels.plan_decode_attention(
                self.pool.kv, block_tables, expected_gen, self.pool.page_gen, seq_lens, self.scale
            )

            def attend(
                layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
                kernels.write_kv_pages(k, v, self.pool.kv, layer, slot_mapping)
                return attention(q, layer)[0]

            hidden = self.model(tokens, pos, attend)  # (B, D)
            flags = attention.flags | stale
            return self.model.logits(hidden), flags
        finally:
            self._settle(held)


def _grouped_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Sequence[tuple[int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Causal attention within each prompt of a flat layout: ``groups`` lists (start, count,
    length) blocks of ``count`` consecutive prompts of ``length`` tokens each. One SDPA call per
    block, laid out as :func:`causal_attend` lays out a single prompt (bit-identical results)."""
    if len(groups) == 1 and groups[0][1] == 1:
        return causal_attend(scale)(0, q, k, v)
    _, heads, hd = q.shape
    rep = heads // k.shape[1]
    if rep > 1:  # KV heads repeated for GQA, as the reference SDPA path does
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    outs = []
    for start, count, length in groups:
        end = start + count * length

        def block(x: torch.Tensor) -> torch.Tensor:
            return x[start:end].view(count, length, heads, hd).transpose(1, 2)  # noqa: B023

        out = F.scaled_dot_product_attention(
            block(q), block(k), block(v), is_causal=True, scale=scale
        )  # (count, H, length, hd)
        outs.append(out.transpose(1, 2).reshape(count * length, heads, hd))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class DecodeBatch:
    """The decode inputs of a set of sequences that changes a little between steps.

    A row is identified by its page list *object* (a sequence's block table, which must not change
    while the row is in the batch): :meth:`sync` keeps the rows whose list is still there, in order,
    and appends the new ones, so the block-table and generation tensors are touched only when the
    set changes. Padding entries carry a generation no page ever has.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._rows: list[Sequence[PageRef]] = []
        self._limits: list[int] = []  # row i's positions must stay below this
        dev = engine.device
        self.block_tables = torch.zeros((0, 1), dtype=torch.int32, device=dev)
        self.expected_gen = torch.full((0, 1), _PAD_GEN, dtype=torch.int64, device=dev)

    def __len__(self) -> int:
        return len(self._rows)

    def sync(self, rows: Sequence[Sequence[PageRef]]) -> None:
        """Make the batch's rows ``rows`` (page lists, in order)."""
        old = self._rows
        if len(old) == len(rows) and all(a is b for a, b in zip(old, rows, strict=True)):
            return
        where = {id(r): i for i, r in enumerate(old)}
        kept = [where[id(r)] for r in rows if id(r) in where]
        n = len(kept)
        if kept != sorted(kept) or any(id(r) not in where for r in rows[:n]):
            kept, n = [], 0  # not "old rows in order, then new ones": rebuild
        if kept != list(range(len(old))):
            idx = torch.tensor(kept, dtype=torch.long, device=self.engine.device)
            self.block_tables = self.block_tables.index_select(0, idx)
            self.expected_gen = self.expected_gen.index_select(0, idx)
        new = rows[n:]
        if new:
            width = max(self.block_tables.shape[1], *(len(r) for r in new))
            table = [[r.page_id for r in refs] + [0] * (width - len(refs)) for refs in new]
            gens = [[r.generation for r in refs] + [_PAD_GEN] * (width - len(refs)) for refs in new]
            dev = self.engine.device
            tables = [
                self._widen(self.block_tables, width, 0),
                torch.tensor(table, dtype=torch.int32, device=dev),
            ]
            gen_t = [
                self._widen(self.expected_gen, width, _PAD_GEN),
                torch.tensor(gens, dtype=torch.int64, device=dev),
            ]
            self.block_tables = torch.cat(tables)
            self.expected_gen = torch.cat(gen_t)
        ps = self.engine.page_size
        self._rows = list(rows)
        self._limits = [self._limits[i] for i in kept] + [len(r) * ps for r in new]

    @staticmethod
    def _widen(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
        if t.shape[1] >= width:
            return t
        pad = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype, device=t.device)
        return torch.cat([t, pad], dim=1)

    def step(
        self, token_ids: Sequence[int], positions: Sequence[int], *, pages_held: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Engine.decode_step` for the current rows: (logits (B, vocab), flags (B,)).
        ``pages_held``: as in :meth:`Engine.decode_rows`."""
        if not self._rows:
            raise ValueError("empty decode batch")
        if len(token_ids) != len(self._rows) or len(positions) != len(self._rows):
            raise ValueError("one token and one position per row")
        ps = self.engine.page_size
        writes = []
        for i, (p, limit) in enumerate(zip(positions, self._limits, strict=True)):
            if not 0 <= p < limit:
                raise ValueError(
                    f"batch item {i}: position {p} is outside its {len(self._rows[i])} pages"
                )
            writes.append(self._rows[i][p // ps])
        return self.engine.decode_rows(
            token_ids,
            positions,
            writes,
            self.block_tables,
            self.expected_gen,
            pages_held=pages_held,
        )

    def step_and_sample(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        params: Sequence[SamplingParams],
        draws: Sequence[int],
        *,
        pages_held: bool = False,
    ) -> list[int | None]:
        """One decode step and one sampled token per row (``draws[i]`` is row i's draw index);
        None for a row whose tag check failed: it produced no token and must be failed.
        ``pages_held``: as in :meth:`Engine.decode_rows`."""
        logits, flags = self.step(token_ids, positions, pages_held=pages_held)
        bad = flags.tolist()
        if not any(bad):
            return list(sample(logits, params, draws))
        good = [i for i, b in enumerate(bad) if not b]
        out: list[int | None] = [None] * len(bad)
        if good:
            picked = sample(logits[good], [params[i] for i in good], [draws[i] for i in good])
            for i, tok in zip(good, picked, strict=True):
                out[i] = tok
        return out
