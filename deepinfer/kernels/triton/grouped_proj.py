"""Op "grouped_proj_fp8" on cuda: V4's grouped output LoRA with `wo_a` kept as its checkpoint FP8 bytes.

The official model runs `einsum("bsgd,grd->bsgr", o, wo_a)` on bf16 operands, wo_a being convert.py's bf16
dequantisation `bf16(fp32(E4M3) x scale)` of the FP8 checkpoint weight. That value is exact (4 significant
bits x a power of two), so the FP8 bytes and block scales hold the same weight in half the memory (V4-Flash:
32 MB a layer, 1.4 GB over 43 layers) and a decode step reads half the bytes (64 -> 32 MB a layer).

Four forms, the same math as the twin (`quant_weights.grouped_proj_fp8_torch`: exact bf16 products, fp32
sums, one bf16 rounding), up to the fp32 summation order:
* T <= SYNC_MAX_T (decode): the mma.sync CUDA kernel of fp8_linear's decode form
  (`kernels/cuda/fp8_linear_mma.cu` with RAW_ACT and GROUP_ROWS: the same E4M3 expansion, x's bf16 as it is,
  the rows of one group per CTA, split-K added in a fixed order). H200 2026-12-05 (twenty-first session,
  V4-Flash's wo_a): 14.4 us at T=1 and 15.3 at T=8 against cuBLAS's 21.6 on the bf16 weight;
* WGMMA_MIN_T..WGMMA_MAX_T (batched decode): fp8_linear's wgmma CUDA kernel with GROUP_ROWS
  (`kernels/cuda/fp8_linear_wgmma.cu`: o's bf16 reordered once by `act_quant_wgmma(quant=False)`, the rows of
  one group per CTA), where this Triton kernel was slower than cuBLAS on the bf16 weight (H200: T=32 27.1
  against 22.4 us, T=128 36.2 against 24.7). H100 2026-12-05: T=32 24.5 against cuBLAS's 29.6, T=128 32.7
  against 32.7 (its H200 timing is owed);
* T <= FUSED_MAX_T tokens (where the CUDA forms cannot run): `_grouped_proj_fp8_kernel` expands each weight tile in
  registers (E4M3 -> fp32, x its block scale, -> bf16: convert.py's expression, bit for bit) and multiplies
  it on the bf16 tensor cores with fp32 accumulation; one program owns BLOCK_N consecutive rows of one
  group for a block of tokens and streams the full K (no split-K: one launch, a fixed summation order).
* more tokens (prefill): `_dequant_kernel` writes the bf16 weight once per call (a transient [G, R, d]
  buffer, 64 MB on V4-Flash; ~25 us at the copy rate) and cuBLAS runs the official einsum's batched GEMM
  on it (`bf16_gemm.grouped_proj_bf16_cublas`: written straight into [T, G, R], no permuted view to copy
  after), at the price of that one pass.
Must not: be imported off CUDA (imports triton); keep a bf16 copy of the weight beyond one call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.bf16_gemm import grouped_proj_bf16_cublas
from deepinfer.kernels.quant_weights import QuantLinearWeight, check_grouped_proj_fp8
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.launch import cdiv, fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter

BF16 = torch.bfloat16
FUSED_MAX_T = 64  # tokens up to which the fused kernel runs (decode batches); more: dequantise + cuBLAS
# The fused kernel's launch plan per token count: rows of the weight per program, K per step, pipeline
# stages, warps (benchmarks/bench_grouped_proj.py sweeps it). H200 2026-12-05, V4-Flash's wo_a, graph replay
# (results/grouped_proj_h200_2026-12-05_s18_scalar_scale.log): T=1..8 21.5-22.0 us (cuBLAS on the bf16
# weight 21.6: the FP8 bytes at ~1.5 TB/s, not yet the ~4 their half size allows), T=64 24.7-27.6 (23.4),
# T=128 36.0 (24.8); num_stages 5-6 at T <= 64 were the sweep's best by <= 1 us. Where the CUDA forms run
# (sm_90: the sync and wgmma forms) this kernel is not used up to 256 tokens.
PLAN_SMALL = dict(BLOCK_N=64, BLOCK_K=128, num_stages=4, num_warps=4)  # T <= 16: one 16-row MMA block
PLAN_LARGE = dict(BLOCK_N=64, BLOCK_K=128, num_stages=3, num_warps=4)  # T <= 64
_PLAN_KEYS = ("BLOCK_T", "BLOCK_N", "BLOCK_K", "num_stages", "num_warps")
SYNC_MAX_T = 8  # tokens the mma.sync form takes (one CTA's 8 rows; fp8_gemm.SYNC_MAX_M)
WGMMA_MIN_T, WGMMA_MAX_T = 9, 256  # tokens the wgmma form takes where it can run (fp8_gemm's wgmma regime)


@fast_launch
@triton.jit
def _grouped_proj_fp8_kernel(o_ptr, w_ptr, s_ptr, out_ptr, T, R, D, stride_ot, stride_og, stride_wn, stride_sn,
                             stride_out, WBLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, n] = bf16(sum_k o[t, n // R, k] * bf16(fp32(w[n, k]) * s[n // WBLOCK, k // WBLOCK])) for the
    program's BLOCK_N rows n (one group: R % BLOCK_N == 0; one scale row: BLOCK_N <= WBLOCK) and BLOCK_T
    tokens; fp32 accumulation. K goes in steps of BLOCK_K <= WBLOCK (one scale a step: a scalar load, and
    pointer tiles advanced in place; the first form gathered a [BLOCK_N, BLOCK_K] tile of scales through a
    pointer tile per step and ran at ~190 GB/s on the H200)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    g = n0 // R
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = o_ptr + toks.to(tl.int64)[:, None] * stride_ot + g * stride_og + ks[None, :]
    w_ptrs = w_ptr + (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    s_row = s_ptr + (n0 // WBLOCK) * stride_sn
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        x = tl.load(x_ptrs, mask=tmask[:, None], other=0.0)
        w = tl.load(w_ptrs).to(tl.float32)
        wb = (w * tl.load(s_row + k0 // WBLOCK)).to(tl.bfloat16)  # convert.py's bf16 of the exact fp32 value
        if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; fp32 operands give the same exact products
            acc = tl.dot(x.to(tl.float32), tl.trans(wb.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(wb), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    rows = n0 + tl.arange(0, BLOCK_N)
    out = out_ptr + toks.to(tl.int64)[:, None] * stride_out + rows[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=tmask[:, None])


@fast_launch
@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, D, stride_wn, stride_sn, WBLOCK: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """out[n, k] = bf16(fp32(w[n, k]) * s[n // WBLOCK, k // WBLOCK]) (convert.py's wo_a), out contiguous."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows < N)[:, None] & (ks < D)[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rows // WBLOCK).to(tl.int64)[:, None] * stride_sn + (ks // WBLOCK)[None, :], mask=m,
                other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + ks[None, :], (w * s).to(tl.bfloat16), mask=m)


def plan(T: int, R: int, config: dict | None = None) -> dict:
    """The fused kernel's launch plan for T tokens (`config`'s keys on top: the benchmark's sweep). BLOCK_T
    is the smallest MMA block (16) that holds T up to 16, else 64 (the kernel's regime ends at
    FUSED_MAX_T); BLOCK_N must divide R (a program's rows stay in one group)."""
    cfg = dict(PLAN_SMALL if T <= 16 else PLAN_LARGE)
    cfg["BLOCK_T"] = 16 if T <= 16 else 64
    bad = sorted(set(config or {}) - set(_PLAN_KEYS))
    if bad:
        raise ValueError(f"grouped_proj_fp8: unknown config keys {bad}; known: {_PLAN_KEYS}")
    cfg.update(config or {})
    for key in ("BLOCK_T", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"grouped_proj_fp8: {key}={v} must be a power of two >= 16 (the MMA's minimum)")
    if R % cfg["BLOCK_N"]:
        raise ValueError(f"grouped_proj_fp8: BLOCK_N={cfg['BLOCK_N']} must divide the {R} rows of a group")
    return cfg


def fit_block(cfg: dict, block: int, d: int) -> dict:
    """The plan with BLOCK_N and BLOCK_K at most the weight's scale block (one scale per step) and BLOCK_K
    dividing d (the kernel's K loop has no tail mask)."""
    cfg = dict(cfg)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block)
    bk = min(cfg["BLOCK_K"], block)
    while d % bk:
        bk //= 2
    if bk < 16:
        raise ValueError(f"grouped_proj_fp8: d={d} has no power-of-two K step >= 16 within the {block} block")
    cfg["BLOCK_K"] = bk
    return cfg


def dequant_bf16(w: QuantLinearWeight) -> torch.Tensor:
    """The weight's bf16 value [N, K] (convert.py's), in one launch: a new tensor, the caller's to drop."""
    N, D = w.data.shape
    out = torch.empty(N, D, dtype=BF16, device=w.data.device)
    bn, bk = 32, 256
    _dequant_kernel[(cdiv(N, bn), cdiv(D, bk))](w.data, w.scale, out, N, D, w.data.stride(0),
                                                             w.scale.stride(0), WBLOCK=w.block, BLOCK_N=bn,
                                                             BLOCK_K=bk, num_warps=4)
    return out


def grouped_proj_fp8(o: torch.Tensor, w: QuantLinearWeight, config: dict | None = None,
                     form: str = "auto") -> torch.Tensor:
    """o bf16 [T, G, d], w [G * R, d] (FP8 + block scales) -> bf16 [T, G, R]. form: "sync" (the mma.sync CUDA
    kernel), "wgmma" (the warpgroup-MMA CUDA kernel), "fused" (the in-register expansion), "dequant" (bf16
    weight + cuBLAS) or "auto" (sync up to SYNC_MAX_T tokens and wgmma for WGMMA_MIN_T..WGMMA_MAX_T where they
    can run, else fused up to FUSED_MAX_T, dequant above). config: the fused kernel's launch override (`plan`),
    or for "sync" fp8_linear_mma's (tiles, SPLIT_K, CLUSTER), for "wgmma" fp8_linear_wgmma's (tiles, SPLIT_K)."""
    if not o.is_cuda and not interpreting():
        from deepinfer.kernels.quant_weights import grouped_proj_fp8_torch

        return grouped_proj_fp8_torch(o, w)
    R = check_grouped_proj_fp8(o, w)
    T, G, d = o.shape
    if form not in ("auto", "fused", "dequant", "sync", "wgmma"):
        raise ValueError(f"grouped_proj_fp8: form must be auto, sync, wgmma, fused or dequant, got {form!r}")
    if form == "sync" or (form == "auto" and 0 < T <= SYNC_MAX_T and _sync_usable(w, R, o.device)):
        return _grouped_proj_sync(o, w, R, config)
    if form == "wgmma" or (form == "auto" and WGMMA_MIN_T <= T <= WGMMA_MAX_T and _wgmma_usable(w, R, o.device)):
        return _grouped_proj_wgmma(o, w, R, config)
    if form == "dequant" or (form == "auto" and T > FUSED_MAX_T):
        # the batched GEMM writes [T, G, R] itself: einsum's permuted [G, T, R] view cost the caller's flatten a
        # copy (an 8k prefill: 4 x 175 us on the H100, 2026-12-06 profile_ops)
        return grouped_proj_bf16_cublas(o, dequant_bf16(w).view(G, R, d))
    if o.stride(2) != 1:
        o = o.contiguous()
    out = torch.empty(T, G, R, dtype=BF16, device=o.device)
    if T == 0:
        return out
    cfg = fit_block(plan(T, R, config), w.block, d)
    grid = (G * R // cfg["BLOCK_N"], cdiv(T, cfg["BLOCK_T"]))
    _grouped_proj_fp8_kernel[grid](o, w.data, w.scale, out, T, R, d, o.stride(0), o.stride(1), w.data.stride(0),
                                   w.scale.stride(0), out.stride(0), WBLOCK=w.block, BLOCK_T=cfg["BLOCK_T"],
                                   BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], INTERPRET=interpreting(),
                                   num_stages=cfg["num_stages"],
                                   num_warps=cfg["num_warps"])
    return out


def _sync_usable(w: QuantLinearWeight, R: int, device: torch.device) -> bool:
    """The mma.sync form can run this weight here: fp8_linear's rule for its decode kernel (CUDA with NVRTC,
    blocks 128 / 32, K whole 128-steps, exact scales) and groups of whole CTA tiles."""
    from deepinfer.kernels.cuda import fp8_linear_mma as sync
    from deepinfer.kernels.triton.fp8_gemm import _sync_usable as linear_sync_usable

    return R % sync.rows_per_cta(sync.tiles()) == 0 and linear_sync_usable(w, device)


def _wgmma_usable(w: QuantLinearWeight, R: int, device: torch.device) -> bool:
    """The wgmma form can run this weight here: fp8_linear's rule for its wgmma kernel (sm_90 with NVRTC,
    blocks 128 / 32, exact scales) and groups of whole CTA tiles (256 rows: the widest plan's)."""
    from deepinfer.kernels.triton.fp8_gemm import _wgmma_usable as linear_wgmma_usable

    return R % 256 == 0 and linear_wgmma_usable(w, device)


def _grouped_proj_wgmma(o: torch.Tensor, w: QuantLinearWeight, R: int, config: dict | None) -> torch.Tensor:
    """The wgmma form: o's bf16 reordered once into the kernel's operand order, the GEMM with one group per
    CTA, split-K partials added by fp8_gemm's ordered sum."""
    from deepinfer.kernels.cuda import fp8_linear_wgmma as wg
    from deepinfer.kernels.triton.act_quant import act_quant_wgmma
    from deepinfer.kernels.triton.fp8_gemm import _partials_then_sum, serial_counters, sm_count

    T, G, d = o.shape
    out = torch.empty(T, G, R, dtype=BF16, device=o.device)
    if T == 0:
        return out
    a = act_quant_wgmma(o.reshape(T, G * d), w.act_block, quant=False)  # o's values, the operand's column order
    cfg = wg.plan(T, G * R, d, sm_count(o.device), config)
    split = cfg["SPLIT_K"]
    counters = serial_counters(w, split, wg.tile_count(T, G * R, cfg), wg.rows_per_cta(cfg), config, o.device)
    _partials_then_sum(lambda dest, **serial: wg.fp8_linear_partials(a, w, dest, cfg, group_rows=R, **serial),
                       split, out.view(T, G * R), counters)
    return out


def _grouped_proj_sync(o: torch.Tensor, w: QuantLinearWeight, R: int, config: dict | None) -> torch.Tensor:
    """The mma.sync form: one launch when its plan does not split K or the split CTAs add up as a cluster
    (fp8_gemm's `use_cluster` rule), else fp32 partials and fp8_gemm's ordered sum."""
    from deepinfer.kernels.cuda import fp8_linear_mma as sync
    from deepinfer.kernels.triton.fp8_gemm import (SERIAL_MAX_ROWS, _partials_then_sum, serial_counters, sm_count,
                                                   use_cluster)

    T, G, d = o.shape
    if o.stride(2) != 1 or o.stride(1) != d or o.stride(0) % 8:
        o = o.contiguous()
    out = torch.empty(T, G, R, dtype=BF16, device=o.device)
    flat = out.view(T, G * R)
    cfg = sync.plan(T, G * R, d, sm_count(o.device), config)
    split = cfg["SPLIT_K"]
    if use_cluster(split, config, lambda: sync.cluster_fits(T, G * R, cfg, o.device, group_rows=R)):
        sync.fp8_linear_partials(o, w, flat, cfg, cluster_split=split, group_rows=R)
        return out
    counters = serial_counters(w, split, sync.tile_count(T, G * R, cfg), sync.rows_per_cta(cfg), config, o.device,
                               by_default=T <= SERIAL_MAX_ROWS)
    _partials_then_sum(lambda dest, **serial: sync.fp8_linear_partials(o, w, dest, cfg, group_rows=R, **serial),
                       split, flat, counters)
    return out


REGISTRATIONS = {"grouped_proj_fp8": grouped_proj_fp8}
