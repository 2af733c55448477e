"""GEMMs on bf16 weights in fast numerics, without per-call upcasts: the grouped output LoRA (`wo_a`), the
official fp32 matmuls of bf16 checkpoint weights (LM head, compressors, MoE gate) and the bf16 linears.

Ops (registered in `deepinfer.kernels`; torch twins for "cpu", cuBLAS on bf16 operands for "cuda"):
* "grouped_proj_bf16"(o bf16 [T, G, d], w bf16 [G, R, d]) -> bf16 [T, G, R] = o[t, g] . w[g, r].
  The official model.py runs `torch.einsum("bsgd,grd->bsgr", o, wo_a)` with o AND wo_a in bf16 (wo_a is a
  bf16 `ColumnParallelLinear`, o the bf16 sparse-attention output): products of bf16 values are exact,
  cuBLAS accumulates them in fp32 and rounds the output to bf16 once. The twin does the same math in fp32
  (upcast, fp32 matmul, one bf16 rounding); the cuda version is the official einsum itself (no 4x-sized
  fp32 copy of the 64 MB weight per layer and call).
* "linear_f32"(x bf16 [N, K], w bf16 or fp32 [M, K]) -> fp32 [N, M] = x . w^T. The official fp32 matmuls
  whose weights the checkpoint stores in bf16 (the LM head, the compressors' wkv/wgate, the MoE gate; the
  official model holds them as fp32 copies of the bf16 values) run `F.linear(bf16_x.float(), w_f32)` in
  fp32 with TF32 off: exact products of bf16 values summed in fp32. cuBLAS with bf16 operands and an fp32
  output (`torch.mm(..., out_dtype=float32)`, compute type fp32) is that math up to summation order, on the
  tensor cores (the fp32 path is SIMT/xmma at about a tenth of the rate), reading half the weight bytes and
  never forming an fp32 copy of the weight. TF32 cannot enter: it applies to fp32 operands only. An fp32
  weight (official-numerics params) takes the fp32 matmul, its exact values.
* "blinear"(x bf16, w bf16) -> bf16 on cuda: the official bf16 `F.linear` (indexer weights_proj, V4.1's
  uncompressed-layer wkv) as fp32 accumulation and output, rounded to bf16 once (the twin's math,
  `official.blinear`, on the tensor cores; an fp32 weight takes the twin).
Must not: upcast a bf16 weight on the cuda path; accept activations that are not bf16 (the values would change).
"""
from __future__ import annotations

import torch

from deepinfer.kernels import official

BF16, F32 = torch.bfloat16, torch.float32


def _check(op: str, a: torch.Tensor, w: torch.Tensor, a_dims: int, w_dims: int,
           weight_dtypes: tuple[torch.dtype, ...] = (BF16,)) -> None:
    if a.dtype != BF16:
        raise ValueError(f"{op}: needs a bf16 activation, got {a.dtype}")
    if w.dtype not in weight_dtypes:
        names = " or ".join({BF16: "bf16", F32: "fp32"}[d] for d in weight_dtypes)
        raise ValueError(f"{op}: needs a {names} weight, got {w.dtype}")
    if a.dim() != a_dims or w.dim() != w_dims or a.shape[-1] != w.shape[-1]:
        raise ValueError(f"{op}: shapes {tuple(a.shape)} and {tuple(w.shape)} do not fit "
                         f"({a_dims}-D activation, {w_dims}-D weight, same last dim)")
    if a.device != w.device:
        raise ValueError(f"{op}: activation on {a.device}, weight on {w.device}")


def _check_groups(o: torch.Tensor, w: torch.Tensor) -> None:
    _check("grouped_proj_bf16", o, w, 3, 3)
    if o.shape[1] != w.shape[0]:
        raise ValueError(f"grouped_proj_bf16: {o.shape[1]} groups in o, {w.shape[0]} in w")


def grouped_proj_bf16_torch(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twin: exact products, fp32 sums, one bf16 rounding (any device)."""
    _check_groups(o, w)
    return torch.einsum("tgd,grd->tgr", o.to(F32), w.to(F32)).to(BF16)


def grouped_proj_bf16_cublas(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The official bf16 einsum (cuBLAS batched GEMM over the groups, fp32 accumulation, bf16 out), written
    straight into a [T, G, R]-contiguous result. `torch.einsum` runs the same batched GEMM over g into
    [G, T, R] and returns a permuted view, which the caller's flatten to [T, G * R] (wo_b's input) then
    copied: one more kernel per layer at decode. cuBLAS takes the strided result as it is (ldc = G * R, batch
    stride R), the same GEMM."""
    if not o.is_cuda:
        return grouped_proj_bf16_torch(o, w)
    _check_groups(o, w)
    z = torch.empty(o.shape[0], o.shape[1], w.shape[1], dtype=torch.result_type(o, w), device=o.device)
    torch.bmm(o.transpose(0, 1), w.transpose(1, 2), out=z.transpose(0, 1))
    return z


def linear_f32_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twin: the official fp32 matmul on the same values (upcasts; an fp32 weight is used as it is)."""
    _check("linear_f32", x, w, 2, 2, (BF16, F32))
    return x.to(F32) @ w.to(F32).T


def linear_f32_cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 operands, fp32 accumulation and output in cuBLAS (no fp32 copy of the weight)."""
    if not x.is_cuda or w.dtype != BF16:
        return linear_f32_torch(x, w)
    _check("linear_f32", x, w, 2, 2, (BF16, F32))
    return torch.mm(x, w.T, out_dtype=F32)


def blinear_scaled_cublas(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """`blinear_cublas(x, w) * scale` (the twin's steps on cuBLAS's blinear)."""
    return blinear_cublas(x, w) * scale


def blinear_cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The official bf16 linear: fp32 accumulation and output in cuBLAS, one bf16 rounding."""
    if not x.is_cuda or w.dtype != BF16:
        return official.blinear(x, w)
    _check("blinear", x, w, 2, 2, (BF16, F32))
    return torch.mm(x, w.T, out_dtype=F32).to(BF16)
