"""How fast can the decode expert kernel's loads alone go? A diagnostic for kernels/cuda/fp4_moe_mma.cu.

    PYTHONPATH=$PWD python benchmarks/bench_moe_load_bound.py [--ts 8,32,128]

For each batch T (V4-Flash dims, random top-6 routing over 256 experts), the two expert GEMM launches of the
op (w13 over D, w2 over I; routing, act_quant and the reduce kernels left out) are timed by CUDA-graph
replay with the op's own plan (`fp4_moe.plan_mma`), then with the same tiles compiled LOAD_ONLY (the same
global loads of weights, scales and activations, folded by an XOR instead of expanded and multiplied:
garbage out), then LOAD_ONLY with deeper register pipelines. Bytes: FP4 + E8M0 of every expert the batch
touches, over the time (GB/s, % of the copy bandwidth measured in the same run).
Last, the TMA-fed kernel (fp4_moe_tma.cu, its own plan) on the same launches: the kernel that is meant to
bring the GEMM to the loads' speed.
If LOAD_ONLY is far faster than the GEMM, the expansion and MMAs (issue, dependencies) are what the kernel
waits on; if it is about as slow, the load pattern itself (bytes in flight per SM) is.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp4_moe import D, E, I, K_TOP, bank  # noqa: E402
from ceilings import copy_bandwidth_gbs  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

from deepinfer.kernels.cuda import fp4_moe_mma as mma  # noqa: E402
from deepinfer.kernels.cuda import fp4_moe_tma as tma  # noqa: E402
from deepinfer.kernels.triton.fp4_moe import plan_mma, plan_tma, route_slots  # noqa: E402

VARIANTS = (("gemm (the op's plan)", {}), ("loads only", {"LOAD_ONLY": 1}),
            ("loads only, 4 stages", {"LOAD_ONLY": 1, "STAGES": 4}),
            ("loads only, 1 m16 tile/warp", {"LOAD_ONLY": 1, "MT": 1}),
            ("loads only, 8 warps", {"LOAD_ONLY": 1, "WARPS": 8}),
            ("gemm, 4 stages", {"STAGES": 4}), ("tma gemm (fp4_moe_tma.cu)", {"TMA": True}),
            ("tma gemm, MT2 x 4 stages", {"TMA": True, "MT": 2, "STAGES": 4}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="8,32,128")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b = bank(dev)
    copy = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    per_expert = b.w13[0].numel() + b.w13_scale[0].numel() + b.w2[0].numel() + b.w2_scale[0].numel()
    print(f"copy bandwidth {copy:.0f} GB/s")
    for t in (int(v) for v in args.ts.split(",")):
        ids = torch.stack([torch.randperm(E, device=dev)[:K_TOP] for _ in range(t)]).to(torch.int64)
        n_slots, touched = t * K_TOP, int(torch.unique(ids).numel())
        sorted_slots, block_expert = route_slots(ids, E, mma.TOKENS)
        xa = torch.randn(t, D, device=dev).to(torch.bfloat16)
        ha = torch.randn(n_slots, I, device=dev).to(torch.bfloat16)
        for name, extra in VARIANTS:
            kern = tma if "TMA" in extra else mma
            plan = plan_tma if "TMA" in extra else plan_mma
            cfg = plan(n_slots, E, D, I, sms, {"MMA_SYNC": True, **extra})  # tiles from extra, splits planned
            part = torch.empty((cfg["S13"], n_slots, 2 * I), dtype=torch.float32, device=dev)
            rows = torch.empty((cfg["S2"], n_slots, D), dtype=torch.float32, device=dev)

            def both():
                kern.expert_gemm_partials(xa, b.w13, b.w13_scale, part, sorted_slots, block_expert, n_slots, K_TOP, cfg)
                kern.expert_gemm_partials(ha, b.w2, b.w2_scale, rows, sorted_slots, block_expert, n_slots, 1, cfg)

            try:
                ms = graph_replay_ms(both)
            except Exception as err:  # a tile that does not fit: report, go on
                print(f"T={t:4d} {name}: FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            gbs = touched * per_expert / (ms * 1e-3) / 1e9
            tiles = (f"MT{cfg['MT']} cw{cfg['CWARPS']} st{cfg['STAGES']} S13={cfg['S13']} S2={cfg['S2']}" if kern is tma
                     else f"MT{cfg['MT']} w{cfg['WARPS']} st{cfg['STAGES']} k{cfg['KSTEP']} S13={cfg['S13']} S2={cfg['S2']}")
            print(f"T={t:4d} {touched:3d} experts {name:30s} {tiles:32s} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s "
                  f"({100 * gbs / copy:4.1f}% of copy)", flush=True)


if __name__ == "__main__":
    main()
