"""Which engine ops (torch functions with their input shapes) the device time of a V4-Flash slice goes to:
the kernel tables of run_slice.py name CUDA kernels (`elementwise_kernel<128, 4>` ...); this names the aten op
and shapes behind each, so a slow generic kernel can be traced to the line of model code that launches it.

    PYTHONPATH=$PWD python benchmarks/profile_ops.py --layers 4 [--prefill 8192] [--decode 1] [--top 30]

Prints, per workload, the ops by self device time (us total, calls, input shapes). Needs CUDA and triton.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def op_rows(fn, top: int) -> list[tuple[str, str, int, float]]:
    """(op name, input shapes, calls, self device us) of what `fn` runs, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((ev.key[:60], str(ev.input_shapes)[:110], ev.count, t))
    return sorted(rows, key=lambda r: -r[3])[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=1, help="decode batch (0: none)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from deepinfer.model.context import ForwardContext, SeqContext
    from deepinfer.model.decode_step import DecodeRunner
    from v4_slice import SliceRunner

    batch = max(1, args.decode)
    runner = SliceRunner.random(args.layers, batch, max(args.prefill, args.context + 64))
    work = []
    if args.prefill:
        ctx = ForwardContext((SeqContext(0, args.prefill, 0, 0, runner._table(0)),))
        ids = runner._ids(args.prefill)
        work.append((f"prefill {args.prefill}", lambda: runner.model.forward(ids, ctx)))
    if args.decode:
        runner.prefill(list(range(batch)), args.context)
        dec = DecodeRunner(runner.model, batch, args.context + 64, *runner.scratch, cuda_graphs=False,
                           buckets=(batch,), contexts=(args.context + 64,))
        seqs = [SeqContext(args.context, 1, i, i, runner._table(i)) for i in range(batch)]
        dids = runner._ids(batch)
        work.append((f"decode b{batch} (eager)", lambda: dec(dids, seqs)))
    for name, fn in work:
        with torch.no_grad():
            rows = op_rows(fn, args.top)
        print(f"{name}: ops by self device time ({args.layers} layers + head)")
        for op, shapes, calls, t in rows:
            print(f"  {t:9.0f} us {calls:5d}x  {op:60s} {shapes}")


if __name__ == "__main__":
    main()
