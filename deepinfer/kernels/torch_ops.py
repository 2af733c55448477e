"""Torch versions of the engine's ops (exact numerics: the caller passes float64 tensors).

Owns: the math of each op on flat token-major tensors ([num_tokens, ...], varlen batches already
flattened): RMSNorm, YaRN RoPE tables and the interleaved rotation, Hadamard, hc mixing and the
Sinkhorn split, compressor pooling, indexer scores + stable top-k, sparse attention with the sink,
the clamped SwiGLU. Must not: hold state, know about sequences, caches or the reference oracle.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = [
    "rms_norm", "head_rms_norm", "rope_inv_freq", "rope", "hadamard", "hc_mix", "hc_split_sinkhorn",
    "hc_collapse", "hc_post", "compress_pool", "indexer_scores", "stable_topk", "topk_positions", "sparse_attn_sink", "swiglu",
    "greedy_sample",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim (weight None: parameter-free, V4 q heads)."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, None, eps)


@lru_cache(maxsize=32)
def rope_inv_freq(rope_dim: int, original_seq_len: int, base: float, factor: float, beta_fast: int,
                  beta_slow: int) -> torch.Tensor:
    """Per-pair angular frequency [rope_dim/2] float64, YaRN-interpolated when original_seq_len > 0.

    No mscale (the official code applies none). Angles are computed on demand as position * freq so the
    table never bounds the sequence length.
    """
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    if original_seq_len > 0:
        def corr_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST 2*len(inv_freq) channels of x as interleaved (re, im) pairs; returns a new tensor.

    x [T, ..., d]; positions [T] int. inverse=True rotates by -angle (the V4 output de-rotation).
    """
    rd = inv_freq.shape[0] * 2
    angles = torch.outer(positions.to(torch.float64), inv_freq)  # [T, rd/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    if inverse:
        sin = -sin
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [rd // 2]
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -rd:].unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


@lru_cache(maxsize=4)
def _hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix in natural order, H[i,j] = (-1)^popcount(i & j), float64 [n, n]."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H * d^-0.5 over the last dim (the indexer's rotation; math, so exact mode keeps it)."""
    d = x.shape[-1]
    return (x @ _hadamard_matrix(d).to(x.device, x.dtype)) * d**-0.5


def hc_mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hc, D] -> r-normalised projection of the flattened streams [T, n_out]."""
    xf = x.flatten(1)
    return (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (Sinkhorn-normalised)."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[:, 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)  # the first pass normalises columns only
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j * X_j: [T, hc, D], [T, hc] -> [T, D]."""
    return (pre.unsqueeze(-1) * x).sum(dim=1)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * F + sum_j comb[j, k] * R_j (contraction over comb's FIRST index) -> [T, hc, D]."""
    mixed = (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(dim=1)
    return post.unsqueeze(-1) * f.unsqueeze(-2) + mixed


def compress_pool(kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Gated softmax pooling of complete blocks into entries.

    overlap=False: kv, score [n, r, d] -> [n, d] (softmax over the r rows per channel).
    overlap=True:  kv, score [n+1, r, 2d], block 0 being the block BEFORE the first one to pool:
      entry k pools the previous block's A-half (channels :d) and block k's B-half (channels d:) -> [n, d].
    `score` already includes the absolute-position embedding ape[pos % r].
    """
    if overlap:
        d = kv.shape[-1] // 2
        kv = torch.cat([kv[:-1, :, :d], kv[1:, :, d:]], dim=1)  # [n, 2r, d]
        score = torch.cat([score[:-1, :, :d], score[1:, :, d:]], dim=1)
    return (kv * score.softmax(dim=1)).sum(dim=1)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_h weights[t,h] * relu(q[t,h] . keys[j]): q [T, h, d], weights [T, h], keys [E, d] -> [T, E]."""
    s = torch.einsum("thd,ed->the", q, keys).relu()
    return (s * weights.unsqueeze(-1)).sum(dim=1)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties toward the LOWER index (relu makes ties common)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`stable_topk`'s picks in ascending position order (V4.1's index rows and candidate blocks want the set,
    not the score order): int64 [..., min(k, E)]."""
    return stable_topk(scores, k).sort(dim=-1).values


def sparse_attn_sink(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Single-latent MQA over gathered rows with a per-head sink logit (denominator only).

    q [T, H, d]; kv [N, d] (a flat pool of rows); sink [H]; idx [T, K] rows of kv, -1 = skip.
    Every query row must have at least one valid index. Returns [T, H, d].
    """
    valid = idx >= 0
    gathered = kv[idx.clamp(min=0)]  # [T, K, d]
    scores = torch.einsum("thd,tkd->thk", q, gathered) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1) - m)
    return torch.einsum("thk,tkd->thd", p / denom, gathered)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """w2(weight * silu(min(x w1, limit)) * clamp(x w3, +-limit)); limit 0 = unclamped; weight [T, 1]."""
    gate, up = x @ w1.T, x @ w3.T
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = weight * h  # the routing weight multiplies before the down projection
    return h @ w2.T


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of op "greedy_sample" (kernels/triton/greedy.py): logits [N, V] -> (the first argmax [N] int64,
    its raw log_softmax value [N], its rank [N] int64: 1 + the count of strictly higher logprobs), the
    sampler's general path for all-greedy rows (`sampling.logprobs.gather_logprobs`)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = logits.argmax(dim=-1)
    chosen = lp.gather(1, tok.unsqueeze(-1)).squeeze(-1)
    return tok, chosen, (lp > chosen.unsqueeze(-1)).sum(dim=-1) + 1
