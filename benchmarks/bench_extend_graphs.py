"""One-sequence prefills of the V4-Flash slice eagerly (`V4EngineModel.forward`) and through the piecewise
CUDA graphs (`model/extend_graphs.py`), in one process: wall time (CUDA events, median), the host's call time
(host clock around the call, no sync: when it exceeds the wall the step is host-bound), the kernels' summed
time and count (torch.profiler), TFLOP/s against
the measured FP8 peak, and the logits of the two paths against each other.

    PYTHONPATH=$PWD python benchmarks/bench_extend_graphs.py --layers 4 [--tokens 512 1024 2048] [--padded]

--padded: the graphs' default buckets (a prompt runs in the smallest bucket holding it: 1000 tokens in 1024);
default: one bucket of exactly each length (the eager path's shapes).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ceilings  # noqa: E402
from slice_config import flops_per_token_layer, slice_config  # noqa: E402
from prefill_host import kernel_us  # noqa: E402
from timing import cuda_time_ms, host_call_ms  # noqa: E402
from v4_slice import SliceRunner  # noqa: E402

from deepinfer.model.context import ForwardContext, SeqContext  # noqa: E402
from deepinfer.model.extend_graphs import BUCKETS, ExtendGraphs  # noqa: E402


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--padded", action="store_true", help="the default buckets instead of one exact bucket each")
    args = ap.parse_args()
    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.tiny import make_tensors

    register_cuda_kernels()
    cfg = slice_config(args.layers)
    peak = ceilings.fp8_matmul_tflops()
    raw = make_tensors(cfg, seed=0, device="cuda")
    n = cfg.n_layers
    flops_tok = {t: sum(flops_per_token_layer(cfg, raw, layer, t // 2) for layer in range(n)) / n
                 for t in args.tokens}
    runner = SliceRunner(cfg, raw, 1, max(args.tokens))
    del raw
    gc.collect()
    torch.cuda.empty_cache()
    model = runner.model
    buckets = BUCKETS if args.padded else tuple(args.tokens)
    t0 = time.time()
    before = torch.cuda.memory_allocated()
    graphs = ExtendGraphs(model, max(args.tokens), buckets=buckets)
    print(f"{torch.cuda.get_device_name()}, V4-Flash slice of {n} layers; FP8 peak {peak:.0f} TFLOP/s; graphs of "
          f"buckets {graphs.buckets} captured in {time.time() - t0:.1f} s, "
          f"{(torch.cuda.memory_allocated() - before) / 2**20:.0f} MiB", flush=True)
    for t in args.tokens:
        ctx = ForwardContext((SeqContext(0, t, 0, 0, runner._table(0)),))
        ids = runner._ids(t)
        ways = {"eager": lambda: model.forward(ids, ctx), "graphs": lambda: graphs(ids, ctx)}
        logits = {}
        for name, fn in ways.items():
            logits[name] = fn().float()
            wall = cuda_time_ms(fn, reps=10, warmup=2)
            host = host_call_ms(fn)
            kus, launches = kernel_us(fn)  # (a graph replay's kernels are listed one by one too)
            tflops = flops_tok[t] * t * n / (wall * 1e-3) / 1e12
            print(f"prefill {t:5d} {name:6s}: wall {wall:7.2f} ms, host call {host:7.2f} ms, kernels "
                  f"{kus / 1e3:7.2f} ms in {launches} launches, {tflops:6.0f} TFLOP/s = {100 * tflops / peak:5.1f}% "
                  f"of FP8 peak, {t / wall * 1e3:8.0f} tok/s", flush=True)
        a, b = logits["graphs"], logits["eager"]
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        rel = ((a - b).norm() / b.norm()).item()
        print(f"prefill {t:5d} graphs vs eager logits: rel_err {rel:.2e}, cos {cos:.6f}, argmax equal "
              f"{bool((a.argmax(-1) == b.argmax(-1)).all())} (bucket {graphs.bucket(t)})", flush=True)


if __name__ == "__main__":
    main()
