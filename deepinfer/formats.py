"""Number formats of the DeepSeek-V4 checkpoints and of the official kernels' quantisation.

Owns: encode/decode of FP8 E4M3, FP4 E2M1 (two codes per byte, low nibble = even index), E8M0 and
E4M3-as-scale; the emulation of the official `act_quant` / `fp4_act_quant` kernels (spec §6.1, §6.2,
§10.6); dequantisation of block-scaled weights; the FP4->FP8 tile conversion of the official
`convert.py` (spec §5.4) with a check of its scale-span condition.

Must not: know about layers or tensor names (that is `weights/`), or pick numerics policies (that is
the caller's job). Everything here is a pure function of its tensor arguments.

Bit-level facts this module relies on (checked by tests/test_formats.py):
* E8M0 byte b encodes 2**(b-127); 0xFF is NaN.
* The official kernels compute power-of-two scales as 2**ceil(log2(amax * fp32(1/max))) by reading
  the fp32 exponent and adding one when any mantissa bit is set — so the product with the *rounded*
  fp32 reciprocal decides the rounding, not amax/max. We reproduce that bit trick exactly.
* torch's float8_e4m3fn cast rounds to nearest even; out-of-range values must be clamped first
  (the kernels clamp to +-448 before casting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4  # act_quant clamps amax from below (spec §6.1)
FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # fp4_act_quant with E8M0 scales (spec §6.2)
FP4_AMAX_FLOOR_E4M3_SCALE = 6.0 * 2.0**-9  # fp4_act_quant with E4M3 scales, V4.1 (spec §10.6)
FP4_BLOCK = 32  # K elements per E8M0 scale of a packed FP4 weight row

# E2M1 code -> value; bit 3 is the sign (code 8 is -0, decoded as 0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_TABLE = torch.tensor(list(FP4_VALUES) + [-v for v in FP4_VALUES], dtype=torch.float32)
_FP4_TABLE_ON: dict[torch.device, torch.Tensor] = {}


def _fp4_table_on(device: torch.device) -> torch.Tensor:
    """The E2M1 table kept on each device: no host-to-device copy per call (it would break CUDA graph capture)."""
    table = _FP4_TABLE_ON.get(device)
    if table is None:
        table = _FP4_TABLE_ON[device] = _FP4_TABLE.to(device)
    return table


# ----------------------------------------------------------------------------------------------
# scalar formats
# ----------------------------------------------------------------------------------------------
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scales (float8_e8m0fnu, or raw uint8 bytes) to fp32: 2**(byte-127), 0xFF -> NaN."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be float8_e8m0fnu or uint8 bytes, got {scale.dtype}")
    exp = scale.to(torch.int32) - 127
    out = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
    return torch.where(scale == 0xFF, torch.full_like(out, float("nan")), out)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode positive powers of two (fp32) as float8_e8m0fnu. Raises if a value is not a power of two."""
    s = scale.to(torch.float32)
    mant, exp = torch.frexp(s)  # s = mant * 2**exp with mant in [0.5, 1)
    if not bool(((mant == 0.5) & (s > 0)).all()):
        raise ValueError("E8M0 can only hold positive powers of two")
    byte = exp - 1 + 127
    if not bool(((byte >= 0) & (byte <= 254)).all()):  # was silently clamped (2**-130 -> 2**-127)
        raise ValueError("E8M0 can only hold powers of two from 2**-127 to 2**127")
    return byte.to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any scale tensor (E8M0, E4M3 or float) as fp32."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(scale)
    return scale.to(torch.float32)


def pow2_ceil_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """2**ceil(log2(amax * fp32(1/max_value))) by the kernels' exponent-bit trick (fp32 in, fp32 out).

    `amax` must already be floored to a normal fp32 number (both callers floor it).
    """
    prod = amax.to(torch.float32) * torch.tensor(1.0 / max_value, dtype=torch.float32)
    bits = prod.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mantissa_set = (bits & 0x7FFFFF) != 0
    e = exp - 127 + mantissa_set.to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


# ----------------------------------------------------------------------------------------------
# FP4 E2M1
# ----------------------------------------------------------------------------------------------
def _fp4_bucket_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(boundaries [15] fp32, bucket -> code [16] uint8, bucket -> value [16] fp32) on `device`, see `_fp4_buckets`."""
    tables = _FP4_BUCKETS_ON.get(device)
    if tables is None:
        tables = _FP4_BUCKETS_ON[device] = tuple(t.to(device) for t in _FP4_BUCKETS)
    return tables


def _fp4_bucket_tables_host() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mids = [(a + b) / 2 for a, b in zip(FP4_VALUES, FP4_VALUES[1:])]  # 0.25, 0.75, ..., 5 (exact in fp32)
    f32 = torch.float32
    below = lambda v: torch.nextafter(torch.tensor(v, dtype=f32), torch.tensor(-math.inf, dtype=f32)).item()  # noqa: E731
    # x > m counts a midpoint whose lower code is even (a tie stays there), x >= m one whose lower code is
    # odd (a tie goes up): bucketize counts boundaries b < x, and x >= m is x > the float just below m
    pos = [m if j % 2 == 0 else below(m) for j, m in enumerate(mids)]
    neg = [below(-m) if j % 2 == 0 else -m for j, m in enumerate(mids)]  # mirrored: -x > m, -x >= m
    bounds = torch.tensor(sorted(neg) + pos + [math.inf], dtype=f32)
    # bucket 0..6: codes -6 .. -0.5; 7: zero (+0, as a negative value that rounds to 0 keeps code 0);
    # 8..14: 0.5 .. 6 (x = +inf included); 15: NaN (no boundary is below it), code 0 like the grid search's
    codes = [8 + c for c in range(7, 0, -1)] + [0] + list(range(1, 8)) + [0]
    codes = torch.tensor(codes, dtype=torch.uint8)
    return bounds, codes, _FP4_TABLE[codes.long()]


_FP4_BUCKETS = _fp4_bucket_tables_host()
_FP4_BUCKETS_ON: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _fp4_buckets(x: torch.Tensor) -> torch.Tensor:
    """int32 bucket 0..15 of fp32 values on the signed E2M1 grid (see `_fp4_bucket_tables_host`): one
    binary search per value against the 14 signed midpoints (+inf), instead of a distance to each of the 8
    grid values (an [..., 8] tensor and ~10 passes over it: at an 8k prefill the indexer q's FP4 fake-quant
    moved ~20 GB per layer that way). Same codes as the grid search bit for bit, saturation, ties to the
    even code, +0 for negatives that round to 0 and NaN -> 0 included (checked once against it on every fp32
    value of magnitude <= 8; tests/test_formats.py: every bf16 value and the fp32 neighbours of each
    midpoint)."""
    return torch.bucketize(x, _fp4_bucket_tables(x.device)[0], out_int32=True)


def fp4_round_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to E2M1 codes (uint8 0..15).

    Saturates at +-6; ties go to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
    5->4), which is round-to-nearest-even on the E2M1 grid. A negative value that rounds to 0 gets code 0.
    """
    x = x.to(torch.float32)
    return _fp4_bucket_tables(x.device)[1][_fp4_buckets(x)]


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> fp32 values."""
    return _fp4_table_on(codes.device)[codes.to(torch.int64)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] int8 bytes; even index in the low nibble (official layout)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] int8 / uint8 / float4_e2m1fn_x2 bytes -> [..., K] codes (uint8)."""
    b = packed.view(torch.uint8)
    low, high = b & 0x0F, b >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed FP4 weight [out, in/2] with per-`block` scales [out, in/block] -> fp32 [out, in].

    The scale is expanded along the contraction (in) axis ONLY: the seed's P3 bug was expanding an
    expert scale [out, in/32] along both axes, which silently scrambles every row.
    """
    values = fp4_codes_to_float(unpack_fp4(packed))
    out_dim, in_dim = values.shape[-2], values.shape[-1]
    expected = (out_dim, in_dim // block)
    if in_dim % block or tuple(scale.shape[-2:]) != expected:
        raise ValueError(
            f"FP4 scale shape {tuple(scale.shape)} does not match weight [{out_dim}, {in_dim}]: "
            f"expected {expected} (one scale per {block} elements of a row)"
        )
    return values * scale_to_float(scale).repeat_interleave(block, dim=-1)


# ----------------------------------------------------------------------------------------------
# FP8 E4M3 weights with 2-D block scales
# ----------------------------------------------------------------------------------------------
def dequant_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 weight [out, in] with block scales [ceil(out/block), ceil(in/block)] -> fp32 [out, in]."""
    out_dim, in_dim = weight.shape
    expected = (-(-out_dim // block), -(-in_dim // block))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 block scale shape {tuple(scale.shape)} does not match weight [{out_dim}, {in_dim}] "
            f"with {block}x{block} blocks: expected {expected}"
        )
    s = scale_to_float(scale)
    s = s.repeat_interleave(block, dim=0)[:out_dim].repeat_interleave(block, dim=1)[:, :in_dim]
    return weight.to(torch.float32) * s


def quant_fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (E4M3 [out, in], E8M0 [ceil(out/b), ceil(in/b)]) with pow2 block scales.

    Used to write synthetic checkpoints in the official format (scale = pow2 ceil of amax/448).
    """
    out_dim, in_dim = weight.shape
    bo, bi = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(bo * block, bi * block, dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.to(torch.float32)
    tiles = padded.view(bo, block, bi, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR)
    s = pow2_ceil_scale(amax, FP8_MAX)  # [bo, bi]
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(bo * block, bi * block)[:out_dim, :in_dim].contiguous()
    return q, float_to_e8m0(s)


def quant_fp8_rows(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [rows, cols] -> (E4M3 [rows, cols], E8M0 [rows, cols/block]): one pow2 scale per `block` of a row.

    The layout of V4.1's engram tables (ParallelEngramEmbedding: weight E4M3, scale [rows, dim/32])."""
    q, s = act_quant(weight, block)
    return q, float_to_e8m0(s)


def dequant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse layout of `quant_fp8_rows`: E4M3 [rows, cols] x E8M0 [rows, cols/block] -> fp32."""
    block = weight.shape[-1] // scale.shape[-1]
    return (weight.to(torch.float32).unflatten(-1, (-1, block)) * scale_to_float(scale).unsqueeze(-1)).flatten(-2)


def quant_fp4_rows(weight: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (packed int8 [out, in/2], E8M0 [out, in/block]) like the official FP4 experts."""
    out_dim, in_dim = weight.shape
    groups = weight.to(torch.float32).view(out_dim, in_dim // block, block)
    amax = groups.abs().amax(dim=-1).clamp(min=FP4_AMAX_FLOOR)
    s = pow2_ceil_scale(amax, FP4_MAX)
    codes = fp4_round_codes(groups / s.unsqueeze(-1)).view(out_dim, in_dim)
    return pack_fp4(codes), float_to_e8m0(s)


# ----------------------------------------------------------------------------------------------
# activation quantisation (emulation of the official kernels)
# ----------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block}")
    return x.to(torch.float32).unflatten(-1, (-1, block))


def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Official `act_quant(x, block, "ue8m0")` (not inplace): E4M3 values and fp32 pow2 scales.

    Returns (q [..., K] float8_e4m3fn, s [..., K/block] fp32). amax is floored at 1e-4; the scale is
    2**ceil(log2(amax/448)); x/s is clamped to +-448 and cast with round-to-nearest-even.
    """
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    s = pow2_ceil_scale(amax, FP8_MAX)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


def act_quant_dequant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 value of act_quant's output, i.e. what an FP8 GEMM multiplies: q * s (exact in fp32)."""
    q, s = act_quant(x, block)
    return (q.to(torch.float32).unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2)


def fp8_fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """Official inplace `act_quant(x, block, ue8m0, inplace=True)` with real E4M3 rounding.

    This is the current V4-Flash revision and V4.1 behaviour; the initial V4-Flash revision's
    kernel made the inplace path a no-op (see reference/quirks). Result has x's dtype.
    """
    return act_quant_dequant(x, block).to(x.dtype)


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    """fp32 max |x| of blocks [..., nb, block] -> [..., nb, 1]: |max(max x, -min x)|, one read of xb in its
    own dtype (no |x| tensor); the same bits as xb.abs().amax() (the outer abs: +0, and a NaN's sign)."""
    lo, hi = torch.aminmax(xb, dim=-1, keepdim=True)
    return torch.maximum(hi, -lo).abs().to(torch.float32)


def _fp4_scale(xb: torch.Tensor) -> torch.Tensor:
    """E8M0 scales of blocks [..., nb, block] -> fp32 [..., nb, 1] (official `fp4_act_quant`)."""
    return pow2_ceil_scale(_block_amax(xb).clamp(min=FP4_AMAX_FLOOR), FP4_MAX)


def _fp4_scale_e4m3(xb: torch.Tensor) -> torch.Tensor:
    """E4M3 scales (as fp32 values) of blocks [..., nb, block] -> [..., nb, 1] (V4.1)."""
    amax = _block_amax(xb).clamp(min=FP4_AMAX_FLOOR_E4M3_SCALE)
    # E4M3 cannot hold a scale above 448 (amax > 2688): saturate like a satfinite GPU conversion instead of
    # torch's NaN. Unreachable for RMS-normalised latents; an assumption, since [Gk] is not the original.
    return (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def fp4_act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Official `fp4_act_quant` (E8M0 scales): (codes uint8 [..., K], fp32 pow2 scales [..., K/block])."""
    xb = _blocks(x, block)
    s = _fp4_scale(xb)
    codes = fp4_round_codes((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return codes.flatten(-2), s.squeeze(-1)


def fp4_act_quant_e4m3_scale(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1 `fp4_act_quant(..., scale_dtype=float8_e4m3fn)`: scale = E4M3(amax/6) (RNE, not pow2).

    Returns (codes uint8 [..., K], scales as fp32 values of their E4M3 encoding [..., K/block]).
    amax is floored at 6*2**-9 so the scale never drops below E4M3's smallest subnormal range.
    """
    xb = _blocks(x, block)
    s = _fp4_scale_e4m3(xb)
    codes = fp4_round_codes((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return codes.flatten(-2), s.squeeze(-1)


def fp4_fake_quant(x: torch.Tensor, block: int = 32, e4m3_scale: bool = False) -> torch.Tensor:
    """Inplace-style FP4 fake quantisation: dequantised values, in x's dtype.
    = fp4_codes_to_float(codes) * scale of `fp4_act_quant(_e4m3_scale)`, the value read straight off the
    E2M1 bucket (no uint8 codes and int64 copy of them, no clamp: the buckets saturate): the same bits.
    bf16/fp16 x stays in its dtype until the division by the fp32 scale (which upcasts it exactly): no fp32
    copy of x (the indexer q of an 8k prefill is [8192, 64, 128])."""
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block}")
    xb = x.unflatten(-1, (-1, block)) if x.dtype in (torch.bfloat16, torch.float16) else _blocks(x, block)
    s = _fp4_scale_e4m3(xb) if e4m3_scale else _fp4_scale(xb)
    values = _fp4_bucket_tables(x.device)[2][_fp4_buckets(xb / s)] * s
    return values.flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# FP4 -> FP8 tile conversion (official convert.py --expert-dtype fp8)
# ----------------------------------------------------------------------------------------------
MAX_OFFSET_BITS = 6  # 6 * 2**6 = 384 < 448: the largest per-32 offset that still fits E4M3
LOSSLESS_SPAN_BITS = 14  # offsets >= 2**-8 keep every E2M1 value exact in E4M3 (2**-9 subnormal)


@dataclass(frozen=True)
class Fp4ToFp8Result:
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float8_e8m0fnu [out/tile, in/tile]
    lossy_tiles: list[tuple[int, int]]  # (tile_row, tile_col) whose scale span exceeds 2**14

    @property
    def lossless(self) -> bool:
        return not self.lossy_tiles


def fp4_to_fp8_tiles(packed: torch.Tensor, scale: torch.Tensor, tile: int = 128) -> Fp4ToFp8Result:
    """Official `cast_e2m1fn_to_e4m3fn` (spec §5.4), for `tile` = 128 (V4) or 32 (V4.1).

    Each tile's new scale is its largest per-32 scale / 2**6; every element becomes
    value * (its scale / tile scale) cast to E4M3. The result dequantises to exactly the FP4 values
    iff every per-32 scale in the tile is within 2**14 of the tile's largest; tiles where that fails
    are reported in `lossy_tiles` (their small-scale groups lose bits or underflow).
    """
    out_dim, in_dim = packed.shape[0], packed.shape[1] * 2
    if out_dim % tile or in_dim % tile:
        raise ValueError(f"FP4->FP8 conversion needs dims divisible by {tile}, got [{out_dim}, {in_dim}]")
    if tuple(scale.shape) != (out_dim, in_dim // FP4_BLOCK):
        raise ValueError(f"scale shape {tuple(scale.shape)} != expected {(out_dim, in_dim // FP4_BLOCK)}")
    bo, bi = out_dim // tile, in_dim // tile
    values = fp4_codes_to_float(unpack_fp4(packed)).view(bo, tile, bi, tile).transpose(1, 2)
    s = scale_to_float(scale).view(bo, tile, bi, tile // FP4_BLOCK).transpose(1, 2)  # [bo,bi,tile,g]
    s_max = s.amax(dim=(-1, -2), keepdim=True)
    tile_scale = s_max / 2**MAX_OFFSET_BITS
    offset = (s / tile_scale).repeat_interleave(FP4_BLOCK, dim=-1)
    fp8 = (values * offset).transpose(1, 2).reshape(out_dim, in_dim).to(torch.float8_e4m3fn)
    span_ok = (s >= s_max * 2.0**-LOSSLESS_SPAN_BITS).all(dim=-1).all(dim=-1)  # [bo, bi]
    lossy = [(int(r), int(c)) for r, c in (~span_ok).nonzero().tolist()]
    return Fp4ToFp8Result(fp8.contiguous(), float_to_e8m0(tile_scale.view(bo, bi)), lossy)
