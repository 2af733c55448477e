"""The swap-AB tensor-core form of ops "linear_f32" / "blinear" at 9..256 rows
(deepinfer/kernels/triton/bf16_linear_swap.py) against the twins, by the bounds of
tests/test_kernels_bf16_gemv.py (`_check_f32` / `_check_bf16`: both sum the same exact fp32 products in some
order; elementwise within gamma_K * sum|x w| of float64 and 2 gamma_K of the twin).

CPU (needs triton): the routing rule (`takes`), the plan's invariants, DEEPINFER_LINEAR_F32_FORM.
Interpreter: M in {9, 40, 130} (two token blocks), N with a tail of the 64-row block, K with several steps,
one split and several (fp32 partials and the ordered sum; blinear rounds once there), exact sums on a coarse
grid give the twin's bits; the wrappers in bf16_gemv take it only where `takes` says.
GPU (-m gpu): V4-Flash shapes (K 4096; N 64, 256, 512, 1024, 2048; M 9..256), the same bounds; graph replay
bit-identical to eager.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted

BF16, F32 = torch.bfloat16, torch.float32


def _swap():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton import bf16_linear_swap

    return bf16_linear_swap


def test_takes_and_plan(monkeypatch):
    sw = _swap()
    monkeypatch.delenv("DEEPINFER_LINEAR_F32_FORM", raising=False)
    for m, n, k, taken in ((9, 256, 4096, True), (256, 2048, 4096, True), (8, 256, 4096, False),
                           (257, 256, 4096, False), (32, 129280, 4096, False), (32, 256, 200, False),
                           (32, 256, 128, False)):
        assert sw.takes(m, n, k) == taken, (m, n, k)
    for m in (9, 16, 17, 32, 100, 128, 129, 256):
        for n in (64, 256, 512, 1024, 2048, 100):
            p = sw.plan(m, n, 4096, 132)
            assert p["K_CHUNK"] % p["BK"] == 0 and (p["SPLITS"] - 1) * p["K_CHUNK"] < 4096 <= p["SPLITS"] * p["K_CHUNK"]
            assert 16 <= p["BT"] <= 128 and p["BT"] >= min(m, 128)
            assert p["SPLITS"] * m * n * 4 <= max(n * 4096 * 2, m * n * 4), (m, n, p)  # partials <= the weight
    monkeypatch.setenv("DEEPINFER_LINEAR_F32_FORM", "cublas")
    assert not sw.takes(32, 256, 4096)
    monkeypatch.setenv("DEEPINFER_LINEAR_F32_FORM", "triton")
    with pytest.raises(ValueError, match="DEEPINFER_LINEAR_F32_FORM"):
        sw.takes(32, 256, 4096)


_INTERPRET_CHECK = """
from test_kernels_fp8_linear import _INTERPRETER_FIXES
exec(_INTERPRETER_FIXES)
import torch
from test_kernels_bf16_gemv import _check_bf16, _check_f32, _grid_inputs, _inputs
from deepinfer.kernels import bf16_gemm, official
from deepinfer.kernels.triton import bf16_gemv, bf16_linear_swap as sw

F32, BF16 = torch.float32, torch.bfloat16
for m, n, k, cfg in ((9, 37, 256, None), (40, 100, 512, dict(SPLITS=1)), (40, 100, 512, dict(SPLITS=3, BK=64)),
                     (130, 70, 256, dict(BT=64, SPLITS=2))):
    x, w = _inputs(m, n, k, m + n)
    _check_f32(sw.linear(x, w, F32, cfg), x, w, (m, n, k, cfg))
    b = sw.linear(x, w, BF16, cfg)
    _check_bf16(b, x, w, (m, n, k, cfg))
    assert torch.equal(b, sw.linear(x, w, F32, cfg).to(BF16)), (m, n, k, cfg)  # one rounding of the same sums
    xg, wg = _grid_inputs(m, n, min(k, 256), m)
    assert torch.equal(sw.linear(xg, wg, F32, cfg), bf16_gemm.linear_f32_torch(xg, wg)), (m, n, cfg)
    assert torch.equal(sw.linear(xg, wg, BF16, cfg), official.blinear(xg, wg)), (m, n, cfg)
# the wrappers: M=40, K=256 goes to this form (cuBLAS must not be called), K=200 to cuBLAS (the twin)
def no_fallback(*args):
    raise AssertionError("fell back to cuBLAS")
saved = bf16_gemm.linear_f32_cublas, bf16_gemm.blinear_cublas
bf16_gemm.linear_f32_cublas = bf16_gemm.blinear_cublas = no_fallback
x, w = _inputs(40, 64, 256, 3)
_check_f32(bf16_gemv.linear_f32(x, w), x, w, "wrapper")
_check_bf16(bf16_gemv.blinear(x, w), x, w, "wrapper")
bf16_gemm.linear_f32_cublas, bf16_gemm.blinear_cublas = saved
x, w = _inputs(40, 64, 200, 3)
assert torch.equal(bf16_gemv.linear_f32(x, w), bf16_gemm.linear_f32_torch(x, w))
try:
    sw.linear(x.float(), w, F32)
    raise SystemExit("an fp32 activation was accepted")
except ValueError as err:
    assert "bf16" in str(err)
print("ok")
"""


def test_swap_linear_under_the_interpreter():
    _swap()
    proc = run_interpreted(_INTERPRET_CHECK)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [9, 32, 64, 128, 200, 256])
def test_swap_linear_cuda_v4_flash_shapes(m, cuda_kernels):
    from test_kernels_bf16_gemv import _check_bf16, _check_f32, _inputs
    from deepinfer.kernels.triton import bf16_linear_swap as sw

    for n in (64, 256, 512, 1024, 2048):
        x, w = _inputs(m, n, 4096, m * n, "cuda")
        got = sw.linear(x, w, F32)
        _check_f32(got.cpu(), x.cpu(), w.cpu(), (m, n))
        _check_bf16(sw.linear(x, w, BF16).cpu(), x.cpu(), w.cpu(), (m, n))
    x, w = _inputs(m, 2048, 4096, 1, "cuda")
    eager = sw.linear(x, w, F32)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sw.linear(x, w, F32)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
