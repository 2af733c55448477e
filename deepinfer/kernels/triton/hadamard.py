"""Triton Hadamard transform with the official numerics: the CUDA twin of `kernels.official.hadamard32`.

Owns: `hadamard32(x)` for bf16 x [..., d], d a power of two in 16..256 (V4: the indexer queries
[T, 64, 128] and its compressed keys [n, 128]), in ONE kernel: each program loads a [BM, d] tile of rows,
multiplies it by the Sylvester Hadamard matrix H (+-1) with `tl.dot`, scales by d**-0.5 and rounds to bf16
once. The torch version runs an fp32 GEMM (SIMT on the H200) plus a cast in and a cast out.
Numerics: H is held in bf16 (+-1 is exact), so the MMA's products x_i * (+-1) are exact and it accumulates
them in fp32: the twin's fp32 `x.float() @ H` up to the summation order; the fp32 sum is then multiplied by
fp32(d**-0.5) in fp32 and rounded to bf16, as the twin does. Other dtypes, other d, and CPU tensors (unless
TRITON_INTERPRET=1) go to the twin.
Must not: be imported off CUDA (imports triton); copy H from the host per call (calls are captured in CUDA
graphs: H is built once per (d, device) and cached).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from deepinfer.kernels import official
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.launch import cdiv, fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter

MIN_D, MAX_D = 16, 256  # tl.dot needs every dim >= 16; above 256 the [d, d] H no longer fits one program
BLOCK_N = 128  # output columns per MMA: d = 256 runs two, so the fp32 accumulator stays [BM, 128]


@fast_launch
@triton.jit
def _hadamard_kernel(x_ptr, h_ptr, out_ptr, M, stride_xm, scale, D: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """x viewed as [M, D] (unit column stride, row stride stride_xm); out [M, D] contiguous; H [D, D]."""
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # int64: T * 64 rows * 128 can pass 2**31
    rmask = (rows < M)[:, None]
    k = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=rmask, other=0.0)
    if INTERPRET:  # the CPU interpreter's bf16 dot multiplies bit patterns; fp32 operands: the same exact products
        x = x.to(tl.float32)
    for n0 in tl.static_range(0, D, BN):  # the x tile is read once for all column blocks
        cols = n0 + tl.arange(0, BN)
        h = tl.load(h_ptr + k[:, None] * D + cols[None, :])  # 32 KiB per block: L2-resident across programs
        if INTERPRET:
            h = h.to(tl.float32)
        acc = tl.dot(x, h)  # fp32 accumulation of exact products
        y = (acc * scale).to(out_ptr.dtype.element_ty)  # scale: fp32, like the twin's fp32 * python float
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], y, mask=rmask)


@lru_cache(maxsize=16)
def _hadamard_bf16(d: int, device: torch.device) -> torch.Tensor:
    """H [d, d] in bf16 on `device`, built once: a host-to-device copy inside CUDA graph capture would fail."""
    return official._hadamard32(d).to(device=device, dtype=torch.bfloat16).contiguous()


def _block_rows(d: int) -> int:
    """Rows per program. Memory bound (2 bytes read + 2 written per element): enough rows that the tile's
    traffic outweighs the L2 read of H, few enough that the fp32 accumulator [BM, min(d, 128)] stays in
    registers at 4 warps (64 x 128 fp32 = 64 per thread)."""
    return 128 if d <= 64 else 64


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """Same contract as `official.hadamard32`: x [..., d] -> ((x.float() @ H) * d**-0.5) in x's dtype, a new
    contiguous tensor of x's shape. Raises ValueError unless d = x.shape[-1] is a power of two."""
    d = x.shape[-1] if x.dim() else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard32: want x [..., d] with d a power of two; got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or not MIN_D <= d <= MAX_D or not (x.is_cuda or interpreting()):
        return official.hadamard32(x)
    x2 = x.reshape(-1, d)  # a view (row stride kept) unless x's strides forbid it
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, d), dtype=torch.bfloat16, device=x.device)
    if M:
        h = _hadamard_bf16(d, x.device)
        bm = _block_rows(d)
        _hadamard_kernel[(cdiv(M, bm),)](
            x2, h, out, M, x2.stride(0), d**-0.5, D=d, BM=bm, BN=min(d, BLOCK_N), INTERPRET=interpreting(),
            num_warps=4)
    return out.view(x.shape)


REGISTRATIONS = {"hadamard32": hadamard32}
