"""fp4_moe's routing (slots grouped by expert into blocks) at decode sizes: the torch path (`align_by_expert`:
sort + ~19 small kernels) against the one-program Triton kernels (`align_by_expert_small` up to 64 slots,
`align_by_expert_chunked` up to ROUTING_KERNEL_SLOTS; the first run, 2026-12-02, timed it to 2046 slots:
results/routing_h200_2026-12-02.log), CUDA-graph replay, V4-Flash routing (E=256, k=6), uniform random experts.

    PYTHONPATH=$PWD python benchmarks/bench_routing.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.kernels.triton.fp4_moe import (ROUTING_KERNEL_SLOTS, SMALL_ROUTING_SLOTS, align_by_expert,  # noqa: E402
                                             align_by_expert_chunked, align_by_expert_small)
from timing import graph_replay_ms  # noqa: E402


def main() -> None:
    rows = []
    for t in (1, 8, 32, 64, 128, 256, 341):
        ids = torch.stack([torch.randperm(256, device="cuda")[:6] for _ in range(t)])
        forms = [("torch", align_by_expert)]
        if t * 6 <= ROUTING_KERNEL_SLOTS:
            forms.append(("chunked kernel", align_by_expert_chunked))
        if t * 6 <= SMALL_ROUTING_SLOTS:
            forms.append(("small kernel", align_by_expert_small))
        want = align_by_expert(ids, 256, 16)
        for name, fn in forms:
            got = fn(ids, 256, 16)
            same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            us = graph_replay_ms(lambda: fn(ids, 256, 16)) * 1e3
            rows.append(f"T={t:4d} ({6 * t:4d} slots) {name:15s} {us:7.1f} us  same={same}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
