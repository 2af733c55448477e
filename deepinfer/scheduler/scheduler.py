"""`Scheduler`: decides, each step, which requests compute how many tokens, within the token budget, the
running-sequence cap and the block pool.

Policy (nano-vllm / vLLM v1, adapted to V4):
- Catch-up on `num_computed_tokens`: a request needs `num_tokens_with_drafts - num_computed_tokens` more
  positions; prefill chunks, decode tokens and draft tokens are all just that.
- RUNNING requests first, in arrival order, then WAITING ones FCFS (never skipping the head: a big prompt
  is not starved by smaller ones behind it). New admissions stop at the first preemption of the step.
- When a running request cannot get a block, the LATEST-arrived running request is preempted by
  recompute: all its resources are freed, `num_computed_tokens` resets to 0 and it goes to the FRONT of
  the waiting queue. Recompute (not swap) suits V4: its window ring and compressor partial state are
  rebuilt from position 0, and outputs already produced are kept, so the request resumes where it was.
- Length: prompts longer than `max_model_len` are rejected; generation stops (finish reason "length")
  once prompt + outputs reach `max_model_len` or outputs reach `max_tokens`. At most `max_model_len`
  positions are ever computed (the last sampled token is never computed).
- Asynchronous scheduling (the engine schedules step n+1 while step n runs on the device): `update` is
  `advance` (positions computed, one token pending per sampled request, at launch) then `commit` (the
  sampled ids, stop and length checks, once the device has them). A pending token is a position to
  compute whose id the runner reads on the device (`PENDING_TOKEN` here); a request whose pending tokens
  already reach its length limit is not scheduled again, so nothing past the limit is ever computed.

Must not: import a tensor library or sampling; run the model; detokenize (stop strings come in through
`finish`). One `update` must follow each `schedule`, in order.
"""
from __future__ import annotations

import bisect
from collections import deque

from deepinfer.cache.block_pool import BlockPool
from deepinfer.scheduler.config import SchedulerConfig
from deepinfer.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult
from deepinfer.scheduler.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool | None = None) -> None:
        self.config = config
        # `is None`, not `or`: an empty pool has len 0 and would be silently replaced
        if block_pool is None:
            block_pool = BlockPool(config.num_blocks, config.block_size, config.max_num_seqs)
        self.block_pool = block_pool
        if self.block_pool.block_size != config.block_size or self.block_pool.max_num_seqs < config.max_num_seqs:
            raise ValueError("block_pool does not match the config (block_size / max_num_seqs)")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept sorted by arrival_index: the tail is the preemption victim
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._next_arrival = 0
        self._finished_ids: list[str] = []

    # ---- intake ----------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens is longer than "
                f"max_model_len = {self.config.max_model_len}")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} is not fresh (status {request.status.name})")
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, pool = self.config, self.block_pool
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and self._sampled_out(req):  # its last token is on the way: done
                i += 1
                continue
            if req.draft_token_ids:  # (nothing to trim without drafts: the common decode step skips it)
                self._trim_drafts(req)
            num_new = min(req.num_tokens_with_drafts - req.num_computed_tokens, budget,
                          cfg.max_model_len - req.num_computed_tokens)
            if num_new <= 0:  # nothing to compute (no update since the last step)
                i += 1
                continue
            end = req.num_computed_tokens + num_new
            while not pool.can_allocate_for(req.request_id, end):
                victim = self.running.pop()  # latest arrival; never one already scheduled (those are < i)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._take(req, num_new))
                budget -= num_new
                i += 1

        # FCFS admission; a preemption means blocks are short, so admitting more would only thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending_tokens:  # preempted with a token still on the way: admitted once it is known
                break
            req.draft_token_ids.clear()  # drafts only follow a computed context
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget:
                if not cfg.chunked_prefill:
                    break
                num_new = budget
            if not pool.can_allocate_for(req.request_id, req.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            scheduled.append(self._take(req, num_new))
            budget -= num_new

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(tuple(scheduled), tuple(preempted), tuple(finished),
                               cfg.max_num_batched_tokens - budget)

    def _trim_drafts(self, req: Request) -> None:
        """Drop drafts that could never be used: past max_model_len, or past the last token max_tokens allows
        (verifying k drafts yields up to k + 1 tokens)."""
        room = min(self.config.max_model_len - req.num_tokens_with_pending,
                   req.max_tokens - req.num_output_tokens - req.num_pending_tokens - 1)
        if len(req.draft_token_ids) > max(room, 0):
            del req.draft_token_ids[max(room, 0):]

    def _take(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        slots = self.block_pool.allocate_for(req.request_id, end)
        num_drafts = max(0, end - req.num_tokens_with_pending)
        del req.draft_token_ids[num_drafts:]  # drafts cut off by the budget are dropped, not deferred
        sampled_rows = num_drafts + 1 if end >= req.num_tokens_with_pending else 0
        return ScheduledRequest(req, start, num_new, num_drafts, tuple(req.token_ids_to_compute(start, num_new)),
                                slots, sampled_rows)

    def _sampled_out(self, req: Request) -> bool:
        """Whether the tokens already sampled (known and pending) reach the request's length limit."""
        return (req.num_output_tokens + req.num_pending_tokens >= req.max_tokens
                or req.num_tokens_with_pending >= self.config.max_model_len)

    def _preempt(self, req: Request) -> None:
        self.block_pool.free(req.request_id)
        req.num_computed_tokens = 0
        req.draft_token_ids.clear()
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- results ---------------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> StepResult:
        """Advance every scheduled request by its computed tokens and append its sampled tokens (the
        synchronous step: `advance` then `commit`).

        `sampled_token_ids[id]` holds, for a request with `num_sampled_rows > 0`, the accepted drafts
        followed by one sampled token (so 1 .. num_draft_tokens + 1 ids). Requests aborted since `schedule`
        are skipped. Tokens for a request that sampled no row are a row-mapping bug and raise."""
        self._check_sampled_ids(output, sampled_token_ids)  # before advance: a bad map changes nothing
        self.advance(output)
        return self._commit(output, sampled_token_ids)

    def advance(self, output: SchedulerOutput) -> None:
        """The step was launched: its positions count as computed, and each request that samples a row has
        one more token pending (its id comes with `commit`). Requests aborted since `schedule` are skipped."""
        for sr in output.scheduled:
            req = sr.request
            if req.status is not RequestStatus.RUNNING or self.requests.get(req.request_id) is not req:
                continue  # aborted or failed after schedule(): its tokens are dropped
            if req.num_computed_tokens != sr.start_position:
                raise RuntimeError(f"{req.request_id!r}: update out of order (computed {req.num_computed_tokens}, "
                                   f"scheduled from {sr.start_position})")
            req.num_computed_tokens += sr.num_new_tokens
            if sr.num_sampled_rows:
                req.num_pending_tokens += 1

    def commit(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> StepResult:
        """The sampled ids of an advanced step: append them, roll back rejected drafts, apply stop tokens and
        length limits. With asynchronous scheduling the next step may already be scheduled and advanced
        (the request then has a later token pending, or was preempted meanwhile); a request finished or
        aborted since is skipped, its token dropped."""
        self._check_sampled_ids(output, sampled_token_ids)
        return self._commit(output, sampled_token_ids)

    def _commit(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> StepResult:
        result = StepResult()
        for sr in output.scheduled:
            req = sr.request
            if not sr.num_sampled_rows or req.is_finished or self.requests.get(req.request_id) is not req:
                continue
            if req.num_pending_tokens <= 0:
                raise RuntimeError(f"{req.request_id!r}: commit without a pending token (commit before advance, "
                                   f"or twice)")
            tokens = list(sampled_token_ids.get(req.request_id, ()))
            if not 1 <= len(tokens) <= sr.num_draft_tokens + 1:
                raise ValueError(f"{req.request_id!r}: expected 1..{sr.num_draft_tokens + 1} sampled tokens, "
                                 f"got {len(tokens)}")
            req.num_pending_tokens -= 1
            if req.status is RequestStatus.RUNNING:
                # Rejected drafts were computed but are not part of the sequence: roll them back. The bonus
                # (last) token is never computed yet. (A preempted request recomputes from 0 anyway.)
                req.num_computed_tokens -= sr.num_draft_tokens + 1 - len(tokens)
            req.draft_token_ids.clear()
            appended = result.new_token_ids.setdefault(req.request_id, [])
            for token in tokens:
                req.output_token_ids.append(token)
                appended.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    self._finish(req, status, token if status is RequestStatus.FINISHED_STOPPED else None)
                    result.finished.append(req)
                    break
        return result

    @staticmethod
    def _check_sampled_ids(output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> None:
        scheduled_ids = {sr.request_id for sr in output.scheduled if sr.num_sampled_rows}
        unexpected = set(sampled_token_ids) - scheduled_ids
        if unexpected:
            raise ValueError(f"sampled tokens for requests that sampled no row this step: {sorted(unexpected)}")

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        # A stop token wins over length, so an EOS that is also the last allowed token reports "stop".
        if token in req.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def rewind(self, request_id: str, position: int) -> None:
        """Mark positions >= `position` of a running request as not computed: its cache state was rolled
        back to `position` (a rejected draft, spec/). They are recomputed by the next steps' catch-up;
        its blocks stay allocated."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            raise ValueError(f"rewind: {request_id!r} is not a running request")
        if not 0 <= position <= req.num_computed_tokens:
            raise ValueError(f"rewind: {request_id!r} to position {position}, but it has computed "
                             f"{req.num_computed_tokens}")
        req.num_computed_tokens = position

    # ---- endings ---------------------------------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """End a request in any state (e.g. a stop string found by the detokenizer). False when the id is
        unknown or already finished, so a late abort is harmless."""
        if not status.is_finished:
            raise ValueError(f"finish needs a FINISHED_* status, got {status.name}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, status, stop_reason)
        return True

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def fail(self, request_id: str, error: str | BaseException) -> bool:
        req = self.requests.get(request_id)
        if req is not None:
            req.error = str(error) or type(error).__name__
        return self.finish(request_id, RequestStatus.FINISHED_ERROR)

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.block_pool.free(req.request_id)
        else:  # WAITING or PREEMPTED: holds no blocks
            self.waiting.remove(req)
        req.status = status
        req.stop_reason = stop_reason
        req.draft_token_ids.clear()
        req.num_pending_tokens = 0  # a token still on the way is dropped
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
