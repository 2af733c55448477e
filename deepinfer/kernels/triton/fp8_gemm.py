"""Triton op "fp8_linear": official act_quant of bf16 x + a block-scaled FP8 GEMM (spec §6.1, §6.3, §10.6).
x bf16 [M, K], w `QuantLinearWeight` (E4M3 [N, K], fp32 block scales, block 128 in V4 / 32 in V4.1)
-> bf16 [M, N], fp32 accumulation, rounded to bf16 once.

The activation is quantised to E4M3 per `act_block` group with the group's pow2 scale (bit-identical to
formats.act_quant): inside the GEMM for M <= 64 (decode: the quantisation is trivially cheap, each program
quantises only the K range it reads), by one act_quant pass for larger M (else every N tile's program would
redo it). Three Triton tensor-core forms, chosen by `mma=` (module default `MMA`):
* "bf16" (`_fp8_linear_kernel`, exact products): each weight tile is multiplied by its block scales in
  registers, the activation enters as its exact q * s; both are exact in bf16 (E4M3 x pow2), so every
  product is exact and is accumulated in fp32: the official fp8_gemm's math up to fp32 summation order, the
  only difference from the torch twin (`quant_weights.fp8_linear_torch`).
* "fp8" (`_fp8_linear_mma_kernel`, what the official TileLang fp8_gemm does on Hopper): E4M3 codes of both
  operands into the FP8 tensor cores, per K group of the scale granularity (act_block: 128, or 32 in V4.1)
  a FRESH fp32 partial = dot(a_codes, w_codes), promoted as acc += partial * a_scale[:, None] * w_scale.
  Hopper's FP8 MMA accumulates inside one dot with reduced precision (an earlier version measured 6e-4
  rel_err vs the twin), so this is not the twin's math to the last bit.
* "swap" (`kernels/triton/fp8_linear_swap.py`): the "bf16" form's math with the roles swapped, the converted
  weight tile as wgmma's register operand and the tokens as its N; faster for large weights at 17..256 rows
  (`fp8_linear_swap.takes`, from an H200 sweep).
* "wgmma" (`kernels/cuda/fp8_linear_wgmma.cu`, not Triton): the swap form's roles and math in a TMA-fed,
  warp-specialised CUDA kernel; the auto form at WGMMA_MIN_M..WGMMA_MAX_M rows where it can run (sm_90,
  NVRTC, blocks 32 / 128, scales up to 2^7), 3-36% faster per V4-Flash shape than the previous default and
  13-27% over a layer's six linears at M = 32..256 (H200, 2026-12-04: M=128 wq_b 32.6 -> 27.8 us, wo_b
  35.7 -> 29.8, shared w13 29.0 -> 21.7; BENCHMARKS.md).
* "fp8_wgmma" (`kernels/cuda/fp8_linear_prefill.cu`, not Triton): the "fp8" form's math step for step (the
  same bits: the same FP8 MMA per 128 K, the same fused promotion, one rounding) in a TMA-fed, warp-specialised
  CUDA kernel whose consumer warpgroups promote while the other's wgmmas run; V4's 128-blocks on sm_90 only.
  The auto form from FP8_MMA_MIN_M rows where PREFILL_LINEAR_FORM / DEEPINFER_LINEAR_PREFILL_KERNEL say so.
Split-K (every Triton form): when the (M, N) tiles would not fill the SMs (decode), S programs per tile each
reduce a K range into an fp32 workspace [S, M, N]; `_split_sum_kernel` adds the S partials in a fixed order
and rounds to bf16. Deterministic (no atomics), no host sync, CUDA-graph capturable. Rule: `_split_k`.
Default (`MMA = "auto"`): "fp8" from M = FP8_MMA_MIN_M (1024) rows (prefill: compute-bound, where it
doubles the rate), "swap" where it is faster, "bf16" below (decode is weight-bandwidth bound, both forms
read the same bytes, and bf16 keeps the products exact; `FP8_MMA_MIN_M` says why batched decode stays bf16
though fp8 is faster there).
Measured (H200, 2026-12-01, benchmarks/bench_fp8_linear.py, results/bench_fp8_linear_h200.log; FP8 peak
measured that day 1396 TFLOP/s, bf16 781, copy 4244 GB/s):
* fp8 form, 128x128 tiles, 8 warps, 4 stages: K=N=4096 M=4096 189 us = 726 TFLOP/s (bf16 form 408 us =
  337); K=4096 N=32768 M=8192 2.67 ms = 825 TFLOP/s (bf16 6.0 ms); K=8192 N=4096 M=8192 699 us = 786.
  128x256 tiles spill (812 us). At M=128 fp8 is not faster for every shape (K=N=4096: 85 vs 62 us).
  Error vs the twin (tests/test_kernels_fp8_linear.py): rel_err 6-8e-4 with 6.7% of outputs one bf16 ulp
  off (128 blocks), 3-5e-4 / 2.7% (V4.1's 32 blocks); 0 to 8e-5 for M <= 16 (BM=16 runs mma.sync, which
  accumulates these products exactly).
* split-K at M=1 (CUDA-graph replay): K=N=4096 15-18 us with S=4..8 against 20-21 us unsplit (about 1 TB/s,
  still far under the copy rate: one 16 MB weight is 2-3 waves of tiny programs); eager timings of the
  split form are host-bound (two launches and a workspace per call).
Earlier (2026-11-29): the E4M3 codes as fp16 into the dot with the pow2 scales applied per K chunk to the
fp32 partial: M=1 22.2 vs 21.2 us, M=4096 543 vs 406 us (the per-chunk `acc += part * s` serialises the
wgmma pipeline of bf16 dots; with FP8 dots the same promotion per 128 K is the faster form above).
Must not: be imported without triton; allocate per-call weights (the split-K workspace and, for large M,
the quantised activation are per-call activation-sized buffers).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.kernels.split_k import SplitK
from deepinfer.kernels.quant_weights import QuantLinearWeight, e4m3_expansion_exact, fp8_linear_torch, _check_activation
from deepinfer.kernels.triton import fp8_linear_swap as swap
from deepinfer.kernels.triton.act_quant import act_quant, act_quant_dequant_bf16, interpreting, quantise_rows
from deepinfer.kernels.triton.launch import cdiv, fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter

MMA_MODES = ("bf16", "fp8", "sync", "swap", "wgmma", "fp8_wgmma")  # "sync": the mma.sync CUDA kernel
# (kernels/cuda/fp8_linear_mma.cu); "swap": the bf16 form with the weights as wgmma's register operand
# (kernels/triton/fp8_linear_swap.py); "wgmma": the same roles in a TMA-fed, warp-specialised CUDA kernel
# (kernels/cuda/fp8_linear_wgmma.cu); "fp8_wgmma": the "fp8" form's math in a TMA-fed CUDA kernel
# (kernels/cuda/fp8_linear_prefill.cu, V4's 128-blocks)
MMA = "auto"  # default form of op "fp8_linear": "auto" = "fp8" from FP8_MMA_MIN_M rows, "bf16" below, and
# "sync" up to SYNC_MAX_M rows where it can run and DEEPINFER_LINEAR_DECODE_KERNEL / DECODE_LINEAR_FORM say so
SYNC_MAX_M = 8  # the sync kernel's CTA takes 8 rows of x (the MMA's n8): above, each 8 more re-read the weight
DECODE_LINEAR_FORM = "mma"  # what DEEPINFER_LINEAR_DECODE_KERNEL=auto runs up to SYNC_MAX_M rows: "mma" or "triton"
FP8_MMA_MIN_M = 1024  # H200 2026-12-01: fp8 faster at every measured shape from M=1024 (2.2x at 4096).
# ... with V4's 128-blocks only: with V4.1's 32x32 blocks the fp8 form promotes every 32 K (every FP8 MMA's K
# step), and the same H200 run measured it 3.8x SLOWER than the bf16 form at M = 4096, N = K = 4096 (1530 us =
# 90 TFLOP/s against 405 us = 339; results/bench_fp8_linear_h200.log, "v4.1 32x32" rows). On the H100 the V4.1
# slice's 1k prefill spent 13.8 of its 44 ms in those fp8-form linears (~82 TFLOP/s, twenty-eighth session).
FP8_MMA_BLOCKS = (128,)  # weight blocks whose auto form is "fp8" from FP8_MMA_MIN_M rows; others stay "bf16"
PREFILL_LINEAR_FORM = "triton"  # what DEEPINFER_LINEAR_PREFILL_KERNEL=auto runs from FP8_MMA_MIN_M rows: "wgmma"
# (kernels/cuda/fp8_linear_prefill.cu where it can run) or "triton" (the "fp8" form, the same bits)
# 2026-12-02 (scripts/bench_gemm_kernels.py --batch-fp8, results/fp8_linear_batch_sweep_h200_2026-12-02.log): with
# narrow tiles the fp8 form is also faster at M=32 and 128 (sum of a layer's seven decode shapes: M=32 183 -> 129
# us, M=128 247 -> 143 us), but switching there was tried and reverted: a row's bits then depend on whether its
# step has more or fewer than 17 rows (the batched-extend vs per-sequence GPU test failed: logits differ by 9),
# and the free-running tiny V4.1 on cuda kept 4 greedy tokens equal to the oracle's instead of >= 8 (the
# reduced-precision FP8 accumulation). The bf16 form with the sweep's tiles (`_tiles`) gets M=32 to 130 us.
FUSED_ACT_MAX_M = 64  # M up to this: act_quant fused into the GEMM; above: one act_quant pass first
WGMMA_MIN_M, WGMMA_MAX_M = 17, 256  # rows "auto" runs on the wgmma CUDA kernel where it can (sm_90, its weight
# checks): the swap form's regime, which it replaces (H200 sweep: BENCHMARKS.md, scripts/bench_gemm_kernels.py
# --batch-wgmma)


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program order: GROUP_M row tiles share each weight tile while it is in L2."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, stride_os, SPLIT_OUT: tl.constexpr):
    """SPLIT_OUT: the fp32 partial of this program's K range into workspace[split]; else bf16 (rounded once)."""
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_OUT:
        ptrs = out_ptr + tl.program_id(1).to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om \
            + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=mask)


@fast_launch
@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N,
                       stride_xm, stride_wn, stride_wsn, stride_om, stride_os, K: tl.constexpr,
                       WBLOCK: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr, A_DEQUANT: tl.constexpr,
                       K_SPLIT: tl.constexpr, SPLIT_OUT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr = False):
    """mma "bf16". A_DEQUANT: x already holds act_quant's exact q * s in bf16 (large M: quantised once, not
    per N tile); else x is the raw bf16 activation, quantised here per CHUNK (small M: one launch, fused).
    Program (tile, split) reduces K range [split * K_SPLIT, (split + 1) * K_SPLIT) (K_SPLIT = K: no split)."""
    pdl_enter(PDL)
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, KB)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [KB, BN], K-major
    ws_ptrs = ws_ptr + (offs_n // WBLOCK)[None, :] * stride_wsn + tl.arange(0, KB // WBLOCK)[:, None]
    if SPLIT_OUT:
        k_lo = tl.program_id(1) * K_SPLIT
    else:
        k_lo = 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k_step in range(0, K_SPLIT, KB):  # constant trip count (k_lo is added to the offsets)
        k0 = k_lo + k_step
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
    _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, stride_os, SPLIT_OUT)


@fast_launch
@triton.jit
def _fp8_linear_mma_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N,
                           stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os, K: tl.constexpr,
                           WBLOCK: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, A_FUSED: tl.constexpr,
                           K_SPLIT: tl.constexpr, SPLIT_OUT: tl.constexpr, W_UNIFORM: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                           LOOP_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PDL: tl.constexpr = False):
    """mma "fp8" (the official fp8_gemm's form): per K group of G (= act_block) a fresh fp32 partial of the
    E4M3 codes' dot, promoted by the activation row scales and the weight block scales. A_FUSED: x is the
    raw bf16 activation, quantised here per G (small M); else x = act_quant codes and xs its fp32 scales.
    BK: K per loop step (BK // G sub-dots, each with its own loads). W_UNIFORM: BN divides WBLOCK, so one
    weight scale per tile and K group. LOOP_STAGES (None: the launch's num_stages) / WARP_SPECIALIZE: the K
    loop's tl.range options."""
    pdl_enter(PDL)
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_g = tl.arange(0, G)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_g[None, :]
    xs_ptrs = xs_ptr + offs_m.to(tl.int64) * stride_xsm
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_g[:, None]  # [G, BN], K-major
    if W_UNIFORM:
        ws_ptrs = ws_ptr + ((pid_n * BN) // WBLOCK) * stride_wsn
    else:
        ws_ptrs = ws_ptr + (offs_n // WBLOCK) * stride_wsn
    if SPLIT_OUT:
        k_lo = tl.program_id(1) * K_SPLIT
    else:
        k_lo = 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k_step in tl.range(0, K_SPLIT, BK, num_stages=LOOP_STAGES, warp_specialize=WARP_SPECIALIZE):
        k0 = k_lo + k_step
        for j in tl.static_range(BK // G):
            kk = k0 + j * G
            if A_FUSED:
                a = tl.load(x_ptrs + kk, mask=m_ok[:, None], other=0.0).to(tl.float32)
                a_q, a_s = quantise_rows(a)  # the official act_quant of this G group: E4M3 codes, pow2 scales
            else:
                a_q = tl.load(x_ptrs + kk, mask=m_ok[:, None], other=0.0)
                a_s = tl.load(xs_ptrs + kk // G, mask=m_ok, other=0.0)
            b = tl.load(w_ptrs + kk, mask=n_ok[None, :], other=0.0)
            part = tl.dot(a_q, b)  # E4M3 x E4M3 on the FP8 tensor cores, fresh fp32 partial
            if W_UNIFORM:
                b_s = tl.load(ws_ptrs + kk // WBLOCK)
                acc += part * (a_s * b_s)[:, None]
            else:
                b_s = tl.load(ws_ptrs + kk // WBLOCK, mask=n_ok, other=0.0)
                acc += part * (a_s[:, None] * b_s[None, :])
    _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, stride_os, SPLIT_OUT)


@fast_launch
@triton.jit
def _split_sum_kernel(ws_ptr, out_ptr, N, MN, stride_om, S: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """out[m, n] = bf16(sum over s = 0, 1, ..., S-1 of ws[s, m, n]) in that fixed order (fp32)."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + (offs // N) * stride_om + offs % N, acc.to(tl.bfloat16), mask=mask)


def split_sum(part: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = the fp32 partials part [S, M, N] added in order (`_split_sum_kernel`); part's rows may be
    strided (a column view of a stacked GEMM's partials) and are read through a contiguous copy then."""
    split, m, n = part.shape
    if not (part.stride(2) == 1 and part.stride(1) == n and part.stride(0) == m * n):
        part = part.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=part.device)
    if m * n:
        block = 1024
        _split_sum_kernel[(cdiv(m * n, block),)](part, out, n, m * n, out.stride(0), S=split, BLOCK=block,
                                                 num_warps=4)
    return out


@lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 132 (an H200) elsewhere, so the interpreter exercises the same rules."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _tiles(m: int, mma: str, g: int, n: int = 1 << 30, k: int = 1 << 30) -> dict:
    """Tile sizes: small M (decode) is weight-bandwidth bound -> narrow N tiles, many programs streaming
    weights; large M is compute bound -> 128x128 tiles (the FP8 form: 128 K per step, BK // g sub-dots).
    FP8 form at batched decode (H200 sweep, --batch-fp8): M <= 64 64x64; M <= 256 64 x (64 for N >= 8192,
    else 32: the layer's N = 512..4096 projections need the programs), e.g. M=128 wq_a 38 -> 17 us."""
    if mma == "fp8":
        if m <= 16:
            return dict(BM=16, BN=32, BK=128, GROUP_M=1, num_warps=4, num_stages=6)
        if m <= 64:
            return dict(BM=64, BN=64, BK=128, GROUP_M=4, num_warps=4, num_stages=4)
        if m <= 256:
            return dict(BM=64, BN=64 if n >= 8192 else 32, BK=128, GROUP_M=4, num_warps=4, num_stages=4)
        return dict(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4)
    if m <= 16:  # BN 64 / 4 stages: the H200 sweep of 2026-12-02 (scripts/bench_gemm_kernels.py --decode-fp8)
        return dict(BM=16, BN=64, GROUP_M=1, num_warps=4, num_stages=4 if g == 128 else 8)
    # batched decode (--batch-fp8 sweep, 2026-12-02): 32x64 to M=64 (M=32, the seven shapes: 183 -> 130 us);
    # to M=256 64x32 unless the weight is large (N*K >= 32M: wq_b, wo_b keep 128x128; M=128: 247 -> 183 us)
    if m <= 64:
        return dict(BM=32, BN=64, GROUP_M=4, num_warps=4, num_stages=4 if g == 128 else 6)
    if m <= 256 and n * k < (32 << 20):
        return dict(BM=64, BN=32, GROUP_M=4, num_warps=4, num_stages=4 if g == 128 else 6)
    return dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=3 if g == 128 else 5)


def _split_k(m: int, n: int, k: int, kb: int, bm: int, bn: int, sms: int) -> int:
    """Deterministic split-K count S (a power of 2, at most 16): double S while the (M, N) tiles x S stay
    within ~4 programs per SM (small tiles; 1 per SM for 128-row tiles), every split keeps >= 4 loop steps
    of kb, S divides the K steps, and the fp32 workspace traffic (write + read, 8 S M N bytes) stays within
    half the weight bytes (S <= K / (16 M))."""
    tiles = cdiv(m, bm) * cdiv(n, bn)
    target = (4 if bm <= 64 else 1) * sms
    steps = k // kb
    s = 1
    while (s * 2 <= 16 and tiles * s * 2 <= target and steps % (s * 2) == 0 and steps // (s * 2) >= 4
           and 16 * m * s * 2 <= k):
        s *= 2
    return s


def plan(m: int, n: int, k: int, w_block: int, act_block: int, mma: str, sms: int,
         config: dict | None = None) -> dict:
    """The launch configuration for one call: `_tiles` and `_split_k`, then `config`'s keys on top
    (BM, BN, GROUP_M, num_warps, num_stages, BK (fp8), SPLIT_K, LOOP_STAGES / WARP_SPECIALIZE (fp8), FUSED_ACT:
    quantise the activation inside the GEMM (default: M <= FUSED_ACT_MAX_M) or in one pass before it)."""
    if mma not in ("bf16", "fp8", "swap"):  # the Triton forms' plans ("sync": kernels/cuda/fp8_linear_mma)
        raise ValueError(f"fp8_linear plan: mma must be 'bf16', 'fp8' or 'swap' (the Triton forms), got {mma!r}")
    if mma == "fp8":
        cfg = _tiles(m, mma, act_block, n, k)
        cfg.update(config or {})
        kb = cfg["BK"]
        if kb % act_block or k % kb:
            kb = cfg["BK"] = act_block  # K groups of act_block always tile K (QuantLinearWeight checks it)
        split_tile = (cfg["BM"], cfg["BN"])
    else:  # the exact-product forms: whole weight scale blocks per K step
        kb = 128 if k % 128 == 0 and 128 % w_block == 0 else w_block
        if k % kb:
            raise ValueError(f"fp8_linear: in_features {k} must be a multiple of the weight block {w_block}")
        if mma == "swap":
            cfg = swap.tiles(m, n, k)
            cfg.update(config or {})
            split_tile = (cfg["BT"], cfg["BW"])  # a BW x BT program counts as a BT x BW tile in the split rule
        else:
            cfg = _tiles(m, mma, kb, n, k)
            cfg.update({key: v for key, v in (config or {}).items()
                        if key not in ("BK", "LOOP_STAGES", "WARP_SPECIALIZE")})
            split_tile = (cfg["BM"], cfg["BN"])
    if "SPLIT_K" not in cfg:
        cfg["SPLIT_K"] = _split_k(m, n, k, kb, *split_tile, sms)
    steps = k // kb
    if cfg["SPLIT_K"] < 1 or steps % cfg["SPLIT_K"]:
        raise ValueError(f"fp8_linear: SPLIT_K {cfg['SPLIT_K']} must divide the {steps} K steps of {kb}")
    cfg["KB"] = kb
    return cfg


def _sync_usable(w: QuantLinearWeight, device: torch.device) -> bool:
    """The mma.sync kernel can run this weight here: CUDA with NVRTC, blocks of 128 or 32, K whole 128-steps,
    power-of-two scales up to 2^7 (checked once per weight: one host sync, before any graph capture)."""
    from deepinfer.kernels.cuda import fp8_linear_mma as sync
    from deepinfer.kernels.cuda import runtime

    if device.type != "cuda" or w.block not in (128, 32) or w.act_block not in (128, 32) \
            or w.in_features % sync.K_STEP or not runtime.available():
        return False
    return e4m3_expansion_exact(w)


def _fp8_linear_sync(x: torch.Tensor, w: QuantLinearWeight, config: dict | None, out: torch.Tensor,
                     unsummed: bool = False) -> "torch.Tensor | SplitK":
    """fp8_linear through the mma.sync CUDA kernel (act_quant fused, exact products, fp32 sums): one launch
    when S = 1 or the split CTAs add their partials as a cluster (`use_cluster`), else fp32 partials and
    `_split_sum_kernel` (the same fixed-order sum as the Triton forms, so every way gives the same bits)."""
    from deepinfer.kernels.cuda import fp8_linear_mma as sync

    m, k = x.shape
    n = w.out_features
    cfg = sync.plan(m, n, k, sm_count(x.device), config)
    split = cfg["SPLIT_K"]
    if use_cluster(split, config, lambda: sync.cluster_fits(m, n, cfg, x.device)):
        return sync.fp8_linear_partials(x, w, out, cfg, cluster_split=split)  # the partials added in the kernel
    counters = serial_counters(w, split, sync.tile_count(m, n, cfg), sync.rows_per_cta(cfg), config, x.device,
                               by_default=m <= SERIAL_MAX_ROWS)
    return _partials_then_sum(lambda dest, **serial: sync.fp8_linear_partials(x, w, dest, cfg, **serial), split,
                              out, counters, unsummed)


SERIAL_COUNTER_ROW_TILES = 16  # a weight's counters cover launches of up to 16 x 8 = 128 rows of x
SERIAL_MAX_ROWS = 1  # rows of x up to which the mma.sync form's split partials are added serially by default


def serial_counters(w: QuantLinearWeight, split: int, tiles: int, rows_per_cta: int, config: dict | None,
                    device: torch.device, by_default: bool = False) -> torch.Tensor | None:
    """The counters of a CUDA decode linear's serial split-K for this launch (`tiles` output tiles, `split` > 1
    splits; SERIAL_SPLIT in kernels/cuda/fp8_linear_mma.cu and fp8_linear_wgmma.cu), or None: the partials are
    added by `_split_sum_kernel` instead (the same bits). Taken where config SERIAL is True, or where the
    caller's rule says so (`by_default`) and DEEPINFER_LINEAR_SERIAL_SPLIT=1 (off by default: `env`). The rule,
    from the H100 (2026-12-07, thirty-ninth session): the mma.sync form at 1 row of x (SERIAL_MAX_ROWS: the b1
    step neither faster nor slower within its noise), not at 8 rows (the seven projections 67.3 -> 77.8 us: the
    last CTA adds 8 rows' partials alone) nor in the wgmma form (b32 / b128: 85.2 -> 97.5 / 103.8 -> 151.1 us;
    its tiles are 32-128 rows). None also when the weight has no counters yet and a CUDA graph is being
    captured (an allocation there would belong to the graph's pool), or too few for this launch. They are int32
    zeros kept on the weight, made at its first serial launch for 16 row tiles of x by its rows' tiles
    (`rows_per_cta`) and never replaced (a captured graph keeps their address); the kernel leaves them zero.
    One weight's launches must not run concurrently on two streams (each layer's projection runs once a step)."""
    from deepinfer import env

    wanted = (config or {}).get("SERIAL")
    if split <= 1 or wanted is False or not (wanted or (by_default and env.linear_serial_split())):
        return None
    counters = w._split_counters
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(tiles, SERIAL_COUNTER_ROW_TILES * cdiv(w.out_features, rows_per_cta))
        counters = w._split_counters = torch.zeros(size, dtype=torch.int32, device=device)
    if counters.numel() < tiles or counters.device != device:
        return None
    return counters


CLUSTER_MAX_SPLIT = 4  # the most split CTAs a tile adds up as one cluster by default (`use_cluster`)


def use_cluster(split: int, config: dict | None, fits) -> bool:
    """Whether the mma.sync kernel adds its split-K partials inside the kernel, its split CTAs one thread-block
    cluster: 2..CLUSTER_MAX_SPLIT splits (config CLUSTER True: any), not turned off (config CLUSTER False or
    DEEPINFER_LINEAR_CLUSTER_SPLIT=0), and `fits()` (the driver says such a cluster can be resident; asked last,
    once per launch shape). The rule is where both Hopper parts measured it faster (2026-12-05,
    bench_linear_sync.py --variants 'split sum,cluster sum', V4-Flash's decode shapes at M=1): wq_b's 2 splits
    15.0 -> 12.8 us on the H200 and 18.2 -> 17.2 on the H100, the indexer's wq_b's 4 splits 6.5 -> 6.0 and
    7.0 -> 7.0; 8 splits (shared w2) 6.7 -> 6.1 but 7.2 -> 7.5, and 16 (wq_a, wo_b, ...) faster on the H200 only
    in launches of <= 256 CTAs and slower on the H100 in every one (wo_b 18.9 -> 21.5)."""
    from deepinfer import env

    wanted = (config or {}).get("CLUSTER")
    if split <= 1 or wanted is False or not (wanted or env.linear_cluster_split()):
        return False
    if wanted is None and split > CLUSTER_MAX_SPLIT:
        return False
    return fits()


def _partials_then_sum(launch, split: int, out: torch.Tensor, counters: torch.Tensor | None = None,
                       unsummed: bool = False) -> "torch.Tensor | SplitK":
    """`launch(dest)` straight into out (bf16 [M, N]) when split is 1, else into fp32 partials [split, M, N]
    that `_split_sum_kernel` adds in a fixed order into out (the CUDA forms' split-K, like the Triton ones');
    with `counters` (`serial_counters`) `launch(partials, fin=out, counters=counters)` adds them itself, in
    the tile's last split CTA (serial split-K: the same bits, one launch); `unsummed`: the partials returned
    as a SplitK instead of summed (op "fp8_linear_unsummed")."""
    if split == 1:
        return launch(out)
    m, n = out.shape
    part = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    if counters is not None:
        launch(part, fin=out, counters=counters)
        return out
    launch(part)
    return SplitK(part) if unsummed else split_sum(part, out)


def _wgmma_usable(w: QuantLinearWeight, device: torch.device) -> bool:
    """The wgmma CUDA kernel can run this weight here (sm_90 with NVRTC; `fp8_linear_wgmma.usable_weight`)."""
    if device.type != "cuda":
        return False
    from deepinfer.kernels.cuda import fp8_linear_wgmma as wg

    return wg.usable(device) and wg.usable_weight(w)


def _fp8_linear_wgmma(x: torch.Tensor, w: QuantLinearWeight, config: dict | None, out: torch.Tensor,
                      unsummed: bool = False) -> "torch.Tensor | SplitK":
    """fp8_linear through the wgmma CUDA kernel: one act_quant pass into its operand order, the GEMM (fp32
    partials and `_split_sum_kernel` when it splits K: the same fixed-order sum as every form)."""
    from deepinfer.kernels.cuda import fp8_linear_wgmma as wg
    from deepinfer.kernels.triton.act_quant import act_quant_wgmma

    if (config or {}).get("DIAG"):
        raise ValueError("fp8_linear wgmma form: DIAG is a benchmark diagnostic (parts of the kernel alone, garbage "
                         "out: benchmarks/bench_linear_wgmma_parts.py), not a plan the op runs")
    m, k = x.shape
    cfg = wg.plan(m, w.out_features, k, sm_count(x.device), config)
    a = act_quant_wgmma(x, w.act_block)
    split = cfg["SPLIT_K"]
    counters = serial_counters(w, split, wg.tile_count(m, w.out_features, cfg), wg.rows_per_cta(cfg), config,
                               x.device)
    return _partials_then_sum(lambda dest, **serial: wg.fp8_linear_partials(a, w, dest, cfg, **serial), split,
                              out, counters, unsummed)


def _prefill_linear_form() -> str:
    from deepinfer import env

    choice = env.linear_prefill_kernel()
    return PREFILL_LINEAR_FORM if choice == "auto" else choice


def _prefill_usable(w: QuantLinearWeight, out: torch.Tensor) -> bool:
    """The prefill CUDA kernel can run this weight into out here (sm_90 with NVRTC, V4's 128-blocks, whole
    tiles, 16-byte aligned output rows: `fp8_linear_prefill.usable_weight`)."""
    if out.device.type != "cuda" or out.stride(0) % 8 or out.data_ptr() % 16:
        return False
    from deepinfer.kernels.cuda import fp8_linear_prefill as pf

    return pf.usable(out.device) and pf.usable_weight(w)


def _fp8_linear_prefill(x: torch.Tensor, w: QuantLinearWeight, config: dict | None, out: torch.Tensor) -> torch.Tensor:
    """fp8_linear through the prefill CUDA kernel: one act_quant pass (codes and scales, as the "fp8" form's
    unfused path), then the GEMM straight into out (no split-K: from FP8_MMA_MIN_M rows the tiles fill the GPU)."""
    from deepinfer.kernels.cuda import fp8_linear_prefill as pf

    cfg = pf.tiles(config)
    xq, xs = act_quant(x, w.act_block)
    return pf.fp8_linear_prefill(xq, xs, w, out, cfg, sm_count(x.device))


def _batch_form() -> str:
    from deepinfer import env

    return env.linear_batch_form()


def _decode_linear_form() -> str:
    from deepinfer import env

    choice = env.linear_decode_kernel()
    return DECODE_LINEAR_FORM if choice == "auto" else choice


def auto_form(m: int, n: int, k: int, block: int = 128) -> str:
    """The Triton tensor-core form mma="auto" takes for M rows of an N x K weight of `block`-wide scale
    blocks: "fp8" from FP8_MMA_MIN_M rows for FP8_MMA_BLOCKS (V4's 128; V4.1's 32 stay "bf16", see
    FP8_MMA_BLOCKS), "swap" where its sweep measured it faster (`fp8_linear_swap.takes`: 17..256 rows, large
    weights; DEEPINFER_LINEAR_BATCH_FORM=bf16 turns it off), else "bf16". (Where the wgmma CUDA kernel can
    run, `fp8_linear` takes it first for WGMMA_MIN_M..WGMMA_MAX_M rows.)"""
    if m >= FP8_MMA_MIN_M:
        return "fp8" if block in FP8_MMA_BLOCKS else "bf16"
    return "swap" if swap.takes(m, n, k) and _batch_form() in ("auto", "swap") else "bf16"


def fp8_linear(x: torch.Tensor, w: QuantLinearWeight, config: dict | None = None, mma: str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Op "fp8_linear" (`_fp8_linear`'s docstring)."""
    return _fp8_linear(x, w, config, mma, out)


def fp8_linear_unsummed(x: torch.Tensor, w: QuantLinearWeight, config: dict | None = None,
                        mma: str | None = None) -> "torch.Tensor | SplitK":
    """Op "fp8_linear_unsummed": `fp8_linear`, except that where a form would add its split-K partials in
    `_split_sum_kernel` they come back as a `SplitK` (the same bits once added: kernels/split_k.py) for the
    consumer kernel to add; a bf16 tensor where the form adds them itself or does not split. The torch twin
    (CPU) is fp8_linear's."""
    return _fp8_linear(x, w, config, mma, None, unsummed=True)


def _fp8_linear(x: torch.Tensor, w: QuantLinearWeight, config: dict | None = None, mma: str | None = None,
                out: torch.Tensor | None = None, unsummed: bool = False) -> "torch.Tensor | SplitK":
    """Op "fp8_linear" on CUDA tensors; CPU tensors go to the torch twin (or, under TRITON_INTERPRET=1,
    through the kernels in Triton's interpreter, for tests at tiny shapes). config: launch override (the
    benchmark's sweep; see `plan`, or for "sync" kernels/cuda/fp8_linear_mma.plan). mma: "bf16" (exact
    products), "fp8" (FP8 tensor cores), "sync" (the mma.sync CUDA kernel: exact products, act_quant fused;
    its regime is M <= SYNC_MAX_M), "swap", "wgmma" (the TMA-fed CUDA kernel: exact products; its regime is
    WGMMA_MIN_M..WGMMA_MAX_M) or "auto" (by M: "sync" up to SYNC_MAX_M where it can run and
    DEEPINFER_LINEAR_DECODE_KERNEL / DECODE_LINEAR_FORM say so, "wgmma" for WGMMA_MIN_M..WGMMA_MAX_M where it
    can run and DEEPINFER_LINEAR_BATCH_FORM says so, "fp8" from FP8_MMA_MIN_M, there the "fp8_wgmma" CUDA kernel
    where it can run and PREFILL_LINEAR_FORM / DEEPINFER_LINEAR_PREFILL_KERNEL say so); None: `MMA`.
    out: optional bf16 [M, N] destination (tests poison it to check every element is written)."""
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
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"fp8_linear: out must be bf16 [{m}, {n}] on {x.device} with unit column stride")
    if m == 0:
        return out
    mma = mma or MMA
    if mma == "fp8_wgmma" or (mma == "auto" and m >= FP8_MMA_MIN_M and _prefill_linear_form() == "wgmma"
                              and _prefill_usable(w, out)):
        return _fp8_linear_prefill(x, w, config, out)
    if mma == "sync" or (mma == "auto" and m <= SYNC_MAX_M and _decode_linear_form() == "mma"
                         and _sync_usable(w, x.device)):
        return _fp8_linear_sync(x, w, config, out, unsummed)
    if mma == "wgmma" or (mma == "auto" and WGMMA_MIN_M <= m <= WGMMA_MAX_M and _batch_form() == "auto"
                          and _wgmma_usable(w, x.device)):
        return _fp8_linear_wgmma(x, w, config, out, unsummed)
    if mma == "auto":
        mma = auto_form(m, n, k, w.block)
    cfg = plan(m, n, k, w.block, w.act_block, mma, sm_count(x.device), config)
    split, kb = cfg.pop("SPLIT_K"), cfg.pop("KB")
    dest = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    stride_os = dest.stride(0) if split > 1 else 0
    stride_om = dest.stride(1) if split > 1 else out.stride(0)
    fused = bool(cfg.pop("FUSED_ACT", m <= FUSED_ACT_MAX_M))
    if mma == "swap":
        if not fused:
            x = act_quant_dequant_bf16(x, w.act_block)  # quantise once, not in each weight tile's program
        swap.launch(x, w, dest, stride_om, stride_os, m, n, k, kb, split, fused, cfg)
    elif mma == "fp8":
        grid = (cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"]), split)
        cfg.pop("BK")
        if fused:
            xq, xs = x, x  # xs unused
        else:
            xq, xs = act_quant(x, w.act_block)
        bn = cfg["BN"]
        _fp8_linear_mma_kernel[grid](
            xq, xs, w.data, w.scale, dest, m, n, xq.stride(0), xs.stride(0) if not fused else 0, w.data.stride(0),
            w.scale.stride(0), stride_om, stride_os, K=k, WBLOCK=w.block, G=w.act_block, BK=kb, A_FUSED=fused,
            K_SPLIT=k // split, SPLIT_OUT=split > 1, W_UNIFORM=bn <= w.block and w.block % bn == 0,
            LOOP_STAGES=cfg.pop("LOOP_STAGES", None), WARP_SPECIALIZE=cfg.pop("WARP_SPECIALIZE", False), **cfg)
    else:
        grid = (cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"]), split)
        if not fused:
            x = act_quant_dequant_bf16(x, w.act_block)  # quantise once, not in each N tile's program
        _fp8_linear_kernel[grid](x, w.data, w.scale, dest, m, n, x.stride(0), w.data.stride(0), w.scale.stride(0),
                                 stride_om, stride_os, K=k, WBLOCK=w.block, CHUNK=w.act_block, KB=kb,
                                 A_DEQUANT=not fused, K_SPLIT=k // split, SPLIT_OUT=split > 1, **cfg)
    if split > 1:
        return SplitK(dest) if unsummed else split_sum(dest, out)
    return out


REGISTRATIONS = {"fp8_linear": fp8_linear, "fp8_linear_unsummed": fp8_linear_unsummed}
