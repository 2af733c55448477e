"""fp4_moe's v2 path (deepinfer/kernels/triton/fp4_moe.py `_fp4_moe_v2`, selected by a config with any of
`V2_KEYS`), and expand 5 (the fp16 trick by 32-bit multiplies): split-K with fixed-order reduce kernels (w13: SwiGLU epilogue + act_quant(h) fused; w2: fused
with the k-row sum), pre-dequantised bf16 activations (A_BF16), one gate+up tile per program, the k-row
order computed in the sum kernel. Every variant must compute the twin's function.

CPU (needs triton, no GPU): the split rule; expand 5's byte conversion equals expand 1's for every byte,
bit for bit; every variant under TRITON_INTERPRET=1 in a fresh process with
the interpreter's numeric bugs patched (`tests/interpreted.py` `GPU_ROUNDINGS`) against the
torch twin at tiny shapes (E=8, D=512, I=256 so that w2's K=256 splits in 2; T in 1, 3, 40; act blocks 128
and 32; limits 10 and 0). Measured when written: every variant 0 .. 0.02 "row ulps" (|diff| over the bf16
ulp of the row's largest |y|), the same as the default kernel under the interpreter; asserted <= 2 row ulps
and rel_err <= 1e-4.
GPU (`-m gpu`, fresh random inputs): V4-Flash dims against the twin at T in 1, 8, 128, rel_err <= 1e-3
(tests/test_kernels_gemm.py's fp4_moe bound); CUDA-graph replay == eager bit for bit on split plans.
The -m gpu tests passed on the H200, 2026-12-01.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_ran_ok, run_compiled, run_interpreted
from deepinfer.kernels.quant_weights import fp4_moe_torch

BF16 = torch.bfloat16
# variants the benchmark compares (`benchmarks/bench_fp4_moe.py --variants`), at tiny shapes
# (config, expand)
TINY_VARIANTS = [(dict(SPLIT_K=2), 1), (dict(SPLIT_K13=4, SPLIT_K2=2, A_BF16=True), 5), (dict(A_BF16=True), 1),
                 (None, 5), (dict(A_BF16=True), 6), (None, 6), (dict(SPLIT_K=1, BN=32), 1),
                 (dict(SPLIT_K=0, A_BF16=True), 1), (dict(SPLIT_K13=4, SPLIT_K2=2, A_BF16=True), 6)]


def sweep_against_twin(make_bank, variants, g: torch.Generator, rel_bound: float, ulp_bound: float) -> None:
    """The interpreter checks' sweep (also the FP8 form's, tests/test_kernels_fp4_fp8_form.py): E=8, D=512,
    I=256, act blocks 128 and 32 (`make_bank(E, D, I, act_block)`), T 1 / 3 / 40 with heavy-tailed rows
    and limits 10 and 0; each `variants(t)` (config, expand) against the torch twin: rel_err <= rel_bound and
    at most ulp_bound row ulps (|diff| over the bf16 ulp of the row's largest |y|), every value finite.
    The CPU CI's budget: the interpreter takes 3-14 s a call, so each variant runs once per T, not once per
    (T, act block, limit): at T=3 the variants alternate between the two limits, and at every T between the
    two act blocks (variant v at limit v % L, act block (v // L) % 2 with L limits), so each act block
    meets half of the variants and, at T=3, both limits."""
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    E, D, I = 8, 512, 256
    worst = 0.0
    for ai, ab in enumerate((128, 32)):
        b = make_bank(E, D, I, ab)
        for t, limits in ((1, (10.0,)), (3, (10.0, 0.0)), (40, (0.0,))):
            x = (torch.randn(t, D, generator=g) * torch.exp(torch.randn(t, 1, generator=g))).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(t)])
            w = torch.rand(t, 6, generator=g) * 0.5
            for li, limit in enumerate(limits):
                want = fp4_moe_torch(x, ids, w, b, limit)
                ulp = 2.0 ** (torch.floor(torch.log2(want.abs().amax(1, keepdim=True).clamp(min=1e-30))) - 7)
                for vi, (cfg, expand) in enumerate(variants(t)):
                    if vi % len(limits) != li or (vi // len(limits)) % 2 != ai:
                        continue
                    got = fp4_moe(x, ids, w, b, limit, expand=expand, config=cfg)
                    rel = float((got.double() - want.double()).norm() / want.double().norm())
                    ulps = float(((got - want).abs() / ulp).max())
                    worst = max(worst, ulps)
                    print(f"act_block={ab} T={t} limit={limit} cfg={cfg} expand={expand}: rel_err {rel:.2e}, "
                          f"{ulps:.3f} row ulps", flush=True)
                    assert bool(torch.isfinite(got).all()) and ulps <= ulp_bound and rel <= rel_bound, \
                        (ab, t, limit, cfg, expand, rel, ulps)
    print(f"worst {worst:.3f} row ulps")


def test_split_rule_on_v4_flash_shapes():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import plan_v2, split_k

    assert split_k(6 * 64, 4096, 128, 132) == 4 and split_k(6 * 64, 2048, 128, 132) == 4  # T=1, BN=64
    assert split_k(48 * 64, 4096, 128, 132) == 1  # T=8: 48 blocks already fill the SMs
    assert split_k(1, 4096, 128, 132) == 8 and split_k(1, 2048, 128, 132) == 4  # >= 4 K steps per split
    cfg = plan_v2(6, 256, 6, 4096, 2048, 132, {"SPLIT_K": 0})
    assert (cfg["S13"], cfg["S2"], cfg["BM"], cfg["BN"]) == (4, 4, 16, 64)
    cfg = plan_v2(6, 256, 6, 4096, 2048, 132, {"SPLIT_K13": 8, "SPLIT_K2": 2})
    assert (cfg["S13"], cfg["S2"]) == (8, 2)
    with pytest.raises(ValueError, match="SPLIT_K"):
        plan_v2(6, 256, 6, 4096, 2048, 132, {"SPLIT_K": 3})


_EXPANSION_CHECK = r'''
import torch, triton, triton.language as tl
from deepinfer import formats
from deepinfer.kernels.triton.fp4_moe import _e2m1_bytes_to_f32_fp16_mul, _e2m1_bytes_to_f32_fp16_trick

@triton.jit
def k(p, o1, o5, N: tl.constexpr):
    b = tl.load(p + tl.arange(0, N)[None, :])
    tl.store(o1 + tl.arange(0, 2 * N)[None, :], _e2m1_bytes_to_f32_fp16_trick(b))
    tl.store(o5 + tl.arange(0, 2 * N)[None, :], _e2m1_bytes_to_f32_fp16_mul(b))

b = torch.arange(256, dtype=torch.uint8)
o1, o5 = torch.empty(512), torch.empty(512)
k[(1,)](b, o1, o5, N=256)
ref = formats.fp4_codes_to_float(formats.unpack_fp4(b)) * 2.0 ** -14  # low nibble first
assert torch.equal(o5.view(torch.int32), o1.view(torch.int32)), (o5 - o1).abs().max()  # same bits, -0 included
assert torch.equal(o5, ref), (o5 - ref).abs().max()
print("OK")
'''


def test_expand5_byte_conversion_equals_expand1_for_every_byte():
    pytest.importorskip("triton")
    r = run_interpreted(_EXPANSION_CHECK, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# expand 6 for every byte x every E8M0 scale byte it admits (0..128): the exact value E2M1 x 2**(S-127), bit
# for bit (on the GPU through the inline mul.rn.bf16x2, under the interpreter through its fp32 fallback)
_EXPAND6_CHECK = r'''
import torch, triton, triton.language as tl
from deepinfer import formats
from deepinfer.kernels.triton.fp4_moe import EXPAND6_SCALE_MAX, _e2m1_bytes_bf16x2_scaled

@triton.jit
def k(p, sc, o):
    s = tl.program_id(0)
    rows = tl.arange(0, 16)[:, None]
    b = tl.load(p + rows * 16 + tl.arange(0, 16)[None, :])
    byte = tl.load(sc + s + rows * 0)  # [16, 1]: this program's scale byte on every row
    tl.store(o + s * 512 + rows * 32 + tl.arange(0, 32)[None, :], _e2m1_bytes_bf16x2_scaled(b, byte, 16, 32))

dev = DEVICE
lo = LOWEST  # the interpreter flushes subnormal results (S <= 1: 0.5 x 2**(S-127) < 2**-126); the GPU must not
n = EXPAND6_SCALE_MAX + 1 - lo
b = torch.arange(256, dtype=torch.uint8, device=dev)
sc = torch.arange(lo, EXPAND6_SCALE_MAX + 1, dtype=torch.uint8, device=dev)
o = torch.empty(n * 512, dtype=torch.bfloat16, device=dev)
k[(n,)](b, sc, o)
vals = formats.fp4_codes_to_float(formats.unpack_fp4(b.cpu()))  # [512], low nibble first
ref = (vals[None, :] * torch.exp2(torch.arange(lo, lo + n, dtype=torch.float32) - 127)[:, None]).to(torch.bfloat16)
got = o.cpu().view(n, 512)
assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (got.float() - ref.float()).abs().max()
print("OK")
'''


def test_expand6_byte_conversion_is_exact_for_every_byte_and_scale():
    pytest.importorskip("triton")
    r = run_interpreted(_EXPAND6_CHECK.replace("DEVICE", "'cpu'").replace("LOWEST", "2"), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_expand6_refuses_a_bank_with_scales_above_its_exact_range():
    pytest.importorskip("triton")
    from deepinfer.kernels.quant_weights import FP4ExpertBank
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    g = torch.Generator().manual_seed(0)
    sc = lambda *s: torch.full(s, 120, dtype=torch.uint8)  # noqa: E731
    w2s = sc(4, 128, 2)
    w2s[3, 5, 1] = 129  # one scale of 4: above expand 6's range
    bank = FP4ExpertBank(torch.randint(0, 256, (4, 128, 64), dtype=torch.uint8, generator=g), sc(4, 128, 4),
                         torch.randint(0, 256, (4, 128, 32), dtype=torch.uint8, generator=g), w2s, 32)
    assert bank.scale_max == 129
    x, ids, w = torch.randn(2, 128).to(BF16), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    with pytest.raises(ValueError, match="expand 6 is exact for E8M0 scale bytes up to 128.*129"):
        fp4_moe(x, ids, w, bank, 0.0, expand=6)
    assert torch.equal(fp4_moe(x, ids, w, bank, 0.0, expand=5), fp4_moe_torch(x, ids, w, bank, 0.0))  # CPU: the twin


@pytest.mark.gpu
def test_expand6_byte_conversion_is_exact_on_the_gpu(tmp_path):
    _cuda()
    r = run_compiled(_EXPAND6_CHECK.replace("DEVICE", "'cuda'").replace("LOWEST", "0"), tmp_path, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


_INTERPRET_CHECK = r'''
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import torch

from deepinfer.kernels.quant_weights import FP4ExpertBank
from test_kernels_fp4_moe_split import TINY_VARIANTS, sweep_against_twin

g = torch.Generator().manual_seed(5)


def bank(e, d, i, ab):
    sc = lambda *s: torch.randint(119, 129, s, dtype=torch.uint8, generator=g)
    return FP4ExpertBank(torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, generator=g), sc(e, 2 * i, d // 32),
                         torch.randint(0, 256, (e, d, i // 2), dtype=torch.uint8, generator=g), sc(e, d, i // 32), ab)


# T=40 (the interpreter's slowest rows) with the expand-6 variants only, unsplit and both GEMMs split (expand 6
# is the production expansion; 1 and 5 are covered at T=1 and 3): the sweep was the CPU CI's slowest test
sweep_against_twin(bank, lambda t: TINY_VARIANTS if t != 40 else [TINY_VARIANTS[5], TINY_VARIANTS[8]], g,
                   rel_bound=1e-4, ulp_bound=2)
print("ok")
'''


def test_fp4_moe_v2_variants_match_the_twin_under_the_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=900)
    print(res.stdout[-4000:])
    assert_ran_ok(res)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
GPU_VARIANTS = [(dict(SPLIT_K=0), 1), (dict(SPLIT_K=0, A_BF16=True), 5), (dict(A_BF16=True), 1), (None, 5),
                (dict(A_BF16=True, BN=128), 5), (dict(SPLIT_K=2, BN=128), 1), (dict(SPLIT_K13=8, SPLIT_K2=4, A_BF16=True), 5),
                (dict(A_BF16=True, BN=128, num_warps=8, num_stages=3), 5), (dict(SPLIT_K=0, A_BF16=True, BN=128), 6),
                (dict(SPLIT_K=2, A_BF16=True), 6), (None, 6)]


from test_kernels_gemm import _cuda as _cuda_device, _random_bank as _bank, _rel, assert_replay_is_eager  # noqa: E402


def _cuda():
    pytest.importorskip("triton")
    return _cuda_device()


@pytest.fixture(scope="module")
def flash_bank():
    return _bank(256, 4096, 2048, 128, _cuda())


def _inputs(t, dev, e=256, d=4096):
    x = (torch.randn(t, d, device=dev) * torch.exp(torch.randn(t, 1, device=dev))).to(BF16)
    ids = torch.stack([torch.randperm(e, device=dev)[:6] for _ in range(t)])
    return x, ids, torch.rand(t, 6, device=dev) * 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 128])
def test_fp4_moe_v2_matches_twin_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    dev = flash_bank.w13.device
    x, ids, weights = _inputs(t, dev)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        for cfg, expand in GPU_VARIANTS:
            got = fp4_moe(x, ids, weights, flash_bank, limit, expand=expand, config=cfg)
            rel = _rel(got, want)
            print(f"fp4_moe v2 T={t} limit={limit} cfg={cfg} expand={expand}: rel_err={rel:.2e}")
            assert bool(torch.isfinite(got).all()) and rel <= 1e-3, (cfg, expand, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("act_block", [128, 32])
def test_fp4_moe_v2_small_dims_match_twin(act_block):
    """Many experts per block (T=200 over 32 experts: BM=64 tiles from `_config`) and act_block 32."""
    dev = _cuda()
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    bank = _bank(32, 512, 256, act_block, dev)
    for t in (1, 3, 200):
        x, ids, weights = _inputs(t, dev, e=32, d=512)
        want = fp4_moe_torch(x, ids, weights, bank, 10.0)
        for cfg in (dict(SPLIT_K=2), dict(SPLIT_K13=4, SPLIT_K2=2, A_BF16=True), dict(A_BF16=True)):
            rel = _rel(fp4_moe(x, ids, weights, bank, 10.0, expand=5, config=cfg), want)
            print(f"fp4_moe v2 small act_block={act_block} T={t} cfg={cfg}: rel_err={rel:.2e}")
            assert rel <= 1e-3, (cfg, rel)


@pytest.mark.gpu
def test_fp4_moe_split_graph_replay_is_eager_bit_for_bit(flash_bank):
    """The fixed-order split reduces make eager runs and CUDA-graph replays bit-identical."""
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    dev = flash_bank.w13.device
    for t, cfg in ((1, dict(SPLIT_K=0)), (1, dict(SPLIT_K13=8, SPLIT_K2=4, A_BF16=True)), (8, dict(SPLIT_K=2)),
                   (128, dict(SPLIT_K=2, A_BF16=True, BN=128))):
        x, ids, weights = _inputs(t, dev)
        run = lambda: fp4_moe(x, ids, weights, flash_bank, 10.0, expand=5, config=cfg)  # noqa: E731
        assert_replay_is_eager(run, f"T={t} {cfg}")
