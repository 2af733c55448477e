"""fp8_linear at decode rows: the exact-product bf16 tensor-core form (mma "bf16", its split-K plan) against the
CUDA-core GEMV form (mma "fma": one launch, no split-K, no MMA rows of padding), on V4-Flash's decode shapes,
and a tile sweep of the GEMV. One device call:

    PYTHONPATH=$PWD python benchmarks/bench_fp8_gemv.py [--budget 150] [--tiles "BN,KB,warps,stages;..."]

Shapes (K, N): wq_a (4096, 1024), wq_b (1024, 32768), wkv (4096, 512), wo_b (8192, 4096), shared w1 / w3
(4096, 2048), shared w2 (2048, 4096), indexer wq_b (1024, 8192); 128x128 blocks. M in 1, 2, 4, 8, 16.
Time: a CUDA graph of back-to-back calls over copies of the weight (>= 4x the L2 size in all: each call reads
its weight from HBM, as in a decode step), replayed, divided by the calls: device time per call with the
in-graph launch gaps. GB/s: the weight's bytes (N K + scales) per call (H200 copy ceiling ~4.2 TB/s).
Writes $OUT/bench_fp8_gemv.json when $OUT is set. Needs CUDA and triton.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton

from deepinfer import formats
from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch
from deepinfer.kernels.triton.fp8_gemm import fp8_linear, plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

SHAPES = ((4096, 1024, "wq_a"), (1024, 32768, "wq_b"), (4096, 512, "wkv"), (8192, 4096, "wo_b"),
          (4096, 2048, "shared w1/w3"), (2048, 4096, "shared w2"), (1024, 8192, "indexer wq_b"))
MS = (1, 2, 4, 8, 16)
SWEEP_MS = (1, 4)
DEFAULT_TILES = "2,512,4,3;4,512,4,3;4,1024,4,3;8,512,4,3;8,256,4,4;16,256,8,3;4,256,4,4;8,1024,8,3"


def _copies(n: int, k: int) -> list[QuantLinearWeight]:
    wq, ws = formats.quant_fp8_blocks(torch.randn(n, k, device="cuda"), 128)
    scale = formats.e8m0_to_float(ws)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    copies = max(2, min(256, math.ceil(4 * l2 / (n * k))))
    return [QuantLinearWeight(wq.clone(), scale.clone(), 128, 128) for _ in range(copies)]


def _per_call_us(x, weights, mma, config=None) -> float:
    def calls():
        for w in weights:
            fp8_linear(x, w, config=config, mma=mma)
    return graph_replay_ms(calls, warmup_ms=5, rep_ms=30) * 1e3 / len(weights)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--tiles", default=DEFAULT_TILES)
    args = ap.parse_args()
    torch.manual_seed(0)
    end = time.time() + args.budget
    print(f"{torch.cuda.get_device_name(0)}, triton {triton.__version__}")
    rows = []
    for k, n, name in SHAPES:
        weights = _copies(n, k)
        nbytes = n * k + (n // 128) * (k // 128) * 4
        for m in MS:
            if time.time() > end:
                print(f"{name} M={m}: skipped (budget)")
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rec = dict(name=name, K=k, N=n, M=m, fma_tiles=plan(m, n, k, 128, 128, "fma", 132))
            try:
                rec["bf16_us"] = _per_call_us(x, weights, "bf16")
                rec["fma_us"] = _per_call_us(x, weights, "fma")
                want = fp8_linear_torch(x, weights[0])
                rec["fma_rel"] = _rel(fp8_linear(x, weights[0], mma="fma"), want)
                print(f"{name:13s} K={k:5d} N={n:5d} M={m:2d} | bf16 {rec['bf16_us']:6.2f} us "
                      f"{nbytes / rec['bf16_us'] / 1e3:5.0f} GB/s | fma {rec['fma_us']:6.2f} us "
                      f"{nbytes / rec['fma_us'] / 1e3:5.0f} GB/s | x{rec['bf16_us'] / rec['fma_us']:.2f} | "
                      f"rel_err {rec['fma_rel']:.1e}", flush=True)
            except Exception as err:
                rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"{name} M={m} FAILED {rec['error']}", flush=True)
            rows.append(rec)
        for m in SWEEP_MS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for spec in args.tiles.split(";"):
                if time.time() > end:
                    break
                bn, kb, warps, stages = (int(v) for v in spec.split(","))
                cfg = dict(BN=bn, KB=kb, num_warps=warps, num_stages=stages)
                try:
                    us = _per_call_us(x, weights, "fma", cfg)
                    print(f"   sweep {name:13s} M={m} {spec:12s} {us:6.2f} us {nbytes / us / 1e3:5.0f} GB/s", flush=True)
                    rows.append(dict(name=name, K=k, N=n, M=m, sweep=cfg, us=us))
                except Exception as err:
                    print(f"   sweep {name} M={m} {spec} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_fp8_gemv.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
