"""What loading the first weight stages before the PDL wait gives the TMA-fed FP8 linears (EARLY_WEIGHTS in
fp8_linear_wgmma.cu, the batched-decode form, and fp8_linear_prefill.cu, the prefill form):

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bench_linear_early.py [--ms 32 128] [--prefill-ms 1024]

A chain of the V4-Flash layer's six FP8 linears (the fast params' stacking) is captured in one CUDA graph, each
op its act_quant pass, the GEMM and (where it splits K) the split sum, as in a decode step; the replay's median
(`graph_replay_ms`, L2 flushed between replays) with EARLY 1 against EARLY 0 (the default), alternating, in one
process. Every pair first checks the two builds give the same bits (they must: only the order of the copies
moves). The prefill form runs where the op's mma="fp8_wgmma" can (sm_90, V4's 128-blocks).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import QuantLinearWeight
from deepinfer.kernels.triton.fp8_gemm import fp8_linear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

SHAPES = ((4096, 1536, "wq_a+wkv"), (1024, 32768, "wq_b"), (8192, 4096, "wo_b"), (4096, 4096, "shared w13"),
          (2048, 4096, "shared w2"), (1024, 8192, "index wq_b"))


def _weight(n: int, k: int, g: torch.Generator) -> QuantLinearWeight:
    w = torch.randn(n, k, device="cuda", generator=g) * torch.exp(torch.randn(n, 1, device="cuda", generator=g))
    q, s = formats.quant_fp8_blocks(w, 128)
    return QuantLinearWeight(q, formats.e8m0_to_float(s), 128, 128)


def _chain(xs, ws, outs, config, mma):
    return lambda: [fp8_linear(x, w, config, mma=mma, out=o) for x, w, o in zip(xs, ws, outs)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prefill-ms", type=int, nargs="*", default=[1024])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(5)
    ws = [_weight(n, k, g) for k, n, _ in SHAPES]
    print(torch.cuda.get_device_name())
    for m, mma in [(m, None) for m in args.ms] + [(m, "fp8_wgmma") for m in args.prefill_ms]:
        xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for k, _, _ in SHAPES]
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _, n, _ in SHAPES]
        early = [o.clone() for o in _chain(xs, ws, outs, {"EARLY": 1}, mma)()]
        late = _chain(xs, ws, outs, {"EARLY": 0}, mma)()
        same = all(torch.equal(a, b) for a, b in zip(early, late))
        times = {1: [], 0: []}
        for _ in range(args.rounds):
            for e in (1, 0):
                times[e].append(graph_replay_ms(_chain(xs, ws, outs, {"EARLY": e}, mma)) * 1e3)
        best = {e: min(v) for e, v in times.items()}
        print(f"M={m:5d} {mma or 'auto'}: six linears early {best[1]:8.1f} us, late {best[0]:8.1f} us "
              f"({best[0] - best[1]:+.1f} us) | rounds early {[round(v, 1) for v in times[1]]} late "
              f"{[round(v, 1) for v in times[0]]} | same bits {same}")


if __name__ == "__main__":
    main()
