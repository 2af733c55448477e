"""Time the Triton fp8_linear and fp4_moe ops on a CUDA device (median of triton.testing.do_bench, events).

fp8_linear: N=K=4096 at M = 1, 128, 4096 for V4 (128x128 blocks) and V4.1 (32x32); cuBLAS bf16 beside it.
fp4_moe: V4-Flash dims (D=4096, I=2048, E=256, k=6) at T = 1, 128, 8192, uniform random routing.
Reports ms, GB/s over the bytes that must move (weights touched once + activations) and TFLOP/s.
Usage: python scripts/bench_gemm_kernels.py   (needs CUDA and triton)

Measured on one H200, 2026-11-29 (commit 190d767; eager / CUDA-graph replay, median):
  fp8_linear 4096x4096  M=1: 21.5 / 21.6 us (781 GB/s; cuBLAS bf16 19.1 us moving twice the bytes)
                        M=128: 96 / 60 us;  M=4096: 408 us = 337 TFLOP/s (cuBLAS bf16 189 us)
                        (V4.1 32x32 blocks: M=1 50.6 eager / 21.9 graph us, M=4096 406 us)
  fp4_moe (E=256 k=6 D=4096 I=2048)  T=1: 807 / 225 us (routing alone 405 us eager: host-bound torch ops)
                        T=128: 5.2 ms (624 GB/s over the 244 experts' bytes);  T=8192: 20.1 ms = 123 TFLOP/s
The GEMMs are bound by the in-register FP4/FP8 -> bf16 expansion (integer ops per element), not by bytes.
"""
from __future__ import annotations

import torch
import triton

from deepinfer import formats
from deepinfer.kernels.quant_weights import FP4ExpertBank, QuantLinearWeight
from deepinfer.kernels.triton.fp4_moe import align_by_expert, fp4_moe
from deepinfer.kernels.triton.fp8_gemm import fp8_linear


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_ms(fn) -> float:
    """Median time of replaying `fn` captured in a CUDA graph (no Python launch overhead); nan if capture fails."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return _ms(graph.replay)
    except RuntimeError as err:
        print(f"graph capture failed: {err}")
        return float("nan")


def bench_fp8_linear(rows: list[str]) -> None:
    n = k = 4096
    for block in (128, 32):
        wq, ws = formats.quant_fp8_blocks(torch.randn(n, k, device="cuda"), block)
        w = QuantLinearWeight(wq, formats.e8m0_to_float(ws), block, block)
        wb = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        for m in (1, 128, 4096):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t = _ms(lambda: fp8_linear(x, w))
            tg = _graph_ms(lambda: fp8_linear(x, w))
            tb = _ms(lambda: x @ wb.T)
            bytes_moved = n * k + m * k * 2 + m * n * 2
            flops = 2 * m * n * k
            rows.append(f"fp8_linear block={block:3d} M={m:5d} N=K=4096 | {t * 1e3:8.1f} us | "
                        f"{bytes_moved / t / 1e6:7.0f} GB/s | {flops / t / 1e9:6.1f} TFLOP/s | graph {tg * 1e3:6.1f} us | cuBLAS bf16 {tb * 1e3:7.1f} us")


def bench_fp4_moe(rows: list[str]) -> None:
    e, d, i, k = 256, 4096, 2048, 6

    def scales(*shape):
        return torch.randint(119, 129, shape, dtype=torch.uint8, device="cuda")

    bank = FP4ExpertBank(torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, device="cuda"), scales(e, 2 * i, d // 32),
                         torch.randint(0, 256, (e, d, i // 2), dtype=torch.uint8, device="cuda"), scales(e, d, i // 32), 128)
    per_expert_bytes = (2 * i * d + d * i) // 2 + (2 * i * d + d * i) // 32
    for t in (1, 128, 8192):
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
        w = torch.rand(t, k, device="cuda")
        ms = _ms(lambda: fp4_moe(x, ids, w, bank, 10.0))
        route_ms = _ms(lambda: align_by_expert(ids, e, 16 if t < 64 else 128))
        graph_ms = _graph_ms(lambda: fp4_moe(x, ids, w, bank, 10.0))
        touched = int(torch.unique(ids).numel())
        bytes_moved = touched * per_expert_bytes + t * d * 2 + t * d * 4
        flops = 2 * t * k * 3 * d * i
        rows.append(f"fp4_moe T={t:5d} (E=256 k=6 D=4096 I=2048, {touched} experts) | {ms * 1e3:8.1f} us | "
                    f"{bytes_moved / ms / 1e6:7.0f} GB/s | {flops / ms / 1e9:6.1f} TFLOP/s | "
                    f"CUDA graph {graph_ms * 1e3:8.1f} us | routing alone {route_ms * 1e3:6.1f} us")


def main() -> None:
    torch.manual_seed(0)
    rows: list[str] = []
    bench_fp8_linear(rows)
    bench_fp4_moe(rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
