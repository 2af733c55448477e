"""Jit pieces shared by the grouped expert GEMMs (`fp4_moe`'s kernels and the FP8 form in `fp4_fp8_gemm`).

Owns: `expert_rows` (a program's slots, their activation rows, its weight rows and K range: the same set-up
whichever operand the weights are in the dot) and `swiglu_bf16` (the official expert epilogue on the GEMMs'
fp32 gate/up: bf16 roundings, the clamp, silu(gate) * up; the caller multiplies by the routing weight in its
own orientation). Inlined by Triton, so a kernel that calls them compiles as if it had the lines itself.
Must not: be imported without triton; load weights or activations (the kernels' loops differ).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_rows(sorted_slots_ptr, n_slots, N, pid_m, pid_n, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                SPLIT_OUT: tl.constexpr, K_SPLIT: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr):
    """Routing block pid_m's BS slots (valid = real slots; rows = their activation rows, slot // A_ROW_DIV)
    and weight tile pid_n's BW rows: GATED, BW/2 gate rows n0.. then the matching BW/2 up rows N + n0.. (one
    tile; col = the output column of each, w_row = its weight row), else BW rows; k_lo = the split's first K
    (SPLIT_OUT: program axis 2). Returns (slots, valid, rows, col, w_row, n_ok, k_lo)."""
    slots = tl.load(sorted_slots_ptr + pid_m * BS + tl.arange(0, BS))
    valid = slots < n_slots
    rows = (slots // A_ROW_DIV).to(tl.int64)
    r = tl.arange(0, BW)
    if GATED:
        col = pid_n * (BW // 2) + r % (BW // 2)
        w_row = col + (r // (BW // 2)) * N
    else:
        col = pid_n * BW + r
        w_row = col
    n_ok = col < N
    if SPLIT_OUT:
        k_lo = tl.program_id(2) * K_SPLIT
    else:
        k_lo = 0
    return slots, valid, rows, col, w_row, n_ok, k_lo


@triton.jit
def swiglu_bf16(gate, up, limit):
    """fp32 GEMM outputs gate, up -> silu(g) * u with g, u rounded to bf16 first (the GEMMs' bf16 outputs, as
    official) and, when limit > 0, up clamped to +-limit and gate to <= limit."""
    gate = gate.to(tl.bfloat16).to(tl.float32)
    up = up.to(tl.bfloat16).to(tl.float32)
    if limit > 0:
        up = tl.clamp(up, -limit, limit)
        gate = tl.minimum(gate, limit)
    return gate / (1.0 + tl.exp(-gate)) * up
