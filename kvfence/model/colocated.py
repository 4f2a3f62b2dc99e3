"""Prefill and decode in one process on one pool: the reference every differential test compares to.

``ColocatedEngine.generate`` runs requests through the same Engine and Scheduler the services use,
so a disaggregated run (prefill node -> transfer -> decode node) must produce exactly its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvfence.kv.pool import PagePool
from kvfence.model.engine import Engine
from kvfence.model.llama import causal_attend
from kvfence.model.loader import LoadedModel, load_model
from kvfence.model.sampling import SamplingParams
from kvfence.model.scheduler import Scheduler, SequenceStatus
from kvfence.model.tiny import ensure_tiny_model
from kvfence.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt as token ids and how to sample its continuation."""

    prompt_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class GenerationOutput:
    """Generated tokens only (the EOS id included when it ended the run), text, why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: str


class ColocatedEngine:
    """A loaded model, its tokenizer, a page pool and a scheduler in one process."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        tokenizer: Tokenizer | None = None,
        page_size: int = 16,
        num_pages: int = 256,
        max_batch_size: int = 64,
    ):
        shape = loaded.shape
        self.loaded = loaded
        self.tokenizer = tokenizer or load_tokenizer(loaded.path)
        self.pool = PagePool(
            num_pages,
            num_layers=shape.num_layers,
            page_size=page_size,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=loaded.dtype,
            device=loaded.model.device,
        )
        self.engine = Engine(loaded.model, self.pool)
        self.max_batch_size = max_batch_size

    @classmethod
    def from_path(
        cls,
        path: Path | str | None = None,
        *,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        **kwargs: int,
    ) -> ColocatedEngine:
        """Load ``path`` (None = the embedded tiny model) and build an engine on it."""
        folder = ensure_tiny_model() if path is None else Path(path)
        return cls(load_model(folder, dtype=dtype, device=device), **kwargs)  # type: ignore[arg-type]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run every request to completion with continuous batching; outputs in request order.

        Raises ValueError for a request that can never run, IntegrityError if a tag check failed.
        """
        sched = Scheduler(
            self.engine,
            self.tokenizer,
            eos_token_ids=self.loaded.eos_token_ids,
            max_batch_size=self.max_batch_size,
        )
        for i, req in enumerate(requests):
            sched.add(str(i), req.prompt_ids, req.sampling)
        done: dict[str, GenerationOutput] = {}
        try:
            while sched.has_work():
                for out in sched.step():
                    if not out.finished:
                        continue
                    if out.error is not None:
                        raise out.error
                    assert out.status == SequenceStatus.FINISHED and out.token_ids is not None
                    assert out.text is not None and out.finish_reason is not None
                    done[out.seq_id] = GenerationOutput(out.token_ids, out.text, out.finish_reason)
        finally:
            # One request's error ends the run: the others give their pages back (at a step
            # boundary), or the pool keeps them and the next generate() on it finds their ids
            # taken.
            if sched.has_work():
                for i in range(len(requests)):
                    sched.abort(str(i))
                while sched.has_work():
                    sched.step()
        return [done[str(i)] for i in range(len(requests))]

    @torch.inference_mode()
    def logit_gaps(self, prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> list[float]:
        """For each generated token, top-1 minus top-2 logit at the position that produced it.

        Tests use it to tell a real divergence from a near-tie that float rounding may flip.
        """
        ids = [*prompt_ids, *generated_ids][: len(prompt_ids) + len(generated_ids) - 1]
        model = self.loaded.model
        tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
        positions = torch.arange(len(ids), device=model.device)
        hidden = model(tokens, positions, causal_attend(model.args.head_dim**-0.5))
        logits = model.logits(hidden[len(prompt_ids) - 1 :])  # (len(generated), vocab)
        top2 = torch.topk(logits, 2, dim=-1).values
        return (top2[:, 0] - top2[:, 1]).tolist()
