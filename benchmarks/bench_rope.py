"""rope32 (Triton) on the 8k prefill's shapes of the V4-Flash slice and at decode batch 128: time (CUDA-graph
replay) and the bytes it must move (the rope channels read and written in place; out of place the whole
tensor) against the copy rate measured in the same run (`ceilings.copy_bandwidth_gbs`). The first run
(2026-12-02, results/rope_h200_2026-12-02.log) divided by a 1 GiB graph-replayed copy instead, which read
2.7 TB/s: its percentages are too high; the microseconds stand.

    PYTHONPATH=$PWD python benchmarks/bench_rope.py        # writes $OUT/rope.json
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.kernels import official  # noqa: E402
from deepinfer.kernels.triton import rope  # noqa: E402
import ceilings  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

# (name, shape, in place): q and o [T, 64, 512] (o rotated back), the window kv [T, 512], the indexer q
# [T, 64, 128], a ratio-4 compressor's entries [T/4, 512]
CASES = [("q 8k", (8192, 64, 512), True), ("o 8k (inverse)", (8192, 64, 512), True), ("kv 8k", (8192, 512), True),
         ("index q 8k", (8192, 64, 128), True), ("entries 2k", (2048, 512), False),
         ("q b128", (128, 64, 512), True), ("kv b128", (128, 512), True), ("q 8k out of place", (8192, 64, 512), False)]


def main() -> None:
    freqs = official.rope_freqs32(64, 65536, 160000.0, 16.0, 32, 1).cuda()
    ceiling = ceilings.copy_bandwidth_gbs()  # the slice's ceiling (a 4 GiB copy, event-timed)
    rows, res = [], []
    for name, shape, inplace in CASES:
        x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 1_000_000, (shape[0],), device="cuda")
        table = rope.rope_table32(pos, freqs)
        inverse = "inverse" in name
        ms = graph_replay_ms(lambda: rope.rope32(x, pos, freqs, inverse, table=table, inplace=inplace))
        rows_ = x.numel() // shape[-1]
        moved = 2 * rows_ * 2 * freqs.numel() * 2 if inplace else 2 * x.numel() * 2
        gbs = moved / (ms * 1e-3) / 1e9
        res.append(dict(name=name, shape=shape, inplace=inplace, us=ms * 1e3, gbs=gbs))
        rows.append(f"{name:22s} {str(shape):18s} {'in place' if inplace else 'new':8s} {ms * 1e3:8.1f} us "
                    f"{gbs:6.0f} GB/s ({100 * gbs / ceiling:4.1f}% of copy {ceiling:.0f})")
    with open(os.path.join(os.environ.get("OUT", "."), "rope.json"), "w") as f:
        json.dump(dict(copy_gbs=ceiling, rows=res), f, indent=1)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
