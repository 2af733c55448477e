"""The DeepSeek-V4.1-Flash oracle (family `v41`, spec §10): hyper-connections with the deferred `pre`,
Engram n-gram memory before layers 1 and 14, V4.1 attention with cross-layer sharing, MoE without hash
layers, and the final collapse with the last block's `pre` (no hc_head parameters).

Same forward contract as the V4 oracle (`V4Model`): prefill at start_pos 0, then one token per call;
`tap` receives the full 4-stream residual after engram/attention/FFN. DSpark drafting (mtp.* stages) is
not built here: greedy decoding does not use it (speculative-decoding issue); its tensors are still
checked on load. `main_hidden` (the mean over streams of the inputs of dspark_target_layer_ids) is kept
after every forward for that work.

Read in the official V4.1 `inference/model.py` (`Block.forward`, `Block.hc_mixes/hc_pre/hc_post`,
`Transformer.forward`, `make_identity_pre_mix`): each sublayer collapses its input with the `pre` mix the
PREVIOUS sublayer computed; the first uses one-hot [1, 0, 0, 0].
"""
from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.reference import ops
from deepinfer.reference.attention import _sub
from deepinfer.reference.engram import Engram, NgramHasher
from deepinfer.reference.moe import MoE
from deepinfer.reference.numerics import Numerics
from deepinfer.reference.v4 import Tap, check_forward_args, collapse, hc_mix, hc_post
from deepinfer.reference.v41_attention import SharedAttention, V41Attention


class V41Block:
    def __init__(self, layer: int, params, cfg: ModelConfig, num: Numerics, shared: SharedAttention,
                 max_batch: int, max_seq_len: int, quirks_official: bool) -> None:
        self.p, self.cfg, self.num = params, cfg, num
        self.attn = V41Attention(layer, _sub(params, "attn."), cfg, num, shared, max_batch, max_seq_len,
                                 quirks_official)
        self.ffn = MoE(layer, _sub(params, "ffn."), cfg, num, shared_clamp=True)

    def _mixes(self, x: torch.Tensor, which: str):
        cfg, p = self.cfg, self.p
        return ops.hc_split_sinkhorn(hc_mix(x, p[f"hc_{which}_fn"], cfg.norm_eps, self.num), p[f"hc_{which}_scale"],
                                     p[f"hc_{which}_base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def __call__(self, x, start_pos: int, pre_mix: torch.Tensor, ids, tap: Tap | None, name: str):
        num, eps = self.num, self.cfg.norm_eps
        attn_pre, post, comb = self._mixes(x, "attn")
        y = ops.rms_norm(collapse(x, pre_mix, num), self.p["attn_norm.weight"], eps, num)
        x = hc_post(self.attn(y, start_pos), x, post, comb, num)
        if tap:
            tap(f"{name}.attn", x)
        ffn_pre, post, comb = self._mixes(x, "ffn")
        y = ops.rms_norm(collapse(x, attn_pre, num), self.p["ffn_norm.weight"], eps, num)
        x = hc_post(self.ffn(y, ids), x, post, comb, num)
        if tap:
            tap(f"{name}.ffn", x)
        return x, ffn_pre


class V41Model:
    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], num: Numerics, max_batch: int = 4,
                 max_seq_len: int = 4096, quirks_official: bool = False, tokenizer=None) -> None:
        if not cfg.is_v41:
            raise ValueError("V41Model is the family v41 oracle; this checkpoint is v4")
        self.cfg, self.p, self.num = cfg, params, num
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.shared = SharedAttention()
        self.layers = [V41Block(i, _sub(params, f"layers.{i}."), cfg, num, self.shared, max_batch, max_seq_len,
                                quirks_official) for i in range(cfg.n_layers)]
        self.engrams = {layer: Engram(_sub(params, f"layers.{layer}.engram."), cfg, num, layer)
                        for layer in cfg.engram_layer_ids}
        self.hasher = NgramHasher(cfg, max_batch, max_seq_len, tokenizer) if cfg.engram_layer_ids else None
        self.tap: Tap | None = None
        self.seq_len = 0
        self.main_hidden: torch.Tensor | None = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.p["embed.weight"][ids]

    def hidden(self, ids: torch.Tensor, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Backbone; returns the final 4-stream residual and the last block's `pre` mix."""
        check_forward_args(self, ids, start_pos)
        hashes = self.hasher(ids, start_pos) if self.hasher is not None else None
        x = self.embed(ids).unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        if self.tap:
            self.tap("embed", x)
        pre_mix = torch.zeros(*ids.shape, self.cfg.hc_mult, dtype=self.num.acc)
        pre_mix[..., 0] = 1.0
        targets = []
        for i, block in enumerate(self.layers):
            if i in self.engrams:
                x = self.engrams[i](x, hashes[:, :, self.hasher.layer_index(i)])
                if self.tap:
                    self.tap(f"layers.{i}.engram", x)
            if i in self.cfg.dspark_target_layer_ids:  # DSpark reads the INPUT of its target layers
                targets.append(x.to(self.num.acc).mean(dim=2))
            x, pre_mix = block(x, start_pos, pre_mix, ids, self.tap, f"layers.{i}")
        self.main_hidden = torch.cat(targets, dim=-1) if targets else None
        self.seq_len = start_pos + ids.shape[1]
        return x, pre_mix

    def forward(self, ids: torch.Tensor, start_pos: int = 0, all_logits: bool = False) -> torch.Tensor:
        x, pre_mix = self.hidden(ids, start_pos)
        y = ops.rms_norm(collapse(x, pre_mix, self.num), self.p["norm.weight"], self.cfg.norm_eps, self.num)
        if self.tap:
            self.tap("final", y)
        return self.num.flinear(y if all_logits else y[:, -1], self.p["head.weight"])

    __call__ = forward
