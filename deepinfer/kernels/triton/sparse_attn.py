"""Triton sparse attention with the sink: the CUDA twin of `kernels.official.sparse_attn_sink_official`.

Owns: one kernel that, for each (query token, block of heads), gathers the kv rows its index row names,
runs the official online softmax over blocks of 64 indices IN INDEX ORDER (scores = bf16 q.k accumulated
in fp32, times scale, -1 masked to -inf; P rounded to bf16 before P.V; the sink only in the denominator;
the running max starting at `initial_max`: -inf for V4, -1e30 for V4.1), and writes bf16. Serves decode
(T = batch) and prefill/extend (T = thousands) alike: the index rows already encode window + compressed
selection per token, so the kernel never knows about sequences or caches.
Must not: reorder or split the index row (the block order is visible in the last bits), import the model,
or be imported off CUDA (it imports triton).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.triton.fp8_gemm import sm_count
from deepinfer.kernels.triton.launch import cdiv, fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter
from deepinfer.kernels.triton.rope import rotate_tail

SPARSE_ATTN_BLOCK = 64  # indices per online-softmax step, as the official kernel


def _interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run on CPU tensors (local checks at tiny shapes)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def head_block(q_ptr, H, stride_qt, stride_qh, initial_max, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """A program's token and block of heads (axis 0 = head block, fastest: the programs of one token read the
    same kv rows back to back, L2 reuse), its q tile, and the online softmax's initial state."""
    t = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=hmask[:, None], other=0.0)
    run_max = tl.full((BLOCK_H,), initial_max, tl.float32)
    return t, heads, hmask, dims, q, run_max, tl.zeros((BLOCK_H,), tl.float32), tl.zeros((BLOCK_H, D), tl.float32)


@triton.jit
def attend_block(q, kv, valid, run_max, run_sum, acc, scale, INTERPRET: tl.constexpr):
    """One online-softmax step over a block of kv rows [BLOCK_K, D] in index order: scores = bf16 q.k in
    fp32 times scale, invalid rows -inf; P rounded to bf16 before P.V. Returns (run_max, run_sum, acc)."""
    if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; fp32 operands give the same exact products
        s = tl.dot(q.to(tl.float32), tl.trans(kv).to(tl.float32))
    else:
        s = tl.dot(q, tl.trans(kv))  # bf16 operands, fp32 accumulation
    s = s * scale  # [BLOCK_H, BLOCK_K]
    s = tl.where(valid[None, :], s, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(s, axis=1))
    rescale = tl.exp(run_max - new_max)
    p = tl.exp(s - new_max[:, None])
    run_sum = run_sum * rescale + tl.sum(p, axis=1)
    p16 = p.to(tl.bfloat16)  # the official kernel rounds P to bf16 before P.V
    if INTERPRET:
        pv = tl.dot(p16.to(tl.float32), kv.to(tl.float32))
    else:
        pv = tl.dot(p16, kv)
    return new_max, run_sum, acc * rescale[:, None] + pv


@triton.jit
def finish_heads(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh):
    """The sink joins the denominator only; out = acc / sum in bf16."""
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    out = acc / (run_sum + tl.exp(sink - run_max))[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :], out.to(tl.bfloat16),
             mask=hmask[:, None])


@triton.jit
def finish_heads_rope(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh,
                      cos_ptr, sin_ptr, D: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """`finish_heads`, then the inverse RoPE of the last 2 HALF channels of every head at token t (cos / sin:
    `rope.rope_table32`'s rows of the tokens): the bf16 output upcast, rotated by -angle in fp32 with
    `rope._rope_kernel`'s arithmetic and rounded again, as `rope32(out, inverse=True)` after the kernel
    computes it. Every pair is rotated, the pass-through pairs by cos 1 and sin 0 (exact), and only the
    rope channels' rotated values are stored."""
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    out = (acc / (run_sum + tl.exp(sink - run_max))[:, None]).to(tl.bfloat16)
    ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    NOPE: tl.constexpr = D - 2 * HALF
    tl.store(ptrs, out, mask=hmask[:, None] & (dims < NOPE)[None, :])
    rot = rotate_tail(out.to(tl.float32), t, cos_ptr, sin_ptr, BLOCK_H, D, HALF, True)  # the inverse rotation
    tl.store(ptrs, rot.to(tl.bfloat16), mask=hmask[:, None] & (dims >= NOPE)[None, :])


@fast_launch
@triton.jit
def _sparse_attn_sink_kernel(
    q_ptr, kv_ptr, sink_ptr, idx_ptr, out_ptr,
    H, K, scale, initial_max,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t, heads, hmask, dims, q, run_max, run_sum, acc = head_block(q_ptr, H, stride_qt, stride_qh, initial_max, D,
                                                                  BLOCK_H)
    for start in range(0, K, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        rows = tl.load(idx_ptr + t * stride_it + offs, mask=offs < K, other=-1)
        valid = rows >= 0
        # invalid rows load zeros: P is 0 there anyway, and a -1 must never read outside the pool
        kv = tl.load(kv_ptr + rows.to(tl.int64)[:, None] * stride_kvn + dims[None, :], mask=valid[:, None], other=0.0)
        run_max, run_sum, acc = attend_block(q, kv, valid, run_max, run_sum, acc, scale, INTERPRET)
    finish_heads(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh)


def _check(q: torch.Tensor, kv: torch.Tensor | None, sink: torch.Tensor, idx: torch.Tensor) -> None:
    """The kernels' argument contract (ValueError naming what is wrong). kv None: the caller's keys are not a
    bf16 pool (the paged op checks its stored entries itself)."""
    kv_shape = None if kv is None else tuple(kv.shape)
    if q.dim() != 3 or (kv is not None and kv.dim() != 2) or idx.dim() != 2 or sink.dim() != 1:
        raise ValueError(f"sparse_attn_sink: want q [T,H,d], kv [N,d], sink [H], idx [T,K]; got q {tuple(q.shape)}, "
                         f"kv {kv_shape}, sink {tuple(sink.shape)}, idx {tuple(idx.shape)}")
    T, H, d = q.shape
    if (kv is not None and kv.shape[1] != d) or idx.shape[0] != T or sink.shape[0] != H:
        raise ValueError(f"sparse_attn_sink: shape mismatch q {tuple(q.shape)}, kv {kv_shape}, "
                         f"sink {tuple(sink.shape)}, idx {tuple(idx.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"sparse_attn_sink: head dim {d} must be a power of two >= 16")
    if q.dtype != torch.bfloat16 or (kv is not None and kv.dtype != torch.bfloat16):
        raise ValueError(f"sparse_attn_sink: q and kv must be bf16, got {q.dtype}, {None if kv is None else kv.dtype}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attn_sink: idx must be int32/int64, got {idx.dtype}")
    for name, x in (("q", q), ("kv", kv), ("sink", sink), ("idx", idx)):
        if x is not None and not x.is_cuda and not _interpreting():  # the interpreter runs on CPU tensors
            raise ValueError(f"sparse_attn_sink: {name} is on {x.device}, the Triton kernel needs CUDA tensors")


def _block_h(T: int, H: int) -> int:
    """Heads per program. Measured on the H200 (H=64, d=512, K=640): while T * (H / 64) programs would not
    fill the GPU, 16 heads per program (the smallest MMA tile) spread a decode batch over 4x the programs
    (T=1: 40 us vs 54 us, T=32: 42 vs 56); from there on, 64 heads gather each kv row once per token
    (T=128: 62 us vs 95; T=8192: 3.1 ms vs 5.1)."""
    if H <= 16:
        return 16
    wide = 32 if H <= 32 else 64
    return wide if T * cdiv(H, wide) >= 64 else 16


def sparse_attn_sink_triton(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                            scale: float, initial_max: float = float("-inf"),
                            block_h: int | None = None, num_warps: int | None = None,
                            num_stages: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T,H,d] bf16, kv [N,d] bf16, sink [H] fp32, idx [T,K] (-1 = skip) -> [T,H,d] bf16 (official numerics).
    block_h / num_warps / num_stages: launch knobs for benchmarks and tests (the defaults are the measured best).
    out: where to write it (a [T,H,d] bf16 tensor whose last dim is dense, e.g. a CUDA graph's buffer)."""
    _check(q, kv, sink, idx)
    T, H, d = q.shape
    K = idx.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense, whatever q's strides
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"sparse_attn_sink: out must be {tuple(q.shape)} {q.dtype} on {q.device} with a dense "
                         f"last dim, got {tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
    if T == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    sink = sink.to(torch.float32).contiguous()
    bh = block_h or _block_h(T, H)
    # acc [bh, d] fp32 lives in registers: 8 warps once it passes 16K values
    warps = num_warps or (8 if bh * d >= 16384 else 4)
    grid = (cdiv(H, bh), T)
    _sparse_attn_sink_kernel[grid](
        q, kv, sink, idx, out, H, K, float(scale), float(initial_max),
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
        D=d, BLOCK_H=bh, BLOCK_K=SPARSE_ATTN_BLOCK, INTERPRET=_interpreting(), num_warps=warps, num_stages=num_stages,
    )
    return out


# The warpgroup-MMA CUDA form (kernels/cuda/sparse_attn_wgmma.cu) takes a token's 64 heads a CTA (384 threads, ~210 KB
# of shared memory). Measured on an H100 at K = 640 (benchmarks/bench_sparse_attn_prefill.py): T = 16 / 32 Triton's
# 16-head programs are faster (37 / 39 us against 40 / 41), from T = 64 the CUDA form (44 against 57 us; 8k prefill
# rows 1.36x). BENCHMARKS.md, "thirty-sixth session". The unserialized build (the default since the thirty-seventh
# session) is faster from T = 8 (H100: 33.9 / 34.6 / 36.0 against 36.8 / 37.3 / 38.8 us at T = 8 / 16 / 32; H200
# from 16, by 4%), and the engine's prefill / extend GPU tests pass with it at every T (thirty-eighth session, H100,
# DEEPINFER_ATTN_PREFILL_KERNEL=wgmma): it runs from 8 tokens.
WGMMA_MIN_TOKENS = 8


def _wgmma_form(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this call runs on the CUDA form: DEEPINFER_ATTN_PREFILL_KERNEL, the device, the shapes (idx int32)."""
    choice = env.attn_prefill_kernel()
    if choice == "triton" or _interpreting() or (choice == "auto" and q.shape[0] < WGMMA_MIN_TOKENS):
        return False
    from deepinfer.kernels.cuda import sparse_attn_wgmma as wg

    return wg.usable(q.device) and not wg.problems(q, kv, idx, out)


def sparse_attn_sink_cuda(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                          initial_max: float = float("-inf"), out: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_attn_sink_triton`'s contract and math, on the CUDA form where `_wgmma_form` picks it, else Triton."""
    _check(q, kv, sink, idx)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense, whatever q's strides
    idx = idx.to(torch.int32).contiguous()
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not _wgmma_form(q, kv, idx, out):
        return sparse_attn_sink_triton(q, kv, sink, idx, scale, initial_max, out=out)  # (which checks out)
    from deepinfer.kernels.cuda import sparse_attn_wgmma as wg

    return wg.sparse_attn_wgmma(q, kv, sink.to(torch.float32).contiguous(), idx, scale, initial_max, out,
                                sm_count(q.device))


def sparse_attn_sink_official_cuda(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                                   scale: float, initial_max: float = float("-inf"),
                                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature as `official.sparse_attn_sink_official` (the V4 kernel: running max from -inf)."""
    return sparse_attn_sink_cuda(q, kv, sink, idx, scale, initial_max, out=out)


def sparse_attn_sink_official_v41_cuda(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                                       scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature as `official.sparse_attn_sink_official_v41` (running max from -1e30)."""
    return sparse_attn_sink_cuda(q, kv, sink, idx, scale, initial_max=-1e30, out=out)


def sparse_attn_sink_qnorm(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                           eps: float, positions: torch.Tensor, freqs: torch.Tensor, table: torch.Tensor | None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Op "sparse_attn_sink_qnorm" (twin: `official_fused.sparse_attn_sink_qnorm`): V4's prefill attention over the
    raw query projection. On the CUDA form with DEEPINFER_ATTN_QNORM=kernel, one launch: the kernel norms each
    item's q rows in shared memory before its first S (the .cu's QNORM), so the 8k prefill's full write and
    re-read of q by `head_rms_norm_rope` (~370 us a layer on an H100) goes. Otherwise `head_rms_norm_rope`'s
    launch, then the attention, as before."""
    from deepinfer.kernels.triton import attn_norm_rope, rope

    if table is None:
        table = rope.rope_table32(positions, freqs)
    fused = (env.attn_qnorm_in_kernel() and env.attn_fusions_enabled() and q.is_cuda and q.dtype == torch.bfloat16
             and q.dim() == 3 and tuple(positions.shape) == (q.shape[0],) and table.dtype == torch.float32
             and table.is_contiguous() and tuple(table.shape) == (2, q.shape[0], freqs.shape[0]))
    if fused:
        from deepinfer.kernels.cuda import sparse_attn_wgmma as wg

        fused = freqs.shape[0] == wg.ROPE_HALF
    if fused:
        _check(q, kv, sink, idx)
        dest = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        idx32 = idx.to(torch.int32).contiguous()
        fused = dest.shape == q.shape and dest.dtype == q.dtype and _wgmma_form(q, kv, idx32, dest)
    if not fused:
        qn = attn_norm_rope.head_rms_norm_rope(q, eps, positions, freqs, table)
        return sparse_attn_sink_cuda(qn, kv, sink, idx, scale, out=out)
    return wg.sparse_attn_wgmma(q, kv, sink.to(torch.float32).contiguous(), idx32, scale, float("-inf"), dest,
                                sm_count(q.device), q_norm=(float(eps), table))


REGISTRATIONS = {
    "sparse_attn_sink_qnorm": sparse_attn_sink_qnorm,
    "sparse_attn_sink_official": sparse_attn_sink_official_cuda,
    "sparse_attn_sink_official_v41": sparse_attn_sink_official_v41_cuda,
}
