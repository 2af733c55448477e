"""Greedy sampling over fp32 logits rows in one pass: the token (first argmax), its raw logprob and rank.

Op `greedy_sample(logits [N, V]) -> (token_ids [N] int64, logprobs [N] fp32, ranks [N] int64)`, the sampler's
fast path for a step whose rows are all greedy and ask no top logprobs (`sampling/sampler.py`). Its twin is
the sampler's general path: `log_softmax` of the row, `argmax`, the gather and the rank count
(`sampling.logprobs.gather_logprobs`), which writes and re-reads a [N, V] fp32 tensor four times (at batch
128 over the 129,280-token vocabulary, 66 MB each pass). Here each row is read once:
* split into chunks, one program per (row, chunk): the chunk's max, its first argmax, sum(exp(x - max))
  (online over blocks), and its first NaN;
* one program per row combines them: M = max, the token = the first position holding M, the logprob =
  -log(sum_c s_c * exp(m_c - M)), which is log_softmax's value at the argmax ((x - M) - log(sum) with
  x = M); the rank is 1 (no logprob can be strictly above the argmax's).
Same token as torch's argmax (ties to the first; a NaN in the row: its first NaN, logprob NaN; +inf: the
first +inf, logprob NaN; a row of -inf: position 0, logprob NaN, as torch). The logprob differs from
torch's only by the fp32 sum's order (tests: within 2e-6 of the float64 log_softmax; CPU torch's fp32
log_softmax itself was 1.3e-5 off over 129,280 entries).
Must not: sample randomly or filter (the general path does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.fp8_gemm import sm_count
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

BLOCK = 2048  # elements per step of a chunk program
PROGRAMS_PER_SM = 8  # a chunk's steps wait on each other (the online max and sum): many short chunks in flight.
# H200 2026-12-04 (benchmarks/bench_greedy.py): at 2 per SM, B=128 took 56.8 us (1.17 TB/s, 28% of copy)


@fast_launch
@triton.jit
def _greedy_chunk_kernel(x_ptr, stride_row, V, m_ptr, idx_ptr, s_ptr, nan_ptr, n_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lo = c * CHUNK
    m = -float("inf")
    s = 0.0
    idx = lo
    nan_at = V
    for k0 in range(0, CHUNK, BLOCK):
        offs = lo + k0 + tl.arange(0, BLOCK)
        inside = (offs < V) & (offs < lo + CHUNK)
        x = tl.load(x_ptr + row * stride_row + offs, mask=inside, other=-float("inf"))
        isnan = x != x
        nan_at = tl.minimum(nan_at, tl.min(tl.where(isnan, offs, V), axis=0))
        x = tl.where(isnan, -float("inf"), x)
        bm, bi = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        new_m = tl.maximum(m, bm)
        idx = tl.where(bm > m, lo + k0 + bi, idx)  # strictly greater: an equal max later keeps the first
        live = new_m > -float("inf")  # nothing but -inf so far: no sum yet (exp(-inf - -inf) is NaN)
        s = tl.where(live, s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0), 0.0)
        m = new_m
    at = row * n_chunks + c
    tl.store(m_ptr + at, m)
    tl.store(idx_ptr + at, idx)
    tl.store(s_ptr + at, s)
    tl.store(nan_ptr + at, nan_at)


@fast_launch
@triton.jit
def _greedy_finish_kernel(m_ptr, idx_ptr, s_ptr, nan_ptr, tok_ptr, lp_ptr, rank_ptr, V, n_chunks,
                          NC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, NC)
    ok = cs < n_chunks
    at = row * n_chunks + cs
    m = tl.load(m_ptr + at, mask=ok, other=-float("inf"))
    idx = tl.load(idx_ptr + at, mask=ok, other=V)
    s = tl.load(s_ptr + at, mask=ok, other=0.0)
    nan_at = tl.min(tl.load(nan_ptr + at, mask=ok, other=V), axis=0)
    M = tl.max(m, axis=0)
    tok = tl.min(tl.where(m == M, idx, V), axis=0)  # chunks are in order: the first chunk holding M
    total = tl.sum(tl.where(m > -float("inf"), s * tl.exp(m - M), 0.0), axis=0)
    lp = -tl.log(total)
    bad = (nan_at < V) | (M == -float("inf")) | (M == float("inf"))
    lp = tl.where(bad, float("nan"), lp)
    tok = tl.where(nan_at < V, nan_at, tok)
    tok = tl.where(M == -float("inf"), 0, tok)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, lp)
    tl.store(rank_ptr + row, tl.full((), 1, tl.int64))


def chunks_for(n_rows: int, V: int, sms: int) -> tuple[int, int]:
    """(chunk length, chunks per row): about PROGRAMS_PER_SM programs per SM over the whole batch, whole
    BLOCKs (a compile-time length: a handful of values over the batch sizes)."""
    want = max(1, min(cdiv(V, BLOCK), round(PROGRAMS_PER_SM * sms / max(n_rows, 1))))
    chunk = cdiv(cdiv(V, want), BLOCK) * BLOCK
    return chunk, cdiv(V, chunk)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] fp32 (a row stride is fine; the last dim contiguous) -> (token ids int64, logprobs fp32,
    ranks int64), each [N]."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"greedy_sample: want fp32 logits [N, V], got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("greedy_sample: an empty vocabulary has no argmax")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    N, V = logits.shape
    dev = logits.device
    tok = torch.empty(N, dtype=torch.int64, device=dev)
    lp = torch.empty(N, dtype=torch.float32, device=dev)
    ranks = torch.empty(N, dtype=torch.int64, device=dev)
    if N == 0:
        return tok, lp, ranks
    chunk, n_chunks = chunks_for(N, V, sm_count(dev))
    m = torch.empty(N, n_chunks, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    idx = torch.empty(N, n_chunks, dtype=torch.int32, device=dev)
    nan_at = torch.empty_like(idx)
    _greedy_chunk_kernel[(N, n_chunks)](logits, logits.stride(0), V, m, idx, s, nan_at, n_chunks,
                                        CHUNK=chunk, BLOCK=BLOCK, num_warps=8)
    _greedy_finish_kernel[(N,)](m, idx, s, nan_at, tok, lp, ranks, V, n_chunks,
                                NC=max(2, next_power_of_2(n_chunks)), num_warps=1)
    return tok, lp, ranks


REGISTRATIONS = {"greedy_sample": greedy_sample}
