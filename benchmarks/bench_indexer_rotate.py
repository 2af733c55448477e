"""`indexer_q_rotate` (the indexer query's RoPE, Hadamard and FP4 fake quantisation, one launch) by its warps
per program, at the batched decode's sizes and a prefill's: CUDA-graph replay, one call per query copy over
up to 64 copies (at decode sizes they stay in L2, as the previous kernel's output would; from T = 128 they
outrun it); each warps count's output checked bit-equal to 4 warps'.

    PYTHONPATH=$PWD python benchmarks/bench_indexer_rotate.py [--ts 1 8 32 128 8192] [--warps 4 8 16]

Why (2026-12-07, H100, PDL off): at b1 the call is one program of the Hadamard tile's 64 rows and took 13.2 us
on the indexer lane that bounds an indexer layer's attention start; its 4-warp sm_90 build is 3,856
instructions straight-line (8 warps: 2,240).
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

HEADS, D, ROPE = 64, 128, 64  # V4-Flash's indexer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 8, 32, 128, 8192])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args()
    from deepinfer.kernels import official
    from deepinfer.kernels.triton.indexer_rotate import indexer_q_rotate
    from deepinfer.kernels.triton.rope import rope_table32

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    freqs = official.rope_freqs32(ROPE, 65536, 160000.0, 16.0, 32, 1).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 60 << 20)  # as bench_linear_sync
    for t in args.ts:
        copies = max(1, math.ceil(4 * l2 / (t * HEADS * D * 2)))
        qs = [(torch.randn(t, HEADS, D, generator=g, device=dev) * 2).bfloat16() for _ in range(min(copies, 64))]
        pos = torch.randint(0, 50_000, (t,), generator=g, device=dev)
        table = rope_table32(pos, freqs)
        want = indexer_q_rotate(qs[0], pos, freqs, table, warps=4)
        cells = []
        for w in args.warps:
            same = torch.equal(indexer_q_rotate(qs[0], pos, freqs, table, warps=w), want)
            ms = graph_replay_ms(lambda: [indexer_q_rotate(q, pos, freqs, table, warps=w) for q in qs]) / len(qs)
            cells.append(f"{w:2d} warps {ms * 1e3:7.1f} us{'' if same else ' (BITS DIFFER)'}")
        print(f"T={t:5d}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
