"""The mma.sync form of op "fp8_linear" at decode (deepinfer/kernels/cuda/fp8_linear_mma.cu + .py).

CPU: the launcher's input checks (ValueErrors before any launch) and its refusal of scales above 2^7 or not
powers of two; the E4M3 -> bf16 expansion (`pair` + one bf16 multiply), emulated bit for bit, is exact for all
254 non-NaN bytes x every scale 2^-124 .. 2^7; the split rule on V4-Flash decode shapes; the source compiles
for sm_90 in every tile configuration where NVRTC is installed (the CPU CI has none: skipped there).
GPU (`-m gpu`, fresh random inputs, outputs poisoned with NaN: every element must be written):
* exactness of the expansion and the K pairing: one-hot activation rows (act_quant of a one-hot row is exact:
  amax 1 -> scale 2^-8, q = 256 -> 1.0) pick single weights, so out[k, n] must equal bf16(W[n, k]) bit for
  bit (as values: -0 sums to +0), all 254 non-NaN bytes on every row, block scales 2^-117 .. 2^7 (from 2^-117
  every nonzero E4M3 x scale is a normal bf16 and fp32), every tile configuration, splits 1 and 2, blocks 128
  and 32; M = 1024 rows = 128 CTAs along grid.x;
* the kernel's partials against float64 sums of the same exact operands (rel_err <= 1e-5: exact products,
  fp32 sums), splits 1..4, M not a multiple of 8, N not a multiple of the CTA's rows;
* the op (fp8_linear(mma="sync"): the production wrapper, ordered split sum) against the torch twin at
  V4-Flash decode shapes, M in 1, 3, 8, 16, blocks 128 / act 128 and
  32 / 32: rel_err <= 3e-4 (fp8_linear's "bf16" form bound, tests/test_kernels_fp8_linear.py) and >= 99% of
  the outputs within 1 bf16 ulp (only fp32 summation order differs);
* CUDA-graph replay == eager bit for bit (split and unsplit plans);
* the cluster split (the split CTAs add their partials in the kernel) == the separate ordered sum, bit for bit;
* the serial split (the tile's last split CTA adds the partials) == the separate ordered sum, bit for bit, with
  its counters left zero, under repeated graph replays too.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(MT=2, WARPS=4, STAGES=2), dict(MT=1, WARPS=4, STAGES=2), dict(MT=2, WARPS=4, STAGES=4),
                dict(MT=4, WARPS=4, STAGES=2), dict(MT=1, WARPS=8, STAGES=2), dict(MT=2, WARPS=2, STAGES=2)]
NAN_CODES = (0x7F, 0xFF)


def _cfg_id(c: dict) -> str:
    return f"MT{c['MT']}w{c['WARPS']}s{c['STAGES']}"


def _weight(codes: torch.Tensor, scale: torch.Tensor, block: int, act_block: int) -> QuantLinearWeight:
    return QuantLinearWeight(codes.view(torch.float8_e4m3fn), scale, block, act_block)


def _random_fp8_weight(n: int, k: int, block: int, act_block: int, dev) -> QuantLinearWeight:
    """As tests/test_kernels_gemm.py's: varied row magnitudes, quantised with pow2 block scales."""
    w = torch.randn(n, k, device=dev) * torch.exp(torch.randn(n, 1, device=dev))
    q, s = formats.quant_fp8_blocks(w, block)
    return QuantLinearWeight(q, formats.e8m0_to_float(s), block, act_block)


def _activation(m: int, k: int, dev) -> torch.Tensor:
    return (torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev))).to(BF16)  # heavy-tailed rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _ordered(v: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as integers in value order: differences are ulp distances."""
    b = v.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


# ---------------------------------------------------------------------------------------------- CPU
def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp8_linear_mma import fp8_linear_partials

    n, k = 64, 512
    codes = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8)
    w = _weight(codes, torch.ones(1, 4), 128, 128)
    x = torch.zeros(3, k, dtype=BF16)
    out = torch.zeros(3, n, dtype=BF16)
    with pytest.raises(ValueError, match="x must be bf16"):
        fp8_linear_partials(x.float(), w, out)
    with pytest.raises(ValueError, match="rows 16-byte aligned"):
        fp8_linear_partials(torch.zeros(3, k + 4, dtype=BF16)[:, :k], w, out)
    with pytest.raises(ValueError, match="must start 16-byte aligned"):
        fp8_linear_partials(torch.zeros(3 * k + 1, dtype=BF16)[1:].view(3, k), w, out)
    with pytest.raises(ValueError, match="x has K=256"):
        fp8_linear_partials(x[:, :256], w, out)
    with pytest.raises(ValueError, match="w.data must be contiguous"):
        fp8_linear_partials(x, _weight(torch.zeros(k, n, dtype=torch.uint8).t(), torch.ones(1, 4), 128, 128), out)
    with pytest.raises(ValueError, match="w.block must be 128 or 32"):
        fp8_linear_partials(x, _weight(codes, torch.ones(1, 8), 64, 64), out)
    with pytest.raises(ValueError, match="w.act_block must be 128 or 32 and divide the weight block 32"):
        fp8_linear_partials(x, _weight(codes, torch.ones(2, 16), 32, 128), out)
    with pytest.raises(ValueError, match="out must be bf16"):
        fp8_linear_partials(x, w, out.float())
    with pytest.raises(ValueError, match="out must be fp32"):
        fp8_linear_partials(x, w, torch.zeros(2, 3, n, dtype=BF16))
    with pytest.raises(ValueError, match="K per split 128 must be a multiple of 128 x STAGES 2"):
        fp8_linear_partials(x, w, torch.zeros(4, 3, n))
    with pytest.raises(ValueError, match="split 3 must divide K=512"):
        fp8_linear_partials(x, w, torch.zeros(3, 3, n))
    with pytest.raises(ValueError, match="cluster_split must be 1..16, got 32"):
        fp8_linear_partials(x, w, out, cluster_split=32)
    with pytest.raises(ValueError, match="cluster_split 3 must divide the tile's 1024 outputs"):
        fp8_linear_partials(x, w, out, cluster_split=3)
    with pytest.raises(ValueError, match="K per split 128 must be a multiple of 128 x STAGES 2"):
        fp8_linear_partials(x, w, out, cluster_split=4)
    part, counters = torch.zeros(2, 3, n), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fin \(the serial split's output\) needs fp32 partials"):
        fp8_linear_partials(x, w, out, fin=out, counters=counters)
    with pytest.raises(ValueError, match="fin must be bf16"):
        fp8_linear_partials(x, w, part, fin=out.float(), counters=counters)
    with pytest.raises(ValueError, match="counters must be contiguous int32 with >= 1 entries"):
        fp8_linear_partials(x, w, part, fin=out, counters=counters.long())
    with pytest.raises(ValueError, match="counters must be contiguous int32 with >= 1 entries on cpu, got None"):
        fp8_linear_partials(x, w, part, fin=out)
    with pytest.raises(ValueError, match="counters without fin"):
        fp8_linear_partials(x, w, part, counters=counters)


def test_launcher_refuses_scales_outside_the_exact_expansion():
    from deepinfer.kernels.cuda.fp8_linear_mma import fp8_linear_partials
    from deepinfer.kernels.quant_weights import fp8_scale_exponent_max as scale_exponent_max

    codes = torch.randint(0, 0x7F, (64, 512), dtype=torch.uint8)
    x, out = torch.zeros(3, 512, dtype=BF16), torch.zeros(3, 64, dtype=BF16)
    scale = torch.full((1, 4), 2.0 ** -127)  # E8M0 byte 0: an fp32 subnormal, exponent field 0
    assert scale_exponent_max(scale) == 0
    scale[0, 2] = 128.0
    assert scale_exponent_max(scale) == 134
    scale[0, 1] = 256.0  # the function reads the scales each time (QuantLinearWeight caches its own answer)
    assert scale_exponent_max(scale) == 135
    with pytest.raises(ValueError, match=r"scales up to 2\^7 \(fp32 exponent field 134\); this weight has a scale 2\^8"):
        fp8_linear_partials(x, _weight(codes, scale, 128, 128), out)
    with pytest.raises(ValueError, match="powers of two"):
        fp8_linear_partials(x, _weight(codes, torch.full((1, 4), 0.75), 128, 128), out)


def _expand_emulated(codes: torch.Tensor, scale_exp: torch.Tensor) -> torch.Tensor:
    """The kernel's E4M3 -> bf16 steps on int64 tensors: `pair` (byte permute with sign replication, << 4,
    mask 0x87F0) on each byte, the multiplier's bf16 bits (fp32 bits of 2^120 x scale) >> 16, and the
    product of the two bf16 values (float64: exact), which must then be a bf16 value itself."""
    b = codes.long()
    half = ((((b >> 7) * 0xFF) << 8 | b) << 4) & 0x87F0  # prmt: [sign x 8][byte]; then << 4, & mask
    bits = half << 16
    val = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).int().view(torch.float32).double()  # E4M3 x 2^-120
    mult_bits = (torch.exp2(scale_exp.float() + 120).view(torch.int32).long() >> 16) << 16
    return val * mult_bits.int().view(torch.float32).double()


def test_expansion_is_exact_for_every_byte_and_scale():
    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    exps = torch.arange(-124, 8)
    got = _expand_emulated(codes[:, None], exps[None, :])
    want = codes.view(torch.float8_e4m3fn).double()[:, None] * torch.exp2(exps.double())[None, :]
    assert torch.equal(got, want)
    assert torch.equal(got.to(BF16).double(), got)  # representable: the bf16 multiply rounds nothing


def test_split_rule_on_v4_flash_shapes():
    from deepinfer.kernels.cuda.fp8_linear_mma import plan

    def s(m, n, k, config=None):
        return plan(m, n, k, 132, config)["SPLIT_K"]

    # 128 weight rows x 8 x-rows per CTA; S doubles while the CTAs x S stay <= 4 x 132 = 528, up to 16
    assert s(1, 1024, 4096) == 16 and s(1, 4096, 4096) == 16 and s(1, 4096, 8192) == 16  # 8 / 32 / 32 CTAs
    assert s(1, 32768, 4096) == 2 and s(1, 32768, 1024) == 2  # 256 CTAs
    assert s(8, 4096, 4096) == 16 and s(16, 4096, 4096) == 8 and s(16, 32768, 4096) == 1  # M = 16: 2 row groups
    assert s(1, 1024, 1024, {"STAGES": 4}) == 2  # whole rounds: K / S a multiple of 128 x 4
    assert plan(1, 1024, 384, 132)["STAGES"] == 1 and s(1, 1024, 384) == 1  # K = 3 steps: no double buffering
    assert s(1, 4096, 4096, {"SPLIT_K": 4}) == 4 and s(1, 4096, 4096, {"MT": 1, "WARPS": 4}) == 8
    with pytest.raises(ValueError, match="K per split 256 must be a multiple of 128 x STAGES 4"):
        plan(1, 4096, 4096, 132, {"SPLIT_K": 16, "STAGES": 4})


def test_cluster_rule(monkeypatch):
    """fp8_gemm.use_cluster: never for one split or when turned off; 2..CLUSTER_MAX_SPLIT splits by default;
    config CLUSTER True takes any split; the driver's fit (`fits`) asked last, and only then."""
    from deepinfer.kernels.triton.fp8_gemm import CLUSTER_MAX_SPLIT, use_cluster

    asked = []

    def fits(answer=True):
        return lambda: asked.append(1) or answer

    monkeypatch.delenv("DEEPINFER_LINEAR_CLUSTER_SPLIT", raising=False)
    assert not use_cluster(1, None, fits()) and not asked
    assert use_cluster(2, None, fits()) and use_cluster(CLUSTER_MAX_SPLIT, None, fits()) and len(asked) == 2
    assert not use_cluster(2 * CLUSTER_MAX_SPLIT, None, fits()) and not use_cluster(16, None, fits())
    assert len(asked) == 2  # refused before the driver is asked
    assert use_cluster(16, {"CLUSTER": True}, fits())
    assert not use_cluster(2, None, fits(False))  # the driver says it does not fit
    assert not use_cluster(2, {"CLUSTER": False}, fits())
    monkeypatch.setenv("DEEPINFER_LINEAR_CLUSTER_SPLIT", "0")
    n = len(asked)
    assert not use_cluster(2, None, fits()) and len(asked) == n
    assert use_cluster(16, {"CLUSTER": True}, fits())  # an explicit config still asks for it


def test_serial_split_counters_rule(monkeypatch):
    """fp8_gemm.serial_counters: none for one split, off the callers' default rule (by_default False) or when
    turned off (config SERIAL False, the env switch); else the weight's int32 zeros, made once (16 row tiles x
    the weight's row tiles, or more) and handed out again, never replaced; none when a launch needs more tiles
    than they have. The rule itself: the mma.sync form at SERIAL_MAX_ROWS rows (1)."""
    from deepinfer.kernels.triton.fp8_gemm import SERIAL_MAX_ROWS, serial_counters

    assert SERIAL_MAX_ROWS == 1
    w = _weight(torch.zeros(1000, 512, dtype=torch.uint8), torch.ones(8, 4), 128, 128)
    cpu = torch.device("cpu")
    monkeypatch.delenv("DEEPINFER_LINEAR_SERIAL_SPLIT", raising=False)
    assert serial_counters(w, 16, 8, 128, None, cpu, by_default=True) is None  # off unless the switch is on
    monkeypatch.setenv("DEEPINFER_LINEAR_SERIAL_SPLIT", "1")
    assert serial_counters(w, 1, 8, 128, None, cpu, by_default=True) is None and w._split_counters is None
    assert serial_counters(w, 16, 8, 128, {"SERIAL": False}, cpu, by_default=True) is None
    assert serial_counters(w, 16, 8, 128, None, cpu) is None and w._split_counters is None  # not the rule's
    c = serial_counters(w, 16, 8, 128, None, cpu, by_default=True)
    assert c is not None and c.dtype == torch.int32 and c.numel() == 16 * 8 and not c.any()
    assert serial_counters(w, 2, 16 * 8, 128, None, cpu, by_default=True) is c  # the same tensor: a graph keeps it
    assert serial_counters(w, 2, 16 * 8 + 1, 128, {"SERIAL": True}, cpu) is None and w._split_counters is c  # too few
    monkeypatch.setenv("DEEPINFER_LINEAR_SERIAL_SPLIT", "0")
    assert serial_counters(w, 16, 8, 128, None, cpu, by_default=True) is None
    assert serial_counters(w, 16, 8, 128, {"SERIAL": True}, cpu) is c  # an explicit config still asks for it


def test_source_compiles_for_sm90_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp8_linear_mma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, [{**cfg, "SPLIT_OUT": split_out} for cfg in TILE_CONFIGS for split_out in (0, 1)]
                    + [{**cfg, "SPLIT_OUT": 0, "CLUSTER_SPLIT": s} for cfg in TILE_CONFIGS[:2] for s in (2, 16)]
                    + [{**TILE_CONFIGS[1], "SPLIT_OUT": so, "RAW_ACT": 1, "GROUP_ROWS": 1024} for so in (0, 1)]
                    + [{**cfg, "SPLIT_OUT": 1, "SERIAL_SPLIT": 1} for cfg in TILE_CONFIGS[:2]]
                    + [{**TILE_CONFIGS[1], "SPLIT_OUT": 1, "SERIAL_SPLIT": 1, "RAW_ACT": 1, "GROUP_ROWS": 1024}])


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    return cuda_with_nvrtc()


def _one_hot_weight(n: int, k: int, block: int, dev) -> QuantLinearWeight:
    """Random non-NaN bytes, every row starting with all 254 non-NaN bytes (rotated by the row), block
    scales 2^-117 .. 2^7 (both ends present)."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    every = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    for r in range(n):
        codes[r, :every.numel()] = every.roll(r)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0x01
    shape = (-(-n // block), k // block)
    exps = (torch.arange(shape[0] * shape[1]) * 37) % 125 - 117
    exps[:2] = torch.tensor([-117, 7])
    return _weight(codes, torch.exp2(exps.float()).view(shape), block, block).to(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_cfg_id)
def test_one_hot_rows_give_every_weight_exactly(cfg, block):
    from deepinfer.kernels.cuda.fp8_linear_mma import fp8_linear_partials

    dev = _cuda()
    n, k = 160, 1024  # 160 rows: a partial CTA tile for most configs
    w = _one_hot_weight(n, k, block, dev)
    x = torch.eye(k, dtype=BF16, device=dev)  # M = 1024: 128 groups of 8 rows
    want = w.dequant().T.contiguous()  # [k, n] fp32, every value a bf16
    assert torch.equal(want.to(BF16).float(), want)
    for split in (1, 2):
        if (k // split) % (128 * cfg["STAGES"]):
            continue
        if split == 1:
            out = fp8_linear_partials(x, w, torch.full((k, n), float("nan"), dtype=BF16, device=dev), cfg)
            got = out.float()
        else:
            out = fp8_linear_partials(x, w, torch.full((split, k, n), float("nan"), device=dev), cfg)
            got = out.sum(0)  # the other split's partial is exactly 0
        nan = int(torch.isnan(out).sum())
        bad = got != want
        print(f"one-hot {_cfg_id(cfg)} block={block} split={split}: {nan} unwritten, {int(bad.sum())} wrong")
        assert nan == 0 and not bad.any(), (cfg, block, split, nan, int(bad.sum()), bad.nonzero()[:8].tolist(),
                                            got[bad][:8].tolist(), want[bad][:8].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:4], ids=_cfg_id)
def test_partials_match_float64(cfg):
    from deepinfer.kernels.cuda.fp8_linear_mma import fp8_linear_partials

    dev = _cuda()
    for block in (128, 32):
        n, k = 200, 1024
        w = _random_fp8_weight(n, k, block, block, dev)
        wf = w.dequant().double()
        for m in (1, 5, 13):
            x = _activation(m, k, dev)
            x[0, :block] = 0  # an all-zero group: the 1e-4 amax floor
            a = formats.act_quant_dequant(x, block).double()
            for split in (1, 2, 4):
                if (k // split) % (128 * cfg["STAGES"]):
                    continue
                out = fp8_linear_partials(x, w, torch.full((split, m, n), float("nan"), device=dev), cfg)
                want = torch.stack([a[:, s * k // split:(s + 1) * k // split] @ wf[:, s * k // split:(s + 1) * k // split].T
                                    for s in range(split)])
                rel = _rel(out, want)
                print(f"partials {_cfg_id(cfg)} block={block} M={m} split={split}: rel_err {rel:.2e}")
                assert not torch.isnan(out).any() and rel <= 1e-5, (cfg, block, m, split, rel)  # fp32 sums: ~1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 4096), (4096, 8192), (32768, 1024), (4096, 4096)])
def test_op_matches_twin_v4_flash_decode_shapes(n, k, block):
    from deepinfer.kernels.cuda.fp8_linear_mma import plan
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    dev = _cuda()
    w = _random_fp8_weight(n, k, block, block, dev)
    for m in (1, 3, 8, 16):
        x = _activation(m, k, dev)
        x[0, :block] = 0
        want = fp8_linear_torch(x, w)
        for config in (None, {"SPLIT_K": 1}, {"MT": 1, "WARPS": 8}):
            split = plan(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count, config)["SPLIT_K"]
            out = torch.full((m, n), float("nan"), dtype=BF16, device=dev)
            got = fp8_linear(x, w, config, mma="sync", out=out)
            ulps = (_ordered(got) - _ordered(want)).abs()
            rel, within = _rel(got, want), float((ulps <= 1).float().mean())
            print(f"mma N={n} K={k} block={block} M={m} {config} S={split}: rel_err {rel:.2e}, "
                  f"{within:.4%} within 1 ulp, max {int(ulps.max())} ulps")
            assert got is out and bool(torch.isfinite(got).all()), (m, config, "unwritten or non-finite outputs")
            assert rel <= 3e-4 and within >= 0.99, (m, config, rel, within)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(MT=1, WARPS=8, STAGES=2), dict(MT=2, WARPS=4, STAGES=2)], ids=_cfg_id)
def test_cluster_split_is_the_separate_sum_bit_for_bit(cfg):
    """The split CTAs of a tile adding their partials as a thread-block cluster (CLUSTER_SPLIT) give the
    bits of the separate fixed-order sum (fp32 partials + _split_sum_kernel), for every split 2..16 (16: a
    non-portable cluster), 1..13 rows (two row groups), N not a multiple of the tile's rows; every output
    written (poisoned with NaN); under graph replay too."""
    from deepinfer.kernels.cuda.fp8_linear_mma import cluster_fits, fp8_linear_partials, tiles
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    for split in (2, 16):  # several CTAs an SM: even 16 of them fit a GPC
        assert cluster_fits(13, 4096, {**tiles(cfg), "SPLIT_K": split}, dev), split
    for block, n, k in ((128, 1000, 4096), (32, 520, 2048)):
        w = _random_fp8_weight(n, k, block, block, dev)
        for m in (1, 3, 8, 13):
            x = _activation(m, k, dev)
            for split in (2, 4, 8, 16):
                if (k // split) % (128 * cfg["STAGES"]):
                    continue
                config = {**cfg, "SPLIT_K": split}
                want = fp8_linear(x, w, {**config, "CLUSTER": False, "SERIAL": False}, mma="sync")
                out = torch.full((m, n), float("nan"), dtype=BF16, device=dev)
                got = fp8_linear_partials(x, w, out, cfg, cluster_split=split)
                same = int((got.view(torch.int16) == want.view(torch.int16)).sum())
                print(f"cluster {_cfg_id(cfg)} block={block} N={n} M={m} S={split}: {same} of {m * n} outputs the same bits")
                assert same == m * n, (cfg, block, m, split, same)
        x = _activation(5, k, dev)
        top = max(s for s in (2, 4, 8, 16) if (k // s) % (128 * cfg["STAGES"]) == 0)  # whole pipeline rounds
        assert_replay_is_eager(lambda: fp8_linear(x, w, {**cfg, "SPLIT_K": top, "CLUSTER": True}, mma="sync"),
                               f"fp8_linear sync cluster S={top} block={block}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(MT=1, WARPS=8, STAGES=2), dict(MT=2, WARPS=4, STAGES=2)], ids=_cfg_id)
def test_serial_split_is_the_separate_sum_bit_for_bit(cfg):
    """The tile's last split CTA adding the partials (SERIAL_SPLIT, through the op's dispatch) gives the bits
    of the separate fixed-order sum for splits 2..16, 1..13 rows and 17 (three row groups: three counters per
    weight-row tile), N not a multiple of the tile's rows; every output written (poisoned with NaN); the
    counters are zero again after each launch; three graph replays in a row == eager."""
    from deepinfer.kernels.cuda.fp8_linear_mma import fp8_linear_partials, tile_count, tiles
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    for block, n, k in ((128, 1000, 4096), (32, 520, 2048)):
        w = _random_fp8_weight(n, k, block, block, dev)
        for m in (1, 3, 8, 13, 17):
            x = _activation(m, k, dev)
            for split in (2, 4, 8, 16):
                if (k // split) % (128 * cfg["STAGES"]):
                    continue
                assert_serial_is_separate(x, w, {**cfg, "SPLIT_K": split, "CLUSTER": False}, "sync",
                                          f"{_cfg_id(cfg)} block={block} N={n} M={m} S={split}")
        # straight through the launcher with counters of exactly the launch's tiles
        x = _activation(9, k, dev)
        full = {**tiles(cfg), "SPLIT_K": 2}
        counters = torch.zeros(tile_count(9, n, full), dtype=torch.int32, device=dev)
        part = torch.empty(2, 9, n, device=dev)
        fin = torch.full((9, n), float("nan"), dtype=BF16, device=dev)
        got = fp8_linear_partials(x, w, part, full, fin=fin, counters=counters)
        want = fp8_linear(x, w, {**full, "CLUSTER": False, "SERIAL": False}, mma="sync")
        assert got is fin and torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert not bool(counters.any())
        x = _activation(5, k, dev)
        top = max(s for s in (2, 4, 8, 16) if (k // s) % (128 * cfg["STAGES"]) == 0)

        def run():
            return fp8_linear(x, w, {**cfg, "SPLIT_K": top, "CLUSTER": False, "SERIAL": True}, mma="sync")
        assert_replay_is_eager(run, f"fp8_linear sync serial S={top} block={block}")
        assert_replays_repeat(run)


def assert_serial_is_separate(x: torch.Tensor, w: QuantLinearWeight, config: dict, mma: str, label: str) -> None:
    """fp8_linear with the serial split (config SERIAL True) == with the separate ordered sum, bit for bit, every
    output written (poisoned with NaN), the weight's counters zero again (shared with the wgmma form's tests)."""
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    want = fp8_linear(x, w, {**config, "SERIAL": False}, mma=mma)
    out = torch.full(want.shape, float("nan"), dtype=BF16, device=x.device)
    got = fp8_linear(x, w, {**config, "SERIAL": True}, mma=mma, out=out)
    same = int((got.view(torch.int16) == want.view(torch.int16)).sum())
    print(f"serial {mma} {label}: {same} of {want.numel()} outputs the same bits")
    assert got is out and same == want.numel(), (label, same)
    assert w._split_counters is not None and not bool(w._split_counters.any()), (label, "counters not put back")


def assert_replays_repeat(run) -> None:
    """`run()` captured once and replayed three times in a row (output poisoned before each): every replay ==
    an eager run (a replay whose serial-split counters were not put back would leave tiles unwritten)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        assert torch.equal(captured, run()), "replay after replay"


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_graph_replay_is_eager_bit_for_bit(block):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    w = _random_fp8_weight(4096, 4096, block, block, dev)
    for m, config in ((1, None), (5, {"SPLIT_K": 4}), (16, {"SPLIT_K": 1})):
        x = _activation(m, 4096, dev)
        assert_replay_is_eager(lambda: fp8_linear(x, w, config, mma="sync"), f"fp8_linear sync M={m} {config}")


@pytest.mark.gpu
def test_op_dispatch_takes_the_sync_kernel_up_to_8_rows(monkeypatch):
    """fp8_linear's auto form: the sync kernel for M <= SYNC_MAX_M (bit for bit its output), the Triton bf16
    form above and under DEEPINFER_LINEAR_DECODE_KERNEL=triton."""
    from deepinfer.kernels.triton.fp8_gemm import SYNC_MAX_M, fp8_linear
    from test_kernels_gemm import _cuda, _random_fp8_weight

    dev = _cuda()
    w = _random_fp8_weight(2048, 4096, 128, 128, dev)
    for m in (1, SYNC_MAX_M, SYNC_MAX_M + 1):
        x = torch.randn(m, 4096, device=dev).to(BF16)
        auto, sync, tri = fp8_linear(x, w), fp8_linear(x, w, mma="sync"), fp8_linear(x, w, mma="bf16")
        assert torch.equal(auto, sync if m <= SYNC_MAX_M else tri), m
        monkeypatch.setenv("DEEPINFER_LINEAR_DECODE_KERNEL", "triton")
        assert torch.equal(fp8_linear(x, w), tri), m
        monkeypatch.delenv("DEEPINFER_LINEAR_DECODE_KERNEL")
