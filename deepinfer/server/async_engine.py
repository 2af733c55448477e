"""`AsyncEngine`: the synchronous, non-thread-safe `LLMEngine` behind an asyncio interface.

One background task drives `step()`; every engine call (add, abort, step) runs on ONE worker thread, so
the engine is never entered concurrently and the event loop never blocks on a forward. Each API request
gets an asyncio queue; the loop pushes every `RequestOutput` of its engine requests there. Aborts (a
client went away) are queued on that thread without awaiting, so a cancelled handler can issue them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.sampling import SamplingParams
from deepinfer.server.errors import APIError
from deepinfer.server.metrics import Metrics

log = logging.getLogger("deepinfer.server")


@dataclass
class _Tracked:
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    num_output: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics, max_waiting: int = 256) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-engine")
        self._tracked: dict[str, _Tracked] = {}  # engine request id -> its consumer (event-loop thread only)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pending_adds = 0
        self.accepting = True

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Refuse new work, let in-flight requests finish for up to grace_s, abort the rest, stop the loop."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = dict(self._tracked)
        self.abort(list(left))
        for tracked in left.values():  # None = aborted: the handler ends its response cleanly
            tracked.queue.put_nowait(None)
        if self._task:
            self._task.cancel()
        self._executor.shutdown(wait=True)  # runs the queued aborts: every KV block is free afterwards

    @property
    def num_in_flight(self) -> int:
        return len(self._tracked)

    # ------------------------------------------------------------------ requests
    async def add(self, items: list[tuple[str, str | list[int], SamplingParams]]) -> asyncio.Queue:
        """Queue engine requests (id, prompt, params) that share one output queue; all or none are added.
        Raises APIError 503 while shutting down, 429 when the waiting queue is full, ValueError for bad input."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down", code="service_unavailable")
        waiting = self.engine.scheduler.num_waiting + self._pending_adds  # an estimate; reads are benign
        if waiting + len(items) > self.max_waiting:
            raise APIError(429, f"too many waiting requests ({waiting}, limit {self.max_waiting}); retry later",
                           code="queue_full")
        request_ids = [rid for rid, _, _ in items]
        queue: asyncio.Queue = asyncio.Queue()
        for rid in request_ids:
            self._tracked[rid] = _Tracked(queue)
        self._pending_adds += len(request_ids)
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._add_all, items)
        except BaseException:  # rejected (nothing added), or the client left (abort whatever lands)
            self.abort(request_ids)
            raise
        finally:
            self._pending_adds -= len(request_ids)
        self.metrics.requests_received.inc(len(request_ids))
        self._wake.set()
        return queue

    def _add_all(self, items) -> None:
        added = []
        try:
            for rid, prompt, p in items:
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except BaseException:
            for rid in added:  # all or none: an n>1 request is never half queued
                self.engine.abort(rid)
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Stop engine requests whose consumer is gone. Called on the event loop (also from a cancelled
        handler's finally, which must not await): the abort is queued on the engine thread behind any add of
        the same ids (one FIFO worker), so it can never overtake the add it cancels."""
        gone = sum(self._tracked.pop(rid, None) is not None for rid in request_ids)
        if gone:  # its engine output is ignored from now on: count the abort here
            self.metrics.requests_finished.labels("abort").inc(gone)
        try:
            self._executor.submit(self._abort_now, list(request_ids))
        except RuntimeError:  # executor already shut down: nothing runs any more
            pass

    def _abort_now(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)  # frees its KV blocks now; the next step reports it once (ignored)

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._tracked:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs, busy, waiting, running, usage = await loop.run_in_executor(self._executor, self._step)
            except Exception:  # the engine isolates request failures; anything else must not kill the loop
                log.exception("engine step failed")
                await asyncio.sleep(0.05)
                continue
            self.metrics.set_gauges(waiting, running, usage)
            self.metrics.set_spec(getattr(self.engine, "spec_stats", None))  # the step is done: no race
            for out in outputs:
                self._dispatch(out)
            if not busy:
                # only an add is pending: do not spin on empty steps. (Not "no outputs": a FINAL_ONLY request
                # has none until it ends, a DELTA one none on a prefill chunk, and the engine is busy then.)
                await asyncio.sleep(0.005)

    def _step(self):
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        pool, sched = self.engine.block_pool, self.engine.scheduler
        usage = 1.0 - pool.num_free / pool.num_blocks if pool.num_blocks else 0.0
        return outputs, self.engine.has_unfinished(), sched.num_waiting, sched.num_running, usage

    def _dispatch(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        now = time.monotonic()
        completion = out.outputs[0]
        # counted from the engine's totals, whatever the output carries (a DELTA or FINAL_ONLY output
        # holds only part of the tokens); the first token's time is when the engine had it, not when a
        # (FINAL_ONLY) output brought it here
        new = out.num_output_tokens - tracked.num_output
        if new > 0:
            if tracked.first_token is None:
                tracked.first_token = out.first_token_time if out.first_token_time is not None else now
                self.metrics.ttft.observe(max(0.0, tracked.first_token - tracked.arrival))
            self.metrics.generation_tokens.inc(new)
            tracked.num_output = out.num_output_tokens
        if out.finished:
            del self._tracked[out.request_id]
            self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            self.metrics.requests_finished.labels(completion.finish_reason or "unknown").inc()
            if tracked.first_token is not None and tracked.num_output > 1:
                self.metrics.tpot.observe((now - tracked.first_token) / (tracked.num_output - 1))
        tracked.queue.put_nowait(out)
