"""Triton op "fp8_linear": official act_quant of bf16 x fused into a block-scaled FP8 GEMM (spec §6.1, §6.3,
§10.6). x bf16 [M, K], w `QuantLinearWeight` (E4M3 [N, K], fp32 block scales, block 128 in V4 / 32 in V4.1)
-> bf16 [M, N].

The activation is quantised to E4M3 per `act_block` group with the group's pow2 scale (bit-identical to
formats.act_quant): inside the GEMM for M <= 64 (decode: one launch), by one act_quant pass writing the exact
q * s in bf16 for larger M (else every N tile's program would redo it). Each weight tile is multiplied by
its block scales in registers. Both
operands then enter the tensor cores as their exact values in bf16 (E4M3 x pow2 fits bf16), so every
product is exact and is accumulated in fp32: the official fp8_gemm's math (sum over K blocks of
scale_a x scale_b x exact FP8 dot) up to fp32 summation order, which is the only difference from the torch
twin (`quant_weights.fp8_linear_torch`). Why not FP8 tensor-core dots: Hopper's FP8 MMA accumulates with
reduced precision (measured 6e-4 rel_err vs the twin, 6% of outputs off, against 0 for this form).
Tried and dropped (H200, 2026-11-29, same run): the E4M3 codes as fp16 into the dot with the pow2 scales
applied once per K chunk to the fp32 partial (one conversion per element, no per-element multiply; exact,
passed the twin tests): M=1 22.2 vs 21.2 us (the decode GEMM is not bound by the expansion), M=4096 543 vs
406 us (the per-chunk `acc += part * s` serialises the wgmma pipeline).
Must not: be imported without triton; allocate per-call weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch, _check_activation
from deepinfer.kernels.triton.act_quant import act_quant_dequant_bf16, interpreting, quantise_rows


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N,
                       stride_xm, stride_wn, stride_wsn, stride_om, K: tl.constexpr,
                       WBLOCK: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr, A_DEQUANT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """A_DEQUANT: x already holds act_quant's exact q * s in bf16 (large M: quantised once, not per N tile);
    else x is the raw bf16 activation, quantised here per CHUNK (small M: one launch, fused)."""
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
    offs_k = tl.arange(0, KB)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [KB, BN], K-major
    ws_ptrs = ws_ptr + (offs_n // WBLOCK)[None, :] * stride_wsn + tl.arange(0, KB // WBLOCK)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, KB):
        # activation: E4M3 with one pow2 scale per CHUNK of a row, then its exact value q * s in bf16
        if A_DEQUANT:
            a_val = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0).to(tl.float32)
            a_q, a_scale = quantise_rows(tl.reshape(a, (BM * (KB // CHUNK), CHUNK)))
            a_val = tl.reshape(a_q.to(tl.float32) * a_scale[:, None], (BM, KB)).to(tl.bfloat16)
        # weight: E4M3 x its pow2 block scale, exact in bf16 (E4M3 has 3 mantissa bits)
        b = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0).to(tl.float32)
        b_scale = tl.load(ws_ptrs + k0 // WBLOCK, mask=n_ok[None, :], other=0.0)  # [KB/WBLOCK, BN]
        b_val = tl.reshape(tl.reshape(b, (KB // WBLOCK, WBLOCK, BN)) * b_scale[:, None, :], (KB, BN))
        acc = tl.dot(a_val, b_val.to(tl.bfloat16), acc)  # exact products, fp32 accumulation
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


def fp8_linear(x: torch.Tensor, w: QuantLinearWeight, config: dict | None = None) -> torch.Tensor:
    """Op "fp8_linear" on CUDA tensors; CPU tensors go to the torch twin (or, under TRITON_INTERPRET=1,
    through the kernel in Triton's interpreter, for tests at tiny shapes). config: tile override (the
    benchmark's sweep)."""
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
    kb = 128 if k % 128 == 0 and 128 % w.block == 0 else w.block  # K per loop step: whole scale blocks
    cfg = config or _config(m, kb)
    a_dequant = m > 64  # quantise once (exact bf16 q * s) rather than in each of the N/BN tiles' programs
    if a_dequant:
        x = act_quant_dequant_bf16(x, w.act_block)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _fp8_linear_kernel[grid](x, w.data, w.scale, out, m, n, x.stride(0), w.data.stride(0), w.scale.stride(0),
                             out.stride(0), K=k, WBLOCK=w.block, CHUNK=w.act_block, KB=kb,
                             A_DEQUANT=a_dequant, **cfg)
    return out


REGISTRATIONS = {"fp8_linear": fp8_linear}
