"""Triton codec of the FP8 KV layouts of `cache/layouts.py` (codec "fp8_e8m0": v4_fp8_ds_mla, v41_window_fp8).

Owns: `kv_encode(layout, x)`, `kv_encode_into(layout, x, store, rows, keep)` (the same bytes stored
straight into cache rows, where keep) and `kv_decode(layout, packed)`, meant as the CUDA twins of `KVLayout.store` /
`.load` bit for bit (tests/test_kernels_attn.py `-m gpu`, and under TRITON_INTERPRET); registered in
kernels.triton.KERNEL_MODULES, so fast numerics' cache encode/decode on cuda goes through it. x rounded to bf16, per block of `layout.block` channels
amax (floored at 1e-4) -> the official pow2 scale 2**ceil(log2(amax * fp32(1/448))) by the exponent-bit
trick -> E4M3 RNE of clamp(x / s, +-448); the entry bytes [E4M3 values | rope tail as raw bf16 | E8M0
scale bytes | zero pad]. Decode multiplies the E4M3 value by its scale in fp32 and rounds to bf16, as the
oracle's fake-quant does. One program per entry, one pass each way (the torch codec makes ~15 passes).
FP4 index-key layouts (codec fp4_e8m0, no raw tail) go to `fp4_quant`'s codec (bit-identical to the layout
codec on the H200, tests/test_kernels_decode.py -m gpu, 2026-12-01); other codecs (V4.1's latents, bf16,
the seed's) to the layout's torch codec.
Must not: import `cache` (the layout object is passed in); be imported off CUDA (imports triton).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.act_quant import pow2_scale
from deepinfer.kernels.triton.fp4_quant import fp4_codec_supported, fp4_decode_supported, fp4_kv_decode, fp4_kv_encode
from deepinfer.kernels.triton.launch import fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

FP8_MAX = tl.constexpr(448.0)  # jit code reads module globals only as constexpr
FP8_AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def e4m3_blocks(x):
    """x [blocks, BLOCK] fp32 (bf16 values) -> (E4M3 codes of x / 2^e, the E8M0 exponent bytes e [blocks] as
    int32) per block: the pow2 ceiling of amax / 448 (amax floored at 1e-4; the product's exponent field, + 1
    if any mantissa bit), x / scale clamped to +-448 and rounded to E4M3. The official act_quant's block
    codec, shared by every kernel that packs FP8 cache rows (their bytes must agree to the bit)."""
    s, _ = pow2_scale(tl.maximum(tl.max(tl.abs(x), axis=1), FP8_AMAX_FLOOR))  # act_quant's scale
    e = s.to(tl.int32, bitcast=True) >> 23  # its biased exponent: the E8M0 byte
    return tl.minimum(tl.maximum(x / s[:, None], -FP8_MAX), FP8_MAX).to(tl.float8e4nv), e


@fast_launch
@triton.jit
def _encode_kernel(x_ptr, out8_ptr, out16_ptr, stride_x, BPT, dst_ptr, keep_ptr,
                   QDIM: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NB_P2: tl.constexpr,
                   ROPE: tl.constexpr, ROPE_P2: tl.constexpr, PAD: tl.constexpr, INTO: tl.constexpr,
                   KEEP: tl.constexpr, PDL: tl.constexpr = False):
    """Program = x's row; its bytes go to output row dst[row] (INTO) or row, and only where keep[row] (KEEP)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if KEEP:
        if tl.load(keep_ptr + row) == 0:
            return
    nb = tl.arange(0, NB_P2)
    j = tl.arange(0, BLOCK)
    bmask = nb < NB
    ch = nb[:, None] * BLOCK + j[None, :]
    m = bmask[:, None] & (j[None, :] < BLOCK)
    x = tl.load(x_ptr + row * stride_x + ch, mask=m, other=0.0).to(tl.bfloat16).to(tl.float32)
    q, e = e4m3_blocks(x)
    if INTO:
        base = tl.load(dst_ptr + row).to(tl.int64) * BPT
    else:
        base = row * BPT
    tl.store(out8_ptr + base + ch, q.to(tl.uint8, bitcast=True), mask=m)
    if ROPE > 0:  # raw bf16 tail, written through the int16 view of the same bytes (offsets are even)
        r = tl.arange(0, ROPE_P2)
        rm = r < ROPE
        raw = tl.load(x_ptr + row * stride_x + QDIM + r, mask=rm, other=0.0).to(tl.bfloat16)
        tl.store(out16_ptr + (base + QDIM) // 2 + r, raw.to(tl.int16, bitcast=True), mask=rm)
    tl.store(out8_ptr + base + QDIM + 2 * ROPE + nb, e.to(tl.uint8), mask=bmask)
    if PAD > 0:
        p = tl.arange(0, 8)
        tl.store(out8_ptr + base + QDIM + 2 * ROPE + NB + p, tl.zeros((8,), tl.uint8), mask=p < PAD)


@triton.jit
def e8m0_value(byte):
    """E8M0 bytes -> fp32 2**(byte-127), every byte as the layout codec reads it: the fp32 exponent field,
    except 0 (2**-127, a subnormal) and 0xFF (NaN)."""
    b = byte.to(tl.int32)
    return tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23)).to(tl.float32, bitcast=True)


@fast_launch
@triton.jit
def _decode_kernel(in8_ptr, in16_ptr, out_ptr, BPT,
                   QDIM: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, NB_P2: tl.constexpr,
                   ROPE: tl.constexpr, ROPE_P2: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    nb = tl.arange(0, NB_P2)
    j = tl.arange(0, BLOCK)
    bmask = nb < NB
    ch = nb[:, None] * BLOCK + j[None, :]
    m = bmask[:, None] & (j[None, :] < BLOCK)
    base = row * BPT
    v = tl.load(in8_ptr + base + ch, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = e8m0_value(tl.load(in8_ptr + base + QDIM + 2 * ROPE + nb, mask=bmask, other=127))
    dim: tl.constexpr = QDIM + ROPE
    tl.store(out_ptr + row * dim + ch, (v * s[:, None]).to(tl.bfloat16), mask=m)
    if ROPE > 0:
        r = tl.arange(0, ROPE_P2)
        rm = r < ROPE
        raw = tl.load(in16_ptr + (base + QDIM) // 2 + r, mask=rm, other=0).to(tl.bfloat16, bitcast=True)
        tl.store(out_ptr + row * dim + QDIM + r, raw, mask=rm)


def _on_device(t: torch.Tensor) -> bool:
    """CUDA tensors, or any under TRITON_INTERPRET=1 (local checks at tiny shapes)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _fp8_geometry(layout) -> dict:
    nb = layout.n_scales
    return dict(QDIM=layout.quant_dim, BLOCK=layout.block, NB=nb, NB_P2=next_power_of_2(nb),
                ROPE=layout.raw_dim, ROPE_P2=next_power_of_2(max(1, layout.raw_dim)))


def _supported(layout) -> bool:
    """fp8_e8m0 with a power-of-two block and byte offsets the int16 view can address."""
    return (layout.codec == "fp8_e8m0" and layout.block & (layout.block - 1) == 0
            and layout.bytes_per_token % 2 == 0 and layout.quant_dim % 2 == 0)


def kv_encode(layout, x: torch.Tensor) -> torch.Tensor:
    """Same contract as `layout.store(x)`: [..., dim] float -> uint8 [..., bytes_per_token]."""
    if fp4_codec_supported(layout) and _on_device(x):  # the FP4 index keys
        return fp4_kv_encode(layout, x)
    if not _supported(layout) or not _on_device(x):
        return layout.store(x)
    if x.shape[-1] != layout.dim:
        raise ValueError(f"{layout.name}: expected last dimension {layout.dim}, got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, layout.dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], layout.bytes_per_token, dtype=torch.uint8, device=x.device)
    _fp8_encode(layout, x2, out)
    return out.reshape(*lead, layout.bytes_per_token)


def _fp8_encode(layout, x2: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> None:
    """`_encode_kernel` over x2 [T, dim] (unit channel stride): row t's bytes to out[t], or with `rows` to
    out[rows[t]] where keep[t] (keep None: every row)."""
    if not x2.shape[0]:
        return
    bpt = layout.bytes_per_token
    pad = bpt - layout.value_bytes - 2 * layout.raw_dim - layout.scale_bytes
    dst = out if rows is None else rows
    _encode_kernel[(x2.shape[0],)](x2, out, out.view(torch.int16), x2.stride(0), bpt, dst,
                                   dst if keep is None else keep, PAD=pad, INTO=rows is not None,
                                   KEEP=keep is not None, num_warps=4, **_fp8_geometry(layout))


def kv_encode_into(layout, x: torch.Tensor, store: torch.Tensor, rows: torch.Tensor,
                   keep: torch.Tensor | None = None) -> None:
    """`official_fused.kv_encode_into` (store[rows] = where(keep, encode(x), store[rows])) with the encode
    kernel storing each kept row's bytes straight into the cache row: one launch instead of the encode, the
    gather of the old rows, the select and the scatter. Rows must be distinct where kept (the decode step's
    are: one token per sequence; its padding rows all write the scratch slot, whichever lands last)."""
    from deepinfer.kernels.official_fused import _check_encode_into, kv_encode_into as twin

    fp4 = fp4_codec_supported(layout)
    if not (fp4 or _supported(layout)) or not _on_device(x):
        return twin(layout, x, store, rows, keep)
    _check_encode_into(layout, x, store, rows, keep)
    if fp4:
        return fp4_kv_encode(layout, x, into=(store, rows, keep))
    _fp8_encode(layout, x if x.stride(-1) == 1 else x.contiguous(), store, rows, keep)


def kv_decode(layout, packed: torch.Tensor) -> torch.Tensor:
    """Same contract as `layout.load(packed)`: uint8 [..., bytes_per_token] -> bf16 [..., dim]."""
    if fp4_decode_supported(layout) and _on_device(packed):  # the FP4 index keys, V4.1's FP4 latents
        return fp4_kv_decode(layout, packed)
    if not _supported(layout) or not _on_device(packed):
        return layout.load(packed)
    bpt = layout.bytes_per_token
    if packed.dtype != torch.uint8 or packed.shape[-1] != bpt:
        raise ValueError(f"{layout.name}: expected uint8 [..., {bpt}], got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    p2 = packed.reshape(-1, bpt).contiguous()
    out = torch.empty(p2.shape[0], layout.dim, dtype=torch.bfloat16, device=packed.device)
    if p2.shape[0]:
        _decode_kernel[(p2.shape[0],)](p2, p2.view(torch.int16), out, bpt, num_warps=4, **_fp8_geometry(layout))
    return out.reshape(*lead, layout.dim)


def kv_decode_rows(layout, store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`official_fused.kv_decode_rows` (the values of a packed store's rows `rows`): the FP4 layouts in one
    launch that reads the rows where they are (`fp4_kv_decode(..., rows=)`); the others gather, then decode."""
    from deepinfer.kernels.official_fused import kv_decode_rows as twin

    if fp4_decode_supported(layout) and _on_device(store) and store.dim() == 2 and rows.dtype == torch.int64:
        return fp4_kv_decode(layout, store, rows)
    if _on_device(store) and store.dim() == 2:
        return kv_decode(layout, store[rows.clamp(min=0)])
    return twin(layout, store, rows)


REGISTRATIONS = {"kv_encode": kv_encode, "kv_encode_into": kv_encode_into, "kv_decode": kv_decode,
                 "kv_decode_rows": kv_decode_rows}
