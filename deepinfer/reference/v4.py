"""The DeepSeek-V4 oracle (family `v4`: V4-Flash, V4-Pro, V4-Flash-0731 backbone): embedding, blocks with
manifold-constrained hyper-connections, head collapse, norm, fp32 head, and the MTP block (spec §3).

Forward contract = the official one: `forward(ids [B,S], start_pos)`; start_pos 0 prefills S tokens and
resets the per-sequence state, start_pos > 0 takes exactly one token per sequence. Logits are fp32 (fp64
in exact numerics) for the last position, or every position with `all_logits=True` (the official code only
computes the last; computing more rows changes nothing else).

`tap(name, tensor)`, when set, receives the full 4-stream residual state after the embedding and after
every sublayer (`layers.{i}.attn`, `layers.{i}.ffn`) and the collapsed final hidden state — the state the
parity tools compare (never a sublayer output alone: with hc_mult=4 the residual lives in 4 streams).
"""
from __future__ import annotations

from typing import Callable

import torch

from deepinfer.config import ModelConfig
from deepinfer.reference import ops
from deepinfer.reference.attention import Attention, _sub
from deepinfer.reference.moe import MoE
from deepinfer.reference.numerics import Numerics

Tap = Callable[[str, torch.Tensor], None]


def hc_mix(x: torch.Tensor, fn: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """r-normalised projection of the flattened streams: (xf @ fn.T) * rsqrt(mean(xf^2) + eps)."""
    xf = x.flatten(2).to(num.acc)
    return (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def collapse(x: torch.Tensor, pre: torch.Tensor, num: Numerics) -> torch.Tensor:
    """round(sum_j pre_j * X_j) computed in fp32: [B,S,hc,D] -> [B,S,D]."""
    return num.round((pre.unsqueeze(-1) * x.to(num.acc)).sum(dim=2))


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, num: Numerics):
    """X'_k = round(post_k * F + sum_j comb[j,k] * R_j) (contraction over comb's FIRST index)."""
    acc = num.acc
    mixed = (comb.unsqueeze(-1) * residual.to(acc).unsqueeze(-2)).sum(dim=2)
    return num.round(post.unsqueeze(-1) * f.to(acc).unsqueeze(-2) + mixed)


class Block:
    def __init__(self, layer: int, params, cfg: ModelConfig, num: Numerics, max_batch: int, max_seq_len: int,
                 keep_stale_state: bool, shared_clamp: bool) -> None:
        self.layer = layer
        self.p = params
        self.cfg = cfg
        self.num = num
        self.attn = Attention(layer, _sub(params, "attn."), cfg, num, max_batch, max_seq_len, keep_stale_state)
        self.ffn = MoE(layer, _sub(params, "ffn."), cfg, num, shared_clamp)

    def _pre(self, x: torch.Tensor, which: str):
        cfg, p = self.cfg, self.p
        mixes = hc_mix(x, p[f"hc_{which}_fn"], cfg.norm_eps, self.num)
        pre, post, comb = ops.hc_split_sinkhorn(
            mixes, p[f"hc_{which}_scale"], p[f"hc_{which}_base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        )
        return collapse(x, pre, self.num), post, comb

    def __call__(self, x: torch.Tensor, start_pos: int, ids: torch.Tensor, tap: Tap | None, name: str):
        num, eps = self.num, self.cfg.norm_eps
        y, post, comb = self._pre(x, "attn")
        x = hc_post(self.attn(ops.rms_norm(y, self.p["attn_norm.weight"], eps, num), start_pos), x, post, comb, num)
        if tap:
            tap(f"{name}.attn", x)
        y, post, comb = self._pre(x, "ffn")
        x = hc_post(self.ffn(ops.rms_norm(y, self.p["ffn_norm.weight"], eps, num), ids), x, post, comb, num)
        if tap:
            tap(f"{name}.ffn", x)
        return x


def head_collapse(x: torch.Tensor, p: dict, prefix: str, cfg: ModelConfig, num: Numerics) -> torch.Tensor:
    """Learned 4->1 stream collapse before the head: pre = sigmoid(mix * scale + base) + hc_eps."""
    mixes = hc_mix(x, p[f"{prefix}hc_head_fn"], cfg.norm_eps, num)
    pre = torch.sigmoid(mixes * p[f"{prefix}hc_head_scale"] + p[f"{prefix}hc_head_base"]) + cfg.hc_eps
    return collapse(x, pre, num)


def check_forward_args(model, ids: torch.Tensor, start_pos: int) -> None:
    """The official forward contract, with clear errors: [B, S] ids in the vocabulary, B <= max_batch,
    positions within max_seq_len, and after the prefill exactly one token at the cached length."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [batch, seqlen], got shape {tuple(ids.shape)}")
    B, S = ids.shape
    if B > model.max_batch:
        raise ValueError(f"batch {B} exceeds max_batch {model.max_batch}")
    if S == 0:
        raise ValueError("empty input")
    if int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab_size:
        raise ValueError(f"token ids must be in [0, {model.cfg.vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    if start_pos + S > model.max_seq_len:
        raise ValueError(f"start_pos {start_pos} + {S} tokens exceeds max_seq_len {model.max_seq_len}")
    if start_pos > 0:
        if S != 1:
            raise ValueError("after the prefill the reference takes exactly one token per call")
        if start_pos != model.seq_len:
            raise ValueError(f"decode at start_pos {start_pos} but {model.seq_len} tokens are cached")



class V4Model:
    """The V4 oracle over contiguous per-sequence caches of `max_batch` x `max_seq_len`."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], num: Numerics, max_batch: int = 4,
                 max_seq_len: int = 4096, keep_stale_state: bool = False) -> None:
        if cfg.is_v41:
            raise ValueError("V4Model is the family v4 oracle; this checkpoint is v41")
        self.cfg, self.p, self.num = cfg, params, num
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        shared_clamp = num.revision == "current"  # spec §11: the initial release left the shared expert unclamped
        args = (cfg, num, max_batch, max_seq_len, keep_stale_state, shared_clamp)
        self.layers = [Block(i, _sub(params, f"layers.{i}."), *args) for i in range(cfg.n_layers)]
        self.mtp = [Block(layer, _sub(params, f"mtp.{i}."), *args) for i, layer in enumerate(cfg.mtp_layer_ids)]
        self.tap: Tap | None = None
        self.seq_len = 0  # tokens processed so far (same for every sequence of the batch)

    def _check(self, ids: torch.Tensor, start_pos: int) -> None:
        check_forward_args(self, ids, start_pos)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.p["embed.weight"][ids]

    def hidden(self, ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Run the backbone; returns the final 4-stream residual [B, S, hc, D]."""
        self._check(ids, start_pos)
        x = self.embed(ids).unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        if self.tap:
            self.tap("embed", x)
        for i, block in enumerate(self.layers):
            x = block(x, start_pos, ids, self.tap, f"layers.{i}")
        self.seq_len = start_pos + ids.shape[1]
        return x

    def logits_from_hidden(self, x: torch.Tensor, all_logits: bool = False, prefix: str = "",
                           norm: str = "norm.weight") -> torch.Tensor:
        y = head_collapse(x, self.p, prefix, self.cfg, self.num)
        y = ops.rms_norm(y, self.p[norm], self.cfg.norm_eps, self.num)
        if self.tap and not prefix:
            self.tap("final", y)
        rows = y if all_logits else y[:, -1]
        return self.num.flinear(rows, self.p["head.weight"])

    def forward(self, ids: torch.Tensor, start_pos: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] for the last position (or [B, S, V] with all_logits)."""
        return self.logits_from_hidden(self.hidden(ids, start_pos), all_logits)

    __call__ = forward

    def mtp_forward(self, hidden: torch.Tensor, ids: torch.Tensor, start_pos: int, stage: int = 0,
                    all_logits: bool = False) -> torch.Tensor:
        """MTP stage `stage` on a 4-stream hidden state [B,S,hc,D] and the ids it is conditioned on (spec §3.11).

        The official code has no caller, so which hidden state and which token shift feed it is the
        caller's choice (settled in the speculative-decoding work); the block math here is the official one.
        """
        num, cfg = self.num, self.cfg
        p = f"mtp.{stage}."
        e = ops.rms_norm(self.embed(ids), self.p[p + "enorm.weight"], cfg.norm_eps, num)
        h = ops.rms_norm(hidden, self.p[p + "hnorm.weight"], cfg.norm_eps, num)
        x = num.round(num.qlinear(e, self.p[p + "e_proj.weight"]).unsqueeze(2) + num.qlinear(h, self.p[p + "h_proj.weight"]))
        x = self.mtp[stage](x, start_pos, ids, None, f"mtp.{stage}")
        return self.logits_from_hidden(x, all_logits, prefix=p, norm=p + "norm.weight")
