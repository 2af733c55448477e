"""The two ceilings every benchmark number is judged against, measured in the same run on the same GPU.

* HBM bandwidth: a large device-to-device copy, counting bytes read plus bytes written (METHOD.md).
* Matrix peaks: an 8192^3 bf16 product through torch, and an FP8 e4m3 product through `torch._scaled_mm`
  (the vendor library's FP8 path), both on random data (zeros run faster and would flatter the peak).
Datasheet rates are only leads; these are the numbers BENCHMARKS.md divides by.
"""
from __future__ import annotations

import torch

from timing import cuda_time_ms


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Bytes read + written per second of a device-to-device copy of `nbytes` (GB/s, 1e9)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bf16_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, reps=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def fp8_matmul_tflops(n: int = 8192) -> float:
    """e4m3 x e4m3 -> bf16 with per-tensor scales through torch._scaled_mm (cuBLASLt FP8)."""
    a = (torch.randn(n, n, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    b = (torch.randn(n, n, device="cuda") * 0.1).to(torch.float8_e4m3fn).t()  # column-major second operand
    one = torch.ones((), device="cuda")
    ms = cuda_time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure() -> dict[str, float]:
    out = {"copy_gbs": copy_bandwidth_gbs(), "bf16_tflops": bf16_matmul_tflops()}
    try:
        out["fp8_tflops"] = fp8_matmul_tflops()
    except (RuntimeError, AttributeError) as e:  # reported, not hidden: the FP8 roofline then uses the bf16 one x2
        print(f"FP8 peak not measurable through torch._scaled_mm: {e}")
        out["fp8_tflops"] = float("nan")
    torch.cuda.empty_cache()
    return out
