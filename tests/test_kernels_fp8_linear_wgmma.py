"""The wgmma form of op "fp8_linear" at batched decode (deepinfer/kernels/cuda/fp8_linear_wgmma.cu + .py: a
producer warp feeds E4M3 weights and the step's tokens through a TMA ring, consumer warpgroups expand the
weights into wgmma's register operand; `fp8_linear` takes it for WGMMA_MIN_M..WGMMA_MAX_M rows on sm_90) and
its activation operand (`act_quant.act_quant_wgmma`: act_quant's q * s in `wgmma_k_order`).

CPU: the A fragments' bytes (`e4m3_pair<J>` of the lane's words, derived here from the m16n8k16 / wgmma RS
layout independently of the kernel's formula) hold exactly `wgmma_k_order`; `act_quant_wgmma` under the
Triton interpreter against act_quant + that order, bit for bit; the launcher's input checks, tile and split
rules; the source compiles for sm_90a in every tile configuration where NVRTC is installed.
GPU (`-m gpu`, fresh random inputs, outputs poisoned with NaN: every element must be written):
* exactness of the expansion and the K order: one-hot activation rows pick single weights, so out[k, n] must
  equal bf16(W[n, k]) bit for bit for all 254 non-NaN bytes, block scales 2^-117 .. 2^7, every token tile
  (16 .. 128) and both warpgroup counts, splits 1 and 2, blocks 128 and 32, rows past N (a partial TMA box);
* the kernel's fp32 partials against float64 sums of the same exact operands (rel_err <= 1e-5), M not a
  multiple of the token tile, K long enough for the ring to wrap;
* the op (fp8_linear(mma="wgmma"): act_quant_wgmma, the kernel, the ordered split sum) against the torch twin
  at V4-Flash decode shapes, M 17 .. 256, blocks 128 and 32: rel_err <= 3e-4 and >= 99% of the outputs within
  1 bf16 ulp (only fp32 summation order differs: fp8_linear's "bf16" form bounds);
* the serial split (the tile's last split CTA adds the partials) == the separate ordered sum bit for bit, N
  not a multiple of 4 (the scalar tail), its counters put back, repeated graph replays;
* CUDA-graph replay == eager bit for bit; the default picks it for 17..256 rows and
  DEEPINFER_LINEAR_BATCH_FORM=swap / bf16 the Triton forms.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch
from test_kernels_fp8_linear_mma import (_activation, _one_hot_weight, _ordered, _rel, _weight,
                                         assert_replays_repeat, assert_serial_is_separate)
from test_kernels_fp8_linear_mma import _random_fp8_weight as _random_weight

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(BT=128, CWG=2, STAGES=4, HALVES=0), dict(BT=128, CWG=4, STAGES=3, HALVES=1),
                dict(BT=64, CWG=2, STAGES=6, HALVES=0), dict(BT=32, CWG=2, STAGES=8, HALVES=0),
                dict(BT=16, CWG=1, STAGES=3, HALVES=0), dict(BT=64, CWG=4, STAGES=2, HALVES=1),
                dict(BT=128, CWG=1, STAGES=5, HALVES=1), dict(BT=32, CWG=4, STAGES=4, HALVES=0)]


def _tag(c: dict) -> str:
    return f"BT{c['BT']}wg{c['CWG']}s{c['STAGES']}h{c['HALVES']}"


def _random_fp8_weight(n: int, k: int, block: int, dev) -> QuantLinearWeight:
    return _random_weight(n, k, block, block, dev)


# ---------------------------------------------------------------------------------------------- CPU
def test_a_fragments_hold_the_wgmma_k_order():
    """Lane (g, t) holds, for 16-K step s, registers a0 (row g, logical K 16s + 2t, + 1) and a2 (row g, 16s + 2t
    + 8, + 9) (a1 / a3: row g + 8, the same K), low half the lower K. The kernel reads the lane's physical K
    32t .. 32t + 31 as words 0..7 (4 bytes each) and fills step s from lo = word 2q, hi = word 2q + 1 (q = s >> 1)
    with e4m3_pair<J>(lo, hi) = (lo's byte J, hi's byte J), J = 2(s & 1) for a0 and J + 1 for a2. So the
    logical K of each half names a physical K: that map must be `wgmma_k_order`."""
    from deepinfer.kernels.triton.act_quant import wgmma_k_order

    held = {}
    for t in range(4):
        for s in range(8):
            q, j = s >> 1, 2 * (s & 1)
            for jj, k_lo in ((j, 16 * s + 2 * t), (j + 1, 16 * s + 2 * t + 8)):
                held[k_lo] = 32 * t + 4 * (2 * q) + jj        # low half: lo's byte jj
                held[k_lo + 1] = 32 * t + 4 * (2 * q + 1) + jj  # high half: hi's byte jj
    assert sorted(held) == list(range(128)) and sorted(held.values()) == list(range(128))
    logical = torch.arange(384)
    want = torch.tensor([held[int(c) % 128] + 128 * (int(c) // 128) for c in logical])
    assert torch.equal(wgmma_k_order(logical), want)


def check_act_quant_wgmma(device: str = "cpu") -> None:
    """act_quant_wgmma against act_quant (formats, the reference) + `wgmma_k_order`, bit for bit, act blocks
    128 and 32, K of one program per 128 .. 1024 columns."""
    from deepinfer.kernels.triton.act_quant import act_quant_wgmma, wgmma_k_order

    gen = torch.Generator().manual_seed(7)
    for m, k, block in ((3, 384, 128), (5, 256, 32), (2, 2048, 128)):
        x = (torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))).to(BF16)
        x[0, :block] = 0  # an all-zero group: the 1e-4 amax floor
        got = act_quant_wgmma(x.to(device), block).cpu()
        want = formats.act_quant_dequant(x.float(), block).to(BF16)[:, wgmma_k_order(torch.arange(k))]
        assert torch.equal(got, want), (m, k, block)
        raw = act_quant_wgmma(x.to(device), block, quant=False).cpu()  # the grouped LoRA's operand: o reordered
        assert torch.equal(raw, x[:, wgmma_k_order(torch.arange(k))]), (m, k, block, "quant=False")


def test_act_quant_wgmma_matches_act_quant_and_the_order():
    """Under the interpreter (with the GPU's fp32 -> E4M3 / bf16 rounding restored, as the fp8_linear tests)."""
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter

    done = run_interpreted(GPU_ROUNDINGS + "\nfrom test_kernels_fp8_linear_wgmma import check_act_quant_wgmma as c"
                                                "\nc()\nprint('ok')\n")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp8_linear_wgmma import fp8_linear_partials, plan

    n, k = 64, 512
    codes = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8)
    w = _weight(codes, torch.ones(1, 4), 128, 128)
    a = torch.zeros(3, k, dtype=BF16)
    out = torch.zeros(3, n, dtype=BF16)
    cfg = plan(3, n, k, 132, {"SPLIT_K": 1})
    with pytest.raises(ValueError, match="a must be contiguous bf16"):
        fp8_linear_partials(a.float(), w, out, cfg)
    with pytest.raises(ValueError, match="a must be contiguous bf16"):
        fp8_linear_partials(a[:, :256], w, out, cfg)
    with pytest.raises(ValueError, match="w.data must be contiguous"):
        fp8_linear_partials(a, _weight(torch.zeros(k, n, dtype=torch.uint8).t(), torch.ones(1, 4), 128, 128), out, cfg)
    with pytest.raises(ValueError, match="w.block must be 32 or 128"):
        fp8_linear_partials(a, _weight(codes, torch.ones(1, 8), 64, 64), out, cfg)
    with pytest.raises(ValueError, match="out must be bf16"):
        fp8_linear_partials(a, w, out.float(), cfg)
    with pytest.raises(ValueError, match=r"out must be fp32 \[2, M, N\] for SPLIT_K 2"):
        fp8_linear_partials(a, w, out, plan(3, n, k, 132, {"SPLIT_K": 2}))
    with pytest.raises(ValueError, match="K=512 must be a positive multiple of 128 x SPLIT_K"):
        fp8_linear_partials(a, w, torch.zeros(8, 3, n), dict(cfg, SPLIT_K=8))
    with pytest.raises(ValueError, match=r"a must be contiguous bf16 \[M, 1024\]"):  # 2 groups of 32 rows: 2 K wide
        fp8_linear_partials(a, w, out, dict(cfg, CWG=1), group_rows=32)
    with pytest.raises(ValueError, match="group_rows 48 must divide the weight's 64 rows"):
        fp8_linear_partials(a, w, out, cfg, group_rows=48)
    with pytest.raises(ValueError, match="group_rows 64 must be a multiple of the plan's 128 weight rows per CTA"):
        fp8_linear_partials(a, w, out, dict(cfg, CWG=2), group_rows=64)
    scale = torch.ones(1, 4)
    scale[0, 1] = 256.0
    with pytest.raises(ValueError, match=r"scales up to 2\^7 .* this weight has a scale 2\^8"):
        fp8_linear_partials(a, _weight(codes, scale, 128, 128), out, cfg)
    with pytest.raises(ValueError, match="powers of two"):
        fp8_linear_partials(a, _weight(codes, torch.full((1, 4), 0.75), 128, 128), out, cfg)


def test_tile_and_split_rules():
    from deepinfer.kernels.cuda.fp8_linear_wgmma import plan, smem_bytes, tiles, usable_weight

    assert [tiles(m)["BT"] for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256)] == [16, 16, 32, 32, 64, 64, 128,
                                                                                     128, 128, 128]
    for m in (16, 32, 64, 128):
        for cwg in (1, 2, 4):
            cfg = tiles(m, {"CWG": cwg})
            assert 2 <= cfg["STAGES"] <= 8 and smem_bytes(cfg) <= 227 * 1024, cfg
            assert cfg["HALVES"] == (cwg == 4), cfg  # whole-stage buffers beside 4 warpgroups' accumulators spill
    assert tiles(128, {"CWG": 2})["STAGES"] == 4 and tiles(32, {"CWG": 2})["STAGES"] == 8
    assert tiles(128, {"CWG": 4})["STAGES"] == 3
    with pytest.raises(ValueError, match="BT 16/32/64/128"):
        tiles(8, {"BT": 256})
    with pytest.raises(ValueError, match="shared memory"):
        tiles(128, {"STAGES": 6})
    with pytest.raises(ValueError, match="DIAG 3 .* needs HALVES 0"):  # the .cu has no wgmmas-only half stages
        tiles(128, {"CWG": 4, "DIAG": 3})
    assert tiles(128, {"CWG": 2, "DIAG": 3})["HALVES"] == 0

    def s(m, n, k, config=None):
        return plan(m, n, k, 132, config)["SPLIT_K"]

    def cwg(m, n, k):
        return plan(m, n, k, 132)["CWG"]

    # the sweep's warpgroups: 4 for the tall wq_b, 1 for small weights in one token tile, else 2
    assert cwg(128, 32768, 1024) == 4 and cwg(32, 32768, 1024) == 4
    assert cwg(128, 1536, 4096) == 1 and cwg(128, 4096, 2048) == 1 and cwg(64, 8192, 1024) == 1
    assert cwg(256, 4096, 2048) == 2 and cwg(128, 4096, 4096) == 2 and cwg(128, 4096, 8192) == 2
    # CTAs = token tiles x ceil(N / (64 CWG)); S doubles while CTAs x S <= 132, each split >= 2 stages
    assert s(128, 32768, 1024) == 1 and s(128, 4096, 8192) == 4 and s(128, 4096, 4096) == 4  # 128 / 32 / 32 CTAs
    assert s(128, 4096, 2048) == 2 and s(128, 1536, 4096) == 4 and s(256, 4096, 4096) == 2  # 64 / 24 / 64 CTAs
    assert s(32, 512, 256) == 1 and s(32, 512, 512) == 2  # whole stages, at least 2 a split
    assert s(128, 4096, 4096, {"SPLIT_K": 2}) == 2 and s(128, 4096, 4096, {"CWG": 1}) == 2
    with pytest.raises(ValueError, match="multiple of 128 x SPLIT_K"):
        plan(128, 4096, 384, 132, {"SPLIT_K": 2})
    codes = torch.randint(0, 0x7F, (64, 512), dtype=torch.uint8)
    assert usable_weight(_weight(codes, torch.ones(1, 4), 128, 128))
    assert usable_weight(_weight(codes, torch.ones(2, 16), 32, 32))
    assert not usable_weight(_weight(codes, torch.ones(1, 8), 64, 64))
    assert not usable_weight(_weight(codes, torch.full((1, 4), 256.0), 128, 128))


def test_the_op_refuses_the_diagnostic_builds():
    """DIAG (benchmarks/bench_linear_wgmma_parts.py) builds parts of the kernel alone: the op must not run them."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp8_gemm import _fp8_linear_wgmma

    codes = torch.randint(0, 0x7F, (64, 512), dtype=torch.uint8)
    w = _weight(codes, torch.ones(1, 4), 128, 128)
    x, out = torch.zeros(20, 512, dtype=BF16), torch.empty(20, 64, dtype=BF16)
    for diag in (1, 2, 3):
        with pytest.raises(ValueError, match="DIAG is a benchmark diagnostic"):
            _fp8_linear_wgmma(x, w, {"DIAG": diag}, out)


def test_source_compiles_for_sm90a_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp8_linear_wgmma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, [{**cfg, "SPLIT_OUT": so} for cfg in TILE_CONFIGS for so in (0, 1)]
                    + [{**cfg, "SPLIT_OUT": so, "GROUP_ROWS": 1024} for cfg in TILE_CONFIGS[:4] for so in (0, 1)]
                    + [{**cfg, "SPLIT_OUT": 1, "SERIAL_SPLIT": 1} for cfg in TILE_CONFIGS[:4]]
                    + [{**TILE_CONFIGS[0], "SPLIT_OUT": 1, "SERIAL_SPLIT": 1, "GROUP_ROWS": 1024}],
                    arch="sm_90a")


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("the wgmma form needs sm_90")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg, block):
    from deepinfer.kernels.cuda.fp8_linear_wgmma import fp8_linear_partials
    from deepinfer.kernels.triton.act_quant import act_quant_wgmma

    dev = _cuda()
    n, k = 200, 1024  # 200 rows: a partial TMA box past N; K = 8 stages: the ring wraps
    w = _one_hot_weight(n, k, block, dev)
    a = act_quant_wgmma(torch.eye(k, dtype=BF16, device=dev), block)  # exact: amax 1 -> q = 256, scale 2^-8
    want = w.dequant().T.contiguous()  # [k, n] fp32, every value a bf16
    assert torch.equal(want.to(BF16).float(), want)
    for split in (1, 2):
        c = dict(cfg, SPLIT_K=split)
        if split == 1:
            out = fp8_linear_partials(a, w, torch.full((k, n), float("nan"), dtype=BF16, device=dev), c)
            got = out.float()
        else:
            out = fp8_linear_partials(a, w, torch.full((split, k, n), float("nan"), device=dev), c)
            got = out.sum(0)  # the other split's partial is exactly 0
        nan = int(torch.isnan(out).sum())
        bad = got != want
        print(f"one-hot {_tag(cfg)} block={block} split={split}: {nan} unwritten, {int(bad.sum())} wrong")
        assert nan == 0 and not bad.any(), (cfg, block, split, nan, int(bad.sum()), bad.nonzero()[:8].tolist(),
                                            got[bad][:8].tolist(), want[bad][:8].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:4] + TILE_CONFIGS[6:], ids=_tag)
def test_partials_match_float64(cfg):
    from deepinfer.kernels.cuda.fp8_linear_wgmma import fp8_linear_partials
    from deepinfer.kernels.triton.act_quant import act_quant_wgmma

    dev = _cuda()
    for block in (128, 32):
        n, k = 328, 2048
        w = _random_fp8_weight(n, k, block, dev)
        wf = w.dequant().double()
        for m in (1, 19, cfg["BT"] + 5):
            x = _activation(m, k, dev)
            x[0, :block] = 0
            a = formats.act_quant_dequant(x, block).double()
            for split in (1, 2, 4):
                c = dict(cfg, SPLIT_K=split)
                if split == 1:  # bf16 out, rounded once: float64's rounding but where fp32 sums cancel
                    out = fp8_linear_partials(act_quant_wgmma(x, block), w,
                                              torch.full((m, n), float("nan"), dtype=BF16, device=dev), c)
                    ulps = (_ordered(out) - _ordered((a @ wf.T).to(BF16))).abs()
                    rel = float((ulps <= 1).float().mean())
                    # bf16's rounding moves a vector by at most 2^-8 of its norm (~1e-3 typically; 2e-3 was
                    # exceeded by chance at M=1 on the H100, 2026-12-05, with every output within 1 ulp)
                    ok = rel >= 0.999 and _rel(out, a @ wf.T) <= 2.0**-8 + 1e-5
                else:
                    out = fp8_linear_partials(act_quant_wgmma(x, block), w,
                                              torch.full((split, m, n), float("nan"), device=dev), c)
                    want = torch.stack([a[:, i * k // split:(i + 1) * k // split] @
                                        wf[:, i * k // split:(i + 1) * k // split].T for i in range(split)])
                    rel = _rel(out, want)
                    ok = rel <= 1e-5  # exact products, fp32 sums: ~1e-6
                print(f"partials {_tag(cfg)} block={block} M={m} split={split}: "
                      f"{'share within 1 ulp' if split == 1 else 'rel_err'} {rel:.2e}")
                assert not torch.isnan(out).any() and ok, (cfg, block, m, split, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("n,k", [(1536, 4096), (32768, 1024), (4096, 8192), (4096, 4096), (4096, 2048),
                                 (8192, 1024)])
def test_op_matches_twin_v4_flash_decode_shapes(n, k, block):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    dev = _cuda()
    w = _random_fp8_weight(n, k, block, dev)
    for m in (17, 32, 64, 100, 128, 256):
        x = _activation(m, k, dev)
        x[0, :block] = 0
        want = fp8_linear_torch(x, w)
        for config in (None, {"SPLIT_K": 1}):
            out = torch.full((m, n), float("nan"), dtype=BF16, device=dev)
            got = fp8_linear(x, w, config, mma="wgmma", out=out)
            ulps = (_ordered(got) - _ordered(want)).abs()
            rel, within = _rel(got, want), float((ulps <= 1).float().mean())
            print(f"wgmma N={n} K={k} block={block} M={m} {config}: rel_err {rel:.2e}, {within:.4%} within 1 ulp, "
                  f"max {int(ulps.max())} ulps")
            assert got is out and bool(torch.isfinite(got).all()), (m, config, "unwritten or non-finite outputs")
            assert rel <= 3e-4 and within >= 0.99, (m, config, rel, within)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:4], ids=_tag)
def test_serial_split_is_the_separate_sum_bit_for_bit(cfg):
    """SERIAL_SPLIT through the op: the bits of fp32 partials + _split_sum_kernel for splits 2..16, M within
    one token tile and across two, N = 1030 (a partial row tile and a 4-output chunk cut by N); every output
    written (poisoned with NaN); the weight's counters zero after each launch; three replays in a row."""
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    for block, n, k in ((128, 1030, 4096), (32, 520, 2048)):
        w = _random_fp8_weight(n, k, block, dev)
        for m in (17, cfg["BT"] + 3):
            x = _activation(m, k, dev)
            for split in (2, 4, 8, 16):
                if k // split < 2 * 128:
                    continue
                assert_serial_is_separate(x, w, {**cfg, "SPLIT_K": split}, "wgmma",
                                          f"{_tag(cfg)} block={block} N={n} M={m} S={split}")
        x = _activation(40, k, dev)

        def run():
            return fp8_linear(x, w, {**cfg, "SPLIT_K": 4, "SERIAL": True}, mma="wgmma")
        assert_replay_is_eager(run, f"fp8_linear wgmma serial block={block}")
        assert_replays_repeat(run)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_graph_replay_is_eager_bit_for_bit(block):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    w = _random_fp8_weight(4096, 4096, block, dev)
    for m, config in ((17, None), (128, {"SPLIT_K": 4}), (200, {"SPLIT_K": 1})):
        x = _activation(m, 4096, dev)
        assert_replay_is_eager(lambda: fp8_linear(x, w, config, mma="wgmma"), f"fp8_linear wgmma M={m} {config}")


@pytest.mark.gpu
def test_op_dispatch_takes_the_wgmma_kernel_for_batched_decode(monkeypatch):
    """fp8_linear's auto form: the wgmma kernel for WGMMA_MIN_M..WGMMA_MAX_M rows (bit for bit its output), the
    Triton forms outside and under DEEPINFER_LINEAR_BATCH_FORM=swap / bf16."""
    from deepinfer.kernels.triton.fp8_gemm import WGMMA_MAX_M, WGMMA_MIN_M, auto_form, fp8_linear

    dev = _cuda()
    w = _random_fp8_weight(32768, 1024, 128, dev)
    for m in (WGMMA_MIN_M - 1, WGMMA_MIN_M, WGMMA_MAX_M, WGMMA_MAX_M + 1):
        x = _activation(m, 1024, dev)
        triton_form = fp8_linear(x, w, mma=auto_form(m, 32768, 1024))
        wg = fp8_linear(x, w, mma="wgmma")
        assert torch.equal(fp8_linear(x, w), wg if WGMMA_MIN_M <= m <= WGMMA_MAX_M else triton_form), m
        for form, mma in (("swap", auto_form(m, 32768, 1024)), ("bf16", "bf16")):
            monkeypatch.setenv("DEEPINFER_LINEAR_BATCH_FORM", form)
            if WGMMA_MIN_M <= m <= WGMMA_MAX_M:
                assert torch.equal(fp8_linear(x, w), fp8_linear(x, w, mma=mma)), (m, form)
            monkeypatch.delenv("DEEPINFER_LINEAR_BATCH_FORM")
