"""A GEMM result left as its split-K partials, for the consumer kernel to add (one launch fewer a use).

Owns: `SplitK` (fp32 partials [S, M, N] of a bf16 [M, N] result: bf16(part[0] + part[1] + ... + part[S-1]),
added in that order, the fixed order of `fp8_gemm._split_sum_kernel`), its column views (`cols`: the halves
of a stacked GEMM, `model/stacked.py`) and `total()`, the bf16 tensor itself; `summed(x)` for consumers that
take either form.
Why: at decode a split-K linear is two launches, the GEMM into partials and a sum kernel of ~1.5 us on the
step's main chain (5 a V4 layer at b1). A consumer kernel that reads its input once per element can add the
partials itself, in the same order and with the same one rounding, so the values it sees are the same bits:
op "fp8_linear_unsummed" (kernels/triton/fp8_gemm.py) returns a SplitK where the sum kernel would run, and
the consumers that take one (`hc_post_pre_fused`, `qkv_norm_rope_store`, `swiglu_bf16`) add the partials on
their loads; everything else calls `summed`.
Must not: import triton (the sum runs through fp8_gemm on CUDA or the interpreter, imported on use).
"""
from __future__ import annotations

import torch


class SplitK:
    """fp32 partials part [S, M, N] (S >= 2) of the bf16 [M, N] result bf16(sum over s in order of part[s]);
    a view (`cols`) keeps the parent's strides."""

    __slots__ = ("part",)

    def __init__(self, part: torch.Tensor) -> None:
        if part.dim() != 3 or part.dtype != torch.float32 or part.shape[0] < 2 or part.stride(2) != 1:
            raise ValueError(f"SplitK: want fp32 partials [S >= 2, M, N] with unit column stride, got "
                             f"{part.dtype} {tuple(part.shape)} strides {part.stride()}")
        self.part = part

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    @property
    def dtype(self) -> torch.dtype:  # the result's
        return torch.bfloat16

    def dim(self) -> int:
        return 2

    @property
    def splits(self) -> int:
        return self.part.shape[0]

    @property
    def device(self) -> torch.device:
        return self.part.device

    def cols(self, lo: int, hi: int | None = None) -> "SplitK":
        """Columns lo:hi of the result, still as partials (a view)."""
        return SplitK(self.part[:, :, lo:hi])

    def total(self) -> torch.Tensor:
        """The bf16 [M, N] result: the partials added in order in fp32, rounded once (on cuda by
        `fp8_gemm._split_sum_kernel`; elsewhere by torch, the same bits: its fp32 adds and round-to-nearest-even)."""
        part = self.part
        if part.is_cuda:
            from deepinfer.kernels.triton.fp8_gemm import split_sum

            return split_sum(part)
        acc = part[0].clone()
        for s in range(1, part.shape[0]):
            acc += part[s]
        return acc.to(torch.bfloat16)


def summed(x: "torch.Tensor | SplitK") -> torch.Tensor:
    """x itself, or the bf16 result a SplitK stands for."""
    return x.total() if isinstance(x, SplitK) else x


def cols(x: "torch.Tensor | SplitK", lo: int, hi: int | None = None) -> "torch.Tensor | SplitK":
    """Columns lo:hi (last dimension) of a result in either form, as a view."""
    return x.cols(lo, hi) if isinstance(x, SplitK) else x[..., lo:hi]


def one_launch(a, b) -> bool:
    """a and b are SplitKs a consumer kernel can take as two operands of one S and one split stride (the column
    views of one stacked GEMM's partials: `model/stacked.py`)."""
    return (isinstance(a, SplitK) and isinstance(b, SplitK) and a.splits == b.splits
            and a.part.stride() == b.part.stride())
