"""`DSparkProposer`: drafts with the DSpark stages (model/dspark.py), greedily, up to block_size tokens.

Bookkeeping per request, as for MTP: `done[rid]` = target positions seeded into the stages' window rings.
The target's main_hidden at position t is valid once tokens 0..t are all real, so after a step the rings
catch up to t < min(target computed end, num_tokens - 1); when caught up (done == num_tokens - 1) a block
at P = done - 1 led by the last (sampled) token proposes tokens num_tokens .. . The draft block's own KV is
never cached, so drafting leaves no state to roll back; a target rewind never un-seeds a valid position.
The official code seeds on the prefill and drafts from the first decode step on; drafting right after the
prefill uses the same ring contents (positions <= P), so it is done too.
The confidence head's output is kept (`last_confidence`) but does not cut drafts: the official code
returns it without a policy.
Must not: touch the target cache or scheduler state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.config import ModelConfig
from deepinfer.model.dspark import DSpark, DSparkCache, prepare_dspark_params
from deepinfer.scheduler import Request
from deepinfer.spec.proposer import Proposer, TargetStep


class DSparkProposer(Proposer):
    needs_hidden = True

    def __init__(self, dspark: DSpark) -> None:
        self.dspark = dspark
        self.done: dict[str, int] = {}
        self.slot: dict[str, int] = {}
        self.last_confidence: dict[str, torch.Tensor] = {}

    def release(self, request_id: str) -> None:
        for d in (self.done, self.slot, self.last_confidence):
            d.pop(request_id, None)

    def observe(self, requests: dict[str, Request], step: TargetStep) -> None:
        for rid, c in step.computed.items():
            req = requests.get(rid)
            if req is None or req.is_finished:
                self.release(rid)
                continue
            if c.hidden is None:
                raise RuntimeError(f"{rid}: the DSpark drafter needs the target's main_hidden rows")
            if c.start == 0 or self.slot.get(rid) != c.window_slot:
                self.dspark.cache.reset(c.window_slot)
                self.done[rid], self.slot[rid] = 0, c.window_slot
            lo = self.done[rid]
            if lo < c.start:
                raise RuntimeError(f"{rid}: DSpark seeded {lo} positions but the target's rows start at {c.start}")
            hi = min(c.start + c.hidden.shape[0], req.num_tokens - 1)
            if hi > lo:
                self.dspark.seed(c.window_slot, lo, c.hidden[lo - c.start : hi - c.start])
                self.done[rid] = hi

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, list[int]]:
        if k > self.dspark.cfg.dspark_block_size:
            raise ValueError(f"DSpark proposes at most dspark_block_size = {self.dspark.cfg.dspark_block_size} "
                             f"tokens per step, {k} asked")
        ready = [r for r in requests if self.done.get(r.request_id, 0) >= 1
                 and self.done[r.request_id] == r.num_tokens - 1]
        if not ready:
            return {}
        block = self.dspark.draft([self.slot[r.request_id] for r in ready],
                                  [self.done[r.request_id] - 1 for r in ready],
                                  [r.last_token_id for r in ready])
        out = {}
        for i, r in enumerate(ready):
            out[r.request_id] = block.tokens[i][:k]
            self.last_confidence[r.request_id] = block.confidence[i]
        return out


def build_dspark_proposer(cfg: ModelConfig, checkpoint: str, target_model, target_params, numerics: str,
                          max_num_seqs: int) -> DSparkProposer:
    from deepinfer.weights import load_tensors

    params = prepare_dspark_params(load_tensors(checkpoint, cfg, progress=False), cfg)
    return DSparkProposer(DSpark(cfg, params, target_params, DSparkCache(cfg, max_num_seqs), numerics))
