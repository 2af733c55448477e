"""`ModelRunner`: turns a `SchedulerOutput` into one varlen forward and returns the logits rows to sample.

Owns: loading the engine model, the warm-up forward that sizes the KV cache, building the
`ForwardContext` (positions, block tables, ring and state slots) and mapping logits rows back to requests
EXPLICITLY (row i is not request i once partial prefills sample nothing and drafts sample several: the
seed's P4.2). Must not: sample, or touch scheduler state.

The warm-up runs on a throwaway cache with synthetic tokens: nothing of it reaches a request's state,
outputs or any debug tap (the seed's dummy-profile pitfall).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import ModelConfig
from deepinfer.engine.config import EngineConfig
from deepinfer.model.cache import V4Cache
from deepinfer.model.context import ForwardContext, SeqContext
from deepinfer.model.params import prepare_params
from deepinfer.model.v4 import V4EngineModel
from deepinfer.scheduler.output import SchedulerOutput
from deepinfer.weights import load_tensors


@dataclass
class RunnerOutput:
    sample_logits: torch.Tensor  # [num sampled rows, V] in SchedulerOutput.sample_rows() order
    prompt_logits: dict[str, torch.Tensor]  # request id -> [num new prompt tokens, V] (only if asked)


class ModelRunner:
    def __init__(self, config: EngineConfig, cfg: ModelConfig) -> None:
        if cfg.is_v41:  # family v41: its own model, cache and sizing (exact or official numerics)
            from deepinfer.model.v41 import build_for_runner

            self.config, self.cfg, self.numerics = config, cfg, config.numerics
            self.dtype = torch.float64 if config.numerics == "exact" else torch.float32  # logits dtype
            self.params, self.num_blocks, self.model = build_for_runner(config, cfg)
            return
        self.config, self.cfg = config, cfg
        self.numerics = config.numerics  # "exact" (float64) or "official" (bf16/FP8 emulation, revision current)
        self.dtype = torch.float64 if self.numerics == "exact" else torch.float32  # logits dtype
        self.params = prepare_params(load_tensors(config.model, cfg, progress=False), cfg, self.dtype,
                                     numerics=self.numerics)
        self.num_blocks = config.num_blocks or self._size_kv_cache()
        cache = self._cache(self.num_blocks, config.max_num_seqs)
        self.model = V4EngineModel(cfg, self.params, cache, self.numerics)

    def _cache(self, num_blocks: int, max_num_seqs: int) -> V4Cache:
        return V4Cache(self.cfg, num_blocks, self.config.block_size, max_num_seqs, self.dtype, self.numerics)

    # ------------------------------------------------------------------ sizing
    def _size_kv_cache(self) -> int:
        """Run the worst-case batch once on a throwaway cache, then give the rest of the budget to blocks."""
        c, cfg = self.config, self.cfg
        tokens = min(c.max_num_batched_tokens, c.max_model_len)
        blocks = -(-tokens // c.block_size)
        scratch = V4EngineModel(cfg, self.params, self._cache(blocks, 1), self.numerics)
        ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        ctx = ForwardContext((SeqContext(0, tokens, 0, 0, tuple(range(blocks))),))
        if c.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        scratch.forward(ids, ctx)
        fixed = V4Cache.bytes_per_sequence(cfg, self.dtype, self.numerics) * c.max_num_seqs
        if c.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = int(total * c.gpu_memory_utilization) - torch.cuda.max_memory_allocated() - fixed
        else:
            budget = c.kv_cache_bytes - fixed
        per_block = V4Cache.bytes_per_block(cfg, c.block_size, self.dtype, self.numerics)
        num_blocks = budget // per_block if per_block else 1
        need = -(-c.max_model_len // c.block_size)
        if num_blocks < need:
            raise ValueError(f"KV budget holds {num_blocks} blocks but one sequence of max_model_len "
                             f"{c.max_model_len} needs {need}: raise kv_cache_bytes or lower max_model_len")
        return int(num_blocks)

    # ------------------------------------------------------------------ one step
    def execute(self, out: SchedulerOutput, want_prompt_logits: set[str] = frozenset()) -> RunnerOutput:
        seqs, ids = [], []
        for sr in out.scheduled:
            seqs.append(SeqContext.from_slots(sr.slots, sr.start_position, sr.num_new_tokens))
            ids.extend(sr.token_ids)
        needs_rows = any(sr.num_sampled_rows > 1 for sr in out.scheduled)
        all_rows = needs_rows or any(sr.request_id in want_prompt_logits for sr in out.scheduled)
        ctx = ForwardContext(tuple(seqs), all_logits=all_rows)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), ctx)
        sample, prompt = [], {}
        for i, sr in enumerate(out.scheduled):
            rows = logits[ctx.rows(i)] if all_rows else logits[i : i + 1]  # [n_i, V] or [1, V]
            if sr.num_sampled_rows:
                sample.append(rows[-sr.num_sampled_rows :])
            if all_rows and sr.request_id in want_prompt_logits:
                prompt_len = sr.request.num_prompt_tokens
                n_prompt = max(0, min(sr.num_new_tokens, prompt_len - sr.start_position))
                prompt[sr.request_id] = rows[:n_prompt]
        vocab = self.cfg.vocab_size
        sample_logits = torch.cat(sample) if sample else torch.empty(0, vocab, dtype=self.dtype)
        return RunnerOutput(sample_logits, prompt)
