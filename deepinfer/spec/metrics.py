"""`AcceptanceStats`: how many drafts were proposed and accepted at each draft position (1-based: position 1
is the first draft after the last real token). Acceptance is prefix-wise: a draft counts as accepted only
if every earlier draft of its step was accepted too.

Must not: decide acceptance (verify.py does) or format for a transport (the server does).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    proposed: list[int] = field(default_factory=list)  # index j: drafts proposed at position j + 1
    accepted: list[int] = field(default_factory=list)
    num_steps: int = 0  # verification steps (one per request per step that carried drafts)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        if num_drafts == 0:
            return
        grow = num_drafts - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        for j in range(num_drafts):
            self.proposed[j] += 1
            self.accepted[j] += j < num_accepted
        self.num_steps += 1

    def rates(self) -> list[float]:
        """Acceptance rate per draft position (accepted / proposed)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per verification step (accepted drafts + the one sampled token)."""
        return 1 + sum(self.accepted) / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "proposed": list(self.proposed), "accepted": list(self.accepted),
                "acceptance_rate": self.rates(), "mean_accepted_length": self.mean_accepted_length}
