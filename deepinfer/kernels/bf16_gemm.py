"""GEMMs on bf16 weights in fast numerics, without per-call upcasts: the grouped output LoRA (`wo_a`) and
the LM head.

Ops (registered in `deepinfer.kernels`; torch twins for "cpu", cuBLAS on bf16 operands for "cuda"):
* "grouped_proj_bf16"(o bf16 [T, G, d], w bf16 [G, R, d]) -> bf16 [T, G, R] = o[t, g] . w[g, r].
  The official model.py runs `torch.einsum("bsgd,grd->bsgr", o, wo_a)` with o AND wo_a in bf16 (wo_a is a
  bf16 `ColumnParallelLinear`, o the bf16 sparse-attention output): products of bf16 values are exact,
  cuBLAS accumulates them in fp32 and rounds the output to bf16 once. The twin does the same math in fp32
  (upcast, fp32 matmul, one bf16 rounding); the cuda version is the official einsum itself (no 4x-sized
  fp32 copy of the 64 MB weight per layer and call).
* "head_logits_bf16"(y bf16 [N, D], w bf16 [V, D]) -> fp32 [N, V] = y . w^T. The official head holds the
  checkpoint's bf16 weight as fp32 and computes `F.linear(bf16_normed_y.float(), w_f32)` in fp32 (TF32 off):
  exact products of bf16 values summed in fp32. cuBLAS with bf16 operands and an fp32 output
  (`torch.mm(..., out_dtype=float32)`, compute type fp32) is that math up to summation order, reading
  half the bytes and never forming the 2 GB fp32 head. TF32 cannot enter: it applies to fp32 operands only.
Must not: upcast a weight on the cuda path; accept inputs that are not bf16 (the values would change).
"""
from __future__ import annotations

import torch

BF16, F32 = torch.bfloat16, torch.float32


def _check(op: str, a: torch.Tensor, w: torch.Tensor, a_dims: int, w_dims: int) -> None:
    if a.dtype != BF16 or w.dtype != BF16:
        raise ValueError(f"{op}: needs bf16 activation and weight, got {a.dtype} and {w.dtype}")
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
    """The official bf16 einsum (cuBLAS batched GEMM over the groups, fp32 accumulation, bf16 out)."""
    if not o.is_cuda:
        return grouped_proj_bf16_torch(o, w)
    _check_groups(o, w)
    return torch.einsum("tgd,grd->tgr", o, w)


def head_logits_bf16_torch(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twin: the official fp32 head on the same values (upcasts both; any device)."""
    _check("head_logits_bf16", y, w, 2, 2)
    return y.to(F32) @ w.to(F32).T


def head_logits_bf16_cublas(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 operands, fp32 accumulation and output in cuBLAS (no fp32 copy of the head)."""
    if not y.is_cuda:
        return head_logits_bf16_torch(y, w)
    _check("head_logits_bf16", y, w, 2, 2)
    return torch.mm(y, w.T, out_dtype=F32)
