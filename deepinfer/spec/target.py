"""The target forward of one step that ALSO keeps each sequence's final hidden rows, for drafters that
condition on them (MTP). The logits rows are the ones `ModelRunner.execute` returns, in the same order
(`SchedulerOutput.sample_rows()`), and the head runs on those rows only (it is vocab x dim).

Must not: sample or touch scheduler state; differ from the runner's row mapping (tests compare both).
"""
from __future__ import annotations

import torch

from deepinfer.model.context import ForwardContext, SeqContext, forward_context
from deepinfer.scheduler.output import SchedulerOutput


def _hidden(model, ids: torch.Tensor, seqs: list[SeqContext]) -> torch.Tensor:
    """Final 4-stream residual [T, hc, D] of the batch (official numerics: one sequence per call, as the
    model's own forward does, so the bits match the non-drafting run)."""
    if getattr(model, "official", False) and not getattr(model, "fast", False) and len(seqs) > 1:
        parts, at = [], 0
        for s in seqs:
            parts.append(_hidden(model, ids[at : at + s.num_new], [s]))
            at += s.num_new
        return torch.cat(parts)
    ctx = ForwardContext(tuple(seqs))
    with forward_context(ctx):
        return model.hidden(ids)


def execute_with_hidden(model, out: SchedulerOutput, want_prompt_logits: set[str], vocab: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """-> (sample logits [rows, V] in sample_rows() order, prompt logits per asked request id,
    hidden rows [num_new, hc, D] per request id). Family v4 models (`hidden` returns one tensor)."""
    seqs, ids, spans = [], [], []
    at = 0
    for sr in out.scheduled:
        seqs.append(SeqContext.from_slots(sr.slots, sr.start_position, sr.num_new_tokens))
        ids.extend(sr.token_ids)
        spans.append((at, at + sr.num_new_tokens))
        at += sr.num_new_tokens
    x = _hidden(model, torch.tensor(ids, dtype=torch.long), seqs)
    if isinstance(x, tuple):
        raise NotImplementedError("execute_with_hidden serves family v4 models (a single final residual)")
    sample_idx, prompt_idx = [], {}
    for sr, (a, b) in zip(out.scheduled, spans):
        if sr.num_sampled_rows:
            sample_idx += range(b - sr.num_sampled_rows, b)
        if sr.request_id in want_prompt_logits:
            n_prompt = max(0, min(sr.num_new_tokens, sr.request.num_prompt_tokens - sr.start_position))
            prompt_idx[sr.request_id] = range(a, a + n_prompt)
    wanted = sorted(set(sample_idx).union(*prompt_idx.values()))
    where = {row: i for i, row in enumerate(wanted)}
    logits = model.logits(x[torch.tensor(wanted, dtype=torch.long)]) if wanted else torch.empty(0, vocab, dtype=dtype)
    sample = logits[[where[r] for r in sample_idx]] if sample_idx else torch.empty(0, vocab, dtype=logits.dtype)
    prompt = {rid: logits[[where[r] for r in rows]] if len(rows) else logits[:0] for rid, rows in prompt_idx.items()}
    hidden = {sr.request_id: x[a:b] for sr, (a, b) in zip(out.scheduled, spans)}
    return sample, prompt, hidden
