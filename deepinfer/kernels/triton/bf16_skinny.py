"""Triton tensor-core GEMM for the bf16-weight fp32 matmuls at 9..256 rows (batched decode, short extends).

Owns: `launch(x, w, out_dtype)` (x bf16 [M, K] @ w bf16 [N, K]^T -> fp32 or bf16 [M, N]) and `takes_shape(m, n)`,
the rows `bf16_gemv.linear_f32` / `blinear` hand it (between the GEMV's <= 8 rows and cuBLAS's long prompts).
Why: at 16..128 rows cuBLAS ran these (the compressors' stacked wkv | wgate, the MoE gate, the indexer's
weights_proj: N = 64..2048, K = 4096) as a split-K GEMM plus a `splitKreduce` kernel, ~16 us per call pair
on the H100 for 0.5-16 MB of weights (results/decode_anatomy_pdl_h100_2026-12-06_s27.log: 187 us of a
b128 step's 4 layers, 20 launches; the reduce alone ~9 us a call, its fp32 partials as large as the
weight). Here one program owns BW consecutive weight rows for BT tokens and streams the FULL K: one launch,
no partials, a summation order fixed by the tile (batch invariant: BW and BK depend on N only, so a row's
bits do not depend on M or on the other rows; tested on the GPU).
Form ("swap", as fp8_linear's decode kernels): the weight tile is the MMA's M side ([BW, BK], BW >= 64 =
one wgmma M per warpgroup), the tokens its N side ([BK, BT], BT = 16..128), so a 16-row batch does not pad
to 64 MMA rows; the fp32 accumulator [BW, BT] is stored transposed.
Numerics: bf16 operands into the tensor cores with fp32 accumulation (`tl.dot`, out_dtype fp32): products
of bf16 values are exact, sums in fp32 in the MMA's order, one rounding for bf16 out. That is the official
fp32 matmul of the bf16 values up to the fp32 summation order, as cuBLAS's tensor-core path is
(`bf16_gemm.linear_f32_cublas`); the tests hold it to the same summation-order bounds as the GEMV.
Must not: be imported off CUDA (imports triton); sync with the host (captured in CUDA graphs); copy or
upcast the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

MIN_ROWS, MAX_ROWS = 9, 256  # rows it takes: above the GEMV's, up to two 128-token tiles
MAX_N = 16384  # weights with more rows (the LM head's 129280) stay on cuBLAS, which streams them at the copy rate


@fast_launch
@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = sum_k x[m, k] w[n, k] for this program's BW weight rows n and BT tokens m, over all K.
    x [M, K] and w [N, K] with unit column strides (16-byte asynchronous copies into shared memory: with x's
    column stride a run-time value, sm_90 code loaded x 2 bytes at a time through registers); out [M, N]
    with unit column stride, its dtype (fp32 or bf16) the one output rounding."""
    pdl_enter(PDL)
    wrows = tl.program_id(0).to(tl.int64) * BW + tl.arange(0, BW)
    toks = tl.program_id(1).to(tl.int64) * BT + tl.arange(0, BT)
    wmask = wrows < N
    tmask = toks < M
    lanes = tl.arange(0, BK)
    acc = tl.zeros((BW, BT), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + lanes
        kmask = ks < K
        w = tl.load(w_ptr + wrows[:, None] * stride_wn + ks[None, :], mask=wmask[:, None] & kmask[None, :],
                    other=0.0)  # [BW, BK] bf16
        x = tl.load(x_ptr + toks[:, None] * stride_xm + ks[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)  # [BT, BK] bf16, K contiguous as stored
        # the transpose is the MMA's operand order (a K-major B tile), not a data movement: loading the
        # [BK, BT] tile directly made sm_90 code transpose in registers (byte permutes, spills at BT 128)
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)  # exact products, fp32 sums
    tl.store(out_ptr + toks[None, :] * stride_om + wrows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=wmask[:, None] & tmask[None, :])


def tiles(m: int, n: int, k: int) -> dict:
    """{BW, BT, BK, num_warps, num_stages} for M tokens and an N x K weight. BT: the smallest of 16..128 that
    holds the tokens (two programs along M from 129 rows). BW and BK depend on N only (batch invariance):
    64 weight rows a program (one wgmma M per warpgroup; N = 2048 gives 32 programs a token tile) and
    128-K steps, 4 stages in flight (a stage is 16 KB of weights and up to 32 KB of tokens)."""
    bt = min(128, max(16, next_power_of_2(m)))
    return dict(BW=64, BT=bt, BK=128, num_warps=4, num_stages=4)


def takes_shape(m: int, n: int) -> bool:
    """Whether M rows times an N-row weight take this kernel (MIN_ROWS..MAX_ROWS rows, N <= MAX_N)."""
    return MIN_ROWS <= m <= MAX_ROWS and 0 < n <= MAX_N


def launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """The kernel on x's device (cuda, or CPU under TRITON_INTERPRET=1), no checks beyond the layout:
    x bf16 [M, K] (any strides: one with a column stride other than 1 is copied first), w bf16 [N, K] with
    unit column stride -> out_dtype [M, N]. config: keys of `tiles` overriding it (benchmark sweeps, tests)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w.shape[0]
    if w.stride(1) != 1:
        raise ValueError(f"bf16 skinny GEMM: wants w with unit column stride; got strides {tuple(w.stride())}")
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    t = dict(tiles(M, N, K), **(config or {}))
    _skinny_kernel[(cdiv(N, t["BW"]), cdiv(M, t["BT"]))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BW=t["BW"], BT=t["BT"], BK=t["BK"], num_warps=t["num_warps"], num_stages=t["num_stages"])
    return out


__all__ = ["MAX_N", "MAX_ROWS", "MIN_ROWS", "launch", "takes_shape", "tiles"]
