"""Test-only drafters whose proposals are forced, so acceptance paths are exercised on the tiny model
(whose random MTP weights almost never agree with the target): the target's own greedy continuation
(100% acceptance), a wrong one (0%), and one right for a varying prefix then wrong (every acceptance
length, so every rollback length)."""
from __future__ import annotations

from deepinfer.spec.proposer import Proposer

VOCAB = 129280


class ForcedProposer(Proposer):
    """Proposes from `continuations[tuple(prompt)]` (the non-drafting run's output tokens): the first
    `right(k)` (mixed: cycling 1, 2, .., k, 0 over calls) drafts are the true next tokens, the rest are
    deliberately wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], mode: str) -> None:
        if mode not in ("oracle", "wrong", "mixed"):
            raise ValueError(mode)
        self.cont, self.mode = continuations, mode
        self.calls = 0

    def right(self, k: int) -> int:
        self.calls += 1
        return {"oracle": k, "wrong": 0}.get(self.mode, self.calls % (k + 1))

    def propose(self, requests, k):
        drafts = {}
        for req in requests:
            truth = self.cont[tuple(req.prompt_token_ids)][req.num_output_tokens : req.num_output_tokens + k]
            good = self.right(k)
            drafts[req.request_id] = [t if j < good else (t + 1) % VOCAB for j, t in enumerate(truth)]
        return drafts
