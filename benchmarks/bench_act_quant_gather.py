"""`act_quant.act_quant_gather` (the prefill experts' wgmma operand: act_quant, gathered into the routing's sorted
order, each 128 columns in `wgmma_k_order`) at the 8k prefill's two shapes under program sizes around its
default: x [T, 4096] at top-6 (w13's operand, each token's row written 6 times) and h [6T, 2048] (w2's). Its 8
calls took 2.5 ms of the H200's 8k prefill (thirty-seventh session), ~3x what their bytes take at the copy rate.

Each row: CUDA-graph replay median of one call; GB/s = the bytes it must move (the gathered rows written once,
the source rows read once) over that time, against the copy rate measured in the same run; checked bit-equal
to the default plan's output.

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/bench_act_quant_gather.py [--t 8192]

Must not: be imported by the package.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import copy_bandwidth_gbs  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

E, K_TOP, D, I, BT = 256, 6, 4096, 2048, 128
PLANS = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8), (8192, 16)]  # (elems, num_warps)


def main() -> None:
    from deepinfer.kernels.triton.act_quant import GATHER_ELEMS, GATHER_WARPS, act_quant_gather
    from deepinfer.kernels.triton.fp4_moe import route_slots

    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8192)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s (read + write)", flush=True)
    torch.manual_seed(0)
    t = args.t
    ids = torch.stack([torch.randperm(E, device=dev)[:K_TOP] for _ in range(t)])
    sorted_slots, block_expert = route_slots(ids, E, BT)
    n_slots = t * K_TOP
    cases = {"x (w13)": (torch.randn(t, D, device=dev).to(torch.bfloat16), K_TOP),
             "h (w2)": (torch.randn(n_slots, I, device=dev).to(torch.bfloat16), 1)}
    used = (block_expert >= 0).repeat_interleave(BT)  # the rows a call writes (used routing blocks)
    real_rows = int(used.sum())
    for name, (x, row_div) in cases.items():
        moved = real_rows * x.shape[1] * 2 + x.numel() * 2
        ref = act_quant_gather(x, 128, sorted_slots, block_expert, n_slots, row_div, BT)
        for elems, warps in PLANS:
            out = act_quant_gather(x, 128, sorted_slots, block_expert, n_slots, row_div, BT, elems=elems,
                                   num_warps=warps)
            same = torch.equal(out[used], ref[used])
            ms = graph_replay_ms(lambda: act_quant_gather(x, 128, sorted_slots, block_expert, n_slots, row_div, BT,
                                                          elems=elems, num_warps=warps))
            gbps = moved / ms / 1e6
            tag = " (default)" if (elems, warps) == (GATHER_ELEMS, GATHER_WARPS) else ""
            print(f"{name:<8} T={t} elems {elems:5d} warps {warps:2d}{tag:<10} {ms * 1e3:8.1f} us  {gbps:6.0f} GB/s "
                  f"({gbps / copy:5.1%} of copy)  same bits {same}", flush=True)


if __name__ == "__main__":
    main()
