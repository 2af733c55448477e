"""Triton decode step of one KV compressor: the CUDA twin of `official_fused.compress_decode_step`.

Owns: `compress_decode_step(kv, gate, ape, state_kv, state_score, slots, positions, complete, norm_weight,
eps, overlap)`, same contract as the twin: ONE launch for what the batched decode path ran as ~20 torch ops
per compressor (ape add, state scatter, block gather, overlap concat / shift, gated softmax pooling, bf16
round, RMSNorm, bf16 round). One program per batch row:
1. writes the token's row (kv, gate + ape[p % r]) into its state slot;
2. only where `complete`: loads the slot's block in chunks of channels (the token's row is taken from the
   inputs, not re-read), pools it with `compress_pool`'s math (max-subtracted exp, p / sum, sum of v * p,
   fp32), rounds to bf16 into `out`; with overlap moves rows [r, 2r) to rows [0, r); then RMSNorm of the
   bf16 row as `norm_hc.rms_norm` computes it (fp32, sum(x^2) / w), bf16 into `out`;
3. elsewhere writes 0 (the entry is not stored: its pooling is skipped, so an incomplete row reads none of
   its state; ratio 128 reads 512 KB per complete row).
`compress_decode_store` (op of the same name, DEEPINFER_COMPRESS_STORE=fused): the same kernel's STORE form, the
attention's KV compressor through to its cache: step 2's normed entry rotated (its RoPE tail) and its packed
layout bytes written to the cache row where complete, what `rope32` and `kv_encode_into` did in two more
launches (the same arithmetic: bit for bit under the interpreter).
Deterministic (no atomics; every sum within one program). The token's row is substituted in registers, so a
row's result does not depend on the order in which programs sharing a slot (batch padding) write it.
Hazards inside a program (the shift overwrites rows the pooling read; `out` is re-read by other threads)
are ordered by `tl.debug_barrier()` (bar.sync orders global memory within the CTA).
float64 or non-fp32 state falls back to the twin.
Must not: be imported off CUDA (imports triton); know about caches or metadata (the caller passes tensors).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels import official_fused
from deepinfer.kernels.triton.kv_pack import _fp8_geometry, _supported, e4m3_blocks
from deepinfer.kernels.triton.launch import fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter
from deepinfer.kernels.triton.rope import rotate_tail

F32, BF16 = torch.float32, torch.bfloat16


@fast_launch
@triton.jit
def _compress_decode_kernel(kv_ptr, gate_ptr, ape_ptr, skv_ptr, ssc_ptr, slot_ptr, pos_ptr, done_ptr, nw_ptr,
                            out_ptr, eps, stride_kv, stride_gate, stride_s, stride_r, stride_slot, stride_pos,
                            stride_done, cos_ptr, sin_ptr, rows_ptr, out8_ptr, out16_ptr, BPT,
                            R: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
                            STORE: tl.constexpr = False, QDIM: tl.constexpr = 0, SBLOCK: tl.constexpr = 1,
                            NB: tl.constexpr = 1, HALF: tl.constexpr = 1, PAD: tl.constexpr = 0,
                            PDL: tl.constexpr = False):
    """One program a batch row (the module's steps 1-3). STORE (`compress_decode_store`): the normed entry is not
    written to `out` (a scratch row for the pooled values then); it is rotated (RoPE of its last 2 HALF channels
    by the row's cos / sin, `rope._rope_kernel`'s arithmetic) and its layout bytes go to cache row rows[b]
    (`kv_pack._encode_kernel`'s: E4M3 of the first QDIM channels per SBLOCK with E8M0 scales, the rotated tail
    raw bf16, zero pad), only where complete: what rope32 and kv_encode_into did after this kernel."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + b * stride_slot).to(tl.int64)
    pos = tl.load(pos_ptr + b * stride_pos).to(tl.int64)
    done = tl.load(done_ptr + b * stride_done) != 0
    phase = pos % R
    CW: tl.constexpr = 2 * W if OVERLAP else W
    if OVERLAP:
        row = phase + R
    else:
        row = phase
    base = slot * stride_s
    src = b * stride_kv  # the token's projections (rows of kv and gate: their own strides)
    gsrc = b * stride_gate
    # 1. the token's row into its slot (every row, complete or not)
    for c0 in range(0, CW, BLOCK_S):
        cs = c0 + tl.arange(0, BLOCK_S)
        m = cs < CW
        v = tl.load(kv_ptr + src + cs, mask=m, other=0.0)
        s = tl.load(gate_ptr + gsrc + cs, mask=m, other=0.0) + tl.load(ape_ptr + phase * CW + cs, mask=m, other=0.0)
        tl.store(skv_ptr + base + row * stride_r + cs, v, mask=m)
        tl.store(ssc_ptr + base + row * stride_r + cs, s, mask=m)
    wc = tl.arange(0, BLOCK_W)
    wm = wc < W
    if done:
        rows = tl.arange(0, BLOCK_R)
        if OVERLAP:
            rmask = rows < 2 * R
        else:
            rmask = rows < R
        new = (rows == row)[:, None]
        second = (rows >= R)[:, None]
        for c0 in range(0, W, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            cm = cols < W
            m2 = rmask[:, None] & cm[None, :]
            off_a = base + rows[:, None].to(tl.int64) * stride_r + cols[None, :]  # channels [c0, c0+C) (A-half)
            kv_a = tl.load(skv_ptr + off_a, mask=m2, other=0.0)
            sc_a = tl.load(ssc_ptr + off_a, mask=m2, other=float("-inf"))
            nkv_a = tl.load(kv_ptr + src + cols, mask=cm, other=0.0)
            nsc_a = tl.load(gate_ptr + gsrc + cols, mask=cm, other=0.0) + tl.load(ape_ptr + phase * CW + cols,
                                                                                mask=cm, other=0.0)
            kv_a = tl.where(new, nkv_a[None, :], kv_a)
            sc_a = tl.where(new, nsc_a[None, :], sc_a)
            if OVERLAP:
                # rows [0, r): the previous block, A-half; rows [r, 2r): this block, B-half (channels + W)
                kv_b = tl.load(skv_ptr + off_a + W, mask=m2, other=0.0)
                sc_b = tl.load(ssc_ptr + off_a + W, mask=m2, other=float("-inf"))
                nkv_b = tl.load(kv_ptr + src + W + cols, mask=cm, other=0.0)
                nsc_b = tl.load(gate_ptr + gsrc + W + cols, mask=cm, other=0.0) + tl.load(
                    ape_ptr + phase * CW + W + cols, mask=cm, other=0.0)
                kv_b = tl.where(new, nkv_b[None, :], kv_b)
                sc_b = tl.where(new, nsc_b[None, :], sc_b)
                v = tl.where(second, kv_b, kv_a)
                s = tl.where(second, sc_b, sc_a)
            else:
                v = kv_a
                s = sc_a
            p = tl.exp(s - tl.max(s, axis=0)[None, :])
            wgt = p / tl.sum(p, axis=0)[None, :]
            tl.store(out_ptr + b * W + cols, tl.sum(v * wgt, axis=0).to(tl.bfloat16), mask=cm)
            if OVERLAP:  # this block becomes the previous one: rows [r, 2r) -> [0, r), both halves
                tl.debug_barrier()  # every thread has read rows [0, r) before any overwrites them
                sm = m2 & second
                dst = off_a - R * stride_r
                tl.store(skv_ptr + dst, kv_a, mask=sm)
                tl.store(ssc_ptr + dst, sc_a, mask=sm)
                tl.store(skv_ptr + dst + W, kv_b, mask=sm)
                tl.store(ssc_ptr + dst + W, sc_b, mask=sm)
        tl.debug_barrier()  # the bf16 pooled row, written by other threads
        x = tl.load(out_ptr + b * W + wc, mask=wm, other=0.0).to(tl.float32)
        rs = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / W + eps)
        y = tl.load(nw_ptr + wc, mask=wm, other=0.0).to(tl.float32) * (x * rs)
        if STORE:
            _rope_encode_store(y.to(tl.bfloat16).to(tl.float32), b, cos_ptr, sin_ptr, rows_ptr, out8_ptr,
                               out16_ptr, BPT, W, QDIM, SBLOCK, NB, HALF, PAD)
        else:
            tl.debug_barrier()
            tl.store(out_ptr + b * W + wc, y.to(tl.bfloat16), mask=wm)
    elif not STORE:
        tl.store(out_ptr + b * W + wc, tl.zeros([BLOCK_W], tl.float32).to(tl.bfloat16), mask=wm)


@triton.jit
def _rope_encode_store(e, b, cos_ptr, sin_ptr, rows_ptr, out8_ptr, out16_ptr, BPT, W: tl.constexpr,
                       QDIM: tl.constexpr, SBLOCK: tl.constexpr, NB: tl.constexpr, HALF: tl.constexpr,
                       PAD: tl.constexpr):
    """Entry e [W] (fp32 of its bf16 values, W a power of two = QDIM + 2 HALF) of row b: its tail rotated and its
    layout bytes written to cache row rows[b] (see `_compress_decode_kernel`'s STORE)."""
    rot = rotate_tail(tl.reshape(e, (1, W)), b, cos_ptr, sin_ptr, 1, W, HALF, False)  # (its tail is stored)
    rot = tl.reshape(rot, (W // SBLOCK, SBLOCK))
    x = tl.reshape(e, (W // SBLOCK, SBLOCK))  # the quantised channels keep the entry's values
    nb = tl.arange(0, W // SBLOCK)
    j = tl.arange(0, SBLOCK)
    ch = nb[:, None] * SBLOCK + j[None, :]
    bmask = nb < NB
    q, ex = e4m3_blocks(x)
    base = tl.load(rows_ptr + b).to(tl.int64) * BPT
    tl.store(out8_ptr + base + ch, q.to(tl.uint8, bitcast=True), mask=bmask[:, None] & (j[None, :] < SBLOCK))
    tail = ch >= QDIM
    tl.store(out16_ptr + (base + QDIM) // 2 + (ch - QDIM), rot.to(tl.bfloat16).to(tl.int16, bitcast=True),
             mask=tail)
    tl.store(out8_ptr + base + QDIM + 4 * HALF + nb, ex.to(tl.uint8), mask=bmask)
    if PAD > 0:
        p = tl.arange(0, 8)
        tl.store(out8_ptr + base + QDIM + 4 * HALF + NB + p, tl.zeros((8,), tl.uint8), mask=p < PAD)


DECODE_TILE = 4096  # state elements of a complete row's pooling pass that one pass takes (8 warps)


def compress_decode_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state_kv: torch.Tensor,
                         state_score: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                         complete: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         overlap: bool) -> torch.Tensor:
    """See `official_fused.compress_decode_step` (same arguments, same result; the states in place)."""
    if state_kv.dtype != F32 or state_score.dtype != F32 or kv.dtype == torch.float64 or gate.dtype == torch.float64:
        return official_fused.compress_decode_step(kv, gate, ape, state_kv, state_score, slots, positions,
                                                   complete, norm_weight, eps, overlap)
    return _launch(kv, gate, ape, state_kv, state_score, slots, positions, complete, norm_weight, eps, overlap)


def _store_fits(layout, w: int, half: int) -> bool:
    """The STORE form covers this layout: the FP8 codec with a raw tail that is exactly the rope channels, whole
    scale blocks before it, and a power-of-two entry (the kernel's [W] vector is the whole entry)."""
    return (_supported(layout) and layout.dim == w and layout.raw_dim == 2 * half and w & (w - 1) == 0
            and layout.quant_dim % layout.block == 0 and layout.quant_dim + layout.raw_dim == w
            and w % layout.block == 0 and half & (half - 1) == 0)


def compress_decode_store(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state_kv: torch.Tensor,
                          state_score: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                          complete: torch.Tensor, norm_weight: torch.Tensor, eps: float, overlap: bool,
                          block_pos: torch.Tensor, freqs: torch.Tensor, table: torch.Tensor | None, layout,
                          store: torch.Tensor, rows: torch.Tensor) -> None:
    """See `official_fused.compress_decode_store` (`table`: `rope.rope_table32(block_pos, freqs)` or None). With
    DEEPINFER_COMPRESS_STORE=fused one launch (the kernel's STORE form: the entries' RoPE and packed store in
    its epilogue, where `rope32` and `kv_encode_into` were two launches more on the side chain a ratio layer's
    attention waits for; the default); the three launches with DEEPINFER_COMPRESS_STORE=apart."""
    from deepinfer.kernels.triton import kv_pack, rope

    half = freqs.shape[0]
    c = 2 if overlap else 1
    w = kv.shape[1] // c if kv.dim() == 2 else -1
    fused = (env.compress_store_fused() and state_kv.dtype == F32 and state_score.dtype == F32
             and kv.dtype != torch.float64 and gate.dtype != torch.float64 and _store_fits(layout, w, half))
    if table is None:
        table = rope.rope_table32(block_pos, freqs)
    if not fused:
        entries = compress_decode_step(kv, gate, ape, state_kv, state_score, slots, positions, complete,
                                       norm_weight, eps, overlap)
        kv_pack.kv_encode_into(layout, rope.rope32(entries, block_pos, freqs, table=table), store, rows, complete)
        return
    B = kv.shape[0]
    official_fused._check_store_rows(layout, B, store, rows, complete)  # (w == layout.dim: `_store_fits`)
    if tuple(table.shape) != (2, B, half) or table.dtype != F32 or not table.is_contiguous():
        raise ValueError(f"compress_decode_store: table {table.dtype} {tuple(table.shape)} is not rope_table32's "
                         f"fp32 [2, {B}, {half}]")
    if not store.is_contiguous():
        raise ValueError("compress_decode_store: the cache rows are written in place and must be contiguous")
    geo = _fp8_geometry(layout)
    bpt = layout.bytes_per_token
    pad = bpt - layout.value_bytes - 2 * layout.raw_dim - layout.scale_bytes
    _launch(kv, gate, ape, state_kv, state_score, slots, positions, complete, norm_weight, eps, overlap,
            store=dict(cos_ptr=table[0], sin_ptr=table[1], rows_ptr=rows.contiguous(), out8_ptr=store,
                       out16_ptr=store.view(torch.int16), BPT=bpt, STORE=True, QDIM=geo["QDIM"],
                       SBLOCK=geo["BLOCK"], NB=geo["NB"], HALF=half, PAD=pad))


def _launch(kv, gate, ape, state_kv, state_score, slots, positions, complete, norm_weight, eps, overlap,
            store: dict | None = None) -> torch.Tensor:
    """Both ops' checks and launch: -> the entries [B, w] bf16 (with `store`, the STORE form's keywords: a
    scratch row of the pooled values only)."""
    c = 2 if overlap else 1
    B, cw = kv.shape if kv.dim() == 2 else (-1, -1)
    r = state_kv.shape[1] // c if state_kv.dim() == 3 else -1
    if (kv.dim() != 2 or gate.shape != kv.shape or state_kv.shape != state_score.shape or state_kv.dim() != 3
            or state_kv.shape[1] != c * r or state_kv.shape[2] != cw or tuple(ape.shape) != (r, cw) or cw % c
            or tuple(norm_weight.shape) != (cw // c,) or slots.shape != (B,) or positions.shape != (B,)
            or complete.shape != (B,) or complete.dtype != torch.bool):
        raise ValueError(f"compress_decode_step: want kv, gate [B, c*w], ape [r, c*w], states [S, c*r, c*w], "
                         f"norm_weight [w], slots / positions / complete (bool) [B] (c={c}); got kv "
                         f"{tuple(kv.shape)}, gate {tuple(gate.shape)}, ape {tuple(ape.shape)}, states "
                         f"{tuple(state_kv.shape)} / {tuple(state_score.shape)}, norm_weight "
                         f"{tuple(norm_weight.shape)}, slots {tuple(slots.shape)}, positions "
                         f"{tuple(positions.shape)}, complete {tuple(complete.shape)} {complete.dtype}")
    if not (state_kv.is_contiguous() and state_score.is_contiguous()):
        raise ValueError("compress_decode_step: the state tensors are updated in place and must be contiguous")
    w = cw // c
    out = torch.empty(B, w, dtype=BF16, device=kv.device)
    if B == 0:
        return out
    # rows may be strided (the column halves of the stacked compressor GEMM's output), columns not
    kv, gate = (t.to(F32) if t.stride(1) == 1 else t.to(F32).contiguous() for t in (kv, gate))
    ape = ape.to(F32).contiguous()
    block_r = next_power_of_2(c * r)
    # compress_pool's tile, or the whole row where its [rows, w] fits one pass (DECODE_TILE elements: ratio 4
    # with overlap, 8 rows x 512): the pass's loads then go out at once instead of w / 128 passes in a row, each
    # a wait on L2 (sm_90 at 8 warps: 80 registers, no loop, no spill; scripts/sass_sm90.py compress_decode_r4)
    block_c = min(next_power_of_2(w), max(16, min(128, 8192 // block_r), DECODE_TILE // block_r))
    extra = store or dict(cos_ptr=ape, sin_ptr=ape, rows_ptr=slots, out8_ptr=out, out16_ptr=out, BPT=0)  # (unread)
    _compress_decode_kernel[(B,)](
        kv, gate, ape, state_kv, state_score, slots, positions, complete.view(torch.uint8),
        norm_weight.contiguous(), out, float(eps), kv.stride(0), gate.stride(0), state_kv.stride(0),
        state_kv.stride(1), slots.stride(0), positions.stride(0), complete.stride(0), R=r, W=w,
        OVERLAP=bool(overlap), BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_S=min(1024, next_power_of_2(cw)), BLOCK_W=next_power_of_2(w),
        num_warps=8 if block_r >= 64 or block_r * block_c >= DECODE_TILE else 4, **extra)
    return out


REGISTRATIONS = {"compress_decode_step": compress_decode_step, "compress_decode_store": compress_decode_store}
