"""bf16-weight GEMMs of fast numerics (`kernels/bf16_gemm.py`): the grouped output LoRA, `linear_f32` (the
official fp32 matmuls of bf16 weights: LM head, compressors, MoE gate) and the bf16 `blinear`.

CPU: the twins are the official math (exact bf16 products, fp32 sums; one bf16 rounding for the grouped
projection and blinear, fp32 output for linear_f32) checked against float64; an fp32 copy of a bf16 weight
gives the same bits as the weight itself (what official-numerics params hold); bad input raises a clear error.
GPU (`-m gpu`, fresh random inputs): the cuBLAS versions against the twins. Only the fp32 summation order
differs, so linear_f32 agrees to fp32 rounding (rel_err <= 1e-5; TF32 would show ~1e-3) and the bf16
outputs to last-bit flips (rel_err <= 1e-3, a bf16 ulp is 2**-8 relative).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels import official
from deepinfer.kernels.bf16_gemm import grouped_proj_bf16_torch, linear_f32_torch

BF16 = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_twins_are_the_official_math():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(5, 4, 96, generator=g).to(BF16)
    w = torch.randn(4, 32, 96, generator=g).to(BF16)
    z = grouped_proj_bf16_torch(o, w)
    exact = torch.einsum("tgd,grd->tgr", o.double(), w.double())
    assert z.dtype == BF16 and z.shape == (5, 4, 32)
    assert torch.equal(z, exact.to(BF16)) or _rel(z, exact) < 2 ** -8  # fp32 sums, then one rounding
    y = torch.randn(3, 96, generator=g).to(BF16)
    head = torch.randn(50, 96, generator=g).to(BF16)
    logits = linear_f32_torch(y, head)
    assert logits.dtype == torch.float32 and logits.shape == (3, 50)
    assert _rel(logits, y.double() @ head.double().T) < 1e-6
    assert torch.equal(linear_f32_torch(y, head.float()), logits)  # the official fp32 copy: the same bits
    z = official.blinear(y, head)
    assert z.dtype == BF16 and torch.equal(z, official.blinear(y, head.float()))
    assert torch.equal(z, (y.float() @ head.float().T).to(BF16))


def test_registered_for_cpu_and_cuda():
    assert kernels.get("grouped_proj_bf16") is grouped_proj_bf16_torch
    assert kernels.get("linear_f32") is linear_f32_torch
    assert kernels.get("linear_f32", "cuda") is not linear_f32_torch
    assert kernels.get("blinear") is official.blinear
    assert kernels.get("blinear", "cuda") is not official.blinear


def test_bad_inputs_raise_clear_errors():
    o = torch.zeros(2, 4, 8, dtype=BF16)
    with pytest.raises(ValueError, match="bf16"):
        grouped_proj_bf16_torch(o.float(), torch.zeros(4, 3, 8, dtype=BF16))
    with pytest.raises(ValueError, match="groups"):
        grouped_proj_bf16_torch(o, torch.zeros(2, 3, 8, dtype=BF16))
    with pytest.raises(ValueError, match="do not fit"):
        linear_f32_torch(torch.zeros(2, 8, dtype=BF16), torch.zeros(5, 7, dtype=BF16))
    with pytest.raises(ValueError, match="bf16 activation"):
        linear_f32_torch(torch.zeros(2, 8), torch.zeros(5, 8, dtype=BF16))
    with pytest.raises(ValueError, match="bf16 or fp32 weight"):
        linear_f32_torch(torch.zeros(2, 8, dtype=BF16), torch.zeros(5, 8, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 128])
def test_cublas_versions_match_the_twins(t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    from deepinfer.kernels.bf16_gemm import blinear_cublas, grouped_proj_bf16_cublas, linear_f32_cublas

    o = torch.randn(t, 8, 4096, device=dev).to(BF16)  # V4-Flash: 8 groups of 8 heads x 512, rank 1024
    w = (torch.randn(8, 1024, 4096, device=dev) * 0.02).to(BF16)
    got, want = grouped_proj_bf16_cublas(o, w), grouped_proj_bf16_torch(o, w)
    assert got.dtype == BF16 and got.shape == (t, 8, 1024) and got.is_contiguous()  # flatten(1) is a view
    # the strided-result GEMM is the einsum's own (which returns a permuted view): the same bits
    assert torch.equal(got, torch.einsum("tgd,grd->tgr", o, w))
    rel = _rel(got, want)
    print(f"grouped_proj T={t}: rel_err={rel:.2e}, {float((got != want).float().mean()):.3%} differ")
    assert rel <= 1e-3
    y = torch.randn(t, 4096, device=dev).to(BF16)
    head = (torch.randn(32768, 4096, device=dev) * 0.02).to(BF16)
    got, want = linear_f32_cublas(y, head), linear_f32_torch(y, head)
    exact = y.double() @ head.double().T
    assert got.dtype == torch.float32 and got.shape == (t, 32768)
    rel, rel_exact = _rel(got, want), _rel(got, exact)
    print(f"head T={t}: rel_err vs twin {rel:.2e}, vs float64 {rel_exact:.2e}")
    assert rel <= 1e-5 and rel_exact <= 1e-5
    for n in (1024, 256):  # the compressor wkv/wgate [1024, 4096] and the MoE gate [256, 4096]
        w = (torch.randn(n, 4096, device=dev) * 0.02).to(BF16)
        got, exact = linear_f32_cublas(y, w), y.double() @ w.double().T
        assert got.dtype == torch.float32 and _rel(got, exact) <= 1e-5, (n, _rel(got, exact))
        assert torch.equal(linear_f32_cublas(y, w.float()), linear_f32_torch(y, w.float()))  # fp32 w: the fp32 path
    w = (torch.randn(64, 4096, device=dev) * 0.02).to(BF16)  # indexer weights_proj
    got, want = blinear_cublas(y, w), official.blinear(y, w)
    assert got.dtype == BF16 and _rel(got, want) <= 1e-3
