"""Rows whose last reduction has not run yet (`PendingRows`), so that the kernel reading them can do it.

At decode a sublayer's output ends in a small reduce kernel: fp8_linear's fixed-order sum of its split-K
partials (wo_b), the MoE's combine of its experts' split partials and the shared rows. Each is a launch on
the critical path (~2 us plus a gap at b1), and the next kernel, the hc_post inside the next sublayer's mix
(`hc_post_pre_fused`), reads exactly those rows column by column: it can add them up itself, in the same
order, for the same bits. A producer asked for `pending=True` returns a PendingRows instead of the bf16
tensor; a consumer that cannot fuse the reduction calls `rows(f)`, which runs the producer's own reduce kernel
(once). Device tensors only: the torch twins return tensors, which every consumer takes as they are.

Two kinds, both bf16 [T, D] when materialised:
* split (ids None): part fp32 [S, T, D]; row t = bf16(part[0, t] + part[1, t] + ... + part[S-1, t]), added in
  that order (fp8_gemm's `_split_sum_kernel`).
* moe (ids [T, k]): part fp32 [S, T k, D], slot t k + j for token t's j-th expert; row t = bf16(acc) where acc
  starts at 0.0 and adds, in ascending expert id (ties by j, a stable sort), each slot's bf16(sum over s of
  part[s, slot]) as fp32, then the shared expert's bf16 row (fp4_moe's `_combine_kernel`); `shared_rows()`
  gives that row after the producer's stream join.
Must not: import triton (the model and the twins use it).
"""
from __future__ import annotations

from typing import Callable

import torch


class PendingRows:
    __slots__ = ("part", "ids", "_shared", "_finish", "_value")

    def __init__(self, part: torch.Tensor, finish: Callable[[], torch.Tensor], ids: torch.Tensor | None = None,
                 shared=None) -> None:
        """part: the fp32 partials (see the module docstring); finish(): the producer's reduce, returning the
        bf16 rows; ids: the moe kind's expert ids [T, k]; shared: an object whose wait() gives the shared
        expert's bf16 rows [T, D] (after joining the stream they were made on)."""
        if part.dim() != 3 or part.dtype != torch.float32:
            raise ValueError(f"PendingRows: partials must be fp32 [S, rows, D], got {part.dtype} {tuple(part.shape)}")
        if ids is not None and (ids.dim() != 2 or ids.numel() != part.shape[1]):
            raise ValueError(f"PendingRows: ids [T, k] must number the partials' {part.shape[1]} rows, "
                             f"got {tuple(ids.shape)}")
        if ids is None and shared is not None:
            raise ValueError("PendingRows: shared rows belong to the moe kind (ids given)")
        self.part, self.ids, self._shared, self._finish, self._value = part, ids, shared, finish, None

    @property
    def shape(self) -> torch.Size:
        n = self.part.shape[1] if self.ids is None else self.ids.shape[0]
        return torch.Size((n, self.part.shape[2]))

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.part.device

    @property
    def has_shared(self) -> bool:
        return self._shared is not None

    def shared_rows(self) -> torch.Tensor | None:
        """The shared expert's bf16 rows (the producer's stream joined first), or None."""
        return None if self._shared is None else self._shared.wait()

    def materialize(self) -> torch.Tensor:
        """The bf16 rows, by the producer's own reduce kernel (run on the first call only)."""
        if self._value is None:
            self._value = self._finish()
            self._finish = None  # drop the closure's references to the producer's buffers
        return self._value


def rows(f: "torch.Tensor | PendingRows") -> torch.Tensor:
    """f itself, or the rows a PendingRows stands for."""
    return f.materialize() if isinstance(f, PendingRows) else f
