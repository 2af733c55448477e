"""`Communicator`: the handful of collectives the parallel model needs, over torch.distributed process
groups (gloo on CPU, nccl on CUDA; no home-made transport). The model receives one (None = single
process: its existing paths run unchanged, bit for bit).

Boundaries (spec §3.1, §3.5, §3.9, §10.5):
* `embed`: vocab-parallel lookup, foreign ids give zero rows, summed over the tp group;
* `attn_out`: the row-parallel wo_b partial outputs summed over the tp group;
* `moe_dispatch` / `moe_combine`: with experts split over the whole world and several dp groups, the
  tokens of every dp group are all-gathered first; the local experts' partial sums are all-reduced over
  the expert group and each rank keeps its own rows;
* `engram_sum`: engram table rows of this rank (zeros elsewhere) summed over the tp group;
* `gather_vocab`: the vocab-parallel head's column slices all-gathered into full logits.
Reductions of bf16 values run in fp32 (spec §6.7: "TP all-reduces of row-parallel outputs and MoE are
fp32") and are rounded back. Groups of one rank are skipped, so tp=1 costs nothing.
Must not: know the model's layers or the engine (it is handed tensors, returns tensors).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.distributed.parallel_config import ParallelConfig


class Communicator:
    def __init__(self, parallel: ParallelConfig) -> None:
        """Call on every rank after `dist.init_process_group`: every rank must create every group, in order."""
        if not dist.is_initialized():
            raise RuntimeError("Communicator needs torch.distributed initialised (init_process_group)")
        if dist.get_world_size() != parallel.world_size or dist.get_rank() != parallel.rank:
            raise ValueError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"ParallelConfig says rank {parallel.rank} of {parallel.world_size}")
        self.parallel = pc = parallel
        self.tp_group = self.dp_group = None
        for d in range(pc.dp):
            g = dist.new_group(pc.tp_group_ranks(d))
            if d == pc.dp_rank:
                self.tp_group = g
        for t in range(pc.tp):
            g = dist.new_group(pc.dp_group_ranks(t))
            if t == pc.tp_rank:
                self.dp_group = g
        self.ep_group = self.tp_group if pc.ep == pc.tp else dist.group.WORLD
        # where the bookkeeping tensors of a collective live: nccl only moves CUDA tensors
        nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._dp_counts: list[int] | None = None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _sum(x: torch.Tensor, group) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            y = x.to(torch.float32)
            dist.all_reduce(y, group=group)
            return y.to(x.dtype)
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    def min_over_world(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    # ------------------------------------------------------------------ model boundaries
    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """table [V/tp, D] (this rank's vocabulary rows), ids [T] global -> [T, D]."""
        if self.parallel.tp == 1:
            return table[ids]
        n = table.shape[0]
        local = ids - self.parallel.tp_rank * n
        foreign = (local < 0) | (local >= n)
        rows = table[local.clamp(0, n - 1)]
        rows[foreign] = 0
        return self._sum(rows, self.tp_group)

    def attn_out(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.parallel.tp == 1 else self._sum(out, self.tp_group)

    def engram_sum(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.parallel.tp == 1 else self._sum(rows, self.tp_group)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V/tp] this rank's vocabulary columns -> [N, V] (tp ranks hold consecutive slices)."""
        if self.parallel.tp == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.parallel.tp)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens the local experts must see: this dp group's own (x, ids), or every dp group's."""
        if not self.parallel.moe_gathers_dp:
            return x, ids
        counts = torch.zeros(self.parallel.dp, dtype=torch.int64, device=self.device)
        counts[self.parallel.dp_rank] = x.shape[0]
        dist.all_reduce(counts, group=self.dp_group)
        self._dp_counts = counts.tolist()
        return self._gather_rows(x), (None if ids is None else self._gather_rows(ids))

    def _gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        counts = self._dp_counts
        width = max(counts)
        padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.dp_group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    def moe_combine(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the local experts' outputs over the expert group; keep this dp group's rows."""
        if self.parallel.ep == 1:
            return y
        y = self._sum(y, self.ep_group)
        if not self.parallel.moe_gathers_dp:
            return y
        start = sum(self._dp_counts[: self.parallel.dp_rank])
        return y[start : start + self._dp_counts[self.parallel.dp_rank]]
