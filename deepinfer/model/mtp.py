"""The V4 multi-token-prediction block (`mtp.0`, spec §3.11) as an engine drafter model, over its own
window-ring cache (the MTP layer has compress ratio 0: window attention only).

Which hidden state and shift feed it (the official code has no caller; settled from DeepSeek-V3's MTP
description and how vLLM/SGLang run DeepSeek MTP): at position t the block combines the target's FINAL
4-stream residual at t (the backbone output before the head's hc collapse, so the MTP's own `hnorm` sees
what the head would) with the embedding of token t + 1, at RoPE position t, and its head predicts token
t + 2. Chained drafts feed the block's own output residual at t as the hidden for position t + 1.
  x = e_proj(enorm(embed(token_{t+1}))) broadcast to the hc streams + h_proj(hnorm(X_t)) (hnorm per stream)
  X' = Block_mtp(x);  logits = head(mtp.norm(hc_collapse_mtp(X')))  (shared embed and head)

Owns: the MTP parameters' use, its window ring per sequence slot (`MTPCache`, reset when a sequence
starts afresh). Exact numerics (float64) and official numerics (bf16 activations, FP8 act-quant GEMMs).
Must not: import the reference oracle; decide which positions to run or what to propose (spec/ does).
"""
from __future__ import annotations

from typing import Mapping

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.attention import _sub
from deepinfer.model.cache import LayerCache, cache_layouts
from deepinfer.model.context import ForwardContext, forward_context
from deepinfer.model.params import prepare_params
from deepinfer.model.v4 import V4Block

F32, BF16 = torch.float32, torch.bfloat16


class _RawSubset(dict):
    """A filtered checkpoint mapping that keeps the loader's `dequantised` marker."""

    dequantised: set = set()


def prepare_mtp_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
                       numerics: str, stage: int = 0) -> dict[str, torch.Tensor]:
    """The compute-ready `mtp.{stage}.*` tensors (names without the prefix)."""
    prefix = f"mtp.{stage}."
    sub = _RawSubset({k: v for k, v in raw.items() if k.startswith(prefix)})
    sub.dequantised = set(getattr(raw, "dequantised", ()))
    if not any(k.endswith(".weight") for k in sub):
        raise ValueError(f"the checkpoint has no {prefix}* tensors: it carries no MTP layer to draft with")
    return _sub(prepare_params(sub, cfg, dtype, skip_mtp=False, numerics=numerics), prefix)


class MTPCache:
    """The MTP layer's window ring per sequence slot (`layers` keyed by the layer id the block reads)."""

    def __init__(self, cfg: ModelConfig, layer: int, max_num_seqs: int, dtype: torch.dtype, numerics: str,
                 revision: str = "current") -> None:
        if cfg.compress_ratios[layer]:
            raise ValueError(f"MTP layer {layer} has compress ratio {cfg.compress_ratios[layer]}; expected 0")
        self.max_num_seqs, self.numerics, self.revision = max_num_seqs, numerics, revision
        self.layouts = cache_layouts(cfg, numerics, revision)
        self.layers = {layer: LayerCache(cfg, layer, 0, 128, max_num_seqs, dtype, self.layouts)}

    def reset(self, window_slot: int) -> None:
        for lc in self.layers.values():
            lc.reset(window_slot, window_slot)


class V4MTP:
    """One MTP stage over `MTPCache`. `target_params` supplies the shared `embed.weight` / `head.weight`."""

    def __init__(self, cfg: ModelConfig, mtp_params: dict[str, torch.Tensor], target_params: dict[str, torch.Tensor],
                 cache: MTPCache, numerics: str = "exact", stage: int = 0) -> None:
        if cfg.is_v41:
            raise ValueError("V4MTP is the family v4 MTP block; V4.1 drafts with DSpark")
        self.cfg, self.p, self.cache, self.numerics = cfg, mtp_params, cache, numerics
        self.official = numerics == "official"
        self.layer = cfg.mtp_layer_ids[stage]
        self.embed, self.head_w = target_params["embed.weight"], target_params["head.weight"]
        self.block = V4Block(self.layer, mtp_params, cfg, official=self.official,
                             shared_clamp=cache.revision == "current")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        rms = kernels.get("rms_norm")
        if self.official:
            return rms(x.to(F32), self.p[name], self.cfg.norm_eps).to(BF16)
        return rms(x, self.p[name], self.cfg.norm_eps)

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.official:
            return kernels.get("qlinear")(x, self.p[name])
        return x @ self.p[name].T

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, ctx: ForwardContext,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hc, D] (target final residual at each position, or the MTP's own output when
        chaining), next_ids [T] (the token AFTER each position) -> (output residual [T, hc, D],
        logits of `ctx.logit_rows()`)."""
        if hidden.dim() != 3 or hidden.shape[0] != next_ids.shape[0] or next_ids.shape[0] != ctx.num_tokens:
            raise ValueError(f"MTP: hidden {tuple(hidden.shape)} / ids {tuple(next_ids.shape)} do not match "
                             f"the context's {ctx.num_tokens} tokens")
        e = self._norm(self.embed[next_ids], "enorm.weight")
        h = self._norm(hidden, "hnorm.weight")  # per stream
        x = self._proj(e, "e_proj.weight").unsqueeze(1) + self._proj(h, "h_proj.weight")
        if self.official:
            x = x.to(BF16)
        with forward_context(ctx):
            x = self.block(x, next_ids, ctx, self.cache)
        return x, self.logits(x[ctx.logit_rows()])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The MTP head: its own 4->1 collapse and norm, then the shared head. x [N, hc, D] -> [N, V]."""
        cfg, p = self.cfg, self.p
        if self.official:
            x = x.to(F32)
        mixes = kernels.get("hc_mix")(x, p["hc_head_fn"], cfg.norm_eps)
        pre = torch.sigmoid(mixes * p["hc_head_scale"] + p["hc_head_base"]) + cfg.hc_eps
        y = kernels.get("hc_collapse")(x, pre)
        if self.official:
            y = y.to(BF16).to(F32)
            y = kernels.get("rms_norm")(y, p["norm.weight"], cfg.norm_eps).to(BF16).to(F32)
        else:
            y = kernels.get("rms_norm")(y, p["norm.weight"], cfg.norm_eps)
        return y @ self.head_w.T
