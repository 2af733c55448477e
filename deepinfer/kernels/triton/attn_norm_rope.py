"""Triton ops of the decode attention's query and KV preparation, each in one launch where the decode path ran
three or four (twins and meaning: `kernels/official_fused.py`):

* "qkv_norm_rope_store": after the stacked wq_a | wkv projection, the q LoRA's RMSNorm (-> qr) and the KV's
  RMSNorm, RoPE and packed store into the window ring. One program per token: the q row (1024 channels in
  V4-Flash) and the kv row (512: 448 FP8 channels in blocks of 64 and a 64-channel bf16 RoPE tail), what
  `norm_hc._rms_norm_kernel` (twice), `rope._rope_kernel` and `kv_pack._encode_kernel` computed, with the
  same rounding points (normed values rounded to bf16, rotated in fp32 and rounded, quantised from the bf16
  values). Replaces four launches on the decode step's main chain.
* "head_rms_norm_rope": the per-head q norm (the official bf16 torch ops, as `norm_hc._head_rms_norm_kernel`)
  and the RoPE of each head's tail: one launch instead of two.

Why: at batch 1 a decode layer is a chain of ~40 latency-bound kernels of >= ~1.5 us each (the launch floor
in a CUDA graph, BENCHMARKS.md: "PDL, measured"); these two ops remove three of them from every layer's
main chain.
Bits: an RMSNorm's fp32 sum of squares is a reduction whose order follows the kernel's layout, so the normed
values may differ from the separate kernels' in the last bf16 bit where that sum rounds differently (as
`norm_hc.rms_norm_bf16` already differs from the fp32-input form); everything after the sum is the same
arithmetic. tests/test_kernels_attn_norm_rope.py bounds it against the twins.
Layouts other than the FP8 window layout with a raw RoPE tail (`kv_pack._supported`, raw_dim = the rope
channels) and non-bf16 inputs take the separate ops.
Must not: be imported off CUDA (imports triton); know about caches beyond the layout geometry passed in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels import official, official_fused
from deepinfer.kernels.split_k import SplitK, one_launch, summed
from deepinfer.kernels.triton import kv_pack, norm_hc, rope, split_k_load
from deepinfer.kernels.triton.split_k_load import load_summed
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

BF16 = torch.bfloat16


@triton.jit
def _q_norm_part(q_ptr, qw_ptr, qr_ptr, b, eps, stride_q, stride_qr, stride_s, S: tl.constexpr, NQ: tl.constexpr,
                 BLOCK_Q: tl.constexpr):
    """qr[b] = bf16(w_q * q[b] * rsqrt(mean(q[b]^2) + eps)) (norm_hc._rms_norm_kernel's arithmetic)."""
    cq = tl.arange(0, BLOCK_Q)
    mq = cq < NQ
    x = load_summed(q_ptr + b * stride_q + cq, mq, S, stride_s)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / NQ + eps)
    y = tl.load(qw_ptr + cq, mask=mq, other=0.0).to(tl.float32) * (x * r)
    tl.store(qr_ptr + b * stride_qr + cq, y.to(tl.bfloat16), mask=mq)


@triton.jit
def _kv_store_part(kv_ptr, kvw_ptr, cos_ptr, sin_ptr, rows_ptr, out8_ptr, out16_ptr, b, eps, stride_kv, BPT,
                   stride_s, S: tl.constexpr, BLOCK_D: tl.constexpr, QDIM: tl.constexpr, BLOCK: tl.constexpr,
                   NB: tl.constexpr, NB_P2: tl.constexpr, HALF: tl.constexpr, PAD: tl.constexpr):
    """The kv row normed and rounded to bf16, its last 2 HALF channels rotated, its layout bytes into ring row
    rows[b] (`_qkv_norm_rope_store_kernel`)."""
    # the row's RMS over all D channels (one flat sum, as the separate kernel), then its two parts
    D: tl.constexpr = QDIM + 2 * HALF
    kv_row = kv_ptr + b * stride_kv
    cd = tl.arange(0, BLOCK_D)
    xf = load_summed(kv_row + cd, cd < D, S, stride_s)
    rk = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    # the quantised channels: normed, rounded to bf16, E4M3 per BLOCK with the pow2 scale of its amax
    nb = tl.arange(0, NB_P2)
    j = tl.arange(0, BLOCK)
    bmask = nb < NB
    ch = nb[:, None] * BLOCK + j[None, :]
    m = bmask[:, None] & (j[None, :] < BLOCK)
    xn = load_summed(kv_row + ch, m, S, stride_s)
    yn = (tl.load(kvw_ptr + ch, mask=m, other=0.0).to(tl.float32) * (xn * rk)).to(tl.bfloat16).to(tl.float32)
    q8, e = kv_pack.e4m3_blocks(yn)
    base = tl.load(rows_ptr + b).to(tl.int64) * BPT
    tl.store(out8_ptr + base + ch, q8.to(tl.uint8, bitcast=True), mask=m)
    # the RoPE tail: normed, rounded to bf16, rotated in fp32 (rope._rope_kernel's arithmetic), raw bf16
    i = tl.arange(0, HALF)
    re = load_summed(kv_row + QDIM + 2 * i, i < HALF, S, stride_s)
    im = load_summed(kv_row + QDIM + 2 * i + 1, i < HALF, S, stride_s)
    re = (tl.load(kvw_ptr + QDIM + 2 * i).to(tl.float32) * (re * rk)).to(tl.bfloat16).to(tl.float32)
    im = (tl.load(kvw_ptr + QDIM + 2 * i + 1).to(tl.float32) * (im * rk)).to(tl.bfloat16).to(tl.float32)
    c = tl.load(cos_ptr + b * HALF + i)
    sn = tl.load(sin_ptr + b * HALF + i)
    tail = (base + QDIM) // 2  # int16 index of the raw tail (byte offsets are even)
    tl.store(out16_ptr + tail + 2 * i, (re * c - im * sn).to(tl.bfloat16).to(tl.int16, bitcast=True))
    tl.store(out16_ptr + tail + 2 * i + 1, (re * sn + im * c).to(tl.bfloat16).to(tl.int16, bitcast=True))
    SCALES: tl.constexpr = QDIM + 4 * HALF  # byte offset of the scale bytes: after 2 HALF bf16 tail channels
    tl.store(out8_ptr + base + SCALES + nb, e.to(tl.uint8), mask=bmask)
    if PAD > 0:
        p = tl.arange(0, 8)
        tl.store(out8_ptr + base + SCALES + NB + p, tl.zeros((8,), tl.uint8), mask=p < PAD)


@fast_launch
@triton.jit
def _qkv_norm_rope_store_kernel(q_ptr, kv_ptr, qw_ptr, kvw_ptr, qr_ptr, cos_ptr, sin_ptr, rows_ptr, out8_ptr,
                                out16_ptr, eps, stride_q, stride_kv, stride_qr, BPT, stride_s,
                                S: tl.constexpr, NQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                                QDIM: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NB_P2: tl.constexpr,
                                HALF: tl.constexpr, PAD: tl.constexpr, TWO_PROGRAMS: tl.constexpr = False,
                                PDL: tl.constexpr = False):
    """Program b: qr[b] = bf16(w_q * q[b] * rsqrt(mean(q[b]^2) + eps)); the kv row normed the same way and
    rounded to bf16, its last 2 HALF channels rotated (interleaved pairs, fp32, rounded to bf16), and the
    row's layout bytes [E4M3 of the first QDIM channels per BLOCK | the rotated tail as raw bf16 | E8M0 scale
    bytes | zero pad] written to ring row rows[b]. S > 1: q and kv are fp32 split-K partials (stride_s apart),
    added in order and rounded to bf16 on every load (`split_k_load.load_summed`: the sum kernel's bits).
    TWO_PROGRAMS (grid (B, 2)): program (b, 0) does the q row, (b, 1) the kv row; each part's arithmetic and
    layout are the one program's, so the same bits with twice the loads in flight (the partials' reads)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    if TWO_PROGRAMS:
        if tl.program_id(1) == 0:
            _q_norm_part(q_ptr, qw_ptr, qr_ptr, b, eps, stride_q, stride_qr, stride_s, S, NQ, BLOCK_Q)
        else:
            _kv_store_part(kv_ptr, kvw_ptr, cos_ptr, sin_ptr, rows_ptr, out8_ptr, out16_ptr, b, eps, stride_kv, BPT,
                           stride_s, S, BLOCK_D, QDIM, BLOCK, NB, NB_P2, HALF, PAD)
    else:
        _q_norm_part(q_ptr, qw_ptr, qr_ptr, b, eps, stride_q, stride_qr, stride_s, S, NQ, BLOCK_Q)
        _kv_store_part(kv_ptr, kvw_ptr, cos_ptr, sin_ptr, rows_ptr, out8_ptr, out16_ptr, b, eps, stride_kv, BPT,
                       stride_s, S, BLOCK_D, QDIM, BLOCK, NB, NB_P2, HALF, PAD)


QKV_TWO_PROGRAMS = False  # the fused kernel's q and kv rows in two programs also on bf16 inputs (with split-K
# partials always: twice the loads in flight); DEEPINFER_QKV_PROGRAMS overrides it for A/B runs


def _fused_window(layout, kv: torch.Tensor, half: int) -> bool:
    """The fused kernel covers this layout and kv: the FP8 codec with a raw tail that is exactly the rope
    channels, kv's width the layout's."""
    return (kv_pack._supported(layout) and layout.raw_dim == 2 * half and layout.quant_dim + layout.raw_dim == layout.dim
            and kv.shape[-1] == layout.dim and layout.quant_dim % layout.block == 0)


def qkv_norm_rope_store(q_lora: "torch.Tensor | SplitK", kv: "torch.Tensor | SplitK", q_weight: torch.Tensor,
                        kv_weight: torch.Tensor, eps: float, positions: torch.Tensor, freqs: torch.Tensor,
                        table: torch.Tensor | None, layout, store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Same contract as `official_fused.qkv_norm_rope_store` (`table`: `rope.rope_table32`'s cos / sin, or
    None). One launch for bf16 rows on the FP8 window layout; the separate Triton ops otherwise. q_lora and
    kv may be the two column views of one `SplitK` (the stacked wq_a | wkv from op "fp8_linear_unsummed"):
    the fused kernel adds the partials on its loads (the split-sum kernel's bits), every other path first
    sums them."""
    if not one_launch(q_lora, kv):
        q_lora, kv = summed(q_lora), summed(kv)
    return _qkv_norm_rope_store(q_lora, kv, q_weight, kv_weight, eps, positions, freqs, table, layout, store, rows)


def _qkv_norm_rope_store(q_lora, kv, q_weight, kv_weight, eps, positions, freqs, table, layout, store, rows):
    on_device = q_lora.device.type == "cuda" or interpreting()
    if not on_device or q_lora.dtype == torch.float64:
        return official_fused.qkv_norm_rope_store(q_lora, kv, q_weight, kv_weight, eps, positions, freqs, table,
                                                  layout, store, rows)
    half = freqs.shape[0]
    B = q_lora.shape[0]
    problems = []
    if q_lora.dim() != 2 or kv.dim() != 2 or kv.shape[0] != B or positions.shape != (B,) or rows.shape != (B,):
        problems.append(f"want q_lora [B, r], kv [B, d], positions and rows [B]; got {tuple(q_lora.shape)}, "
                        f"{tuple(kv.shape)}, {tuple(positions.shape)}, {tuple(rows.shape)}")
    elif tuple(q_weight.shape) != (q_lora.shape[1],) or tuple(kv_weight.shape) != (kv.shape[1],):
        problems.append(f"weights {tuple(q_weight.shape)} / {tuple(kv_weight.shape)} do not match q_lora "
                        f"{tuple(q_lora.shape)} / kv {tuple(kv.shape)}")
    if problems:
        raise ValueError("qkv_norm_rope_store: " + "; ".join(problems))
    split = isinstance(q_lora, SplitK)  # both are then (qkv_norm_rope_store)
    fused = ((split or (q_lora.dtype == kv.dtype == BF16 and q_lora.stride(1) == 1 and kv.stride(1) == 1))
             and env.attn_fusions_enabled() and _fused_window(layout, kv, half) and half & (half - 1) == 0
             and store.dim() == 2 and store.is_contiguous()
             and store.dtype == torch.uint8 and store.shape[1] == layout.bytes_per_token)
    if table is None:
        table = rope.rope_table32(positions, freqs)
    if not fused:  # the same ops one by one
        q_lora, kv = summed(q_lora), summed(kv)
        qr = norm_hc.rms_norm_bf16(q_lora, q_weight, eps)
        kvn = rope.rope32(norm_hc.rms_norm_bf16(kv, kv_weight, eps), positions, freqs, table=table, inplace=True)
        kv_pack.kv_encode_into(layout, kvn, store, rows)
        return qr
    if tuple(table.shape) != (2, B, half) or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(f"qkv_norm_rope_store: table {table.dtype} {tuple(table.shape)} is not rope_table32's "
                         f"fp32 [2, {B}, {half}]")
    qr = torch.empty(q_lora.shape, dtype=BF16, device=q_lora.device)
    if B:
        geo = kv_pack._fp8_geometry(layout)
        bpt = layout.bytes_per_token
        pad = bpt - layout.value_bytes - 2 * layout.raw_dim - layout.scale_bytes
        q_op, S, stride_s, stride_q = split_k_load.operand(q_lora)
        kv_op, _, _, stride_kv = split_k_load.operand(kv)
        choice = env.qkv_programs()
        two = choice == "2" or (choice == "auto" and (S > 1 or QKV_TWO_PROGRAMS))
        _qkv_norm_rope_store_kernel[(B, 2 if two else 1)](
            q_op, kv_op, q_weight.contiguous(), kv_weight.contiguous(), qr, table[0], table[1], rows.contiguous(),
            store, store.view(torch.int16), float(eps), stride_q, stride_kv, qr.stride(0), bpt, stride_s, S=S,
            NQ=q_lora.shape[1], BLOCK_Q=next_power_of_2(q_lora.shape[1]), BLOCK_D=next_power_of_2(layout.dim),
            QDIM=geo["QDIM"], BLOCK=geo["BLOCK"], NB=geo["NB"], NB_P2=geo["NB_P2"], HALF=half, PAD=pad,
            TWO_PROGRAMS=two, num_warps=4)  # 4 with partials too: the sums of squares' reduction tree follows the warps
    return qr


@fast_launch
@triton.jit
def _head_rms_norm_rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, n_rows, heads, D, eps, stride_x, stride_o,
                               ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
                               PDL: tl.constexpr = False):
    """Rows of x [n_rows = B * heads, D]: `norm_hc._head_rms_norm_kernel`'s arithmetic (each bf16 torch op's
    rounding), then the row's last 2 HALF channels rotated by its token's (row // heads) cos / sin (fp32,
    rounded to bf16), as `rope._rope_kernel` rotates the normed bf16 values."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    NOPE = D - 2 * HALF
    m = live[:, None] & (cols < NOPE)[None, :]
    m_all = live[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m_all, other=0.0).to(tl.float32)
    r = norm_hc.head_rms_factor(x, D, eps)  # the separate kernel's own arithmetic
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (x * r[:, None]).to(tl.bfloat16), mask=m)
    i = tl.arange(0, HALF)
    tok = rows // heads
    ch = NOPE + 2 * i
    re = tl.load(x_ptr + rows[:, None] * stride_x + ch[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    im = tl.load(x_ptr + rows[:, None] * stride_x + ch[None, :] + 1, mask=live[:, None], other=0.0).to(tl.float32)
    re = (re * r[:, None]).to(tl.bfloat16).to(tl.float32)
    im = (im * r[:, None]).to(tl.bfloat16).to(tl.float32)
    c = tl.load(cos_ptr + tok[:, None] * HALF + i[None, :], mask=live[:, None], other=0.0)
    sn = tl.load(sin_ptr + tok[:, None] * HALF + i[None, :], mask=live[:, None], other=0.0)
    o = out_ptr + rows[:, None] * stride_o + ch[None, :]
    tl.store(o, (re * c - im * sn).to(tl.bfloat16), mask=live[:, None])
    tl.store(o + 1, (re * sn + im * c).to(tl.bfloat16), mask=live[:, None])


def head_rms_norm_rope(q: torch.Tensor, eps: float, positions: torch.Tensor, freqs: torch.Tensor,
                       table: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `official_fused.head_rms_norm_rope` (q [B, heads, d]; `table`: `rope.rope_table32`'s
    cos / sin of `positions`, or None). One launch for bf16 q; the separate ops otherwise."""
    if q.dtype == torch.float64 or (not q.is_cuda and not interpreting()):
        return official_fused.head_rms_norm_rope(q, eps, positions, freqs, table, out)
    if q.dtype != BF16 or not env.attn_fusions_enabled():  # the separate ops
        y = rope.rope32(norm_hc.head_rms_norm(q, eps), positions, freqs, table=table, inplace=True)
        return y if out is None else official.write_into(out, y, "head_rms_norm_rope")
    half = freqs.shape[0]
    if q.dim() != 3 or positions.shape != (q.shape[0],) or 2 * half > q.shape[2] or half & (half - 1):
        raise ValueError(f"head_rms_norm_rope: want q [B, heads, d] with positions [B] and a power-of-two count "
                         f"of pair frequencies <= d/2; got q {tuple(q.shape)}, positions {tuple(positions.shape)}, "
                         f"freqs {tuple(freqs.shape)}")
    B, H, D = q.shape
    if table is None:
        table = rope.rope_table32(positions, freqs)
    if tuple(table.shape) != (2, B, half) or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(f"head_rms_norm_rope: table {table.dtype} {tuple(table.shape)} is not rope_table32's "
                         f"fp32 [2, {B}, {half}]")
    x2 = q.reshape(B * H, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x2.shape, dtype=BF16, device=q.device)
    elif out.shape != q.shape or out.dtype != BF16 or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"head_rms_norm_rope: out must be a contiguous bf16 {tuple(q.shape)} on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}, strides {out.stride()}")
    else:
        out = out.view(x2.shape)
    n = x2.shape[0]
    if n:
        block = next_power_of_2(D)
        rows = max(1, min(8, 4096 // block))  # as head_rms_norm: the same row tiles, hence the same sums
        _head_rms_norm_rope_kernel[(cdiv(n, rows),)](x2, out, table[0], table[1], n, H, D, float(eps), x2.stride(0),
                                                     out.stride(0), ROWS=rows, BLOCK_D=block, HALF=half,
                                                     num_warps=4)
    return out.view(q.shape)


REGISTRATIONS = {"qkv_norm_rope_store": qkv_norm_rope_store, "head_rms_norm_rope": head_rms_norm_rope}
