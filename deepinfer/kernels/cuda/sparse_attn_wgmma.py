"""Launcher of `sparse_attn_wgmma.cu`: the sparse attention with the sink of the prefill / extend regime on Hopper's
warpgroup MMA (the .cu's header has the layout, the pipeline and the math: the official kernel's, as
`kernels/triton/sparse_attn.py`'s Triton form).

`sparse_attn_wgmma(q, kv, sink, idx, scale, initial_max, out, sms, q_norm=None)`: q [T, H, 512] bf16, kv [N, 512]
bf16, sink [H] fp32, idx [T, K] int32 (-1 = skip), out [T, H, 512] bf16 (dense last dim), sms the device's SM count
-> out; q_norm = (eps, table): q is the raw query projection, normed per head and its last 64 dims rotated by
table (`rope.rope_table32`'s fp32 [2, T, 32]) inside the kernel (the .cu's QNORM). `problems(...)` lists what
keeps inputs off the kernel (empty: it can run them); `usable(device)`: compute capability exactly 9.0 (wgmma is
sm_90a) with NVRTC and the driver.
Must not: import triton; allocate.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "sparse_attn_wgmma.cu"
HEAD_DIM, HEADS_PER_CTA, THREADS = 512, 64, 384
STAGES = 2  # kv blocks in flight: q (64 KB) and two 64 KB stages fill an SM's shared memory
_SIGNATURE = "pppppiiiffllllllppf"  # q kv sink idx out | T H K | scale initial_max | 6 strides | qcos qsin qnorm_eps
ROPE_HALF = 32  # the .cu's: the query's rope pairs with QNORM
_KERNELS: dict[tuple, CudaKernel] = {}


def smem_bytes(stages: int = STAGES) -> int:
    """q, the kv ring, two P tiles, the row max / sum exchange, the mbarriers, 1024 bytes of alignment slack."""
    return 65536 + stages * 65536 + 2 * 8192 + 2 * 2 * 64 * 4 + 8 * (2 + 2 * stages) + 1024


def defines(stages: int = STAGES, mn_swap: int = 0, pipelined: bool = True, qnorm: bool = False) -> dict[str, int]:
    """The build's compile-time constants (the .cu's STAGES, MN_SWAP, PIPELINED_QK, QNORM)."""
    return {"STAGES": stages, "MN_SWAP": mn_swap, "PIPELINED_QK": int(pipelined), "QNORM": int(qnorm)}


def kernel(stages: int = STAGES, mn_swap: int = 0, pipelined: bool = True, qnorm: bool = False) -> CudaKernel:
    key = (stages, mn_swap, pipelined, qnorm)
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "sparse_attn_wgmma", _SIGNATURE,
                                   defines(stages, mn_swap, pipelined, qnorm), arch_suffix="a", pdl=True)
    return _KERNELS[key]


def usable(device: torch.device) -> bool:
    """A CUDA device of compute capability exactly 9.0 (wgmma is sm_90a) with NVRTC and the driver."""
    return runtime.sm90a_usable(device)


def problems(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> list[str]:
    """What keeps these (already contract-checked) inputs off the kernel, each naming the argument; empty: it can
    run them."""
    found = []
    if q.shape[-1] != HEAD_DIM or q.shape[1] % HEADS_PER_CTA:
        found.append(f"q {tuple(q.shape)}: the kernel takes head dim {HEAD_DIM} and a multiple of "
                     f"{HEADS_PER_CTA} heads")
    for name, x in (("q", q), ("kv", kv), ("out", out)):
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s % 8 for s in x.stride()[:-1]):
            found.append(f"{name} needs 16-byte aligned rows with a dense last dim, got strides {x.stride()}")
    if idx.dtype != torch.int32 or idx.stride(-1) != 1:
        found.append(f"idx must be int32 with unit column stride, got {idx.dtype} strides {idx.stride()}")
    return found


def sparse_attn_wgmma(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                      initial_max: float, out: torch.Tensor, sms: int, mn_swap: int = 0,
                      pipelined: bool = True, q_norm: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
    """Launch into `out` and return it (ValueError naming every problem, before any launch). sms: the device's SM
    count (the persistent CTAs' grid; the caller's cached `fp8_gemm.sm_count`); mn_swap: the layout check's other
    descriptor form (tests only); pipelined False: the build whose wgmmas ptxas serializes (PIPELINED_QK 0: the
    same bits, ~14% slower on an H200; tests and the bench only); q_norm (eps, table): the raw queries normed and
    rotated in the kernel (QNORM)."""
    found = problems(q, kv, idx, out)
    T, H, _ = q.shape
    table = None
    if q_norm is not None:
        table = q_norm[1]
        if (table.dtype != torch.float32 or tuple(table.shape) != (2, T, ROPE_HALF) or not table.is_contiguous()
                or table.device != q.device):
            found.append(f"q_norm's table must be rope_table32's contiguous fp32 [2, {T}, {ROPE_HALF}] on {q.device}, "
                         f"got {table.dtype} {tuple(table.shape)} on {table.device}")
    if found:
        raise ValueError("sparse_attn_wgmma: " + "; ".join(found))
    if T == 0:
        return out
    items = T * (H // HEADS_PER_CTA)  # (token, 64-head block) pairs: a persistent CTA an SM walks them
    cos, sin = (table[0], table[1]) if table is not None else (sink, sink)  # (unread without QNORM)
    kernel(STAGES, mn_swap, pipelined, q_norm is not None).launch(
        (min(items, sms), 1, 1), (THREADS, 1, 1),
        (q, kv, sink, idx, out, T, H, idx.shape[1], float(scale), float(initial_max),
         q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1), cos, sin,
         float(q_norm[0]) if q_norm is not None else 0.0),
        q.device, shared=smem_bytes())
    return out
