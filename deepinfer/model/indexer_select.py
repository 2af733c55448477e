"""The indexer's selection for every sequence of a varlen extend step at once (fast numerics): the same pool
rows and index columns as `extend_attention._indexer_selection` builds sequence by sequence.

Why: per sequence and indexer layer that loop costs ~12 torch ops (mask, stable top-k, hidden picks, column
building, the gather of its pool piece), each a launch on cuda: a prefill step of many prompts pays them on
every indexer layer.

How: each sequence's scores are computed by its own `indexer_scores_bf16` call (the per-sequence kernel
call with the sequence's visible counts, so the same bits, -inf past them) into one [T, N] buffer padded
with -inf to the widest sequence's N entries; one stable top-k of K = min(index_topk, N) for the whole step.
Padding sorts after every real entry (stable: ties toward the lower index), so a sequence's first
min(index_topk, n) picks are its own top-k.
Columns and pool rows follow the per-sequence layout exactly (the same `base` running over the sequences in
order: a sequence whose S queries pick fewer than its n entries gets its S * k picked rows, else all its n
entries), from a plan of per-token vectors built once per step, ratio and base (`SelectPlan`); the picks of
the "picked rows" sequences are scattered into the pool's row list on the device.
Must not: score with another kernel than the per-sequence path, or read device values on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext


@dataclass
class SelectPlan:
    K: int  # columns: min(index_topk, widest sequence's entries)
    widest: int  # N: the widest sequence's entries
    spans: tuple[tuple[int, int, int, int], ...]  # (first token, tokens, first entry, entries) per sequence with entries
    kmax: torch.Tensor  # [T] min(index_topk, n) of the token's sequence (0: none)
    all_rows: torch.Tensor  # [T] bool: the token's sequence puts all its entries in the pool
    base_t: torch.Tensor  # [T] the token's first column value (see module doc)
    pool_entry: torch.Tensor  # [P] index into entry_rows of each pool row (picked rows: their sequence's first)
    pick_src: torch.Tensor  # [Q] flat index into the [T, K] picks of each picked pool row
    pick_dst: torch.Tensor  # [Q] its position in the pool


def build_select_plan(ctx: ForwardContext, n_ent: tuple[int, ...], ent_start: tuple[int, ...], topk: int,
                      base: int, device: torch.device) -> SelectPlan:
    widest = max(n_ent)
    K = min(topk, widest)
    kmax, all_rows, base_t, pool_entry, pick_src, pick_dst, spans = [], [], [], [], [], [], []
    at = 0  # pool rows so far
    for i, s in enumerate(ctx.seqs):
        S, n, e0, a = s.num_new, n_ent[i], ent_start[i], ctx.cu_tokens[i]
        k = min(topk, n)
        kmax.append(np.full(S, k))
        if not n:
            all_rows.append(np.zeros(S, dtype=bool))
            base_t.append(np.zeros(S, dtype=np.int64))
            continue
        spans.append((a, S, e0, n))
        if S * k < n:  # its picked rows only: pool rows (u, j) for u < S, j < k
            all_rows.append(np.zeros(S, dtype=bool))
            base_t.append(base + at + np.arange(S, dtype=np.int64) * k)
            pool_entry.append(np.full(S * k, e0))
            u, j = np.divmod(np.arange(S * k), k)
            pick_src.append((a + u) * K + j)
            pick_dst.append(at + np.arange(S * k))
            at += S * k
        else:  # all its entries, ascending
            all_rows.append(np.ones(S, dtype=bool))
            base_t.append(np.full(S, base + at))
            pool_entry.append(e0 + np.arange(n))
            at += n

    def dev(parts: list, dtype=np.int64) -> torch.Tensor:
        flat = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
        return host_to_device(torch.from_numpy(flat), device)

    return SelectPlan(K, widest, tuple(spans), dev(kmax), dev(all_rows, bool), dev(base_t), dev(pool_entry),
                      dev(pick_src), dev(pick_dst))


def select_batched(k, plan: SelectPlan, q_idx: torch.Tensor, w_idx: torch.Tensor, keys: torch.Tensor,
                   visible: torch.Tensor, entry_rows: torch.Tensor,
                   comp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k: the op lookup (kernels.get on the layer's device); keys [sum n, d] every sequence's decoded keys;
    visible [T] entries each query sees ->
    (stored pool rows [P, bytes], index columns [T, K] counted from the plan's base, -1 = none)."""
    T = q_idx.shape[0]
    scores = torch.full((T, plan.widest), float("-inf"), dtype=torch.bfloat16, device=q_idx.device)
    for a, S, e0, n in plan.spans:  # the per-sequence kernel call: the same score bits, -inf past visible
        scores[a : a + S, :n] = k("indexer_scores_bf16")(q_idx[a : a + S], w_idx[a : a + S], keys[e0 : e0 + n],
                                                         visible[a : a + S])
    sel = k("stable_topk")(scores, plan.K)  # [T, K]
    hidden = sel >= visible.unsqueeze(1)
    col = torch.arange(plan.K, device=sel.device)
    cols = plan.base_t.unsqueeze(1) + torch.where(plan.all_rows.unsqueeze(1), sel, col)
    cols = torch.where(hidden | (col >= plan.kmax.unsqueeze(1)), -1, cols)
    pool = plan.pool_entry
    if plan.pick_src.numel():
        picks = torch.where(hidden, 0, sel).flatten()[plan.pick_src]
        pool = pool.index_add(0, plan.pick_dst, picks)  # (distinct destinations: deterministic)
    return comp[entry_rows[pool]], cols
