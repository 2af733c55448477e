"""Logit filters of random sampling: min-p, top-k, top-p, batched with per-row parameters.

Each filter takes temperature-scaled logits `[N, V]` and returns a copy with the removed tokens at -inf,
so the caller's softmax renormalises over what is left. Order (vLLM v1): min-p, then top-k, then top-p.
min-p compares against the row's best token, which no other filter removes, so it commutes with top-k;
top-p measures mass after min-p/top-k removed tokens.

Ties: top-k keeps every token equal to the k-th value (a deterministic set, not a sort-order accident);
top-p keeps the smallest prefix of the descending order whose mass reaches p (the best token always).

Must not: draw random numbers or compute logprobs.
"""
from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens with prob < min_p * max_prob. `min_p` [N] in [0, 1]; 0 removes nothing."""
    # In log space: logit_i < max_logit + log(min_p) (softmax's normaliser cancels); log(0) = -inf.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p.to(logits.dtype)).unsqueeze(-1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """`top_k` [N] long, 0 = off; `top_p` [N] in (0, 1], 1 = off. Either may be None (off for all rows)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [N, V] each
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).to(torch.long)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(-1))  # [N, 1]
        remove |= sorted_logits < kth
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens; 0 for the best
        p = top_p.to(probs.dtype).unsqueeze(-1)
        remove |= (mass_before >= p) & (p < 1)  # p == 1 is exactly "off", immune to cumsum rounding
    mask = torch.zeros_like(remove).scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def apply_filters(logits: torch.Tensor, top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  min_p: torch.Tensor | None = None) -> torch.Tensor:
    """All filters in the sampler's order; a None parameter skips that filter for every row."""
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return apply_top_k_top_p(logits, top_k, top_p)
