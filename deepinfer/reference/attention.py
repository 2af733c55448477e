"""V4 attention of the reference: low-rank q, single-head latent KV with a window ring, compressed KV,
the lightning indexer, sparse attention with the sink, grouped low-rank output (spec §3.5, §3.7).

Owns: the per-layer contiguous caches of the official forward contract (prefill at start_pos 0 of S
tokens, then exactly one token per call) and the order of operations inside a call (the indexer and its
compressor run before the window write and the main compressor).
"""
from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.reference import ops
from deepinfer.reference.compressor import Compressor
from deepinfer.reference.numerics import Numerics


def _sub(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ties broken toward the LOWER position.

    relu makes exact ties common (an entry that no head likes scores exactly 0, and bf16 scores collide),
    and torch.topk breaks ties by an implementation detail that depends on the tensor's length — so the
    same query would pick different entries in a prefill of S and of S+1 tokens. A stable descending sort
    fixes one answer; the engine must use the same rule. (The official GPU topk's tie order is undefined.)
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class Indexer:
    """Scores compressed entries for each query and returns the top-k as attention indices (ratio-4 layers)."""

    def __init__(self, params, cfg: ModelConfig, freqs, num: Numerics, max_batch: int, max_seq_len: int,
                 keep_stale_state: bool) -> None:
        self.p = params
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rd = cfg.rope_head_dim
        self.topk = cfg.index_topk
        self.ratio = 4
        self.freqs = freqs
        self.num = num
        self.cache = torch.zeros(max_batch, max_seq_len // 4, self.head_dim, dtype=num.act)
        self.compressor = Compressor(
            _sub(params, "compressor."), 4, self.head_dim, self.rd, cfg.norm_eps, True, self.cache, freqs, num,
            max_batch, cfg.kv_quant_block, keep_stale_state,
        )

    def __call__(self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, offset: int) -> torch.Tensor:
        B, S, _ = x.shape
        num, r = self.num, self.ratio
        end = start_pos + S
        q = num.qlinear(qr, self.p["wq_b.weight"]).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.apply_rope(q, self.freqs[start_pos:end], num)
        q = num.fp4(ops.hadamard(q, num), 32)
        self.compressor(x, start_pos)
        weights = num.blinear(x, self.p["weights_proj.weight"])
        weights = num.round(weights * (self.head_dim**-0.5 * self.n_heads**-0.5))
        keys = self.cache[:B, : end // r]
        # bf16 einsum -> bf16 scores, relu, bf16 multiply by weights, bf16 sum over heads
        scores = num.round(torch.einsum("bshd,btd->bsht", q.to(num.acc), keys.to(num.acc)))
        scores = num.round(scores.relu() * weights.unsqueeze(-1))
        scores = num.round(scores.to(num.acc).sum(dim=2))  # [B, S, E]
        if start_pos == 0:
            hidden = torch.arange(S // r).repeat(S, 1) >= (torch.arange(1, S + 1) // r).unsqueeze(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        top = stable_topk(scores, min(self.topk, end // r))
        if start_pos == 0:
            hidden = top >= (torch.arange(1, S + 1) // r).unsqueeze(1)
            return torch.where(hidden, -1, top + offset)
        return top + offset


class Attention:
    def __init__(self, layer: int, params, cfg: ModelConfig, num: Numerics, max_batch: int, max_seq_len: int,
                 keep_stale_state: bool) -> None:
        self.layer = layer
        self.p = params
        self.cfg = cfg
        self.num = num
        self.ratio = cfg.compress_ratios[layer]
        self.win = cfg.window_size
        self.H, self.hd, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.eps = cfg.norm_eps
        original = cfg.original_seq_len if self.ratio else 0  # window-only layers: no YaRN
        self.freqs = ops.rope_table(
            self.rd, max_seq_len, original, cfg.rope_base(layer), cfg.rope_factor, cfg.beta_fast, cfg.beta_slow,
            num.exact,
        )
        entries = max_seq_len // self.ratio if self.ratio else 0
        self.kv_cache = torch.zeros(max_batch, self.win + entries, self.hd, dtype=num.act)
        self.compressor = None
        self.indexer = None
        if self.ratio:
            self.compressor = Compressor(
                _sub(params, "compressor."), self.ratio, self.hd, self.rd, self.eps, False,
                self.kv_cache[:, self.win :], self.freqs, num, max_batch, cfg.kv_quant_block, keep_stale_state,
            )
            if self.ratio == 4:
                self.indexer = Indexer(_sub(params, "indexer."), cfg, self.freqs, num, max_batch, max_seq_len,
                                       keep_stale_state)

    def _fake_quant_kv(self, kv: torch.Tensor) -> torch.Tensor:
        nope = self.hd - self.rd
        return torch.cat([self.num.kv_fp8(kv[..., :nope], self.cfg.kv_quant_block), kv[..., nope:]], dim=-1)

    def __call__(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        B, S, _ = x.shape
        num, p, win, r = self.num, self.p, self.win, self.ratio
        freqs = self.freqs[start_pos : start_pos + S]
        qr = ops.rms_norm(num.qlinear(x, p["wq_a.weight"]), p["q_norm.weight"], self.eps, num)
        q = num.qlinear(qr, p["wq_b.weight"]).unflatten(-1, (self.H, self.hd))
        q = ops.head_rms_norm(q, self.eps, num)
        q = ops.apply_rope(q, freqs, num)
        kv = ops.rms_norm(num.qlinear(x, p["wkv.weight"]), p["kv_norm.weight"], self.eps, num)
        kv = self._fake_quant_kv(ops.apply_rope(kv, freqs, num))
        idx = ops.window_indices(win, B, S, start_pos)
        if r:
            offset = S if start_pos == 0 else win
            if self.indexer is not None:
                cidx = self.indexer(x, qr, start_pos, offset)
            else:
                cidx = ops.compressed_indices(r, B, S, start_pos, offset)
            idx = torch.cat([idx, cidx], dim=-1)
        if start_pos == 0:
            if S <= win:
                self.kv_cache[:B, :S] = kv
            else:  # keep the last `win` tokens, token p in slot p % win
                cut = S % win
                tail = kv[:, -win:]
                self.kv_cache[:B, cut:win] = tail[:, : win - cut]
                self.kv_cache[:B, :cut] = tail[:, win - cut :]
            attend = kv
            if r:
                entries = self.compressor(x, start_pos)
                if entries is not None:
                    attend = torch.cat([kv, entries], dim=1)
        else:
            if S != 1:
                raise ValueError("the reference decodes one token per call (official forward contract)")
            self.kv_cache[:B, start_pos % win] = kv[:, 0]
            if r:
                self.compressor(x, start_pos)
            attend = self.kv_cache[:B]
        o = ops.sparse_attn(q, attend, p["attn_sink"], idx, self.hd**-0.5, num)
        o = ops.apply_rope(o, freqs, num, inverse=True)
        G = self.cfg.o_groups
        o = o.reshape(B, S, G, -1)
        wo_a = p["wo_a.weight"].view(G, self.cfg.o_lora_rank, -1)
        z = num.round(torch.einsum("bsgd,grd->bsgr", o.to(num.acc), wo_a))  # bf16 einsum in the official code
        return num.qlinear(z.flatten(2), p["wo_b.weight"])
