"""Expert parallelism in fast numerics: a batch's global routing turned into routing over THIS rank's
`FP4ExpertBank`, so that one unchanged `fp4_moe` call returns exactly this rank's fp32 partial sum.

With ep > 1 a rank's bank holds the experts [first, first + n_local) (`ParallelConfig.owns_expert`: expert e
lives on shard e // n_local), stored at local indices 0..n_local-1 (`params_fast`). `local_routing` maps:
* a local slot (global id in the range) -> local id = id - first, its routing weight kept;
* a non-local slot -> a local expert this token does NOT already use, routing weight 0.0.
Why that contributes exactly nothing: the op multiplies the routing weight into the fp32 SwiGLU output
before the bf16 rounding (official order), so the row is 0.0 * finite = +-0 (finite: the clamp, limit > 0,
bounds gate and up; V4/V4.1 ship swiglu_limit 10); act_quant floors a row's amax at 1e-4, so a zero row
quantises to zeros and its down projection is +-0; adding +-0 to the token's fp32 sum leaves it unchanged.
Rows are independent in both the Triton kernel and its torch twin (per-row activation scales), so the
local slots' outputs are the same bits as without the padding. Distinct ids per token: the twin
accumulates with `y[rows] += ...`, which would drop one of two equal ids in a token.
Why not compaction (only the local slots): the op takes a fixed k per token, and packing a variable number
of local slots needs their count on the host (a sync per layer, no CUDA-graph capture).
Cost: every slot is still computed, so the grouped GEMMs do the FLOPs of all T*k slots (as at ep 1) while
reading only the local 1/ep of the weights; the padding rows are spread over the local experts (rotated
per token) so no expert's blocks pile up. At decode (weight-bandwidth bound) that costs little; at large
prefill batches it is ~ep x the needed expert FLOPs (a compacting dispatch would remove that).
Must not: know the model's layers or import torch.distributed (the caller dispatches and combines).
"""
from __future__ import annotations

import torch


def local_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, first: int,
                  n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] global expert ids, topk_weights [T, k] fp32 -> (ids [T, k] in [0, n_local), distinct
    per row; weights [T, k] with 0.0 on every slot whose expert is not in [first, first + n_local)).
    Device ops only (no host sync)."""
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"local_routing: topk_ids and topk_weights must both be [T, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    t, k = topk_ids.shape
    if k > n_local:
        raise ValueError(f"local_routing: {k} experts per token but only {n_local} local experts: the "
                         f"zero-weight padding needs k distinct local experts (use a smaller ep)")
    dev = topk_ids.device
    local = topk_ids.long() - first
    is_local = (local >= 0) & (local < n_local)
    slot = torch.where(is_local, local, torch.zeros_like(local))
    used = torch.zeros((t, n_local), dtype=torch.int32, device=dev).scatter_add_(1, slot, is_local.to(torch.int32)) > 0
    # each token's free local experts, in an order rotated per token (the padding rows spread over the
    # local experts); the used ones sort after every free one (n_local - used >= k - used free ones exist)
    rotation = (torch.arange(t, device=dev) * k) % n_local
    order = (torch.arange(n_local, device=dev)[None, :] - rotation[:, None]) % n_local
    free = (order + used.long() * n_local).argsort(dim=1)
    nth_foreign = ((~is_local).long().cumsum(dim=1) - 1).clamp(min=0)
    ids = torch.where(is_local, local, free.gather(1, nth_foreign))
    weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))
    return ids.to(topk_ids.dtype), weights


def expert_shard(params, cfg, comm) -> tuple[int, int] | None:
    """(first, n_local) of the bank under params["experts"] when it holds one expert-parallel shard; None
    when it holds every expert (one process, or ep 1). Checks the bank against the parallel split."""
    pc = None if comm is None else comm.parallel
    if pc is None or pc.ep == 1:
        return None
    n_local = pc.experts_per_rank(cfg.n_routed_experts)
    held = params["experts"].n_experts
    if held != n_local:
        raise ValueError(f"fast numerics with ep {pc.ep}: the expert bank holds {held} experts, this rank owns "
                         f"{n_local} of {cfg.n_routed_experts} (params built from another split?)")
    if cfg.n_activated_experts > n_local:
        raise ValueError(f"fast numerics with ep {pc.ep}: {cfg.n_activated_experts} experts per token exceed the "
                         f"{n_local} local experts the zero-weight padding needs distinct (use a smaller ep)")
    return pc.ep_rank * n_local, n_local
