"""Mixture of experts of the reference: sqrt-softplus gate with a selection-only bias or hash routing by
token id, renormalised and scaled weights, clamped SwiGLU experts, one shared expert (V4 spec §3.9).
V4.1 (§10.4): logits divided by gate_temp, no hash layers, weights normalised as w / (sum + 1e-20) when
norm_topk_prob and top-k > 1, shared expert clamped (image-span tokens would use `bias_vl`: text only here).

The routing weight multiplies the SwiGLU output BEFORE the down projection (and before its activation
quantisation); per-expert outputs are accumulated in fp32 in expert order, then rounded once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.config import ModelConfig
from deepinfer.reference.numerics import Numerics


def swiglu_expert(x: torch.Tensor, w1, w3, w2, limit: float, weight: torch.Tensor | None, num: Numerics):
    """w2(round(weight * silu(min(g, limit)) * clamp(u, -limit, limit))) with g, u upcast (spec §3.9)."""
    gate = num.qlinear(x, w1).to(num.acc)
    up = num.qlinear(x, w3).to(num.acc)
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = weight * h
    return num.qlinear(num.round(h), w2)


class MoE:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig, num: Numerics,
                 shared_clamp: bool) -> None:
        self.p = params
        self.cfg = cfg
        self.num = num
        self.hash = cfg.is_hash_layer(layer)
        self.topk = cfg.n_activated_experts
        self.shared_limit = cfg.swiglu_limit if shared_clamp else 0.0

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], ids [T] -> (weights [T, k], expert indices [T, k])."""
        cfg, num = self.cfg, self.num
        logits = num.flinear(x, self.p["gate.weight"])  # fp32 gate on upcast bf16 weights
        if cfg.is_v41:
            logits = logits / cfg.gate_temp
        if cfg.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash:
            indices = self.p["gate.tid2eid"][ids].long()
        else:
            indices = (scores + self.p["gate.bias"]).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.is_v41:
            if cfg.norm_topk_prob and self.topk > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # not norm_eps: as trained
        elif cfg.score_func != "softmax":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * cfg.route_scale, indices

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.route(x, ids.reshape(-1))
        y = torch.zeros(x.shape, dtype=self.num.acc)
        limit = self.cfg.swiglu_limit
        for e in sorted(set(indices.flatten().tolist())):
            rows, slot = torch.where(indices == e)
            p = f"experts.{e}."
            y[rows] += swiglu_expert(
                x[rows], self.p[p + "w1.weight"], self.p[p + "w3.weight"], self.p[p + "w2.weight"], limit,
                weights[rows, slot, None], self.num,
            ).to(self.num.acc)
        s = "shared_experts."
        y += swiglu_expert(
            x, self.p[s + "w1.weight"], self.p[s + "w3.weight"], self.p[s + "w2.weight"], self.shared_limit, None,
            self.num,
        ).to(self.num.acc)
        return self.num.round(y).view(shape)
