"""Triton lightning-indexer scores with the official bf16 rounding points.

Owns:
* `indexer_scores_bf16(q, weights, keys)`: the CUDA twin of `official.indexer_scores_bf16`. One program per
  (query token, block of 64 entries): all heads' q.k in one MMA (fp32 accumulation), rounded to bf16, relu,
  times the bf16 head weight rounded to bf16, summed over heads in fp32, rounded to bf16. The [T, h, E]
  per-head scores never reach memory (the torch version writes them twice).
The top-k after it stays `torch_ops.stable_topk` on CUDA too: `torch.sort(stable=True)` is stable there (a
radix sort; tested with heavy ties in tests/test_kernels_attn.py), and measured on the H200 it beat a top-k
over packed (score, position) int64 keys 4-10x (T=1, E=65536: 40 us vs 393 us; T=8192, E=2048: 345 us vs
1684 us), so no kernel is registered for it.
Must not: be imported off CUDA (imports triton); mask visibility (the caller sets invisible entries to -inf).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import official


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, NH, E, stride_qt, stride_qh, stride_wt, stride_ke,
                           stride_ot, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                           INTERPRET: tl.constexpr):
    t = tl.program_id(1).to(tl.int64)
    ents = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ents < E
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < NH
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=hmask[:, None], other=0.0)
    keys = tl.load(k_ptr + ents.to(tl.int64)[:, None] * stride_ke + dims[None, :], mask=emask[:, None], other=0.0)
    if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; fp32 operands give the same exact products
        s = tl.dot(q.to(tl.float32), tl.trans(keys).to(tl.float32))
    else:
        s = tl.dot(q, tl.trans(keys))  # [BLOCK_H, BLOCK_E] fp32
    s = tl.maximum(s.to(tl.bfloat16).to(tl.float32), 0.0)
    w = tl.load(w_ptr + t * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    s = (s * w[:, None]).to(tl.bfloat16).to(tl.float32)  # padded heads: weight 0, score 0
    total = tl.sum(s, axis=0)
    tl.store(out_ptr + t * stride_ot + ents, total.to(tl.bfloat16), mask=emask)


def indexer_scores_bf16(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, h, d] bf16, weights [T, h] bf16, keys [E, d] bf16 -> [T, E] bf16 (official rounding points)."""
    if q.dim() != 3 or weights.shape != q.shape[:2] or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"indexer_scores_bf16: want q [T, h, d], weights [T, h], keys [E, d]; got q {tuple(q.shape)}, "
                         f"weights {tuple(weights.shape)}, keys {tuple(keys.shape)}")
    T, nh, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"indexer_scores_bf16: head dim {d} must be a power of two >= 16")
    if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16:
        return official.indexer_scores_bf16(q, weights, keys)  # other dtypes: the torch version's promotion
    E = keys.shape[0]
    out = torch.empty(T, E, dtype=torch.bfloat16, device=q.device)
    if T == 0 or E == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.contiguous()
    block_h = max(16, triton.next_power_of_2(nh))
    block_e = 64
    _indexer_scores_kernel[(triton.cdiv(E, block_e), T)](
        q, weights, keys, out, nh, E, q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), out.stride(0),
        D=d, BLOCK_H=block_h, BLOCK_E=block_e, INTERPRET=_interpreting(), num_warps=4)
    return out


REGISTRATIONS = {
    "indexer_scores_bf16": indexer_scores_bf16,
}
