"""The mma.sync form of the routed experts at decode (deepinfer/kernels/cuda/fp4_moe_mma.cu + .py, wired into
`fp4_moe` as config MMA_SYNC and, by DEEPINFER_MOE_DECODE_KERNEL / DECODE_FORM, as the decode default).

CPU: the launcher's input checks and the split rule; the source compiles for sm_90 where NVRTC is installed
(the CPU CI has none: skipped there).
GPU (`-m gpu`, fresh random inputs):
* exactness and the fragment mapping: one-hot activation rows pick single weights, so every output must
  equal one weight E2M1 x 2^(S-127) bit for bit, for all 256 bytes and every scale byte 0..128, in every
  tile configuration (a K position fed to the MMA from A and B in different orders would show here);
* the kernel alone against float64 partial sums (rel_err <= 1e-5: exact products, fp32 sums), every
  output entry written (the output is poisoned with NaN first), splits 1..4, padding slots, rows past N;
* the whole op against the torch twin at V4-Flash dims (rel_err <= 1e-3, the Triton kernels' bound) and
  against the Triton v2 kernels (the same math up to fp32 summation order, which bf16 / E4M3 roundings
  between the GEMMs amplify: rel_err <= 1e-3); CUDA-graph replay == eager bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(MT=2, WARPS=4, STAGES=2), dict(MT=1, WARPS=4, STAGES=2, KSTEP=256), dict(MT=1, WARPS=4, STAGES=1),
                dict(MT=2, WARPS=4, STAGES=4, ASYNC=1), dict(MT=1, WARPS=4, STAGES=4, KSTEP=256, ASYNC=1),
                dict(MT=2, WARPS=4, STAGES=4), dict(MT=4, WARPS=4, STAGES=2), dict(MT=1, WARPS=8, STAGES=2),
                dict(MT=2, WARPS=2, STAGES=2), dict(MT=2, WARPS=4, STAGES=2, KSTEP=256), dict(MT=1, WARPS=4, STAGES=6, ASYNC=1)]


def _tag(c: dict) -> str:
    return f"MT{c['MT']}w{c['WARPS']}s{c['STAGES']}k{c.get('KSTEP', 128)}" + ("a" if c.get("ASYNC") else "")


def _kstep(cfg: dict) -> int:
    return cfg.get("KSTEP", 128) * cfg["STAGES"]


def _weights_f64(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/2] + E8M0 [E, N, K/32] -> float64 [E, N, K] exact values (low nibble = even K)."""
    vals = formats.fp4_codes_to_float(formats.unpack_fp4(w.cpu())).double()
    scale = torch.exp2(s.cpu().double() - 127).repeat_interleave(32, dim=-1)
    return vals * scale


def _routing(ids: torch.Tensor, e: int):
    from deepinfer.kernels.cuda.fp4_moe_mma import TOKENS
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    return align_by_expert(ids, e, TOKENS)


def _reference_partials(a, w, s, sorted_slots, block_expert, n_slots, a_row_div, split):
    """float64 [split, n_slots, N]: each slot's activation row times its expert's weights over each K range."""
    wf = _weights_f64(w, s)
    e, n, k = wf.shape
    out = torch.zeros(split, n_slots, n, dtype=torch.float64)
    slots = sorted_slots.cpu().view(-1, 8)
    for b, ex in enumerate(block_expert.cpu().tolist()):
        if ex < 0:
            continue
        for slot in slots[b].tolist():
            if slot >= n_slots:
                continue
            row = a[slot // a_row_div, :k].double().cpu()
            for sp in range(split):
                lo, hi = sp * k // split, (sp + 1) * k // split
                out[sp, slot] = wf[ex, :, lo:hi] @ row[lo:hi]
    return out


# ---------------------------------------------------------------------------------------------- CPU
def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp4_moe_mma import expert_gemm_partials

    w = torch.zeros(2, 32, 128, dtype=torch.uint8)
    s = torch.zeros(2, 32, 8, dtype=torch.uint8)
    slots, blocks = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    a = torch.zeros(4, 256, dtype=BF16)
    out = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="a must be bf16"):
        expert_gemm_partials(a.float(), w, s, out, slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="w_scale must be uint8"):
        expert_gemm_partials(a, w, s[:, :, :4], out, slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="out must be fp32"):
        expert_gemm_partials(a, w, s, out[:, :3], slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="K per split 64 must be a multiple of KSTEP 128 x STAGES 2"):
        expert_gemm_partials(a, w, s, torch.zeros(4, 4, 32), slots, blocks, 4, 1)
    with pytest.raises(ValueError, match="routing must be int32 blocks of 8"):
        expert_gemm_partials(a, w, s, out, slots[:6], blocks, 4, 1)


def test_split_rule_on_v4_flash_shapes():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import plan_mma

    cfg = plan_mma(6, 256, 4096, 2048, 132, {"MMA_SYNC": True})  # T=1: MMA_TILES_FEW, 6 blocks x 64 tiles of 64 rows
    assert (cfg["MT"], cfg["KSTEP"], cfg["S13"], cfg["S2"]) == (1, 256, 2, 2), cfg  # doubled while 384 x S < 4 x 132
    cfg = plan_mma(768, 256, 4096, 2048, 132, {"MMA_SYNC": True})  # T=128: the blocks fill the machine
    assert (cfg["MT"], cfg["KSTEP"], cfg["S13"], cfg["S2"]) == (2, 256, 1, 1)  # MMA_TILES
    cfg = plan_mma(6, 256, 4096, 2048, 132, {"MMA_SYNC": True, "SPLIT_K13": 8, "STAGES": 4, "KSTEP": 128})
    assert cfg["S13"] == 8 and cfg["STAGES"] == 4
    with pytest.raises(ValueError, match="K per split 256 must be a multiple of KSTEP 256 x STAGES 4"):
        plan_mma(6, 256, 4096, 2048, 132, {"MMA_SYNC": True, "SPLIT_K": 16, "STAGES": 4})
    cfg = plan_mma(6, 8, 256, 128, 132, {"MMA_SYNC": True})  # the tiny checkpoints' D=256, I=128: one stage
    assert (cfg["KSTEP"], cfg["STAGES"], cfg["S13"], cfg["S2"]) == (128, 1, 2, 1), cfg  # w13: 2 steps, split
    cfg = plan_mma(600, 8, 512, 256, 132, {"MMA_SYNC": True})  # MMA_TILES would need 512-K rounds: I=256
    assert (cfg["KSTEP"], cfg["STAGES"]) == (128, 2), cfg


def test_the_waves_switch_sets_the_auto_split(monkeypatch):
    """DEEPINFER_MOE_MMA_WAVES (A/B runs): 2 CTAs per SM leave b1's 384 CTAs unsplit; a config's WAVES wins; a
    bad value is refused by name."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import plan_mma

    monkeypatch.setenv("DEEPINFER_MOE_MMA_WAVES", "2")
    cfg = plan_mma(6, 256, 4096, 2048, 132, {"MMA_SYNC": True})
    assert (cfg["S13"], cfg["S2"]) == (1, 1), cfg
    assert plan_mma(6, 256, 4096, 2048, 132, {"MMA_SYNC": True, "WAVES": 4})["S13"] == 2
    monkeypatch.setenv("DEEPINFER_MOE_MMA_WAVES", "two")
    with pytest.raises(ValueError, match="DEEPINFER_MOE_MMA_WAVES"):
        plan_mma(6, 256, 4096, 2048, 132, {"MMA_SYNC": True})


def test_the_op_refuses_the_load_only_diagnostic():
    """LOAD_ONLY (benchmarks/bench_moe_load_bound.py) compiles the kernel without its math: the op must not run it."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import _fp4_moe_mma

    sc = lambda *s: torch.full(s, 120, dtype=torch.uint8)  # noqa: E731
    bank = FP4ExpertBank(torch.zeros(4, 512, 128, dtype=torch.uint8), sc(4, 512, 8),
                         torch.zeros(4, 256, 128, dtype=torch.uint8), sc(4, 256, 8), 128)
    x, ids, w = torch.zeros(2, 256, dtype=BF16), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    with pytest.raises(ValueError, match="LOAD_ONLY is a benchmark diagnostic"):
        _fp4_moe_mma(x, ids, w, bank, 0.0, {"MMA_SYNC": True, "LOAD_ONLY": 1}, torch.empty(2, 256))


def test_source_compiles_for_sm90_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp4_moe_mma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, TILE_CONFIGS)


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    return cuda_with_nvrtc()


def assert_one_hot_exact(partials, cfg: dict, splits, dev, n: int = 96, k: int = 1024) -> None:
    """K one-hot activation rows (a token per K position, all routed to expert 0 of 2) through `partials` (an
    `expert_gemm_partials`): output [slot k, row n] must be W[0, n, k] exactly (as values: a -0 weight sums
    to +0) for every split in `splits`; rows cycle through all 256 bytes, scales through 2..128 (from 2 the
    smallest product, 0.5 x 2^-125, is an fp32 normal). Shared by the mma.sync and TMA forms' tests."""
    g = torch.Generator(device="cpu").manual_seed(3)
    w = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8, generator=g)
    w[0, :, :256] = torch.arange(256, dtype=torch.uint8)  # every byte on every row
    s = (torch.arange(2 * n * (k // 32)).view(2, n, k // 32) % 127 + 2).to(torch.uint8)
    ids = torch.zeros(k, 1, dtype=torch.int64)
    sorted_slots, block_expert = _routing(ids, 2)
    a = torch.eye(k, dtype=BF16)
    want = _weights_f64(w, s)[0].T.float()  # [k, n]
    for split in splits:
        out = torch.full((split, k, n), float("nan"), device=dev)
        partials(a.to(dev), w.to(dev), s.to(dev), out, sorted_slots.to(dev), block_expert.to(dev), k, 1, cfg)
        assert not torch.isnan(out).any(), (cfg, split, int(torch.isnan(out).sum()))
        got = out.sum(0).cpu()  # the other splits' partials are exactly 0
        bad = got != want
        assert not bad.any(), (cfg, split, int(bad.sum()), bad.nonzero()[:8].tolist())


def assert_partials_match_float64(partials, cfg: dict, d: int, splits, dev, e: int = 16, i: int = 512,
                                  lay_scales=lambda s: s) -> None:
    """`partials` against float64 partial sums for T = 1, 5, 40 top-6 rows over E experts, w13's shape
    (2I rows, K = d), every split in `splits`: rel_err <= 1e-5 (exact products, fp32 sums), no entry left
    unwritten (the output is NaN first). lay_scales: the device scales' layout (e.g. 16-byte strided rows)."""
    gen = torch.Generator(device="cpu").manual_seed(11)
    w = torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(100, 129, (e, 2 * i, d // 32), dtype=torch.uint8, generator=gen)
    for t in (1, 5, 40):
        x = (torch.randn(t, d, generator=gen) * torch.exp(torch.randn(t, 1, generator=gen))).to(BF16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)])
        sorted_slots, block_expert = _routing(ids, e)
        for split in splits:
            out = torch.full((split, t * 6, 2 * i), float("nan"), device=dev)
            partials(x.to(dev), w.to(dev), lay_scales(s.to(dev)), out, sorted_slots.to(dev), block_expert.to(dev), t * 6, 6, cfg)
            want = _reference_partials(x, w, s, sorted_slots, block_expert, t * 6, 6, split)
            got = out.cpu().double()
            assert not torch.isnan(got).any(), (cfg, t, split, int(torch.isnan(got).sum()))
            rel = float((got - want).norm() / want.norm())
            print(f"{cfg} T={t} split={split}: rel_err {rel:.2e}")
            assert rel <= 1e-5, (cfg, t, split, rel)  # fp32 sums of exact products: measured ~1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    """`assert_one_hot_exact` at K = 1024, 96 rows (a partial CTA tile for most configs), splits 1 and 2 where
    they keep whole pipeline rounds."""
    from deepinfer.kernels.cuda.fp4_moe_mma import expert_gemm_partials

    assert_one_hot_exact(expert_gemm_partials, cfg, [sp for sp in (1, 2) if (1024 // sp) % _kstep(cfg) == 0], _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:4], ids=_tag)
def test_partials_match_float64(cfg):
    from deepinfer.kernels.cuda.fp4_moe_mma import expert_gemm_partials

    d = 1024
    assert_partials_match_float64(expert_gemm_partials, cfg, d, [sp for sp in (1, 2, 4) if (d // sp) % _kstep(cfg) == 0],
                                  _cuda())


@pytest.fixture(scope="module")
def flash_bank():
    from test_kernels_gemm import _random_bank

    return _random_bank(256, 4096, 2048, 128, _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 128])
def test_op_matches_twin_and_triton_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import DECODE_V2, fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _rel

    x, ids, weights = _inputs(t, flash_bank.w13.device)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        triton_v2 = fp4_moe(x, ids, weights, flash_bank, limit, expand=6, config=DECODE_V2)
        for cfg in ({"MMA_SYNC": True}, {"MMA_SYNC": True, "SPLIT_K": 4}, {"MMA_SYNC": True, "MT": 1, "WARPS": 8}):
            got = fp4_moe(x, ids, weights, flash_bank, limit, config=cfg)
            rel, rel_v2 = _rel(got, want), _rel(got, triton_v2)
            print(f"mma T={t} limit={limit} {cfg}: rel_err {rel:.2e} vs twin, {rel_v2:.2e} vs triton v2")
            # the bf16 roundings of gate / up / w2 rows and act_quant(h) turn fp32 summation-order differences
            # into ulp flips: measured 0 .. 3.4e-4 against either (H200, 2026-12-02)
            assert bool(torch.isfinite(got).all()) and rel <= 1e-3 and rel_v2 <= 1e-3, (cfg, rel, rel_v2)


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
        got = fp4_moe(x, ids, weights, bank, 10.0, config={"MMA_SYNC": True})
        assert _rel(got, want) <= 1e-3, (t, _rel(got, want))
        assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config={"MMA_SYNC": True}),
                               f"fp4_moe mma T={t}")


@pytest.mark.gpu
def test_op_refuses_scales_above_the_exact_range():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, mma_form_usable

    dev = _cuda()
    sc = lambda *s: torch.full(s, 120, dtype=torch.uint8, device=dev)  # noqa: E731
    w2s = sc(4, 256, 8)
    w2s[1, 2, 3] = 129
    bank = FP4ExpertBank(torch.randint(0, 256, (4, 512, 128), dtype=torch.uint8, device=dev), sc(4, 512, 8),
                         torch.randint(0, 256, (4, 256, 128), dtype=torch.uint8, device=dev), w2s, 128)
    assert not mma_form_usable(bank, dev)
    x, ids, w = torch.randn(2, 256, device=dev).to(BF16), torch.tensor([[0, 1], [2, 3]], device=dev), torch.rand(2, 2, device=dev)
    with pytest.raises(ValueError, match="exact for E8M0 scale bytes up to 128; this bank has 129"):
        fp4_moe(x, ids, w, bank, 0.0, config={"MMA_SYNC": True})
