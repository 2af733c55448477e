"""fp8_linear at decode rows (M = 1..8): the Triton bf16 form against the mma.sync CUDA kernel
(kernels/cuda/fp8_linear_mma.cu) and its tiles, on the V4-Flash layer's projection shapes (128x128 blocks).

    PYTHONPATH=$PWD python benchmarks/bench_linear_sync.py [--ms 1,4,8] [--variants 'split sum,cluster sum,serial sum']

Each row: CUDA-graph replay of one call per weight copy, over enough copies (>= 4x the L2 in all) that the
weights come from HBM as in a decode step; time per call, the weight bytes (E4M3 + scales) over it (GB/s),
rel_err against the torch twin. Writes $OUT/linear_sync.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import QuantLinearWeight, fp8_linear_torch
from deepinfer.kernels.triton.fp8_gemm import fp8_linear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

SHAPES = (("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("shared w1", 4096, 2048), ("wq_a", 4096, 1024),
          ("wkv", 4096, 512), ("shared w2", 2048, 4096), ("index wq_b", 1024, 8192))  # (name, K, N)
VARIANTS = (("triton bf16", "bf16", None), ("sync MT2 w4 s2", "sync", None), ("sync MT1 w4 s2", "sync", {"MT": 1}),
            ("sync MT2 w4 s4", "sync", {"STAGES": 4}), ("sync MT1 w8 s2", "sync", {"MT": 1, "WARPS": 8}),
            ("sync MT1 w8 s4", "sync", {"MT": 1, "WARPS": 8, "STAGES": 4}),  # 2026-12-07: every stage before the PDL wait
            ("sync MT4 w4 s2", "sync", {"MT": 4}), ("sync MT2 w4 s2 split/2", "sync", "half"),
            # the default tiles with the split-K partials summed by a separate kernel / by the cluster (2026-12-05;
            # the op's default is `fp8_gemm.use_cluster`'s rule)
            ("sync split sum", "sync", {"CLUSTER": False, "SERIAL": False}),
            ("sync cluster sum", "sync", {"CLUSTER": True}),
            # ... and by the tile's last split CTA (serial split-K, 2026-12-07: the default beyond the cluster's 4)
            ("sync serial sum", "sync", {"CLUSTER": False, "SERIAL": True}),
            # the batched-decode form (17..256 rows: --ms 32,128; its cluster form was removed, 2026-12-05)
            ("wgmma", "wgmma", None),
            ("wgmma split sum", "wgmma", {"SERIAL": False}), ("wgmma serial sum", "wgmma", {"SERIAL": True}))


def weights(n: int, k: int, copies: int, dev) -> list[QuantLinearWeight]:
    w = torch.randn(n, k, device=dev) * torch.exp(torch.randn(n, 1, device=dev))
    q, s = formats.quant_fp8_blocks(w, 128)
    base = QuantLinearWeight(q, formats.e8m0_to_float(s), 128, 128)
    return [base] + [QuantLinearWeight(q.clone(), base.scale.clone(), 128, 128) for _ in range(copies - 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--variants", default="", help="comma-separated substrings: only the variants whose label "
                    "has one (e.g. 'split sum,cluster sum'); default all but the wgmma ones")
    args = ap.parse_args()
    wanted = [v for v in args.variants.split(",") if v]
    variants = [v for v in VARIANTS if (any(w in v[0] for w in wanted) if wanted else v[1] != "wgmma")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 60 << 20)
    rows, res = [], []
    sums: dict[tuple[int, str], float] = {}
    for name, k, n in SHAPES:
        copies = max(1, math.ceil(4 * l2 / (n * k)))
        ws = weights(n, k, copies, dev)
        nbytes = n * k + ws[0].scale.numel() * 4
        for m in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev))).to(torch.bfloat16)
            want = fp8_linear_torch(x, ws[0])
            for label, mma, config in variants:
                cfg = config
                if config == "half":
                    from deepinfer.kernels.cuda.fp8_linear_mma import plan

                    s = plan(m, n, k, torch.cuda.get_device_properties(dev).multi_processor_count)["SPLIT_K"]
                    cfg = {"SPLIT_K": max(1, s // 2)}
                try:
                    got = fp8_linear(x, ws[0], cfg, mma=mma)
                    rel = float((got.double() - want.double()).norm() / want.double().norm())
                    ms = graph_replay_ms(lambda: [fp8_linear(x, w, cfg, mma=mma) for w in ws]) / copies
                except Exception as err:  # report, go on
                    print(f"{name} M={m} {label}: FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                    continue
                gbs = nbytes / (ms * 1e-3) / 1e9
                sums[(m, label)] = sums.get((m, label), 0.0) + ms
                res.append(dict(shape=name, k=k, n=n, m=m, variant=label, config=cfg, us=ms * 1e3, gbs=gbs, rel_err=rel))
                rows.append(f"{name:11s} K={k:5d} N={n:5d} M={m} {label:24s} {ms * 1e3:7.1f} us {gbs:6.0f} GB/s rel {rel:.1e}")
                print(rows[-1], flush=True)
    print("\nper-layer sums of the seven shapes (us):")
    for (m, label), total in sorted(sums.items()):
        print(f"  M={m} {label:24s} {total * 1e3:8.1f}")
    with open(os.path.join(os.environ.get("OUT", "."), "linear_sync.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
