"""Decode step time of the fast engine on the real-dimension V4-Flash slice: the per-sequence path
(`V4EngineModel.forward`), the batched decode path eager, and its CUDA-graph replay (model/decode_step.py).
Writes `$OUT/decode_graphs.json` (or ./decode_graphs.json) and prints a table.

    PYTHONPATH=$PWD python benchmarks/bench_decode_graphs.py --layers 4 --context 256

Needs CUDA and triton. The per-sequence path is timed only up to --old-max-batch (it costs ~9 ms per
sequence and step at 4 layers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_config import slice_config  # noqa: E402
from v4_slice import SliceRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--old-max-batch", type=int, default=8)
    args = ap.parse_args()
    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.tiny import make_tensors

    register_cuda_kernels()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = slice_config(args.layers)
    raw = make_tensors(cfg, seed=0, device="cuda")
    runner = SliceRunner(cfg, raw, max(batches), args.context + 64)
    del raw
    torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(), "layers": args.layers, "context": args.context,
           "command": " ".join(sys.argv)}
    for b in batches:
        row = {"eager_batched_ms": runner.decode_batched_ms(b, args.context, graphs=False)[0]}
        try:
            row["graph_ms"] = runner.decode_batched_ms(b, args.context, graphs=True)[0]
            row["graph_tok_s"] = b / row["graph_ms"] * 1e3
        except RuntimeError as err:  # a capture failure is a result too: report it, keep timing the rest
            res[f"graph_error_b{b}"] = str(err)[:2000]
            print("graph capture failed:", str(err)[:2000], flush=True)
        if b <= args.old_max_batch:
            row["per_sequence_ms"] = runner.decode_ms(b, args.context)
        res[f"decode_b{b}"] = row
        print(f"decode b{b:<4} " + "  ".join(f"{k} {v:8.2f}" for k, v in row.items()), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_graphs.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
