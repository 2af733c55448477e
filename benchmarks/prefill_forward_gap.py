"""Whether a fresh prefill's whole forward (blocks + head) costs more than its blocks beyond the head's one row:
the 8k prefill on the V4-Flash slice, measured in alternating order (blocks, full, blocks, full; 5 reps each
after 4 warm-ups of each), with each call's host launch time and the caching allocator's retries / cudaMallocs
between them, then a CPU profile of one whole forward.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/prefill_forward_gap.py [--tokens 8192]

Written 2026-12-06 (twenty-sixth session): `run_slice.py` had reported 69.5-71.0 ms for the whole 8k forward
against 59.6-65.5 ms for its blocks; in steady state (this script) they are 59.3 and 58.5 ms on the same H100,
so the gap was the first measurement's warm-up, not the forward (results/prefill_forward_gap_h100_2026-12-06_s26.log).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from deepinfer.model.context import ForwardContext, SeqContext, forward_context
    from v4_slice import SliceRunner

    runner = SliceRunner.random(args.layers, 128, args.tokens + 64)
    ctx = ForwardContext((SeqContext(0, args.tokens, 0, 0, runner._table(0)),))
    ids = runner._ids(args.tokens)

    def full():
        runner.model.forward(ids, ctx)

    def blocks():
        with forward_context(ctx):
            runner.model.hidden(ids)

    def timed(fn) -> tuple[float, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host * 1e3

    with torch.no_grad():
        for fn in (full, blocks, full, blocks):
            fn()
            fn()
        for name, fn in (("blocks", blocks), ("full", full), ("blocks", blocks), ("full", full)):
            before = torch.cuda.memory_stats()
            runs = [timed(fn) for _ in range(5)]
            after = torch.cuda.memory_stats()
            print(f"{name:6s} device ms {[round(r[0], 1) for r in runs]}  host launch ms {[round(r[1], 1) for r in runs]}  "
                  f"alloc retries {after.get('num_alloc_retries', 0) - before.get('num_alloc_retries', 0)}  "
                  f"cudaMalloc {after.get('num_device_alloc', 0) - before.get('num_device_alloc', 0)}  "
                  f"reserved {torch.cuda.memory_reserved() / 1e9:.1f} GB", flush=True)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with prof:
            full()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
