"""The attention's grouped output LoRA (`wo_a`) in fast numerics, whichever form the params hold it in.

The official block runs `einsum("bsgd,grd->bsgr", o, wo_a)` on bf16 operands, wo_a being convert.py's bf16
dequantisation of the FP8 checkpoint weight. By default `params_fast` keeps the FP8 bytes and block scales
(`QuantLinearWeight`, op "grouped_proj_fp8": the same values in half the memory, its CUDA forms faster than
cuBLAS on the bf16 weight up to 256 tokens, BENCHMARKS.md twenty-first session); with `DEEPINFER_WO_A_FP8=0`
it holds that bf16 value (op "grouped_proj_bf16", the official einsum itself).
Must not: know about caches or layers.
"""
from __future__ import annotations

from typing import Callable

import torch

from deepinfer.kernels.quant_weights import QuantLinearWeight


def out_lora(op: Callable[[str], Callable], o: torch.Tensor, wo_a: torch.Tensor | QuantLinearWeight) -> torch.Tensor:
    """o bf16 [T, G, d] (the attention output of the G head groups) -> z bf16 [T, G, R]. op: the caller's
    kernel lookup for its device (name -> callable)."""
    if isinstance(wo_a, QuantLinearWeight):
        return op("grouped_proj_fp8")(o, wo_a)
    return op("grouped_proj_bf16")(o, wo_a.view(o.shape[1], -1, o.shape[2]))
