"""Triton GEMV for the bf16-weight fp32 matmuls at batched decode: ops "linear_f32" and "blinear" in ONE launch.

Owns: `linear_f32(x, w)` (x bf16 [M, K] @ w bf16 [N, K]^T -> fp32 [M, N]) and `blinear(x, w)` (the same, one
rounding to bf16) for small M x N on cuda: the MoE gate, the compressors' wkv / wgate and the indexer's
weights_proj at decode (the LM head stays on cuBLAS). cuBLAS (`bf16_gemm.linear_f32_cublas` / `blinear_cublas`)
runs these at M = 1 as a split-K GEMM plus a separate `splitKreduce` kernel, ~6 us per call for weights of
0.5-16 MB; here one program owns BN consecutive weight rows for all M rows of x and streams the FULL K (no
split-K: one launch, a fixed summation order), so the call is bound by reading the weight once.
Numerics: x and w chunks are upcast to fp32 and multiplied elementwise (never `tl.dot`: no TF32 / bf16 MMA
rounding can enter); a product of two bf16 values is exact in fp32 (8 + 8 significant bits <= 24), so
fused multiply-adds change nothing. Each of the BK lanes of a program accumulates the products of its
k = j, j + BK, j + 2 BK, ... in fp32 in that order, then the BK lane sums are added in Triton's reduction
tree: the official fp32 matmul of the bf16 values (`bf16_gemm.linear_f32_torch`, `official.blinear`) up to
the fp32 summation order, as cuBLAS is. The order is fixed for a given tile (`_gemv_tiles(m, n, k)`: it
depends on M, so a row's bits can change with the batch size, as cuBLAS's can); runs are deterministic.
Registration: `kernels/__init__` registers the cuBLAS versions for "cuda" when `deepinfer.kernels` is
imported, which happens before `kernels.triton.register_cuda_kernels()` can run (it lives in a subpackage
and imports `register` from it), so these entries replace them; every call they do not take (M >
GEMV_MAX_ROWS or M x N > GEMV_MAX_WORK, an fp32 weight, a weight that is not contiguous, CPU tensors off the
interpreter) goes to the cuBLAS versions (which send CPU tensors to the torch twins). From 9 rows cuBLAS's
split-K GEMM + splitKreduce stays: a one-launch tensor-core GEMM over the whole K (bf16_skinny, 2026-12-06)
was 0.42-0.97x its speed on the H100 (too few CTAs stream a 0.5-16 MB weight; BENCHMARKS.md twenty-ninth
session), and removed.
Must not: be imported off CUDA (imports triton); sync with the host (calls are captured in CUDA graphs);
copy or upcast the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import bf16_gemm
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

BF16, F32 = torch.bfloat16, torch.float32
GEMV_MAX_ROWS = 8  # rows of x one program holds (its [M_PAD, BN, BK] fp32 accumulator lives in registers)
# Which calls take the GEMV (H200, results/gemv_h200_2026-12-02_s4.log, per call with L2-cold weights, K=4096):
# it beats cuBLAS (split-K + splitKreduce, ~6-10 us) while M x N is small: M=1 N=64..2048 2.6-8.1 vs
# 5.8-10.1 us; M=2 to N=1024 (7.0 vs 7.9); M=4 to N=512 (5.5 vs 7.3); M=8 only N<=256, barely; from M=16 and
# for the LM head (N=129280: 266 vs 243 us, cuBLAS streams it at the copy rate) cuBLAS is faster.

GEMV_MAX_WORK = 2048  # M x N up to this (and M <= 8) take the GEMV; above, cuBLAS is as fast or faster


@triton.jit
def gemv_program(x_ptr, w_ptr, out_ptr, pid, M, N, K, stride_xm, stride_wn, stride_om, scale,
                 M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr):
    """Program `pid`'s share of the GEMV: out[m, n] = sum_k x[m, k] * w[n, k] for n in its BN columns and all
    m < M <= M_PAD. SCALED (bf16 out): the bf16 sum times the fp32 scale, rounded to bf16 again (`blinear(x,
    w) * scale` as torch does it). Also the first stage of the MoE's fused decode route (moe_route.py), which
    calls it with the same tiles so that its logits have these bits."""
    cols = pid.to(tl.int64) * BN + tl.arange(0, BN)  # weight rows = output columns
    rows = tl.arange(0, M_PAD)
    cmask = cols < N
    rmask = rows < M
    lanes = tl.arange(0, BK)
    acc = tl.zeros((M_PAD, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + lanes
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # [M_PAD, BK]
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # [BN, BK]
        acc += x[:, None, :] * w[None, :, :]  # exact products, one fp32 sum per lane and k-step
    y = tl.sum(acc, axis=2)  # [M_PAD, BN]: the BK lane sums, in the reduction tree's order
    if SCALED:
        y = y.to(tl.bfloat16).to(tl.float32) * scale
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@fast_launch
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 scale, M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    """out[m, n] = sum_k x[m, k] * w[n, k] for n in this program's BN columns and all m < M <= M_PAD.
    x [M, K] and w [N, K] with unit column strides (x's a run-time stride made sm_90 code load x 2 bytes at a
    time: 32 LDG.U16 against the weight's 4 LDG.128 a thread at M=1 N=256, scripts/sass_sm90.py); out [M, N]
    with unit column stride, its dtype (fp32 or bf16) the one output rounding (SCALED: see gemv_program)."""
    pdl_enter(PDL)
    gemv_program(x_ptr, w_ptr, out_ptr, tl.program_id(0), M, N, K, stride_xm, stride_wn, stride_om, scale, M_PAD,
                 BN, BK, SCALED)


def _gemv_tiles(m: int, n: int, k: int) -> dict:
    """{BN, BK, num_warps, num_stages} for x [m, K] and w [n, K], from the H200 sweep of 2026-12-02
    (benchmarks/bench_gemv.py, results/gemv_h200_2026-12-02_s4.log: K = 4096):
    * up to 4 rows the best tiles hold BN x BK = 4096 weight elements per step (an fp32 accumulator of up to
      128 per thread at 4 warps) with about 512 programs at one or two rows, 256 from four: M=1 N=256 BN 1
      (3.1 us), N=1024 BN 2 (5.6 us), N=2048 BN 4 (8.2 us); M=4 N=256 BN 1 (4.2 us), N=512 BN 2 (5.5 us);
    * 5..8 rows: 8 warps and 64 accumulator elements per thread (M=8 N=64 6.5 us, N=256 6.9 us). The
      4-row rule carried to 8 rows (256 fp32 per thread) spills: 88 us per call in the slice's b8 step
      (results/decode_anatomy_h200_2026-12-02_s4.log), which is how this branch came to be."""
    mp = next_power_of_2(max(m, 1))
    kp = next_power_of_2(max(k, 1))
    if mp >= 8:
        bn = min(16, max(2, n // 256))
        bn = 1 << (bn.bit_length() - 1)
        return dict(BN=bn, BK=max(16, min(kp, 16384 // (mp * bn))), num_warps=8, num_stages=2)
    bn = min(16, max(1, n // (512 if mp <= 2 else 256)))
    bn = 1 << (bn.bit_length() - 1)  # a power of two
    return dict(BN=bn, BK=max(16, min(kp, 4096 // bn)), num_warps=4, num_stages=2)


def _launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, tiles: dict | None = None,
            max_rows: int = GEMV_MAX_ROWS, scale: float | None = None) -> torch.Tensor:
    """The kernel on x's device (cuda, or CPU under TRITON_INTERPRET=1), no checks beyond the layout:
    x bf16 [M <= max_rows, K] (any strides: one with a column stride other than 1 is copied first, at most
    max_rows rows), w bf16 [N, K] with unit column stride -> out_dtype [M, N]. tiles: {BN, BK, num_warps,
    num_stages} overriding `_gemv_tiles` (benchmark sweeps, tests); max_rows is raised past GEMV_MAX_ROWS only
    by the benchmark (to see where the limit should sit). scale (bf16 out only): `blinear(x, w) * scale`."""
    M, K = x.shape
    N = w.shape[0]
    if M > max_rows or w.stride(1) != 1:
        raise ValueError(f"bf16 gemv: wants x [<= {max_rows}, K] and w with unit column stride; got x "
                         f"{tuple(x.shape)}, w strides {tuple(w.stride())}")
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    t = dict(_gemv_tiles(M, N, K), **(tiles or {}))
    if scale is not None and out_dtype != BF16:
        raise ValueError("bf16 gemv: a scale needs the bf16 output (blinear_scaled)")
    _gemv_kernel[(cdiv(N, t["BN"]),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), float(1.0 if scale is None else scale),
        M_PAD=next_power_of_2(M), BN=t["BN"], BK=t["BK"], SCALED=scale is not None, num_warps=t["num_warps"],
        num_stages=t["num_stages"])
    return out


def _takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel runs a checked call with a bf16 weight (else cuBLAS, or the twin on CPU)."""
    return ((x.is_cuda or interpreting()) and takes_shape(x.shape[0], w.shape[0])
            and w.stride(1) == 1 and w.stride(0) == w.shape[1])


def takes_shape(m: int, n: int) -> bool:
    """Whether M rows times an N-row weight take the GEMV (GEMV_MAX_ROWS, GEMV_MAX_WORK: the H200 measurement)."""
    return m <= GEMV_MAX_ROWS and m * n <= GEMV_MAX_WORK


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as `bf16_gemm.linear_f32_cublas`: x bf16 [M, K], w bf16 or fp32 [N, K] -> fp32 [M, N].
    A bf16 weight's arguments are checked on every device (ValueError naming the op); an fp32 weight (the
    official numerics' copy) goes to cuBLAS's fp32 path / the twin unchanged."""
    if w.dtype == BF16:
        bf16_gemm._check("linear_f32", x, w, 2, 2, (BF16, F32))
        if _takes(x, w):
            return _launch(x, w, F32)
    return bf16_gemm.linear_f32_cublas(x, w)


def blinear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as `bf16_gemm.blinear_cublas`: x bf16 [M, K], w bf16 or fp32 [N, K] -> bf16 [M, N]
    (fp32 sums rounded to bf16 once). Checks as `linear_f32` (stricter than `blinear_cublas` on CPU only,
    whose twin `official.blinear` takes any float activation)."""
    if w.dtype == BF16:
        bf16_gemm._check("blinear", x, w, 2, 2, (BF16, F32))
        if _takes(x, w):
            return _launch(x, w, BF16)
    return bf16_gemm.blinear_cublas(x, w)


def blinear_scaled(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as `bf16_gemm.blinear_scaled_cublas`: `blinear(x, w) * scale` (bf16 out; torch's product of
    the bf16 output and the fp32 scale, rounded again), the multiply inside the GEMV's launch when it takes
    the call (the indexer's per-head weights at decode: one launch fewer on its lane)."""
    if w.dtype == BF16:
        bf16_gemm._check("blinear_scaled", x, w, 2, 2, (BF16, F32))
        if _takes(x, w):
            return _launch(x, w, BF16, scale=scale)
    return bf16_gemm.blinear_scaled_cublas(x, w, scale)


REGISTRATIONS = {"linear_f32": linear_f32, "blinear": blinear, "blinear_scaled": blinear_scaled}
