"""Op `fp4_moe_shared` (kernels/triton/fp4_moe.py): the MoE's routed-expert sum with the shared expert's bf16
rows added last in fp32 and one bf16 rounding, fused into the forms' combine kernel. It must give exactly
the bits of the steps it replaces, `fp4_moe(...)` (fp32), `y.add_(shared)`, `y.to(bf16)`:
CPU: the twin is those steps, and `ready` (the caller's stream join) runs once, before `shared` is read.
GPU (-m gpu): every form (the decode TMA / mma.sync forms, the Triton v2 plan, the prefill wgmma form, the
FP8 form, the legacy kernel) against those steps on the same form, bit for bit, at V4-Flash dims.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels.quant_weights import fp4_moe_shared_torch, fp4_moe_torch

BF16 = torch.bfloat16


def _inputs(t, d, e, g, dev="cpu"):
    x = (torch.randn(t, d, generator=g) * torch.exp(torch.randn(t, 1, generator=g))).to(BF16)
    ids = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(t)])
    w = torch.rand(t, 6, generator=g) * 0.5
    shared = (torch.randn(t, d, generator=g) * 0.3).to(BF16)
    return x.to(dev), ids.to(dev), w.to(dev), shared.to(dev)


def test_twin_is_the_steps_it_replaces():
    from test_kernels_gemm import _random_bank

    g = torch.Generator().manual_seed(5)
    bank = _random_bank(8, 256, 128, 128, "cpu")
    x, ids, w, shared = _inputs(3, 256, 8, g)
    calls = []
    got = kernels.get("fp4_moe_shared")(x, ids, w, bank, 10.0, shared, lambda: calls.append(1))
    assert calls == [1]
    want = fp4_moe_torch(x, ids, w, bank, 10.0).add_(shared).to(BF16)
    assert got.dtype == BF16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="shared must be bf16"):
        fp4_moe_shared_torch(x, ids, w, bank, 10.0, shared.float())


@pytest.mark.gpu
@pytest.mark.parametrize("t,config", [(1, "MMA_SYNC"), (32, "TMA"), (128, "TMA"), (8, "V2"), (128, "V2"),
                                      (2048, "WGMMA"), (300, "FP8"), (40, None)])
def test_every_form_adds_the_shared_rows_like_the_unfused_steps(t, config, cuda_kernels):
    from test_kernels_gemm import _random_bank
    from deepinfer.kernels.triton import fp4_moe as m

    cfg = {"MMA_SYNC": m.DECODE_MMA, "TMA": m.DECODE_TMA, "V2": m.DECODE_V2, "WGMMA": m.PREFILL_WGMMA,
           "FP8": dict(FP8=True), None: None}[config]
    expand = 6 if config in ("V2", None) else None
    bank = _random_bank(256, 4096, 2048, 128, "cuda")
    g = torch.Generator().manual_seed(t)
    x, ids, w, shared = _inputs(t, 4096, 256, g, "cuda")
    calls = []
    got = m.fp4_moe_shared(x, ids, w, bank, 10.0, shared, lambda: calls.append(1), expand=expand, config=cfg)
    want = m.fp4_moe(x, ids, w, bank, 10.0, expand=expand, config=cfg).add_(shared).to(BF16)
    assert calls == [1]
    assert got.dtype == BF16 and torch.equal(got, want), (t, config)
    with pytest.raises(ValueError, match="contiguous"):
        m.fp4_moe_shared(x, ids, w, bank, 10.0, torch.cat([shared, shared], 1)[:, ::2])
