"""`ParallelConfig`: which slice of the model and of the batch one rank owns.

Layout: world = tp * dp ranks, rank = dp_rank * tp + tp_rank (a tensor-parallel group is a run of
consecutive ranks, so on one host it shares the fastest links). Attention, the embedding, the head and
the engram tables are split over the tp group; every dp group serves its own sequences. Routed experts
are split into `ep` equal shards, ep in {1, tp, tp*dp}:
* ep = 1: every rank holds every expert (MoE needs no communication);
* ep = tp: expert shard = tp_rank (the official `model{rank}-mp{tp}` layout), MoE all-reduce over the tp group;
* ep = tp*dp: expert shard = global rank; the tokens of all dp groups are gathered, each rank runs its
  experts on all of them, the sum is all-reduced over the world and every dp group keeps its rows.
Must not: import torch.distributed or touch tensors (the communicator and the sharding rules do).
"""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    ep: int = 1
    dp: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.ep not in (1, self.tp, self.world_size):
            raise ValueError(f"ParallelConfig: ep must be 1, tp ({self.tp}) or tp*dp ({self.world_size}), "
                             f"got {self.ep}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelConfig: rank {self.rank} outside the world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def ep_rank(self) -> int:
        if self.ep == 1:
            return 0
        return self.tp_rank if self.ep == self.tp else self.rank

    @property
    def moe_gathers_dp(self) -> bool:
        """MoE tokens cross dp groups (experts split over the whole world and more than one dp group)."""
        return self.ep > 1 and self.ep == self.world_size and self.dp > 1

    def for_rank(self, rank: int) -> "ParallelConfig":
        return ParallelConfig(self.tp, self.ep, self.dp, rank)

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def dp_group_ranks(self, tp_rank: int) -> list[int]:
        return [d * self.tp + tp_rank for d in range(self.dp)]

    # ------------------------------------------------------------------ model checks
    def check_model(self, cfg: ModelConfig) -> None:
        """Clear errors for a split the model's shapes do not allow (raised before any process starts)."""
        def bad(msg: str) -> None:
            raise ValueError(f"--tp {self.tp} --ep {self.ep} --dp {self.dp}: {msg}")

        if cfg.n_heads % self.tp:
            bad(f"{cfg.n_heads} attention heads are not divisible by tp {self.tp}")
        if cfg.vocab_size % self.tp:
            bad(f"vocabulary {cfg.vocab_size} is not divisible by tp {self.tp}")
        G = cfg.o_groups
        if G % self.tp and self.tp % G:
            bad(f"o_groups {G} and tp {self.tp}: one must divide the other")
        if cfg.n_routed_experts % self.ep:
            bad(f"{cfg.n_routed_experts} routed experts are not divisible by ep {self.ep}")

    # ------------------------------------------------------------------ ownership
    def experts_per_rank(self, n_experts: int) -> int:
        return n_experts // self.ep

    def owns_expert(self, expert: int, n_experts: int) -> bool:
        """Expert e lives on ep shard e // (n/ep), as the official converter places it."""
        return expert // self.experts_per_rank(n_experts) == self.ep_rank

    def owns_sequence(self, state_slot: int) -> bool:
        """Data parallel: a sequence is served by dp group state_slot % dp. The slot is the sequence's for
        its whole life (a preempted one restarts from position 0, so moving groups then is harmless)."""
        return state_slot % self.dp == self.dp_rank

    def engram_rows(self, total_rows: int) -> tuple[int, int]:
        """[start, end) of an engram table's rows on this rank: ceil(rows/tp) per rank (spec §10.5)."""
        per = -(-total_rows // self.tp)
        start = min(self.tp_rank * per, total_rows)
        return start, min(start + per, total_rows)
