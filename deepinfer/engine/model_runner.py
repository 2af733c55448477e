"""`ModelRunner`: turns a `SchedulerOutput` into one varlen forward and returns the logits rows to sample.

Owns: loading the engine model, the warm-up forward that sizes the KV cache, building the
`ForwardContext` (positions, block tables, ring and state slots) and mapping logits rows back to requests
EXPLICITLY (row i is not request i once partial prefills sample nothing and drafts sample several: the
seed's P4.2). Must not: sample, or touch scheduler state.

The warm-up runs on a throwaway cache with synthetic tokens: nothing of it reaches a request's state,
outputs or any debug tap (the seed's dummy-profile pitfall).
Devices: with `device="cuda"` the params, caches and per-step metadata live on the GPU (the model moves
the step's token ids and positions once); the logits stay on the device, where the engine samples (only
tokens and logprobs come back to the host). A CUDA engine registers the Triton kernels once at start (the
torch twins run where triton is missing).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from deepinfer import env
from deepinfer.config import ModelConfig
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.distributed_load import load_rank_tensors
from deepinfer.model.cache import V4Cache
from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext, SeqContext, resolve_device
from deepinfer.model.decode_step import DecodeRunner
from deepinfer.model.extend_graphs import ExtendGraphs
from deepinfer.model.factory import v4_cache, v4_params, value_dtype
from deepinfer.model.mixed_step import can_split, forward_split
from deepinfer.model.v4 import V4EngineModel
from deepinfer.scheduler.output import SchedulerOutput
from deepinfer.scheduler.request import PENDING_TOKEN
from deepinfer.weights import load_tensors


@dataclass(frozen=True)
class PendingTokens:
    """The previous step's sampled tokens, still on the device (asynchronous scheduling): `token_ids[r]` is
    the token of the request `rows` maps to r. A position scheduled with PENDING_TOKEN takes its id here."""

    token_ids: torch.Tensor  # [R] long, on the runner's device
    rows: dict[str, int]  # request id -> row of token_ids


@dataclass
class RunnerOutput:
    """Logits on the runner's device, valid until the next step (a pure-decode step's rows can be views of
    its CUDA graph's output buffer, which the next replay overwrites): sample and read them in this step."""

    sample_logits: torch.Tensor  # [num sampled rows, V] in SchedulerOutput.sample_rows() order
    prompt_logits: dict[str, torch.Tensor]  # request id -> [num new prompt tokens, V] (only if asked)


class ModelRunner:
    def __init__(self, config: EngineConfig, cfg: ModelConfig, comm=None) -> None:
        """comm: a `deepinfer.distributed.Communicator` on a rank of a parallel group (the model then gets
        this rank's slices of the checkpoint); None in one process."""
        self.comm = comm
        self.device = resolve_device(config.device)
        self.decoder = None  # the batched decode path (fast numerics)
        self.extender: ExtendGraphs | None = None  # the extend steps' piecewise graphs (fast, cuda, one process)
        self._extend_graph_tokens = 0
        # (read once: a bad DEEPINFER_SPLIT_MIXED_STEPS fails the engine's start, not every mixed step)
        split = env.split_mixed_steps()
        self.split_mixed = split == "on" or (split == "auto" and self.device.type == "cuda")
        if cfg.is_v41:  # family v41: its own model, cache and sizing (any numerics)
            from deepinfer.model.v41 import build_for_runner

            if self.device.type == "cuda":
                start_cuda_kernels()
            self.config, self.cfg, self.numerics = config, cfg, config.numerics
            self.dtype = torch.float64 if config.numerics == "exact" else torch.float32  # logits dtype
            load = None if comm is None else (lambda d, c: load_rank_tensors(d, c, comm.parallel))
            # fast numerics (one process: V4.1 fast runs no parallel group): pure-decode steps through the
            # batched decode path (model/v41_decode.py), eager or graphed, its padding rows on a scratch slot/block
            batched_decode = self.numerics == "fast" and env.batched_decode_enabled()
            self._extend_graph_tokens = self._graph_tokens(config, comm)
            self.params, self.num_blocks, self.model, self.extender = build_for_runner(
                config, cfg, comm, load, batched_decode, self._extend_graph_tokens)
            if batched_decode:
                self.decoder = self._decode_runner()
            return
        self.config, self.cfg = config, cfg
        # "exact" (float64), "official" (bf16/FP8 emulation, revision current) or "fast" (official rounding
        # points batched, quantised weights)
        self.numerics = config.numerics
        self.dtype = value_dtype(self.numerics)  # logits dtype
        if self.device.type == "cuda":
            start_cuda_kernels()
        if comm is None:
            raw = load_tensors(config.model, cfg, progress=False)
        else:  # this rank's slices (tensor/expert parallel), read a layer at a time
            raw = load_rank_tensors(config.model, cfg, comm.parallel)
        self.params = v4_params(raw, cfg, self.numerics, self.device)
        # fast numerics on cuda in one process: extend steps up to `graph_tokens` through the piecewise CUDA
        # graphs (model/extend_graphs.py), captured before the KV sizing so that their pool is counted
        self._extend_graph_tokens = self._graph_tokens(config, comm)
        self.num_blocks = config.num_blocks or self._size_kv_cache()
        # fast numerics: pure-decode steps take the batched decode path, whose padding rows need a window/state
        # slot and a block the scheduler never hands out (the cache's last ones). In a parallel group every
        # rank runs it too (engine/distributed_runner.py says how the ranks keep their collectives in step)
        batched_decode = self.numerics == "fast" and env.batched_decode_enabled()
        extra = 1 if batched_decode else 0
        cache = self._cache(self.num_blocks + extra, config.max_num_seqs + extra)
        self.model = V4EngineModel(cfg, self.params, cache, self.numerics, comm=comm)
        if self._extend_graph_tokens:
            if self.extender is None:  # (num_blocks given: no sizing ran)
                self.extender = ExtendGraphs(self.model, self._extend_graph_tokens)
            self.extender.bind(self.model)
        if batched_decode:
            self.decoder = self._decode_runner()

    def _graph_tokens(self, config, comm) -> int:
        """The most tokens of an extend step run through the piecewise graphs (0: none): fast numerics on cuda
        in one process, CUDA graphs on, capped by the step's token budget (a step: several prompts)."""
        graphs = config.cuda_graphs and env.cuda_graphs_enabled() and self.device.type == "cuda"
        tokens = min(env.extend_graph_tokens(), config.max_num_batched_tokens)
        return tokens if graphs and config.numerics == "fast" and comm is None else 0

    def _decode_runner(self) -> DecodeRunner:
        """The batched decode path over the model's cache, its padding rows on the slot and block past what the
        scheduler hands out (the cache was built with one of each more)."""
        c = self.config
        return DecodeRunner(self.model, c.max_num_seqs, c.max_model_len, scratch_slot=c.max_num_seqs,
                            scratch_block=self.num_blocks, cuda_graphs=c.cuda_graphs and env.cuda_graphs_enabled())

    def _cache(self, num_blocks: int, max_num_seqs: int) -> V4Cache:
        return v4_cache(self.cfg, self.numerics, num_blocks, self.config.block_size, max_num_seqs, self.device)

    # ------------------------------------------------------------------ sizing
    def _size_kv_cache(self) -> int:
        """Run the worst-case batch once on a throwaway cache, then give the rest of the budget to blocks."""
        c, cfg = self.config, self.cfg
        tokens = min(c.max_num_batched_tokens, c.max_model_len)
        blocks = -(-tokens // c.block_size)
        scratch = V4EngineModel(cfg, self.params, self._cache(blocks, 1), self.numerics, comm=self.comm)
        ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        ctx = ForwardContext((SeqContext(0, tokens, 0, 0, tuple(range(blocks))),))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self._extend_graph_tokens:  # its graphs hold no cache tensor: bound to the real model later
            self.extender = ExtendGraphs(scratch, self._extend_graph_tokens)
        scratch.forward(ids, ctx)
        fixed = V4Cache.bytes_per_sequence(cfg, self.dtype, self.numerics) * c.max_num_seqs
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * c.gpu_memory_utilization) - torch.cuda.max_memory_allocated(self.device) - fixed
        else:
            budget = c.kv_cache_bytes - fixed
        per_block = V4Cache.bytes_per_block(cfg, c.block_size, self.dtype, self.numerics)
        num_blocks = budget // per_block if per_block else 1
        if self.comm is not None:  # every rank must hold the blocks the one scheduler hands out
            num_blocks = self.comm.min_over_world(int(num_blocks))
        need = -(-c.max_model_len // c.block_size)
        # no more blocks than every sequence slot at max_model_len can use (a GPU's free memory would
        # otherwise give millions of blocks to the host-side block pool)
        num_blocks = min(num_blocks, need * c.max_num_seqs)
        if num_blocks < need:
            raise ValueError(f"KV budget holds {num_blocks} blocks but one sequence of max_model_len "
                             f"{c.max_model_len} needs {need}: raise kv_cache_bytes or lower max_model_len")
        return int(num_blocks)

    # ------------------------------------------------------------------ one step
    def execute(self, out: SchedulerOutput, want_prompt_logits: set[str] = frozenset(),
                pending: PendingTokens | None = None) -> RunnerOutput:
        """pending: where the ids of positions scheduled as PENDING_TOKEN are (asynchronous scheduling)."""
        seqs, ids = [], []
        for sr in out.scheduled:
            seqs.append(SeqContext.from_slots(sr.slots, sr.start_position, sr.num_new_tokens))
            ids.extend(sr.token_ids)
        needs_rows = any(sr.num_sampled_rows > 1 for sr in out.scheduled)
        all_rows = needs_rows or any(sr.request_id in want_prompt_logits for sr in out.scheduled)
        ctx = ForwardContext(tuple(seqs), all_logits=all_rows)
        logits = self.forward_batch(self._token_ids(out, ids, pending), ctx)
        picked, prompt = [], {}  # the sampled rows' indices into `logits`, in scheduled order
        if not all_rows:  # one row per sequence (its last token's), each sampling at most one
            picked = [i for i, sr in enumerate(out.scheduled) if sr.num_sampled_rows]
        else:
            for i, sr in enumerate(out.scheduled):
                span = ctx.rows(i)
                rows = range(span.start, span.stop)
                picked.extend(rows[len(rows) - sr.num_sampled_rows :] if sr.num_sampled_rows else ())
                if sr.request_id in want_prompt_logits:
                    prompt_len = sr.request.num_prompt_tokens
                    n_prompt = max(0, min(sr.num_new_tokens, prompt_len - sr.start_position))
                    prompt[sr.request_id] = logits[rows.start : rows.start + n_prompt]
        # one gather for the whole step (a view when every row is sampled in order, as in pure decode):
        # on a GPU a slice and a concatenation per request cost more host time than the batch's sampling
        if len(picked) == logits.shape[0] and (not all_rows or picked == list(range(logits.shape[0]))):
            sample_logits = logits
        else:
            sample_logits = logits[host_to_device(torch.tensor(picked, dtype=torch.long), logits.device)]
        return RunnerOutput(sample_logits, prompt)

    def _token_ids(self, out: SchedulerOutput, ids: list[int], pending: PendingTokens | None) -> torch.Tensor:
        """The step's flat ids: on the host, or, when some are pending, on the device with those read from
        the previous step's sampled tokens (one gather; the host never waits for them)."""
        if pending is not None and len(ids) == len(out.scheduled) == pending.token_ids.shape[0] \
                and pending.token_ids.dtype == torch.long and all(
                    t == PENDING_TOKEN and pending.rows.get(sr.request_id) == i
                    for i, (t, sr) in enumerate(zip(ids, out.scheduled))):
            # the steady decode step: the previous step's tokens, in the same order, are this step's ids
            # (no host tensor, no copies, no gather: ~0.1 ms of host work per b128 step)
            return pending.token_ids
        host = torch.tensor(ids, dtype=torch.long)
        if PENDING_TOKEN not in ids:
            return host
        where, rows, flat = [], [], 0
        for sr in out.scheduled:
            for j, token in enumerate(sr.token_ids):
                if token == PENDING_TOKEN:
                    if pending is None or sr.request_id not in pending.rows:
                        raise ValueError(f"request {sr.request_id!r}: position {sr.start_position + j} is "
                                         f"pending but the previous step sampled no token for it")
                    where.append(flat + j)
                    rows.append(pending.rows[sr.request_id])
            flat += len(sr.token_ids)
        device = pending.token_ids.device
        dev_ids = host_to_device(host, device)
        dev_ids[host_to_device(torch.tensor(where), device)] = \
            pending.token_ids[host_to_device(torch.tensor(rows), device)]
        return dev_ids

    def forward_batch(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step's logits rows on the runner's device (the engine samples there). The parallel runner
        overrides this (and runs `route` on every rank)."""
        return self.route(ids, ctx, self.split_mixed)

    def route(self, ids: torch.Tensor, ctx: ForwardContext, split_mixed: bool) -> torch.Tensor:
        """The batch through the model's paths: a pure-decode step (one new token per sequence) through the
        batched decode path when there is one; with `split_mixed`, a step mixing decode rows with prefills /
        extends sends its decode rows there too (model/mixed_step.py); the rest through the general path.
        The choice depends on the batch and the runner's settings only, so every rank of a group makes it alike."""
        decoder = self.decoder  # (None: not fast numerics, or switched off)
        extend = self.model.forward if self.extender is None else self.extender  # (it takes what it fits)
        if decoder is not None and self.model.tap is None:
            if all(s.num_new == 1 for s in ctx.seqs):
                return decoder(ids, ctx.seqs)  # one logits row per sequence (== its last token's)
            if split_mixed and can_split(ctx):
                return forward_split(extend, decoder, ids, ctx)
        return extend(ids, ctx)


def start_cuda_kernels() -> None:
    """Register the Triton kernels for cuda (once per process is enough; re-registering is harmless)."""
    try:
        from deepinfer.kernels.triton import register_cuda_kernels

        register_cuda_kernels()
    except ImportError as err:  # no triton, or a kernel module not there: the torch twins run
        warnings.warn(f"Triton kernels not registered ({err}); the CUDA engine runs the torch twins", stacklevel=2)
