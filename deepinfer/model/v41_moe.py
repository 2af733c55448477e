"""V4.1 mixture of experts of the engine (spec §10.4): sqrt-softplus (or configured) gate on logits divided
by gate_temp, selection-only bias, weights normalised as w / (sum + 1e-20) when norm_topk_prob and top-k > 1,
scaled by route_scale; clamped SwiGLU experts and a clamped shared expert. No hash layers.
Exact numerics: float64 throughout. Must not: import the reference oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import kernels
from deepinfer.config import ModelConfig


class V41MoE:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        if not cfg.is_v41:
            raise ValueError("V41MoE implements family v41 routing")
        self.p, self.cfg, self.topk = params, cfg, cfg.n_activated_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, k], expert indices [T, k]."""
        cfg = self.cfg
        logits = (x @ self.p["gate.weight"].T) / cfg.gate_temp
        if cfg.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        indices = (scores + self.p["gate.bias"]).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.route_scale, indices

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        swiglu, limit = kernels.get("swiglu"), self.cfg.swiglu_limit
        weights, indices = self.route(x)
        y = torch.zeros_like(x)
        for e in sorted(set(indices.flatten().tolist())):
            rows, slot = torch.where(indices == e)
            pe = f"experts.{e}."
            y[rows] += swiglu(x[rows], self.p[pe + "w1.weight"], self.p[pe + "w3.weight"], self.p[pe + "w2.weight"],
                              limit, weights[rows, slot, None])
        s = "shared_experts."
        return y + swiglu(x, self.p[s + "w1.weight"], self.p[s + "w3.weight"], self.p[s + "w2.weight"], limit)
