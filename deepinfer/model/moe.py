"""V4 mixture of experts of the engine: sqrt-softplus gate with a selection-only bias, or hash routing by
token id (the first n_hash_layers), renormalised and scaled weights, clamped SwiGLU experts, one shared
expert (spec §3.9). Exact numerics: float64 throughout. Official numerics: bf16 in/out, fp32 gate, each
expert's GEMMs with FP8 activation quantisation (the routing weight multiplies the fp32 SwiGLU output
before its rounding to bf16 and the down projection), expert outputs accumulated in fp32 in expert order
(shared expert last), rounded to bf16 once. Fast numerics: the same rounding points with the routed
experts kept FP4 in one `FP4ExpertBank` (params key "experts") run by the `fp4_moe` op in one call (no
per-expert loop, no host sync on the routing), the shared expert's FP8 weights kept quantised
(`fp8_linear`). Fast numerics with expert parallelism: the same dispatch/combine as the other numerics,
the bank holding this rank's experts only (`expert_parallel_fast.py`: non-local slots get weight 0).
Must not: import the reference oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import env, kernels
from deepinfer.config import ModelConfig
from deepinfer.model.expert_parallel_fast import expert_shard, local_routing
from deepinfer.model.side_stream import forked, join, side_work
from deepinfer.model.stacked import pair


class V4MoE:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig,
                 shared_clamp: bool = True, official: bool = False, fast: bool = False, comm=None) -> None:
        if cfg.is_v41:
            raise ValueError("V4MoE implements family v4 routing")
        self.p, self.cfg = params, cfg
        self.hash = cfg.is_hash_layer(layer)
        self.topk = cfg.n_activated_experts
        self.shared_limit = cfg.swiglu_limit if shared_clamp else 0.0  # the initial release left it unclamped
        self.official = official or fast  # fast numerics keeps the official rounding points
        self.fast = fast
        device = params["gate.weight"].device
        self.kdev = device.type if fast else "cpu"  # exact/official: the torch twins (any device)
        self.comm = comm  # expert parallel: params hold only this rank's routed experts
        self.expert_shard = expert_shard(params, cfg, comm) if fast else None

    def _local_experts(self, indices: torch.Tensor) -> list[int]:
        """The routed experts this batch uses that live on this rank (all of them in one process)."""
        return [e for e in sorted(set(indices.flatten().tolist())) if f"experts.{e}.w1.weight" in self.p]

    def _swiglu_official(self, x: torch.Tensor, pre: str, limit: float, weight: torch.Tensor | None) -> torch.Tensor:
        qlinear = kernels.get("fp8_linear", self.kdev) if self.fast else kernels.get("qlinear")
        # one GEMM over the stacked [w1; w3] where the fast params hold it (the shared expert); its split-K
        # partials left to the SwiGLU kernel where env.split_sum_consumers says so (the same bits)
        w13 = kernels.get("fp8_linear_unsummed", self.kdev) if self.fast and "swiglu" in env.split_sum_consumers() \
            else qlinear
        gate, up = pair(w13, x, self.p, pre + "w13.weight", pre + "w1.weight", pre + "w3.weight")
        # upcast, clamps, silu * up (* weight), bf16 round: one kernel on cuda (seven torch ops in the twin)
        h = kernels.get("swiglu_bf16", self.kdev)(gate, up, limit, weight)
        return qlinear(h, self.p[pre + "w2.weight"])

    def _route_fast(self, x: torch.Tensor, ids: torch.Tensor):
        """Fast numerics' sqrt-softplus routing as op "moe_route": the official fp32 logits of the bf16 x and
        weight, then the gate (hash or biased top-k), exactly the ops `route` runs below; on cuda at b1 one
        launch that also makes the routed experts' slot blocks and act_quant(x) (the third item, a
        `PreRouted` for fp4_moe_shared, else None)."""
        bank = self.p["experts"]
        hashed = self.hash
        return kernels.get("moe_route", self.kdev)(
            x, self.p["gate.weight"], None if hashed else self.p["gate.bias"], self.topk, self.cfg.route_scale,
            act_block=bank.act_block, tid2eid=self.p["gate.tid2eid"] if hashed else None, ids=ids if hashed else None)

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], ids [T] -> weights [T, k], expert indices [T, k]."""
        cfg = self.cfg
        if self.fast and cfg.score_func == "sqrtsoftplus":
            return self._route_fast(x, ids)[:2]
        if self.fast:  # the official fp32 matmul of the bf16 x and weight (tensor cores on cuda)
            logits = kernels.get("linear_f32", self.kdev)(x, self.p["gate.weight"])
        else:
            logits = (x.to(torch.float32) if self.official else x) @ self.p["gate.weight"].T
        if cfg.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif cfg.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash:
            indices = self.p["gate.tid2eid"][ids].long()
        else:  # the bias only selects; the weights come from the unbiased scores
            indices = (scores + self.p["gate.bias"]).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.score_func != "softmax":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * cfg.route_scale, indices

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids [T] -> [T, D]."""
        if self.fast:
            return self._forward_fast(x, ids)
        if self.official:
            return self._forward_official(x, ids)
        swiglu = kernels.get("swiglu")
        xr, idr = (x, ids) if self.comm is None else self.comm.moe_dispatch(x, ids)  # EP over dp: all tokens
        weights, indices = self.route(xr, idr)
        y = torch.zeros_like(xr)
        limit = self.cfg.swiglu_limit
        for e in self._local_experts(indices):
            rows, slot = torch.where(indices == e)
            pe = f"experts.{e}."
            y[rows] += swiglu(xr[rows], self.p[pe + "w1.weight"], self.p[pe + "w3.weight"], self.p[pe + "w2.weight"],
                              limit, weights[rows, slot, None])
        if self.comm is not None:
            y = self.comm.moe_combine(y)  # sum over the expert shards, this rank's rows
        s = "shared_experts."
        y += swiglu(x, self.p[s + "w1.weight"], self.p[s + "w3.weight"], self.p[s + "w2.weight"], self.shared_limit)
        return y

    def _forward_official(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        xr, idr = (x, ids) if self.comm is None else self.comm.moe_dispatch(x, ids)
        weights, indices = self.route(xr, idr)
        y = torch.zeros(xr.shape, dtype=torch.float32, device=x.device)
        limit = self.cfg.swiglu_limit
        for e in self._local_experts(indices):
            rows, slot = torch.where(indices == e)
            out = self._swiglu_official(xr[rows], f"experts.{e}.", limit, weights[rows, slot, None])
            y[rows] += out.to(torch.float32)
        if self.comm is not None:
            y = self.comm.moe_combine(y)  # fp32, as the official all-reduce
        y += self._swiglu_official(x, "shared_experts.", self.shared_limit, None).to(torch.float32)
        return y.to(torch.bfloat16)

    def _forward_fast(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Official rounding points, routed experts in one `fp4_moe` call (fp32 sum over the k experts),
        the shared expert added in fp32, rounded to bf16 once."""
        # The shared expert needs only x: on CUDA it runs on the side stream beside the gate, the routing and
        # the routed experts (model/side_stream.py), and joins before its fp32 add. Same kernels, same bits.
        with forked(x.device) as branch:  # joined at the latest when the block ends
            # the routing is the critical path's start, the shared expert only joins at the combine: queued
            # first, a replayed graph starts its kernel first (env.route_first_enabled). Not with a
            # communicator: its dispatch syncs the host (the dp groups' row counts), which would hold the shared
            # expert back from overlapping the collective
            shared = side_work(branch, lambda: self._swiglu_official(x, "shared_experts.", self.shared_limit, None),
                               later=env.route_first_enabled() and self.comm is None)
            xr, idr = (x, ids) if self.comm is None else self.comm.moe_dispatch(x, ids)  # EP over dp: all tokens
            routed = None
            if self.cfg.score_func == "sqrtsoftplus" and self.comm is None and self.expert_shard is None:
                weights, indices, routed = self._route_fast(xr, idr)
            else:
                weights, indices = self.route(xr, idr)
            weights = weights.to(torch.float32)
            if self.expert_shard is not None:  # this rank's experts only; the others' slots contribute 0
                indices, weights = local_routing(indices, weights, *self.expert_shard)
            bank, limit = self.p["experts"], self.cfg.swiglu_limit
            shared = shared()  # (queued here when the routing went first)
            if self.comm is None:  # the shared rows added last in fp32 and the bf16 rounding inside the op's
                # combine; the op joins the side stream just before that combine (after queueing the GEMMs)
                return kernels.get("fp4_moe_shared", self.kdev)(xr, indices, weights, bank, limit, shared,
                                                                lambda: join(branch), routed=routed)
            y = kernels.get("fp4_moe", self.kdev)(xr, indices, weights, bank, limit)
            y = self.comm.moe_combine(y)  # fp32 partial sums over the expert shards, this rank's rows
            # in place, the bf16 shared output upcast inside the add (exact, the same sum as adding its fp32
            # copy): no fp32 copy of it and no second [T, dim] fp32 buffer (y is this call's own fp32 result)
            join(branch)
            y.add_(shared)
            return y.to(torch.bfloat16)
