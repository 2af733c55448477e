"""Kernels of the fast decode step that are not GEMMs or attention: the V4 MoE gate
(`moe_gate_sqrtsoftplus`: sqrt-softplus, biased top-k, renormalise, scale in one Triton kernel) against its
torch twin in `kernels/official_fused.py`, which is exactly `V4MoE.route`'s sequence of torch ops.

CPU: the twin equals the route's formula written out, and rejects bad shapes. GPU (-m gpu): the Triton
kernel vs the twin on fresh random logits at decode and prefill row counts: same experts in the same
order, weights within a few ulp (the renormalising sum is a tree sum there, sequential in torch).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.official_fused import moe_gate_sqrtsoftplus


def _route_written_out(logits, bias, k, scale):
    scores = F.softplus(logits).sqrt()
    idx = torch.argsort(scores + bias, dim=-1, descending=True, stable=True)[:, :k]
    w = scores.gather(1, idx)
    return w / w.sum(-1, keepdim=True) * scale, idx


def test_gate_twin_is_the_route_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 64, generator=g) * 6
    logits[0, :3] = torch.tensor([25.0, -40.0, 0.0])  # softplus threshold, underflow, zero
    bias = torch.randn(64, generator=g) * 0.3
    w, idx = moe_gate_sqrtsoftplus(logits, bias, 6, 2.5)
    w_ref, idx_ref = _route_written_out(logits, bias, 6, 2.5)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.sum(-1), torch.full((7,), 2.5), rtol=1e-6, atol=0)


def test_gate_rejects_bad_shapes():
    with pytest.raises(ValueError, match="topk"):
        moe_gate_sqrtsoftplus(torch.zeros(2, 8), torch.zeros(8), 9, 1.0)
    with pytest.raises(ValueError, match="bias"):
        moe_gate_sqrtsoftplus(torch.zeros(2, 8), torch.zeros(7), 2, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (8, 256, 6), (128, 256, 6), (3, 8, 2), (5, 384, 8)])
def test_gate_triton_matches_its_twin(T, E, k):
    from deepinfer.kernels.triton.moe_gate import moe_gate_sqrtsoftplus as gate_triton

    g = torch.Generator(device="cuda").manual_seed(T * 1000 + E)
    logits = torch.randn(T, E, device="cuda", generator=g) * 4
    logits[0, :2] = torch.tensor([30.0, -50.0], device="cuda")  # past the softplus threshold, underflow
    bias = torch.randn(E, device="cuda", generator=g) * 0.2
    w, idx = gate_triton(logits, bias, k, 1.5)
    w_ref, idx_ref = moe_gate_sqrtsoftplus(logits, bias, k, 1.5)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="fp32"):
        gate_triton(logits.half(), bias, k, 1.5)
