"""Triton SwiGLU of the shared experts with the official rounding points: the CUDA twin of
`kernels.official.swiglu_bf16`.

Owns: `swiglu_bf16(gate, up, limit, weight=None)` on the bf16 outputs of the w1 / w3 GEMMs [T, N]: upcast,
clamps, silu(gate) * up (times a per-row weight [T, 1]), one bf16 rounding, in one launch. The torch form is
seven kernels (two casts, two clamps, silu, multiply, cast) over [T, N] fp32 temporaries: 1.3 ms of an
8k-token prefill of a 4-layer V4-Flash slice on the H200, ~25 launches of a batch-1 decode step.
Numerics: silu as g / (1 + exp(-g)) with Triton's exp and division (as the routed experts' epilogue in
fp4_moe.py), torch's is the same formula with libm-accurate exp and IEEE division: the fp32 values can
differ in the last bits, and the bf16 result where that moves a rounding (tests bound it at one bf16 ulp).
Must not: be imported off CUDA (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import official
from deepinfer.kernels.split_k import SplitK, one_launch, summed
from deepinfer.kernels.triton import split_k_load
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter
from deepinfer.kernels.triton.split_k_load import load_summed

BF16 = torch.bfloat16


@fast_launch
@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, out_ptr, N, stride_g, stride_u, stride_o, limit, stride_s,
                   S: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """S > 1: gate and up are fp32 split-K partials (stride_s apart), added in order and rounded to bf16 on the
    load (`split_k_load.load_summed`: the split-sum kernel's bits)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = load_summed(g_ptr + row * stride_g + cols, ok, S, stride_s)
    u = load_summed(u_ptr + row * stride_u + cols, ok, S, stride_s)
    if limit > 0:
        u = tl.clamp(u, -limit, limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if HAS_WEIGHT:
        h = tl.load(w_ptr + row).to(tl.float32) * h
    tl.store(out_ptr + row * stride_o + cols, h.to(tl.bfloat16), mask=ok)


SPLIT_BLOCK = 256  # columns a program when it adds split-K partials (16 x 2 x 256 fp32 to read, not 16 x 2 x 1024)


def swiglu_bf16(gate: "torch.Tensor | SplitK", up: "torch.Tensor | SplitK", limit: float,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `official.swiglu_bf16`: gate, up bf16 [T, N], weight None or [T, 1] -> bf16 [T, N].
    gate and up may be the two column views of one `SplitK` (the stacked w1 | w3 from op
    "fp8_linear_unsummed"): the kernel adds the partials on its loads (the split-sum kernel's bits); other
    SplitKs are summed first."""
    split = one_launch(gate, up)
    if not split:
        gate, up = summed(gate), summed(up)
    if gate.dtype != BF16 or up.dtype != BF16 or not (gate.device.type == "cuda" or interpreting()) or gate.dim() != 2:
        return official.swiglu_bf16(gate, up, limit, weight)
    if up.shape != gate.shape or up.device != gate.device:
        raise ValueError(f"swiglu_bf16: gate {tuple(gate.shape)} on {gate.device} and up {tuple(up.shape)} on "
                         f"{up.device} must match")
    T, N = gate.shape
    if weight is not None and (weight.numel() != T or weight.device != gate.device):
        raise ValueError(f"swiglu_bf16: weight {tuple(weight.shape)} must hold one value per row of gate "
                         f"{tuple(gate.shape)}, on {gate.device}")
    if not split and gate.stride(1) != 1:
        gate = gate.contiguous()
    if not split and up.stride(1) != 1:
        up = up.contiguous()
    out = torch.empty((T, N), dtype=BF16, device=gate.device)
    if T and N:
        g_op, S, stride_s, stride_g = split_k_load.operand(gate)
        u_op, _, _, stride_u = split_k_load.operand(up)
        w = weight.reshape(T).contiguous() if weight is not None else out  # never read without HAS_WEIGHT
        block = min(SPLIT_BLOCK if S > 1 else 1024, next_power_of_2(N))
        _swiglu_kernel[(T, cdiv(N, block))](g_op, u_op, w, out, N, stride_g, stride_u, out.stride(0), float(limit),
                                            stride_s, S=S, HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=4)
    return out


REGISTRATIONS = {"swiglu_bf16": swiglu_bf16}
