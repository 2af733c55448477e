"""The prefill CUDA form of op "fp8_linear" (deepinfer/kernels/cuda/fp8_linear_prefill.cu + .py: a producer warp
feeds both operands' E4M3 codes through a TMA ring, consumer warpgroups run the FP8 wgmmas of each 128-K group
and promote the fresh partial by the group's activation and weight scales: the official fp8_gemm's math, the
Triton "fp8" form's steps).

CPU: the launcher's input checks and tile rules, the dispatch switch, the source compiling for sm_90a in every
tile configuration (where NVRTC is installed).
GPU (`-m gpu`, fresh random inputs, outputs poisoned with NaN: every element must be written):
* layout exactness: one-hot activation rows pick single weights, so out[k, n] must equal bf16(W[n, k]) for
  every non-NaN code and block scales 2^-117 .. 2^7, rows past M (a partial TMA box), the ring wrapping;
* against the Triton "fp8" form (unsplit, the same act_quant) bit for bit: the same FP8 MMA per 128 K, the
  same fused promotion, one bf16 rounding, at V4-Flash prefill shapes and odd M, every tile configuration;
* against the torch twin within the "fp8" form's bound (rel_err <= 2e-3: Hopper's FP8 MMA accumulates inside
  a 128-K group with reduced precision, tests/test_kernels_fp8_linear.py);
* CUDA-graph replay == eager bit for bit; the dispatch switch picks it from FP8_MMA_MIN_M rows.
"""
from __future__ import annotations

import pytest
import torch

from test_kernels_fp8_linear_mma import _activation, _one_hot_weight, _ordered, _rel, _weight
from test_kernels_fp8_linear_mma import _random_fp8_weight as _random_weight

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(CWG=2, BN=128, STAGES=0, GROUP_M=8, PIPE=0), dict(CWG=1, BN=128, STAGES=0, GROUP_M=8, PIPE=0),
                dict(CWG=2, BN=64, STAGES=0, GROUP_M=4, PIPE=0), dict(CWG=1, BN=64, STAGES=3, GROUP_M=1, PIPE=0),
                dict(CWG=2, BN=128, STAGES=2, GROUP_M=16, PIPE=0), dict(CWG=2, BN=128, STAGES=0, GROUP_M=8, PIPE=1),
                dict(CWG=1, BN=128, STAGES=3, GROUP_M=8, PIPE=1), dict(CWG=2, BN=64, STAGES=0, GROUP_M=8, PIPE=1)]
TILE_CONFIGS = [dict(c, PERSIST=0) for c in TILE_CONFIGS] + [
    dict(CWG=2, BN=128, STAGES=0, GROUP_M=8, PIPE=0, PERSIST=1), dict(CWG=2, BN=128, STAGES=3, GROUP_M=1, PIPE=0, PERSIST=1),
    dict(CWG=1, BN=64, STAGES=2, GROUP_M=4, PIPE=0, PERSIST=1)]


# the Triton "fp8" form on wgmma at every M (its own plan takes BM 16, mma.sync, up to 16 rows, whose FP8 sums are
# exact), unsplit, act_quant in one pass: the math the CUDA kernel reproduces
TRITON_WGMMA_PLAN = dict(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4, SPLIT_K=1, FUSED_ACT=False)


def _tag(c: dict) -> str:
    return f"wg{c['CWG']}n{c['BN']}s{c['STAGES']}g{c['GROUP_M']}p{c['PIPE']}{'P' if c['PERSIST'] else ''}"


def _random_fp8_weight(n: int, k: int, dev):
    return _random_weight(n, k, 128, 128, dev)


# ---------------------------------------------------------------------------------------------- CPU
def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp8_linear_prefill import fp8_linear_prefill, tiles

    n, k, m = 256, 512, 3
    codes = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8)
    w = _weight(codes, torch.ones(2, 4), 128, 128)
    xq = torch.zeros(m, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    xs = torch.ones(m, k // 128)
    out = torch.zeros(m, n, dtype=BF16)
    cfg = tiles()
    with pytest.raises(ValueError, match="128 x 128 blocks and act block 128"):
        fp8_linear_prefill(xq, xs, _weight(codes, torch.ones(8, 16), 32, 32), out, cfg, 132)
    with pytest.raises(ValueError, match="N of the plan's BN 128"):
        fp8_linear_prefill(xq, xs, _weight(codes[:192], torch.ones(2, 4), 128, 128), out[:, :192], cfg, 132)
    with pytest.raises(ValueError, match="w.data must be contiguous"):
        fp8_linear_prefill(xq, xs, _weight(torch.zeros(k, n, dtype=torch.uint8).t(), torch.ones(2, 4), 128, 128),
                           out, cfg, 132)
    with pytest.raises(ValueError, match="xq must be contiguous 16-byte aligned float8_e4m3fn"):
        fp8_linear_prefill(xq.view(torch.uint8), xs, w, out, cfg, 132)
    with pytest.raises(ValueError, match=r"xs must be fp32 \[3, 4\]"):
        fp8_linear_prefill(xq, xs[:, :2], w, out, cfg, 132)
    with pytest.raises(ValueError, match="out must be bf16"):
        fp8_linear_prefill(xq, xs, w, out.float(), cfg, 132)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        fp8_linear_prefill(xq, xs, w, torch.zeros(m, n + 4, dtype=BF16)[:, :n], cfg, 132)


def test_tile_rules():
    from deepinfer.kernels.cuda.fp8_linear_prefill import smem_bytes, tiles

    assert tiles()["STAGES"] == 6 and tiles({"CWG": 1})["STAGES"] == 8 and tiles({"BN": 64})["STAGES"] == 8
    for c in TILE_CONFIGS:
        cfg = tiles(c)
        assert 2 <= cfg["STAGES"] <= 8 and smem_bytes(cfg) <= 227 * 1024, cfg
    with pytest.raises(ValueError, match="CWG 1/2"):
        tiles({"CWG": 3})  # spills in the sm_90a build
    with pytest.raises(ValueError, match="BN 64/128"):
        tiles({"BN": 256})
    with pytest.raises(ValueError, match="PIPE 0/1"):
        tiles({"PIPE": 2})
    with pytest.raises(ValueError, match="not both"):
        tiles({"PIPE": 1, "PERSIST": 1})
    assert tiles({"STAGES": 7})["STAGES"] == 7  # past the default budget, within the SM's 227 KB
    with pytest.raises(ValueError, match="shared memory"):
        tiles({"STAGES": 8})
    with pytest.raises(ValueError, match="at least 2 stages"):
        tiles({"STAGES": 1})


def test_the_switch_names_its_choices(monkeypatch):
    pytest.importorskip("triton")
    from deepinfer import env
    from deepinfer.kernels.triton import fp8_gemm

    monkeypatch.setenv("DEEPINFER_LINEAR_PREFILL_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="DEEPINFER_LINEAR_PREFILL_KERNEL='cutlass'"):
        env.linear_prefill_kernel()
    monkeypatch.setenv("DEEPINFER_LINEAR_PREFILL_KERNEL", "triton")
    assert fp8_gemm._prefill_linear_form() == "triton"
    monkeypatch.delenv("DEEPINFER_LINEAR_PREFILL_KERNEL")
    assert fp8_gemm._prefill_linear_form() == fp8_gemm.PREFILL_LINEAR_FORM
    assert not fp8_gemm._prefill_usable(_weight(torch.zeros(128, 128, dtype=torch.uint8), torch.ones(1, 1), 128, 128),
                                        torch.zeros(1, 128, dtype=BF16))  # CPU tensors never take it


def test_source_compiles_for_sm90a_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp8_linear_prefill import SOURCE, tiles
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, [tiles(c) for c in TILE_CONFIGS], arch="sm_90a")


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("the prefill wgmma form needs sm_90")
    return dev


def _run(x: torch.Tensor, w, cfg: dict) -> torch.Tensor:
    from deepinfer.kernels.cuda.fp8_linear_prefill import fp8_linear_prefill, tiles
    from deepinfer.kernels.triton.act_quant import act_quant
    from deepinfer.kernels.triton.fp8_gemm import sm_count

    xq, xs = act_quant(x, 128)
    out = torch.full((x.shape[0], w.out_features), float("nan"), dtype=BF16, device=x.device)
    return fp8_linear_prefill(xq, xs, w, out, tiles(cfg), sm_count(x.device))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    dev = _cuda()
    n, k = 256, 1152  # K = 9 stages: the ring wraps; M = K = 1152 rows: a partial last row tile for BM 128
    w = _one_hot_weight(n, k, 128, dev)
    x = torch.eye(k, dtype=BF16, device=dev)  # act_quant: amax 1 -> code 256 x 2^-8, exact in E4M3
    want = w.dequant().T.contiguous()  # [k, n] fp32, every value a bf16
    assert torch.equal(want.to(BF16).float(), want)
    out = _run(x, w, cfg)
    nan = int(torch.isnan(out).sum())
    bad = out.float() != want
    print(f"one-hot {_tag(cfg)}: {nan} unwritten, {int(bad.sum())} wrong")
    assert nan == 0 and not bad.any(), (cfg, nan, int(bad.sum()), bad.nonzero()[:8].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_matches_the_triton_fp8_form_bit_for_bit(cfg):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    dev = _cuda()
    for n, k in ((1536, 4096), (4096, 2048), (1024, 8192)):
        w = _random_fp8_weight(n, k, dev)
        for m in (1, 77, 1024, 1500):
            x = _activation(m, k, dev)
            x[0, :128] = 0  # an all-zero group: act_quant's amax floor
            got = _run(x, w, cfg)
            want = fp8_linear(x, w, TRITON_WGMMA_PLAN, mma="fp8")
            ulps = (_ordered(got) - _ordered(want)).abs()
            print(f"vs triton fp8 {_tag(cfg)} N={n} K={k} M={m}: {int((ulps > 0).sum())} of {ulps.numel()} differ, "
                  f"max {int(ulps.max())} ulps")
            assert torch.equal(got, want), (cfg, n, k, m, int((ulps > 0).sum()), int(ulps.max()))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 4096), (32768, 1024), (4096, 8192), (4096, 4096), (4096, 2048),
                                 (8192, 1024)])
def test_op_matches_twin_v4_flash_prefill_shapes(n, k):
    from deepinfer.kernels.quant_weights import fp8_linear_torch
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    dev = _cuda()
    w = _random_fp8_weight(n, k, dev)
    for m in (1024, 2100):
        x = _activation(m, k, dev)
        want = fp8_linear_torch(x, w)
        out = torch.full((m, n), float("nan"), dtype=BF16, device=dev)
        got = fp8_linear(x, w, mma="fp8_wgmma", out=out)
        rel = _rel(got, want)
        print(f"fp8_wgmma N={n} K={k} M={m}: rel_err {rel:.2e}")
        assert got is out and bool(torch.isfinite(got).all()) and rel <= 2e-3, (m, rel)


@pytest.mark.gpu
def test_graph_replay_is_eager_bit_for_bit():
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    w = _random_fp8_weight(4096, 4096, dev)
    x = _activation(1100, 4096, dev)
    assert_replay_is_eager(lambda: fp8_linear(x, w, mma="fp8_wgmma"), "fp8_linear fp8_wgmma M=1100")


@pytest.mark.gpu
def test_dispatch_takes_the_kernel_from_fp8_mma_min_m(monkeypatch):
    """DEEPINFER_LINEAR_PREFILL_KERNEL=wgmma: fp8_linear's auto form runs the kernel from FP8_MMA_MIN_M rows, not
    below (the switch changes nothing there); =triton never runs it."""
    from deepinfer.kernels.triton import fp8_gemm

    dev = _cuda()
    w = _random_fp8_weight(4096, 2048, dev)
    calls = []
    original = fp8_gemm._fp8_linear_prefill
    monkeypatch.setattr(fp8_gemm, "_fp8_linear_prefill", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    for m in (fp8_gemm.FP8_MMA_MIN_M - 1, fp8_gemm.FP8_MMA_MIN_M, 3000):
        x = _activation(m, 2048, dev)
        monkeypatch.setenv("DEEPINFER_LINEAR_PREFILL_KERNEL", "triton")
        by_triton = fp8_gemm.fp8_linear(x, w)
        assert calls == [], m
        monkeypatch.setenv("DEEPINFER_LINEAR_PREFILL_KERNEL", "wgmma")
        by_switch = fp8_gemm.fp8_linear(x, w)
        assert calls == ([m] if m >= fp8_gemm.FP8_MMA_MIN_M else []), (m, calls)
        # the unsplit plans of both forms give the same bits; the Triton plan splits K only where tiles are few
        if m >= fp8_gemm.FP8_MMA_MIN_M:
            assert torch.equal(by_switch, fp8_gemm.fp8_linear(x, w, TRITON_WGMMA_PLAN, mma="fp8")), m
        else:
            assert torch.equal(by_switch, by_triton), m
        calls.clear()
        monkeypatch.delenv("DEEPINFER_LINEAR_PREFILL_KERNEL")
