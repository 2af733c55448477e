"""Triton RMSNorm and the manifold-constrained hyper-connection (mHC) pieces, official numerics (fp32 math).

Owns:
* `rms_norm(x, weight, eps)`: registered under the torch op's name; fp32 math, result in the dtype torch
  would give (`result_type(x, weight)`), so the official path's `rms_norm(t.float(), w).to(bf16)` is unchanged;
  `rms_norm_bf16(x, weight, eps)` is that whole expression in one launch (bf16 in, bf16 out, the same bits);
  `head_rms_norm(x, eps)`: V4's per-head q norm, the official bf16 torch ops with their roundings in one launch.
* `hc_pre_fused(x, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps) -> (y, post, comb)`: everything
  `V4Block._hc_official` does before the sublayer, in two launches (split-K partials of the mix GEMM over
  blocks of tokens, then per token: partial sums, r-normalisation, Sinkhorn, collapse, bf16 round, RMSNorm,
  bf16 round). Its torch twin is
  `kernels.official_fused.hc_pre_fused`: exactly the sequence of torch ops the engine runs today. The mix
  GEMM runs on bf16 tensor cores with exact products (fn split in three bf16 parts); `mix_plan` is its
  launch geometry, which `hc_pre_fused(..., config=)` overrides (the benchmark's sweep).
* `hc_pre_deferred_fused(x, pre_mix, ...) -> (y, pre, post, comb)`: V4.1's hc_pre (the collapse takes the
  previous sublayer's pre; this one's is returned), the same two launches.
* `hc_post(f, residual, post, comb)`: registered under the torch op's name (fp32 result);
  `hc_post_fused(...)` writes the bf16 residual directly (the official path rounds right after).
float64 inputs (exact numerics on a GPU) fall back to the torch ops: these kernels compute in fp32.
Must not: be imported off CUDA (imports triton); know about layers or caches.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels import official, official_fused, torch_ops
from deepinfer.kernels.split_k import SplitK, summed
from deepinfer.kernels.triton import split_k_load
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.split_k_load import load_summed, pinned
from deepinfer.kernels.triton.pdl import pdl_enter

F32, BF16 = torch.float32, torch.bfloat16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fallback(*tensors: torch.Tensor | None) -> bool:
    """float64 anywhere: the caller wants exact numerics, which the torch ops give."""
    return any(t is not None and t.dtype == torch.float64 for t in tensors)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ---------------------------------------------------------------------------------------------- RMSNorm
@fast_launch
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, stride_x, stride_o,
                     HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r
    if HAS_WEIGHT:
        y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(op: str, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """`_rms_norm_kernel` over the rows of x [..., D] (any float dtype, read and upcast in the kernel) into a
    new tensor of `out_dtype` (the fp32 result rounded there by the kernel's store)."""
    D = x.shape[-1]
    _need(weight is None or tuple(weight.shape) == (D,), f"{op}: weight "
          f"{tuple(weight.shape) if weight is not None else None} does not match the last dim {D} of x {tuple(x.shape)}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        block = next_power_of_2(D)
        w = weight.contiguous() if weight is not None else x2  # never read without HAS_WEIGHT
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, D, float(eps), x2.stride(0), out.stride(0),
                                         HAS_WEIGHT=weight is not None, BLOCK_D=block,
                                         num_warps=max(1, min(16, block // 256)))
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, fp32 math (weight None: parameter-free)."""
    if _fallback(x, weight):
        return torch_ops.rms_norm(x, weight, eps)
    return _rms_norm_launch("rms_norm", x, weight, eps, x.dtype if weight is None else torch.result_type(x, weight))


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`official.rms_norm_bf16` in one launch instead of three (upcast, norm, cast): the bf16 x read and
    upcast in the kernel (exact), fp32 math, the result rounded to bf16 in the kernel. The official rounding
    points, but NOT the bits of `rms_norm(x.to(fp32), w, eps).to(bf16)` on cuda: the kernel's layout, and
    so the order of its fp32 sum of squares, follows the input's vector width, so bf16 and fp32 inputs sum in
    different orders (H200, 2026-12-01: 1 of 8 test shapes differed in last bits, with the output rounded
    either in the kernel or by torch). tests/test_kernels_rope_table.py bounds it at 1 bf16 ulp."""
    if _fallback(x, weight) or x.dtype != BF16:
        return official.rms_norm_bf16(x, weight, eps)
    return _rms_norm_launch("rms_norm_bf16", x, weight, eps, BF16)


@fast_launch
@triton.jit
def _head_rms_norm_kernel(x_ptr, out_ptr, n_rows, D, eps, stride_x, stride_o,
                          ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """The bf16 torch ops `x * rsqrt(x.square().mean(-1) + eps)` with each op's bf16 rounding: the square
    rounded per element, its fp32 sum times 1/D (torch's mean: fp32 accumulation, the factor 1/D) rounded,
    + eps rounded, rsqrt (fp32 rsqrt.approx, as torch's) rounded, the product rounded."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = head_rms_factor(x, D, eps)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (x * r[:, None]).to(tl.bfloat16), mask=m)


@triton.jit
def head_rms_factor(x, D, eps):
    """The per-row factor of V4's per-head q norm for x [rows, BLOCK_D] fp32 (bf16 values, zeros past D):
    the bf16 torch ops' roundings, the square per element, the fp32 sum times 1/D, + eps, rsqrt, each rounded
    to bf16 -> [rows] fp32 (the caller multiplies and rounds). Shared with attn_norm_rope's fused kernel."""
    sq = (x * x).to(tl.bfloat16).to(tl.float32)
    mean = (tl.sum(sq, axis=1) * (1.0 / D)).to(tl.bfloat16).to(tl.float32)
    v = (mean + eps).to(tl.bfloat16).to(tl.float32)
    return tl.math.rsqrt(v).to(tl.bfloat16).to(tl.float32)


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Op "head_rms_norm" (V4's parameter-free per-head q norm, which the official model runs as bf16 torch
    ops on the bf16 q): one launch instead of five (square, mean, add, rsqrt, mul; 4.4 ms of an 8k prefill's
    q [8192, 64, 512] on the H200; 258 us each in one). The same rounding points as the twin on a bf16 x;
    the bits differ only where the fp32 sum of squares, summed in another order, rounds to another bf16
    mean (then the row's bf16 rsqrt moves by an ulp, its outputs by one or two)."""
    if x.dtype != BF16 or (not x.is_cuda and not _interpreting()):
        return torch_ops.head_rms_norm(x, eps)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=BF16, device=x.device)
    n = x2.shape[0]
    if n:
        block = next_power_of_2(D)
        rows = max(1, min(8, 4096 // block))
        _head_rms_norm_kernel[(cdiv(n, rows),)](x2, out, n, D, float(eps), x2.stride(0), out.stride(0),
                                                       ROWS=rows, BLOCK_D=block, num_warps=4)
    return out.view(x.shape)


# ---------------------------------------------------------------------------------------------- hc_pre
@triton.jit
def _bf16_split3(w):
    """fp32 w -> bf16 (hi, mid, lo) with hi + mid + lo == w exactly, so three bf16 MMAs give fp32 products.
    Why exact: hi = bf16(w) keeps w's top 8 significand bits (rounded); r = w - hi, a rounding error, is a
    multiple of ulp(w) no larger than half an ulp of hi: at most 16 significant bits, exact in fp32. mid =
    bf16(r) takes its top 8 and r - mid (exact again) keeps at most the last 8, which bf16 holds: 24 = 3 x 8.
    Needs |w| below bf16's max (3.39e38, else hi is inf) and >= 2^-103 (ulp(w) >= 2^-126: no part subnormal,
    which the GPU would flush); fn's weights (~1e-2) are far from both."""
    hi = w.to(tl.bfloat16)
    r = w - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _mix_dots(x, w, acc, INTERPRET: tl.constexpr):
    """acc += x @ w with fp32-matmul accuracy from bf16 tensor cores: w [BLOCK_K, BLOCK_O] fp32 in three exact
    bf16 parts (`_bf16_split3`), x [BLOCK_T, BLOCK_K] bf16, every product exact."""
    hi, mid, lo = _bf16_split3(w)
    if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; fp32 operands give the same exact products
        xf = x.to(tl.float32)
        acc = tl.dot(xf, hi.to(tl.float32), acc)
        acc = tl.dot(xf, mid.to(tl.float32), acc)
        acc = tl.dot(xf, lo.to(tl.float32), acc)
    else:
        acc = tl.dot(x, hi, acc)
        acc = tl.dot(x, mid, acc)
        acc = tl.dot(x, lo, acc)
    return acc


@fast_launch
@triton.jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, ssq_ptr, T, KD, n_out, k_chunk,
                           BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                           INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Split-K partials of x[t] @ fn.T and of sum(x[t]^2) over the columns [split*k_chunk, +k_chunk) of the
    flattened hc streams x [T, KD] bf16 (fn [n_out, KD] fp32): part [splits, T, n_out], ssq [splits, T].
    fp32-matmul accuracy from bf16 tensor cores: x is bf16 already and fn goes in as three bf16 parts
    (`_bf16_split3`), so every product x*part is exact (8 x 8 significand bits) and x*hi + x*mid + x*lo is
    x*fn; only the fp32 accumulation's order and rounding differ from an fp32 GEMM. Replaces an fp32 upcast
    of x and tf32x3 dots (H200, T=8192, D=4096: ~380 us, latency-bound, where the HBM read of x is ~64 us)."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    outs = tl.arange(0, BLOCK_O)
    omask = outs < n_out
    acc = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)  # x^2 per column slot: one cross-thread sum, after the loop
    k_lo = split * k_chunk
    for k0 in range(0, k_chunk, BLOCK_K):
        ks = k_lo + k0 + tl.arange(0, BLOCK_K)
        kmask = ks < KD
        x = tl.load(x_ptr + toks.to(tl.int64)[:, None] * KD + ks[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(fn_ptr + outs[None, :] * KD + ks[:, None], mask=kmask[:, None] & omask[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += xf * xf
        acc = _mix_dots(x, w, acc, INTERPRET)  # w [BLOCK_K, BLOCK_O]: fn's tile transposed
    base = split.to(tl.int64) * T
    tl.store(part_ptr + (base + toks)[:, None] * n_out + outs[None, :], acc, mask=tmask[:, None] & omask[None, :])
    tl.store(ssq_ptr + base + toks, tl.sum(sq, axis=1), mask=tmask)


@fast_launch
@triton.jit
def _hc_sinkhorn_collapse_kernel(part_ptr, ssq_ptr, scale_ptr, base_ptr, x_ptr, nw_ptr, y_ptr, post_ptr, comb_ptr,
                                 pre_in_ptr, pre_out_ptr, T, D, splits, iters, hc_eps, norm_eps,
                                 HC: tl.constexpr, BLOCK_D: tl.constexpr, SP: tl.constexpr, HEAD: tl.constexpr,
                                 DEFERRED: tl.constexpr, PDL: tl.constexpr = False):
    """One token, in two programs (grid (T, 2); (T, 1) for HEAD): both sum the split-K partials they need
    and r-normalise them; program 0 collapses the token's hc streams with the pre weights, rounds to bf16,
    RMSNorms and rounds again (y); program 1 runs the Sinkhorn split (post, comb), which y does not need.
    One program did both one after the other until 2026-12-05: at decode the Sinkhorn's chain of 2 x iters
    dependent reductions and the collapse's stream loads were the two halves of a ~7 us critical path.
    The partials of all splits are loaded at once ([SP, ...], SP the splits' power of two) and summed as a
    tree (deterministic: a fixed order). (Tried 2026-12-02: loading the streams first, to overlap their
    latency with the Sinkhorn chain in one program: H200 8k prefill 152 -> 197 us per call, decode b1 8.1 ->
    9.2 us; reverted.) HEAD: the model head's collapse (`hc_head_fused`): the mixes are the HC pre weights
    alone, no post, comb or Sinkhorn. DEFERRED (V4.1's deferred pre, `hc_pre_deferred_fused`): program 0 stores
    the pre weights it computes (pre_out [T, HC]) and collapses with the given ones (pre_in [T, HC] fp32)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    if HEAD:
        n_mix = HC
    else:
        n_mix = (2 + HC) * HC
    j = tl.arange(0, HC)
    sp = tl.arange(0, SP)
    live = sp < splits
    row = (sp.to(tl.int64) * T + t) * n_mix  # [SP]
    ssq = tl.sum(tl.load(ssq_ptr + sp.to(tl.int64) * T + t, mask=live, other=0.0), axis=0)
    r = 1.0 / tl.sqrt(ssq / (HC * D) + norm_eps)  # rsqrt(mean over all hc*D values), applied after the matmul
    if tl.program_id(1) == 0:
        m_pre = tl.sum(tl.load(part_ptr + row[:, None] + j[None, :], mask=live[:, None], other=0.0), axis=0)
        pre = tl.sigmoid(m_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + j)) + hc_eps
        if DEFERRED:  # this sublayer's pre goes to the next sublayer; the collapse takes the previous one's
            tl.store(pre_out_ptr + t * HC + j, pre)
            pre = tl.load(pre_in_ptr + t * HC + j)
        cols = tl.arange(0, BLOCK_D)
        dmask = cols < D
        x = tl.load(x_ptr + t * HC * D + j[:, None] * D + cols[None, :], mask=dmask[None, :],
                    other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * x, axis=0)
        y = y.to(tl.bfloat16).to(tl.float32)  # the collapse is rounded to bf16 before the norm
        rn = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / D + norm_eps)
        y = tl.load(nw_ptr + cols, mask=dmask, other=0.0) * (y * rn)
        tl.store(y_ptr + t * D + cols, y.to(tl.bfloat16), mask=dmask)
    elif not HEAD:
        cidx = 2 * HC + j[:, None] * HC + j[None, :]  # comb[j, k], row-major
        m_post = tl.sum(tl.load(part_ptr + row[:, None] + HC + j[None, :], mask=live[:, None], other=0.0), axis=0)
        m_comb = tl.sum(tl.load(part_ptr + row[:, None, None] + cidx[None, :, :], mask=live[:, None, None],
                                other=0.0), axis=0)
        post = 2.0 * tl.sigmoid(m_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + j))
        c = m_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + hc_eps
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)  # the first pass normalises columns only
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + t * HC + j, post)
        tl.store(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], c)


@fast_launch
@triton.jit
def _hc_post_mix_partial_kernel(f_ptr, r_ptr, post_ptr, comb_ptr, x_ptr, fn_ptr, part_ptr, ssq_ptr, T, D, KD,
                                n_out, k_chunk, stride_f, stride_fs, FS: tl.constexpr, HC: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                                INTERPRET: tl.constexpr, PIN_F: tl.constexpr = False,
                                PDL: tl.constexpr = False):
    """`_hc_mix_partial_kernel` whose x is made here: the previous sublayer's hc_post (`_hc_post_kernel`'s
    arithmetic, post_k * f + sum over j of comb[j, k] * r_j in fp32, rounded to bf16) of the columns this
    program reads, stored into x [T, HC * D] (every column by exactly one program) and used for the partials.
    A step of BLOCK_K columns lies in one stream k (D % BLOCK_K == 0, checked by the launcher). FS > 1: f is
    the sublayer's fp32 split-K partials (stride_fs apart), added in order and rounded to bf16 on the load
    (`split_k_load.load_summed`: the split-sum kernel's bits)."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    t64 = toks.to(tl.int64)
    outs = tl.arange(0, BLOCK_O)
    omask = outs < n_out
    acc = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
    sq = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    k_lo = split * k_chunk
    for k0 in range(0, k_chunk, BLOCK_K):
        c0 = k_lo + k0
        ks = c0 + tl.arange(0, BLOCK_K)
        kmask = ks < KD
        stream = c0 // D  # this step's output stream k
        dd = ks - stream * D
        m2 = tmask[:, None] & kmask[None, :]
        if FS > 1:
            f = load_summed(f_ptr + t64[:, None] * stride_f + dd[None, :], m2, FS, stride_fs)
        else:  # bf16 f, made contiguous by the launcher: rows D apart (the build before the partials, to the byte)
            f = load_summed(f_ptr + t64[:, None] * D + dd[None, :], m2, FS, stride_fs)
        if FS > 1 or PIN_F:
            f = pinned(f, INTERPRET)  # one layout conversion of the sum, not one per partial
        live = tmask & (c0 < KD)
        post = tl.load(post_ptr + t64 * HC + stream, mask=live, other=0.0)
        # sum over j in ascending order, one stream's [BLOCK_T, BLOCK_K] tile at a time (a [HC, ...] tile of
        # all four spills at 16 x 128)
        mixed = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        for jj in tl.static_range(HC):
            r = tl.load(r_ptr + t64[:, None] * (HC * D) + jj * D + dd[None, :], mask=m2, other=0.0).to(tl.float32)
            c = tl.load(comb_ptr + t64 * (HC * HC) + jj * HC + stream, mask=live, other=0.0)  # comb[t, j, k]
            mixed += c[:, None] * r
        x = (post[:, None] * f + mixed).to(tl.bfloat16)
        tl.store(x_ptr + t64[:, None] * KD + ks[None, :], x, mask=m2)
        w = tl.load(fn_ptr + outs[None, :] * KD + ks[:, None], mask=kmask[:, None] & omask[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += xf * xf
        acc = _mix_dots(x, w, acc, INTERPRET)  # w [BLOCK_K, BLOCK_O]: fn's tile transposed
    base = split.to(tl.int64) * T
    tl.store(part_ptr + (base + toks)[:, None] * n_out + outs[None, :], acc, mask=tmask[:, None] & omask[None, :])
    tl.store(ssq_ptr + base + toks, tl.sum(sq, axis=1), mask=tmask)


def _check_hc_pre(x, fn, scale, base, norm_weight, hc):
    _need(x.dim() == 3 and x.shape[1] == hc, f"hc_pre: x must be [T, hc={hc}, D], got {tuple(x.shape)}")
    D = x.shape[2]
    n_mix = (2 + hc) * hc
    _need(hc & (hc - 1) == 0, f"hc_pre: hc={hc} must be a power of two")
    _need(tuple(fn.shape) == (n_mix, hc * D), f"hc_pre: fn must be [{n_mix}, {hc * D}], got {tuple(fn.shape)}")
    _need(scale.numel() == 3 and base.numel() == n_mix,
          f"hc_pre: scale must have 3 values and base {n_mix}, got {scale.numel()} and {base.numel()}")
    _need(tuple(norm_weight.shape) == (D,), f"hc_pre: norm weight must be [{D}], got {tuple(norm_weight.shape)}")


_MIX_PROGRAMS = 264  # 2 programs per SM of the H200 (132 SMs)
COLLAPSE_WARPS = 4  # the Sinkhorn-collapse kernel's warps: H200 2026-12-02 (bench_attn_kernels.py --hc-mix, the
# whole hc_pre op, D=4096; results/hc_collapse_warps_h200_2026-12-02.log): T=1 13.9 us against 15.3 with one
# warp per 1024 of hc * D (16), T=8 14.4 vs 17.7, T=128 18.2 vs 21.2, T=8192 201 vs 254 (8 warps: about the same)
_MIX_KEYS = ("BLOCK_T", "BLOCK_K", "SPLITS", "num_warps", "num_stages", "COLLAPSE_WARPS", "PIN_F")


def mix_plan(T: int, KD: int, config: dict | None = None) -> dict:
    """Launch geometry of `_hc_mix_partial_kernel` for T tokens of KD = hc*D columns: BLOCK_T tokens per
    program, BLOCK_K columns per step, SPLITS programs along K (each K_CHUNK columns, a multiple of BLOCK_K;
    SPLITS is lowered so no split is empty), num_warps, num_stages; `config`'s keys on top (the GPU sweep in
    benchmarks/bench_attn_kernels.py). Defaults from that sweep on the H200 (2026-12-02, D=4096, timed as
    the whole hc_pre_fused op, results/hc_indexer_h200_2026-12-02_s3.log):
    * T <= 16 (decode): one block of 16 tokens (the smallest MMA), so the work is reading fn (24 x KD fp32,
      1.5 MB at D=4096) and split-K spreads it: 32 splits of 512 columns, 4 steps of 128, 4 loads in flight
      (num_stages 5; Triton keeps num_stages - 1 buffers). T=1: 15.4 us; 64 splits 16.4, 128 splits 21.7:
      the collapse kernel sums a token's splits one after the other, so more splits cost it more than they
      save the mix.
    * T <= 1024: 64 tokens (one warpgroup's MMA: M=64), 4 warps, BLOCK_K 128, 2 stages, 32 splits: T=128
      21.1 us (64 splits of 64-column steps 22.2, 128 splits 32.2).
    * larger: 128 tokens over 8 warps (two warpgroups), num_stages 4: three 24 KB buffers (x 128x64 bf16,
      fn 64x32 fp32), 84 KB of shared memory with the bf16 parts and 109 registers (sm_90 compile), two
      programs per SM; splits until ~2 programs per SM (T=8192: 64 token blocks x 4 splits). T=8192: mix
      103 us (2.65 TB/s of x; the tf32x3 kernel before it took ~380 us), the whole op 255 us; 2 or 8 splits,
      BLOCK_K 128 or 256 tokens per program measured no better.
    At least 128 columns per split (until 2026-12-05 at least 512, i.e. 32 splits at D=4096: with the
    collapse loading every split's partials at once, 128 splits of one 128-column step won on the H200,
    results/hc_mix_h200_2026-12-05_s18.log: the whole op at T=1 13.4 -> 8.9 us, T=8 13.6 -> 9.3, T=128
    17.4 -> 13.2; T=8192 keeps 4 splits, 8 measured slower). COLLAPSE_WARPS: the Sinkhorn-collapse kernel's warps (default
    `COLLAPSE_WARPS`; None: one per 1024 of hc * D, up to 16, the rule before 2026-12-02).
    Since those 128 splits make one 128-column step a program at T <= 16, a software pipeline has nothing to
    overlap: num_stages 1 (5 until 2026-12-07; benchmarks/bench_hc_post_pre.py --pre on an H100, the same bits:
    hc_pre_fused T=1 / 8 / 16 7.51 / 9.03 / 8.00 -> 7.03 / 8.73 / 7.58 us, hc_head_fused 7.14 / 7.64 / 8.39 ->
    6.90 / 7.45 / 8.06)."""
    if T <= 16:
        cfg = dict(BLOCK_T=16, BLOCK_K=128, num_warps=4, num_stages=1)
    elif T <= 1024:
        cfg = dict(BLOCK_T=64, BLOCK_K=128, num_warps=4, num_stages=2)
    else:
        cfg = dict(BLOCK_T=128, BLOCK_K=64, num_warps=8, num_stages=4)
    cfg["SPLITS"] = max(1, min(round(_MIX_PROGRAMS / cdiv(T, cfg["BLOCK_T"])), KD // 128))
    bad = sorted(set(config or {}) - set(_MIX_KEYS))
    _need(not bad, f"hc_pre: unknown config keys {bad}; known: {_MIX_KEYS}")
    cfg.update(config or {})
    for key in ("BLOCK_T", "BLOCK_K"):
        v = cfg[key]
        _need(v >= 16 and v & (v - 1) == 0, f"hc_pre: {key}={v} must be a power of two >= 16 (the MMA's minimum)")
    _need(cfg["SPLITS"] >= 1 and cfg["num_stages"] >= 1, f"hc_pre: SPLITS={cfg['SPLITS']} and "
          f"num_stages={cfg['num_stages']} must be >= 1")
    block_k = cfg["BLOCK_K"]
    cfg["K_CHUNK"] = cdiv(cdiv(KD, cfg["SPLITS"]), block_k) * block_k
    cfg["SPLITS"] = cdiv(KD, cfg["K_CHUNK"])
    cfg.setdefault("COLLAPSE_WARPS", COLLAPSE_WARPS)
    return cfg


def hc_mix_partials(x2: torch.Tensor, fn: torch.Tensor, plan: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`_hc_mix_partial_kernel` under `plan` (`mix_plan`): x2 [T, KD] bf16, fn [n_out, KD] ->
    part [splits, T, n_out], ssq [splits, T] fp32."""
    T, KD = x2.shape
    n_out = fn.shape[0]
    splits = plan["SPLITS"]
    part = torch.empty(splits, T, n_out, dtype=F32, device=x2.device)
    ssq = torch.empty(splits, T, dtype=F32, device=x2.device)
    _hc_mix_partial_kernel[(cdiv(T, plan["BLOCK_T"]), splits)](
        x2, fn.to(F32).contiguous(), part, ssq, T, KD, n_out, plan["K_CHUNK"],
        BLOCK_T=plan["BLOCK_T"], BLOCK_O=max(16, next_power_of_2(n_out)), BLOCK_K=plan["BLOCK_K"],
        INTERPRET=_interpreting(), num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    return part, ssq


def hc_pre_fused(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 norm_weight: torch.Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, D] bf16 residual streams -> y [T, D] bf16 (collapsed, normed sublayer input),
    post [T, hc] fp32, comb [T, hc, hc] fp32 (Sinkhorn-normalised; hc_post contracts its first index).
    config: the mix kernel's launch override (`mix_plan`)."""
    _check_hc_pre(x, fn, scale, base, norm_weight, hc)
    if _fallback(x, fn):
        return official_fused.hc_pre_fused(x, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps)
    y, _, post, comb = _hc_pre(x, None, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, config)
    return y, post, comb


def hc_pre_deferred_fused(x: torch.Tensor, pre_mix: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                          base: torch.Tensor, norm_weight: torch.Tensor, hc: int, iters: int, hc_eps: float,
                          norm_eps: float, config: dict | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Op "hc_pre_deferred_fused" (twin `official_fused.hc_pre_deferred_fused`): V4.1's hc_pre, which
    collapses with the previous sublayer's pre -> (y, pre, post, comb), in `hc_pre_fused`'s two launches where
    its separate ops were ~90 (the Sinkhorn's 2 x iters reductions one launch each)."""
    _check_hc_pre(x, fn, scale, base, norm_weight, hc)
    T = x.shape[0]
    _need(tuple(pre_mix.shape) == (T, hc), f"hc_pre_deferred: pre_mix must be [{T}, {hc}], got {tuple(pre_mix.shape)}")
    if _fallback(x, fn, pre_mix):
        return official_fused.hc_pre_deferred_fused(x, pre_mix, fn, scale, base, norm_weight, hc, iters, hc_eps,
                                                    norm_eps)
    return _hc_pre(x, pre_mix, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, config)


def _hc_pre(x, pre_mix, fn, scale, base, norm_weight, iters, hc_eps, norm_eps, config):
    """hc_pre_fused's and hc_pre_deferred_fused's outputs and launches -> (y, pre, post, comb); pre (the
    computed pre weights) only with a pre_mix to collapse with (deferred), else None."""
    _need(x.dtype == BF16, f"hc_pre: x must be bf16 (an MMA operand as it is) or float64 (the twin), got {x.dtype}")
    T, hc, D = x.shape
    x = x.contiguous()
    dev = x.device
    y = torch.empty(T, D, dtype=BF16, device=dev)
    pre = None if pre_mix is None else torch.empty(T, hc, dtype=F32, device=dev)
    post = torch.empty(T, hc, dtype=F32, device=dev)
    comb = torch.empty(T, hc, hc, dtype=F32, device=dev)
    if T:
        _mix_and_collapse(x, fn, scale, base, norm_weight, y, post, comb, iters, hc_eps, norm_eps, config,
                          deferred=None if pre_mix is None else (pre_mix.to(F32).contiguous(), pre))
    return y, pre, post, comb


def _mix_and_collapse(x, fn, scale, base, norm_weight, y, post, comb, iters, hc_eps, norm_eps, config,
                      head: bool = False, deferred: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The two launches of hc_pre_fused / hc_pre_deferred_fused / hc_head_fused: the split-K mix partials, then
    per token a collapse program into y and (unless `head`: the head has its pre weights only, and post / comb
    are never written then) a Sinkhorn program into post / comb (`_collapse`, deferred as there)."""
    T, hc, D = x.shape
    plan = mix_plan(T, hc * D, config)
    part, ssq = hc_mix_partials(x.view(T, hc * D), fn, plan)
    _collapse(part, ssq, plan, x, scale, base, norm_weight, y, post, comb, iters, hc_eps, norm_eps, head, deferred)


def _collapse(part, ssq, plan, x, scale, base, norm_weight, y, post, comb, iters, hc_eps, norm_eps,
              head: bool = False, deferred: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`_hc_sinkhorn_collapse_kernel` over the mix partials of `plan`: y (and, unless `head`, post / comb);
    deferred = (pre_in, pre_out): collapse with pre_in, store the computed pre into pre_out."""
    T, hc, D = x.shape
    block_d = next_power_of_2(D)
    pre_in, pre_out = deferred if deferred is not None else (post, post)  # (unread without DEFERRED)
    _hc_sinkhorn_collapse_kernel[(T, 1 if head else 2)](
        part, ssq, scale.to(F32).contiguous(), base.to(F32).contiguous(), x, norm_weight.to(F32).contiguous(),
        y, post, comb, pre_in, pre_out, T, D, plan["SPLITS"], int(iters), float(hc_eps), float(norm_eps),
        HC=hc, BLOCK_D=block_d, SP=max(2, next_power_of_2(plan["SPLITS"])), HEAD=head, DEFERRED=deferred is not None,
        num_warps=plan["COLLAPSE_WARPS"] or max(1, min(16, block_d * hc // 1024)))


POST_MIX_MAX_T = 16  # the fused mix kernel's tokens: the decode plan's one token block. Its larger plans'
# [64 | 128, 128] tiles spill in the sm_90 build (5 KB / 3.8 KB of stack a thread with hc_post's loads added;
# scripts/sass_sm90.py), and a prefill's launch count does not bound it: they take the two ops
POST_MIX_PLAN = dict(BLOCK_K=64, num_stages=1)  # and one step of 64 columns a program (SPLITS = hc * D / 64):
# the decode plan's 128-column step spills with hc_post's loads (704 B a thread at 4 warps, 56-96 B at 8);
# this one builds in 255 registers without (sm_90). The whole hc_pre op with 256 splits of 64 took 9.0 us at
# T=1 against 8.9 for 128 of 128 on the H200 (results/hc_mix_h200_2026-12-05_s18.log). One step a program:
# no pipeline (num_stages 2 until 2026-12-07; the whole op on an H100, the same bits: T=1 / 2 / 8 / 16
# 10.95 / 10.56 / 12.09 / 11.18 -> 8.83 / 8.99 / 10.67 / 11.24 us; num_warps 2, COLLAPSE_WARPS, SPLITS measured
# worse or mixed; the b1 step 1.068 -> 1.060 ms, b8 1.916 -> 1.908: results/bench_hc_post_pre_*_s35.log).
# DEEPINFER_HC_POST_MIX overrides its keys for A/B runs (env.hc_post_mix_plan)


def hc_post_pre_fused(f: "torch.Tensor | SplitK", residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor, hc: int,
                      iters: int, hc_eps: float, norm_eps: float,
                      config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Op "hc_post_pre_fused" (twin `official_fused.hc_post_pre_fused`): one sublayer's hc_post and the next
    sublayer's hc_pre -> (x [T, hc, D] bf16 the new residual streams, y, post, comb as `hc_pre_fused`). Two
    launches where there were three at decode (up to POST_MIX_MAX_T tokens): the mix kernel makes the columns
    of x it reads (`_hc_post_mix_partial_kernel`) instead of a separate hc_post pass writing them first. f may
    be a `SplitK` (the attention's wo_b from op "fp8_linear_unsummed"): that kernel adds its partials on its
    loads (the split-sum kernel's bits); the other paths sum them first."""
    if _fallback(f, residual, post, comb):
        return official_fused.hc_post_pre_fused(summed(f), residual, post, comb, fn, scale, base, norm_weight, hc,
                                                iters, hc_eps, norm_eps)
    T, hc_r, D = residual.shape if residual.dim() == 3 else (0, 0, 0)
    plan = mix_plan(T, hc * D, {**POST_MIX_PLAN, "SPLITS": max(1, hc * D // 64), **env.hc_post_mix_plan(),
                                **(config or {})}) if T else None
    if (not env.attn_fusions_enabled() or residual.dtype != BF16 or f.dtype != BF16 or hc_r != hc or not T
            or T > POST_MIX_MAX_T or D % plan["BLOCK_K"] or tuple(f.shape) != (T, D)):  # the two ops in turn
        x = hc_post_fused(summed(f), residual, post, comb)
        return (x,) + tuple(hc_pre_fused(x, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps, config))
    _need(tuple(post.shape) == (T, hc) and tuple(comb.shape) == (T, hc, hc),
          f"hc_post_pre: want post [{T}, {hc}] and comb [{T}, {hc}, {hc}], got {tuple(post.shape)}, {tuple(comb.shape)}")
    _check_hc_pre(residual, fn, scale, base, norm_weight, hc)
    dev = residual.device
    x = torch.empty(T, hc, D, dtype=BF16, device=dev)
    y = torch.empty(T, D, dtype=BF16, device=dev)
    post2 = torch.empty(T, hc, dtype=F32, device=dev)
    comb2 = torch.empty(T, hc, hc, dtype=F32, device=dev)
    KD, n_out, splits = hc * D, fn.shape[0], plan["SPLITS"]
    part = torch.empty(splits, T, n_out, dtype=F32, device=dev)
    ssq = torch.empty(splits, T, dtype=F32, device=dev)
    f_op, fs, stride_fs, stride_f = split_k_load.operand(f if isinstance(f, SplitK) else f.contiguous())
    _hc_post_mix_partial_kernel[(cdiv(T, plan["BLOCK_T"]), splits)](
        f_op, residual.contiguous(), post.to(F32).contiguous(), comb.to(F32).contiguous(), x,
        fn.to(F32).contiguous(), part, ssq, T, D, KD, n_out, plan["K_CHUNK"], stride_f, stride_fs, FS=fs, HC=hc,
        BLOCK_T=plan["BLOCK_T"], BLOCK_O=max(16, next_power_of_2(n_out)), BLOCK_K=plan["BLOCK_K"],
        INTERPRET=_interpreting(),
        PIN_F=bool(plan.get("PIN_F", 0)), num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    _collapse(part, ssq, plan, x, scale, base, norm_weight, y, post2, comb2, iters, hc_eps, norm_eps)
    return x, y, post2, comb2


def hc_head_fused(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                  norm_weight: torch.Tensor, hc_eps: float, norm_eps: float,
                  config: dict | None = None) -> torch.Tensor:
    """The model head's collapse and final norm: x [N, hc, D] bf16 -> y [N, D] bf16 (twin:
    `official_fused.hc_head_fused`), the two launches of `hc_pre_fused` with the head's hc mixes (fn [hc,
    hc*D]: pre weights only) instead of ~12 torch launches (an fp32 upcast, an fp32 SIMT GEMM, ...)."""
    _need(x.dim() == 3 and tuple(fn.shape) == (x.shape[1], x.shape[1] * x.shape[2]),
          f"hc_head: want x [N, hc, D] and fn [hc, hc*D], got {tuple(x.shape)} and {tuple(fn.shape)}")
    hc, D = x.shape[1], x.shape[2]
    _need(hc & (hc - 1) == 0, f"hc_head: hc={hc} must be a power of two")
    _need(scale.numel() == 1 and base.numel() == hc and tuple(norm_weight.shape) == (D,),
          f"hc_head: want scale [1], base [{hc}], norm weight [{D}], got {tuple(scale.shape)}, "
          f"{tuple(base.shape)}, {tuple(norm_weight.shape)}")
    _need(x.dtype == BF16, f"hc_head: x must be bf16 (fast numerics' residual streams), got {x.dtype}")
    T = x.shape[0]
    x = x.contiguous()
    y = torch.empty(T, D, dtype=BF16, device=x.device)
    if T == 0:
        return y
    _mix_and_collapse(x, fn, scale, base, norm_weight, y, y, y, 0, hc_eps, norm_eps, config, head=True)
    return y


# ---------------------------------------------------------------------------------------------- hc_post
@fast_launch
@triton.jit
def _hc_post_kernel(f_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[t, k] = post[t, k] * f[t] + sum_j comb[t, j, k] * r[t, j] (fp32 math, stored in out's dtype)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = cols < D
    j = tl.arange(0, HC)
    f = tl.load(f_ptr + t * D + cols, mask=dmask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + t * HC * D + j[:, None] * D + cols[None, :], mask=dmask[None, :], other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * HC + j)
    comb = tl.load(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :])  # [j, k]
    mixed = tl.sum(comb[:, :, None] * r[:, None, :], axis=0)  # [k, BLOCK_D]
    out = post[:, None] * f[None, :] + mixed
    tl.store(out_ptr + t * HC * D + j[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=dmask[None, :])


def _hc_post(f, residual, post, comb, out_dtype):
    _need(residual.dim() == 3 and f.dim() == 2 and f.shape[0] == residual.shape[0] and f.shape[1] == residual.shape[2],
          f"hc_post: want f [T, D] and residual [T, hc, D], got {tuple(f.shape)} and {tuple(residual.shape)}")
    T, hc, D = residual.shape
    _need(hc & (hc - 1) == 0, f"hc_post: hc={hc} must be a power of two")
    _need(tuple(post.shape) == (T, hc) and tuple(comb.shape) == (T, hc, hc),
          f"hc_post: want post [{T}, {hc}] and comb [{T}, {hc}, {hc}], got {tuple(post.shape)}, {tuple(comb.shape)}")
    out = torch.empty(T, hc, D, dtype=out_dtype, device=residual.device)
    if T:
        block_d = min(1024, next_power_of_2(D))
        _hc_post_kernel[(T, cdiv(D, block_d))](
            f.contiguous(), residual.contiguous(), post.to(F32).contiguous(), comb.to(F32).contiguous(), out, D,
            HC=hc, BLOCK_D=block_d, num_warps=4)
    return out


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same contract as `torch_ops.hc_post` (result dtype = torch's promotion of the inputs)."""
    if _fallback(f, residual, post, comb):
        return torch_ops.hc_post(f, residual, post, comb)
    dtype = torch.promote_types(torch.promote_types(f.dtype, residual.dtype), torch.promote_types(post.dtype, comb.dtype))
    return _hc_post(f, residual, post, comb, dtype)


def hc_post_fused(f: "torch.Tensor | SplitK", residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """hc_post rounded once to bf16, as the official block does: f [T, D] (bf16 sublayer output, read as fp32;
    a SplitK is summed first), residual [T, hc, D] bf16 -> [T, hc, D] bf16."""
    return _hc_post(summed(f), residual, post, comb, BF16)


REGISTRATIONS = {
    "rms_norm": rms_norm,
    "rms_norm_bf16": rms_norm_bf16,
    "head_rms_norm": head_rms_norm,
    "hc_pre_fused": hc_pre_fused,
    "hc_pre_deferred_fused": hc_pre_deferred_fused,
    "hc_head_fused": hc_head_fused,
    "hc_post": hc_post,
    "hc_post_fused": hc_post_fused,
    "hc_post_pre_fused": hc_post_pre_fused,
}
