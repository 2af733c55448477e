"""`Request`: one sequence as the scheduler sees it — its tokens, how many of them are computed, its state.

The central quantity is `num_computed_tokens`: every token of `all_token_ids` (prompt + outputs) plus any
draft tokens that is not yet computed is a "token to compute". A prefill chunk, a decode token and a
verified draft are the same thing to the scheduler; it only catches `num_computed_tokens` up.

Must not: know about sampling (the engine turns SamplingParams into `max_tokens` and `stop_token_ids`;
stop strings are the detokenizer's job and end a request through `Scheduler.finish`) or hold tensors.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


PENDING_TOKEN = -1  # the id of a position whose token was sampled on the device and is not yet known here


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from position 0
    FINISHED_STOPPED = "finished_stopped"  # a stop token (or a stop string, via Scheduler.finish)
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish_reason of a finished status."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)  # identity semantics: two requests are never "equal" by value
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS included by the engine unless ignore_eos
    payload: Any = None  # opaque to the scheduler (e.g. SamplingParams, generator, detokenizer state)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed for the next step (set by the drafter between steps); computed together with
    # the last real token and verified by the sampler.
    draft_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled on the device whose ids the host does not know yet (asynchronous scheduling: the next
    # step is scheduled while this one runs). They count as positions to compute; their ids are
    # PENDING_TOKEN until `Scheduler.commit` appends the real ones (the runner reads them on the device).
    num_pending_tokens: int = 0
    arrival_index: int = -1  # FCFS order, set by Scheduler.add_request
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id, or the stop string
    error: str | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_token_ids):
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must be non-negative ints")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be a positive int, got {self.max_tokens!r}")
        self.stop_token_ids = frozenset(self.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens (prompt + outputs), drafts excluded."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus those sampled on the device and not yet known (asynchronous scheduling)."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_tokens_with_drafts(self) -> int:
        return self.num_tokens_with_pending + len(self.draft_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of every known token (O(length): per-step callers want `known_token_ids` or
        `last_token_id`)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def known_token_ids(self, start: int, stop: int) -> list[int]:
        """Known tokens (prompt + outputs) of positions [start, stop), clipped to what is known."""
        num = min(stop, self.num_tokens) - start
        return self.token_ids_to_compute(start, num, known_only=True) if num > 0 else []

    def token_ids_to_compute(self, start: int, num: int, known_only: bool = False) -> list[int]:
        """Ids of positions [start, start + num): prompt, then outputs, then pending (PENDING_TOKEN), then
        drafts. Only the asked span is walked: a decode step asks for one position of a sequence of any
        length, and building the whole sequence each step made the scheduler's step grow with the context
        (b128: 0.65 ms at 256 tokens, 33 ms at 32K; benchmarks/bench_scheduler_host.py)."""
        end = start + num
        if start < 0 or num < 0:
            raise ValueError(f"{self.request_id!r}: positions [{start}, {end}) are not a span")
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if not known_only and not self.draft_token_ids and known <= start and end <= known + self.num_pending_tokens:
            return [PENDING_TOKEN] * num  # a decode step's pending token(s)
        parts = (self.prompt_token_ids, self.output_token_ids) if known_only else \
            (self.prompt_token_ids, self.output_token_ids, None, self.draft_token_ids)
        out: list[int] = []
        lo = 0
        for part in parts:
            n = self.num_pending_tokens if part is None else len(part)
            a, b = max(start - lo, 0), min(end - lo, n)
            if a < b:
                out.extend([PENDING_TOKEN] * (b - a) if part is None else part[a:b])
            lo += n
        if end > lo:
            raise ValueError(f"{self.request_id!r}: positions [{start}, {end}) pass the {lo} it has")
        return out

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
