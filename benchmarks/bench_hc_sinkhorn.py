"""hc_pre_fused (the mix partials, then the collapse and Sinkhorn programs) at decode and prefill sizes, with
the Sinkhorn in blocks of tokens (the default) and one program a token (DEEPINFER_HC_SINKHORN_BLOCKS=0, the
form before 2026-12-06), in one process:

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bench_hc_sinkhorn.py [--ts 1 8 32 128 1024 8192]

Times: the median of CUDA-graph replays of `calls` back-to-back calls (as bench_attn_kernels.py --hc-mix: fn
copies enough to outrun the L2 at decode sizes), us a call, D = 4096, hc = 4; the head's collapse too (no
Sinkhorn: the same kernel either way). Bytes: x read, y written (the op's floor at prefill sizes), against the
copy rate measured in the same run. Every row first compares the two forms' outputs: y must be the same bits
(the collapse is the same code), post / comb are reported as their largest relative difference (the sums'
order differs).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from deepinfer.kernels.triton import norm_hc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import copy_bandwidth_gbs  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

L2_BYTES = 50 * 2**20


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 8, 32, 128, 1024, 8192])
    args = ap.parse_args()
    forms = (("blocks", "1"), ("token", "0"))  # DEEPINFER_HC_SINKHORN_BLOCKS, read at every call
    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s")
    g = torch.Generator(device="cuda").manual_seed(3)
    D, hc = 4096, 4
    for T in args.ts:
        x = torch.randn(T, hc, D, generator=g, device="cuda").bfloat16()
        calls = 1 if x.numel() * 2 > 2 * L2_BYTES else 32
        fns = [torch.randn(24, hc * D, generator=g, device="cuda") * 0.01 for _ in range(calls)]
        scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
        nw = torch.rand(D, device="cuda") + 0.5
        outs = {}
        for name, flag in forms:
            os.environ["DEEPINFER_HC_SINKHORN_BLOCKS"] = flag
            outs[name] = norm_hc.hc_pre_fused(x, fns[0], scale, base, nw, hc, 20, 1e-6, 1e-6)
        (y, post, comb), (y0, post0, comb0) = outs["blocks"], outs["token"]
        check = f" | y same bits {torch.equal(y, y0)}, post {_rel(post, post0):.1e}, comb {_rel(comb, comb0):.1e}"
        nbytes = x.numel() * 2 + T * D * 2
        times = []
        for name, flag in forms:
            os.environ["DEEPINFER_HC_SINKHORN_BLOCKS"] = flag
            ms = graph_replay_ms(lambda: [norm_hc.hc_pre_fused(x, f, scale, base, nw, hc, 20, 1e-6, 1e-6)
                                          for f in fns]) / calls
            times.append(f"{name} {ms * 1e3:7.1f} us ({nbytes / ms / 1e6 / copy:5.1%} of copy)")
        os.environ.pop("DEEPINFER_HC_SINKHORN_BLOCKS")
        head = graph_replay_ms(lambda: [norm_hc.hc_head_fused(x, f[:hc], scale[:1], base[:hc], nw, 1e-6, 1e-6)
                                        for f in fns]) / calls
        times.append(f"head {head * 1e3:6.1f} us")
        print(f"hc_pre T={T:5d}: " + ", ".join(times) + check)


if __name__ == "__main__":
    main()
