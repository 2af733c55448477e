"""Time ops "linear_f32" / "blinear" at decode rows: cuBLAS (`bf16_gemm.linear_f32_cublas`: split-K GEMM +
splitKreduce at M = 1) against the one-launch Triton GEMV (deepinfer/kernels/triton/bf16_gemv.py), on V4-Flash's
decode shapes, and sweep the GEMV's tiles to set `_gemv_tiles` (provisional until this has run). One device call:

    PYTHONPATH=$PWD python benchmarks/bench_gemv.py [--budget 420] [--no-sweep] [--head]
        [--tiles "BN,BK,warps[,stages];..."]   # sweep these tiles instead of the default grid
        [--k 5120 --ns 64,384,512,2048]        # other shapes (these: V4.1-Flash's; the names then say "N=...")

Shapes (K = 4096 = dim, V4-Flash config): N = 64 (indexer weights_proj, blinear), 256 (MoE gate; the indexer's
compressor wkv / wgate: ratio 4 -> 2 x index_head_dim 128), 512 (main compressor wkv / wgate at ratio 128:
head_dim 512), 1024 (main compressor at ratio 4: 2 x 512), 2048; --head adds the LM head (N = 129280, 1 GB).
M in 1, 2, 4, 8, 16, 32 (16 and 32 > GEMV_MAX_ROWS: the GEMV is launched directly, to see where the limit should sit).
Time: a CUDA graph of back-to-back calls over copies of the weight (>= 4x the L2 size in all, so each call
reads its weight from HBM as in a decode step), replayed (`timing.graph_replay_ms`), divided by the number of
calls: device time per call including the in-graph launch gaps. GB/s: the weight's bytes (N K 2) per call time
(the H200's copy ceiling is ~4.2 TB/s). Each row also checks the GEMV against cuBLAS (rel_err, fp32 outputs).
Writes $OUT/bench_gemv.json when $OUT is set. Needs CUDA and triton.
Results: results/gemv_h200_2026-12-02_s4.log (H200; the tile rule and GEMV_MAX_WORK come from it).
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

from deepinfer.kernels import bf16_gemm
from deepinfer.kernels.triton import bf16_gemv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

K = 4096
SHAPES = ((64, "indexer weights_proj"), (256, "MoE gate / idx-compressor wkv,wgate"),
          (512, "compressor wkv,wgate r=128"), (1024, "compressor wkv,wgate r=4"), (2048, "N=2048"))
HEAD = (129280, "LM head")
MS = (1, 2, 4, 8, 16, 32)
SWEEP_MS = (1, 4, 16)


def _copies_k(n: int, k: int) -> list[torch.Tensor]:
    """Copies of one random bf16 weight [n, k], >= 4x the L2 size in all (at least 2, at most 512)."""
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return [w.clone() for _ in range(max(2, min(512, math.ceil(4 * l2 / (2 * n * k)))))]


def _per_call_us(op, x, weights) -> float:
    def calls():
        for w in weights:
            op(x, w)
    return graph_replay_ms(calls, warmup_ms=5, rep_ms=40) * 1e3 / len(weights)


def _gemv(tiles: dict | None):
    return lambda x, w: bf16_gemv._launch(x, w, torch.float32, tiles, max_rows=max(MS))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _sweep_tiles(spec: str | None, m: int) -> list[dict]:
    if spec:
        out = []
        for item in spec.split(";"):
            v = [int(s) for s in item.split(",")]
            out.append(dict(BN=v[0], BK=v[1], num_warps=v[2], num_stages=v[3] if len(v) > 3 else 2))
        return out
    mp = triton.next_power_of_2(m)
    grid = []
    for bn in (1, 2, 4, 8, 16):
        for bk in (128, 256, 512, 1024, 2048, 4096):
            for warps in (4, 8):
                per_thread = mp * bn * bk // (32 * warps)
                if 16 <= per_thread <= 128:  # outside: idle lanes, or spills
                    grid.append(dict(BN=bn, BK=bk, num_warps=warps, num_stages=2))
    return grid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; rows after it are skipped")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--head", action="store_true", help="also the LM head (N = 129280)")
    ap.add_argument("--tiles", default=None, help='sweep these: "BN,BK,warps[,stages];..."')
    ap.add_argument("--k", type=int, default=K, help="the weights' K (default V4-Flash's dim)")
    ap.add_argument("--ns", default=None, help="comma-separated N to time instead of V4-Flash's shapes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv: needs CUDA")
    k = args.k
    torch.manual_seed(0)
    start, end = time.time(), time.time() + args.budget
    dev = torch.cuda.get_device_properties(0)
    print(f"{dev.name}, {dev.multi_processor_count} SMs, triton {triton.__version__}, torch {torch.__version__}")
    shapes = tuple((int(n), f"N={n}") for n in args.ns.split(",")) if args.ns else SHAPES
    shapes += (HEAD,) if args.head else ()
    rows, sweep = [], []
    print(f"\n== linear_f32, K={k}: us per call (graph replay, L2-cold weights) and weight GB/s ==")
    print(f"{'N':>6s} {'M':>3s} | {'cuBLAS':>16s} | {'GEMV (rule)':>16s} | {'speedup':>7s} | {'rel_err':>8s} | tiles")
    for n, name in shapes:
        weights = _copies_k(n, k)
        nbytes = 2 * n * k
        for m in MS:
            if time.time() > end:
                rows.append(dict(N=n, M=m, skipped="time budget"))
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rec = dict(N=n, M=m, name=name, tiles=bf16_gemv._gemv_tiles(m, n, k))
            try:
                rec["cublas_us"] = _per_call_us(bf16_gemm.linear_f32_cublas, x, weights)
                rec["gemv_us"] = _per_call_us(_gemv(None), x, weights)
                rec["rel_err"] = _rel(_gemv(None)(x, weights[0]), bf16_gemm.linear_f32_cublas(x, weights[0]))
                print(f"{n:6d} {m:3d} | {rec['cublas_us']:6.2f} us {nbytes / rec['cublas_us'] / 1e3:5.0f} GB/s | "
                      f"{rec['gemv_us']:6.2f} us {nbytes / rec['gemv_us'] / 1e3:5.0f} GB/s | "
                      f"{rec['cublas_us'] / rec['gemv_us']:6.2f}x | {rec['rel_err']:8.1e} | {rec['tiles']}  {name}",
                      flush=True)
            except Exception as err:  # one failing row must not hide the others
                rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"{n:6d} {m:3d} FAILED {rec['error']}", flush=True)
            rows.append(rec)
        if not args.no_sweep and n != HEAD[0]:
            for m in SWEEP_MS:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                best = None
                for tiles in _sweep_tiles(args.tiles, m):
                    if time.time() > end:
                        sweep.append(dict(N=n, M=m, tiles=tiles, skipped="time budget"))
                        break
                    rec = dict(N=n, M=m, tiles=tiles)
                    try:
                        rec["us"] = _per_call_us(_gemv(tiles), x, weights)
                        if best is None or rec["us"] < best["us"]:
                            best = rec
                    except Exception as err:
                        rec["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                    sweep.append(rec)
                    print(f"  sweep N={n:5d} M={m:2d} {str(tiles):62s} "
                          + (f"{rec['us']:6.2f} us {nbytes / rec['us'] / 1e3:5.0f} GB/s" if "us" in rec
                             else f"FAILED {rec['error']}"), flush=True)
                if best is not None:
                    print(f"  best  N={n:5d} M={m:2d} {best['tiles']} {best['us']:.2f} us "
                          f"(rule {bf16_gemv._gemv_tiles(m, n, k)})", flush=True)
        del weights
        torch.cuda.empty_cache()
    skipped = sum("skipped" in r for r in rows + sweep)
    print(f"{len(rows)} rows, {len(sweep)} sweep points, {skipped} skipped (budget {args.budget:.0f} s); "
          f"{time.time() - start:.0f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_gemv.json"), "w") as f:
            json.dump(dict(device=dev.name, K=k, rows=rows, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
