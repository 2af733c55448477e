"""Triton FP4 (E2M1) fake quantisation with E8M0 scales per 32 values: the CUDA twin of
`official_fused.fp4_fake_quant` (= `formats.fp4_fake_quant(x, 32)`), bit for bit.

Owns: `fp4_fake_quant(x, block=32)`, and `fp4_kv_encode(layout, x)` / `fp4_kv_decode(layout, packed)`: the
same quantisation as the packed codec of the index-key layouts (codec "fp4_e8m0" with no raw tail:
v4_index_fp4, v41_index_fp4), the CUDA twins of `KVLayout.store` / `.load` byte for byte (codes packed two
a byte, even index in the low nibble, then one E8M0 byte per block; zero pad). `fp4_kv_decode` also reads V4.1's
latents (codec "fp4_e4m3": an E4M3 scale byte per block of 16, exact in fp32 as well).
Per block of 32 values: amax (floored at 6 * 2**-126) -> the official pow2 scale
2**ceil(log2(amax * fp32(1/6))) by the exponent-bit trick -> x / s (exact: s is a power of two, applied as
its exact reciprocal) clamped to 6 -> the nearest E2M1 value, ties to the even code ->
value * s rounded to x's dtype; zero codes keep a +0 sign, as the torch codec's. Only exact operations
(compares, power-of-two products, bit arithmetic), so the GPU result equals the torch twin's bits.
On torch this is ~30 kernels (the indexer's q path runs it every ratio-4 layer and decode step); here one.
STATUS: bit-exact under TRITON_INTERPRET and on the H200 (tests/test_kernels_decode.py -m gpu passed there,
2026-12-01), so it is registered (kernels.triton.KERNEL_MODULES), and kv_pack.kv_encode / kv_decode hand
the fp4_e8m0 index-key layouts (`fp4_codec_supported`) to the codec here.
Must not: import `cache` (the layout object is passed in), or be imported off CUDA (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

BLOCK = 32


@fast_launch
@triton.jit
def _fp4_fake_quant_kernel(x_ptr, out_ptr, n_blocks, BB: tl.constexpr, BLK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
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


@triton.jit
def _fp4_codes(x, inv_s):
    """fp32 values (already bf16-exact) x / s -> E2M1 codes 0..15 (sign bit 8 only for non-zero codes)."""
    mag = tl.minimum(tl.abs(x * inv_s), 6.0)
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    return code | (((x < 0) & (code != 0)).to(tl.int32) << 3)


@triton.jit
def _fp4_value(code):
    """E2M1 code 0..15 -> fp32 value (code 8 is -0.0, as the torch table)."""
    c = code & 7
    mag = tl.where(c <= 4, c.to(tl.float32) * 0.5, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))
    return mag * tl.where((code & 8) != 0, -1.0, 1.0)  # a product keeps -0.0 (Triton's negation is 0 - x)


@fast_launch
@triton.jit
def _fp4_encode_kernel(x_ptr, out_ptr, stride_x, BPT, dst_ptr, keep_ptr, NB: tl.constexpr, NB_P2: tl.constexpr,
                       HALF: tl.constexpr, PAD: tl.constexpr, PAD_P2: tl.constexpr, INTO: tl.constexpr,
                       KEEP: tl.constexpr, PDL: tl.constexpr = False):
    """Program = x's row; its bytes go to output row dst[row] (INTO) or row, and only where keep[row] (KEEP)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if KEEP:
        if tl.load(keep_ptr + row) == 0:
            return
    nb = tl.arange(0, NB_P2)
    j = tl.arange(0, HALF)  # byte j of a block holds values 2j (low nibble) and 2j + 1 (high nibble)
    m = (nb < NB)[:, None] & (j[None, :] < HALF)
    ch = nb[:, None] * (2 * HALF) + 2 * j[None, :]
    xe = tl.load(x_ptr + row * stride_x + ch, mask=m, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + row * stride_x + ch + 1, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1)),
                      6.0 * 1.1754943508222875e-38)
    bits = (amax * (1.0 / 6.0)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv_s = ((254 - e) << 23).to(tl.float32, bitcast=True)
    byte = _fp4_codes(xe, inv_s[:, None]) | (_fp4_codes(xo, inv_s[:, None]) << 4)
    if INTO:
        base = tl.load(dst_ptr + row).to(tl.int64) * BPT
    else:
        base = row * BPT
    tl.store(out_ptr + base + nb[:, None] * HALF + j[None, :], byte.to(tl.uint8), mask=m)
    tl.store(out_ptr + base + NB * HALF + nb, e.to(tl.uint8), mask=nb < NB)
    if PAD > 0:
        p = tl.arange(0, PAD_P2)
        tl.store(out_ptr + base + NB * HALF + NB + p, tl.zeros([PAD_P2], dtype=tl.uint8), mask=p < PAD)


@triton.jit
def _e4m3_value(b):
    """E4M3 (fn) bytes 0..255 as int32 -> their exact fp32 values: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m * 2**-9), 0x7F / 0xFF NaN (no infinities in the fn variant). Built from
    the bits, not by a float8 cast (which the CPU interpreter does not have)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = ((e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)  # 2**(e - 7) * (1 + m / 8)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return v * tl.where((b & 0x80) != 0, -1.0, 1.0)  # a product keeps -0.0 (Triton's negation is 0 - x)


@fast_launch
@triton.jit
def _fp4_decode_kernel(p_ptr, rows_ptr, out_ptr, n_rows, BPT, NB: tl.constexpr, NB_P2: tl.constexpr,
                       HALF: tl.constexpr, E4M3: tl.constexpr, ROWS: tl.constexpr, INDEXED: tl.constexpr,
                       PDL: tl.constexpr = False):
    """ROWS output rows a program; output row r decodes packed row rows[r] (INDEXED; a negative index reads
    row 0) or row r. Each row's values are stored contiguously (the two nibbles of a byte joined first)."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    if INDEXED:
        src = tl.maximum(tl.load(rows_ptr + r, mask=rmask, other=0).to(tl.int64), 0)
    else:
        src = r
    nb = tl.arange(0, NB_P2)
    j = tl.arange(0, HALF)
    bm = rmask[:, None] & (nb < NB)[None, :]  # [ROWS, NB_P2]
    m = bm[:, :, None] & (j[None, None, :] < HALF)
    base = src[:, None, None] * BPT
    byte = tl.load(p_ptr + base + nb[None, :, None] * HALF + j[None, None, :], mask=m, other=0).to(tl.int32)
    b = tl.load(p_ptr + src[:, None] * BPT + NB * HALF + nb[None, :], mask=bm, other=127).to(tl.int32)
    if E4M3:  # V4.1's latents: one E4M3 scale byte per block
        s = _e4m3_value(b)
    else:
        # 2**(b - 127): the normal fp32 with exponent field b; b == 0 is the subnormal 2**-127; 0xFF is NaN
        s = tl.where(b == 0, tl.full([ROWS, NB_P2], 0x00400000, tl.int32), b << 23).to(tl.float32, bitcast=True)
        s = tl.where(b == 0xFF, float("nan"), s)
    lo = (_fp4_value(byte & 15) * s[:, :, None]).to(tl.bfloat16, fp_downcast_rounding="rtne")
    hi = (_fp4_value(byte >> 4) * s[:, :, None]).to(tl.bfloat16, fp_downcast_rounding="rtne")
    vals = tl.reshape(tl.join(lo, hi), [ROWS, NB_P2, 2 * HALF])  # value 2j from the low nibble, 2j + 1 the high
    c = tl.arange(0, 2 * HALF)
    tl.store(out_ptr + r[:, None, None] * (NB * 2 * HALF) + nb[None, :, None] * (2 * HALF) + c[None, None, :], vals,
             mask=bm[:, :, None] & (c[None, None, :] < 2 * HALF))


def fp4_codec_supported(layout) -> bool:
    """fp4_e8m0 layouts without a raw bf16 tail (the index keys), blocks of an even power-of-two size."""
    return (layout.codec == "fp4_e8m0" and layout.raw_dim == 0 and layout.block >= 2
            and layout.block & (layout.block - 1) == 0)


def fp4_kv_encode(layout, x: torch.Tensor, into: tuple | None = None) -> torch.Tensor | None:
    """Same contract as `layout.store(x)` for `fp4_codec_supported` layouts: [..., dim] -> uint8 [..., bpt].
    into=(store, rows, keep): x [T, dim]'s bytes written straight into store's rows[t] where keep[t] (keep None:
    every row; `kv_pack.kv_encode_into` checks the arguments), nothing returned."""
    if not fp4_codec_supported(layout):
        raise ValueError(f"fp4_kv_encode: layout {layout.name} ({layout.codec}, raw {layout.raw_dim}) not supported")
    if x.shape[-1] != layout.dim:
        raise ValueError(f"{layout.name}: expected last dimension {layout.dim}, got {tuple(x.shape)}")
    lead, bpt = x.shape[:-1], layout.bytes_per_token
    # rounded to bf16 first, as `store` (by torch: one RNE cast, only when the caller passes wider values)
    x2 = x.reshape(-1, layout.dim).to(torch.bfloat16)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if into is None:
        out = torch.empty(x2.shape[0], bpt, dtype=torch.uint8, device=x.device)
        dst = keep = out
    else:
        out, dst, keep = into
    if x2.shape[0]:
        nb = layout.n_scales
        pad = bpt - layout.value_bytes - layout.scale_bytes
        _fp4_encode_kernel[(x2.shape[0],)](x2, out, x2.stride(0), bpt, dst, keep if keep is not None else dst,
                                           NB=nb, NB_P2=next_power_of_2(nb), HALF=layout.block // 2, PAD=pad,
                                           PAD_P2=next_power_of_2(max(pad, 1)), INTO=into is not None,
                                           KEEP=into is not None and keep is not None, num_warps=1)
    return out.reshape(*lead, bpt) if into is None else None


def fp4_decode_supported(layout) -> bool:
    """What `fp4_kv_decode` reads: the `fp4_codec_supported` layouts and V4.1's fp4_e4m3 latents (an E4M3
    scale byte per block; their encode stays on the torch codec)."""
    return fp4_codec_supported(layout) or (layout.codec == "fp4_e4m3" and layout.raw_dim == 0
                                           and layout.block >= 2 and layout.block & (layout.block - 1) == 0)


DECODE_ROWS = 16  # rows a decode program (4 warps): one row of one warp per program wrote 2-byte values 4 bytes
# apart and took ~96 us for a b32 step's 16K latent rows on an H100 (2026-12-06)


def fp4_kv_decode(layout, packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `layout.load(packed)` for `fp4_decode_supported` layouts: uint8 [..., bpt] -> bf16.
    rows (int64, any shape): `layout.load(packed[rows.clamp(min=0)])` of the packed store [N, bpt] instead, in
    one launch (no gathered copy of the rows)."""
    if not fp4_decode_supported(layout):
        raise ValueError(f"fp4_kv_decode: layout {layout.name} ({layout.codec}, raw {layout.raw_dim}) not supported")
    bpt = layout.bytes_per_token
    if packed.dtype != torch.uint8 or packed.shape[-1] != bpt or (rows is not None and packed.dim() != 2):
        raise ValueError(f"{layout.name}: expected uint8 [..., {bpt}] ([N, {bpt}] with rows), got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    lead = packed.shape[:-1] if rows is None else rows.shape
    p2 = packed.reshape(-1, bpt).contiguous() if rows is None else packed.contiguous()
    idx = None if rows is None else rows.reshape(-1).contiguous()
    n = p2.shape[0] if rows is None else idx.numel()
    out = torch.empty(n, layout.dim, dtype=torch.bfloat16, device=packed.device)
    if n:
        nb = layout.n_scales
        _fp4_decode_kernel[(cdiv(n, DECODE_ROWS),)](p2, idx if idx is not None else p2, out, n, bpt, NB=nb,
                                                    NB_P2=next_power_of_2(nb), HALF=layout.block // 2,
                                                    E4M3=layout.codec == "fp4_e4m3", ROWS=DECODE_ROWS,
                                                    INDEXED=idx is not None, num_warps=4)
    return out.reshape(*lead, layout.dim)



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
        _fp4_fake_quant_kernel[(cdiv(n_blocks, bb),)](xc, out, n_blocks, BB=bb, BLK=BLOCK, num_warps=4)
    return out


REGISTRATIONS = {"fp4_fake_quant": fp4_fake_quant}
