"""Triton op "fp8_linear": official act_quant of bf16 x fused into a block-scaled FP8 GEMM (spec §6.1, §6.3,
§10.6). x bf16 [M, K], w `QuantLinearWeight` (E4M3 [N, K], fp32 block scales, block 128 in V4 / 32 in V4.1)
-> bf16 [M, N].

Per K chunk of `act_block` (= the weight block in both families) each program quantises its [BM, chunk]
activation tile to E4M3 with the pow2 scale of that row group (bit-identical to formats.act_quant), takes the
exact FP8 x FP8 dot with fp32 accumulation on the tensor cores, and promotes the partial sum into a separate
fp32 accumulator multiplied by act scale x weight block scale: the official kernel's math. The only
difference from the torch twin (`quant_weights.fp8_linear_torch`) is the fp32 summation order.
Must not: be imported without triton; allocate per-call weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch, _check_activation
from deepinfer.kernels.triton.act_quant import interpreting, quantise_rows


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N,
                       stride_xm, stride_wn, stride_wsn, stride_om, K: tl.constexpr,
                       WBLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # grouped program order: GROUP_M row tiles share each weight tile while it is in L2
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, CHUNK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [CHUNK, BN], K-major
    ws_ptrs = ws_ptr + (offs_n // WBLOCK) * stride_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, CHUNK):
        a = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0).to(tl.float32)
        a_q, a_scale = quantise_rows(a)
        b = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0)
        b_scale = tl.load(ws_ptrs + k0 // WBLOCK, mask=n_ok, other=0.0)
        partial = tl.dot(a_q, b)  # exact FP8 products, fp32 accumulation inside one scale block
        acc += partial * (a_scale[:, None] * b_scale[None, :])
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int, chunk: int) -> dict:
    """Tile sizes: small M (decode) is weight-bandwidth bound -> narrow N tiles so all SMs stream weights;
    large M is compute bound -> 128x128 tiles."""
    if m <= 16:
        return dict(BM=16, BN=32, GROUP_M=1, num_warps=4, num_stages=6 if chunk == 128 else 8)
    if m <= 64:
        return dict(BM=64, BN=64, GROUP_M=4, num_warps=4, num_stages=4 if chunk == 128 else 6)
    return dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=3 if chunk == 128 else 5)


def fp8_linear(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Op "fp8_linear" on CUDA tensors; CPU tensors go to the torch twin (or, under TRITON_INTERPRET=1,
    through the kernel in Triton's interpreter, for tests at tiny shapes)."""
    if not x.is_cuda and not interpreting():
        return fp8_linear_torch(x, w)
    _check_activation("fp8_linear", x, w.in_features)
    if w.act_block != w.block and w.block % w.act_block:
        raise ValueError(f"fp8_linear: act_block {w.act_block} must divide the weight block {w.block}")
    if w.data.device != x.device or not (w.data.is_contiguous() and w.scale.is_contiguous()):
        raise ValueError(f"fp8_linear: the weight must be contiguous tensors on {x.device} (QuantLinearWeight.to)")
    x = x.contiguous()
    m, k = x.shape
    n = w.out_features
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    cfg = _config(m, w.act_block)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _fp8_linear_kernel[grid](x, w.data, w.scale, out, m, n, x.stride(0), w.data.stride(0), w.scale.stride(0),
                             out.stride(0), K=k, WBLOCK=w.block, CHUNK=w.act_block, **cfg)
    return out


REGISTRATIONS = {"fp8_linear": fp8_linear}
