"""Where a one-sequence prefill's wall time goes on the V4-Flash slice: the device's kernels or the host's
Python. For each length it prints
* wall: CUDA events around `model.forward` (as run_slice.py times it, median of 5);
* kernels: the sum of the CUDA kernels' durations of one forward (torch.profiler);
* host: the host clock around the forward's call alone, no synchronisation after it (when host >= wall the
  prefill is host-bound: the device waits for launches);
* hidden syncs: calls that wait for the device inside the forward (`torch.cuda.set_sync_debug_mode`);
* the host's Python by function (cProfile of one forward, top --top by own time and by cumulative time).

    PYTHONPATH=$PWD python benchmarks/prefill_host.py --layers 4 [--tokens 1024 8192] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_config import slice_config  # noqa: E402
from timing import cuda_time_ms  # noqa: E402
from v4_slice import SliceRunner  # noqa: E402

from deepinfer.kernels.triton import launch  # noqa: E402
from deepinfer.model.context import ForwardContext, SeqContext  # noqa: E402


def kernel_us(fn) -> tuple[float, int]:
    """(sum of kernel us, kernel launches) of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total, n = 0.0, 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            n += 1
    return total, n


def hidden_syncs(fn) -> list[str]:
    """The warnings torch gives for each synchronising call inside fn (first line of each, deduplicated)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sorted({str(w.message).splitlines()[0][:160] for w in caught})


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.tiny import make_tensors

    register_cuda_kernels()
    cfg = slice_config(args.layers)
    runner = SliceRunner(cfg, make_tensors(cfg, seed=0, device="cuda"), 1, max(args.tokens))
    torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, V4-Flash slice of {args.layers} layers", flush=True)
    for t in args.tokens:
        ctx = ForwardContext((SeqContext(0, t, 0, 0, runner._table(0)),))
        ids = runner._ids(t)

        def fwd(ids=ids, ctx=ctx):
            runner.model.forward(ids, ctx)

        for fast in (False, True):  # Triton's own launch dispatch, then kernels.triton.launch's fast path
            launch.ENABLED = fast
            wall = cuda_time_ms(fwd, reps=5, warmup=2)
            kus, launches = kernel_us(fwd)
            hosts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fwd()
                hosts.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
            syncs = hidden_syncs(fwd)
            print(f"prefill {t} ({'fast launch' if fast else 'JIT dispatch'}): wall {wall:.2f} ms, kernels "
                  f"{kus / 1e3:.2f} ms in {launches} launches, host call {statistics.median(hosts):.2f} ms "
                  f"(median of 5), hidden syncs {len(syncs)}", flush=True)
            for s in syncs:
                print(f"    sync: {s}")
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        fwd()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            text = buf.getvalue()
            print(f"-- prefill {t}, host Python by {key} --")
            print(text[text.find("ncalls"):].rstrip(), flush=True)


if __name__ == "__main__":
    main()
