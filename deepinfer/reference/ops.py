"""Stateless operators of the V4 reference (spec §3.2-§3.4, §3.8, §6.5), parameterised by `Numerics`.

Owns: RMSNorm, YaRN RoPE tables and interleaved rotation, the Hadamard rotation, hc_split_sinkhorn,
sparse attention with the sink, and the official window/compressed index patterns.
Must not: hold state or weights.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from deepinfer.reference.numerics import Numerics

SPARSE_ATTN_BLOCK = 64  # indices processed per online-softmax step by the official kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """y = round(w * (x * rsqrt(mean(x^2) + eps))) with x upcast first (spec §3.2)."""
    xf = x.to(num.acc)
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return num.round(weight * xf)


def head_rms_norm(q: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """V4 per-head parameter-free q norm, done in bf16 tensor arithmetic by the official code (§9.2)."""
    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)


@lru_cache(maxsize=16)
def rope_table(
    rope_dim: int, seqlen: int, original_seq_len: int, base: float, factor: float, beta_fast: int,
    beta_slow: int, exact: bool,
) -> torch.Tensor:
    """freqs_cis [seqlen, rope_dim/2] (complex) with YaRN frequency interpolation when original_seq_len > 0.

    No attention-temperature (mscale) is applied: the official code does not use one.
    """
    real = torch.float64 if exact else torch.float32
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=real) / rope_dim))
    if original_seq_len > 0:
        def corr_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=real) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen, dtype=real), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, num: Numerics, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST `2*freqs.shape[-1]` channels as interleaved (real, imag) pairs; returns a new tensor.

    x: [B, S, ..., d]; freqs: [S, rd/2] (one row per position of dim 1 of x).
    Math in fp32 (fp64 exact), result rounded back to x's dtype, like the official in-place version.
    """
    rd = freqs.shape[-1] * 2
    head, tail = x[..., :-rd], x[..., -rd:]
    z = torch.view_as_complex(tail.to(num.acc).unflatten(-1, (-1, 2)).contiguous())
    f = freqs.conj() if inverse else freqs
    shape = [1, z.shape[1]] + [1] * (z.dim() - 3) + [z.shape[-1]]
    rotated = torch.view_as_real(z * f.view(shape)).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)


@lru_cache(maxsize=4)
def hadamard_matrix(n: int) -> torch.Tensor:
    """Natural-order Sylvester Hadamard matrix H[i,j] = (-1)^popcount(i & j), float64."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    idx = torch.arange(n)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return 1.0 - 2.0 * parity.to(torch.float64)


def hadamard(x: torch.Tensor, num: Numerics) -> torch.Tensor:
    """fast_hadamard_transform(x, scale=d^-0.5): fp32 inside, result in x's dtype (spec §6.5)."""
    h = hadamard_matrix(x.shape[-1]).to(num.acc)
    return ((x.to(num.acc) @ h) * x.shape[-1] ** -0.5).to(x.dtype)


def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc, hc] (spec §3.4), in mixes' dtype.

    comb: row softmax (+eps), then column normalisation, then (iters-1) x (row, column) normalisations.
    """
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float, num: Numerics,
    finite_init: bool = False,
) -> torch.Tensor:
    """o[b,m,h] = sum_k softmax-with-sink(scale * q.kv[idx]) kv[idx]; -1 indices are skipped (spec §3.8).

    q [B,M,H,d], kv [B,N,d], sink [H], idx [B,M,K] int. The sink joins the denominator only (zero value)
    and is not part of the running max. official: the kernel's online softmax over blocks of 64 indices
    with probabilities rounded to bf16 before P.V; exact: a plain float64 softmax.
    `finite_init` (V4.1 kernel): the running max starts at -1e30, so a row without any index gives 0.
    """
    B, M, H, d = q.shape
    K = idx.shape[-1]
    valid = idx >= 0
    gathered = torch.gather(
        kv.unsqueeze(1).expand(B, M, kv.shape[1], d), 2, idx.clamp(min=0).long().unsqueeze(-1).expand(B, M, K, d)
    )  # [B, M, K, d]
    acc = num.acc
    scores = torch.einsum("bmhd,bmkd->bmhk", q.to(acc), gathered.to(acc)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if num.exact:
        m = scores.amax(dim=-1, keepdim=True)
        if finite_init:
            m = m.clamp(min=-1e30)
        p = torch.exp(scores - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink.to(acc).view(1, 1, H, 1) - m)
        out = torch.einsum("bmhk,bmkd->bmhd", p / denom, gathered.to(acc))
        return out.to(q.dtype)
    run_max = torch.full((B, M, H, 1), -1e30 if finite_init else float("-inf"), dtype=acc)
    run_sum = torch.zeros((B, M, H, 1), dtype=acc)
    out = torch.zeros((B, M, H, d), dtype=acc)
    for start in range(0, K, SPARSE_ATTN_BLOCK):
        s = scores[..., start : start + SPARSE_ATTN_BLOCK]
        v = gathered[:, :, start : start + SPARSE_ATTN_BLOCK].to(acc)
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(s - new_max)
        run_sum = run_sum * rescale + p.sum(-1, keepdim=True)
        p_bf16 = p.to(torch.bfloat16).to(acc)  # the kernel casts P to bf16 for the P.V tensor-core GEMM
        out = out * rescale + torch.einsum("bmhk,bmkd->bmhd", p_bf16, v)
        run_max = new_max
    run_sum = run_sum + torch.exp(sink.to(acc).view(1, 1, H, 1) - run_max)
    return (out / run_sum).to(q.dtype)


def window_indices(window: int, batch: int, seqlen: int, start_pos: int) -> torch.Tensor:
    """Official window index pattern (spec §3.5 step 4), [B, S, min(S, window)] or [B, 1, window].

    Prefill indexes the fresh kv tensor (causal window [i-window+1, i]); decode indexes the ring,
    oldest slot first once the ring is full.
    """
    if start_pos >= window - 1:
        p = start_pos % window
        row = torch.cat([torch.arange(p + 1, window), torch.arange(0, p + 1)])
        matrix = row.unsqueeze(0)
    elif start_pos > 0:
        matrix = torch.cat([torch.arange(start_pos + 1), torch.full((window - start_pos - 1,), -1)]).unsqueeze(0)
    else:
        pos = torch.arange(seqlen).unsqueeze(1)
        matrix = (pos - window + 1).clamp(min=0) + torch.arange(min(seqlen, window))
        matrix = torch.where(matrix > pos, -1, matrix)
    return matrix.unsqueeze(0).expand(batch, -1, -1)


def compressed_indices(ratio: int, batch: int, seqlen: int, start_pos: int, offset: int) -> torch.Tensor:
    """All visible compressed entries (layers without an indexer): entry j visible to query i iff j < (i+1)//r."""
    if start_pos > 0:
        matrix = (torch.arange((start_pos + 1) // ratio) + offset).unsqueeze(0)
    else:
        matrix = torch.arange(seqlen // ratio).repeat(seqlen, 1)
        hidden = matrix >= (torch.arange(1, seqlen + 1) // ratio).unsqueeze(1)
        matrix = torch.where(hidden, -1, matrix + offset)
    return matrix.unsqueeze(0).expand(batch, -1, -1)
