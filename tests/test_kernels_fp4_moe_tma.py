"""The TMA form of the routed experts at decode (deepinfer/kernels/cuda/fp4_moe_tma.cu + .py: a producer warp
streams weights through a shared-memory ring by TMA, consumer warps expand and multiply on mma.sync; wired
into `fp4_moe` as config TMA and, by DEEPINFER_MOE_DECODE_KERNEL=tma / DECODE_FORM, as a decode form).

CPU: the launcher's input checks, the shape / split / shared-memory rules, the tensor-map parameter rules of
the runtime; the source compiles for sm_90 where NVRTC is installed (skipped on the CPU CI, which has none).
GPU (`-m gpu`, fresh random inputs), the same bars as the mma.sync form's tests:
* one-hot activation rows pick single weights: every output must equal one weight E2M1 x 2^(S-127) bit for
  bit, all 256 bytes, scale bytes 2..128, rows past N (a partial TMA box), rings shorter and longer than the
  K steps (the mbarrier phases wrap), splits 1 and 2;
* the kernel alone against float64 partial sums (rel_err <= 1e-5: exact products, fp32 sums), the output
  poisoned with NaN first, padding slots, splits 1..4;
* the whole op against the torch twin and the Triton v2 kernels at V4-Flash dims (rel_err <= 1e-3) and
  against the mma.sync form; CUDA-graph replay == eager bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch
from test_kernels_fp4_moe_mma import assert_one_hot_exact, assert_partials_match_float64

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(MT=4, CWARPS=4, STAGES=3), dict(MT=2, CWARPS=4, STAGES=4), dict(MT=2, CWARPS=4, STAGES=6),
                dict(MT=1, CWARPS=8, STAGES=8), dict(MT=2, CWARPS=4, STAGES=2), dict(MT=4, CWARPS=2, STAGES=4),
                dict(MT=2, CWARPS=8, STAGES=4)]


def _tag(c: dict) -> str:
    return f"MT{c['MT']}w{c['CWARPS']}s{c['STAGES']}"


# ---------------------------------------------------------------------------------------------- CPU
def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp4_moe_tma import expert_gemm_partials

    w = torch.zeros(2, 32, 256, dtype=torch.uint8)  # K = 512
    s = torch.zeros(2, 32, 16, dtype=torch.uint8)
    slots, blocks = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    a = torch.zeros(4, 512, dtype=BF16)
    out = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="a must be bf16"):
        expert_gemm_partials(a.float(), w, s, out, slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="w_scale must be uint8"):
        expert_gemm_partials(a, w, s[:, :, :8], out, slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="out must be fp32"):
        expert_gemm_partials(a, w, s, out[:, :3], slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="split 8 must divide K=512 into multiples of 128"):
        expert_gemm_partials(a, w, s, torch.zeros(8, 4, 32), slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="routing must be int32 blocks of 8"):
        expert_gemm_partials(a, w, s, out, slots[:6], blocks, 4, 1)
    wide = torch.zeros(2, 32, 24, dtype=torch.uint8)[:, :, :16]  # right shape, rows 24 bytes apart
    with pytest.raises(ValueError, match="w_scale must start 16-byte aligned with 16-byte aligned rows"):
        expert_gemm_partials(a, w, wide, out, slots, blocks, 4, 1)
    # K = 256: 8 scale bytes a row, contiguous (the tensor map needs 16-byte rows: the bank pads them)
    with pytest.raises(ValueError, match="sixteen_byte_rows"):
        expert_gemm_partials(a[:, :256].contiguous(), w[:, :, :128], s[:, :, :8].contiguous(), out, slots, blocks, 4, 1)


def test_bank_keeps_scale_rows_16_byte_strided():
    """V4.1-Flash's w2 scales are 72 bytes a row (I = 2304): the bank lays any row length out 16-byte strided
    (a zero-padded buffer, the same values), keeps rows that already are, carries the padding through `to`,
    counts it in the memory check, and dequantises the same weights."""
    from deepinfer.kernels.quant_weights import sixteen_byte_rows
    from deepinfer.model.params_fast import param_bytes

    gen = torch.Generator().manual_seed(3)
    e, d, i = 3, 256, 96  # w2 scales 3 bytes a row, w13's 8
    w13 = torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, generator=gen)
    w2 = torch.randint(0, 256, (e, d, i // 2), dtype=torch.uint8, generator=gen)
    s13 = torch.randint(110, 129, (e, 2 * i, d // 32), dtype=torch.uint8, generator=gen)
    s2 = torch.randint(110, 129, (e, d, i // 32), dtype=torch.uint8, generator=gen)
    bank = FP4ExpertBank(w13, s13.clone(), w2, s2.clone(), 32)
    for got, want in ((bank.w13_scale, s13), (bank.w2_scale, s2)):
        assert torch.equal(got, want) and got.stride() == (got.shape[1] * 16, 16, 1), got.stride()
    moved = bank.to("cpu")
    assert moved.w2_scale.stride() == bank.w2_scale.stride() and torch.equal(moved.w2_scale, s2)
    plain = FP4ExpertBank.__new__(FP4ExpertBank)  # the same tensors without the layout, for the dequant
    plain.w13, plain.w13_scale, plain.w2, plain.w2_scale = w13, s13, w2, s2
    for a, b in zip(bank.dequant_expert(1), FP4ExpertBank.dequant_expert(plain, 1)):
        assert torch.equal(a, b)
    assert param_bytes({"experts": bank}) == w13.numel() + w2.numel() + e * d * 16 + e * 2 * i * 16
    aligned = torch.zeros(2, 4, 32, dtype=torch.uint8)
    assert sixteen_byte_rows(aligned) is aligned


def test_shape_rules_and_shared_memory():
    from deepinfer.kernels.cuda import fp4_moe_tma as tma

    assert tma.scale_row_bytes(4096) == 144 and tma.scale_row_bytes(2048) == 80 and tma.scale_row_bytes(512) == 32
    assert tma.scale_row_bytes(256) == 48 and tma.scale_row_bytes(384) == 48  # splits that start mid-group
    cfg = tma.tiles()
    assert tma.rows_per_cta(cfg) == 256
    # 3 stages x (16 KB weights + 3200 B activations) + 256 rows x 144 scale bytes + 7 barriers
    assert tma.smem_bytes(cfg, 4096) == 3 * (16384 + 3200) + 256 * 144 + 8 * 7
    assert tma.check_shapes(4096, 1, cfg) is None and tma.check_shapes(2048, 16, cfg) is None
    assert "scale box would exceed 256 bytes" in tma.check_shapes(8192, 1, cfg)  # the split's scale box would be 272 bytes
    assert tma.check_shapes(8192, 2, cfg) is None
    assert "shared memory" in tma.check_shapes(4096, 1, tma.tiles({"STAGES": 12}))
    with pytest.raises(ValueError, match="<= 256 rows"):
        tma.tiles({"CWARPS": 8})
    with pytest.raises(ValueError, match="MT, CWARPS, STAGES >= 1"):
        tma.tiles({"STAGES": 0})


def test_split_rule_on_v4_flash_shapes():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import plan_tma

    cfg = plan_tma(6, 256, 4096, 2048, 132, {"TMA": True})  # T=1: 6 blocks x 16 tiles of 256 rows
    assert (cfg["S13"], cfg["S2"]) == (8, 8), cfg  # w13: 96 x S doubled while < 4 x 132; w2 the same grid
    cfg = plan_tma(6, 256, 4096, 2048, 132, {"TMA": True, "MT": 2})  # 128-row tiles: 192 x S
    assert (cfg["S13"], cfg["S2"]) == (4, 4), cfg
    cfg = plan_tma(768, 256, 4096, 2048, 132, {"TMA": True})  # T=128: the blocks fill the machine
    assert (cfg["S13"], cfg["S2"]) == (1, 1), cfg
    cfg = plan_tma(6, 256, 4096, 2048, 132, {"TMA": True, "SPLIT_K13": 8, "STAGES": 4})
    assert cfg["S13"] == 8 and cfg["STAGES"] == 4
    with pytest.raises(ValueError, match="split 3 must divide"):
        plan_tma(6, 256, 4096, 2048, 132, {"TMA": True, "SPLIT_K": 3})
    cfg = plan_tma(768, 256, 8192, 2048, 132, {"TMA": True})  # K 8192 in one split: a 272-byte scale box
    assert cfg["S13"] == 2, cfg


def test_tensor_map_rules():
    from deepinfer.kernels.cuda import runtime

    assert runtime.check_tensor_map((4, 32, 64), (2048, 64, 1), 0x1000, (1, 32, 64)) is None
    assert "innermost a multiple of 16" in runtime.check_tensor_map((4, 32, 64), (2048, 64, 1), 0x1000, (1, 32, 8))
    assert "multiples of 16" in runtime.check_tensor_map((4, 32, 8), (256, 8, 1), 0x1000, (1, 32, 16))
    assert "each dim 1..256" in runtime.check_tensor_map((4, 512, 64), (32768, 64, 1), 0x1000, (1, 512, 64))


def test_moe_decode_kernel_choice_takes_tma_and_linear_does_not(monkeypatch):
    from deepinfer import env

    monkeypatch.setenv("DEEPINFER_MOE_DECODE_KERNEL", "TMA")
    assert env.moe_decode_kernel() == "tma"
    monkeypatch.setenv("DEEPINFER_LINEAR_DECODE_KERNEL", "tma")
    with pytest.raises(ValueError, match="DEEPINFER_LINEAR_DECODE_KERNEL='tma'"):
        env.linear_decode_kernel()


def test_source_compiles_for_sm90_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp4_moe_tma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, TILE_CONFIGS)


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("the TMA form needs sm_90")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    """`assert_one_hot_exact` (the mma.sync form's tests) at K = 1024 and 96 rows, a partial TMA box for every
    config (the box's rows past N are zero-filled and must not be stored); split 8 = 128 K per split, whose
    scale boxes start inside 16-byte groups."""
    from deepinfer.kernels.cuda.fp4_moe_tma import expert_gemm_partials

    assert_one_hot_exact(expert_gemm_partials, cfg, (1, 2, 8), _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:4], ids=_tag)
def test_partials_match_float64(cfg):
    """`assert_partials_match_float64` at K = 2048; splits 8 and 16 (256 / 128 K per split) take their scale
    boxes from mid-group starts."""
    from deepinfer.kernels.cuda.fp4_moe_tma import expert_gemm_partials

    assert_partials_match_float64(expert_gemm_partials, cfg, 2048, (1, 2, 4, 8, 16), _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:2], ids=_tag)
def test_partials_match_float64_with_v41_flash_w2_k(cfg):
    """K = 2304 (V4.1-Flash's w2: 72 scale bytes a row, 16-byte strided by `sixteen_byte_rows`, the tensor
    map's box reaching past the row's end): splits 1, 2, 3, 6, 9, 18 (768 / 256 / 128 K, boxes from
    mid-group starts)."""
    from deepinfer.kernels.cuda.fp4_moe_tma import expert_gemm_partials
    from deepinfer.kernels.quant_weights import sixteen_byte_rows

    assert_partials_match_float64(expert_gemm_partials, cfg, 2304, (1, 2, 3, 6, 9, 18), _cuda(), i=256,
                                  lay_scales=sixteen_byte_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 32])
def test_op_matches_twin_and_mma_v41_flash_expert_dims(t):
    """V4.1-Flash's expert shape (I = 2304, act_block 32; D = 1024 and 32 experts to keep it small) on the
    TMA form against the torch twin and the mma.sync form (rel_err <= 1e-3), and graph replay == eager."""
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, tma_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank, _rel, assert_replay_is_eager

    dev = _cuda()
    bank = _random_bank(32, 1024, 2304, 32, dev)
    assert tma_form_usable(bank, dev) and bank.w2_scale.stride(1) == 80
    x, ids, weights = _inputs(t, dev, e=32, d=1024)
    want = fp4_moe_torch(x, ids, weights, bank, 10.0)
    mma = fp4_moe(x, ids, weights, bank, 10.0, config={"MMA_SYNC": True})
    got = fp4_moe(x, ids, weights, bank, 10.0, config={"TMA": True})
    rel, rel_mma = _rel(got, want), _rel(got, mma)
    print(f"tma V4.1 dims T={t}: rel_err {rel:.2e} vs twin, {rel_mma:.2e} vs mma.sync")
    assert bool(torch.isfinite(got).all()) and max(rel, rel_mma) <= 1e-3, (rel, rel_mma)
    assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config={"TMA": True}), f"v41 tma T={t}")


@pytest.fixture(scope="module")
def flash_bank():
    from test_kernels_gemm import _random_bank

    return _random_bank(256, 4096, 2048, 128, _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 128])
def test_op_matches_twin_triton_and_mma_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import DECODE_V2, fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _rel

    x, ids, weights = _inputs(t, flash_bank.w13.device)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        triton_v2 = fp4_moe(x, ids, weights, flash_bank, limit, expand=6, config=DECODE_V2)
        mma = fp4_moe(x, ids, weights, flash_bank, limit, config={"MMA_SYNC": True})
        for cfg in ({"TMA": True}, {"TMA": True, "SPLIT_K": 4}, {"TMA": True, "MT": 1, "CWARPS": 8, "STAGES": 8}):
            got = fp4_moe(x, ids, weights, flash_bank, limit, config=cfg)
            rel, rel_v2, rel_mma = _rel(got, want), _rel(got, triton_v2), _rel(got, mma)
            print(f"tma T={t} limit={limit} {cfg}: rel_err {rel:.2e} vs twin, {rel_v2:.2e} vs triton v2, "
                  f"{rel_mma:.2e} vs mma.sync")
            assert bool(torch.isfinite(got).all()) and max(rel, rel_v2, rel_mma) <= 1e-3, (cfg, rel, rel_v2, rel_mma)


@pytest.mark.gpu
def test_op_small_bank_act_block_32_and_graph_replay():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, tma_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank, _rel, assert_replay_is_eager

    dev = _cuda()
    bank = _random_bank(32, 512, 512, 32, dev)
    assert tma_form_usable(bank, dev)
    for t in (1, 3, 20):
        x, ids, weights = _inputs(t, dev, e=32, d=512)
        want = fp4_moe_torch(x, ids, weights, bank, 10.0)
        got = fp4_moe(x, ids, weights, bank, 10.0, config={"TMA": True})
        assert _rel(got, want) <= 1e-3, (t, _rel(got, want))
        assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config={"TMA": True}),
                               f"fp4_moe tma T={t}")


@pytest.mark.gpu
def test_decode_default_follows_the_env_choice(monkeypatch):
    """DEEPINFER_MOE_DECODE_KERNEL=tma and the default (auto, DECODE_FORM "tma") run the TMA form above 8 slots
    (bit-identical to config TMA) and the mma.sync form up to 8 (T=1: 6 slots); I = 256 (scale rows of 8
    bytes, laid 16 apart by the bank) runs the TMA form too."""
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, tma_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank

    dev = _cuda()
    tma, mma = {"TMA": True}, {"MMA_SYNC": True}
    for choice in ("tma", "auto"):
        monkeypatch.setenv("DEEPINFER_MOE_DECODE_KERNEL", choice)
        for inter, t, form in ((512, 3, tma), (512, 1, mma), (256, 3, tma)):
            bank = _random_bank(32, 512, inter, 128, dev)
            assert tma_form_usable(bank, dev)
            x, ids, weights = _inputs(t, dev, e=32, d=512)
            got, want = fp4_moe(x, ids, weights, bank, 10.0), fp4_moe(x, ids, weights, bank, 10.0, config=form)
            assert torch.equal(got, want), (choice, inter, t, form)


@pytest.mark.gpu
def test_op_refuses_scales_above_the_exact_range():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, tma_form_usable

    dev = _cuda()
    sc = lambda *s: torch.full(s, 120, dtype=torch.uint8, device=dev)  # noqa: E731
    w2s = sc(4, 512, 16)
    w2s[1, 2, 3] = 129
    bank = FP4ExpertBank(torch.randint(0, 256, (4, 1024, 256), dtype=torch.uint8, device=dev), sc(4, 1024, 16),
                         torch.randint(0, 256, (4, 512, 256), dtype=torch.uint8, device=dev), w2s, 128)
    assert not tma_form_usable(bank, dev)
    x, ids, w = torch.randn(2, 512, device=dev).to(BF16), torch.tensor([[0, 1], [2, 3]], device=dev), torch.rand(2, 2, device=dev)
    with pytest.raises(ValueError, match="TMA form: exact for E8M0 scale bytes up to 128; this bank has 129"):
        fp4_moe(x, ids, w, bank, 0.0, config={"TMA": True})
