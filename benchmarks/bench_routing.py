"""fp4_moe's routing (slots grouped by expert into blocks of the GEMM's BM rows) from decode to prefill sizes:
the torch path (`align_by_expert`: sort + ~19 small kernels), the one-program Triton kernel
(`align_by_expert_small`, up to 64 slots) and the one-program-per-expert kernel (`align_by_expert_parallel`;
results/routing_h200_2026-12-02_s4.log also times the one-program chunked kernel it replaced), CUDA-graph
replay, V4-Flash routing (E=256, k=6, BM as `fp4_moe` picks it), uniform random experts. Every form's
outputs are checked against the torch path's.

    PYTHONPATH=$PWD python benchmarks/bench_routing.py [--experts 256 384] [--ts 1 8 ...] [--parallel-max SLOTS]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.kernels.triton import fp4_moe  # noqa: E402
from deepinfer.kernels.triton.fp4_moe import (SMALL_ROUTING_SLOTS, _config, align_by_expert,  # noqa: E402
                                             align_by_expert_parallel, align_by_expert_small)
from timing import graph_replay_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="*", default=[256], help="E (V4-Flash 256, V4.1-Flash 384)")
    ap.add_argument("--ts", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256, 1024, 2048, 8192])
    ap.add_argument("--parallel-max", type=int, default=0,
                    help="time the per-expert kernel up to this many slots (default: where route_slots takes it)")
    args = ap.parse_args()
    limit = fp4_moe.PARALLEL_ROUTING_SLOTS
    if args.parallel_max:
        fp4_moe.PARALLEL_ROUTING_SLOTS = max(limit, args.parallel_max)  # the kernel's own argument check
    rows = []
    for e in args.experts:
        for t in args.ts:
            n = 6 * t
            bm = _config(n, e)["BM"]
            ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :6].contiguous()  # k distinct experts a token
            forms = [("torch", align_by_expert)]
            if n <= SMALL_ROUTING_SLOTS:
                forms.append(("small kernel", align_by_expert_small))
            if n <= max(limit, args.parallel_max):
                forms.append(("per-expert kernel", align_by_expert_parallel))
            want = align_by_expert(ids, e, bm)
            for name, fn in forms:
                got = fn(ids, e, bm)
                same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                us = graph_replay_ms(lambda: fn(ids, e, bm)) * 1e3
                rows.append(f"E={e} T={t:5d} ({n:5d} slots, BM {bm:3d}) {name:18s} {us:8.1f} us  same={same}")
                print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
