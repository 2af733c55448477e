"""`SpecDecoder`: the engine's speculative step around one target forward.

  before the forward   snapshot the non-paged state of every sequence that carries drafts (rollback.py)
  the forward          the runner's, or `execute_with_hidden` when the drafter conditions on hidden rows
  verification         verify.py, on the rows `SchedulerOutput.sample_rows()` maps to each request
  after the update     record acceptance; on a rejection restore the snapshot and rewind the request's
                       computed length to the step's start (the accepted tokens are recomputed next step
                       in the same extend as the new ones); let the drafter observe the step; assign the
                       next drafts to every running request that received tokens
Must not: import the engine (the engine drives this), sample outside verify.py, or map rows itself.
"""
from __future__ import annotations

from typing import Iterable

import torch

from deepinfer.scheduler import RequestStatus, Scheduler, SchedulerOutput
from deepinfer.spec.metrics import AcceptanceStats
from deepinfer.spec.proposer import Computed, Proposer, TargetStep
from deepinfer.spec.rollback import SequenceSnapshot
from deepinfer.spec.verify import Verified


class SpecDecoder:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, target_cache, vocab_size: int) -> None:
        if num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {num_speculative_tokens}")
        self.proposer, self.k, self.cache, self.vocab = proposer, num_speculative_tokens, target_cache, vocab_size
        self.stats = AcceptanceStats()

    @property
    def needs_hidden(self) -> bool:
        return self.proposer.needs_hidden

    def snapshot(self, out: SchedulerOutput) -> dict[str, SequenceSnapshot]:
        return {sr.request_id: SequenceSnapshot.take(self.cache, sr.slots.window_slot, sr.slots.state_slot)
                for sr in out.scheduled if sr.num_draft_tokens}

    @staticmethod
    def drafts_of(out: SchedulerOutput) -> dict[str, list[int]]:
        """The draft ids each scheduled request computes this step (the last num_draft_tokens of its ids)."""
        return {sr.request_id: list(sr.token_ids[len(sr.token_ids) - sr.num_draft_tokens :])
                for sr in out.scheduled}

    def finish_step(self, scheduler: Scheduler, out: SchedulerOutput, verified: dict[str, Verified],
                    snapshots: dict[str, SequenceSnapshot], hidden: dict[str, torch.Tensor] | None,
                    released: Iterable[str]) -> None:
        step = TargetStep()
        for sr in out.scheduled:
            rid, req = sr.request_id, sr.request
            v = verified.get(rid)
            if v is not None and sr.num_draft_tokens:
                self.stats.record(sr.num_draft_tokens, v.num_accepted)
            running = req.status is RequestStatus.RUNNING and scheduler.requests.get(rid) is req
            if running and v is not None and v.num_accepted < sr.num_draft_tokens:
                snapshots[rid].restore()
                scheduler.rewind(rid, sr.start_position)
                step.rewound[rid] = sr.start_position
            step.computed[rid] = Computed(sr.start_position, hidden.get(rid) if hidden else None,
                                          sr.slots.window_slot, sr.slots.state_slot)
        for rid in released:
            self.proposer.release(rid)
        self.proposer.observe(scheduler.requests, step)
        ready = [r for r in scheduler.running if r.request_id in verified]
        drafts = self.proposer.propose(ready, self.k) if ready else {}
        for req in ready:
            d = [int(t) for t in drafts.get(req.request_id, ())][: self.k]
            bad = [t for t in d if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"{type(self.proposer).__name__} proposed ids outside the vocabulary: {bad[:5]}")
            req.draft_token_ids[:] = d
