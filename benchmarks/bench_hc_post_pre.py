"""Op `hc_post_pre_fused` at decode (one sublayer's hc_post and the next one's hc_pre: the post-mix kernel, then
the Sinkhorn-collapse kernel) under launch plans around its default, V4-Flash's D = 4096, hc = 4: the op sits
twice in every decode layer's critical path (~13 us a sublayer at b1 on an H100 with PDL off, 2026-12-07).
CUDA-graph replay of 32 calls in a row (fn from 8 copies, so it is not always L2-resident); each plan's x / y
checked bit-equal to the default's (the split count changes only the partials' sum order: post / comb within
1e-5 relative).

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/bench_hc_post_pre.py [--ts 1 4 16]

Must not: be imported by the package.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

CALLS, COPIES = 32, 8
PLANS = [None, dict(SPLITS=128), dict(SPLITS=64), dict(num_warps=2), dict(num_warps=8), dict(num_stages=1),
         dict(num_stages=3), dict(COLLAPSE_WARPS=1), dict(COLLAPSE_WARPS=2), dict(COLLAPSE_WARPS=8),
         dict(COLLAPSE_WARPS=16), dict(SPLITS=128, COLLAPSE_WARPS=8), dict(num_stages=1, num_warps=2),
         dict(num_stages=1, num_warps=1), dict(num_stages=1, num_warps=2, COLLAPSE_WARPS=2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--plans", type=int, nargs="*", default=None, help="indices into PLANS (default: all)")
    ap.add_argument("--pre", action="store_true", help="instead: hc_pre_fused and hc_head_fused (the mix kernel's "
                    "own decode plan) at num_stages 5 (default), 2, 1")
    args = ap.parse_args()
    if args.pre:
        return pre_plans(args.ts)
    from deepinfer.kernels.triton import norm_hc
    from test_kernels_hc_post_pre import _inputs

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    D = 4096
    for T in args.ts:
        f, r, post, comb, fn, scale, base, nw = _inputs(T, D, dev, 5)
        fns = [fn.clone() for _ in range(COPIES)]
        ref = None
        for plan in [PLANS[i] for i in args.plans] if args.plans else PLANS:
            def call(w, plan=plan):
                return norm_hc.hc_post_pre_fused(f, r, post, comb, w, scale, base, nw, 4, 20, 1e-6, 1e-6, config=plan)

            got = call(fns[0])
            if ref is None:
                ref = got
            same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            drift = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got[2:], ref[2:]))
            us = graph_replay_ms(lambda: [call(fns[i % COPIES]) for i in range(CALLS)]) / CALLS * 1e3
            print(f"T={T:3d} {str(plan or 'default'):<40} {us:6.2f} us a call   x, y same bits {same}, "
                  f"post / comb {drift:.1e}", flush=True)


def pre_plans(ts) -> None:
    """hc_pre_fused (a decode step's first sublayer; V4.1's every sublayer through hc_pre_deferred_fused, the same
    kernels) and hc_head_fused (the model head) under mix_plan's T <= 16 plan and shallower pipelines; above 16
    tokens (a prefill's) under the collapse kernel's warp counts. hc_head_fused's collapse has no Sinkhorn
    programs, so hc_pre_fused - hc_head_fused at a prefill size is about what the Sinkhorn half costs."""
    from deepinfer.kernels.triton import norm_hc
    from test_kernels_hc_post_pre import _inputs

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    D = 4096
    for T in ts:
        _, r, _, _, fn, scale, base, nw = _inputs(T, D, dev, 5)
        fns = [fn.clone() for _ in range(COPIES)]
        head_fn = [torch.randn(4, 4 * D, device=dev) * 0.01 for _ in range(COPIES)]
        ops = {"hc_pre_fused": lambda w, c: norm_hc.hc_pre_fused(r, fns[w], scale, base, nw, 4, 20, 1e-6, 1e-6, c),
               "hc_head_fused": lambda w, c: (norm_hc.hc_head_fused(r, head_fn[w], scale[:1], base[:4], nw, 1e-6,
                                                                    1e-6, c),)}
        for name, op in ops.items():
            ref = op(0, None)
            # prefill sizes: the Sinkhorn-collapse kernel's warps (one program per token and half: grid (T, 2))
            plans = (None, dict(num_stages=2), dict(num_stages=1)) if T <= 16 else \
                (None, dict(COLLAPSE_WARPS=2), dict(COLLAPSE_WARPS=8), dict(COLLAPSE_WARPS=16))
            for plan in plans:
                got = op(0, plan)
                same = all(torch.equal(a, b) for a, b in zip(got, ref))
                us = graph_replay_ms(lambda: [op(i % COPIES, plan) for i in range(CALLS)]) / CALLS * 1e3
                print(f"T={T:3d} {name:<14} {str(plan or 'default'):<22} {us:6.2f} us a call   same bits {same}",
                      flush=True)


if __name__ == "__main__":
    main()
