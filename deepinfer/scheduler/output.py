"""What one scheduling step hands to the model runner, and what `Scheduler.update` hands back.

Owns: `ScheduledRequest` (one request's slice of the step: which positions, which token ids, where they go
in the cache, how many logits rows it samples), `SchedulerOutput` (the step), `StepResult` (the update).
The explicit row map matters: row i of the sampled logits is NOT request i once partial prefills (no
rows) and draft tokens (several rows) share a batch — the seed lost a day to exactly that (H20 plan P4.2).

Must not: hold tensors; the runner builds them from these lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.cache.block_pool import SequenceSlots
from deepinfer.scheduler.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start_position: int  # == request.num_computed_tokens when scheduled; 0 means the sequence starts
    # afresh: the runner must reset its window ring and compressor partial state (new or recomputed)
    num_new_tokens: int  # positions [start_position, start_position + num_new_tokens) are computed
    num_draft_tokens: int  # the last num_draft_tokens of them are drafts to verify
    token_ids: tuple[int, ...]  # ids of those positions
    slots: SequenceSlots  # block table (covers every computed position), ring and compressor-state slots
    num_sampled_rows: int  # 0: a prefill chunk short of the end; 1: next token; 1 + drafts when verifying

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]  # running requests first (arrival order), then new admissions
    preempted_ids: tuple[str, ...]  # freed this step; they will be recomputed later
    finished_ids: tuple[str, ...]  # finished/aborted/failed since the previous step: runner may drop state
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def sample_rows(self) -> dict[str, range]:
        """Rows of the sampled-logits tensor per request, in `scheduled` order (rows are concatenated)."""
        rows: dict[str, range] = {}
        start = 0
        for sr in self.scheduled:
            if sr.num_sampled_rows:
                rows[sr.request_id] = range(start, start + sr.num_sampled_rows)
                start += sr.num_sampled_rows
        return rows


@dataclass
class StepResult:
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)  # appended this step, per request
    finished: list[Request] = field(default_factory=list)  # finished by this update (stop or length)
