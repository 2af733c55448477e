"""Two GEMMs on one activation as one: the weight pairs `params_fast.STACKS` stacks.

Owns: `pair(op, x, p, stacked, first, second)` -> (x @ first.T, x @ second.T) through the GEMM op `op`
("fp8_linear", "linear_f32"). When p holds the stacked weight (fast numerics) it is ONE call and the two
results are the column halves of its output: views with row stride n1 + n2 and unit column stride, which
the consumers (RMSNorm, SwiGLU, the compressor step) read as they are. Without it (official / exact
numerics, or a pair that could not be stacked) the two calls as before.
Must not: copy the halves (a contiguous copy would cost the launch the stacking saved).
"""
from __future__ import annotations

import torch

from deepinfer.kernels import split_k


def _rows(w) -> int:
    return w.out_features if hasattr(w, "out_features") else w.shape[0]


def pair(op, x: torch.Tensor, p: dict, stacked: str, first: str, second: str) -> tuple:
    both = p.get(stacked)
    if both is None:
        return op(x, p[first]), op(x, p[second])
    y = op(x, both)
    n = _rows(p[first])
    return split_k.cols(y, 0, n), split_k.cols(y, n)  # y may be a SplitK (op "fp8_linear_unsummed")
