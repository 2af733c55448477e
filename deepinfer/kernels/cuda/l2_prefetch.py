"""Launcher of `l2_prefetch.cu`: ask the L2 for the bytes of some tensors (weights a later kernel streams),
up to a byte budget, on the current stream. A prefetch changes no value (see the .cu's header).

`spans(tensors, budget)`: the (address, bytes) ranges the kernel takes, in the tensors' order, each trimmed
inward to 16-byte boundaries (the bulk copy's rule), the last one cut where the budget ends.
`prefetch(tensors, budget, device)`: launch over those spans (one launch per 8 spans).
`usable(device)`: a CUDA device of compute capability 9.0 or newer (the bulk prefetch is sm_90's) with NVRTC
and the driver.
`set_aside(device, nbytes)`: size the device's persisting-L2 set-aside, the part of the L2 where lines with
the evict_last policy are kept from streaming reads (the driver's default is 0 bytes, where the policy
protects nothing); once per device, clamped to the device's maximum.
Must not: import triton; read or write any tensor's values.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "l2_prefetch.cu"
RANGES = 8  # spans per launch (the kernel's parameters)
CHUNK = 32 << 10  # bytes per bulk prefetch instruction
MAX_CTAS = 132  # one warp each: at most one an SM of an H200 / H100 SXM
_SIGNATURE = "p" * RANGES + "l" * RANGES
_KERNELS: dict[tuple[int, int], CudaKernel] = {}
_SET_ASIDE: dict[int, int] = {}  # device index -> the persisting-L2 bytes set
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06  # cuda.h CUlimit
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108  # cuda.h CUdevice_attribute


def kernel(chunk: int = CHUNK, evict_last: bool = False) -> CudaKernel:
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"l2_prefetch: chunk must be a positive multiple of 16 bytes, got {chunk}")
    key = (chunk, int(evict_last))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "l2_prefetch", _SIGNATURE, {"CHUNK": chunk, "EVICT_LAST": int(evict_last)})
    return _KERNELS[key]


def usable(device: torch.device) -> bool:
    return (device.type == "cuda" and runtime.available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def spans(tensors, budget: int) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor's storage span in order, trimmed inward to 16-byte boundaries, until
    `budget` bytes are covered (the span that crosses it is cut there; tensors after it are left out).
    Tensors must be contiguous: a strided view's span would include bytes that are not its own."""
    if budget < 0:
        raise ValueError(f"l2_prefetch: budget must be >= 0 bytes, got {budget}")
    out, left = [], budget
    for t in tensors:
        if left < 16:
            break
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise ValueError(f"l2_prefetch: contiguous tensors only, got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else tuple(t.stride())}")
        start = t.data_ptr()
        lo = (start + 15) & ~15
        hi = (start + t.numel() * t.element_size()) & ~15
        size = min(hi - lo, left & ~15)
        if size >= 16:
            out.append((lo, size))
            left -= size
    return out


def prefetch(tensors, budget: int, device: torch.device, chunk: int = CHUNK, evict_last: bool = False) -> int:
    """Launch the prefetch of `spans(tensors, budget)` on the current stream of `device`; returns the bytes
    asked for. Every tensor must live on `device`."""
    tensors = list(tensors)
    wrong = [t.device for t in tensors if t.device != device]
    if wrong:
        raise ValueError(f"l2_prefetch: every tensor must be on {device}, got {wrong[0]}")
    found = spans(tensors, budget)
    k = kernel(chunk, evict_last)
    for i in range(0, len(found), RANGES):
        group = found[i : i + RANGES]
        pieces = sum(-(-size // chunk) for _, size in group)
        ptrs = [p for p, _ in group] + [0] * (RANGES - len(group))
        sizes = [s for _, s in group] + [0] * (RANGES - len(group))
        k.launch((min(MAX_CTAS, -(-pieces // 32)), 1, 1), (32, 1, 1), tuple(ptrs) + tuple(sizes), device)
    return sum(size for _, size in found)


def set_aside(device: torch.device, nbytes: int) -> int:
    """Set the persisting-L2 set-aside of `device` to `nbytes` clamped to the device's maximum (an H100 / H200
    allows 3/4 of its L2) and return the size the driver reports back; the first call per device decides,
    later ones return that size. Not during a CUDA-graph capture (the caller's warm-up comes first)."""
    import ctypes

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SET_ASIDE:
        return _SET_ASIDE[index]
    if nbytes < 0:
        raise ValueError(f"l2_prefetch.set_aside: nbytes must be >= 0, got {nbytes}")
    drv = runtime._driver()
    with torch.cuda.device(index):
        torch.cuda.current_stream().cuda_stream  # torch makes the device's primary context current
        handle, most = ctypes.c_int(), ctypes.c_int()
        runtime._check_cu(drv.cuDeviceGet(ctypes.byref(handle), index), "cuDeviceGet")
        runtime._check_cu(drv.cuDeviceGetAttribute(ctypes.byref(most), CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
                                                   handle), "cuDeviceGetAttribute(MAX_PERSISTING_L2_CACHE_SIZE)")
        runtime._check_cu(drv.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(min(nbytes, most.value))),
                          "cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)")
        got = ctypes.c_size_t()
        runtime._check_cu(drv.cuCtxGetLimit(ctypes.byref(got), CU_LIMIT_PERSISTING_L2_CACHE_SIZE),
                          "cuCtxGetLimit(PERSISTING_L2_CACHE_SIZE)")
    _SET_ASIDE[index] = got.value
    return got.value
