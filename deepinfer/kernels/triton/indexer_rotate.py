"""Triton ops of the V4 indexer's rotations, each in one launch (twins and meaning: `kernels/official_fused.py`):

* "indexer_q_rotate": the indexer query's RoPE (each head's tail), Hadamard transform and FP4 fake
  quantisation: `fp4_fake_quant(hadamard32(rope32(q)), 32)`, three launches before;
* "index_key_rotate_store": a decode step's new index keys: RoPE at their blocks' positions, Hadamard, and
  the packed FP4 bytes written into the key cache rows where a block completed: `kv_encode_into(layout,
  hadamard32(rope32(e)), store, rows, keep)`, three launches before.

Why: on an indexer layer these run on the side chain that bounds the layer at decode (BENCHMARKS.md,
nineteenth session), and each launch is >= ~1.5 us in a CUDA graph. The extend path's query takes the
first op too (three passes over an 8k prefill's [8192, 64, 128] q become one).
Bits: the same arithmetic in the same order as the three kernels: the RoPE pairs rotated in fp32 as
`rope._rope_kernel` (pass-through pairs by cos 1 / sin 0, exact) and rounded to bf16; the Hadamard MMA on
the same [64, 128] x [128, 128] tiles as `hadamard._hadamard_kernel` (bf16 +-1, fp32 sums, times fp32
d**-0.5, rounded); the FP4 steps are `fp4_quant`'s exact operations. Bit for bit the separate kernels under
the interpreter (tests/test_kernels_indexer_rotate.py).
Must not: be imported off CUDA (imports triton); know about caches beyond the layout geometry passed in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels import official_fused
from deepinfer.kernels.triton import hadamard, kv_pack, rope
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.fp4_quant import (BLOCK as FP4_BLOCK, _fp4_codes, _fp4_value, fp4_codec_supported,
                                                 fp4_fake_quant)
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

BF16 = torch.bfloat16


@triton.jit
def _rope_hadamard(x_ptr, h_ptr, cos_ptr, sin_ptr, rows, live, heads, stride_x, scale, D: tl.constexpr,
                   HALF: tl.constexpr, BM: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows `rows` [BM] of x [*, D] bf16 (row r belongs to token r // heads): RoPE of the last 2 HALF
    channels, rounded to bf16, then (x @ H) * scale rounded to bf16 -> [BM, D] bf16."""
    k = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    re, im = tl.split(tl.reshape(x, (BM, D // 2, 2)))
    pair = tl.arange(0, D // 2) - (D // 2 - HALF)  # the rope pair's index, negative for pass-through pairs
    is_rope = (pair >= 0)[None, :]
    tok = rows // heads
    c = tl.load(cos_ptr + tok[:, None] * HALF + pair[None, :], mask=live[:, None] & is_rope, other=1.0)
    sn = tl.load(sin_ptr + tok[:, None] * HALF + pair[None, :], mask=live[:, None] & is_rope, other=0.0)
    x = tl.reshape(tl.join(re * c - im * sn, re * sn + im * c), (BM, D)).to(tl.bfloat16)
    h = tl.load(h_ptr + k[:, None] * D + k[None, :])
    if INTERPRET:  # the CPU interpreter's bf16 dot multiplies bit patterns; fp32 operands: the same exact products
        acc = tl.dot(x.to(tl.float32), h.to(tl.float32))
    else:
        acc = tl.dot(x, h)
    return (acc * scale).to(tl.bfloat16)


@fast_launch
@triton.jit
def _indexer_q_rotate_kernel(x_ptr, h_ptr, cos_ptr, sin_ptr, out_ptr, M, heads, stride_x, scale, D: tl.constexpr,
                             HALF: tl.constexpr, BM: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Rows of q [M = T * heads, D]: `_rope_hadamard`, then the FP4 fake quantisation of every 32 values
    (`fp4_quant._fp4_fake_quant_kernel`'s steps) into out [M, D] bf16."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    live = rows < M
    y = _rope_hadamard(x_ptr, h_ptr, cos_ptr, sin_ptr, rows, live, heads, stride_x, scale, D, HALF, BM,
                       INTERPRET).to(tl.float32)
    NB: tl.constexpr = D // 32
    yb = tl.reshape(y, (BM, NB, 32))
    amax = tl.maximum(tl.max(tl.abs(yb), axis=2), 6.0 * 1.1754943508222875e-38)  # 6 * 2**-126
    bits = (amax * (1.0 / 6.0)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)
    val = _fp4_value(_fp4_codes(yb, inv_s[:, :, None]))  # the codec's own code and value (a signed code is never 0)
    out = tl.reshape(val * s[:, :, None], (BM, D)).to(tl.bfloat16)
    k = tl.arange(0, D)
    tl.store(out_ptr + rows[:, None] * D + k[None, :], out, mask=live[:, None])


@fast_launch
@triton.jit
def _index_key_rotate_store_kernel(x_ptr, h_ptr, cos_ptr, sin_ptr, out_ptr, rows_ptr, keep_ptr, M, stride_x, scale,
                                   BPT, D: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr, PAD: tl.constexpr,
                                   PAD_P2: tl.constexpr, KEEP: tl.constexpr, INTERPRET: tl.constexpr,
                                   PDL: tl.constexpr = False):
    """Rows of e [M, D]: `_rope_hadamard`, then the FP4 key codec (`fp4_quant._fp4_encode_kernel`'s bytes:
    per 32 values 16 bytes of two codes, even index in the low nibble, then the E8M0 scale bytes, zero pad)
    into out's row rows[m], only where keep[m] (KEEP)."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    live = rows < M
    if KEEP:
        live = live & (tl.load(keep_ptr + rows, mask=live, other=0) != 0)
    y = _rope_hadamard(x_ptr, h_ptr, cos_ptr, sin_ptr, rows, live, 1, stride_x, scale, D, HALF, BM,
                       INTERPRET).to(tl.float32)
    NB: tl.constexpr = D // 32
    ye, yo = tl.split(tl.reshape(y, (BM, NB, 16, 2)))  # [BM, NB, 16]: values 2j and 2j + 1 of a block
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(ye), axis=2), tl.max(tl.abs(yo), axis=2)),
                      6.0 * 1.1754943508222875e-38)
    bits = (amax * (1.0 / 6.0)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)
    byte = _fp4_codes(ye, inv_s[:, :, None]) | (_fp4_codes(yo, inv_s[:, :, None]) << 4)
    base = tl.load(rows_ptr + rows, mask=live, other=0).to(tl.int64) * BPT
    nb = tl.arange(0, NB)
    j = tl.arange(0, 16)
    tl.store(out_ptr + base[:, None, None] + nb[None, :, None] * 16 + j[None, None, :], byte.to(tl.uint8),
             mask=live[:, None, None])
    tl.store(out_ptr + base[:, None] + NB * 16 + nb[None, :], e.to(tl.uint8), mask=live[:, None])
    if PAD > 0:
        p = tl.arange(0, PAD_P2)
        tl.store(out_ptr + base[:, None] + NB * 16 + NB + p[None, :], tl.zeros((BM, PAD_P2), tl.uint8),
                 mask=live[:, None] & (p < PAD)[None, :])


def _geometry_ok(x: torch.Tensor, half: int) -> bool:
    d = x.shape[-1]
    return (x.dtype == BF16 and d & (d - 1) == 0 and hadamard.MIN_D <= d <= hadamard.BLOCK_N and d % 32 == 0
            and half & (half - 1) == 0 and 0 < 2 * half <= d)


def _table(positions: torch.Tensor, freqs: torch.Tensor, table: torch.Tensor | None, op: str) -> torch.Tensor:
    if table is None:
        return rope.rope_table32(positions, freqs)
    half = freqs.shape[0]
    if table.dtype != torch.float32 or tuple(table.shape) != (2, positions.shape[0], half) or not table.is_contiguous():
        raise ValueError(f"{op}: table {table.dtype} {tuple(table.shape)} is not rope_table32's fp32 "
                         f"[2, {positions.shape[0]}, {half}]")
    return table


FEW_ROWS_WARPS = 8  # warps per program up to FEW_ROWS tokens (decode), 4 above (`indexer_q_rotate`)
FEW_ROWS = 32


def indexer_q_rotate(q: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                     table: torch.Tensor | None, warps: int | None = None) -> torch.Tensor:
    """Same contract as `official_fused.indexer_q_rotate`: q [T, heads, d] -> a new bf16 tensor (`table`:
    `rope.rope_table32(positions, freqs)` or None). warps: the kernel's warps per program (None: FEW_ROWS_WARPS
    up to FEW_ROWS tokens, else 4; the program's tile and MMA order, hence the bits, do not depend on it: GPU
    test `test_indexer_q_rotate_bits_do_not_depend_on_its_warps`, passed on an H100 2026-12-07). At decode
    (T = 1: one program of the Hadamard tile's 64 rows) the 4-warp build is 3,856 instructions straight-line
    (8 warps: 2,240). H100, CUDA-graph replay, PDL on (`benchmarks/bench_indexer_rotate.py`,
    results/bench_indexer_rotate_h100_2026-12-07_s33.log): T = 1 / 8 / 32 took 6.4 / 6.8 / 7.3 us with 4
    warps, 5.9 / 6.0 / 6.2 with 8, 5.9 / 6.1 / 6.3 with 16; larger T was not timed, so it keeps 4."""
    if q.dtype == torch.float64 or not (q.is_cuda or interpreting()):
        return official_fused.indexer_q_rotate(q, positions, freqs, table)
    if q.dim() != 3 or positions.shape != (q.shape[0],):
        raise ValueError(f"indexer_q_rotate: want q [T, heads, d] and positions [T]; got {tuple(q.shape)}, "
                         f"{tuple(positions.shape)}")
    half = freqs.shape[0]
    table = _table(positions, freqs, table, "indexer_q_rotate")
    if not _geometry_ok(q, half) or not env.attn_fusions_enabled():  # the separate kernels
        return fp4_fake_quant(hadamard.hadamard32(rope.rope32(q, positions, freqs, table=table)), FP4_BLOCK)
    T, H, d = q.shape
    if warps is None:
        warps = FEW_ROWS_WARPS if T <= FEW_ROWS else 4
    x2 = q.reshape(T * H, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(T * H, d, dtype=BF16, device=q.device)
    if T * H:
        bm = hadamard._block_rows(d)  # the Hadamard kernel's tiles, hence its sums
        _indexer_q_rotate_kernel[(cdiv(T * H, bm),)](
            x2, hadamard._hadamard_bf16(d, q.device), table[0], table[1], out, T * H, H, x2.stride(0), d**-0.5,
            D=d, HALF=half, BM=bm, INTERPRET=interpreting(), num_warps=warps)
    return out.view(q.shape)


def index_key_rotate_store(entries: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                           table: torch.Tensor | None, layout, store: torch.Tensor, rows: torch.Tensor,
                           keep: torch.Tensor | None = None) -> None:
    """Same contract as `official_fused.index_key_rotate_store` (entries [B, d] bf16; `table`:
    `rope.rope_table32(positions, freqs)` or None): the keys written into store[rows] where keep."""
    if entries.dtype == torch.float64 or not (entries.is_cuda or interpreting()):
        return official_fused.index_key_rotate_store(entries, positions, freqs, table, layout, store, rows, keep)
    from deepinfer.kernels.official_fused import _check_encode_into

    if entries.dim() != 2 or positions.shape != (entries.shape[0],):
        raise ValueError(f"index_key_rotate_store: want entries [B, d] and positions [B]; got "
                         f"{tuple(entries.shape)}, {tuple(positions.shape)}")
    _check_encode_into(layout, entries, store, rows, keep)
    half = freqs.shape[0]
    table = _table(positions, freqs, table, "index_key_rotate_store")
    d = entries.shape[1]
    fused = (env.attn_fusions_enabled() and _geometry_ok(entries, half) and fp4_codec_supported(layout) and layout.block == 32
             and layout.dim == d and store.is_contiguous())
    if not fused:
        rotated = hadamard.hadamard32(rope.rope32(entries, positions, freqs, table=table))
        return kv_pack.kv_encode_into(layout, rotated, store, rows, keep)
    M = entries.shape[0]
    if not M:
        return None
    x2 = entries if entries.stride(-1) == 1 else entries.contiguous()
    bpt = layout.bytes_per_token
    pad = bpt - layout.value_bytes - layout.scale_bytes
    bm = hadamard._block_rows(d)
    _index_key_rotate_store_kernel[(cdiv(M, bm),)](
        x2, hadamard._hadamard_bf16(d, entries.device), table[0], table[1], store, rows.contiguous(),
        rows if keep is None else keep.contiguous().view(torch.uint8), M, x2.stride(0), d**-0.5, bpt,
        D=d, HALF=half, BM=bm, PAD=pad, PAD_P2=next_power_of_2(max(pad, 1)), KEEP=keep is not None,
        INTERPRET=interpreting(), num_warps=4)
    return None


REGISTRATIONS = {"indexer_q_rotate": indexer_q_rotate, "index_key_rotate_store": index_key_rotate_store}
