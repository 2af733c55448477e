"""Time ops "linear_f32" / "blinear" at 9..256 rows: cuBLAS (`bf16_gemm.linear_f32_cublas`: a split-K GEMM +
splitKreduce at these sizes) against the one-launch Triton tensor-core GEMM (deepinfer/kernels/triton/
bf16_skinny.py), on V4-Flash's decode shapes, and sweep its tiles to check `bf16_skinny.tiles`. One device call:

    PYTHONPATH=$PWD python benchmarks/bench_skinny_gemm.py [--budget 300] [--no-sweep]
        [--k 4096 --ns 64,256,512,1024,2048]   # other shapes (V4.1-Flash: --k 5120 ...)

Shapes (K = 4096, V4-Flash): N = 64 (indexer weights_proj, blinear), 256 (MoE gate), 512 (the indexer
compressor's stacked wkv | wgate), 1024 (the main compressor's at ratio 128), 2048 (at ratio 4); M = 9..256.
Time: `bench_gemv._per_call_us` (a CUDA graph of back-to-back calls over copies of the weight, >= 4x the L2 in
all, so each call reads its weight from HBM as in a decode step; device time per call with the in-graph
launch gaps). GB/s: the weight's bytes (2 N K) per call time. rel_err: fp32 outputs against cuBLAS's.
Writes $OUT/bench_skinny_gemm.json when $OUT is set. Needs CUDA and triton.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from deepinfer.kernels import bf16_gemm
from deepinfer.kernels.triton import bf16_skinny

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemv import _copies_k, _per_call_us, _rel  # noqa: E402

NS = (64, 256, 512, 1024, 2048)
MS = (9, 16, 32, 64, 128, 256)
SWEEP = ((256, 32), (256, 128), (2048, 32), (2048, 128))  # (N, M) points of the tile sweep


def _grid() -> list[dict]:
    """BW 64 / 128 (one or two wgmma M a warpgroup), BK 64..256, 3..5 stages, 4 / 8 warps, within 200 KB."""
    out = []
    for bw in (64, 128):
        for bk in (64, 128, 256):
            for stages in (3, 4, 5):
                for warps in (4, 8):
                    if (bw * bk + bk * 128) * 2 * stages <= 200 << 10 and not (warps == 8 and bw == 64):
                        out.append(dict(BW=bw, BK=bk, num_stages=stages, num_warps=warps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; rows after it are skipped")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--ns", default=None, help="comma-separated N (default V4-Flash's shapes)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_skinny_gemm: needs CUDA")
    k = args.k
    torch.manual_seed(0)
    start, end = time.time(), time.time() + args.budget
    dev = torch.cuda.get_device_properties(0)
    print(f"{dev.name}, {dev.multi_processor_count} SMs, triton {triton.__version__}, torch {torch.__version__}")
    ns = tuple(int(n) for n in args.ns.split(",")) if args.ns else NS
    rows, sweep = [], []
    print(f"\n== linear_f32, K={k}: us per call (graph replay, L2-cold weights) and weight GB/s ==")
    print(f"{'N':>6s} {'M':>3s} | {'cuBLAS':>16s} | {'skinny (rule)':>16s} | {'speedup':>7s} | {'rel_err':>8s} | tiles")
    for n in ns:
        weights = _copies_k(n, k)
        nbytes = 2 * n * k
        for m in MS:
            if time.time() > end:
                rows.append(dict(N=n, M=m, skipped="time budget"))
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rec = dict(N=n, M=m, tiles=bf16_skinny.tiles(m, n, k))
            try:
                rec["cublas_us"] = _per_call_us(bf16_gemm.linear_f32_cublas, x, weights)
                rec["skinny_us"] = _per_call_us(lambda a, b: bf16_skinny.launch(a, b, torch.float32), x, weights)
                rec["rel_err"] = _rel(bf16_skinny.launch(x, weights[0], torch.float32),
                                      bf16_gemm.linear_f32_cublas(x, weights[0]))
                print(f"{n:6d} {m:3d} | {rec['cublas_us']:6.2f} us {nbytes / rec['cublas_us'] / 1e3:5.0f} GB/s | "
                      f"{rec['skinny_us']:6.2f} us {nbytes / rec['skinny_us'] / 1e3:5.0f} GB/s | "
                      f"{rec['cublas_us'] / rec['skinny_us']:6.2f}x | {rec['rel_err']:8.1e} | {rec['tiles']}",
                      flush=True)
            except Exception as err:  # one failing row must not hide the others
                rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"{n:6d} {m:3d} FAILED {rec['error']}", flush=True)
            rows.append(rec)
        for sn, m in SWEEP if not args.no_sweep else ():
            if sn != n:
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            best = None
            for cfg in _grid():
                if time.time() > end:
                    sweep.append(dict(N=n, M=m, tiles=cfg, skipped="time budget"))
                    break
                rec = dict(N=n, M=m, tiles=cfg)
                try:
                    rec["us"] = _per_call_us(lambda a, b, c=cfg: bf16_skinny.launch(a, b, torch.float32, c),
                                             x, weights)
                    if best is None or rec["us"] < best["us"]:
                        best = rec
                except Exception as err:
                    rec["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                sweep.append(rec)
                print(f"  sweep N={n:5d} M={m:3d} {str(cfg):62s} "
                      + (f"{rec['us']:6.2f} us {nbytes / rec['us'] / 1e3:5.0f} GB/s" if "us" in rec
                         else f"FAILED {rec['error']}"), flush=True)
            if best is not None:
                print(f"  best  N={n:5d} M={m:3d} {best['tiles']} {best['us']:.2f} us "
                      f"(rule {bf16_skinny.tiles(m, n, k)})", flush=True)
        del weights
        torch.cuda.empty_cache()
    skipped = sum("skipped" in r for r in rows + sweep)
    print(f"{len(rows)} rows, {len(sweep)} sweep points, {skipped} skipped (budget {args.budget:.0f} s); "
          f"{time.time() - start:.0f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_skinny_gemm.json"), "w") as f:
            json.dump(dict(device=dev.name, K=k, rows=rows, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
