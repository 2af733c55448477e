"""The Triton tensor-core GEMM of ops "linear_f32" / "blinear" at 9..256 rows
(deepinfer/kernels/triton/bf16_skinny.py, routed by bf16_gemv's wrappers) against the twins
`bf16_gemm.linear_f32_torch` / `official.blinear`.

Bounds: the kernel and the twin both sum exact products of bf16 values in fp32, in different orders, so the
GEMV's summation-order bounds apply (test_kernels_bf16_gemv: gamma_K * sum_k |x_k w_k| from float64, twice
that from the twin, rel_err <= 1e-5; blinear within that plus half a bf16 ulp of each rounding, <= 1 ulp
without cancellation). On the GPU the tensor cores' fp32 accumulation is not promised to round to nearest,
so there the unit roundoff in gamma_K is taken as 2**-23 (any faithful rounding of each add).
CPU: the tile rule (BW and BK depend on N only: the batch invariance the kernel claims), the routing limits.
Interpreter (TRITON_INTERPRET=1, fresh process, the GPU's roundings): M in {9, 17, 130, 256} with N and K
tails, strided x, several K steps; inputs on an exact grid give the twin's bits; the wrappers route 9..256
rows here (cuBLAS stubbed to fail), 257 rows and DEEPINFER_SKINNY_GEMM=0 to cuBLAS (the twin's bits).
GPU (`-m gpu`): V4-Flash shapes (K = 4096, N = 64..2048: weights_proj, MoE gate, the compressors' stacked
wkv | wgate) at M = 9..256, the same bounds; batch invariance (a row's bits at M rows equal its bits alone
in a 9-row call); a CUDA graph's replay bit-identical to eager.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_ran_ok, run_interpreted
from test_kernels_bf16_gemv import _check_bf16, _check_f32, _inputs

BF16, F32 = torch.bfloat16, torch.float32


def _kernel():
    pytest.importorskip("triton")  # CI has no triton: skip cleanly
    from deepinfer.kernels.triton import bf16_skinny

    return bf16_skinny


def test_tile_rule_and_routing_limits():
    sk = _kernel()
    for n in (37, 64, 256, 2048, 16384):
        for k in (64, 200, 4096):
            rules = {(t["BW"], t["BK"], t["num_warps"]) for t in (sk.tiles(m, n, k) for m in range(9, 257))}
            assert len(rules) == 1, (n, k, rules)  # batch invariance: nothing of the sum's order depends on M
            for m in (9, 16, 17, 128, 129, 256):
                t = sk.tiles(m, n, k)
                assert t["BT"] in (16, 32, 64, 128) and (t["BT"] >= m or t["BT"] == 128), (m, t)
                assert t["BW"] % 64 == 0, t  # one wgmma M per warpgroup
    for m, n, taken in ((8, 64, False), (9, 64, True), (256, 2048, True), (257, 64, False), (128, 16384, True),
                        (128, 16385, False), (128, 129280, False), (16, 0, False)):
        assert sk.takes_shape(m, n) == taken, (m, n)


_INTERPRET_CHECK = """
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import os
import torch

from test_kernels_bf16_gemv import _check_bf16, _check_f32, _grid_inputs, _inputs
from deepinfer.kernels import bf16_gemm, official
from deepinfer.kernels.triton import bf16_gemv, bf16_skinny

F32, BF16 = torch.float32, torch.bfloat16
twin_f32, twin_b = bf16_gemm.linear_f32_cublas, bf16_gemm.blinear_cublas


def no_fallback(*args):
    raise AssertionError("fell back to cuBLAS / the twin")


bf16_gemm.linear_f32_cublas = bf16_gemm.blinear_cublas = no_fallback  # the wrappers must take the kernel
for m, n, k in ((9, 37, 200), (17, 64, 256), (130, 70, 136), (256, 8, 64)):
    x, w = _inputs(m, n, k, m + n + k)
    f = bf16_gemv.linear_f32(x, w)
    _check_f32(f, x, w, (m, n, k))
    b = bf16_gemv.blinear(x, w)
    _check_bf16(b, x, w, (m, n, k))
    assert torch.equal(b, f.to(BF16)), (m, n, k)  # one rounding of the same sums
    # small tiles: several K steps, several weight and token programs, tails everywhere
    for cfg in (dict(BK=32), dict(BT=16, BK=64), dict(BW=64, BT=32, BK=16, num_warps=4)):
        _check_f32(bf16_skinny.launch(x, w, F32, cfg), x, w, (m, n, k, cfg))
        _check_bf16(bf16_skinny.launch(x, w, BF16, cfg), x, w, (m, n, k, cfg))
    xg, wg = _grid_inputs(m, n, k, m * n)  # exact sums: the twin's bits in any order
    assert torch.equal(bf16_skinny.launch(xg, wg, F32), bf16_gemm.linear_f32_torch(xg, wg)), (m, n, k)
    assert torch.equal(bf16_skinny.launch(xg, wg, BF16, dict(BK=32)), official.blinear(xg, wg)), (m, n, k)
# strided x: a row stride wider than K, and a column stride != 1 (read in place, no copy)
x, w = _inputs(20, 37, 200, 7)
xg, wg = _grid_inputs(20, 37, 200, 8)
wide = torch.zeros(20, 300, dtype=BF16)
wide[:, 50:250] = xg
tall = xg.T.contiguous().T
assert tall.stride() == (1, 20)
ref = bf16_gemm.linear_f32_torch(xg, wg)
assert torch.equal(bf16_gemv.linear_f32(wide[:, 50:250], wg), ref)
assert torch.equal(bf16_gemv.linear_f32(tall, wg), ref)
assert bf16_gemv.linear_f32(x[:0], w).shape == (0, 37)
# not taken: 257 rows, the switch off, a weight over MAX_N rows is checked by takes_shape (CPU test)
bf16_gemm.linear_f32_cublas, bf16_gemm.blinear_cublas = twin_f32, twin_b
x257, w8 = _inputs(257, 8, 64, 3)
assert not bf16_gemv._takes_skinny(x257, w8)
assert torch.equal(bf16_gemv.linear_f32(x257, w8), bf16_gemm.linear_f32_torch(x257, w8))
assert bf16_gemv._takes_skinny(x, w)
os.environ["DEEPINFER_SKINNY_GEMM"] = "0"
assert not bf16_gemv._takes_skinny(x, w)
assert torch.equal(bf16_gemv.blinear(x, w), official.blinear(x, w))
del os.environ["DEEPINFER_SKINNY_GEMM"]
try:
    bf16_skinny.launch(x, w.T.contiguous().T, F32)
    raise SystemExit("a weight with a column stride was accepted")
except ValueError as err:
    assert "unit column stride" in str(err)
print("ok")
"""


def test_skinny_gemm_under_the_interpreter():
    """The kernel vs the twins on CPU bf16 inputs (TRITON_INTERPRET=1 in a fresh process: read at import)."""
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=900)
    assert_ran_ok(res)


# ---------------------------------------------------------------------------------------------- cuda
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_U = 2.0**-23  # the tensor cores' fp32 adds: faithful, not necessarily round-to-nearest


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [64, 256, 512, 1024, 2048])
def test_skinny_gemm_matches_the_twins_on_cuda(n):
    """V4-Flash decode shapes (K = 4096: weights_proj 64, MoE gate 256, the index compressor's 512, the
    compressors' stacked wkv | wgate 1024 / 2048), fresh random inputs at M = 9..256, through the ops."""
    sk = _kernel()
    from deepinfer import kernels
    from deepinfer.kernels.triton import bf16_gemv, register_cuda_kernels

    register_cuda_kernels()
    assert kernels.get("linear_f32", "cuda") is bf16_gemv.linear_f32
    for m in (9, 16, 33, 100, 128, 200, 256):
        x, w = _inputs(m, n, 4096, 1000 * m + n, "cuda")
        assert bf16_gemv._takes_skinny(x, w) and not bf16_gemv._takes(x, w)
        got = bf16_gemv.linear_f32(x, w)
        _check_f32(got.cpu(), x.cpu(), w.cpu(), (m, n), u=GPU_U)
        b = bf16_gemv.blinear(x, w)
        _check_bf16(b.cpu(), x.cpu(), w.cpu(), (m, n), u=GPU_U)
        assert torch.equal(b, got.to(BF16)), (m, n)  # one rounding of the same fp32 sums
        exact = x.double() @ w.double().T
        rel = float((got.double() - exact).norm() / exact.norm())
        print(f"bf16 skinny M={m} N={n}: rel_err vs float64 {rel:.2e}, tiles {sk.tiles(m, n, 4096)}")


@gpu
@needs_cuda
def test_skinny_gemm_is_batch_invariant_on_cuda():
    """A row's bits do not depend on the call's other rows or its row count (BW, BK fixed by N)."""
    sk = _kernel()
    for n in (256, 2048):
        x, w = _inputs(256, n, 4096, n, "cuda")
        full = sk.launch(x, w, F32)
        for m in (9, 16, 40, 128, 129):
            assert torch.equal(sk.launch(x[:m].contiguous(), w, F32), full[:m]), (n, m)
        assert torch.equal(sk.launch(x[100:109].contiguous(), w, F32), full[100:109]), n


@gpu
@needs_cuda
def test_skinny_gemm_in_a_cuda_graph():
    _kernel()
    from test_kernels_gemm import assert_replay_is_eager
    from deepinfer.kernels.triton import bf16_gemv

    for m, n in ((9, 256), (128, 2048), (200, 64)):
        x, w = _inputs(m, n, 4096, m + n, "cuda")
        assert_replay_is_eager(lambda: bf16_gemv.linear_f32(x, w), f"linear_f32 M={m} N={n}")
        assert_replay_is_eager(lambda: bf16_gemv.blinear(x, w), f"blinear M={m} N={n}")
