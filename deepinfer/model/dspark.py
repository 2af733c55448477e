"""DSpark drafting stages (`mtp.0..n-1` of a V4.1 checkpoint, spec §10.8) as an engine drafter model,
read in the official V4.1 `inference/model.py` (DSparkAttention, DSparkBlock, DSparkMarkovHead,
DSparkConfidenceHead, Transformer.forward_spec).

  main_hidden [.., 3D]  the target's per-position mean over the 4 streams of the INPUT of each of
                        dspark_target_layer_ids (captured by spec/target.py)
  main_x = main_norm(main_proj(main_hidden))  (stage 0's weights; every stage reads this main_x)
  window ring, per stage and sequence slot: kv_norm(wkv_stage(main_x_p)) with RoPE at p, for every target
      position p whose hidden is valid (the official "prefill only seeds the window")
  draft block at target position P (the last position in the ring): ids [last sampled token, noise x (bs-1)]
      embedded to 4 streams, RoPE positions P+1 .. P+bs; each stage is a hyper-connected block (deferred
      pre mix, identity one-hot first) whose attention queries see the ring's last `window` positions and
      ALL block positions (bidirectional), MoE with dspark_n_routed_experts / dspark_n_activated_experts
  head: collapse with the last stage's pre mix, stage norm, the target's head; block row i is biased by the
      Markov head of token i (head_m @ embed_m[token_i]) and sampled in order (greedy here), so row i
      proposes token P+2+i; confidence = proj([collapsed x_i, embed_m[token_i]]) per row.

V4-Flash-0731 (config family "v4" with dspark keys; its inference code was never published) runs the same
algorithm over V4 blocks. What is read and what is inferred:
  read (its tensor inventory, spec §11): stages are V4 blocks (wq_a/q_norm/wq_b, wkv/kv_norm, wo_a/wo_b,
      attn_sink, ratio 0), MoE with the backbone's expert count, stage 0 `main_proj` [D, 3D] + `main_norm`,
      the last stage `norm`, `hc_head_*`, `markov_head.markov_w1/markov_w2` [V, rank] and the confidence head;
      target layers [40, 41, 42], block 5, noise 128799, rank 256 (its config).
  inferred, from V4.1's algorithm and V4's blocks: main_hidden = the mean over the 4 streams of each
      target layer's input (as V4.1); the window ring is seeded exactly as V4.1 (kv_norm(wkv(main_x)),
      RoPE at the target position); attention is V4's: q gets the per-head parameter-free RMS norm after
      wq_b (V4.1 dropped it; every V4 attention has it); each sublayer's hyper-connection pre mix comes from
      its own input (V4's Block, no deferred pre mix), so the head collapse is V4's learned one with the
      last stage's `hc_head_*` (the reason those tensors exist, as in V4's MTP block) instead of V4.1's
      deferred pre mix; the MoE is V4's (score-routed: stage ids >= n_hash_layers) with top-k
      dspark_n_activated_experts or, as 0731's config sets none, n_activated_experts; markov_w1 is the
      token embedding (V4.1 `embed`) and markov_w2 the rank -> vocab head (V4.1 `head`), the order of a
      low-rank W1 W2 factorisation, and the confidence input is [collapsed x_i, markov_w1[token_i]].
  A third-party port of "the official DSpark inference code" onto V4 blocks (MindStudio's deepseek_v4
  DSparkBlock/DSparkAttention/DSparkMarkovHead) has exactly this structure: V4 Block with per-head q
  norm, hc_head collapse, markov_w1 embedding then markov_w2 head, confidence on the hc_head output.
Exact numerics (float64). Official numerics are not implemented for the drafter (a clear error says so).
Must not: import the reference oracle; decide which positions to seed or what to propose (spec/ does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.moe import V4MoE
from deepinfer.model.mtp import _RawSubset
from deepinfer.model.params import prepare_params
from deepinfer.model.v41_attention import _sub
from deepinfer.model.v41_cache import V41LayerCache
from deepinfer.model.v41_moe import V41MoE


def prepare_dspark_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The compute-ready `mtp.*` tensors of every DSpark stage (names keep the `mtp.{i}.` prefix)."""
    sub = _RawSubset({k: v for k, v in raw.items() if k.startswith("mtp.")})
    sub.dequantised = set(getattr(raw, "dequantised", ()))
    if not sub:
        raise ValueError("the checkpoint has no mtp.* tensors: it carries no DSpark stages")
    return prepare_params(sub, cfg, torch.float64, skip_mtp=False)


class DSparkCache:
    """One window ring per stage and sequence slot (`layers` keyed by the stage's layer id)."""

    def __init__(self, cfg: ModelConfig, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.layers = {layer: V41LayerCache(cfg, layer, 0, 128, max_num_seqs, torch.float64)
                       for layer in cfg.mtp_layer_ids}

    def reset(self, slot: int) -> None:
        for lc in self.layers.values():
            lc.reset(slot, slot)


@dataclass
class DraftBlock:
    tokens: list[list[int]]  # per sequence: the block_size greedy proposals (positions P+2 ..)
    confidence: torch.Tensor  # [num_seqs, block_size] the confidence head's logits


class _Stage:
    def __init__(self, stage: int, params: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
        self.layer = cfg.mtp_layer_ids[stage]
        self.cfg, self.p = cfg, _sub(params, f"mtp.{stage}.")
        self.a = _sub(self.p, "attn.")
        self.H = self.a["wq_b.weight"].shape[0] // cfg.head_dim
        self.inv_freq = kernels.get("rope_inv_freq")(
            cfg.rope_head_dim, cfg.original_seq_len if cfg.uses_yarn(self.layer) else 0, cfg.rope_base(self.layer),
            cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        self.v4 = not cfg.is_v41  # V4-Flash-0731: V4 blocks (see the module docstring)
        moe = V4MoE if self.v4 else V41MoE
        self.ffn = moe(self.layer, _sub(self.p, "ffn."), cfg)
        self.ffn.topk = cfg.dspark_n_activated_experts or cfg.n_activated_experts  # DSpark's own top-k

    def window_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rms = kernels.get("rms_norm")
        kv = rms(main_x @ self.a["wkv.weight"].T, self.a["kv_norm.weight"], self.cfg.norm_eps)
        return kernels.get("rope")(kv, positions, self.inv_freq)

    def _mixes(self, x: torch.Tensor, which: str):
        cfg, p = self.cfg, self.p
        mixes = kernels.get("hc_mix")(x, p[f"hc_{which}_fn"], cfg.norm_eps)
        return kernels.get("hc_split_sinkhorn")(mixes, p[f"hc_{which}_scale"], p[f"hc_{which}_base"], cfg.hc_mult,
                                                cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def attention(self, x: torch.Tensor, ring: torch.Tensor, slots: list[int], last: list[int]) -> torch.Tensor:
        """x [B*bs, D] normed block rows (sequence-major); ring [max_seqs, win, hd]; last[b] = P."""
        cfg, a, bs, win = self.cfg, self.a, self.cfg.dspark_block_size, self.cfg.window_size
        rms, rope = kernels.get("rms_norm"), kernels.get("rope")
        T = x.shape[0]
        pos = torch.cat([torch.arange(P + 1, P + 1 + bs) for P in last])
        q = (rms(x @ a["wq_a.weight"].T, a["q_norm.weight"], cfg.norm_eps) @ a["wq_b.weight"].T).view(T, self.H, -1)
        if self.v4:  # V4 attention normalises every query head (parameter-free); V4.1 dropped it
            q = kernels.get("head_rms_norm")(q, cfg.norm_eps)
        q = rope(q, pos, self.inv_freq)
        kv = rope(rms(x @ a["wkv.weight"].T, a["kv_norm.weight"], cfg.norm_eps), pos, self.inv_freq)
        pool, idx, base = [], [], 0
        for b, (slot, P) in enumerate(zip(slots, last)):
            lo = max(0, P - win + 1)
            ring_kv = ring[slot, torch.arange(lo, P + 1) % win]  # the last `win` target positions <= P
            n = ring_kv.shape[0]
            pool += [ring_kv, kv[b * bs : (b + 1) * bs]]
            idx.append((base + torch.arange(n + bs)).expand(bs, -1))  # every query sees all of them
            base += n + bs
        width = max(t.shape[1] for t in idx)
        idx = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in idx])
        o = kernels.get("sparse_attn_sink")(q, torch.cat(pool), a["attn_sink"], idx, cfg.head_dim**-0.5)
        o = rope(o, pos, self.inv_freq, inverse=True)
        G = a["wo_a.weight"].shape[0] // cfg.o_lora_rank
        z = torch.einsum("tgd,grd->tgr", o.reshape(T, G, -1), a["wo_a.weight"].view(G, cfg.o_lora_rank, -1))
        return z.flatten(1) @ a["wo_b.weight"].T

    def __call__(self, x, pre_mix, ring, slots, last, ids):
        """x [B*bs, hc, D] -> (x, the pre mix for the next collapse: V4.1 deferred; None on V4)."""
        if self.v4:
            return self._v4_block(x, ring, slots, last, ids), None
        rms, collapse, post_fn, eps = kernels.get("rms_norm"), kernels.get("hc_collapse"), kernels.get("hc_post"), \
            self.cfg.norm_eps
        attn_pre, post, comb = self._mixes(x, "attn")
        y = rms(collapse(x, pre_mix), self.p["attn_norm.weight"], eps)
        x = post_fn(self.attention(y, ring, slots, last), x, post, comb)
        ffn_pre, post, comb = self._mixes(x, "ffn")
        y = rms(collapse(x, attn_pre), self.p["ffn_norm.weight"], eps)
        x = post_fn(self.ffn(y), x, post, comb)
        return x, ffn_pre

    def _v4_block(self, x, ring, slots, last, ids):
        """V4's Block: each sublayer collapses its own input with the pre mix computed from it."""
        rms, collapse, post_fn, eps = kernels.get("rms_norm"), kernels.get("hc_collapse"), kernels.get("hc_post"), \
            self.cfg.norm_eps
        pre, post, comb = self._mixes(x, "attn")
        y = rms(collapse(x, pre), self.p["attn_norm.weight"], eps)
        x = post_fn(self.attention(y, ring, slots, last), x, post, comb)
        pre, post, comb = self._mixes(x, "ffn")
        y = rms(collapse(x, pre), self.p["ffn_norm.weight"], eps)
        return post_fn(self.ffn(y, ids), x, post, comb)


class DSpark:
    """All DSpark stages over `DSparkCache`; `target_params` supplies the shared embed and head."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], target_params: dict[str, torch.Tensor],
                 cache: DSparkCache, numerics: str = "exact") -> None:
        if not cfg.dspark_block_size:
            raise ValueError("the checkpoint has no DSpark stages (dspark_block_size = 0)")
        if numerics != "exact":
            raise NotImplementedError(f"the DSpark drafter runs exact numerics only, not {numerics!r}")
        targets = cfg.dspark_target_layer_ids
        if not targets or any(not 0 <= t < cfg.n_layers for t in targets) or list(targets) != sorted(set(targets)):
            raise ValueError(f"dspark_target_layer_ids {list(targets)} must be ascending distinct backbone layers "
                             f"0..{cfg.n_layers - 1}")
        if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
            raise ValueError(f"dspark_noise_token_id {cfg.dspark_noise_token_id} is outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
        self.cfg, self.p, self.cache = cfg, params, cache
        self.stages = [_Stage(i, params, cfg) for i in range(cfg.n_mtp_layers)]
        first, last = "mtp.0.", f"mtp.{cfg.n_mtp_layers - 1}."
        self.main_proj, self.main_norm = params[first + "main_proj.weight"], params[first + "main_norm.weight"]
        self.norm = params[last + "norm.weight"]
        # the Markov head's two [V, rank] tables: V4.1 names them embed/head, V4-Flash-0731 markov_w1/markov_w2
        w_in, w_out = ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2")
        self.markov_embed = params[f"{last}markov_head.{w_in}.weight"]  # token -> rank
        self.markov_head = params[f"{last}markov_head.{w_out}.weight"]  # rank -> vocab
        self.hc_head = None if cfg.is_v41 else [params[f"{last}hc_head_{n}"] for n in ("fn", "scale", "base")]
        self.confidence = params[last + "confidence_head.proj.weight"]  # [1, D + rank]
        self.embed, self.head = target_params["embed.weight"], target_params["head.weight"]

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm")(main_hidden @ self.main_proj.T, self.main_norm, self.cfg.norm_eps)

    def seed(self, slot: int, start: int, main_hidden: torch.Tensor) -> None:
        """Write target positions [start, start + n) of one sequence into every stage's ring."""
        n, win = main_hidden.shape[0], self.cfg.window_size
        keep = max(0, n - win)  # only the last `win` positions survive in the ring
        positions = torch.arange(start + keep, start + n)
        main_x = self.main_x(main_hidden[keep:])
        for st in self.stages:
            self.cache.layers[st.layer].ring[slot, positions % win] = st.window_kv(main_x, positions)

    def draft(self, slots: list[int], last: list[int], last_tokens: list[int]) -> DraftBlock:
        """One draft block per sequence at target position last[b] (seeded), led by last_tokens[b]."""
        cfg, bs = self.cfg, self.cfg.dspark_block_size
        B = len(slots)
        ids = torch.full((B, bs), cfg.dspark_noise_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor(last_tokens)
        x = self.embed[ids.flatten()].unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [B*bs, hc, D]
        pre_mix = torch.zeros(B * bs, cfg.hc_mult, dtype=x.dtype)
        pre_mix[:, 0] = 1.0
        for st in self.stages:
            x, pre_mix = st(x, pre_mix, self.cache.layers[st.layer].ring, slots, last, ids.flatten())
        if self.hc_head is not None:  # V4: the learned collapse of the last stage (V4's head collapse)
            fn, scale, base = self.hc_head
            pre_mix = torch.sigmoid(kernels.get("hc_mix")(x, fn, cfg.norm_eps) * scale + base) + cfg.hc_eps
        y = kernels.get("hc_collapse")(x, pre_mix)  # [B*bs, D]
        logits = (kernels.get("rms_norm")(y, self.norm, cfg.norm_eps) @ self.head.T).view(B, bs, -1)
        out = ids[:, :1].clone()
        embeds = []
        for i in range(bs):  # row i is biased by the Markov head of token i, then sampled (greedy)
            m = self.markov_embed[out[:, i]]  # [B, rank]
            embeds.append(m)
            out = torch.cat([out, (logits[:, i] + m @ self.markov_head.T).argmax(-1, keepdim=True)], dim=1)
        conf = torch.cat([y.view(B, bs, -1), torch.stack(embeds, dim=1)], dim=-1) @ self.confidence.T
        return DraftBlock(out[:, 1:].tolist(), conf.squeeze(-1))
