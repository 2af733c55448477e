"""Triton gated softmax pooling of the KV compressor: the CUDA twin of `torch_ops.compress_pool`.

Owns: `compress_pool(kv, score, overlap)`, same contract as the torch op. Per entry and channel, a softmax
over the block's rows of `score` (fp32, max-subtracted) weights the rows of `kv`; overlap (ratio 4) pools
the previous block's A-half (channels :d) with the current block's B-half (channels d:), 2r rows, read in
place (the torch version concatenates both halves into a new tensor first). One program per (entry, block
of channels); the rows of one entry are at most 128 (ratio 128), so a whole column fits in registers.
Must not: know about the compressor's state machine or positions (the caller adds `ape` to the score and
slices the complete blocks); be imported off CUDA (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import torch_ops
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter


@fast_launch
@triton.jit
def _compress_pool_kernel(kv_ptr, sc_ptr, out_ptr, R, W, CW, stride_b, stride_r, OVERLAP: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < W
    rows = tl.arange(0, BLOCK_R)
    if OVERLAP:
        # rows [0, R): block e (the previous block), channels [0, W); rows [R, 2R): block e+1, channels [W, 2W)
        second = rows >= R
        blk = e + second.to(tl.int64)
        r_in = tl.where(second, rows - R, rows)
        ch = cols[None, :] + tl.where(second, W, 0)[:, None]
        rmask = rows < 2 * R
    else:
        blk = e + tl.zeros_like(rows).to(tl.int64)
        r_in = rows
        ch = cols[None, :] + tl.zeros_like(rows)[:, None]
        rmask = rows < R
    off = blk[:, None] * stride_b + r_in[:, None] * stride_r + ch
    m = rmask[:, None] & cmask[None, :]
    s = tl.load(sc_ptr + off, mask=m, other=float("-inf")).to(tl.float32)
    v = tl.load(kv_ptr + off, mask=m, other=0.0).to(tl.float32)
    p = tl.exp(s - tl.max(s, axis=0)[None, :])
    w = p / tl.sum(p, axis=0)[None, :]
    tl.store(out_ptr + e * W + cols, tl.sum(v * w, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)


def compress_pool(kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> torch.Tensor:
    """overlap=False: kv, score [n, r, d] -> [n, d]; overlap=True: [n+1, r, 2d] -> [n, d] (see torch_ops)."""
    if kv.dtype == torch.float64 or score.dtype == torch.float64:
        return torch_ops.compress_pool(kv, score, overlap)
    if kv.dim() != 3 or kv.shape != score.shape or (overlap and kv.shape[-1] % 2):
        raise ValueError(f"compress_pool: want kv and score of one shape [n(+1 if overlap), r, c*d]; got kv "
                         f"{tuple(kv.shape)}, score {tuple(score.shape)}, overlap={overlap}")
    nb, r, cw = kv.shape
    n = nb - 1 if overlap else nb
    W = cw // 2 if overlap else cw
    dtype = torch.promote_types(kv.dtype, score.dtype)
    out = torch.empty(max(n, 0), W, dtype=dtype, device=kv.device)
    if n <= 0:
        return out
    kv, score = kv.contiguous(), score.contiguous()
    block_r = next_power_of_2(2 * r if overlap else r)
    block_c = max(16, min(128, 8192 // block_r))
    _compress_pool_kernel[(n, cdiv(W, block_c))](
        kv, score, out, r, W, cw, kv.stride(0), kv.stride(1), OVERLAP=bool(overlap), BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=4)
    return out


REGISTRATIONS = {"compress_pool": compress_pool}
