"""The grouped output LoRA (`wo_a`) on the H200: the bf16 weight through cuBLAS (the path before 2026-12-05)
against the FP8 weight (op "grouped_proj_fp8": the mma.sync CUDA kernel up to SYNC_MAX_T tokens, its split-K
sums separate or by cluster; the wgmma CUDA kernel for WGMMA_MIN_T..WGMMA_MAX_T; the fused in-register
expansion, dequantise + cuBLAS above FUSED_MAX_T), with a sweep of the fused kernel's launch plans (--no-sweep: without).

V4-Flash's shape: o [T, 8, 4096] bf16, wo_a [8 x 1024, 4096] (FP8: 32 MB + scales; bf16: 64 MB). Each row is
the median of CUDA-graph replays of `CALLS` calls over as many weight copies (the 32 MB FP8 weight would stay
in the 50 MB L2 otherwise; a decode step reads each layer's wo_a once). GB/s: the weight's bytes (+ o and
the output) per call.

    PYTHONPATH=$PWD python benchmarks/bench_grouped_proj.py [--ts 1 8 32 64 128 1024 8192] [--no-sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

from deepinfer.kernels.quant_weights import QuantLinearWeight  # noqa: E402

G, R, D = 8, 1024, 4096
CALLS = 4
SWEEP = [dict(BLOCK_T=32), dict(BLOCK_N=32), dict(BLOCK_N=128), dict(BLOCK_K=256), dict(BLOCK_K=64), dict(num_stages=3),
         dict(num_stages=5), dict(num_stages=6), dict(BLOCK_N=32, num_stages=6), dict(num_warps=8),
         dict(BLOCK_N=128, num_warps=8)]


def main() -> None:
    from deepinfer.kernels.triton import grouped_proj as gp

    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 8, 32, 64, 128, 1024, 8192])
    ap.add_argument("--no-sweep", action="store_true", help="only the default plans (no fused-kernel sweep)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = []
    for _ in range(CALLS):
        codes = torch.randint(0, 256, (G * R, D), generator=g, device="cuda", dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C
        scale = 2.0 ** torch.randint(-12, -4, (G * R // 128, D // 128), generator=g, device="cuda").float()
        ws.append(QuantLinearWeight(codes.view(torch.float8_e4m3fn), scale, 128, 128))
    bf = [gp.dequant_bf16(w).view(G, R, D) for w in ws]
    print(f"{torch.cuda.get_device_name()}: wo_a [{G} x {R}, {D}], {CALLS} weight copies per timed replay")
    for T in args.ts:
        o = torch.randn(T, G, D, generator=g, device="cuda").bfloat16()
        act = 2 * T * G * D + 2 * T * G * R

        def row(label: str, fn, wbytes: int) -> float:
            ms = graph_replay_ms(lambda: [fn(i) for i in range(CALLS)]) / CALLS
            flops = 2 * T * G * R * D
            print(f"T={T:5d} {label:<52} {ms * 1e3:8.1f} us {(wbytes + act) / ms / 1e6:7.0f} GB/s "
                  f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
            return ms

        row("bf16 wo_a, cuBLAS einsum (before)", lambda i: torch.einsum("tgd,grd->tgr", o, bf[i]), 2 * G * R * D)
        fp8_bytes = G * R * D + 4 * G * R * D // 128**2
        row("fp8 wo_a, dequant + cuBLAS", lambda i: gp.grouped_proj_fp8(o, ws[i], form="dequant"), fp8_bytes)
        if T <= gp.SYNC_MAX_T:
            for cluster in (False, True):
                row(f"fp8 wo_a, mma.sync, {'cluster' if cluster else 'separate'} split sum",
                    lambda i, c=cluster: gp.grouped_proj_fp8(o, ws[i], {"CLUSTER": c}, form="sync"), fp8_bytes)
        if gp.WGMMA_MIN_T <= T <= gp.WGMMA_MAX_T:
            row("fp8 wo_a, wgmma (grouped rows)", lambda i: gp.grouped_proj_fp8(o, ws[i], form="wgmma"), fp8_bytes)
        if T <= 128:
            row(f"fp8 wo_a, fused, default {gp.plan(T, R)}", lambda i: gp.grouped_proj_fp8(o, ws[i], form="fused"),
                fp8_bytes)
            for cfg in [] if args.no_sweep else SWEEP:
                try:
                    gp.plan(T, R, cfg)
                except ValueError:
                    continue
                row(f"  fused {cfg}", lambda i, cfg=cfg: gp.grouped_proj_fp8(o, ws[i], cfg, form="fused"), fp8_bytes)


if __name__ == "__main__":
    main()
