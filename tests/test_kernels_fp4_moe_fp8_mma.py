"""The per-32-promoted mma.sync form of the routed experts (deepinfer/kernels/cuda/fp4_moe_fp8_mma.cu + .py,
wired into `fp4_moe` as config FP8_MMA): E4M3 activation codes x E2M1 weights, each 32-K block's dot promoted
into fp32 with its activation and weight scales.

CPU: the launcher's input checks, the plan's rule and the source compiling for sm_90 where NVRTC is installed
(the CPU CI has none: skipped there).
GPU (`-m gpu`, fresh random inputs):
* exactness and the fragment / column mapping: one-hot activation rows (code 1.0, scale 1) pick single weights,
  so every output must equal one weight E2M1 x 2^(S-127) bit for bit, for all 256 bytes and scale bytes 2..240,
  in every tile configuration and both conversions (a K position fed from A and B in different orders, a
  block promoted with another block's scale or a column summed into the wrong token would show here);
* the kernel alone against float64 (rel_err <= 1e-5: exact products, fp32 sums) with random codes and
  activation scales that differ per block (act_block 32 and 128), every output written (NaN-poisoned first),
  splits, padding slots of partly filled routing blocks, rows past N;
* the whole op against the torch twin at V4-Flash dims (rel_err <= 1e-3, the other kernels' bound) and
  against the bf16 mma.sync form; CUDA-graph replay == eager bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
TILE_CONFIGS = [dict(MT=2, WARPS=4, STAGES=2, KSTEP=256, PASSES=1), dict(MT=2, WARPS=4, STAGES=2, KSTEP=256, PASSES=2),
                dict(MT=1, WARPS=4, STAGES=2, KSTEP=128, PASSES=1, CVT=0), dict(MT=1, WARPS=4, STAGES=4, KSTEP=128, PASSES=4),
                dict(MT=2, WARPS=2, STAGES=1, KSTEP=128, PASSES=3), dict(MT=1, WARPS=8, STAGES=2, KSTEP=256, PASSES=2, CVT=0)]


def _tag(c: dict) -> str:
    return f"MT{c['MT']}w{c['WARPS']}s{c['STAGES']}k{c['KSTEP']}p{c['PASSES']}c{c.get('CVT', 1)}"


def _weights_f64(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/2] + E8M0 [E, N, K/32] -> float64 [E, N, K] exact values (low nibble = even K)."""
    vals = formats.fp4_codes_to_float(formats.unpack_fp4(w.cpu())).double()
    return vals * torch.exp2(s.cpu().double() - 127).repeat_interleave(32, dim=-1)


def _routing(ids: torch.Tensor, e: int, cfg: dict):
    from deepinfer.kernels.cuda.fp4_moe_fp8_mma import tokens
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    return align_by_expert(ids, e, tokens(cfg))


def _reference_partials(q, qs, ab, w, s, sorted_slots, block_expert, n_slots, a_row_div, split, per_block):
    """float64 [split, n_slots, N]: each slot's dequantised activation row times its expert's weights over
    each K range (the per-block scalings are exact powers of two, so the order of scaling does not matter)."""
    wf = _weights_f64(w, s)
    e, n, k = wf.shape
    xf = q.cpu().double() * qs.cpu().double().repeat_interleave(ab, dim=1)
    out = torch.zeros(split, n_slots, n, dtype=torch.float64)
    slots = sorted_slots.cpu().view(-1, per_block)
    for b, ex in enumerate(block_expert.cpu().tolist()):
        if ex < 0:
            continue
        for slot in slots[b].tolist():
            if slot >= n_slots:
                continue
            row = xf[slot // a_row_div, :k]
            for sp in range(split):
                lo, hi = sp * k // split, (sp + 1) * k // split
                out[sp, slot] = wf[ex, :, lo:hi] @ row[lo:hi]
    return out


# ---------------------------------------------------------------------------------------------- CPU
def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp4_moe_fp8_mma import expert_gemm_partials

    w = torch.zeros(2, 32, 128, dtype=torch.uint8)
    s = torch.zeros(2, 32, 8, dtype=torch.uint8)
    slots, blocks = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    a, sa = torch.zeros(4, 256, dtype=E4M3), torch.ones(4, 2)
    out = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="a must be float8_e4m3fn"):
        expert_gemm_partials(a.to(BF16), sa, w, s, out, slots, blocks, 4, 1, 128)
    with pytest.raises(ValueError, match="a_scale must be fp32 \\[4, >= 8\\]"):
        expert_gemm_partials(a, sa, w, s, out, slots, blocks, 4, 1, 32)
    with pytest.raises(ValueError, match="act_block must be one of"):
        expert_gemm_partials(a, sa, w, s, out, slots, blocks, 4, 1, 16)
    with pytest.raises(ValueError, match="w_scale must be uint8"):
        expert_gemm_partials(a, sa, w, s[:, :, :4], out, slots, blocks, 4, 1, 128)
    with pytest.raises(ValueError, match="K per split 128 must be a multiple of KSTEP 128 x STAGES 2"):
        expert_gemm_partials(a, sa, w, s, torch.zeros(2, 4, 32), slots, blocks, 4, 1, 128)
    with pytest.raises(ValueError, match="routing must be int32 blocks of 4 slots"):
        expert_gemm_partials(a, sa, w, s, out, slots, blocks, 4, 1, 128, {"PASSES": 2})
    with pytest.raises(ValueError, match="PASSES 1..4"):
        expert_gemm_partials(a, sa, w, s, out, slots, blocks, 4, 1, 128, {"PASSES": 5})


def test_plan_on_v4_flash_shapes():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import plan_fp8mma

    # T=1: one pass; 6 blocks x 32 tiles of 128 rows, split doubled while 192 x S < 4 x 132
    cfg = plan_fp8mma(6, 256, 4096, 2048, 132, {"FP8_MMA": True})
    assert (cfg["PASSES"], cfg["KSTEP"], cfg["S13"], cfg["S2"]) == (1, 256, 4, 4), cfg
    cfg = plan_fp8mma(768, 256, 4096, 2048, 132, {"FP8_MMA": True})  # T=128: 3 slots per expert, two passes
    assert (cfg["PASSES"], cfg["S13"], cfg["S2"]) == (2, 1, 1), cfg
    cfg = plan_fp8mma(6, 8, 256, 128, 132, {"FP8_MMA": True})  # the tiny checkpoints' D=256, I=128: one stage
    assert (cfg["KSTEP"], cfg["STAGES"]) == (128, 1), cfg
    with pytest.raises(ValueError, match="K per split 256 must be a multiple of KSTEP 256 x STAGES 2"):
        plan_fp8mma(6, 256, 4096, 2048, 132, {"FP8_MMA": True, "SPLIT_K": 16})


def test_decode_kernel_variables(monkeypatch):
    from deepinfer import env

    monkeypatch.setenv("DEEPINFER_MOE_DECODE_KERNEL", "MMA32")
    assert env.moe_decode_kernel() == "mma32"
    monkeypatch.setenv("DEEPINFER_LINEAR_DECODE_KERNEL", "mma32")  # the linears have no such kernel
    with pytest.raises(ValueError, match="DEEPINFER_LINEAR_DECODE_KERNEL='mma32': expected one of"):
        env.linear_decode_kernel()
    monkeypatch.setenv("DEEPINFER_MOE_DECODE_KERNEL", "fp8")
    with pytest.raises(ValueError, match="'fp8': expected one of \\('auto', 'mma', 'mma32', 'triton'\\)"):
        env.moe_decode_kernel()


def test_source_compiles_for_sm90_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp4_moe_fp8_mma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, [{**c, "AB": ab} for c in TILE_CONFIGS for ab in (32, 128)])


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    return cuda_with_nvrtc()


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    """K = 1024 one-hot activation rows (code 1.0, scale 1; a token per K position, all routed to expert 0 of 2):
    output [slot k, row n] must be W[0, n, k] exactly; rows cycle through all 256 bytes, scales through 2..240."""
    from deepinfer.kernels.cuda.fp4_moe_fp8_mma import expert_gemm_partials, tokens

    dev = _cuda()
    n, k = 96, 1024  # 96 rows: a partial CTA tile for most configs
    g = torch.Generator(device="cpu").manual_seed(3)
    w = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8, generator=g)
    w[0, :, :256] = torch.arange(256, dtype=torch.uint8)
    s = (torch.arange(2 * n * (k // 32)).view(2, n, k // 32) % 239 + 2).to(torch.uint8)
    ids = torch.zeros(k, 1, dtype=torch.int64)
    sorted_slots, block_expert = _routing(ids, 2, cfg)
    a = torch.eye(k).to(E4M3)
    sa = torch.ones(k, k // 128)
    want = _weights_f64(w, s)[0].T.float()  # [k, n]
    for split in (1, 2):
        if (k // split) % (cfg["KSTEP"] * cfg["STAGES"]):
            continue
        out = torch.full((split, k, n), float("nan"), device=dev)
        expert_gemm_partials(a.to(dev), sa.to(dev), w.to(dev), s.to(dev), out, sorted_slots.to(dev),
                             block_expert.to(dev), k, 1, 128, cfg)
        assert not torch.isnan(out).any(), (cfg, split, int(torch.isnan(out).sum()))
        got = out.sum(0).cpu()
        bad = got != want
        assert not bad.any(), (cfg, split, int(bad.sum()), bad.nonzero()[:8].tolist(), tokens(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_partials_match_float64(cfg):
    from deepinfer.kernels.cuda.fp4_moe_fp8_mma import expert_gemm_partials, tokens

    dev = _cuda()
    gen = torch.Generator(device="cpu").manual_seed(11)
    e, d, i = 16, 1024, 512
    w = torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(100, 141, (e, 2 * i, d // 32), dtype=torch.uint8, generator=gen)
    for ab in (128, 32):
        for t in (1, 5, 40):
            q = (torch.randn(t, d, generator=gen) * 100).clamp(-448, 448).to(E4M3)
            qs = torch.exp2(torch.randint(-12, 4, (t, d // ab), generator=gen).float())  # per block
            ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)])
            sorted_slots, block_expert = _routing(ids, e, cfg)
            for split in (1, 2, 4):
                if (d // split) % (cfg["KSTEP"] * cfg["STAGES"]):
                    continue
                out = torch.full((split, t * 6, 2 * i), float("nan"), device=dev)
                expert_gemm_partials(q.to(dev), qs.to(dev), w.to(dev), s.to(dev), out, sorted_slots.to(dev),
                                     block_expert.to(dev), t * 6, 6, ab, cfg)
                want = _reference_partials(q, qs, ab, w, s, sorted_slots, block_expert, t * 6, 6, split, tokens(cfg))
                got = out.cpu().double()
                assert not torch.isnan(got).any(), (cfg, ab, t, split, int(torch.isnan(got).sum()))
                rel = float((got - want).norm() / want.norm())
                print(f"{cfg} AB={ab} T={t} split={split}: rel_err {rel:.2e}")
                assert rel <= 1e-5, (cfg, ab, t, split, rel)  # exact products, fp32 sums


@pytest.fixture(scope="module")
def flash_bank():
    from test_kernels_gemm import _random_bank

    return _random_bank(256, 4096, 2048, 128, _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 128])
def test_op_matches_twin_and_bf16_mma_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _rel

    x, ids, weights = _inputs(t, flash_bank.w13.device)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        bf16_mma = fp4_moe(x, ids, weights, flash_bank, limit, config={"MMA_SYNC": True})
        for cfg in ({"FP8_MMA": True}, {"FP8_MMA": True, "SPLIT_K": 4, "PASSES": 3}, {"FP8_MMA": True, "CVT": 0}):
            got = fp4_moe(x, ids, weights, flash_bank, limit, config=cfg)
            rel, rel_b = _rel(got, want), _rel(got, bf16_mma)
            print(f"fp8 mma T={t} limit={limit} {cfg}: rel_err {rel:.2e} vs twin, {rel_b:.2e} vs bf16 mma")
            assert bool(torch.isfinite(got).all()) and rel <= 1e-3 and rel_b <= 1e-3, (cfg, rel, rel_b)


@pytest.mark.gpu
def test_op_small_bank_act_block_32_and_graph_replay():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank, _rel, assert_replay_is_eager

    dev = _cuda()
    bank = _random_bank(32, 512, 256, 32, dev)
    for t in (1, 3, 20):
        x, ids, weights = _inputs(t, dev, e=32, d=512)
        want = fp4_moe_torch(x, ids, weights, bank, 10.0)
        got = fp4_moe(x, ids, weights, bank, 10.0, config={"FP8_MMA": True})
        assert _rel(got, want) <= 1e-3, (t, _rel(got, want))
        assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config={"FP8_MMA": True}),
                               f"fp4_moe fp8 mma T={t}")


@pytest.mark.gpu
def test_op_refuses_scales_above_the_promotion_range():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, fp8mma_form_usable

    dev = _cuda()
    sc = lambda *s: torch.full(s, 120, dtype=torch.uint8, device=dev)  # noqa: E731
    w2s = sc(4, 256, 8)
    w2s[1, 2, 3] = 241
    bank = FP4ExpertBank(torch.randint(0, 256, (4, 512, 128), dtype=torch.uint8, device=dev), sc(4, 512, 8),
                         torch.randint(0, 256, (4, 256, 128), dtype=torch.uint8, device=dev), w2s, 128)
    assert not fp8mma_form_usable(bank, dev)
    x, ids, w = torch.randn(2, 256, device=dev).to(BF16), torch.tensor([[0, 1], [2, 3]], device=dev), torch.rand(2, 2, device=dev)
    with pytest.raises(ValueError, match="E8M0 scale bytes <= 240 \\(bank: 241\\)"):
        fp4_moe(x, ids, w, bank, 0.0, config={"FP8_MMA": True})


@pytest.mark.gpu
def test_decode_default_follows_the_variable(flash_bank, monkeypatch):
    """DEEPINFER_MOE_DECODE_KERNEL=mma32 makes the default decode call this form (bit for bit the FP8_MMA
    config), =mma the bf16 mma.sync form."""
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from test_kernels_fp4_moe_split import _inputs

    x, ids, weights = _inputs(8, flash_bank.w13.device)
    own = fp4_moe(x, ids, weights, flash_bank, 10.0, config={"FP8_MMA": True})
    bf16 = fp4_moe(x, ids, weights, flash_bank, 10.0, config={"MMA_SYNC": True})
    assert not torch.equal(own, bf16)  # the two forms sum in different orders: the check below can tell them apart
    monkeypatch.setenv("DEEPINFER_MOE_DECODE_KERNEL", "mma32")
    assert torch.equal(fp4_moe(x, ids, weights, flash_bank, 10.0), own)
    monkeypatch.setenv("DEEPINFER_MOE_DECODE_KERNEL", "mma")
    assert torch.equal(fp4_moe(x, ids, weights, flash_bank, 10.0), bf16)
