"""fp4_moe's grouped-GEMM kernel with the expansion and tiles a caller names (expand 1, `_config`'s tile per
regime and the benchmark's sweep tiles) against the torch twin: V4-Flash dims on the GPU (fresh random inputs,
rel_err <= 1e-3: exact bf16 operands summed in fp32 in another order, tests/test_kernels_gemm.py's bound), tiny
shapes through the whole op under TRITON_INTERPRET on the CPU (rel_err <= 1e-6).
(Until 2026-12-02 this file also held expand 3, the FP8 tensor-core variant, removed for the FP8 form:
tests/test_kernels_fp4_fp8_form.py.)
"""
from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted
from deepinfer.kernels.quant_weights import fp4_moe_torch
from test_kernels_gemm import _cuda as _cuda_device, _random_bank as _bank, _rel  # shared helpers

BF16 = torch.bfloat16


def _cuda():
    pytest.importorskip("triton")
    return _cuda_device()


BOUND = 1e-3  # exact bf16 operands, fp32 sums in another order (tests/test_kernels_gemm.py)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None, dict(BM=16, BN=128, num_warps=4, num_stages=3),
                                 dict(BM=64, BN=128, num_warps=4, num_stages=3),
                                 dict(BM=128, BN=256, num_warps=8, num_stages=3)])
def test_fp4_moe_kernel_tiles_and_real_dims(cfg):
    """V4-Flash dims (D=4096, I=2048) at a decode and a prefill shape, with the tiles the benchmark sweeps."""
    dev = _cuda()
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    bank = _bank(16, 4096, 2048, 128, dev)
    for t in (2, 300, 600):  # 600 x 6 / 16 experts: the BM=128 / BN=256 default tiles
        x = torch.randn(t, 4096, device=dev).to(BF16)
        ids = torch.stack([torch.randperm(16, device=dev)[:6] for _ in range(t)])
        weights = torch.rand(t, 6, device=dev) * 0.5
        rel = _rel(fp4_moe(x, ids, weights, bank, 10.0, expand=1, config=cfg),
                   fp4_moe_torch(x, ids, weights, bank, 10.0))
        print(f"fp4_moe expand=1 real dims T={t} cfg={cfg}: rel_err={rel:.2e}")
        assert rel <= BOUND


_WHOLE_OP_CHECK = r"""
exec(__import__("interpreted").GPU_ROUNDINGS)  # the GPU's roundings in Triton's interpreter
import torch

from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch
from deepinfer.kernels.triton.fp4_moe import fp4_moe

g = torch.Generator().manual_seed(3)
sc = lambda *s: torch.randint(119, 129, s, dtype=torch.uint8, generator=g)  # noqa: E731
E, D, I = 8, 256, 128
for ab in (128, 32):
    b = FP4ExpertBank(torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, generator=g), sc(E, 2 * I, D // 32),
                      torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, generator=g), sc(E, D, I // 32), ab)
    for t in (1, 5):
        x = torch.randn(t, D, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(t)])
        w = torch.rand(t, 3, generator=g)
        want = fp4_moe_torch(x, ids, w, b, 10.0)
        rel = float((fp4_moe(x, ids, w, b, 10.0, expand=1).double() - want.double()).norm() / want.double().norm())
        assert rel <= 1e-6, (ab, t, rel)
print("OK")
"""


def test_kernel_is_the_twin_under_the_interpreter():
    """The grouped-GEMM kernel (expand 1) through the whole op on tiny shapes, in Triton's interpreter with the
    GPU's roundings restored. Measured: rel_err 0."""
    pytest.importorskip("triton")
    r = run_interpreted(_WHOLE_OP_CHECK, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
