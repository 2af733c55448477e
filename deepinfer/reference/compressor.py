"""V4 KV compressor: gated per-channel softmax pooling of `ratio` tokens into one cache entry (spec §3.6).

Owns: the pooling math (overlapping for ratio 4, plain for ratio 128), the partial-block state carried
between calls (prefill at start_pos 0, then one token per decode call), and the post-processing of an
entry (bf16, RMSNorm, RoPE at the block's first position, Hadamard + FP4 or FP8 fake-quant) and its write
into the owner's cache.

Reference quirk (listed in `reference/quirks.py`): the official module never resets its state between
sequences. By default this oracle resets it at every prefill (start_pos 0), which is what a fresh model
does; `quirks="official"` keeps stale state like the official code.
"""
from __future__ import annotations

import torch

from deepinfer.reference import ops
from deepinfer.reference.numerics import Numerics


class Compressor:
    def __init__(
        self, params: dict[str, torch.Tensor], ratio: int, head_dim: int, rope_dim: int, norm_eps: float,
        rotate: bool, cache: torch.Tensor, freqs: torch.Tensor, num: Numerics, max_batch: int,
        kv_quant_block: int, keep_stale_state: bool,
    ) -> None:
        self.p = params  # ape [r, c*d], wkv.weight [c*d, D], wgate.weight [c*d, D], norm.weight [d]
        self.ratio, self.d, self.rd = ratio, head_dim, rope_dim
        self.overlap = ratio == 4
        self.rotate = rotate
        self.eps = norm_eps
        self.cache = cache  # [B, max_entries, d] view into the owner's cache
        self.freqs = freqs
        self.num = num
        self.kv_quant_block = kv_quant_block
        self.keep_stale_state = keep_stale_state
        c = 2 if self.overlap else 1
        self.kv_state = torch.zeros(max_batch, c * ratio, c * head_dim, dtype=num.acc)
        self.score_state = torch.full((max_batch, c * ratio, c * head_dim), float("-inf"), dtype=num.acc)

    def _overlap_blocks(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """[B, n, r, 2d] -> [B, n, 2r, d]: previous block's A-half rows then this block's B-half rows."""
        B, n, r, _ = t.shape
        d = self.d
        out = t.new_full((B, n, 2 * r, d), fill)
        out[:, :, r:] = t[:, :, :, d:]
        out[:, 1:, :r] = t[:, :-1, :, :d]
        return out

    def __call__(self, x: torch.Tensor, start_pos: int) -> torch.Tensor | None:
        """x [B, S, D] (activation dtype). Returns new entries [B, n, d] or None; writes them to the cache."""
        B, S, _ = x.shape
        r, d, num = self.ratio, self.d, self.num
        ape = self.p["ape"]
        kv = num.flinear(x, self.p["wkv.weight"])  # [B, S, c*d] fp32 (fp64 exact)
        score = num.flinear(x, self.p["wgate.weight"])
        if start_pos == 0:
            if not self.keep_stale_state:
                self.kv_state[:B].zero_()
                self.score_state[:B].fill_(float("-inf"))
            remainder = S % r
            cutoff = S - remainder
            ready = S >= r
            row0 = r if self.overlap else 0
            if self.overlap and cutoff >= r:
                self.kv_state[:B, :r] = kv[:, cutoff - r : cutoff]
                self.score_state[:B, :r] = score[:, cutoff - r : cutoff] + ape
            if remainder:
                self.kv_state[:B, row0 : row0 + remainder] = kv[:, cutoff:]
                self.score_state[:B, row0 : row0 + remainder] = score[:, cutoff:] + ape[:remainder]
            kv_b = kv[:, :cutoff].unflatten(1, (-1, r))
            score_b = score[:, :cutoff].unflatten(1, (-1, r)) + ape
            if self.overlap:
                kv_b = self._overlap_blocks(kv_b, 0.0)
                score_b = self._overlap_blocks(score_b, float("-inf"))
            pooled = (kv_b * score_b.softmax(dim=2)).sum(dim=2)  # [B, n, d]
        else:
            if S != 1:
                raise ValueError("the reference decodes one token per call (official forward contract)")
            ready = (start_pos + 1) % r == 0
            score = score + ape[start_pos % r]
            if self.overlap:
                row = r + start_pos % r
                self.kv_state[:B, row] = kv[:, 0]
                self.score_state[:B, row] = score[:, 0]
                if ready:
                    kv_s = torch.cat([self.kv_state[:B, :r, :d], self.kv_state[:B, r:, d:]], dim=1)
                    sc_s = torch.cat([self.score_state[:B, :r, :d], self.score_state[:B, r:, d:]], dim=1)
                    pooled = (kv_s * sc_s.softmax(dim=1)).sum(dim=1, keepdim=True)
                    self.kv_state[:B, :r] = self.kv_state[:B, r:].clone()
                    self.score_state[:B, :r] = self.score_state[:B, r:].clone()
            else:
                self.kv_state[:B, start_pos % r] = kv[:, 0]
                self.score_state[:B, start_pos % r] = score[:, 0]
                if ready:
                    pooled = (self.kv_state[:B] * self.score_state[:B].softmax(dim=1)).sum(dim=1, keepdim=True)
        if not ready:
            return None
        entry = ops.rms_norm(num.round(pooled), self.p["norm.weight"], self.eps, num)
        if start_pos == 0:
            freqs = self.freqs[0:cutoff:r]
        else:
            freqs = self.freqs[start_pos + 1 - r].unsqueeze(0)
        entry = ops.apply_rope(entry, freqs, num)
        if self.rotate:  # indexer keys: Hadamard then FP4 (E2M1, pow2 scale per 32)
            entry = num.fp4(ops.hadamard(entry, num), 32)
        else:  # attention entries: FP8 fake-quant of the nope channels in blocks of 64
            nope = self.d - self.rd
            entry = torch.cat([num.kv_fp8(entry[..., :nope], self.kv_quant_block), entry[..., nope:]], dim=-1)
        if start_pos == 0:
            self.cache[:B, : S // r] = entry
        else:
            self.cache[:B, start_pos // r] = entry[:, 0]
        return entry
