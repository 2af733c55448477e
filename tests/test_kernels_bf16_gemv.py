"""The Triton GEMV of ops "linear_f32" / "blinear" at decode rows (deepinfer/kernels/triton/bf16_gemv.py)
against the twins `bf16_gemm.linear_f32_torch` / `official.blinear`.

CPU (no interpreter; the module imports triton, so these skip without it): the wrappers send CPU tensors,
M > GEMV_MAX_ROWS, M x N > GEMV_MAX_WORK and fp32 weights to cuBLAS's versions, i.e. the twins (the same bits); bad inputs raise
ValueError naming the op; the tile rule's invariants.
Interpreter (TRITON_INTERPRET=1 in a fresh process, the GPU's fp32 -> bf16 rounding restored by
`GPU_ROUNDINGS`), seeded random inputs: M in {1, 3, 8}, (N, K) with tails of BN and BK, default and
explicit tiles (several K steps), strided x; the wrappers' routing (M <= GEMV_MAX_ROWS, M x N <= GEMV_MAX_WORK). Bounds: both the kernel and the twin sum the same exact fp32
products in some order, so each is within gamma_K * sum_k |x_k w_k| of the exact sum (gamma_K = K u / (1 - K u),
u = 2**-24, the worst case of any summation order) and they are within twice that of each other: asserted
elementwise against the twin (2 gamma_K) and float64 (gamma_K), plus rel_err <= 1e-5 (bf16_gemm's cuBLAS
bound). blinear: within that fp32 bound plus half a bf16 ulp of each rounding (elementwise, rigorous), and
<= 1 bf16 ulp wherever |result| >= 2**8 x the fp32 bound (no cancellation). Exactness: inputs on a coarse
grid (integers times 2**-4 and 2**-6, K <= 256) make every partial sum exact in fp32, so any order gives the
twin's bits, for both outputs (blinear's rounding of the exact sum included).
GPU (`-m gpu`): V4-Flash decode shapes (K = 4096, N in {64, 256, 1024, 2048}) at M in {1, 2, 4, 8}, the same bounds;
a CUDA graph's replay bit-identical to eager.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_ran_ok, run_interpreted
from deepinfer.kernels import bf16_gemm, official

BF16, F32 = torch.bfloat16, torch.float32
U = 2.0**-24


def _kernel():
    pytest.importorskip("triton")  # CI has no triton: skip cleanly
    from deepinfer.kernels.triton import bf16_gemv

    return bf16_gemv


def _inputs(m: int, n: int, k: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(BF16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(BF16)
    return x.to(device), w.to(device)


def _grid_inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers in [-64, 64] times 2**-4 (x) and 2**-6 (w): products are multiples of 2**-10 of magnitude
    <= 4, so any partial sum of K <= 256 of them is a multiple of 2**-10 of magnitude <= 2**10: exact in
    fp32 (24 bits span 2**-10..2**14)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-64, 65, (m, k), generator=g).to(BF16) * 2.0**-4
    w = torch.randint(-64, 65, (n, k), generator=g).to(BF16) * 2.0**-6
    return x, w


def _check_f32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what) -> None:
    """fp32 output vs the twin and float64, by the summation-order bound (see the module docstring)."""
    k = x.shape[1]
    gamma = k * U / (1 - k * U)
    scale = x.double().abs() @ w.double().abs().T  # sum_k |x_k w_k|
    exact = x.double() @ w.double().T
    want = bf16_gemm.linear_f32_torch(x, w)
    assert got.dtype == F32 and got.shape == want.shape, what
    assert bool(((got.double() - exact).abs() <= gamma * scale).all()), what
    assert bool(((got.double() - want.double()).abs() <= 2 * gamma * scale).all()), what
    rel = float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-300))
    assert rel <= 1e-5, (what, rel)


def _check_bf16(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what) -> None:
    """bf16 output: both are roundings of fp32 sums within 2 gamma_K * sum|x w| of each other."""
    k = x.shape[1]
    bound = 2 * k * U / (1 - k * U) * (x.double().abs() @ w.double().abs().T)
    want = official.blinear(x, w)
    assert got.dtype == BF16 and got.shape == want.shape, what
    g, v = got.double(), want.double()
    half_ulp = lambda t: 2.0 ** (torch.floor(torch.log2(t.abs().clamp(min=2.0**-126))) - 8)  # noqa: E731
    assert bool(((g - v).abs() <= bound + half_ulp(g) + half_ulp(v)).all()), what
    big = v.abs() >= 2**8 * bound
    ordered = lambda t: torch.where(t.view(torch.int16) < 0, -(t.view(torch.int16).int() & 0x7FFF),  # noqa: E731
                                    t.view(torch.int16).int())
    ulps = (ordered(got) - ordered(want)).abs()
    if bool(big.any()):
        assert int(ulps[big].max()) <= 1, (what, int(ulps[big].max()))


# ------------------------------------------------------------------------------ CPU: fallbacks, checks
def test_cpu_tensors_take_the_twins(monkeypatch):
    gemv = _kernel()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for m in (1, 3, 16, 17):
        x, w = _inputs(m, 37, 200, m)
        assert torch.equal(gemv.linear_f32(x, w), bf16_gemm.linear_f32_torch(x, w))
        assert torch.equal(gemv.blinear(x, w), official.blinear(x, w))
        assert torch.equal(gemv.blinear_scaled(x, w, 0.3), official.blinear(x, w) * 0.3)
        assert torch.equal(gemv.linear_f32(x, w.float()), bf16_gemm.linear_f32_torch(x, w.float()))


def test_bad_inputs_raise_errors_naming_the_op():
    gemv = _kernel()
    def scaled(x, w):
        return gemv.blinear_scaled(x, w, 0.5)

    for name, fn in (("linear_f32", gemv.linear_f32), ("blinear", gemv.blinear), ("blinear_scaled", scaled)):
        with pytest.raises(ValueError, match=f"{name}: needs a bf16 activation"):
            fn(torch.zeros(2, 8), torch.zeros(5, 8, dtype=BF16))
        with pytest.raises(ValueError, match=f"{name}: shapes .* do not fit"):
            fn(torch.zeros(2, 8, dtype=BF16), torch.zeros(5, 7, dtype=BF16))
        with pytest.raises(ValueError, match=f"{name}: shapes .* do not fit"):
            fn(torch.zeros(2, 3, 8, dtype=BF16), torch.zeros(5, 8, dtype=BF16))


def test_registrations_and_tile_rule():
    gemv = _kernel()
    assert gemv.REGISTRATIONS == {"linear_f32": gemv.linear_f32, "blinear": gemv.blinear,
                                  "blinear_scaled": gemv.blinear_scaled}
    from deepinfer.kernels.triton import KERNEL_MODULES

    assert "bf16_gemv" in KERNEL_MODULES
    for m in range(1, gemv.GEMV_MAX_ROWS + 1):
        for n in (8, 37, 64, 256, 512, 1024, 2048, 129280):
            for k in (64, 200, 4096):
                t = gemv._gemv_tiles(m, n, k)
                assert all(v > 0 and v & (v - 1) == 0 for v in (t["BN"], t["BK"])), (m, n, k, t)
                assert t["BN"] * t["BK"] <= 4096 and t["BN"] <= 16, (m, n, k, t)  # the swept tile size
                mp = 1 << (m - 1).bit_length()
                # the fp32 accumulator stays at <= 128 per thread (at 8 rows, 256 spilled: 88 us per call)
                assert mp * t["BN"] * t["BK"] <= 128 * 32 * t["num_warps"], (m, n, k, t)
                if n <= 2048 and k == 4096 and m <= 4:
                    assert -(-n // t["BN"]) >= min(n, 256), (m, t)  # the programs fill the SMs
    # which calls the wrappers take (the H200 measurement behind GEMV_MAX_WORK): M x N small, M <= max rows
    for m, n, taken in ((1, 2048, True), (2, 1024, True), (4, 512, True), (8, 256, True), (4, 1024, False),
                        (1, 129280, False), (gemv.GEMV_MAX_ROWS + 1, 64, False)):
        assert gemv.takes_shape(m, n) == taken, (m, n)
    assert not gemv._takes(torch.zeros(1, 8, dtype=BF16), torch.zeros(4, 8, dtype=BF16))  # CPU, no interpreter


# ------------------------------------------------------------------------- Triton, interpreter on CPU
_INTERPRET_CHECK = """
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import torch

from test_kernels_bf16_gemv import _check_bf16, _check_f32, _grid_inputs, _inputs
from deepinfer.kernels import bf16_gemm, official
from deepinfer.kernels.triton import bf16_gemv

F32, BF16 = torch.float32, torch.bfloat16
twin_f32, twin_b = bf16_gemm.linear_f32_cublas, bf16_gemm.blinear_cublas


def no_fallback(*args):
    raise AssertionError("fell back to cuBLAS / the twin")


bf16_gemm.linear_f32_cublas = bf16_gemm.blinear_cublas = no_fallback  # the wrappers must take the kernel
twin_s, bf16_gemm.blinear_scaled_cublas = bf16_gemm.blinear_scaled_cublas, no_fallback
for m in (1, 3, 8):
    for n, k in ((37, 200), (64, 256), (8, 64), (130, 96)):
        x, w = _inputs(m, n, k, 100 * m + n)
        _check_f32(bf16_gemv.linear_f32(x, w), x, w, (m, n, k))
        b = bf16_gemv.blinear(x, w)
        _check_bf16(b, x, w, (m, n, k))
        assert torch.equal(b, bf16_gemv.linear_f32(x, w).to(BF16)), (m, n, k)  # one rounding of the same sums
        # the indexer weights' scale in the launch: torch's product of the bf16 sums and the fp32 scale
        for c in (128**-0.5 * 64**-0.5, 0.3):
            assert torch.equal(bf16_gemv.blinear_scaled(x, w, c), b * c), (m, n, k, c)
    # several K steps with a K tail, wide and narrow N tiles with an N tail
    x, w = _inputs(m, 37, 200, m)
    for tiles in (dict(BN=16, BK=64), dict(BN=2, BK=32), dict(BN=1, BK=64, num_warps=1)):
        _check_f32(bf16_gemv._launch(x, w, F32, tiles), x, w, (m, tiles))
        _check_bf16(bf16_gemv._launch(x, w, BF16, tiles), x, w, (m, tiles))
    # exact sums: the twin's bits in any order
    for n, k, tiles in ((37, 200, None), (64, 256, None), (37, 200, dict(BN=4, BK=32))):
        x, w = _grid_inputs(m, n, k, m + n)
        assert torch.equal(bf16_gemv._launch(x, w, F32, tiles), bf16_gemm.linear_f32_torch(x, w)), (m, n, k)
        assert torch.equal(bf16_gemv._launch(x, w, BF16, tiles), official.blinear(x, w)), (m, n, k)
# strided x: a row stride wider than K, and a column stride != 1 (read in place, no copy)
x, w = _inputs(5, 37, 200, 7)
wide = torch.zeros(5, 300, dtype=BF16)
wide[:, 50:250] = x
tall = x.T.contiguous().T
assert not wide[:, 50:250].is_contiguous() and tall.stride() == (1, 5)
ref = bf16_gemv.linear_f32(x, w)
assert torch.equal(bf16_gemv.linear_f32(wide[:, 50:250], w), ref)
assert torch.equal(bf16_gemv.linear_f32(tall, w), ref)
# empty calls
assert bf16_gemv.linear_f32(x[:0], w).shape == (0, 37) and bf16_gemv.blinear(x, w[:0]).shape == (5, 0)
# not taken: M > GEMV_MAX_ROWS, M x N > GEMV_MAX_WORK, an fp32 weight, a non-contiguous weight -> the twin's bits
bf16_gemm.linear_f32_cublas, bf16_gemm.blinear_cublas, bf16_gemm.blinear_scaled_cublas = twin_f32, twin_b, twin_s
x9, _ = _inputs(bf16_gemv.GEMV_MAX_ROWS + 1, 37, 200, 17)
assert torch.equal(bf16_gemv.linear_f32(x9, w), bf16_gemm.linear_f32_torch(x9, w))
assert torch.equal(bf16_gemv.blinear(x9, w), official.blinear(x9, w))
assert torch.equal(bf16_gemv.blinear_scaled(x9, w, 0.3), official.blinear(x9, w) * 0.3)
x4, w600 = _inputs(4, 600, 64, 4)  # M x N > GEMV_MAX_WORK: cuBLAS's (here the twin's) bits
assert not bf16_gemv._takes(x4, w600)
assert torch.equal(bf16_gemv.linear_f32(x4, w600), bf16_gemm.linear_f32_torch(x4, w600))
assert torch.equal(bf16_gemv.linear_f32(x, w.float()), bf16_gemm.linear_f32_torch(x, w.float()))
wt = w.T.contiguous().T
assert torch.equal(bf16_gemv.linear_f32(x, wt), bf16_gemm.linear_f32_torch(x, wt))
try:
    bf16_gemv.blinear(x.float(), w)
    raise SystemExit("an fp32 activation was accepted")
except ValueError as err:
    assert "blinear" in str(err)
print("ok")
"""


def test_triton_gemv_under_the_interpreter():
    """The kernel vs the twins on CPU bf16 inputs (TRITON_INTERPRET=1 in a fresh process: read at import)."""
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=600)
    assert_ran_ok(res)


# ---------------------------------------------------------------------------------------------- cuda
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [64, 256, 1024, 2048])
def test_triton_gemv_matches_the_twins_on_cuda(m, n):
    """V4-Flash decode shapes (K = 4096: weights_proj 64, MoE gate 256, compressor wkv/wgate 1024), fresh
    random inputs: the kernel itself at every shape (`_launch`), and the ops, which take it where
    M x N <= GEMV_MAX_WORK and cuBLAS elsewhere."""
    gemv = _kernel()
    from deepinfer import kernels
    from deepinfer.kernels.triton import register_cuda_kernels

    register_cuda_kernels()
    assert kernels.get("linear_f32", "cuda") is gemv.linear_f32 and kernels.get("blinear", "cuda") is gemv.blinear
    x, w = _inputs(m, n, 4096, 1000 * m + n, "cuda")
    assert gemv._takes(x, w) == (m * n <= gemv.GEMV_MAX_WORK)
    got = gemv._launch(x, w, F32)
    _check_f32(got, x, w, (m, n))
    _check_bf16(gemv._launch(x, w, BF16), x, w, (m, n))
    assert torch.equal(gemv._launch(x, w, BF16), got.to(BF16))  # one rounding of the same fp32 sums
    _check_f32(gemv.linear_f32(x, w), x, w, (m, n, "op"))
    _check_bf16(gemv.blinear(x, w), x, w, (m, n, "op"))
    c = 128**-0.5 * 64**-0.5  # the indexer weights' scale: in the launch, torch's product of the bf16 output
    assert torch.equal(gemv.blinear_scaled(x, w, c), gemv.blinear(x, w) * c), (m, n)
    rel = float((got.double() - (x.double() @ w.double().T)).norm() / (x.double() @ w.double().T).norm())
    print(f"bf16 gemv M={m} N={n}: rel_err vs float64 {rel:.2e}, tiles {gemv._gemv_tiles(m, n, 4096)}")


@gpu
@needs_cuda
def test_triton_gemv_in_a_cuda_graph():
    gemv = _kernel()
    from test_kernels_gemm import assert_replay_is_eager

    for m, n in ((1, 256), (2, 1024), (5, 64)):
        x, w = _inputs(m, n, 4096, m + n, "cuda")
        assert_replay_is_eager(lambda: gemv.linear_f32(x, w), f"linear_f32 M={m} N={n}")
        assert_replay_is_eager(lambda: gemv.blinear(x, w), f"blinear M={m} N={n}")
