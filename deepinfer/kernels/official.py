"""Torch emulation of the official kernels' numerics (V4 `numerics="official"`), for the engine model.

Owns the rounding points of the official code on flat token-major tensors: bf16 activations; FP8/FP4
GEMMs = FP8 activation quantisation (pow2 scales per 128) of the input, fp32 accumulation, bf16 out;
bf16-weight linears = fp32 accumulation of bf16 values, bf16 out; fp32 RoPE through complex64 tables;
the sparse-attention kernel's online softmax over blocks of 64 indices with P rounded to bf16 before
P.V; the indexer's bf16 score rounding points. Must not: hold state, know about caches or sequences,
or import the reference oracle (these are written from the policy, not copied from it).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from deepinfer import formats
from deepinfer.kernels import torch_ops

__all__ = ["qlinear", "blinear", "blinear_scaled", "swiglu_bf16", "rope_freqs32", "rope_table32", "rope32", "rms_norm_bf16",
           "hadamard32",
           "indexer_scores_bf16",
           "indexer_scores_batched_bf16", "indexer_scores_paged_bf16",
           "sparse_attn_sink_official", "sparse_attn_sink_official_v41"]

ACT_BLOCK = 128
SPARSE_ATTN_BLOCK = 64  # indices per online-softmax step of the official kernel
BF16, F32 = torch.bfloat16, torch.float32


def qlinear(x: torch.Tensor, w: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """FP8/FP4-weight GEMM: act_quant(x) (FP8, pow2 scale per `block`) @ w.T in fp32 -> bf16.
    `w` is the exact fp32 dequantised weight."""
    return (formats.act_quant_dequant(x, block) @ w.T).to(BF16)


def blinear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16-weight linear on bf16 input: fp32 accumulation, bf16 out (w: the bf16 weight or its fp32 copy)."""
    return (x.to(F32) @ w.to(F32).T).to(BF16)


def blinear_scaled(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """`blinear(x, w) * scale` as torch computes it: the bf16 output times the fp32 value of scale, rounded to
    bf16 again (the indexer's per-head weights: weights_proj(x) * index_head_dim**-0.5 * n_heads**-0.5)."""
    return blinear(x, w) * scale


def swiglu_bf16(gate: torch.Tensor, up: torch.Tensor, limit: float,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """The official expert activation on the bf16 outputs of the w1 / w3 GEMMs: fp32 upcast, the clamps
    (limit > 0: up to [-limit, limit], gate to <= limit), silu(gate) * up (times the routing weight), one
    rounding to bf16 (the w2 GEMM's input)."""
    g, u = gate.to(F32), up.to(F32)
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = torch.nn.functional.silu(g) * u
    if weight is not None:
        h = weight * h
    return h.to(BF16)


@lru_cache(maxsize=32)
def rope_freqs32(rope_dim: int, original_seq_len: int, base: float, factor: float, beta_fast: int,
                 beta_slow: int) -> torch.Tensor:
    """Per-pair frequencies [rope_dim/2] computed in fp32 like the official precompute (YaRN, no mscale)."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=F32) / rope_dim))
    if original_seq_len > 0:
        def corr_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=F32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table32(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rotation table `rope32` builds for positions [T]: complex64 [T, len(freqs)] = polar(1, p * f) from
    the fp32 angles. A step whose layers rotate the same positions by the same frequencies builds it once and
    passes it as `rope32(..., table=)` (each call otherwise rebuilds it: 4 kernels on cuda). The cuda
    registration returns ITS kernel's table (cos, sin); a table is only for the same device's `rope32`."""
    angles = torch.outer(positions.to(F32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rope32(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False,
           table: torch.Tensor | None = None, inplace: bool = False) -> torch.Tensor:
    """Interleaved rotation of the last 2*len(freqs) channels, math in complex64, result in x's dtype.
    x [T, ..., d], positions [T]; `table`: `rope_table32(positions, freqs)` precomputed (the same bits).
    inplace: write the rotated channels into x and return x (the same values as the new tensor; the
    caller's x must be its own, e.g. the fresh output of the op before)."""
    rd = freqs.shape[0] * 2
    if table is None:
        f = rope_table32(positions, freqs)
    elif table.dtype != torch.complex64 or tuple(table.shape) != (x.shape[0], rd // 2):
        raise ValueError(f"rope32: table {table.dtype} {tuple(table.shape)} is not rope_table32's complex64 "
                         f"[{x.shape[0]}, {rd // 2}] (a table from another device's rope_table32?)")
    else:
        f = table
    if inverse:
        f = f.conj()
    z = torch.view_as_complex(x[..., -rd:].to(F32).unflatten(-1, (-1, 2)).contiguous())
    shape = [z.shape[0]] + [1] * (z.dim() - 2) + [z.shape[-1]]
    rotated = torch.view_as_real(z * f.view(shape)).flatten(-2).to(x.dtype)
    if inplace:
        x[..., -rd:] = rotated
        return x
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The official RMSNorm of a bf16 activation: fp32 math, bf16 out, i.e. exactly
    `rms_norm(x.to(fp32), weight, eps).to(bf16)`; the cuda kernel reads the bf16 x and writes the bf16 result
    itself (the two casts would be two more kernels)."""
    return torch_ops.rms_norm(x.to(F32), weight, eps).to(BF16)


@lru_cache(maxsize=4)
def _hadamard32(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=F32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=16)
def _hadamard32_on(n: int, device: torch.device) -> torch.Tensor:
    """The matrix kept on each device: no host-to-device copy per call (one would break CUDA graph capture)."""
    return _hadamard32(n).to(device)


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """fast_hadamard_transform(x, scale=d^-0.5): fp32 inside, result in x's dtype."""
    d = x.shape[-1]
    return ((x.to(F32) @ _hadamard32_on(d, x.device)) * d**-0.5).to(x.dtype)


def check_indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                         visible: torch.Tensor | None) -> None:
    """The argument contract of `indexer_scores_bf16` (shared with its Triton twin): ValueError naming what
    is wrong (a mismatched `visible` would otherwise broadcast or read past its end)."""
    if q.dim() != 3 or weights.shape != q.shape[:2] or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"indexer_scores_bf16: want q [T, h, d], weights [T, h], keys [E, d]; got q {tuple(q.shape)}, "
                         f"weights {tuple(weights.shape)}, keys {tuple(keys.shape)}")
    if visible is not None and (visible.shape != q.shape[:1] or visible.dtype not in (torch.int32, torch.int64)
                                or visible.device != q.device):
        raise ValueError(f"indexer_scores_bf16: visible must be int32/int64 [T={q.shape[0]}] on {q.device}; got "
                         f"{visible.dtype} {tuple(visible.shape)} on {visible.device}")


def indexer_scores_bf16(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                        visible: torch.Tensor | None = None) -> torch.Tensor:
    """Official indexer scores: bf16 q.k, relu, bf16 multiply by the bf16 head weights, bf16 head sum.
    q [T, h, d] bf16, weights [T, h] bf16, keys [E, d] bf16 -> [T, E] bf16. visible [T] (optional): token t
    sees entries [0, visible[t]); the rest of its row is -inf (the official mask before the top-k)."""
    check_indexer_scores(q, weights, keys, visible)
    s = torch.einsum("thd,ed->the", q.to(F32), keys.to(F32)).to(BF16)
    s = (s.relu() * weights.unsqueeze(-1)).to(BF16)
    s = s.to(F32).sum(dim=1).to(BF16)
    if visible is not None:
        s = s.masked_fill(torch.arange(keys.shape[0], device=s.device) >= visible.unsqueeze(1), float("-inf"))
    return s


def indexer_scores_batched_bf16(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`indexer_scores_bf16` with per-sequence keys (the batched decode step: each query has its own
    entries): q [B, h, d] bf16, weights [B, h] bf16, keys [B, E, d] bf16 -> [B, E] bf16. The same rounding
    points; the fp32 dot products may sum in another order than the unbatched op."""
    s = torch.einsum("bhd,bed->bhe", q.to(F32), keys.to(F32)).to(BF16)
    s = (s.relu() * weights.unsqueeze(-1)).to(BF16)
    return s.to(F32).sum(dim=1).to(BF16)


def _check_indexer_paged(q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, entry_rows: torch.Tensor,
                         hidden: torch.Tensor, layout) -> None:
    """The argument contract of `indexer_scores_paged_bf16` (shared with its Triton twin): ValueError naming
    what is wrong. A mismatched `hidden` would otherwise broadcast silently in masked_fill."""
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"indexer_scores_paged_bf16: want q [B, h, d] and weights [B, h]; got q {tuple(q.shape)}, "
                         f"weights {tuple(weights.shape)}")
    if entry_rows.dim() != 2 or entry_rows.shape[0] != q.shape[0] or hidden.shape != entry_rows.shape:
        raise ValueError(f"indexer_scores_paged_bf16: want entry_rows and hidden [B={q.shape[0]}, E]; got entry_rows "
                         f"{tuple(entry_rows.shape)}, hidden {tuple(hidden.shape)}")
    if entry_rows.dtype not in (torch.int32, torch.int64) or hidden.dtype != torch.bool:
        raise ValueError(f"indexer_scores_paged_bf16: entry_rows must be int32/int64 and hidden bool; got "
                         f"{entry_rows.dtype}, {hidden.dtype}")
    if store.dtype != torch.uint8 or store.dim() != 2 or store.shape[1] != layout.bytes_per_token:
        raise ValueError(f"indexer_scores_paged_bf16: store must be uint8 [rows, {layout.bytes_per_token}] "
                         f"({layout.name}); got {store.dtype} {tuple(store.shape)}")
    if q.shape[2] != layout.dim:
        raise ValueError(f"indexer_scores_paged_bf16: q head dim {q.shape[2]} != {layout.name} key dim {layout.dim}")


def indexer_scores_paged_bf16(q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, entry_rows: torch.Tensor,
                              hidden: torch.Tensor, layout) -> torch.Tensor:
    """`indexer_scores_batched_bf16` on keys still packed in a paged cache: q [B, h, d] bf16, weights [B, h] bf16,
    store uint8 [rows, layout.bytes_per_token] (one layer's packed index keys), entry_rows [B, E] (the cache row
    of each sequence's entry j, every one a valid row), hidden [B, E] bool -> [B, E] bf16, -inf where hidden.
    The gather, `layout.load` (the layout object is passed in: kernels never import cache), the batched scores
    and the mask, as the batched decode step composes them; the reference of the fused Triton kernel."""
    _check_indexer_paged(q, weights, store, entry_rows, hidden, layout)
    keys = layout.load(store[entry_rows])  # [B, E, d] bf16
    return indexer_scores_batched_bf16(q, weights, keys).masked_fill(hidden, float("-inf"))


def write_into(out: torch.Tensor, y: torch.Tensor, op: str) -> torch.Tensor:
    """y copied into the caller's `out` (an op's `out=`: same shape and dtype, checked) -> out."""
    if out.shape != y.shape or out.dtype != y.dtype:
        raise ValueError(f"{op}: out must be {tuple(y.shape)} {y.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out.copy_(y)


def sparse_attn_sink_official(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                              scale: float, initial_max: float = float("-inf"),
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """The official sparse attention kernel: q [T, H, d] bf16, kv [N, d] bf16, sink [H] fp32, idx [T, K]
    (-1 = skip) -> [T, H, d] bf16. Online softmax over blocks of 64 indices in idx order (so the index
    order and width matter for the last bits), P rounded to bf16 before P.V, sink in the denominator only.
    `initial_max`: the running max's start (-inf in V4; -1e30 in V4.1, so a row with no index gives 0).
    out: a [T, H, d] tensor of q's dtype to write the result into (returned), e.g. a CUDA graph's buffer.
    """
    if out is not None:
        return write_into(out, sparse_attn_sink_official(q, kv, sink, idx, scale, initial_max), "sparse_attn_sink")
    T, H, d = q.shape
    K = idx.shape[-1]
    valid = idx >= 0
    # computed with a leading batch dimension of 1: the shapes of the official [B, M, H, d] call
    qb, idb = q.unsqueeze(0), idx.unsqueeze(0)
    gathered = kv[idb.clamp(min=0).long()]  # [1, T, K, d]
    scores = torch.einsum("bmhd,bmkd->bmhk", qb.to(F32), gathered.to(F32)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(0).unsqueeze(2), float("-inf"))
    run_max = torch.full((1, T, H, 1), initial_max, dtype=F32, device=q.device)
    run_sum = torch.zeros((1, T, H, 1), dtype=F32, device=q.device)
    out = torch.zeros((1, T, H, d), dtype=F32, device=q.device)
    for start in range(0, K, SPARSE_ATTN_BLOCK):
        s = scores[..., start : start + SPARSE_ATTN_BLOCK]
        v = gathered[:, :, start : start + SPARSE_ATTN_BLOCK].to(F32)
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(s - new_max)
        run_sum = run_sum * rescale + p.sum(-1, keepdim=True)
        out = out * rescale + torch.einsum("bmhk,bmkd->bmhd", p.to(BF16).to(F32), v)
        run_max = new_max
    run_sum = run_sum + torch.exp(sink.to(F32).view(1, 1, H, 1) - run_max)
    return (out / run_sum).to(q.dtype)[0]


def sparse_attn_sink_official_v41(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                                  scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The V4.1 kernel: the same, with the running max starting at -1e30 (out: as there)."""
    return sparse_attn_sink_official(q, kv, sink, idx, scale, initial_max=-1e30, out=out)
