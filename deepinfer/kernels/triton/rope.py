"""Triton RoPE with the official numerics: the CUDA twin of `kernels.official.rope32`.

Owns: the interleaved rotation of the LAST 2*len(freqs) channels of x [T, ..., d] by position * freq, fp32
math, result in x's dtype, written together with the untouched leading channels in one pass (the torch
version slices, rotates through complex64 and concatenates: four passes), or in place (`inplace=True`):
only the rope channels are read and written, 1/8 of the bytes for V4's q and o (64 of 512 channels; it did
not move the 8k prefill's 3.8 ms of RoPE on the H200: the kernel is not bandwidth bound, an open item in
BENCHMARKS.md). The cos/sin table [2, T, rd/2]
(`rope_table32`) is computed by torch from the same fp32 angles the official precompute uses (tiny next to
x, and torch's cos/sin are the accurate ones; an approximate in-kernel sine is wrong at positions of a
million); a step passes one table to all of its calls with the same positions and frequencies.
Must not: change the channel layout (interleaved pairs, rope channels last); be imported off CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import official


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, R, stride_xt, stride_xr, stride_ot, stride_or,
                 D: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr):
    """x viewed as [T, R, D] (R = product of the middle dims); one program per (token, block of R rows).
    COPY_NOPE=False: out is x (in place), the pass-through channels are neither read nor written.
    (One program per 64 rows of any tokens instead, tried 2026-12-02: 5.1 ms against 3.8 ms per 8k prefill
    on the H200, so the grid stayed per token.)"""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    # the pass-through channels [0, D - 2*HALF)
    NOPE: tl.constexpr = D - 2 * HALF
    if COPY_NOPE and NOPE > 0:
        for c0 in range(0, NOPE, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            m = rmask[:, None] & (cols < NOPE)[None, :]
            v = tl.load(x_ptr + t * stride_xt + rows[:, None] * stride_xr + cols[None, :], mask=m)
            tl.store(out_ptr + t * stride_ot + rows[:, None] * stride_or + cols[None, :], v, mask=m)
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t * HALF + i)
    s = tl.load(sin_ptr + t * HALF + i)
    if INVERSE:
        s = -s
    re_off = rows[:, None] * stride_xr + (NOPE + 2 * i)[None, :]
    re = tl.load(x_ptr + t * stride_xt + re_off, mask=rmask[:, None]).to(tl.float32)
    im = tl.load(x_ptr + t * stride_xt + re_off + 1, mask=rmask[:, None]).to(tl.float32)
    o_off = t * stride_ot + rows[:, None] * stride_or + (NOPE + 2 * i)[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + o_off, (re * c[None, :] - im * s[None, :]).to(dt), mask=rmask[:, None])
    tl.store(out_ptr + o_off + 1, (re * s[None, :] + im * c[None, :]).to(dt), mask=rmask[:, None])


def rope_table32(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """This kernel's table for positions [T]: fp32 [2, T, rd/2] = (cos, sin) of the fp32 angles, by torch's
    cos/sin written into one buffer (4 kernels). A step builds it once per frequency table and passes it to
    every `rope32(..., table=)` of those positions; without one, `rope32` builds it itself (the same bits)."""
    angles = torch.outer(positions.to(torch.float32), freqs.to(positions.device, torch.float32))
    table = torch.empty((2,) + tuple(angles.shape), dtype=torch.float32, device=angles.device)
    torch.cos(angles, out=table[0])
    torch.sin(angles, out=table[1])
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
        block_r = min(16, triton.next_power_of_2(R))
        _rope_kernel[(T, triton.cdiv(R, block_r))](
            x3, table[0], table[1], out, R, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            D=d, HALF=half, BLOCK_R=block_r, BLOCK_D=min(128, triton.next_power_of_2(max(1, d - 2 * half))),
            INVERSE=bool(inverse), COPY_NOPE=not inplace, num_warps=4)
    return x if inplace else out.view(x.shape)


REGISTRATIONS = {"rope32": rope32, "rope_table32": rope_table32}
