"""Triton RoPE with the official numerics: the CUDA twin of `kernels.official.rope32`.

Owns: the interleaved rotation of the LAST 2*len(freqs) channels of x [T, ..., d] by position * freq, fp32
math, result in x's dtype, written together with the untouched leading channels in one pass (the torch
version slices, rotates through complex64 and concatenates: four passes). The cos/sin table [T, rd/2] is
computed by torch from the same fp32 angles the official precompute uses (tiny next to x, and torch's
cos/sin are the accurate ones; an approximate in-kernel sine is wrong at positions of a million).
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
                 INVERSE: tl.constexpr):
    """x viewed as [T, R, D] (R = product of the middle dims); one program per (token, block of R rows)."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    # the pass-through channels [0, D - 2*HALF)
    NOPE: tl.constexpr = D - 2 * HALF
    if NOPE > 0:
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


def rope32(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Same contract as `official.rope32`: x [T, ..., d], positions [T], freqs [rd/2] fp32 -> new tensor."""
    if x.dtype == torch.float64:
        return official.rope32(x, positions, freqs, inverse)
    half = freqs.shape[0]
    d = x.shape[-1]
    if x.dim() < 2 or positions.shape != (x.shape[0],) or 2 * half > d or half & (half - 1):
        raise ValueError(f"rope32: want x [T, ..., d] with positions [T] and a power-of-two count of pair "
                         f"frequencies <= d/2; got x {tuple(x.shape)}, positions {tuple(positions.shape)}, "
                         f"freqs {tuple(freqs.shape)}")
    T = x.shape[0]
    x3 = x.reshape(T, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if x3.numel():
        angles = torch.outer(positions.to(torch.float32), freqs.to(x.device, torch.float32))
        cos, sin = torch.cos(angles).contiguous(), torch.sin(angles).contiguous()
        R = x3.shape[1]
        block_r = min(16, triton.next_power_of_2(R))
        _rope_kernel[(T, triton.cdiv(R, block_r))](
            x3, cos, sin, out, R, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            D=d, HALF=half, BLOCK_R=block_r, BLOCK_D=min(128, triton.next_power_of_2(max(1, d - 2 * half))),
            INVERSE=bool(inverse), num_warps=4)
    return out.view(x.shape)


REGISTRATIONS = {"rope32": rope32}
