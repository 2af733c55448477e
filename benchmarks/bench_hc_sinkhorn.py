"""hc_pre_fused (the mix partials, then the collapse and Sinkhorn programs) at decode and prefill sizes, and
optionally the same op from another copy of norm_hc.py in the same process (an A/B of the kernel's forms):

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bench_hc_sinkhorn.py [--before path/to/old_norm_hc.py]

Times: the median of CUDA-graph replays of `calls` back-to-back calls (as bench_attn_kernels.py --hc-mix: fn
copies enough to outrun the L2 at decode sizes), us a call, D = 4096, hc = 4; the head's collapse too. Bytes:
x read, y written (the op's floor at prefill sizes), against the copy rate measured in the same run. With
--before, every row first compares the two forms' outputs: y must be the same bits (the collapse did not
change), post / comb are reported as their largest relative difference (the Sinkhorn's sum order may differ).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

from deepinfer.kernels.triton import norm_hc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import copy_bandwidth_gbs  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

L2_BYTES = 50 * 2**20


def _load(path: str):
    spec = importlib.util.spec_from_file_location("norm_hc_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="another norm_hc.py to time against (same process)")
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 8, 32, 128, 1024, 8192])
    args = ap.parse_args()
    forms = [("now", norm_hc)] + ([("before", _load(args.before))] if args.before else [])
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
        outs = {name: mod.hc_pre_fused(x, fns[0], scale, base, nw, hc, 20, 1e-6, 1e-6) for name, mod in forms}
        check = ""
        if args.before:
            (y, post, comb), (y0, post0, comb0) = outs["now"], outs["before"]
            check = (f" | y same bits {torch.equal(y, y0)}, post {_rel(post, post0):.1e}, comb "
                     f"{_rel(comb, comb0):.1e}")
        nbytes = x.numel() * 2 + T * D * 2
        times = []
        for name, mod in forms:
            ms = graph_replay_ms(lambda: [mod.hc_pre_fused(x, f, scale, base, nw, hc, 20, 1e-6, 1e-6)
                                          for f in fns]) / calls
            head = graph_replay_ms(lambda: [mod.hc_head_fused(x, f[:hc], scale[:1], base[:hc], nw, 1e-6, 1e-6)
                                            for f in fns]) / calls
            times.append(f"{name} {ms * 1e3:7.1f} us ({nbytes / ms / 1e6 / copy:5.1%} of copy; head {head * 1e3:6.1f})")
        print(f"hc_pre T={T:5d}: " + ", ".join(times) + check)


if __name__ == "__main__":
    main()
