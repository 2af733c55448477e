"""Triton FP4 (E2M1) fake quantisation with E8M0 scales per 32 values: the CUDA twin of
`official_fused.fp4_fake_quant` (= `formats.fp4_fake_quant(x, 32)`), bit for bit.

Owns: `fp4_fake_quant(x, block=32)`. Per block of 32 values: amax (floored at 6 * 2**-126) -> the official
pow2 scale 2**ceil(log2(amax * fp32(1/6))) by the exponent-bit trick -> x / s (exact: s is a power of
two, applied as its exact reciprocal) clamped to 6 -> the nearest E2M1 value, ties to the even code ->
value * s rounded to x's dtype; zero codes keep a +0 sign, as the torch codec's. Only exact operations
(compares, power-of-two products, bit arithmetic), so the GPU result equals the torch twin's bits.
On torch this is ~30 kernels (the indexer's q path runs it every ratio-4 layer and decode step); here one.
STATUS: bit-exact under TRITON_INTERPRET (tests/test_kernels_decode.py); its `-m gpu` test has NOT run on a
GPU yet, so this module is NOT in kernels.triton.KERNEL_MODULES: add "fp4_quant" there once it passes.
Must not: pack codes (the cache layouts do), or be imported off CUDA (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32


@triton.jit
def _fp4_fake_quant_kernel(x_ptr, out_ptr, n_blocks, BB: tl.constexpr, BLK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    j = tl.arange(0, BLK)
    bmask = b < n_blocks
    off = b[:, None] * BLK + j[None, :]
    m = bmask[:, None] & (j[None, :] < BLK)
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 6.0 * 1.1754943508222875e-38)  # 6 * 2**-126
    prod = amax * (1.0 / 6.0)  # fp32 product with the rounded fp32 reciprocal, as the official kernel
    bits = prod.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent of the pow2 ceiling
    s = (e << 23).to(tl.float32, bitcast=True)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1/s exactly (e <= 253 for finite amax)
    mag = tl.minimum(tl.abs(x * inv_s[:, None]), 6.0)
    # E2M1 grid 0, .5, 1, 1.5, 2, 3, 4, 6: code = number of midpoints passed; at a midpoint the even code
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    val = tl.where(code <= 4, code.to(tl.float32) * 0.5,
                   tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0)))
    val = tl.where((x < 0) & (code != 0), -val, val)
    tl.store(out_ptr + off, (val * s[:, None]).to(out_ptr.dtype.element_ty), mask=m)


def fp4_fake_quant(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> the FP4-quantised values in x's dtype; see the torch twin."""
    if block != BLOCK:
        raise ValueError(f"fp4_fake_quant (Triton) has blocks of {BLOCK} values, got block={block}")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"fp4_fake_quant: last dimension {x.shape[-1]} is not a multiple of {BLOCK}")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // BLOCK
    if n_blocks:
        bb = 16
        _fp4_fake_quant_kernel[(triton.cdiv(n_blocks, bb),)](xc, out, n_blocks, BB=bb, BLK=BLOCK, num_warps=4)
    return out


REGISTRATIONS = {"fp4_fake_quant": fp4_fake_quant}
