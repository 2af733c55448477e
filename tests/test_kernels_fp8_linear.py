"""Op "fp8_linear" (deepinfer/kernels/triton/fp8_gemm.py): split-K and the FP8-tensor-core form.

CPU (needs triton, no GPU):
* the launch plan: `_split_k`'s rule on the V4-Flash shapes, config overrides, bad SPLIT_K / mma rejected;
* both forms (mma "bf16" and "fp8"), split and unsplit, fused (M <= 64) and pre-quantised (M > 64)
  activations, blocks 128 and 32, M = 1 / 5 / 130, N not a multiple of the tile, run by TRITON_INTERPRET=1 in
  a fresh process against the torch twin. Triton 3.6's interpreter has three numeric bugs that the
  subprocess patches (test-only, `interpreted.GPU_ROUNDINGS`): a dot of bf16 operands multiplies their raw uint16
  bit patterns; fp32 -> bf16 casts truncate; fp32 -> E4M3 "rtne" rounds ties up and drops the mantissa
  carry (31.0 -> 16.0); and (with numpy 2) a loop bound that is a runtime int fails to convert. With the GPU's rounding restored, every case equals the twin bit for bit (measured
  0 bf16 ulps at these shapes: K <= 1024, the fp32 summation-order differences vanish in the bf16
  rounding); asserted: <= 2 ulps on any element. The interpreter does FP8 dots exactly (E4M3 -> fp16 ->
  fp32 products), so it checks the fp8 form's indexing and scale promotion, not Hopper's reduced-precision
  FP8 accumulation (that is what the GPU bound below covers).
GPU (`-m gpu`, fresh random inputs every run) against the twin on the same device, output buffer poisoned
with NaN (every element must be written): M in {1, 7, 16, 128, 1000, 4096}, blocks 128 and 32, both forms,
default plans; explicit SPLIT_K 1..8 at decode M; CUDA-graph replay == eager, bit for bit, on split plans.
Bounds: mma "bf16" rel_err <= 3e-4 (exact products, fp32 sums in another order: the old kernel measured 0
at M <= 7, <= 6.0e-5 above); mma "fp8" rel_err <= 2e-3 (Hopper's FP8 MMA accumulates one dot with reduced
precision: measured 6-8e-4). Passed on the H200, 2026-12-01.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import GPU_ROUNDINGS, assert_ran_ok, run_interpreted
from deepinfer import formats
from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch
from test_kernels_gemm import assert_replay_is_eager

BF16 = torch.bfloat16
BOUND = {"bf16": 3e-4, "fp8": 2e-3, "swap": 3e-4}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _random_fp8_weight(n: int, k: int, block: int, act_block: int, dev, gen=None) -> QuantLinearWeight:
    w = torch.randn(n, k, device=dev, generator=gen) * torch.exp(torch.randn(n, 1, device=dev, generator=gen))
    q, s = formats.quant_fp8_blocks(w, block)
    return QuantLinearWeight(q, formats.e8m0_to_float(s), block, act_block)


def _activation(m: int, k: int, dev, gen=None) -> torch.Tensor:
    return (torch.randn(m, k, device=dev, generator=gen) * torch.exp(torch.randn(m, 1, device=dev, generator=gen))).to(BF16)


# ----------------------------------------------------------------------------------------------
# CPU: the launch plan
# ----------------------------------------------------------------------------------------------
def test_split_k_rule_on_v4_flash_shapes():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp8_gemm import plan

    def s(m, n, k, mma="bf16", block=128, config=None):
        return plan(m, n, k, block, block, mma, 132, config)["SPLIT_K"]

    # decode: (M, N) tiles of 16 x 64 (bf16 form; 16 x 32 fp8) would not fill the SMs -> S programs per tile
    assert s(1, 4096, 4096) == 8 and s(1, 1024, 4096) == 8 and s(1, 4096, 8192) == 8 and s(16, 4096, 4096) == 8
    assert s(1, 32768, 4096) == 1 and s(1, 32768, 1024) == 1  # 512 tiles: already ~4 waves
    assert s(1, 4096, 4096, "fp8") == 4 and s(1, 4096, 4096, block=32) == 8
    assert s(128, 4096, 4096) == 2  # workspace traffic cap: S <= K / (16 M)
    assert s(1024, 4096, 4096) == 1 and s(4096, 4096, 4096, "fp8") == 1
    assert s(1, 4096, 4096, config={"SPLIT_K": 1}) == 1 and s(1, 4096, 4096, config={"BN": 128}) == 8
    cfg = plan(4096, 4096, 4096, 32, 32, "fp8", 132, {"BN": 64})
    assert cfg["BN"] == 64 and cfg["BK"] == 128 and cfg["KB"] == 128 and cfg["BM"] == 128
    with pytest.raises(ValueError, match="SPLIT_K"):
        plan(1, 4096, 4096, 128, 128, "bf16", 132, {"SPLIT_K": 3})


def test_auto_form_and_batched_decode_tiles():
    """mma "auto": the exact-product forms below 1024 rows (bf16, or swap for large weights at 17..256 rows:
    fp8_linear_swap's sweep), the FP8 form from 1024 (FP8_MMA_MIN_M says why batched decode stays exact); the
    swap tiles from that sweep; the tiles from the --batch-fp8 sweep of 2026-12-02: bf16 32x64 to M=64, then to
    M=256 64x32 unless N*K >= 32M (128x128), 128x128 above; fp8 64x64 to M=64, then 64 x (64 for N >= 8192,
    else 32) to M=256."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp8_gemm import auto_form, plan

    forms = [auto_form(m, 32768, 1024) for m in (1, 8, 16, 17, 32, 256, 257, 1023, 1024)]
    assert forms == ["bf16"] * 3 + ["swap"] * 3 + ["bf16", "bf16", "fp8"]
    # V4.1's 32x32 blocks: the fp8 form promotes every 32 K, 3.8x slower than bf16 at M = 4096 (H200): bf16
    assert [auto_form(m, 4096, 4096, 32) for m in (1023, 1024, 8192)] == ["bf16"] * 3
    assert auto_form(8192, 4096, 4096, 128) == "fp8"
    # swap where the weight is large for the rows: from 17 rows N*K >= 32M, from 33 rows N*K >= 8M
    assert [auto_form(m, 2048, 4096) for m in (32, 33, 256)] == ["bf16", "swap", "swap"]
    assert [auto_form(m, 1024, 4096) for m in (33, 128)] == ["bf16", "bf16"]
    with pytest.MonkeyPatch.context() as mp:  # the A/B switch back to the bf16 form; a bad value is named
        mp.setenv("DEEPINFER_LINEAR_BATCH_FORM", "bf16")
        assert auto_form(128, 32768, 1024) == "bf16" and auto_form(4096, 32768, 1024) == "fp8"
        mp.setenv("DEEPINFER_LINEAR_BATCH_FORM", "swapped")
        with pytest.raises(ValueError, match="DEEPINFER_LINEAR_BATCH_FORM"):
            auto_form(128, 32768, 1024)

    def tiles(m, n, k=4096, mma="bf16"):
        cfg = plan(m, n, k, 128, 128, mma, 132)
        return cfg["BM"], cfg["BN"]

    assert tiles(8, 4096) == (16, 64) and tiles(32, 4096) == (32, 64) and tiles(128, 2048) == (64, 32)
    assert tiles(128, 32768, 1024) == (128, 128) and tiles(128, 4096, 8192) == (128, 128) and tiles(300, 512) == (128, 128)
    assert tiles(32, 4096, mma="fp8") == (64, 64) and tiles(128, 4096, mma="fp8") == (64, 32)
    assert tiles(128, 32768, 1024, "fp8") == (64, 64) and tiles(300, 4096, mma="fp8") == (128, 128)
    def swap(m, n, k):
        cfg = plan(m, n, k, 128, 128, "swap", 132)
        return cfg["BW"], cfg["BT"], cfg["num_warps"], cfg["FUSED_ACT"]

    assert swap(32, 4096, 4096) == (64, 32, 4, False) and swap(64, 32768, 1024) == (64, 64, 4, False)
    assert swap(128, 32768, 1024) == (128, 128, 8, False) and swap(200, 2048, 4096) == (64, 64, 4, False)
    with pytest.raises(ValueError, match="mma"):
        plan(1, 4096, 4096, 128, 128, "fp16", 132)


# ----------------------------------------------------------------------------------------------
# CPU: the kernels under TRITON_INTERPRET=1
# ----------------------------------------------------------------------------------------------

_INTERPRET_CHECK = GPU_ROUNDINGS + '''
import torch

import test_kernels_fp8_linear as t
from deepinfer.kernels.quant_weights import fp8_linear_torch
from deepinfer.kernels.triton.fp8_gemm import fp8_linear, plan


def ordered(v):  # bf16 bit patterns as integers in value order: differences are ulp distances
    b = v.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


g = torch.Generator().manual_seed(7)
worst = 0
# (block, act_block, M, N, K, mma, config)
cases = []
for block in (128, 32):
    for mma in ("bf16", "fp8"):
        cases += [(block, block, 1, 200, 1024, mma, None), (block, block, 1, 200, 1024, mma, {"SPLIT_K": 1}),
                  (block, block, 5, 72, 512, mma, {"SPLIT_K": 4}), (block, block, 5, 72, 512, mma, {"BN": 64}),
                  (block, block, 130, 72, 256, mma, None), (block, block, 130, 72, 256, mma, {"SPLIT_K": 2}),
                  (block, block, 5, 72, 512, mma, {"FUSED_ACT": False})]  # small M, quantised in a pass first
cases += [(128, 32, 5, 150, 512, "fp8", {"BN": 64, "SPLIT_K": 2}), (128, 32, 5, 150, 512, "bf16", {"SPLIT_K": 2}),
          (32, 32, 3, 40, 256, "fp8", {"BK": 64})]
for block in (128, 32):  # the swap form: token tiles of 16..128 (one or two), weight tiles of 64 / 128 rows
    cases += [(block, block, 1, 200, 1024, "swap", None), (block, block, 5, 72, 512, "swap", {"SPLIT_K": 4}),
              (block, block, 40, 72, 512, "swap", {"BW": 128, "num_warps": 8}),
              (block, block, 130, 72, 256, "swap", None), (block, block, 130, 72, 256, "swap", {"SPLIT_K": 2, "BT": 64}),
              (block, block, 5, 72, 512, "swap", {"FUSED_ACT": True})]
cases += [(128, 32, 20, 150, 512, "swap", {"SPLIT_K": 2})]
for block, act_block, m, n, k, mma, config in cases:
    w = t._random_fp8_weight(n, k, block, act_block, "cpu", g)
    x = t._activation(m, k, "cpu", g)
    x[0, :act_block] = 0  # an all-zero group: the 1e-4 amax floor
    want = fp8_linear_torch(x, w)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = fp8_linear(x, w, config=config, mma=mma, out=out)
    split = plan(m, n, k, block, act_block, mma, 132, config)["SPLIT_K"]
    assert got is out and not bool(got.isnan().any()), (block, m, n, k, mma, config)
    ulps = int((ordered(got) - ordered(want)).abs().max())
    worst = max(worst, ulps)
    print(f"block={block} act_block={act_block} M={m} N={n} K={k} mma={mma} config={config} S={split}: "
          f"max {ulps} ulps, rel_err {t._rel(got, want):.1e}")
    assert ulps <= 2, (block, act_block, m, n, k, mma, config, ulps)
print(f"worst {worst} ulps")
print("ok")
'''


def test_fp8_linear_kernels_match_the_twin_under_the_interpreter():
    """Both forms, split and unsplit, fused and pre-quantised activations (a fresh process: the flag is
    read at import)."""
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=600)
    print(res.stdout[-4000:])
    assert_ran_ok(res)


# ----------------------------------------------------------------------------------------------
# GPU: against the twin, fresh random inputs
# ----------------------------------------------------------------------------------------------
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def _check(x, w, mma, config=None, label=""):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear, plan, sm_count

    m, n = x.shape[0], w.out_features
    out = torch.full((m, n), float("nan"), dtype=BF16, device=x.device)  # poisoned: every element must be written
    got = fp8_linear(x, w, config=config, mma=mma, out=out)
    want = fp8_linear_torch(x, w)
    cfg = plan(m, n, w.in_features, w.block, w.act_block, mma, sm_count(x.device), config)
    assert got is out and got.dtype == BF16 and got.shape == (m, n)
    assert bool(torch.isfinite(got).all()), f"{label}: unwritten (NaN) or non-finite outputs"
    rel = _rel(got, want)
    differ = float((got != want).float().mean())
    tile = {key: cfg[key] for key in ("BM", "BN", "BW", "BT") if key in cfg}
    print(f"fp8_linear {label} mma={mma} M={m} N={n} K={w.in_features} block={w.block} S={cfg['SPLIT_K']} "
          f"{tile}: rel_err={rel:.2e}, {differ:.3%} of elements differ")
    assert rel <= BOUND[mma], f"rel_err {rel:.2e} > {BOUND[mma]} ({differ:.3%} of elements differ)"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["bf16", "fp8", "swap"])
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", [1, 7, 16, 128, 1000, 4096])
def test_fp8_linear_matches_twin(mma, block, m):
    dev = _cuda()
    if mma == "swap" and m > 256:
        pytest.skip("the swap form is for batched decode (tiles of up to 128 tokens); 1000 / 4096 rows are prefill's")
    for n, k in ((1536, 1024), (1000, 4096), (4096, 4096)):  # 1000: a partial weight block along N
        w = _random_fp8_weight(n, k, block, block, dev)
        x = _activation(m, k, dev)
        x[0, :block] = 0  # an all-zero group: the 1e-4 amax floor
        _check(x, w, mma, label="default plan")


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["bf16", "fp8", "swap"])
@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_explicit_splits_match_twin(mma, block):
    dev = _cuda()
    w = _random_fp8_weight(1000, 4096, block, block, dev)
    for m in (1, 16, 64, 300):
        x = _activation(m, 4096, dev)
        for split in (1, 2, 4, 8):
            _check(x, w, mma, {"SPLIT_K": split}, label=f"SPLIT_K={split}")


@pytest.mark.gpu
def test_fp8_linear_v4_flash_shapes_match_twin():
    dev = _cuda()
    for n, k in ((1024, 4096), (32768, 4096), (4096, 8192), (32768, 1024)):
        w = _random_fp8_weight(n, k, 128, 128, dev)
        for m in (1, 16, 64, 128, 512):
            x = _activation(m, k, dev)
            for mma in ("bf16", "fp8", "swap"):
                _check(x, w, mma, label="v4-flash")


@pytest.mark.gpu
@pytest.mark.parametrize("mma", ["bf16", "fp8", "swap"])
@pytest.mark.parametrize("block", [128, 32])
def test_fp8_linear_graph_replay_is_eager_bit_for_bit(mma, block):
    """Split-K plans: the fixed-order reduction makes eager runs and CUDA-graph replays bit-identical."""
    dev = _cuda()
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear, plan, sm_count

    w = _random_fp8_weight(4096, 4096, block, block, dev)
    for m, config in ((1, None), (16, None), (5, {"SPLIT_K": 8}), (128, None)):
        x = _activation(m, 4096, dev)
        cfg = plan(m, 4096, 4096, block, block, mma, sm_count(dev), config)
        assert m == 128 or cfg["SPLIT_K"] > 1, cfg
        assert_replay_is_eager(lambda: fp8_linear(x, w, config=config, mma=mma), f"M={m} S={cfg['SPLIT_K']}")
