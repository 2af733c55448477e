"""Triton sparse attention with the sink over stored caches of TWO layouts: the CUDA twin of
`kernels.official_fused.sparse_attn_sink_paged_mixed`, for V4.1's batched decode step (model/v41_decode.py).

Owns: one kernel that reads an index row's window entries from the FP8 ring (codec fp8_e8m0: E4M3 values, an
E8M0 scale per block, no raw tail: v41_window_fp8) and its compressed entries from the FP4 latents (codec
fp4_e4m3: E2M1 nibbles, an E4M3 scale per block: v41_latent_fp4), decodes them in registers (exact products,
the bf16 values `kv_decode_rows` writes) and runs `sparse_attn.attend_block`'s online softmax; split over
programs at small batches with `sparse_attn_paged`'s plan and combine (flash-decoding: the last bits move,
as there). It replaces, per V4.1 decode layer, the two gathered decodes into a pool ([B, window + top-k, d]
bf16 written and read again) and their launches with one read of the packed bytes.
The first `ring_cols` index columns are ring rows: with ring_cols a multiple of the 64-column block (V4.1-Flash:
a 128-row window) every block is of one kind, decoded by one branch; other widths (the tiny checkpoints'
16-row window) take the twin's path: gathered decodes, then the pool kernel (`sparse_attn_sink_triton`).
Unsplit, the same rows in the same order and tiles as the pool kernel (`sparse_attn_sink_triton`) over the
decoded pool: its bits at the same launch (8 warps, one stage; H100 2026-12-06: with its default 4 warps the
pool kernel's MMAs sum in another order, and rows with compressed entries differ in last bits).
Must not: import `cache` (the layouts are passed in), reorder an index row, or be imported off CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.official_fused import sparse_attn_sink_paged_mixed as twin
from deepinfer.kernels.triton.fp4_quant import _e4m3_value, _fp4_value
from deepinfer.kernels.triton.kv_pack import e8m0_value
from deepinfer.kernels.triton.launch import fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter
from deepinfer.kernels.triton.sparse_attn import (SPARSE_ATTN_BLOCK, _check, _interpreting, attend_block,
                                                  finish_heads, head_block)
from deepinfer.kernels.triton.sparse_attn_paged import PagedLaunch


@triton.jit
def _mixed_block(ring_ptr, comp_ptr, idx_ptr, t, stride_it, start, K, n_ring, RING_COLS: tl.constexpr,
                 RBPT: tl.constexpr, RBLOCK: tl.constexpr, CBPT: tl.constexpr, CBLOCK: tl.constexpr,
                 D: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """Index columns [start, start + BLOCK_K) of row t, decoded in registers -> (kv [BLOCK_K, D] bf16, valid).
    A block lies wholly in the ring columns or wholly past them (RING_COLS % BLOCK_K == 0)."""
    dims = tl.arange(0, D)
    offs = start + tl.arange(0, BLOCK_K)
    rows = tl.load(idx_ptr + t * stride_it + offs, mask=offs < K, other=-1).to(tl.int64)
    valid = rows >= 0
    # (each branch's temporaries have their own names: Triton types every name both branches assign alike)
    if start < RING_COLS:  # window rows: E4M3 values, then an E8M0 byte per RBLOCK channels
        rbase = ring_ptr + rows * RBPT
        rnb = tl.arange(0, D // RBLOCK)
        raw = tl.load(rbase[:, None] + dims[None, :], mask=valid[:, None], other=0)
        if INTERPRET:  # (no float8 bitcast in the CPU interpreter: the same exact values from the bits)
            v8 = _e4m3_value(raw.to(tl.int32))
        else:
            v8 = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s8 = e8m0_value(tl.load(rbase[:, None] + D + rnb[None, :], mask=valid[:, None], other=127))
        kv = tl.reshape(tl.reshape(v8, (BLOCK_K, D // RBLOCK, RBLOCK)) * s8[:, :, None], (BLOCK_K, D))
    else:  # compressed rows: E2M1 nibbles (channel 2j low, 2j + 1 high), then an E4M3 byte per CBLOCK channels
        cbase = comp_ptr + (rows - n_ring) * CBPT
        cnb = tl.arange(0, D // CBLOCK)
        byte = tl.load(cbase[:, None] + (dims // 2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
        code = tl.where((dims % 2 == 0)[None, :], byte & 15, byte >> 4)
        s4 = _e4m3_value(tl.load(cbase[:, None] + D // 2 + cnb[None, :], mask=valid[:, None], other=0x38).to(tl.int32))
        kv = tl.reshape(tl.reshape(_fp4_value(code), (BLOCK_K, D // CBLOCK, CBLOCK)) * s4[:, :, None], (BLOCK_K, D))
    return kv.to(tl.bfloat16), valid


@fast_launch
@triton.jit
def _sparse_attn_mixed_kernel(
    q_ptr, ring_ptr, comp_ptr, sink_ptr, idx_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    H, K, n_ring, scale, initial_max, chunk, stride_qt, stride_qh, stride_it, stride_ot, stride_oh,
    RING_COLS: tl.constexpr, RBPT: tl.constexpr, RBLOCK: tl.constexpr, CBPT: tl.constexpr, CBLOCK: tl.constexpr,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`sparse_attn_paged._sparse_attn_paged_kernel` with `_mixed_block`'s two decodes (no RoPE epilogue)."""
    pdl_enter(PDL)
    t, heads, hmask, dims, q, run_max, run_sum, acc = head_block(q_ptr, H, stride_qt, stride_qh, initial_max, D,
                                                                  BLOCK_H)
    lo = tl.program_id(2) * chunk
    for start in range(0, chunk, BLOCK_K):
        kv, valid = _mixed_block(ring_ptr, comp_ptr, idx_ptr, t, stride_it, lo + start, K, n_ring, RING_COLS, RBPT,
                                 RBLOCK, CBPT, CBLOCK, D, BLOCK_K, INTERPRET)
        run_max, run_sum, acc = attend_block(q, kv, valid, run_max, run_sum, acc, scale, INTERPRET)
    if SPLIT:
        row = (t * tl.num_programs(2) + tl.program_id(2)) * H + heads
        tl.store(part_max_ptr + row, run_max, mask=hmask)
        tl.store(part_sum_ptr + row, run_sum, mask=hmask)
        tl.store(part_acc_ptr + row[:, None] * D + dims[None, :], acc, mask=hmask[:, None])
    else:
        finish_heads(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh)


def fused(ring_layout, comp_layout, d: int, ring_cols: int) -> bool:
    """What the kernel decodes: an fp8_e8m0 ring without a raw tail, fp4_e4m3 compressed rows without one (or
    none), power-of-two blocks dividing d, and ring columns in whole 64-column blocks."""
    def pow2_block(layout, codec: str) -> bool:
        b = layout.block
        return layout.codec == codec and layout.raw_dim == 0 and layout.dim == d and b & (b - 1) == 0 and d % b == 0

    return (pow2_block(ring_layout, "fp8_e8m0") and (comp_layout is None or pow2_block(comp_layout, "fp4_e4m3"))
            and ring_cols % SPARSE_ATTN_BLOCK == 0 and d & (d - 1) == 0)


def sparse_attn_sink_paged_mixed(q: torch.Tensor, ring: torch.Tensor, ring_layout, comp: torch.Tensor | None,
                                 comp_layout, sink: torch.Tensor, idx: torch.Tensor, scale: float, ring_cols: int,
                                 initial_max: float = float("-inf"), block_h: int | None = None,
                                 num_warps: int = 8, chunk: int | None = None) -> torch.Tensor:
    """Same contract as `official_fused.sparse_attn_sink_paged_mixed`. block_h / num_warps / chunk (index
    columns per split, 0 = none; default `split_plan`, or none with DEEPINFER_DECODE_ATTN_SPLIT=off): launch
    knobs for tests and benchmarks. 8 warps: the [64, d] decoded tile in registers (as sparse_attn_paged)."""
    if q.dim() != 3 or idx.dim() != 2 or idx.shape[0] != q.shape[0] or not 0 <= ring_cols <= idx.shape[1]:
        raise ValueError(f"sparse_attn_sink_paged_mixed: want q [T, H, d], idx [T, K] and 0 <= ring_cols <= K; got "
                         f"{tuple(q.shape)}, {tuple(idx.shape)}, ring_cols {ring_cols}")
    T, H, d = q.shape
    K = idx.shape[1]
    on_gpu = ring.is_cuda or _interpreting()
    if comp is None or comp.shape[0] == 0:
        comp, comp_layout = None, None
    if not on_gpu or not fused(ring_layout, comp_layout, d, ring_cols) or (comp is None and ring_cols != K):
        return twin(q, ring, ring_layout, comp, comp_layout, sink, idx, scale, ring_cols, initial_max)
    for name, x, layout in (("ring", ring, ring_layout), ("comp", comp, comp_layout)):
        if x is not None and (x.dtype != torch.uint8 or x.shape[-1] != layout.bytes_per_token
                              or not x.is_contiguous()):
            raise ValueError(f"sparse_attn_sink_paged_mixed: {name} must be contiguous uint8 [..., "
                             f"{layout.bytes_per_token}] ({layout.name}), got {x.dtype} {tuple(x.shape)}")
    _check(q, None, sink, idx)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = PagedLaunch.make("sparse_attn_sink_paged_mixed", q, idx, sink, out, chunk, block_h, initial_max)
    if T == 0:
        return out
    n_ring = ring.numel() // ring_layout.bytes_per_token
    cl = comp_layout or ring_layout  # (no compressed rows: every index is a ring row; the comp branch never runs)
    _sparse_attn_mixed_kernel[plan.grid](
        plan.q, ring, comp if comp is not None else ring, plan.sink, plan.idx, out, plan.part_acc, plan.part_max,
        plan.part_sum, H, K, n_ring, float(scale), plan.initial_max, plan.chunk, plan.q.stride(0), plan.q.stride(1),
        K, out.stride(0), out.stride(1), RING_COLS=ring_cols, RBPT=ring_layout.bytes_per_token,
        RBLOCK=ring_layout.block, CBPT=cl.bytes_per_token, CBLOCK=cl.block, D=d, BLOCK_H=plan.bh,
        BLOCK_K=SPARSE_ATTN_BLOCK, SPLIT=plan.split, INTERPRET=_interpreting(), num_warps=num_warps, num_stages=1)
    plan.combine(out, plan.sink, plan.sink, 0)
    return out


REGISTRATIONS = {"sparse_attn_sink_paged_mixed": sparse_attn_sink_paged_mixed}
