"""V4.1-Flash attention of the reference (spec §10.3): no per-head q norm, FP8 fake-quant of the whole
window KV per 32, cross-layer sharing of compressed KV and top-k indices, an indexer with its own key
projection (wk/k_norm, no Hadamard), the two-level candidate-block filter, FP4 latents with E4M3 scales.

Read in the official V4.1 `inference/model.py` (HF revision dba1be0a, vendored byte-identical in
tenstorrent/tt-metal `models/demos/deepseek_v3_d_p/reference/deepseek_v41/model.py`):
`Attention._window_kv/_compress_kv/_compress_topk_idxs/forward`, `Compressor`, `Indexer`,
`select_candidate_blocks`, `get_window_topk_idxs`. V4.1 has NO per-head q RMS norm (spec §12 q2): the
official `Attention.forward` goes q_norm(wq_a(x)) -> wq_b -> RoPE and nothing else.

Sharing: the official code passes compress_kv / index_k / topk_idxs / candidates through one process-
global object written by source layers before consumers read it. Here a `SharedAttention` per model
does the same, and also keeps every owner's key cache by layer so the intended behaviour (each layer
scores against its own kv-source's keys) and the official quirk (it scores against whichever owner
published last; see quirks.py) are both available.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config import ModelConfig
from deepinfer.reference import ops
from deepinfer.reference.attention import _sub, stable_topk
from deepinfer.reference.numerics import Numerics


@dataclass
class SharedAttention:
    compress_kv: torch.Tensor | None = None  # last kv source's compressed cache (published every call)
    index_k: torch.Tensor | None = None  # last PUBLISHED index-key cache (official quirk)
    topk_idxs: torch.Tensor | None = None  # last index source's indices
    candidates: torch.Tensor | None = None  # candidate-block mask of the candidate source
    key_caches: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source layer -> its key cache


def window_indices_v41(window: int, batch: int, seqlen: int, start_pos: int) -> torch.Tensor:
    """V4.1 window pattern: prefill as V4; decode lists the ring oldest first with unfilled slots -1."""
    if start_pos == 0:
        return ops.window_indices(window, batch, seqlen, 0)
    oldest = start_pos % window + 1
    idx = torch.cat([torch.arange(oldest, window), torch.arange(oldest)])
    idx = torch.where(idx > start_pos, -1, idx)
    return idx.view(1, 1, -1).expand(batch, 1, -1)


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor | int, top_blocks: int, block: int):
    """Level one of the two-level top-k: a position mask keeping each query's best `top_blocks` blocks.

    Block score = max over its positions (-inf padded); the block holding the newest visible position is
    always kept (it is partly filled and could lose to an older full block); blocks with no reachable
    position are never kept. Ties between blocks go to the lower block (as in `stable_topk`).
    """
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    n_blocks = block_scores.shape[-1]
    newest = (torch.as_tensor(visible) - 1) // block
    block_scores = block_scores.masked_fill(torch.arange(n_blocks) == newest, float("inf"))
    k = min(top_blocks, n_blocks)
    chosen = stable_topk(block_scores, k)
    reachable = block_scores.gather(-1, chosen) > float("-inf")
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter(-1, chosen, reachable)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


class V41Compressor:
    """Ratio 1: latent = norm(wkv(x)) per token. Ratio 2: gated softmax pooling of 2 tokens (no overlap,
    no ape). Returns the normalised latent BEFORE RoPE (the indexer needs it unrotated) or None."""

    def __init__(self, params, ratio: int, cfg: ModelConfig, num: Numerics, max_batch: int,
                 keep_stale_state: bool) -> None:
        self.p, self.ratio, self.num, self.eps = params, ratio, num, cfg.norm_eps
        self.keep_stale_state = keep_stale_state
        if ratio > 1:
            self.kv_state = torch.zeros(max_batch, ratio, cfg.head_dim, dtype=num.acc)
            self.score_state = torch.full((max_batch, ratio, cfg.head_dim), float("-inf"), dtype=num.acc)

    def __call__(self, x: torch.Tensor, start_pos: int) -> torch.Tensor | None:
        B, S, _ = x.shape
        r, num = self.ratio, self.num
        if r == 1:  # a plain bf16 projection, no pooling and no fp32
            return ops.rms_norm(num.blinear(x, self.p["wkv.weight"]), self.p["norm.weight"], self.eps, num)
        kv, score = num.flinear(x, self.p["wkv.weight"]), num.flinear(x, self.p["wgate.weight"])
        if start_pos == 0:
            if not self.keep_stale_state:
                self.kv_state[:B].zero_()
                self.score_state[:B].fill_(float("-inf"))
            rem = S % r
            cut = S - rem
            ready = S >= r
            if rem:
                self.kv_state[:B, :rem] = kv[:, cut:]
                self.score_state[:B, :rem] = score[:, cut:]
            pooled = (kv[:, :cut].unflatten(1, (-1, r)) * score[:, :cut].unflatten(1, (-1, r)).softmax(dim=2)).sum(2)
        else:
            ready = (start_pos + 1) % r == 0
            self.kv_state[:B, start_pos % r] = kv[:, 0]
            self.score_state[:B, start_pos % r] = score[:, 0]
            if ready:
                pooled = (self.kv_state[:B] * self.score_state[:B].softmax(dim=1)).sum(dim=1, keepdim=True)
        if not ready:
            return None
        return ops.rms_norm(num.round(pooled), self.p["norm.weight"], self.eps, num)


def _group_freqs(freqs: torch.Tensor, seqlen: int, start_pos: int, ratio: int) -> torch.Tensor:
    """A compressed entry stands for the first token of its group: positions j*ratio (decode P+1-ratio)."""
    if start_pos == 0:
        return freqs[: seqlen - seqlen % ratio : ratio]
    return freqs[start_pos + 1 - ratio].unsqueeze(0)


class V41Indexer:
    def __init__(self, layer: int, params, cfg: ModelConfig, num: Numerics, freqs: torch.Tensor,
                 shared: SharedAttention, max_batch: int, max_seq_len: int, official_quirk: bool) -> None:
        self.layer, self.p, self.cfg, self.num, self.freqs, self.shared = layer, params, cfg, num, freqs, shared
        self.ratio = cfg.compress_ratios[layer]
        self.owns_k = layer in cfg.kv_source_layers
        self.key_owner = cfg.kv_source_of(layer)
        self.is_candidate_source = layer == cfg.candidate_source_layer
        self.uses_candidates = 0 <= cfg.candidate_source_layer < layer
        self.official_quirk = official_quirk
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        if self.owns_k:
            self.k_cache = torch.zeros(max_batch, max_seq_len // self.ratio, self.head_dim, dtype=num.act)
            shared.key_caches[layer] = self.k_cache

    def __call__(self, x, qr, latent, start_pos: int, offset: int) -> torch.Tensor:
        B, S, _ = x.shape
        num, r, end = self.num, self.ratio, start_pos + S
        if self.owns_k and latent is not None:
            k = ops.rms_norm(num.blinear(latent, self.p["wk.weight"]), self.p["k_norm.weight"], self.cfg.norm_eps, num)
            k = num.fp4(ops.apply_rope(k, _group_freqs(self.freqs, S, start_pos, r), num), 32)
            self.k_cache[:B, start_pos // r : start_pos // r + k.shape[1]] = k
            self.shared.index_k = self.k_cache  # published only when a new entry exists (the quirk)
        q = num.qlinear(qr, self.p["wq_b.weight"]).unflatten(-1, (self.n_heads, self.head_dim))
        q = num.fp4(ops.apply_rope(q, self.freqs[start_pos:end], num), 32)
        keys_cache = self.shared.index_k if self.official_quirk else self.shared.key_caches[self.key_owner]
        keys = keys_cache[:B, : end // r]
        weights = num.round(num.blinear(x, self.p["weights_proj.weight"]) * (self.head_dim**-0.5 * self.n_heads**-0.5))
        scores = num.round(torch.einsum("bshd,btd->bsht", q.to(num.acc), keys.to(num.acc)))
        scores = num.round(num.round(scores.relu() * weights.unsqueeze(-1)).to(num.acc).sum(dim=2))
        if start_pos == 0:
            visible = (torch.arange(1, S + 1) // r).unsqueeze(-1)
            scores = scores.masked_fill(torch.arange(S // r) >= visible, float("-inf"))
        else:
            visible = end // r
        if self.is_candidate_source:
            self.shared.candidates = select_candidate_blocks(
                scores, visible, self.cfg.candidate_topk_blocks, self.cfg.candidate_block_size)
        elif self.uses_candidates:
            scores = scores.masked_fill(~self.shared.candidates, float("-inf"))
        top = stable_topk(scores, min(self.cfg.index_topk, end // r)).sort(dim=-1).values  # position order
        return torch.where(top < torch.as_tensor(visible), top + offset, -1)


class V41Attention:
    def __init__(self, layer: int, params, cfg: ModelConfig, num: Numerics, shared: SharedAttention,
                 max_batch: int, max_seq_len: int, quirks_official: bool, backbone: bool = True) -> None:
        self.layer, self.p, self.cfg, self.num, self.shared = layer, params, cfg, num, shared
        self.ratio = cfg.compress_ratios[layer]
        self.win, self.H, self.hd, self.rd = cfg.window_size, cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        original = cfg.original_seq_len if self.ratio else 0
        self.freqs = ops.rope_table(self.rd, max_seq_len, original, cfg.rope_base(layer), cfg.rope_factor,
                                    cfg.beta_fast, cfg.beta_slow, num.exact)
        self.window_cache = torch.zeros(max_batch, self.win, self.hd, dtype=num.act)
        self.is_kv_source = backbone and layer in cfg.kv_source_layers
        self.is_index_source = backbone and layer in cfg.index_source_layers
        self.compressor = self.indexer = None
        if self.is_kv_source:
            self.compressor = V41Compressor(_sub(params, "compressor."), self.ratio, cfg, num, max_batch,
                                            quirks_official)
            self.compress_cache = torch.zeros(max_batch, max_seq_len // self.ratio, self.hd, dtype=num.act)
        if self.is_index_source:
            self.indexer = V41Indexer(layer, _sub(params, "indexer."), cfg, num, self.freqs, shared, max_batch,
                                      max_seq_len, quirks_official)

    def _window(self, x: torch.Tensor, freqs: torch.Tensor, start_pos: int):
        B, S, _ = x.shape
        num, win = self.num, self.win
        kv = ops.rms_norm(num.qlinear(x, self.p["wkv.weight"]), self.p["kv_norm.weight"], self.cfg.norm_eps, num)
        kv = num.kv_fp8(ops.apply_rope(kv, freqs, num), self.cfg.kv_quant_block, revision_dependent=False)
        if start_pos == 0:
            if S <= win:
                self.window_cache[:B, :S] = kv
            else:
                cut = S % win
                tail = kv[:, -win:]
                self.window_cache[:B, cut:win] = tail[:, : win - cut]
                self.window_cache[:B, :cut] = tail[:, win - cut :]
            window_kv = kv
        else:
            self.window_cache[:B, start_pos % win] = kv[:, 0]
            window_kv = self.window_cache[:B]
        return window_kv, window_indices_v41(win, B, S, start_pos)

    def _compressed(self, x, qr, start_pos: int, offset: int):
        B, S, _ = x.shape
        r, num, shared = self.ratio, self.num, self.shared
        compress_len = (start_pos + S) // r
        latent = None
        if self.is_kv_source:
            latent = self.compressor(x, start_pos)
            shared.compress_kv = self.compress_cache  # published on every call, unlike index keys
        if not self.is_index_source:
            idx = shared.topk_idxs
        elif compress_len == 0:
            idx = torch.empty(B, S, 0, dtype=torch.long)
        else:
            idx = self.indexer(x, qr, latent, start_pos, offset)
        if self.is_index_source:
            shared.topk_idxs = idx
        if latent is not None:
            latent = ops.apply_rope(latent, _group_freqs(self.freqs, S, start_pos, r), num)
            latent = num.fp4(latent, 16, e4m3_scale=True)  # all channels, E4M3 scale per 16
            self.compress_cache[:B, start_pos // r : start_pos // r + latent.shape[1]] = latent
        return shared.compress_kv[:B, :compress_len], idx

    def __call__(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        B, S, _ = x.shape
        num, p = self.num, self.p
        if start_pos > 0 and S != 1:
            raise ValueError("the reference decodes one token per call (official forward contract)")
        freqs = self.freqs[start_pos : start_pos + S]
        qr = ops.rms_norm(num.qlinear(x, p["wq_a.weight"]), p["q_norm.weight"], self.cfg.norm_eps, num)
        q = ops.apply_rope(num.qlinear(qr, p["wq_b.weight"]).unflatten(-1, (self.H, self.hd)), freqs, num)
        kv, idx = self._window(x, freqs, start_pos)
        if self.ratio:
            ckv, cidx = self._compressed(x, qr, start_pos, kv.shape[1])
            kv = torch.cat([kv, ckv], dim=1)
            idx = torch.cat([idx, cidx], dim=-1)
        o = ops.sparse_attn(q, kv, p["attn_sink"], idx, self.hd**-0.5, num, finite_init=True)
        o = ops.apply_rope(o, freqs, num, inverse=True)
        G = self.cfg.o_groups
        wo_a = p["wo_a.weight"].view(G, self.cfg.o_lora_rank, -1)
        z = num.round(torch.einsum("bsgd,grd->bsgr", o.reshape(B, S, G, -1).to(num.acc), wo_a))
        return num.qlinear(z.flatten(2), p["wo_b.weight"])
