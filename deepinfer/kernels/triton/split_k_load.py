"""Loads that add a `SplitK`'s partials on the way in (kernels/split_k.py), for the consumer kernels of op
"fp8_linear_unsummed": `load_summed` in the kernel, `operand` on the host.

The sum is `fp8_gemm._split_sum_kernel`'s: partial 0, then += partial 1, 2, ... in fp32 (no reassociation:
Triton emits each add as written), rounded to bf16 once, so a consumer sees the bits the sum kernel would
have stored. Must not: be imported without triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.split_k import SplitK


@triton.jit
def load_summed(ptrs, mask, S: tl.constexpr, stride_s):
    """fp32 values of a bf16 operand at ptrs: the bf16 values themselves (S = 1), or the bf16 rounding of
    the S fp32 partials at ptrs + s * stride_s added in order s = 0, 1, ..., S - 1."""
    if S == 1:
        v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
        for s in tl.static_range(1, S):
            v += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def pinned(v, INTERPRET: tl.constexpr):
    """v itself, through an opaque register move on the GPU: Triton's layout pass does not carry a layout
    conversion back through it. Why: a consumer that needs v in an MMA operand's layout as well as its own
    (`norm_hc._hc_post_mix_partial_kernel`'s x) had Triton convert each of the S partial loads separately
    (S shared-memory round trips) and add them twice; pinned, it converts the one sum (sm_90 TTGIR,
    scripts/sass_sm90.py hc_post_mix_split16). The bits are v's."""
    if not INTERPRET:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=False, pack=1)
    return v


def operand(x: "torch.Tensor | SplitK") -> tuple[torch.Tensor, int, int, int]:
    """(the tensor a kernel's pointer takes, S, its split stride, its row stride) for a bf16 [M, N] tensor
    (S = 1, split stride 0) or a SplitK's partials."""
    if isinstance(x, SplitK):
        return x.part, x.splits, x.part.stride(0), x.part.stride(1)
    return x, 1, 0, x.stride(0)
