"""Verification of draft tokens against the target's logits rows, one draft position at a time.

A request that computed its last real token and k drafts has k + 1 logits rows: row j is the target's
distribution for the token after draft j (row 0: after the last real token). Round j samples row j of every
request still verifying with the ordinary `Sampler` (its filters, its per-request generator, one noise row
per draw) and accepts draft j iff the sampled token equals it; the first mismatch, or row k, ends the
request's step with the sampled token as the bonus.

Why this preserves the target distribution: every emitted token is a draw from the target row it belongs
to, conditioned on the same prefix; the draft only decides how many rows are looked at. For a deterministic
draft d this IS rejection sampling with q = onehot(d): P(accept) = p(d) = min(1, p(d)/q(d)) and, on a
mismatch, the token is distributed as p restricted to tokens != d, i.e. norm(max(p - q, 0)). A seeded
request draws exactly one noise row per emitted token, as it does without drafting, so its output is
token-for-token the same with and without drafts, and logprobs come from the very rows that were sampled.

Must not: map rows to requests (the caller hands rows per request), touch caches, or know the drafter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepinfer.sampling import Sampler, SamplingParams
from deepinfer.sampling.sampler import SamplerOutput


@dataclass
class Verified:
    """One request's step: the emitted tokens (accepted drafts + one sampled token) and, for token i, the
    sampler output and row index its logprobs come from."""

    tokens: list[int] = field(default_factory=list)
    sampled: list[tuple[SamplerOutput, int]] = field(default_factory=list)
    num_drafts: int = 0

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def verify(sampler: Sampler, rows: Sequence[torch.Tensor] | torch.Tensor, drafts: Sequence[Sequence[int]],
           params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[Verified]:
    """rows[i]: request i's logits [len(drafts[i]) + 1, V] in draft order; or, when no request has drafts, one
    [n, V] tensor whose row i is request i's (sampled as it is: no per-request slicing and stacking, which
    cost host time per request on a GPU). Returns one `Verified` per request."""
    n = len(rows)
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 2 or any(len(d) for d in drafts):
            raise ValueError(f"verify: one logits tensor {tuple(rows.shape)} is for requests without drafts "
                             f"([n, V], one row each)")
        batch, rows = rows, None
    else:
        batch = None
    if not (len(drafts) == len(params) == len(generators) == n):
        raise ValueError(f"verify: {n} row sets, {len(drafts)} drafts, {len(params)} params, "
                         f"{len(generators)} generators")
    for i, (r, d) in enumerate(zip(rows or (), drafts)):
        if r.dim() != 2 or r.shape[0] != len(d) + 1:
            raise ValueError(f"verify: request {i} has {len(d)} drafts but logits rows {tuple(r.shape)}; "
                             f"expected [{len(d) + 1}, V] (one row per draft plus the bonus row)")
    out = [Verified(num_drafts=len(d)) for d in drafts]
    active = list(range(n))
    j = 0
    while active:
        logits = batch if batch is not None else torch.stack([rows[i][j] for i in active])
        sampled = sampler.sample(logits, [params[i] for i in active], [generators[i] for i in active])
        tokens = sampled.lists[0]
        still = []
        for row, i in enumerate(active):
            token = tokens[row]
            out[i].tokens.append(token)
            out[i].sampled.append((sampled, row))
            if j < len(drafts[i]) and token == drafts[i][j]:
                still.append(i)
        active = still
        j += 1
    return out
