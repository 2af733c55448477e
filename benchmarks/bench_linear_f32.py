"""Ops linear_f32 / blinear at batched decode: cuBLAS (split-K GEMM + splitKreduce) against the Triton
swap-AB form (kernels/triton/bf16_linear_swap.py) at the V4-Flash decode slice's calls (K = 4096: the MoE
gate N=256, the compressors' stacked wkv|wgate N=512 / 1024 / 2048, the indexer's weights_proj N=64), per
call as the median of CUDA-graph replays of 32 calls over as many weight copies (the weights L2-cold, as in
a step), against the HBM copy rate of the same run. Optional plan overrides sweep the form's tiles.

    PYTHONPATH=$PWD python benchmarks/bench_linear_f32.py [--rows 16 32 64 128 256] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import copy_bandwidth_gbs  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

SHAPES = (256, 512, 1024, 2048, 64)
SWEEP = (dict(PROGRAMS_PER_SM=1), dict(PROGRAMS_PER_SM=4), dict(BK=64), dict(num_stages=4), dict(num_warps=8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    from deepinfer.kernels import bf16_gemm
    from deepinfer.kernels.triton import bf16_linear_swap as sw

    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: HBM copy {copy:.0f} GB/s; us per call (GB/s of weights)")
    g = torch.Generator(device="cuda").manual_seed(0)
    calls = 32
    for m in args.rows:
        x = torch.randn(m, 4096, generator=g, device="cuda").bfloat16()
        for n in SHAPES:
            ws = [(torch.randn(n, 4096, generator=g, device="cuda") * 0.02).bfloat16() for _ in range(calls)]
            nbytes = ws[0].numel() * 2
            cub = graph_replay_ms(lambda: [bf16_gemm.linear_f32_cublas(x, w) for w in ws]) / calls * 1e3
            ours = graph_replay_ms(lambda: [sw.linear(x, w, torch.float32) for w in ws]) / calls * 1e3
            p = sw.plan(m, n, 4096, 132)
            line = (f"M={m:3d} N={n:5d}  cublas {cub:6.1f} us ({nbytes / cub / 1e3:5.0f})  swap {ours:6.1f} us "
                    f"({nbytes / ours / 1e3:5.0f}, {nbytes / ours / 1e3 / copy:4.0%} of copy)  "
                    f"BT {p['BT']} splits {p['SPLITS']}")
            if args.sweep:
                for cfg in SWEEP:
                    extra = dict(cfg)
                    pps = extra.pop("PROGRAMS_PER_SM", None)
                    if pps:
                        base = -(-n // sw.BW) * -(-m // p["BT"])
                        extra["SPLITS"] = max(1, min(round(pps * 132 / base), 16, max(1, 4096 // (2 * m))))
                    t = graph_replay_ms(lambda: [sw.linear(x, w, torch.float32, extra) for w in ws]) / calls * 1e3
                    line += f" | {cfg} {t:5.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
