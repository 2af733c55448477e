"""The MoE's routing at decode: op "moe_route"'s one launch (kernels/triton/moe_route.py) against the four ops
it replaces (the gate's GEMV, the gate, `fp4_moe.route_slots` in blocks of 8, act_quant_dequant_bf16(x)),
by rows, for V4-Flash's gate (D 4096, E 256, act block 128) and V4.1-Flash's (D 5120, E 384, act block 32).
CUDA-graph replay, one call per gate-weight copy over enough copies to outrun L2 (at decode the expert GEMMs
between two layers' gates evict it); each row count's fused outputs checked bit-equal to the unfused ones.

    PYTHONPATH=$PWD python benchmarks/bench_moe_route.py [--rows 1 2 3 4]    # DEEPINFER_PDL=0: PDL off

Why (2026-12-07): at b1 the routed experts' chain is a decode layer's critical path and opened with those
four kernels, 14.2 us on the H100 with PDL off (results/decode_timeline_h100_2026-12-07_s32.log).
moe_route.FUSED_ROUTE_MAX_ROWS (1) is where the fused launch is taken; this sets it for more rows.
Must not: be imported by the package.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

SHAPES = {"V4-Flash": (4096, 256, 6, 128), "V4.1-Flash": (5120, 384, 6, 32)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    args = ap.parse_args()
    from deepinfer.kernels.triton import bf16_gemv, fp4_moe, moe_gate, moe_route
    from deepinfer.kernels.triton.act_quant import act_quant_dequant_bf16
    from deepinfer.kernels.cuda import runtime

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, PDL {'on' if runtime.PDL_ENABLED else 'off'}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 60 << 20)
    for name, (d, e, k, ab) in SHAPES.items():
        copies = min(64, max(1, math.ceil(4 * l2 / (d * e * 2))))
        ws = [(torch.randn(e, d, generator=g, device=dev) * 0.05).bfloat16() for _ in range(copies)]
        bias = torch.randn(e, generator=g, device=dev) * 0.1
        for m in args.rows:
            x = (torch.randn(m, d, generator=g, device=dev) * 3).bfloat16()

            def unfused(w):
                gw, gi = moe_gate.moe_gate_sqrtsoftplus(bf16_gemv.linear_f32(x, w), bias, k, 2.5)
                slots, blocks = fp4_moe.route_slots(gi, e, moe_route.ROUTE_BLOCK_M)
                return gw, gi, slots, blocks, act_quant_dequant_bf16(x, ab)

            def fused(w):
                gw, gi, pre = moe_route.launch_fused(x, w, bias, k, 2.5, 0.0, ab, None, None)
                return gw, gi, pre.sorted_slots, pre.block_expert, pre.xa

            same = all(torch.equal(a, b) for a, b in zip(fused(ws[0]), unfused(ws[0])))
            t_un = graph_replay_ms(lambda: [unfused(w) for w in ws]) / copies * 1e3
            t_fu = graph_replay_ms(lambda: [fused(w) for w in ws]) / copies * 1e3
            gbs = e * d * 2 / (t_fu * 1e-6) / 1e9
            print(f"{name} rows {m}: unfused {t_un:6.1f} us, fused {t_fu:6.1f} us ({t_un / t_fu:4.2f}x; the gate "
                  f"weight at {gbs:5.0f} GB/s){'' if same else '  BITS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
