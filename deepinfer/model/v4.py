"""The DeepSeek-V4 engine model: a varlen batch of sequences, each extending its cached state by any
number of new tokens at any position (prefill chunks, decode tokens, multi-token extends) in one forward.

Owns: embedding, the blocks (manifold-constrained hyper-connections around attention and MoE), the head
collapse, final norm and the head on the requested rows only (spec §3). Caches live in `V4Cache`; the
batch layout in the `ForwardContext` (entered with `forward_context`).
Numerics: exact only for now (float64 everywhere, no activation or KV quantisation); `numerics` is
validated here so an `official` mode can be added by passing it down to the ops later.
Must not: import the reference oracle (it is the independent implementation this one is checked against).
"""
from __future__ import annotations

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.attention import V4Attention, _sub
from deepinfer.model.cache import V4Cache
from deepinfer.model.context import ForwardContext, forward_context, get_forward_context
from deepinfer.model.moe import V4MoE

SUPPORTED_NUMERICS = ("exact",)


class V4Block:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        self.p, self.cfg = params, cfg
        self.attn = V4Attention(layer, _sub(params, "attn."), cfg)
        self.ffn = V4MoE(layer, _sub(params, "ffn."), cfg)

    def _hc(self, x: torch.Tensor, which: str, sub, *args) -> torch.Tensor:
        """One hyper-connected sublayer: collapse the hc streams, norm, sublayer, mix back. x [T, hc, D]."""
        cfg, p = self.cfg, self.p
        mixes = kernels.get("hc_mix")(x, p[f"hc_{which}_fn"], cfg.norm_eps)
        pre, post, comb = kernels.get("hc_split_sinkhorn")(
            mixes, p[f"hc_{which}_scale"], p[f"hc_{which}_base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        )
        y = kernels.get("rms_norm")(kernels.get("hc_collapse")(x, pre), p[f"{which}_norm.weight"], cfg.norm_eps)
        return kernels.get("hc_post")(sub(y, *args), x, post, comb)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, ctx: ForwardContext, cache: V4Cache) -> torch.Tensor:
        x = self._hc(x, "attn", self.attn, ctx, cache)
        return self._hc(x, "ffn", self.ffn, ids)


class V4EngineModel:
    """V4 backbone + head over a paged `V4Cache` (exact numerics)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], cache: V4Cache,
                 numerics: str = "exact") -> None:
        if cfg.is_v41:
            raise ValueError("V4EngineModel is the family v4 model; this checkpoint is v41")
        if numerics not in SUPPORTED_NUMERICS:
            raise NotImplementedError(f"numerics {numerics!r} not implemented yet (have {SUPPORTED_NUMERICS})")
        self.cfg, self.p, self.cache, self.numerics = cfg, params, cache, numerics
        self.layers = [V4Block(i, _sub(params, f"layers.{i}."), cfg) for i in range(cfg.n_layers)]

    def _check(self, token_ids: torch.Tensor, ctx: ForwardContext) -> None:
        if token_ids.dim() != 1 or token_ids.shape[0] != ctx.num_tokens:
            raise ValueError(f"token_ids must be flat [{ctx.num_tokens}], got {tuple(token_ids.shape)}")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.cfg.vocab_size:
            raise ValueError("token id outside the vocabulary")
        bs = self.cache.block_size
        for s in ctx.seqs:
            if not (0 <= s.window_slot < self.cache.max_num_seqs and 0 <= s.state_slot < self.cache.max_num_seqs):
                raise ValueError(f"slot out of range in {s}")
            if len(s.block_table) * bs < s.end_pos and any(s.end_pos // r for r in self.cfg.compress_ratios if r):
                raise ValueError(f"block table of {len(s.block_table)} blocks does not cover position {s.end_pos - 1}")

    def hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The final 4-stream residual [T, hc, D] of the current ForwardContext's batch."""
        ctx = get_forward_context()
        self._check(token_ids, ctx)
        for s in ctx.seqs:
            if s.start_pos == 0:  # a fresh sequence: nothing of the slot's previous owner may leak in
                self.cache.reset(s.window_slot, s.state_slot)
        x = self.p["embed.weight"][token_ids].unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)  # [T, hc, D]
        for block in self.layers:
            x = block(x, token_ids, ctx, self.cache)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Head on x [N, hc, D] rows: learned 4->1 collapse, final norm, head -> [N, vocab]."""
        cfg, p = self.cfg, self.p
        mixes = kernels.get("hc_mix")(x, p["hc_head_fn"], cfg.norm_eps)
        pre = torch.sigmoid(mixes * p["hc_head_scale"] + p["hc_head_base"]) + cfg.hc_eps
        y = kernels.get("rms_norm")(kernels.get("hc_collapse")(x, pre), p["norm.weight"], cfg.norm_eps)
        return y @ p["head.weight"].T

    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """token_ids [T] flat -> logits [num_seqs, vocab] of each sequence's last new token
        (or [T, vocab] with ctx.all_logits). Without `ctx`, uses the one entered with `forward_context`."""
        if ctx is None:
            ctx = get_forward_context()
        with forward_context(ctx):
            x = self.hidden(token_ids)
        return self.logits(x[ctx.logit_rows()])  # only the needed rows: the head is vocab x dim

    __call__ = forward
