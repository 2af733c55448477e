"""Torch twins of the fused official-numerics ops that have no single torch op: registered for every device
(the CPU fallback) and the references the Triton versions in `kernels/triton/norm_hc.py` are tested against.

Owns: `hc_pre_fused` (hc mixes, Sinkhorn split, collapse, bf16 round, RMSNorm, bf16 round: exactly the
steps `V4Block._hc_official` runs before a sublayer), `hc_post_fused` (hc_post rounded once to bf16), and
`kv_encode` / `kv_decode` (a `cache/layouts.py` KVLayout's own store/load, as ops a device can replace),
`moe_gate_sqrtsoftplus` (the V4 gate after its logits GEMM: sqrt-softplus, bias-only selection, top-k,
renormalise, scale: exactly `V4MoE.route`'s ops), `fp4_fake_quant` (`formats.fp4_fake_quant` as a registry op).
Must not: hold state or import the model or the reference oracle; change a rounding point of the
unfused sequence (the engine may call either and must get the same bits on CPU).
"""
from __future__ import annotations

import torch

from deepinfer import formats
from deepinfer.kernels import torch_ops

__all__ = ["hc_pre_fused", "hc_post_fused", "kv_encode", "kv_decode", "moe_gate_sqrtsoftplus", "fp4_fake_quant"]

F32, BF16 = torch.float32, torch.bfloat16


def hc_pre_fused(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 norm_weight: torch.Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, D] bf16 residual streams -> y [T, D] bf16 (collapsed, normed sublayer input),
    post [T, hc] fp32, comb [T, hc, hc] fp32 (Sinkhorn-normalised; hc_post contracts its first index)."""
    if x.dim() != 3 or x.shape[1] != hc:
        raise ValueError(f"hc_pre_fused: x must be [T, hc={hc}, D], got {tuple(x.shape)}")
    xf = x.to(F32)
    mixes = torch_ops.hc_mix(xf, fn, norm_eps)
    pre, post, comb = torch_ops.hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    y = torch_ops.hc_collapse(xf, pre).to(BF16).to(F32)
    return torch_ops.rms_norm(y, norm_weight, norm_eps).to(BF16), post, comb


def hc_post_fused(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """bf16(post_k * F + sum_j comb[j, k] * R_j) with fp32 arithmetic: f [T, D], residual [T, hc, D]."""
    return torch_ops.hc_post(f.to(F32), residual.to(F32), post, comb).to(BF16)


def kv_encode(layout, x: torch.Tensor) -> torch.Tensor:
    """`layout.store(x)`: values [..., dim] -> the layout's packed bytes (the layout object is passed in, so
    kernels never import cache)."""
    return layout.store(x)


def kv_decode(layout, packed: torch.Tensor) -> torch.Tensor:
    """`layout.load(packed)`: packed bytes -> the bf16 values the oracle holds in its cache."""
    return layout.load(packed)


def moe_gate_sqrtsoftplus(logits: torch.Tensor, bias: torch.Tensor, topk: int,
                          route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, topk] fp32, indices [T, topk] int64): scores sqrt(softplus(logits)),
    the experts of the top-k biased scores (descending), their UNbiased scores renormalised to sum 1, times
    route_scale (spec §3.9; the bias only selects)."""
    if logits.dim() != 2 or bias.shape != logits.shape[-1:] or not 0 < topk <= logits.shape[-1]:
        raise ValueError(f"moe_gate: logits [T, E], bias [E], 0 < topk <= E; got {tuple(logits.shape)}, "
                         f"{tuple(bias.shape)}, topk {topk}")
    scores = torch.nn.functional.softplus(logits).sqrt()
    indices = (scores + bias).topk(topk, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, indices


def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 values with E8M0 pow2 scales per `block` values, dequantised, in x's dtype (the indexer's q)."""
    return formats.fp4_fake_quant(x, block)
