"""Bit-level tests of deepinfer.formats (spec §5.2-5.4, §6.1-6.2, §10.6).

Every quantiser is checked against an independent re-implementation written here in numpy / plain
python (grids built from the format definitions, brute-force nearest-with-ties-to-even rounding,
math.frexp for the power-of-two scales), never against the module's own helpers.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepinfer import formats as F

# ------------------------------------------------------------------------------------------------
# independent references
# ------------------------------------------------------------------------------------------------
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e4m3_grid() -> np.ndarray:
    """Non-negative finite E4M3FN values in code order (code = index): bias 7, 3 mantissa bits,
    subnormals m*2**-9, no infinities, 0x7F is NaN (so the list stops at 0x7E = 448)."""
    vals = [m * 2.0**-9 for m in range(8)]
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                break
            vals.append((1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3_GRID = _e4m3_grid()


def _nearest_even(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid point to each |value|; on an exact tie the even index (= even code)."""
    dist = np.abs(mag.reshape(-1, 1).astype(np.float64) - grid.reshape(1, -1))
    best = dist.min(axis=1, keepdims=True)
    tie = dist == best
    idx = np.empty(mag.size, dtype=np.int64)
    for i, row in enumerate(tie):
        cand = np.flatnonzero(row)
        assert len(cand) <= 2
        even = [c for c in cand if c % 2 == 0]
        idx[i] = even[0] if even else cand[0]
    return idx.reshape(mag.shape)


def ref_e4m3(v: np.ndarray) -> np.ndarray:
    """RNE cast to E4M3 of values already clamped to +-448 (float64 result)."""
    v = np.asarray(v, dtype=np.float64)
    assert np.all(np.abs(v) <= 448.0)
    idx = _nearest_even(np.abs(v), E4M3_GRID)
    return np.sign(v) * E4M3_GRID[idx]


def ref_fp4_codes(v: np.ndarray) -> np.ndarray:
    """E2M1 codes: saturate at 6, nearest grid point, ties to the even code, sign bit only if code != 0."""
    v = np.asarray(v, dtype=np.float64)
    mag = np.minimum(np.abs(v), 6.0)
    code = _nearest_even(mag, FP4_GRID)
    return (code | np.where((v < 0) & (code != 0), 8, 0)).astype(np.uint8)


def ref_pow2_ceil(amax: float, max_value: float) -> float:
    """2**ceil(log2(fp32(amax) * fp32(1/max))) with the product taken in fp32, via math.frexp."""
    prod = float(np.float32(amax) * np.float32(1.0 / max_value))
    m, e = math.frexp(prod)  # prod = m * 2**e, m in [0.5, 1)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


def is_pow2(t: torch.Tensor) -> bool:
    m, _ = torch.frexp(t.to(torch.float32))
    return bool(((m == 0.5) & (t > 0)).all())


def ref_act_quant(x: np.ndarray, block: int):
    """(values q as float64, scales) of the official act_quant, per row, per block."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    q = np.empty(xb.shape)
    s = np.empty(xb.shape[:-1])
    for idx in np.ndindex(*xb.shape[:-1]):
        amax = max(np.float32(np.abs(xb[idx]).max()), np.float32(1e-4))
        sc = ref_pow2_ceil(amax, 448.0)
        s[idx] = sc
        q[idx] = ref_e4m3(np.clip(xb[idx].astype(np.float64) / sc, -448, 448))
    return q.reshape(x.shape), s


# ------------------------------------------------------------------------------------------------
# E8M0
# ------------------------------------------------------------------------------------------------
def test_e8m0_known_values_uint8_and_native():
    raw = torch.tensor([126, 127, 128, 0xFF, 0, 254, 100], dtype=torch.uint8)
    want = [0.5, 1.0, 2.0, float("nan"), 2.0**-127, 2.0**127, 2.0**-27]
    for t in (raw, raw.view(torch.float8_e8m0fnu)):
        got = F.e8m0_to_float(t)
        assert got.dtype == torch.float32
        assert got[:3].tolist() == [0.5, 1.0, 2.0]
        assert math.isnan(got[3].item())
        assert got[4:].tolist() == want[4:]
    # agrees with torch's own E8M0 decoding
    native = raw.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.allclose(F.e8m0_to_float(raw), native, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(TypeError):
        F.e8m0_to_float(torch.ones(3))


def test_float_to_e8m0_round_trip_all_powers():
    exps = torch.arange(-127, 128)
    vals = torch.ldexp(torch.ones(len(exps)), exps.to(torch.int32))
    enc = F.float_to_e8m0(vals)
    assert enc.dtype == torch.float8_e8m0fnu
    assert enc.view(torch.uint8).tolist() == list(range(0, 255))
    assert torch.equal(F.e8m0_to_float(enc), vals)


@pytest.mark.parametrize("bad", [3.0, 0.75, 1.5 * 2**-20, 0.0, -1.0, -0.5, float("nan"), float("inf"), 2.0**-130])
def test_float_to_e8m0_rejects_non_powers(bad):
    with pytest.raises(ValueError, match="power"):
        F.float_to_e8m0(torch.tensor([1.0, bad]))


# ------------------------------------------------------------------------------------------------
# FP4 E2M1 codes and packing
# ------------------------------------------------------------------------------------------------
def test_fp4_code_table():
    got = F.fp4_codes_to_float(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert got[8] == 0.0  # code 8 is -0, decoded as zero


def test_fp4_packing_order_hand_made_byte():
    # element 0 (even) = code 3 (+1.5) in the LOW nibble, element 1 (odd) = code 10 (-1.0) in the high one
    codes = torch.tensor([[3, 10, 0, 15]], dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0xA3, 0xF0]]
    byte = torch.tensor([[0xA3, 0xF0]], dtype=torch.uint8)
    assert F.unpack_fp4(byte).tolist() == [[3, 10, 0, 15]]
    assert F.unpack_fp4(byte.view(torch.int8)).tolist() == [[3, 10, 0, 15]]
    assert F.unpack_fp4(byte.view(torch.float4_e2m1fn_x2)).tolist() == [[3, 10, 0, 15]]
    one = torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # scale 1.0 for 32 elements
    w = F.dequant_fp4(torch.tensor([[0xA3] * 16], dtype=torch.uint8).view(torch.int8), one)
    assert w[0, :4].tolist() == [1.5, -1.0, 1.5, -1.0]
    with pytest.raises(ValueError, match="even"):
        F.pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


def test_fp4_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(F.unpack_fp4(packed), codes)
    # manual nibble check on every byte
    b = packed.view(torch.uint8).to(torch.int64)
    assert torch.equal(b % 16, codes[:, 0::2].to(torch.int64))
    assert torch.equal(b // 16, codes[:, 1::2].to(torch.int64))


# ------------------------------------------------------------------------------------------------
# E2M1 rounding
# ------------------------------------------------------------------------------------------------
def test_fp4_round_ties_and_saturation():
    cases = {0.25: 0, 0.75: 1, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5.0: 4, 6.0: 6, 7.0: 6, 1e30: 6, 0.2: 0, 0.26: 0.5,
             5.01: 6, 4.99: 4}
    xs = torch.tensor(list(cases) + [-k for k in cases])
    want = list(cases.values()) + [-v for v in cases.values()]
    got = F.fp4_codes_to_float(F.fp4_round_codes(xs)).tolist()
    assert got == want
    codes = F.fp4_round_codes(torch.tensor([6.0, 1e30, -7.0, -0.1, -0.25]))
    assert codes.tolist() == [7, 7, 15, 0, 0]  # saturation codes; tiny negatives round to +0 (code 0)


def test_fp4_round_against_brute_force():
    g = np.random.default_rng(2)
    grid = np.concatenate([FP4_GRID, -FP4_GRID])
    mids = (FP4_GRID[1:] + FP4_GRID[:-1]) / 2
    mids = np.concatenate([mids, -mids]).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    rand = g.uniform(-8, 8, 20000).astype(np.float32)
    rand_small = (g.uniform(-1, 1, 2000) * 2.0 ** g.integers(-30, 0, 2000)).astype(np.float32)
    vals = np.concatenate([grid.astype(np.float32), mids, near, rand, rand_small, [6.0, 6.5, -6.5, 100]]).astype(np.float32)
    got = F.fp4_round_codes(torch.from_numpy(vals)).numpy()
    want = ref_fp4_codes(vals)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(vals[i], got[i], want[i]) for i in bad[:10]]


def _grid_search_codes(x: torch.Tensor) -> torch.Tensor:
    """The former `fp4_round_codes`: distance to each of the 8 grid values, ties to the even code."""
    mag = x.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - torch.tensor(FP4_GRID, dtype=torch.float32)).abs()
    is_min = dist == dist.min(dim=-1, keepdim=True).values
    even = (torch.arange(8) % 2) == 0
    code = (is_min.to(torch.int8) * 2 + (is_min & even).to(torch.int8)).argmax(dim=-1).to(torch.uint8)
    return code | (((x < 0) & (code != 0)).to(torch.uint8) << 3)


def test_fp4_round_buckets_equal_grid_search():
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mids = torch.tensor([(a + b) / 2 for a, b in zip(FP4_GRID, FP4_GRID[1:])], dtype=torch.float32)
    bits = (torch.cat([mids, -mids]).view(torch.int32).unsqueeze(1) + torch.arange(-64, 65)).flatten()
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3e38, -3e38, 1e-45, -1e-45])
    x = torch.cat([every_bf16, bits.view(torch.float32), special])
    assert torch.equal(F.fp4_round_codes(x), _grid_search_codes(x))
    s = torch.full((x.numel() // 32 + 1, 1), 2.0)
    xs = torch.cat([x, torch.zeros(s.shape[0] * 32 - x.numel())]).view(-1, 32) * s  # blocks of 32, scaled
    codes, sc = F.fp4_act_quant(xs, 32)
    want = (F.fp4_codes_to_float(codes).view(-1, 32) * sc).flatten()
    assert torch.equal(F.fp4_fake_quant(xs, 32).flatten().view(torch.int32), want.view(torch.int32))


# ------------------------------------------------------------------------------------------------
# power-of-two ceil scale
# ------------------------------------------------------------------------------------------------
def test_pow2_ceil_scale_powers_of_two():
    k = torch.arange(-100, 101, dtype=torch.int32)
    amax = torch.ldexp(torch.ones(len(k)), k)
    got = F.pow2_ceil_scale(amax, 448.0)
    # 2**k / 448 = 2**(k-9) * 1.142.. -> ceil = 2**(k-8)
    assert torch.equal(got, torch.ldexp(torch.ones(len(k)), k - 8))
    got6 = F.pow2_ceil_scale(amax, 6.0)  # 2**k/6 = 2**(k-3) * 1.33 -> 2**(k-2)
    assert torch.equal(got6, torch.ldexp(torch.ones(len(k)), k - 2))


@pytest.mark.parametrize("max_value", [448.0, 6.0])
@pytest.mark.parametrize("k", [-20, -9, -1, 0, 1, 5, 30])
def test_pow2_ceil_scale_reciprocal_product_edge(max_value, k):
    exact = np.float32(max_value * 2.0**k)
    below = np.nextafter(exact, np.float32(0))
    above = np.nextafter(exact, np.float32(np.inf))
    vals = np.array([below, exact, above], dtype=np.float32)
    got = F.pow2_ceil_scale(torch.from_numpy(vals), max_value).tolist()
    want = [ref_pow2_ceil(v, max_value) for v in vals]
    assert got == want
    # and these are the mathematically expected scales: exactly max*2**k needs 2**k, one ulp above 2**(k+1)
    assert got == [2.0**k, 2.0**k, 2.0 ** (k + 1)]


@pytest.mark.parametrize("max_value", [448.0, 6.0])
def test_pow2_ceil_scale_random_against_frexp(max_value):
    g = np.random.default_rng(3)
    vals = (g.uniform(0.5, 1.0, 5000) * 2.0 ** g.integers(-100, 100, 5000)).astype(np.float32)
    got = F.pow2_ceil_scale(torch.from_numpy(vals), max_value).numpy()
    want = np.array([ref_pow2_ceil(v, max_value) for v in vals])
    assert np.array_equal(got, want)
    assert np.all(got * max_value >= vals * (1 - 1e-7))  # the scale covers amax (up to fp32 1/max rounding)


# ------------------------------------------------------------------------------------------------
# act_quant (FP8 E4M3, pow2 scales)
# ------------------------------------------------------------------------------------------------
def _varied(shape, block, seed, zero_block=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    nb = shape[-1] // block
    exps = torch.randint(-30, 20, (*shape[:-1], nb), generator=g).to(torch.float32)
    x = x * torch.exp2(exps).repeat_interleave(block, dim=-1)
    if zero_block:
        x[0, :block] = 0
    return x


def test_e4m3_reference_grid_matches_torch_decoding():
    dec = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    assert np.array_equal(dec.numpy(), E4M3_GRID)


def test_act_quant_against_reference():
    x = _varied((3, 512), 128, seed=4)
    x[1, 128:256] = torch.linspace(-1, 1, 128) * 448 * 2.0**-3  # amax exactly 448 * 2**-3
    q, s = F.act_quant(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (3, 4)
    assert is_pow2(s)
    assert s[0, 0].item() == ref_pow2_ceil(1e-4, 448.0) == 2.0**-22  # amax floor on the all-zero block
    assert torch.all(q[0, :128].to(torch.float32) == 0)
    assert s[1, 1].item() == 2.0**-3
    want_q, want_s = ref_act_quant(x.numpy(), 128)
    assert np.array_equal(s.numpy(), want_s)
    assert np.array_equal(q.to(torch.float64).numpy(), want_q)


def test_act_quant_block_64_and_clamp():
    # scale is 2**ceil(..) so |x/s| <= 448 holds; values exactly at amax land on 448 or below
    x = _varied((2, 256), 64, seed=5, zero_block=False)
    q, s = F.act_quant(x, 64)
    assert s.shape == (2, 4)
    assert q.to(torch.float32).abs().max().item() <= 448
    want_q, want_s = ref_act_quant(x.numpy(), 64)
    assert np.array_equal(s.numpy(), want_s)
    assert np.array_equal(q.to(torch.float64).numpy(), want_q)
    with pytest.raises(ValueError, match="multiple"):
        F.act_quant(torch.ones(2, 100), 64)


def test_act_quant_dequant_error_bound():
    x = _varied((4, 1024), 128, seed=6, zero_block=False)
    q, s = F.act_quant(x, 128)
    y = F.act_quant_dequant(x, 128)
    assert torch.equal(y, (q.to(torch.float32).view(4, 8, 128) * s[..., None]).view(4, 1024))
    s_el = s.repeat_interleave(128, dim=-1)
    normal = (x / s_el).abs() >= 2.0**-6  # E4M3's normal range
    rel = ((y - x).abs() / x.abs())[normal]
    assert normal.float().mean() > 0.9
    assert rel.max().item() <= 2.0**-4
    # subnormal part: absolute error at most half the subnormal step
    assert ((y - x).abs()[~normal] <= s_el[~normal] * 2.0**-10).all()


# ------------------------------------------------------------------------------------------------
# fp4_act_quant (E8M0 scales) and the V4.1 E4M3-scale mode
# ------------------------------------------------------------------------------------------------
def test_fp4_act_quant_against_reference_and_floor():
    x = _varied((3, 256), 32, seed=7)
    codes, s = F.fp4_act_quant(x, 32)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and s.shape == (3, 8)
    assert is_pow2(s)
    assert s[0, 0].item() == 2.0**-126  # floor 6 * 2**-126 on the zero block -> 2**-126
    xb = x.numpy().reshape(3, 8, 32)
    for i, j in np.ndindex(3, 8):
        amax = max(np.float32(np.abs(xb[i, j]).max()), np.float32(6 * 2.0**-126))
        sc = ref_pow2_ceil(amax, 6.0)
        assert s[i, j].item() == sc
        want = ref_fp4_codes(np.clip(xb[i, j].astype(np.float64) / sc, -6, 6))
        assert np.array_equal(codes.view(3, 8, 32)[i, j].numpy(), want), (i, j)


def test_fp4_act_quant_dequant_error():
    x = _varied((4, 512), 32, seed=8, zero_block=False)
    codes, s = F.fp4_act_quant(x, 32)
    s_el = s.repeat_interleave(32, dim=-1)
    y = F.fp4_codes_to_float(codes) * s_el
    assert torch.equal(F.fp4_fake_quant(x, 32), y)
    r = (x / s_el).abs()
    half_gap = torch.where(r < 2, 0.25, torch.where(r < 4, 0.5, 1.0))
    assert ((y - x).abs() <= half_gap * s_el).all()
    amax = x.view(4, 16, 32).abs().amax(-1).repeat_interleave(32, dim=-1)
    assert ((y - x).abs() <= amax / 3).all()


def test_fp4_act_quant_e4m3_scale_hand_case():
    # amax 7 -> 7/6 = 1.1667 -> E4M3 neighbours 1.125 / 1.25 -> s = 1.125 (not a power of two)
    x = torch.zeros(16)
    x[:5] = torch.tensor([7.0, 1.0, 0.5625, -2.8125, -0.28125])
    codes, s = F.fp4_act_quant_e4m3_scale(x, 16)
    assert s.tolist() == [1.125]
    # 7/1.125 = 6.22 -> clamp 6 (code 7); 1/1.125 = .889 -> 1 (2); .5; -2.5 tie -> -2 (12); -0.25 tie -> 0
    assert codes[:5].tolist() == [7, 2, 1, 12, 0]
    assert codes[5:].tolist() == [0] * 11
    # floor 6 * 2**-9: an all-zero block gets E4M3's smallest subnormal as its scale
    _, s0 = F.fp4_act_quant_e4m3_scale(torch.zeros(2, 32), 16)
    assert s0.flatten().tolist() == [2.0**-9] * 4
    assert torch.equal(F.fp4_fake_quant(x, 16, e4m3_scale=True), F.fp4_codes_to_float(codes) * 1.125)


def test_fp4_act_quant_e4m3_scale_against_reference():
    x = _varied((3, 256), 16, seed=9)
    x = x.clamp(-1e4, 1e4) * 2.0**-5  # keep amax/6 inside E4M3's range, some blocks near the floor
    codes, s = F.fp4_act_quant_e4m3_scale(x, 16)
    xb = x.numpy().reshape(3, 16, 16)
    nonpow2 = 0
    for i, j in np.ndindex(3, 16):
        amax = max(np.float32(np.abs(xb[i, j]).max()), np.float32(6 * 2.0**-9))
        sc = float(ref_e4m3(np.array([np.float32(amax) / np.float32(6)]))[0])
        assert s[i, j].item() == sc, (i, j)
        nonpow2 += math.frexp(sc)[0] != 0.5
        q = (xb[i, j] / np.float32(sc)).astype(np.float32)
        want = ref_fp4_codes(np.clip(q.astype(np.float64), -6, 6))
        assert np.array_equal(codes.view(3, 16, 16)[i, j].numpy(), want), (i, j)
    assert nonpow2 > 10


# ------------------------------------------------------------------------------------------------
# FP8 weights with 2-D block scales
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((200, 300), 128), ((129, 127), 128), ((70, 45), 32)])
def test_fp8_blocks_round_trip_ragged(shape, block):
    g = torch.Generator().manual_seed(10)
    w = torch.randn(*shape, generator=g) * 0.02
    w[: min(block, shape[0]), : min(block, shape[1])] *= 1000  # one block with very different scale
    q, s = F.quant_fp8_blocks(w, block)
    bo, bi = -(-shape[0] // block), -(-shape[1] // block)
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (bo, bi) and s.dtype == torch.float8_e8m0fnu
    sf = F.e8m0_to_float(s)
    # independent: each block's scale from the amax of its REAL (unpadded) elements
    for a, b in np.ndindex(bo, bi):
        blk = w[a * block:(a + 1) * block, b * block:(b + 1) * block]
        assert sf[a, b].item() == ref_pow2_ceil(max(blk.abs().max().item(), 1e-4), 448.0)
        want = ref_e4m3(np.clip(blk.numpy().astype(np.float64) / sf[a, b].item(), -448, 448))
        got = q[a * block:(a + 1) * block, b * block:(b + 1) * block].to(torch.float64).numpy()
        assert np.array_equal(got, want)
    d = F.dequant_fp8_blocks(q, s, block)
    assert d.shape == shape
    assert d[-1, -1].item() == q[-1, -1].float().item() * sf[-1, -1].item()
    normal = (d != 0) & (w.abs() >= sf.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]] * 2.0**-6)
    assert ((d - w).abs() / w.abs())[normal].max().item() <= 2.0**-4


def test_dequant_fp8_blocks_rejects_wrong_scale_shape():
    q, s = F.quant_fp8_blocks(torch.randn(200, 300, generator=torch.Generator().manual_seed(21)), 128)
    assert s.shape == (2, 3)
    for bad in (s.t().contiguous(), s[:, :2], torch.ones(1, 3, dtype=torch.float8_e8m0fnu),
                torch.ones(200, 3)):
        with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
            F.dequant_fp8_blocks(q, bad, 128)


# ------------------------------------------------------------------------------------------------
# FP4 expert weights: per-row scales [out, in/32]
# ------------------------------------------------------------------------------------------------
def _random_fp4(out_dim, in_dim, seed, exp_lo=-8, exp_hi=8):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_dim, in_dim), generator=g, dtype=torch.uint8)
    sbytes = 127 + torch.randint(exp_lo, exp_hi + 1, (out_dim, in_dim // 32), generator=g)
    return codes, sbytes.to(torch.uint8).view(torch.float8_e8m0fnu)


def test_dequant_fp4_per_row_scales():
    codes, scale = _random_fp4(64, 128, seed=11)
    w = F.dequant_fp4(F.pack_fp4(codes), scale)
    sb = scale.view(torch.uint8).to(torch.int64)
    for o, i in [(0, 0), (5, 31), (5, 32), (63, 127), (17, 64)]:
        want = FP4_GRID[codes[o, i].item() % 8] * (-1 if codes[o, i].item() >= 8 else 1) * 2.0 ** (sb[o, i // 32].item() - 127)
        assert w[o, i].item() == want


def test_quant_fp4_rows_round_trip():
    # weights exactly on the FP4 grid with one +-6 per group (so amax/6 is the scale) survive unchanged
    codes, scale = _random_fp4(48, 256, seed=12)
    codes = torch.where(codes == 8, torch.zeros_like(codes), codes)  # -0 re-quantises to +0
    codes[:, ::32] = 7
    w = F.dequant_fp4(F.pack_fp4(codes), scale)
    packed, s2 = F.quant_fp4_rows(w)
    assert packed.shape == (48, 128) and packed.dtype == torch.int8 and s2.shape == (48, 8)
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(F.unpack_fp4(packed), codes)
    assert torch.equal(F.dequant_fp4(packed, s2), w)
    # random weights: requantising the dequantised result is a fixed point
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(20))
    p1, s1 = F.quant_fp4_rows(x)
    d1 = F.dequant_fp4(p1, s1)
    p2, s2 = F.quant_fp4_rows(d1)
    assert torch.equal(F.dequant_fp4(p2, s2), d1)
    assert torch.equal(d1, F.fp4_fake_quant(x, 32))


def test_dequant_fp4_rejects_non_row_scales():
    out_dim, in_dim = 256, 512
    codes, scale = _random_fp4(out_dim, in_dim, seed=13)
    packed = F.pack_fp4(codes)
    sf = F.e8m0_to_float(scale)
    bad_shapes = {
        "transposed": sf.t().contiguous(),  # [in/32, out]
        "2-D blocked per 32x32": sf[: out_dim // 32],  # [out/32, in/32]
        "2-D blocked per 128x128": torch.ones(out_dim // 128, in_dim // 128),
        "too few columns": sf[:, :-1],
    }
    for name, bad in bad_shapes.items():
        with pytest.raises(ValueError, match=r"\(256, 16\).*per 32 elements of a row") as e:
            F.dequant_fp4(packed, bad)
        assert str(tuple(bad.shape)) in str(e.value), name
    with pytest.raises(ValueError):  # in not a multiple of 32
        F.dequant_fp4(F.pack_fp4(torch.zeros(4, 48, dtype=torch.uint8)), torch.ones(4, 1))


def _seed_p3_buggy_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The seed's bug: the [out, in/32] expert scale expanded by 32 along BOTH axes, then cropped.
    Row r then gets the scales of row r // 32 (only the first out/32 rows' scales are ever used)."""
    values = F.fp4_codes_to_float(F.unpack_fp4(packed))
    s = F.e8m0_to_float(scale).repeat_interleave(32, dim=0).repeat_interleave(32, dim=1)
    return values * s[: values.shape[0], : values.shape[1]]


def _correct_dequant(packed, scale):
    values = F.fp4_codes_to_float(F.unpack_fp4(packed))
    return values * F.e8m0_to_float(scale).repeat_interleave(32, dim=1)


def test_seed_p3_regression_wrong_axis_expansion_is_detected():
    out_dim, in_dim = 256, 512
    codes, scale = _random_fp4(out_dim, in_dim, seed=14, exp_lo=-6, exp_hi=6)
    packed = F.pack_fp4(codes)
    good = F.dequant_fp4(packed, scale)
    # the correct expansion is bit-identical
    assert torch.equal(good, _correct_dequant(packed, scale))
    # the seed's expansion has the right output shape (so no shape error would catch it) ...
    buggy = _seed_p3_buggy_dequant(packed, scale)
    assert buggy.shape == good.shape
    # ... but its values are scrambled: rows 1.. use another row's scales
    cos = torch.nn.functional.cosine_similarity(buggy.flatten().double(), good.flatten().double(), dim=0)
    assert cos.item() < 0.95, cos.item()
    assert torch.equal(buggy[0], good[0])  # row 0 happens to be right, which is why spot checks missed it
    assert not torch.equal(buggy[1], good[1])
    # and a matmul against the two weights disagrees badly
    x = torch.randn(4, in_dim, generator=torch.Generator().manual_seed(0))
    rel = ((x @ buggy.t()) - (x @ good.t())).norm() / (x @ good.t()).norm()
    assert rel.item() > 0.3


# ------------------------------------------------------------------------------------------------
# FP4 -> FP8 tiles (convert.py --expert-dtype fp8)
# ------------------------------------------------------------------------------------------------
def _tile_scales(out_dim, in_dim, tile, span_exp, seed):
    """E8M0 bytes [out, in/32] whose exponents span at most `span_exp` within every tile."""
    g = torch.Generator().manual_seed(seed)
    bo, bi = out_dim // tile, in_dim // tile
    base = 100 + torch.randint(0, 40, (bo, bi), generator=g)
    base = base.repeat_interleave(tile, 0).repeat_interleave(tile // 32, 1)
    off = torch.randint(0, span_exp + 1, (out_dim, in_dim // 32), generator=g)
    return (base + off)


def _dequant_tiles(res: F.Fp4ToFp8Result, tile: int) -> torch.Tensor:
    s = F.e8m0_to_float(res.scale).repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    return res.weight.to(torch.float32) * s


@pytest.mark.parametrize("tile,shape", [(128, (256, 384)), (32, (96, 160))])
def test_fp4_to_fp8_tiles_lossless_within_span(tile, shape):
    out_dim, in_dim = shape
    g = torch.Generator().manual_seed(15)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    sb = _tile_scales(out_dim, in_dim, tile, 14, seed=16)
    sb[:tile, : tile // 32] = 107
    sb[0, 0], sb[1, 0] = 100, 114  # an exact 2**14 span in tile (0, 0): still lossless
    scale = sb.to(torch.uint8).view(torch.float8_e8m0fnu)
    packed = F.pack_fp4(codes)
    res = F.fp4_to_fp8_tiles(packed, scale, tile=tile)
    assert res.lossless and res.lossy_tiles == []
    assert res.weight.dtype == torch.float8_e4m3fn and res.weight.shape == shape
    assert res.scale.dtype == torch.float8_e8m0fnu and res.scale.shape == (out_dim // tile, in_dim // tile)
    # tile scale = tile's largest per-32 scale / 2**6
    smax = F.e8m0_to_float(scale).view(out_dim // tile, tile, in_dim // tile, tile // 32).amax(dim=(1, 3))
    assert torch.equal(F.e8m0_to_float(res.scale), smax / 64)
    assert res.weight.to(torch.float32).abs().max().item() <= 384
    assert torch.equal(_dequant_tiles(res, tile), F.dequant_fp4(packed, scale))
    assert torch.equal(F.dequant_fp8_blocks(res.weight, res.scale, tile), F.dequant_fp4(packed, scale))


@pytest.mark.parametrize("tile", [128, 32])
def test_fp4_to_fp8_tiles_reports_lossy_tile(tile):
    out_dim, in_dim = 3 * tile, 4 * tile
    g = torch.Generator().manual_seed(17)
    codes = torch.randint(0, 16, (out_dim, in_dim), generator=g, dtype=torch.uint8)
    sb = _tile_scales(out_dim, in_dim, tile, 10, seed=18)
    r, c = 1, 2  # planted tile: one group 2**20 below the tile's maximum
    r0, c0 = r * tile, c * (tile // 32)
    sb[r0 : r0 + tile, c0 : c0 + tile // 32] = 120
    sb[r0 + 3, c0] = 100
    small_rows, small_cols = r0 + 3, slice(c * tile, c * tile + 32)
    codes[small_rows, small_cols] = torch.arange(32) % 16  # every code incl. +-0.5 (underflow)
    # tile (0, 0) at a 2**15 span: already lossy (0.5 * 2**-9 = 2**-10 rounds to 0, 1.5 * 2**-9 to 2**-8)
    sb[:tile, : tile // 32] = 110
    sb[0, 0], sb[1, 0] = 115, 100
    codes[1, :32] = torch.arange(32) % 16
    scale = sb.to(torch.uint8).view(torch.float8_e8m0fnu)
    packed = F.pack_fp4(codes)
    res = F.fp4_to_fp8_tiles(packed, scale, tile=tile)
    assert not res.lossless
    assert sorted(res.lossy_tiles) == [(0, 0), (r, c)]
    got, want = _dequant_tiles(res, tile), F.dequant_fp4(packed, scale)
    diff = got != want
    # the loss is confined to the reported tiles' small-scale groups
    assert diff[small_rows, small_cols].any() and diff[1, :32].any()
    mask = torch.zeros_like(diff)
    mask[small_rows, small_cols] = True
    mask[1, :32] = True
    assert not diff[~mask].any()
    # at 2**-20 of the tile max (offset 2**-14) every E2M1 value falls below half of E4M3's smallest
    # subnormal: the whole group flushes to zero
    assert (want[small_rows, small_cols] != 0).sum() >= 28
    assert (got[small_rows, small_cols] == 0).all()


def test_fp4_to_fp8_tiles_wrong_shapes():
    scale = torch.full((100, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="divisible by 128"):
        F.fp4_to_fp8_tiles(torch.zeros(100, 64, dtype=torch.int8), scale, tile=128)
    ok = torch.zeros(128, 64, dtype=torch.int8)
    good_scale = torch.full((128, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert F.fp4_to_fp8_tiles(ok, good_scale, tile=128).lossless
    for bad in (good_scale.view(torch.uint8).t().contiguous().view(torch.float8_e8m0fnu),
                good_scale[:, :2], torch.ones(1, 1, dtype=torch.float8_e8m0fnu)):
        with pytest.raises(ValueError, match="scale shape"):
            F.fp4_to_fp8_tiles(ok, bad, tile=128)
    with pytest.raises(ValueError, match="divisible by 32"):
        F.fp4_to_fp8_tiles(torch.zeros(48, 16, dtype=torch.int8), torch.ones(48, 1), tile=32)


# ------------------------------------------------------------------------------------------------
# fp8_fake_quant (inplace act_quant)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [64, 32, 128])
def test_fp8_fake_quant_idempotent_and_on_grid(dtype, block):
    x = _varied((3, 512), block, seed=19).to(dtype)
    y = F.fp8_fake_quant(x, block)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(F.fp8_fake_quant(y, block), y)
    assert not torch.equal(y, x)  # it does round (not the initial revision's no-op)
    # each block's values are E4M3 values times that block's pow2 scale
    _, s = F.act_quant(x, block)
    v = (y.to(torch.float32).view(3, -1, block) / s[..., None]).to(torch.float64).numpy()
    assert np.array_equal(v, ref_e4m3(v))
    want_q, want_s = ref_act_quant(x.to(torch.float32).numpy(), block)
    want = (want_q.reshape(3, -1, block) * want_s[..., None]).reshape(3, 512)
    assert np.array_equal(y.to(torch.float64).numpy(), torch.tensor(want).to(dtype).to(torch.float64).numpy())
