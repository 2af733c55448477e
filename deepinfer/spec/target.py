"""The target forward of one step that ALSO keeps, per position, the hidden rows a drafter conditions on:
family v4 (MTP): the final 4-stream residual [n, hc, D]; family v41 and V4-Flash-0731 (v4 with DSpark stages):
`main_hidden` [n, k*D], the mean over the streams of the INPUT of each dspark target layer (official V4.1
`Transformer.forward`; inferred the same for 0731, model/dspark.py says why). The logits
rows are the ones `ModelRunner.execute` returns, in the same order (`SchedulerOutput.sample_rows()`), and
the head runs on those rows only (it is vocab x dim).
V4.1 and 0731: the block loop of `V41EngineModel.hidden` / `V4EngineModel.hidden` is followed step for step
with the target-layer inputs captured (the models have no hook for them); the greedy-identity tests compare
it with the runner's forward.

Must not: sample or touch scheduler state; differ from the runner's row mapping (tests compare both).
"""
from __future__ import annotations

import torch

from deepinfer.model.context import ForwardContext, SeqContext, forward_context
from deepinfer.scheduler.output import SchedulerOutput


def _v41_hidden(model, ids: torch.Tensor, ctx: ForwardContext):
    """V41EngineModel.hidden with the dspark target layers' inputs kept: (x, pre_mix, main_hidden)."""
    cfg = model.cfg
    model._check(ids, ctx)
    for s in ctx.seqs:
        if s.start_pos == 0:
            model.cache.reset(s.window_slot, s.state_slot)
    hashes = model.hasher(ids, ctx) if model.hasher is not None else None
    x = model.p["embed.weight"][ids].unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    pre_mix = torch.zeros(ids.shape[0], cfg.hc_mult, dtype=torch.float32 if model.official else x.dtype)
    pre_mix[:, 0] = 1.0
    shared: dict = {}
    targets = []
    for i, block in enumerate(model.layers):
        if i in model.engrams:
            x = model.engrams[i](x, hashes[:, model.hasher.layer_index(i)])
        if i in cfg.dspark_target_layer_ids:
            targets.append(x.mean(dim=1))
        x, pre_mix = block(x, pre_mix, ctx, model.cache, shared)
    return x, pre_mix, torch.cat(targets, dim=-1)


def _v4_dspark_hidden(model, ids: torch.Tensor, ctx: ForwardContext):
    """V4EngineModel.hidden (one process, exact/official on the host) with the dspark target layers' inputs
    kept: (x, None, main_hidden); None: V4's head needs no pre mix."""
    cfg = model.cfg
    model._check(ids, ctx)
    if model.comm is not None or model.device.type != "cpu":
        raise NotImplementedError("DSpark drafting on V4 runs on a one-process CPU target")
    model.cache.begin_step()
    for s in ctx.seqs:
        if s.start_pos == 0:
            model.cache.reset(s.window_slot, s.state_slot)
    x = model.p["embed.weight"][ids].unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    targets = []
    for i, block in enumerate(model.layers):
        if i in cfg.dspark_target_layer_ids:
            targets.append(x.mean(dim=1))
        x = block(x, ids, ctx, model.cache)
    return x, None, torch.cat(targets, dim=-1)


def _hidden(model, ids: torch.Tensor, seqs: list[SeqContext]):
    """Final 4-stream residual [T, hc, D] of the batch (official numerics: one sequence per call, as the
    model's own forward does, so the bits match the non-drafting run)."""
    if getattr(model, "official", False) and not getattr(model, "fast", False) and len(seqs) > 1:
        parts, at = [], 0
        for s in seqs:
            parts.append(_hidden(model, ids[at : at + s.num_new], [s]))
            at += s.num_new
        if isinstance(parts[0], tuple):
            return tuple(None if t[0] is None else torch.cat(t) for t in zip(*parts))
        return torch.cat(parts)
    ctx = ForwardContext(tuple(seqs))
    with forward_context(ctx):
        if getattr(model.cfg, "is_v41", False):
            return _v41_hidden(model, ids, ctx)
        if getattr(model.cfg, "dspark_block_size", 0):
            return _v4_dspark_hidden(model, ids, ctx)
        return model.hidden(ids)


def execute_with_hidden(model, out: SchedulerOutput, want_prompt_logits: set[str], vocab: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """-> (sample logits [rows, V] in sample_rows() order, prompt logits per asked request id,
    drafter hidden rows per request id: v4 MTP [num_new, hc, D], DSpark main_hidden [num_new, k*D])."""
    seqs, ids, spans = [], [], []
    at = 0
    for sr in out.scheduled:
        seqs.append(SeqContext.from_slots(sr.slots, sr.start_position, sr.num_new_tokens))
        ids.extend(sr.token_ids)
        spans.append((at, at + sr.num_new_tokens))
        at += sr.num_new_tokens
    out_h = _hidden(model, torch.tensor(ids, dtype=torch.long), seqs)
    if isinstance(out_h, tuple):  # DSpark: drafters get main_hidden; v41 logits need the last block's pre mix
        x, pre_mix, drafter_rows = out_h
        if pre_mix is None:
            head = lambda rows: model.logits(x[rows])  # noqa: E731
        else:
            head = lambda rows: model.logits(x[rows], pre_mix[rows])  # noqa: E731
    else:
        x = drafter_rows = out_h
        head = lambda rows: model.logits(x[rows])  # noqa: E731
    sample_idx, prompt_idx = [], {}
    for sr, (a, b) in zip(out.scheduled, spans):
        if sr.num_sampled_rows:
            sample_idx += range(b - sr.num_sampled_rows, b)
        if sr.request_id in want_prompt_logits:
            n_prompt = max(0, min(sr.num_new_tokens, sr.request.num_prompt_tokens - sr.start_position))
            prompt_idx[sr.request_id] = range(a, a + n_prompt)
    wanted = sorted(set(sample_idx).union(*prompt_idx.values()))
    where = {row: i for i, row in enumerate(wanted)}
    # on the model's device, where the engine samples (as the runner's logits; the requests' generators are
    # made on that device)
    logits = (head(torch.tensor(wanted, dtype=torch.long)) if wanted
              else torch.empty(0, vocab, dtype=dtype, device=model.device))
    sample = logits[[where[r] for r in sample_idx]] if sample_idx else logits[:0]
    prompt = {rid: logits[[where[r] for r in rows]] if len(rows) else logits[:0] for rid, rows in prompt_idx.items()}
    hidden = {sr.request_id: drafter_rows[a:b] for sr, (a, b) in zip(out.scheduled, spans)}
    return sample, prompt, hidden
