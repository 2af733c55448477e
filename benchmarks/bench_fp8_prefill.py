"""The prefill's FP8 linears (op "fp8_linear" from FP8_MMA_MIN_M rows, the official fp8_gemm math): the Triton
"fp8" form against the TMA-fed wgmma CUDA kernel (kernels/cuda/fp8_linear_prefill.cu), at V4-Flash's prefill
shapes, and the CUDA kernel's tile plans. One device call (~1-2 min on an H200):

    PYTHONPATH=$PWD python benchmarks/bench_fp8_prefill.py [--ms 1024 8192] [--sweep]

Shapes (K, N, name): the layer's six FP8 GEMMs with the fast params' stacking (wq_a + wkv, shared w1 + w3).
Times: `triton.testing.do_bench` medians (L2 cleared between calls) of the whole op (act_quant + GEMM) and of
the GEMM alone (the same act_quant codes for both forms); TFLOP/s = 2 M N K over the GEMM alone, against the
FP8 matmul ceiling measured in the same run (`ceilings.fp8_matmul_tflops`: cuBLASLt, no block scales). Every
row first checks the two forms' outputs are the same bits (they must be: the .cu's header).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

from deepinfer import formats
from deepinfer.kernels.cuda import fp8_linear_prefill as pf
from deepinfer.kernels.quant_weights import QuantLinearWeight
from deepinfer.kernels.triton.act_quant import act_quant
from deepinfer.kernels.triton.fp8_gemm import fp8_linear, sm_count

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import fp8_matmul_tflops  # noqa: E402

SHAPES = ((4096, 1536, "wq_a+wkv"), (1024, 32768, "wq_b"), (8192, 4096, "wo_b"), (4096, 4096, "shared w13"),
          (2048, 4096, "shared w2"), (1024, 8192, "index wq_b"))
SWEEP = (dict(PERSIST=1), dict(PERSIST=1, GROUP_M=16), dict(PERSIST=1, STAGES=4), dict(PIPE=1), dict(GROUP_M=16),
         dict(GROUP_M=1))


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _weight(n: int, k: int) -> QuantLinearWeight:
    w = torch.randn(n, k, device="cuda") * torch.exp(torch.randn(n, 1, device="cuda"))
    q, s = formats.quant_fp8_blocks(w, 128)
    return QuantLinearWeight(q, formats.e8m0_to_float(s), 128, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--sweep", action="store_true", help="also time the CUDA kernel's other tile plans")
    args = ap.parse_args()
    peak = fp8_matmul_tflops()
    sms = sm_count(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: FP8 matmul ceiling {peak:.0f} TFLOP/s (cuBLASLt 8192^3)")
    totals: dict[tuple[int, str], float] = {}
    for k, n, name in SHAPES:
        w = _weight(n, k)
        for m in args.ms:
            x = (torch.randn(m, k, device="cuda") * torch.exp(torch.randn(m, 1, device="cuda"))).to(torch.bfloat16)
            xq, xs = act_quant(x, 128)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            tri = fp8_linear(x, w, mma="fp8")
            cuda = fp8_linear(x, w, mma="fp8_wgmma")
            same = torch.equal(tri, cuda)
            flop = 2.0 * m * n * k
            cfg = pf.tiles()
            op_t, op_c = _ms(lambda: fp8_linear(x, w, mma="fp8")), _ms(lambda: fp8_linear(x, w, mma="fp8_wgmma"))
            gemm_c = _ms(lambda: pf.fp8_linear_prefill(xq, xs, w, out, cfg, sms))
            aq = _ms(lambda: act_quant(x, 128))
            gemm_t = op_t - aq  # the Triton form's GEMM alone: its op less the same act_quant pass
            for key, v in (("triton", gemm_t), ("cuda", gemm_c)):
                totals[(m, key)] = totals.get((m, key), 0.0) + v
            print(f"{name:11s} K={k:5d} N={n:5d} M={m:5d} | same bits {same} | op: triton {op_t * 1e3:8.1f} us, "
                  f"cuda {op_c * 1e3:8.1f} us | GEMM alone: triton ~{gemm_t * 1e3:8.1f} us "
                  f"({flop / gemm_t / 1e9:6.0f} TFLOP/s), cuda {gemm_c * 1e3:8.1f} us ({flop / gemm_c / 1e9:6.0f} "
                  f"TFLOP/s = {flop / gemm_c / 1e9 / peak:5.1%} of the ceiling) | act_quant {aq * 1e3:6.1f} us")
            if args.sweep:
                for extra in SWEEP:
                    c = pf.tiles(extra)
                    t = _ms(lambda: pf.fp8_linear_prefill(xq, xs, w, out, c, sms))
                    print(f"    {str(extra):18s} -> {c}: {t * 1e3:8.1f} us ({flop / t / 1e9:6.0f} TFLOP/s)")
    for m in args.ms:
        t, c = totals[(m, "triton")], totals[(m, "cuda")]
        print(f"M={m}: the layer's six GEMMs triton ~{t * 1e3:.1f} us, cuda {c * 1e3:.1f} us ({t / c:.2f}x)")


if __name__ == "__main__":
    main()
