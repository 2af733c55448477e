"""Triton RoPE with the official numerics: the CUDA twin of `kernels.official.rope32`.

Owns: the interleaved rotation of the LAST 2*len(freqs) channels of x [T, ..., d] by position * freq, fp32
math, result in x's dtype, written together with the untouched leading channels in one pass (the torch
version slices, rotates through complex64 and concatenates: four passes), or in place (`inplace=True`):
only the rope channels are read and written, 1/8 of the bytes for V4's q and o (64 of 512 channels). A
program takes a block of rows and tokens and reads each row's rope channels as one contiguous run (16-byte
vector loads), splitting the interleaved pairs in registers: the 8k prefill's 20 RoPE launches went from
3.75 ms to 0.42 ms on the H200 (2026-12-02; q [8192, 64, 512] in place 44 us, benchmarks/bench_rope.py); the
old kernel loaded re and im with stride-2 scalar loads, one program per token and 16 rows. The cos/sin
table [2, T, rd/2]
(`rope_table32`) is computed by torch from the same fp32 angles the official precompute uses (tiny next to
x, and torch's cos/sin are the accurate ones; an approximate in-kernel sine is wrong at positions of a
million); a step passes one table to all of its calls with the same positions and frequencies.
Must not: change the channel layout (interleaved pairs, rope channels last); be imported off CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.kernels import official
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter


@fast_launch
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, T, R, stride_xt, stride_xr, stride_ot, stride_or,
                 D: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr, INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr, PDL: tl.constexpr = False):
    """x viewed as [T, R, D] (R = product of the middle dims); one program per (BLOCK_T tokens, BLOCK_R rows).
    The rope channels of a row are read as one contiguous [2*HALF] run (16-byte vector loads) and split into
    their interleaved (re, im) pairs in registers; cos/sin are read once per token for all its rows.
    COPY_NOPE=False: out is x (in place), the pass-through channels are neither read nor written.
    (Before 2026-12-02's third session: one program per (token, 16 rows) with stride-2 scalar loads of re
    and im: 3.8 ms of an 8k prefill's RoPE on the H200.)"""
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (t < T)[:, None] & (rows < R)[None, :]  # [BLOCK_T, BLOCK_R]
    t64 = t.to(tl.int64)
    NOPE: tl.constexpr = D - 2 * HALF
    if COPY_NOPE and NOPE > 0:  # the pass-through channels [0, NOPE)
        for c0 in range(0, NOPE, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            m = ok[:, :, None] & (cols < NOPE)[None, None, :]
            src = x_ptr + t64[:, None, None] * stride_xt + rows[None, :, None] * stride_xr + cols[None, None, :]
            dst = out_ptr + t64[:, None, None] * stride_ot + rows[None, :, None] * stride_or + cols[None, None, :]
            tl.store(dst, tl.load(src, mask=m), mask=m)
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t64[:, None] * HALF + i[None, :], mask=(t < T)[:, None], other=0.0)[:, None, :]
    s = tl.load(sin_ptr + t64[:, None] * HALF + i[None, :], mask=(t < T)[:, None], other=0.0)[:, None, :]
    if INVERSE:
        s = -s
    ch = NOPE + tl.arange(0, 2 * HALF)
    m3 = ok[:, :, None]
    x_off = t64[:, None, None] * stride_xt + rows[None, :, None] * stride_xr + ch[None, None, :]
    pairs = tl.reshape(tl.load(x_ptr + x_off, mask=m3, other=0.0).to(tl.float32), (BLOCK_T, BLOCK_R, HALF, 2))
    re, im = tl.split(pairs)
    rot = tl.reshape(tl.join(re * c - im * s, re * s + im * c), (BLOCK_T, BLOCK_R, 2 * HALF))
    o_off = t64[:, None, None] * stride_ot + rows[None, :, None] * stride_or + ch[None, None, :]
    tl.store(out_ptr + o_off, rot.to(out_ptr.dtype.element_ty), mask=m3)


@triton.jit
def rotate_tail(x, t, cos_ptr, sin_ptr, R: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                INVERSE: tl.constexpr):
    """x [R, D] fp32 (bf16 values) of token t -> [R, D] fp32: every interleaved pair (2i, 2i + 1) of the last
    2 HALF channels rotated by the token's cos / sin (`rope_table32`'s rows; INVERSE: by -angle) with
    `_rope_kernel`'s arithmetic (re c - im s, re s + im c); the pass-through pairs by cos 1 and sin 0, which
    callers do not store (0 x a negative sin can turn a -0.0 into +0.0). The in-kernel RoPE of the fused
    attention and compressor kernels: one copy of the arithmetic their separate launches' bits depend on."""
    re, im = tl.split(tl.reshape(x, (R, D // 2, 2)))
    pair = tl.arange(0, D // 2) - (D - 2 * HALF) // 2  # the rope pair's index, negative for pass-through pairs
    is_rope = pair >= 0
    c = tl.load(cos_ptr + t * HALF + pair, mask=is_rope, other=1.0)[None, :]
    s = tl.load(sin_ptr + t * HALF + pair, mask=is_rope, other=0.0)[None, :]
    if INVERSE:
        s = -s
    return tl.reshape(tl.join(re * c - im * s, re * s + im * c), (R, D))


ROPE_ELEMENTS = 4096  # rope channels per program (tokens x rows x 2*HALF): 8 KB of bf16 in, 8 KB out


@fast_launch
@triton.jit
def _rope_table_kernel(pos_ptr, freq_ptr, table_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                       PDL: tl.constexpr = False):
    """table[0, t] = cos(fp32(p_t) * f), table[1, t] = sin(...): the fp32 angles as torch.outer forms them (one
    rounding of the product), then libdevice's accurate cosf / sinf (CUDA's math library, which torch's
    cos / sin call: NOT tl.cos / tl.sin, which lower to the approximate hardware instructions)."""
    pdl_enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF)
    ok = (t < T)[:, None]
    p = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)
    angles = p[:, None] * tl.load(freq_ptr + i)[None, :]
    off = t.to(tl.int64)[:, None] * HALF + i[None, :]
    tl.store(table_ptr + off, libdevice.cos(angles), mask=ok)
    tl.store(table_ptr + T * HALF + off, libdevice.sin(angles), mask=ok)


def rope_table32_torch(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`rope_table32` by torch ops (4 kernels: cast, outer, cos, sin): the reference its kernel must equal."""
    angles = torch.outer(positions.to(torch.float32), freqs.to(positions.device, torch.float32))
    table = torch.empty((2,) + tuple(angles.shape), dtype=torch.float32, device=angles.device)
    torch.cos(angles, out=table[0])
    torch.sin(angles, out=table[1])
    return table


def rope_table32(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """This kernel's table for positions [T]: fp32 [2, T, rd/2] = (cos, sin) of the fp32 angles, in one launch
    (`_rope_table_kernel`; the torch ops of `rope_table32_torch` were 4). A step builds it once per frequency
    table and passes it to every `rope32(..., table=)` of those positions; without one, `rope32` builds it
    itself (the same bits)."""
    half = freqs.shape[0]
    if positions.dim() != 1 or freqs.dim() != 1 or half & (half - 1):
        raise ValueError(f"rope_table32: positions [T] and a power-of-two count of frequencies, got "
                         f"{tuple(positions.shape)} and {tuple(freqs.shape)}")
    if not positions.is_cuda:  # the interpreter has no libdevice cos / sin: torch's, the bits the kernel must give
        return rope_table32_torch(positions, freqs)
    f = freqs.to(positions.device, torch.float32).contiguous()
    T = positions.shape[0]
    table = torch.empty((2, T, half), dtype=torch.float32, device=positions.device)
    if T:
        block_t = max(1, min(64, 4096 // half))
        _rope_table_kernel[(cdiv(T, block_t),)](positions.contiguous(), f, table, T, HALF=half,
                                                       BLOCK_T=block_t, num_warps=4)
    return table


def rope32(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False,
           table: torch.Tensor | None = None, inplace: bool = False) -> torch.Tensor:
    """Same contract as `official.rope32`: x [T, ..., d], positions [T], freqs [rd/2] fp32 -> new tensor
    (inplace: x, rotated in place); `table` = this module's `rope_table32(positions, freqs)` (not the
    twin's complex one)."""
    if x.dtype == torch.float64:
        return official.rope32(x, positions, freqs, inverse, inplace=inplace)  # builds the twin's own table
    half = freqs.shape[0]
    d = x.shape[-1]
    if x.dim() < 2 or positions.shape != (x.shape[0],) or 2 * half > d or half & (half - 1):
        raise ValueError(f"rope32: want x [T, ..., d] with positions [T] and a power-of-two count of pair "
                         f"frequencies <= d/2; got x {tuple(x.shape)}, positions {tuple(positions.shape)}, "
                         f"freqs {tuple(freqs.shape)}")
    T = x.shape[0]
    if table is not None and (table.dtype != torch.float32 or tuple(table.shape) != (2, T, half)
                              or not table.is_contiguous() or table.device != x.device):
        raise ValueError(f"rope32: table {table.dtype} {tuple(table.shape)} on {table.device} is not this "
                         f"kernel's rope_table32 fp32 [2, {T}, {half}] on {x.device}")
    x3 = x.reshape(T, -1, d)  # a view unless x's strides forbid it (then a copy: its own data pointer)
    if inplace and (x3.stride(-1) != 1 or (x3.numel() and x3.data_ptr() != x.data_ptr())):
        raise ValueError(f"rope32(inplace=True): x {tuple(x.shape)} with strides {x.stride()} cannot be viewed "
                         f"as [T, rows, d] with unit channel stride; rotate it out of place")
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    out = x3 if inplace else torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if x3.numel():
        if table is None:
            table = rope_table32(positions, freqs)
        R = x3.shape[1]
        block_r = min(64, next_power_of_2(R))
        # up to ROPE_ELEMENTS per program, but at least ~one program per SM when T allows (decode: latency)
        spread = max(1, T * cdiv(R, block_r) // 128)
        block_t = max(1, min(64, ROPE_ELEMENTS // (block_r * 2 * half), 1 << (spread.bit_length() - 1)))
        _rope_kernel[(cdiv(T, block_t), cdiv(R, block_r))](
            x3, table[0], table[1], out, T, R, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            D=d, HALF=half, BLOCK_T=block_t, BLOCK_R=block_r,
            BLOCK_D=min(max(1, ROPE_ELEMENTS // (block_t * block_r)), next_power_of_2(max(1, d - 2 * half))),
            INVERSE=bool(inverse), COPY_NOPE=not inplace, num_warps=4)
    return x if inplace else out.view(x.shape)


REGISTRATIONS = {"rope32": rope32, "rope_table32": rope_table32}
