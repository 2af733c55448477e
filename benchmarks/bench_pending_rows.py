"""The hc_post + next hc_pre kernel (`norm_hc.hc_post_pre_fused`, decode plan) given the sublayer output as
rows, or as a `PendingRows` it adds up itself (kernels/pending.py: wo_b's 16 split-K partials, the MoE's
6 x 2 expert partials and shared rows), against the producer's own reduce kernel followed by the rows form:
the op-level view of the b1 step regression measured with DEEPINFER_PENDING_ROWS=1 (2026-12-07, H100).
Also the rows form at 8 warps (the pending forms' count). CUDA-graph replay of 32 calls in a row, T=1.

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/bench_pending_rows.py

Must not: be imported by the package.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

CALLS = 32


def main() -> None:
    from deepinfer.kernels.pending import PendingRows
    from deepinfer.kernels.triton import fp4_moe, fp8_gemm, norm_hc
    from test_kernels_hc_post_pre import _inputs

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    T, D, topk = 1, 4096, 6
    _, r, post, comb, fn, scale, base, nw = _inputs(T, D, dev, 1)
    hc = (fn, scale, base, nw, 4, 20, 1e-6, 1e-6)
    g = torch.Generator(device=dev).manual_seed(0)
    split = torch.randn(16, T, D, generator=g, device=dev)
    moe = torch.randn(2, T * topk, D, generator=g, device=dev)
    ids = torch.randperm(256, generator=g, device=dev)[:topk].view(T, topk).contiguous()
    shared_rows = torch.randn(T, D, generator=g, device=dev).bfloat16()

    class Shared:
        def wait(self):
            return shared_rows

    out = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
    y = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
    f = torch.randn(T, D, generator=g, device=dev).bfloat16()
    cases = {
        "rows (4 warps)": lambda: norm_hc.hc_post_pre_fused(f, r, post, comb, *hc),
        "rows (8 warps)": lambda: norm_hc.hc_post_pre_fused(f, r, post, comb, *hc, config={"num_warps": 8}),
        "split sum + rows": lambda: norm_hc.hc_post_pre_fused(fp8_gemm._sum_splits(split, out), r, post, comb, *hc),
        "split pending": lambda: norm_hc.hc_post_pre_fused(
            PendingRows(split, lambda: fp8_gemm._sum_splits(split, out)), r, post, comb, *hc),
        "combine + rows": lambda: norm_hc.hc_post_pre_fused(fp4_moe._combine_rows(y, moe, ids, Shared()), r, post,
                                                            comb, *hc),
        "moe pending": lambda: norm_hc.hc_post_pre_fused(
            PendingRows(moe, lambda: fp4_moe._combine_rows(y, moe, ids, Shared()), ids=ids, shared=Shared()), r,
            post, comb, *hc),
    }
    for name, fn_call in cases.items():
        us = graph_replay_ms(lambda: [fn_call() for _ in range(CALLS)]) / CALLS * 1e3
        print(f"{name:<18} {us:6.2f} us a call", flush=True)


if __name__ == "__main__":
    main()
