"""`Proposer`: the interface every drafter implements for the engine's speculative loop.

Per engine step, after the scheduler's update:
  observe(step)  - the target just computed `step.computed[rid]` (positions, hidden rows, slots); requests whose
                   target state was rolled back are in `step.rewound[rid] = position`
  propose(reqs)  - draft up to k tokens for each running request that has a new last token
  release(rid)   - the request finished or was preempted: drop its drafter state
Must not: change scheduler state (the engine assigns the drafts), or verify (verify.py does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepinfer.scheduler import Request


@dataclass(frozen=True)
class Computed:
    """One request's part of the target step: positions [start, start + n) and their final hidden rows
    ([n, hc, D]; None when the drafter does not need them), and the request's cache slots."""

    start: int
    hidden: torch.Tensor | None
    window_slot: int
    state_slot: int


@dataclass
class TargetStep:
    computed: dict[str, Computed] = field(default_factory=dict)
    rewound: dict[str, int] = field(default_factory=dict)


class Proposer:
    needs_hidden = False  # True: the engine runs the target so its final hidden rows reach `observe`

    def observe(self, requests: dict[str, Request], step: TargetStep) -> None:
        """Default: a drafter without state of its own ignores the target's step."""

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, list[int]]:
        raise NotImplementedError(f"{type(self).__name__} must implement propose")

    def release(self, request_id: str) -> None:
        """Default: nothing kept per request."""
