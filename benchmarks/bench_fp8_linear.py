"""Time op "fp8_linear" (deepinfer/kernels/triton/fp8_gemm.py) on V4-Flash shapes, both tensor-core forms
(mma "bf16": exact products; "fp8": FP8 tensor cores with per-K-group promotion), with the default split-K
plan and with split-K off (SPLIT_K=1). One device call, under ~90 s on an H200 (a time budget skips what
is left, saying so):

    PYTHONPATH=$PWD python benchmarks/bench_fp8_linear.py [--budget 75] [--no-sweep]

Shapes (K, N): (4096, 1024), (4096, 4096), (4096, 32768), (8192, 4096), (1024, 32768); 128x128 blocks (V4);
M in 1, 8, 16, 64, 128, 1024, 4096, 8192. Time: triton.testing.do_bench median (CUDA events; do_bench also
clears L2 between calls), rotating over enough copies of the weight (>= 4x the L2 size in all) that L2 cannot
serve them. GB/s over the bytes that must move (weight + scales + x + out) for M <= 16 (decode: the H200
copy ceiling is ~4.2 TB/s), TFLOP/s (2 M N K) above (FP8 dense ~1350, bf16 ~780). M = 1 also as a CUDA-graph
replay (no Python launch overhead). Then, budget permitting: a decode tile / split sweep at N = K = 4096,
a large-M FP8 tile sweep at M = 4096, and V4.1 (32x32 blocks) at M = 1 and 4096.
Writes $OUT/bench_fp8_linear.json when $OUT is set. Needs CUDA and triton.
Results: NOT YET MEASURED (written on a CPU-only machine).
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
from deepinfer.kernels.quant_weights import QuantLinearWeight
from deepinfer.kernels.triton.fp8_gemm import fp8_linear, plan, sm_count

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

SHAPES = ((4096, 1024), (4096, 4096), (4096, 32768), (8192, 4096), (1024, 32768))  # (K, N)
MS = (1, 8, 16, 64, 128, 1024, 4096, 8192)
SMALL_M = 16
VARIANTS = (("bf16", None), ("bf16", {"SPLIT_K": 1}), ("fp8", None), ("fp8", {"SPLIT_K": 1}))
COLUMNS = ("bf16 split", "bf16 S=1", "fp8 split", "fp8 S=1")


class Budget:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> bool:
        return time.time() < self.end


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def _graph_ms(fn) -> float:
    return graph_replay_ms(fn, warmup_ms=5, rep_ms=25)


def _weights(n: int, k: int, block: int) -> list[QuantLinearWeight]:
    """Copies of one random block-quantised weight, >= 4x the L2 size in all (at least 2)."""
    wq, ws = formats.quant_fp8_blocks(torch.randn(n, k, device="cuda"), block)
    scale = formats.e8m0_to_float(ws)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    copies = max(2, min(64, math.ceil(4 * l2 / (n * k))))
    return [QuantLinearWeight(wq.clone(), scale.clone(), block, block) for _ in range(copies)]


def _time(x, weights, mma, config) -> float:
    i = [0]

    def call():
        i[0] += 1
        fp8_linear(x, weights[i[0] % len(weights)], config=config, mma=mma)
    return _ms(call)


def _metric(m: int, n: int, k: int, block: int, ms: float) -> str:
    if m <= SMALL_M:
        nbytes = n * k + triton.cdiv(n, block) * triton.cdiv(k, block) * 4 + m * k * 2 + m * n * 2
        return f"{nbytes / ms / 1e6:6.0f} GB/s"
    return f"{2 * m * n * k / ms / 1e9:6.1f} TF/s"


def run(label: str, results: list, budget: Budget, m: int, n: int, k: int, block: int, x, weights, mma: str,
        config: dict | None, graph: bool = False) -> dict:
    """Time one variant and print its row; failures and budget skips become rows too."""
    rec = dict(label=label, M=m, N=n, K=k, block=block, mma=mma, config=config)
    if not budget.left():
        rec["skipped"] = "time budget"
        results.append(rec)
        return rec
    try:
        cfg = plan(m, n, k, block, block, mma, sm_count(x.device), config)
        rec.update(split=cfg["SPLIT_K"], BM=cfg["BM"], BN=cfg["BN"])
        rec["us"] = _time(x, weights, mma, config) * 1e3
        if graph:
            rec["graph_us"] = _graph_ms(lambda: fp8_linear(x, weights[0], config=config, mma=mma)) * 1e3
        rec["metric"] = _metric(m, n, k, block, rec["us"] / 1e3)
        g = f" | graph {rec['graph_us']:7.1f} us {_metric(m, n, k, block, rec['graph_us'] / 1e3)}" if graph else ""
        print(f"{label:12s} K={k:5d} N={n:5d} M={m:5d} block={block:3d} S={cfg['SPLIT_K']:2d} BM={cfg['BM']:3d} "
              f"BN={cfg['BN']:3d} {str(config or ''):40s} | {rec['us']:9.1f} us | {rec['metric']}{g}", flush=True)
    except Exception as err:  # one failing variant must not hide the others
        rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"{label} K={k} N={n} M={m} {mma} {config}: FAILED {rec['error']}", flush=True)
    results.append(rec)
    return rec


def main_grid(results: list, budget: Budget) -> dict:
    """Pass 1: the default plans of both forms everywhere; pass 2: split-K off where the plan splits."""
    table: dict = {}
    xs = {}
    for k, n in SHAPES:
        weights = _weights(n, k, 128)
        for m in MS:
            if (m, k) not in xs:
                xs[(m, k)] = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            x = xs[(m, k)]
            for col, (mma, config) in zip(COLUMNS, VARIANTS):
                if config is not None:
                    continue
                table[(k, n, m, col)] = run(col, results, budget, m, n, k, 128, x, weights, mma, config, graph=m == 1)
        for m in MS:
            x = xs[(m, k)]
            for col, (mma, config) in zip(COLUMNS, VARIANTS):
                if config is None:
                    continue
                auto = table.get((k, n, m, COLUMNS[COLUMNS.index(col) - 1]))
                if auto.get("split") == 1:
                    table[(k, n, m, col)] = auto  # the default plan does not split: same launch
                    continue
                table[(k, n, m, col)] = run(col, results, budget, m, n, k, 128, x, weights, mma, config)
        del weights
        torch.cuda.empty_cache()
    return table


def sweeps(results: list, budget: Budget) -> None:
    k = n = 4096
    weights = _weights(n, k, 128)
    x1 = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    for mma in ("bf16", "fp8"):
        for bn, split, warps, stages in ((32, 8, 4, 6), (64, 4, 4, 6), (64, 8, 4, 4), (128, 8, 4, 4),
                                         (32, 4, 4, 4), (32, 16, 4, 4), (16, 8, 4, 6)):
            cfg = dict(BM=16, BN=bn, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)
            run("sweep M=1", results, budget, 1, n, k, 128, x1, weights, mma, cfg, graph=True)
    x = torch.randn(4096, k, device="cuda").to(torch.bfloat16)
    for cfg in (dict(num_stages=3), dict(num_stages=5), dict(GROUP_M=16), dict(BM=64, BN=128, num_warps=4),
                dict(BN=64), dict(BM=128, BN=256, num_warps=8, num_stages=3), dict(LOOP_STAGES=4),
                dict(WARP_SPECIALIZE=True), dict(BK=256, num_stages=3)):
        run("sweep fp8", results, budget, 4096, n, k, 128, x, weights, "fp8", cfg)
    del weights
    weights = _weights(n, k, 32)
    for m, xx in ((1, x1), (4096, x)):
        for mma in ("bf16", "fp8"):
            run("v4.1 32x32", results, budget, m, n, k, 32, xx, weights, mma, None, graph=m == 1)


def print_table(table: dict) -> None:
    print("\n== fp8_linear, V4-Flash shapes, 128x128 blocks (us; GB/s for M <= 16, TFLOP/s above; S = split-K) ==")
    head = f"{'K':>5s} {'N':>6s} {'M':>5s} | " + " | ".join(f"{c:^24s}" for c in COLUMNS)
    print(head)
    print("-" * len(head))
    for k, n in SHAPES:
        for m in MS:
            cells = []
            for col in COLUMNS:
                rec = table.get((k, n, m, col))
                if rec is None or "us" not in rec:
                    why = "-" if rec is None else ("skipped" if "skipped" in rec else "FAILED")
                    cells.append(f"{why:^24s}")
                else:
                    cells.append(f"{rec['us']:8.1f} S{rec['split']:<2d} {rec['metric']:>11s}")
            print(f"{k:5d} {n:6d} {m:5d} | " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=75.0, help="seconds; rows after it are skipped")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_linear: needs CUDA")
    torch.manual_seed(0)
    start = time.time()
    budget = Budget(args.budget)
    results: list = []
    print(f"{torch.cuda.get_device_name(0)}, {sm_count(torch.device('cuda'))} SMs, triton {triton.__version__}")
    table = main_grid(results, budget)
    if not args.no_sweep:
        sweeps(results, budget)
    print_table(table)
    skipped = sum("skipped" in r for r in results)
    failed = sum("error" in r for r in results)
    print(f"{len(results)} rows, {failed} failed, {skipped} skipped (budget {args.budget:.0f} s); "
          f"{time.time() - start:.0f} s")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_fp8_linear.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
