"""Triton V4 MoE gate after its logits GEMM: the CUDA twin of `official_fused.moe_gate_sqrtsoftplus`.

Owns: `moe_gate_sqrtsoftplus(logits, bias, topk, route_scale, norm_eps=0)` (V4.1 renormalises by sum + 1e-20).
One program per token row: sqrt(softplus) scores (`_sqrt_softplus`: torch's softplus, IEEE sqrt), the top-k of the biased
scores by k rounds of max + lowest index of the max (descending, as torch.topk returns them), the unbiased
scores of those experts renormalised and scaled. On torch this is ~9 kernels (softplus, sqrt, add, topk,
gather, sum, div, mul + the index cast); here one.
Numerics: the renormalising sum of the k weights is a tree sum (tl.sum), torch's is sequential: the weights
may differ in the last bit; the indices are the same unless two biased scores tie exactly.
Also `moe_gate_hash_sqrtsoftplus(logits, tid2eid, ids, route_scale)`, the hash layers' gate (the first
n_hash_layers: the experts come from the token id's row of a table): one program per token reads the k
table entries and only those k logits (six torch ops and an index cast before).
Must not: run the logits GEMM (cuBLAS does it better at every T) or be imported off CUDA (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.official_fused import check_moe_gate_hash
from deepinfer.kernels.triton.launch import fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) as torch computes it: x above 20 passes through, else log1p(exp(x)) by Kahan's
    correction (libdevice's log1p has no TRITON_INTERPRET twin); IEEE sqrt."""
    u = tl.exp(x)
    v = 1.0 + u
    lp = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, lp))


@triton.jit
def hash_gate_row(logits_row_ptr, tid_ptr, tid, w_row_ptr, idx_row_ptr, stride_tid, route_scale, K: tl.constexpr,
                  K_P2: tl.constexpr, CACHE: tl.constexpr):
    """One token's hash gate: its k table entries (row `tid` of tid2eid), their logits' sqrt-softplus scores
    renormalised and scaled. CACHE: the logits' load cache modifier (the fused route reads logits other
    programs wrote: ".cg")."""
    kk = tl.arange(0, K_P2)
    kmask = kk < K
    e = tl.load(tid_ptr + tid * stride_tid + kk, mask=kmask, other=0).to(tl.int64)
    x = tl.load(logits_row_ptr + e, mask=kmask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    w = tl.where(kmask, _sqrt_softplus(x), 0.0)
    tl.store(w_row_ptr + kk, w / tl.sum(w, axis=0) * route_scale, mask=kmask)
    tl.store(idx_row_ptr + kk, e, mask=kmask)


@fast_launch
@triton.jit
def _hash_gate_kernel(logits_ptr, tid_ptr, ids_ptr, w_ptr, idx_ptr, stride_t, stride_tid, route_scale,
                      K: tl.constexpr, K_P2: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    tid = tl.load(ids_ptr + t).to(tl.int64)
    hash_gate_row(logits_ptr + t * stride_t, tid_ptr, tid, w_ptr + t * K, idx_ptr + t * K, stride_tid, route_scale,
                  K, K_P2, "")


@triton.jit
def _order_key(v, e, E_P2: tl.constexpr):
    """An int64 key whose order is v's (fp32, no NaN; -0.0 is taken as +0.0, as float compares them) and,
    between equal v, the lower e first: v's bits made order-preserving as a signed int32 (negative floats'
    magnitude bits flipped) in the high word, E_P2 - 1 - e in the low word."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return (ordered << 32) | (E_P2 - 1 - e).to(tl.int64)


@triton.jit
def gate_row(logits_row_ptr, bias_ptr, w_row_ptr, idx_row_ptr, E, route_scale, norm_eps,
             K: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, CACHE: tl.constexpr, PACKED: tl.constexpr):
    """One token's gate: sqrt-softplus scores of its E logits, the top-k of the biased scores (ties: the lower
    expert), their unbiased scores renormalised and scaled. CACHE: the logits' load cache modifier (the fused
    route reads logits other programs wrote: ".cg"; a constexpr argument every caller passes: a str default
    does not compile for the GPU, 2026-12-07).
    Top-k rounds: each reduction across the warps is a barrier round trip, and a round of the ROUNDS form
    takes three (max, the lowest index of the max, the selected score): the row's serial tail. PACKED (the
    default, `env.gate_packed_key`): ONE reduction a round, the max of `_order_key` (score and lowest index at
    once; sm_90 build of the fused route's loop: 54 -> 18 barriers), the k unbiased scores recomputed from their
    k logits after the loop (the same function of the same values). Both forms give the same bits (interpreter
    and H100 tests). H100, graph replay, PDL on (results/bench_moe_route_*_h100_2026-12-07_s34.log): the fused
    route at 1 row 7.6 against 8.4 us (V4.1's shapes 9.6 against 10.3), the unfused gate's path 9.0 against 9.7."""
    e = tl.arange(0, E_P2)
    emask = e < E
    x = tl.load(logits_row_ptr + e, mask=emask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    scores = _sqrt_softplus(x)
    kk = tl.arange(0, K_P2)
    kmask = kk < K
    sel_idx = tl.zeros([K_P2], dtype=tl.int64)
    if PACKED:
        taken = -9223372036854775807 - 1  # int64's minimum: below every key (padding and chosen experts)
        biased = scores + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)
        key = tl.where(emask, _order_key(biased, e, E_P2), taken)
        for i in tl.static_range(K):
            best = tl.max(key, axis=0)
            j = (E_P2 - 1) - (best & (E_P2 - 1))  # the low word (< E_P2)
            sel_idx = tl.where(kk == i, j, sel_idx)
            key = tl.where(e == j, taken, key)
        sel_w = tl.where(kmask, _sqrt_softplus(tl.load(logits_row_ptr + sel_idx, mask=kmask, other=0.0,
                                                       cache_modifier=CACHE).to(tl.float32)), 0.0)
    else:
        biased = tl.where(emask, scores + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32),
                          float("-inf"))
        sel_w = tl.zeros([K_P2], dtype=tl.float32)
        for i in tl.static_range(K):
            m = tl.max(biased, axis=0)
            j = tl.min(tl.where(biased == m, e, E_P2), axis=0)  # ties: the lower expert
            wj = tl.sum(tl.where(e == j, scores, 0.0), axis=0)
            sel_idx = tl.where(kk == i, j, sel_idx)
            sel_w = tl.where(kk == i, wj, sel_w)
            biased = tl.where(e == j, float("-inf"), biased)
    total = tl.sum(sel_w, axis=0)
    tl.store(w_row_ptr + kk, sel_w / (total + norm_eps) * route_scale, mask=kmask)
    tl.store(idx_row_ptr + kk, sel_idx, mask=kmask)


@fast_launch
@triton.jit
def _gate_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, stride_t, route_scale, norm_eps,
                 K: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, PACKED: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    gate_row(logits_ptr + t * stride_t, bias_ptr, w_ptr + t * K, idx_ptr + t * K, E, route_scale, norm_eps,
             K, E_P2, K_P2, "", PACKED)


def moe_gate_sqrtsoftplus(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float,
                          norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, topk] fp32, indices [T, topk] int64); see the torch twin."""
    if logits.dim() != 2 or bias.shape != logits.shape[-1:] or not 0 < topk <= logits.shape[-1]:
        raise ValueError(f"moe_gate: logits [T, E], bias [E], 0 < topk <= E; got {tuple(logits.shape)}, "
                         f"{tuple(bias.shape)}, topk {topk}")
    if logits.dtype != torch.float32:
        raise ValueError(f"moe_gate: fp32 logits expected, got {logits.dtype}")
    T, E = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, topk, dtype=torch.int64, device=logits.device)
    if T:
        e_p2 = next_power_of_2(E)
        _gate_kernel[(T,)](logits, bias.contiguous(), w, idx, E, logits.stride(0), float(route_scale),
                           float(norm_eps), K=topk, E_P2=e_p2, K_P2=next_power_of_2(topk),
                           PACKED=env.gate_packed_key(), num_warps=4 if e_p2 <= 1024 else 8)
    return w, idx


def moe_gate_hash_sqrtsoftplus(logits: torch.Tensor, tid2eid: torch.Tensor, ids: torch.Tensor,
                               route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, tid2eid [vocab, k], ids [T] -> (weights [T, k] fp32, indices [T, k] int64); see the
    torch twin `official_fused.moe_gate_hash_sqrtsoftplus`."""
    check_moe_gate_hash(logits, tid2eid, ids)
    if logits.dtype != torch.float32:
        raise ValueError(f"moe_gate_hash: fp32 logits expected, got {logits.dtype}")
    T, k = logits.shape[0], tid2eid.shape[1]
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    tid2eid = tid2eid if tid2eid.stride(-1) == 1 else tid2eid.contiguous()
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        _hash_gate_kernel[(T,)](logits, tid2eid, ids.contiguous(), w, idx, logits.stride(0), tid2eid.stride(0),
                                float(route_scale), K=k, K_P2=next_power_of_2(k), num_warps=1)
    return w, idx


REGISTRATIONS = {"moe_gate_sqrtsoftplus": moe_gate_sqrtsoftplus, "moe_gate_hash_sqrtsoftplus": moe_gate_hash_sqrtsoftplus}
