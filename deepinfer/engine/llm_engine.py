"""`LLMEngine`: requests in, `RequestOutput`s out, one `step()` at a time.

Owns: request validation (a bad request raises for that request only; nothing in flight is touched),
per-request sampling state (params, seeded generator, detokenizer, stop checker, logprobs), the step
loop schedule -> run -> sample -> update -> detokenize/stop, and abort. Logprobs are taken from the same
logits rows the sampler drew from (the seed's P5 shipped 0.0 for every token).

Asynchronous scheduling (EngineConfig.async_scheduling; on by default for one CUDA process without
drafting): `step()` schedules and queues step n+1 on the device, with the ids of its decode positions read
there from step n's sampled tokens, and only then waits for step n's tokens and does the host's work on
them (scheduler commit, detokenizing, stop strings, logprobs, outputs) while the device runs step n+1.
Without it that host work (~3 ms a step at batch 128 on the H200's host, BENCHMARKS.md) adds to every
step. Each step's outputs come one `step()` call later, and a request that ends at step n (a stop token
or string) has had one more position computed in step n+1, whose token is dropped. The tokens are the
same as in the synchronous loop: every request sees the same inputs and draws from its own generator in
the same order.
Must not: know tensor layouts (the runner does) or block accounting (the scheduler does).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import count

import torch

from deepinfer import env
from deepinfer.config import ModelConfig
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.distributed_runner import is_parallel, start_parallel_runner
from deepinfer.engine.model_runner import ModelRunner, PendingTokens
from deepinfer.engine.output_text import OutputText
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling import RequestOutputKind, Sampler, SamplingParams
from deepinfer.sampling.logprobs import prompt_logprobs
from deepinfer.sampling.sampler import make_generator
from deepinfer.sampling.stop import StopChecker
from deepinfer.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from deepinfer.scheduler.output import SchedulerOutput
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.verify import Verified, verify
from deepinfer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _State:
    """What the engine keeps per request (the scheduler carries it as the request's payload)."""

    params: SamplingParams
    prompt: str | None
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    stop: StopChecker
    text: OutputText = field(default_factory=OutputText)
    # the prompt's ids as every output reports them: one copy per request, shared by its outputs (a copy
    # per output and step cost ~3 us per 2,000 prompt tokens, per request and step)
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    extra: dict = field(default_factory=dict)
    first_token_time: float | None = None
    # what the request's DELTA outputs have carried so far
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False


@dataclass
class _InFlight:
    """A step queued on the device whose sampled tokens the host has not read yet (asynchronous mode)."""

    out: SchedulerOutput
    pending: PendingTokens | None  # the sampled tokens on the device, for the next step's inputs
    host: object | None  # the SamplerOutput being copied to the host
    ready: object | None  # the CUDA event after that copy (None: on the host already)

    @property
    def rows(self) -> dict[str, int]:
        """Request id -> row of the sampled tokens (none when the step sampled nothing)."""
        return self.pending.rows if self.pending is not None else {}


def _rows_of(logits: torch.Tensor, rows) -> torch.Tensor:
    """A request's logits rows: a view for a contiguous range (sample_rows' form; on a GPU an indexing
    kernel per request costs more host time than the batch's sampling), else gathered."""
    if isinstance(rows, range) and rows.step == 1:
        return logits[rows.start : rows.stop]
    return logits[list(rows)]


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 speculative: SpeculativeConfig | dict | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_checkpoint(config.model)
        spec = SpeculativeConfig.parse(speculative)  # bad settings fail before any weight is loaded
        sample_on = env.sample_on()
        if spec is not None:
            spec.check_model(self.model_config)
            if is_parallel(config):
                raise NotImplementedError("speculative decoding runs in one process; it is not wired into the "
                                          "tensor/expert/data parallel runner")
        self.tokenizer = tokenizer or Tokenizer.from_checkpoint(config.model)
        if is_parallel(config):  # one process per rank; this one is rank 0 (engine/distributed_runner.py)
            self.runner = start_parallel_runner(config, self.model_config)
        else:
            self.runner = ModelRunner(config, self.model_config)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, block_size=config.block_size, num_blocks=self.runner.num_blocks))
        self.sampler = Sampler()
        # where the sampler runs: the runner's device, where its logits are (DEEPINFER_SAMPLE_ON=host: the CPU)
        self.sample_device = self.runner.device if sample_on == "device" else torch.device("cpu")
        self.spec = None  # speculative decoding (spec/): drafts verified in the same step's extend
        if spec is not None:
            from deepinfer.spec.factory import build_spec_decoder

            self.spec = build_spec_decoder(spec, self.model_config, config.model, self.runner.model,
                                           self.runner.params, self.runner.numerics, config.max_num_seqs)
        self._requests: dict[str, Request] = {}
        self._seed_counter = count()
        self.async_scheduling = self._async_mode(config.async_scheduling, spec, sample_on)
        self._in_flight: _InFlight | None = None

    def _async_mode(self, asked: bool | None, spec, sample_on: str) -> bool:
        """Asynchronous scheduling: asked for, or (None) on for a one-process CUDA engine that samples on the
        device. It needs one sampled token per request and step, on the runner's device: not with drafting
        (a step's token count is known only after verification). A parallel group runs it when asked (rank
        0 broadcasts the step's ids from its device, engine/distributed_runner.py; tested on CPU, gloo); it is
        not its default until it has run on GPUs (no multi-GPU machine has been lent: issue 10)."""
        possible = spec is None
        if asked and not possible:
            raise ValueError("async_scheduling does not run with speculative decoding (drafts change how many "
                             "tokens a step yields before the next step can be scheduled)")
        if asked is None:
            return (possible and not is_parallel(self.config) and self.runner.device.type == "cuda"
                    and sample_on == "device")
        return bool(asked)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue. Raises ValueError naming what is wrong; the engine state is untouched then."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id}: params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"request {request_id}: the engine takes n=1 requests; LLM.generate fans out n>1")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id}: token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        eos = self.tokenizer.eos_id
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(self._seed_counter)
        # the generator lives where the sampler draws (the runner's device, see sample_device)
        state = _State(params, text, make_generator(seed, self.sample_device), self.tokenizer.detokenizer(),
                       StopChecker.from_params(params, eos),
                       logprobs=[] if params.logprobs is not None else None,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        state.prompt_ids = list(ids)
        req = Request(request_id, ids, params.max_tokens, params.stop_token_set(eos), payload=state)
        self.scheduler.add_request(req)  # raises (prompt too long, ...) before anything is recorded
        self._requests[request_id] = req

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; False if unknown or already finished."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Requests not finished, or a step whose outputs have not been returned yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def spec_stats(self):
        """Draft acceptance per draft position (spec.AcceptanceStats), or None without drafting."""
        return self.spec.stats if self.spec is not None else None

    @property
    def block_pool(self):
        return self.scheduler.block_pool

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns an output for every request that progressed or finished (with
        asynchronous scheduling: in the previous step)."""
        if self.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        touched = self._finished_since_last_step(out)
        if out.is_empty:
            return self._outputs(touched)
        want_prompt = {sr.request_id for sr in out.scheduled if sr.request.payload.prompt_logprobs is not None}
        snapshots = self.spec.snapshot(out) if self.spec else {}  # state to restore if a draft is rejected
        hidden = None
        try:
            if self.spec is not None and self.spec.needs_hidden:
                from deepinfer.spec.target import execute_with_hidden

                sample_logits, prompt_logits, hidden = execute_with_hidden(
                    self.runner.model, out, want_prompt, self.model_config.vocab_size, self.runner.dtype)
            else:
                result = self.runner.execute(out, want_prompt)
                sample_logits, prompt_logits = result.sample_logits, result.prompt_logits
        except Exception as e:  # a failing forward fails its batch; the engine keeps serving the rest
            if getattr(e, "fatal", False):  # ... unless a rank of the parallel group is gone
                raise
            for sr in out.scheduled:
                self.scheduler.fail(sr.request_id, e)
                touched[sr.request_id] = sr.request
            return self._outputs(touched)
        for rid, logits in prompt_logits.items():
            self._add_prompt_logprobs(self._requests[rid], logits, out)
        sample_logits = sample_logits.to(self.sample_device)  # (a no-op unless sampling on the host)
        rows = out.sample_rows()  # the explicit map: row i of the logits is NOT request i (seed P4.2)
        scheduled = [sr for sr in out.scheduled if sr.request_id in rows]
        states = [sr.request.payload for sr in scheduled]
        # a request's rows: one per draft, then the bonus row (spec/verify.py); no drafts: its one row
        drafts = [list(sr.token_ids[len(sr.token_ids) - sr.num_draft_tokens :]) for sr in scheduled]
        if not any(drafts) and all(rows[sr.request_id] == range(i, i + 1) for i, sr in enumerate(scheduled)) \
                and sample_logits.shape[0] == len(scheduled):
            per_request = sample_logits  # one row each, in order (every step without drafts): sampled as is
        else:
            per_request = [_rows_of(sample_logits, rows[sr.request_id]) for sr in scheduled]
        verified = verify(self.sampler, per_request, drafts,
                          [s.params for s in states], [s.generator for s in states])
        tokens = {sr.request_id: v.tokens for sr, v in zip(scheduled, verified)}
        by_id = dict(zip(tokens, verified))
        self._absorb(self.scheduler.update(out, tokens), by_id, touched)
        if self.spec is not None:
            released = set(out.preempted_ids) | {r for r, q in touched.items() if q.is_finished}
            self.spec.finish_step(self.scheduler, out, by_id, snapshots, hidden, released)
        for sr in out.scheduled:
            touched.setdefault(sr.request_id, sr.request)
        return self._outputs(touched)

    def _finished_since_last_step(self, out: SchedulerOutput) -> dict[str, Request]:
        """Requests aborted or failed since the last step (reported once), as the start of a step's outputs.
        (An id finished by the last step's update was reported by it; if it is in use again, that is a new
        request, not finished.)"""
        finished = (self._requests.get(rid) for rid in out.finished_ids)
        return {req.request_id: req for req in finished if req is not None and req.is_finished}

    def _absorb(self, update, by_id: dict[str, Verified], touched: dict[str, Request]) -> None:
        """The host's work on committed tokens: detokenize (stop strings), logprobs of the tokens that stay."""
        now = None
        for rid, new in update.new_token_ids.items():
            req = self._requests[rid]
            if new and req.payload.first_token_time is None:
                now = now or time.monotonic()
                req.payload.first_token_time = now
            kept = self._detokenize(req, new)
            for sampled, row in by_id[rid].sampled[:kept]:  # logprobs of the tokens that stay, from their rows
                self._record_logprobs(req.payload, sampled, row)
            touched[rid] = req
        for req in update.finished:
            touched[req.request_id] = req

    # ------------------------------------------------------------------ the asynchronous loop
    def _step_async(self) -> list[RequestOutput]:
        """Schedule and queue step n+1, then finish step n on the host while the device runs n+1."""
        out = self.scheduler.schedule()
        touched = self._finished_since_last_step(out)
        launched = self._launch(out, touched) if not out.is_empty else None
        if self._in_flight is not None:
            self._finish_in_flight(self._in_flight, touched)
        self._in_flight = launched
        return self._outputs(touched)

    def _launch(self, out: SchedulerOutput, touched: dict[str, Request]) -> _InFlight | None:
        """Run the step and sample it on the device without reading the tokens; the scheduler advances."""
        want_prompt = {sr.request_id for sr in out.scheduled if sr.request.payload.prompt_logprobs is not None}
        prev = self._in_flight.pending if self._in_flight is not None else None
        try:
            result = self.runner.execute(out, want_prompt, pending=prev)
        except Exception as e:  # as in the synchronous step: the batch fails, the engine keeps serving
            if getattr(e, "fatal", False):
                raise
            for sr in out.scheduled:
                self.scheduler.fail(sr.request_id, e)
                touched[sr.request_id] = sr.request
            return None
        for rid, logits in result.prompt_logits.items():  # (reads on the host: this step waits)
            self._add_prompt_logprobs(self._requests[rid], logits, out)
        rows = out.sample_rows()
        scheduled = [sr for sr in out.scheduled if sr.request_id in rows]
        assert all(rows[sr.request_id] == range(i, i + 1) for i, sr in enumerate(scheduled)), \
            "asynchronous scheduling samples one row per request, in order"
        sampled = host = ready = pending = None
        if scheduled:
            states = [sr.request.payload for sr in scheduled]
            logits = result.sample_logits.to(self.sample_device)
            sampled = self.sampler.sample(logits, [s.params for s in states], [s.generator for s in states],
                                          to_host=False)
            host, ready = sampled.to_host_async()  # queued before the next step: it does not wait for it
            order = {sr.request_id: i for i, sr in enumerate(scheduled)}
            pending = PendingTokens(sampled.token_ids.to(self.runner.device), order)
        self.scheduler.advance(out)
        return _InFlight(out, pending, host, ready)

    def _finish_in_flight(self, step: _InFlight, touched: dict[str, Request]) -> None:
        """Read the step's tokens (waiting for its copy only) and do the host's work on them."""
        tokens = {}
        by_id: dict[str, Verified] = {}
        if step.host is not None:
            if step.ready is not None:
                step.ready.synchronize()
            ids = step.host.lists[0]
            for rid, row in step.rows.items():
                tokens[rid] = [ids[row]]
                by_id[rid] = Verified(tokens=[ids[row]], sampled=[(step.host, row)])
        self._absorb(self.scheduler.commit(step.out, tokens), by_id, touched)
        for sr in step.out.scheduled:  # (one finished and reported since is not reported again; its id may
            if self._requests.get(sr.request_id) is sr.request:  # even name a new request by now)
                touched.setdefault(sr.request_id, sr.request)

    # ------------------------------------------------------------------ helpers
    def _record_logprobs(self, state: _State, sampled, row: int) -> None:
        # (read from the step's lists directly: this runs for every token of every request with logprobs,
        # and the row() tuple, its zip list and a method lookup per entry were most of its host time)
        ids, lps, ranks, top_ids, top_lps = sampled.lists
        state.cumulative_logprob += lps[row]
        if state.logprobs is not None:
            k, decode = sampled.num_top_logprobs[row], self.tokenizer.decode_token
            entry = {t: Logprob(lp, i, decode(t)) for i, t, lp in zip(range(1, k + 1), top_ids[row], top_lps[row])}
            token = ids[row]
            entry[token] = Logprob(lps[row], ranks[row], decode(token))
            state.logprobs.append(entry)

    def _add_prompt_logprobs(self, req: Request, logits: torch.Tensor, out) -> None:
        """Entry p of prompt_logprobs is prompt token p's logprob (entry 0: None). A chunk recomputed after
        a preemption covers positions already reported: those rows are skipped, never sent twice."""
        state: _State = req.payload
        start = next(s.start_position for s in out.scheduled if s.request_id == req.request_id)
        if logits.shape[0] == 0:
            return
        lp = prompt_logprobs(logits, req.prompt_token_ids, start=start, num_top=state.params.prompt_logprobs)
        lp = lp.to("cpu")  # computed on the logits' device, read row by row here
        for i in range(lp.token_ids.shape[0]):
            if start + 1 + i < len(state.prompt_logprobs):
                continue
            token, logprob, rank, top = lp.row(i, state.params.prompt_logprobs)
            entry = {t: Logprob(v, j + 1, self.tokenizer.decode_token(t)) for j, (t, v) in enumerate(top)}
            entry[token] = Logprob(logprob, rank, self.tokenizer.decode_token(token))
            state.prompt_logprobs.append(entry)

    def _detokenize(self, req: Request, new_ids: list[int]) -> int:
        """Detokenize the step's new tokens; returns how many stay. A stop string found at token i ends the
        request there: tokens after it (accepted drafts a one-token step would never have produced) are
        dropped from the output."""
        state: _State = req.payload
        text, stop = state.text, state.stop
        for i, token in enumerate(new_ids):
            if token in req.stop_token_ids and not state.params.include_stop_str_in_output:
                continue  # as vLLM: the stop token is in token_ids but not in the text
            delta = state.detok.push(token)
            text.append(delta)
            if not delta or not stop.stop:
                continue
            # only the tail a match can lie in: the new characters and lookback before them
            window = text.since(len(text) - len(delta) - stop.lookback)
            found = stop.find(window, len(delta))
            if found is not None:
                at, s = found
                text.truncate(len(text) - len(window) + stop.cut(at, s))
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED, s)
                extra = len(new_ids) - i - 1
                if extra:
                    del req.output_token_ids[-extra:]
                return i + 1
        return len(new_ids)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The step's outputs: one per request that progressed or finished, as its output kind asks (a
        FINAL_ONLY request has none before its end, a DELTA request none without anything new)."""
        outputs = []
        for req in touched.values():
            out = self._output(req)
            if out is not None:
                outputs.append(out)
        return outputs

    def _output(self, req: Request) -> RequestOutput | None:
        state: _State = req.payload
        finished = req.is_finished
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        tokens = req.output_token_ids
        prompt_logprobs = state.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            # what is new since the last output; the text's last lookback characters wait (they may begin
            # a stop string) unless the request has ended
            upto = max(state.sent_chars, state.stop.safe_length(len(state.text), finished))
            if not finished and upto == state.sent_chars and len(tokens) == state.sent_tokens:
                return None
            text = state.text.since(state.sent_chars)[: upto - state.sent_chars]
            token_ids = tokens[state.sent_tokens:]
            logprobs = None
            if state.logprobs is not None:
                logprobs = state.logprobs[state.sent_logprobs:]
                state.sent_logprobs = len(state.logprobs)
            if state.sent_prompt_logprobs:
                prompt_logprobs = None  # sent with the first output
            state.sent_chars, state.sent_tokens, state.sent_prompt_logprobs = upto, len(tokens), True
        else:  # (a cumulative text holds back the same characters: no output shows what a later one cuts)
            text, token_ids, logprobs = state.text.value(), list(tokens), state.logprobs
            text = text[: state.stop.safe_length(len(text), finished)]  # (the whole text: no copy)
        completion = CompletionOutput(
            index=state.extra.get("index", 0), text=text, token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob, logprobs=logprobs,
            finish_reason=req.status.finish_reason if finished else None, stop_reason=req.stop_reason)
        if finished:
            self._requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, state.prompt, state.prompt_ids, [completion],
                             prompt_logprobs=prompt_logprobs, finished=finished, error=req.error,
                             num_output_tokens=len(tokens), first_token_time=state.first_token_time)
