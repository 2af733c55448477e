"""V4.1 mixture of experts of the engine (spec §10.4): sqrt-softplus (or configured) gate on logits divided
by gate_temp, selection-only bias, weights normalised as w / (sum + 1e-20) when norm_topk_prob and top-k > 1,
scaled by route_scale; clamped SwiGLU experts and a clamped shared expert. No hash layers.
Exact numerics: float64 throughout. Official numerics: bf16 in/out, fp32 gate, each expert's GEMMs with
FP8 activation quantisation per cfg.act_block (the routing weight multiplies the fp32 SwiGLU output before
its rounding to bf16 and the down projection), outputs accumulated in fp32 in expert order (shared expert,
clamped, last), rounded to bf16 once. Fast numerics: the same rounding points with the routed experts kept
FP4 in one `FP4ExpertBank` (params key "experts") run by the `fp4_moe` op in one call (no per-expert loop,
no host sync on the routing) and the shared expert's FP8 weights kept quantised (`fp8_linear`), the ops of
the params' device. Must not: import the reference oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import env, kernels
from deepinfer.config import ModelConfig
from deepinfer.model.side_stream import forked, join, side_work
from deepinfer.model.stacked import pair


class V41MoE:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig, official: bool = False,
                 comm=None, fast: bool = False) -> None:
        if not cfg.is_v41:
            raise ValueError("V41MoE implements family v41 routing")
        self.p, self.cfg, self.topk = params, cfg, cfg.n_activated_experts
        self.official, self.fast = official or fast, fast  # fast numerics keeps the official rounding points
        if fast and comm is not None:
            raise NotImplementedError("fast numerics with expert parallelism (one FP4 expert bank per layer)")
        self.kdev = params["gate.weight"].device.type if fast else "cpu"  # exact/official: the torch twins
        self.comm = comm  # expert parallel: params hold only this rank's routed experts

    def _local_experts(self, indices: torch.Tensor) -> list[int]:
        """The routed experts this batch uses that live on this rank (all of them in one process)."""
        return [e for e in sorted(set(indices.flatten().tolist())) if f"experts.{e}.w1.weight" in self.p]

    def _routes_by_op(self) -> bool:
        """Whether fast numerics routes through op "moe_route" (sqrt-softplus scores, renormalised top-k; the op
        fuses its steps where it can)."""
        cfg = self.cfg
        return self.fast and cfg.score_func == "sqrtsoftplus" and cfg.norm_topk_prob and self.topk > 1

    def _route_fast(self, x: torch.Tensor):
        """Op "moe_route": the official fp32 logits of the bf16 x and weight, / gate_temp, the gate with this
        renormalisation's + 1e-20: exactly the ops `route` runs below; on cuda at b1 one launch that also
        makes the routed experts' slot blocks and act_quant(x) (the third item, else None)."""
        cfg = self.cfg
        return kernels.get("moe_route", self.kdev)(x, self.p["gate.weight"], self.p["gate.bias"], self.topk,
                                                   cfg.route_scale, 1e-20, cfg.gate_temp,
                                                   act_block=self.p["experts"].act_block)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, k], expert indices [T, k]."""
        cfg = self.cfg
        if self._routes_by_op():
            return self._route_fast(x)[:2]
        if self.fast:  # the official fp32 matmul of the bf16 x and weight (tensor cores on cuda)
            logits = kernels.get("linear_f32", self.kdev)(x, self.p["gate.weight"])
            if cfg.gate_temp != 1.0:  # (a division by 1.0 changes no bit: no launch for it)
                logits = logits / cfg.gate_temp
        else:
            logits = ((x.to(torch.float32) if self.official else x) @ self.p["gate.weight"].T) / cfg.gate_temp
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

    def _swiglu_official(self, x: torch.Tensor, pre: str, weight: torch.Tensor | None) -> torch.Tensor:
        block, limit = self.cfg.act_block, self.cfg.swiglu_limit
        if self.fast:  # QuantLinearWeight: its act_block is cfg.act_block
            fp8_linear = kernels.get("fp8_linear", self.kdev)

            def qlinear(t, w, _block):
                return fp8_linear(t, w)
        else:
            qlinear = kernels.get("qlinear")
        # the shared expert's w1 and w3 in one GEMM in fast numerics (`params_fast.STACKS`), else two
        gate, up = pair(lambda t, w: qlinear(t, w, block), x, self.p, pre + "w13.weight", pre + "w1.weight",
                        pre + "w3.weight")
        # upcast, clamps, silu * up (* weight), bf16 round: one kernel on cuda (seven torch ops in the twin)
        h = kernels.get("swiglu_bf16", self.kdev)(gate, up, limit, weight)
        return qlinear(h, self.p[pre + "w2.weight"], block)

    def _forward_official(self, x: torch.Tensor) -> torch.Tensor:
        xr = x if self.comm is None else self.comm.moe_dispatch(x, None)[0]
        weights, indices = self.route(xr)
        y = torch.zeros(xr.shape, dtype=torch.float32, device=x.device)
        for e in self._local_experts(indices):
            rows, slot = torch.where(indices == e)
            y[rows] += self._swiglu_official(xr[rows], f"experts.{e}.", weights[rows, slot, None]).to(torch.float32)
        if self.comm is not None:
            y = self.comm.moe_combine(y)  # fp32, as the official all-reduce
        y += self._swiglu_official(x, "shared_experts.", None).to(torch.float32)
        return y.to(torch.bfloat16)

    def _forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        """Official rounding points, routed experts in one `fp4_moe` call (fp32 sum over the k experts in
        ascending expert order, as official), the clamped shared expert added in fp32, rounded to bf16 once."""
        with forked(x.device) as branch:  # the shared expert beside the routing and routed experts (as V4MoE)
            shared = side_work(branch, lambda: self._swiglu_official(x, "shared_experts.", None),
                               later=env.route_first_enabled())  # the routing first, as V4MoE
            weights, indices, routed = self._route_fast(x) if self._routes_by_op() else (*self.route(x), None)
            shared = shared()
            # the shared rows added last in fp32 and the bf16 rounding inside the op's combine, which joins the
            # side stream just before it
            return kernels.get("fp4_moe_shared", self.kdev)(x, indices, weights.to(torch.float32),
                                                            self.p["experts"], self.cfg.swiglu_limit, shared,
                                                            lambda: join(branch), routed=routed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return self._forward_fast(x)
        if self.official:
            return self._forward_official(x)
        swiglu, limit = kernels.get("swiglu"), self.cfg.swiglu_limit
        xr = x if self.comm is None else self.comm.moe_dispatch(x, None)[0]  # EP over dp: every group's tokens
        weights, indices = self.route(xr)
        y = torch.zeros_like(xr)
        for e in self._local_experts(indices):
            rows, slot = torch.where(indices == e)
            pe = f"experts.{e}."
            y[rows] += swiglu(xr[rows], self.p[pe + "w1.weight"], self.p[pe + "w3.weight"], self.p[pe + "w2.weight"],
                              limit, weights[rows, slot, None])
        if self.comm is not None:
            y = self.comm.moe_combine(y)  # sum over the expert shards, this rank's rows
        s = "shared_experts."
        return y + swiglu(x, self.p[s + "w1.weight"], self.p[s + "w3.weight"], self.p[s + "w2.weight"], limit)
