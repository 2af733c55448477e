"""Where a batched decode step's milliseconds go, on the V4-Flash slice: the host's preparation of the step
(`DecodeRunner.prepare`: metadata rows, the host-to-device copy), the replay of its CUDA graph alone, the
whole step as run_slice.py times it (events around prepare + replay), and the kernels inside the replayed
graph (their summed device time against the replay's span: the rest is launch gaps between graph nodes).
Also the host's pieces of a step (SeqContexts, prepare, the graph.replay() call) and the step's cost when
steps run back to back with no synchronisation between them (the host's work then hides under the device's).

    PYTHONPATH=$PWD python benchmarks/decode_anatomy.py --layers 4 [--batches 1 32 128] [--top 12]
        [--moe-kernels triton mma]   # each batch once per DEEPINFER_MOE_DECODE_KERNEL choice, same model
        [--env-sets "DEEPINFER_MOE_DECODE_KERNEL=triton,DEEPINFER_LINEAR_DECODE_KERNEL=triton" ""]   # or any sets
        [--ops 60]   # + an eager step's profiler table: ops by input shape and own device time
        [--timeline 120]   # + the replay's critical path and main stream in order (stream_timeline.py; PDL=0)

Needs CUDA and triton. Prints one block per batch; writes `$OUT/decode_anatomy.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import env_sets  # noqa: E402
from slice_config import slice_config  # noqa: E402
from stream_timeline import (critical_path, format_critical_path, format_timeline, kernel_table,  # noqa: E402
                             main_stream_path, profiled_kernels)
from timing import back_to_back_ms, cuda_time_ms  # noqa: E402


def eager_ops_table(step, rows: int) -> str:
    """One eager step under the profiler with input shapes: the torch ops (and the Triton / CUDA launches
    the registry's ops make) by their own device time, grouped by input shape: which call a kernel of the
    replay's list comes from."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=rows,
                                                              max_name_column_width=48, max_shapes_column_width=70)


@torch.no_grad()
def anatomy(runner, batch: int, context: int, top: int, ops: int = 0, timeline: int = -1) -> dict:
    from deepinfer.model.context import SeqContext
    from deepinfer.model.decode_step import DecodeRunner

    runner.prefill(list(range(batch)), context)
    dec = DecodeRunner(runner.model, batch, context + 64, *runner.scratch, cuda_graphs=True, buckets=(batch,),
                       contexts=(context + 64,))
    pos = [context]

    def seqs():
        return [SeqContext(pos[0], 1, i, i, runner._table(i)) for i in range(batch)]

    ids = runner._ids(batch)

    def step():
        dec(ids, seqs())
        pos[0] += 1

    step_ms = cuda_time_ms(step, reps=20, warmup=3)
    # the host's part alone: prepare() with the device idle (synchronised before and after)
    prep = []
    for _ in range(20):
        s = seqs()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.prepare(ids, s)
        prep.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        pos[0] += 1
    # the host's part of a step, piece by piece (perf_counter around each, the device idle at the start):
    # building the SeqContexts, prepare(), and the graph.replay() call itself (the launch returns before the
    # kernels end); and the step with no synchronisation between steps (the host prepares step n+1 while
    # the device runs step n: what a step costs once the host's work hides under the device's)
    # (positions rewind to `context` before each phase: the phases' 80 steps would pass the bucket's 64
    # positions; the kernels' work depends on the bucket and the visible entries, not on the values)
    pieces = {"seqs": [], "prepare": [], "replay_call": []}
    graph, _ = dec._graphs[dec.last_bucket]
    pos[0] = context
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = seqs()
        t1 = time.perf_counter()
        dec.prepare(ids, s)
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        pos[0] += 1
        for key, dt in zip(pieces, (t1 - t0, t2 - t1, t3 - t2)):
            pieces[key].append(dt * 1e3)
    pos[0] = context
    pipelined_ms = back_to_back_ms(step, 20)
    replay_ms = cuda_time_ms(graph.replay, reps=50, warmup=5)
    out = {"step_ms": step_ms, "prepare_host_ms": statistics.median(prep), "replay_ms": replay_ms,
           "host_pieces_ms": {k: statistics.median(v) for k, v in pieces.items()},
           "pipelined_step_ms": pipelined_ms}
    ks = profiled_kernels(graph.replay)  # one profiled replay: the table and the timeline
    out.update(kernel_table(ks, top))
    if timeline >= 0:
        out["timeline"] = (format_critical_path(critical_path(ks), rows=timeline) + "\n"
                           + format_timeline(main_stream_path(ks, idle_floor_us=0.5), rows=timeline))
    if ops:
        pos[0] = context
        out["ops_table"] = eager_ops_table(lambda: dec(ids, seqs(), graphs=False), ops)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--ops", type=int, default=0,
                    help="also print this many rows of an eager step's profiler table (ops by input shape)")
    ap.add_argument("--timeline", type=int, default=-1,
                    help="also lay out the replay's critical path and its main stream (idle windows and what "
                         "they waited on), each with its first N kernels in order (0: the summaries only)")
    ap.add_argument("--moe-kernels", nargs="+", default=None,
                    help="DEEPINFER_MOE_DECODE_KERNEL values to run each batch with (default: the environment's)")
    ap.add_argument("--env-sets", nargs="+", default=None,
                    help="comma-separated KEY=VALUE sets (\"\" = none); each batch runs once per set, the set's "
                         "variables in the environment and every other set's removed")
    args = ap.parse_args()
    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.tiny import make_tensors
    from v4_slice import SliceRunner

    register_cuda_kernels()
    cfg = slice_config(args.layers)
    raw = make_tensors(cfg, seed=0, device="cuda")
    runner = SliceRunner(cfg, raw, max(args.batches), args.context + 64)
    del raw
    torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(), "layers": args.layers, "context": args.context,
           "command": " ".join(sys.argv)}
    sets = env_sets.parse(args.env_sets) if args.env_sets else None
    if sets is None:
        sets = [{"DEEPINFER_MOE_DECODE_KERNEL": c} for c in args.moe_kernels] if args.moe_kernels else [None]
    for b in args.batches:
        for env_set in sets:
            if env_set is not None:  # read by the ops at each call (at capture); PDL too (graphs captured per set)
                env_sets.apply(env_set, sets)
            tag = f"b{b}" + (" " + ",".join(f"{k.split('_')[1].lower()}={v}" for k, v in env_set.items())
                             if env_set else "")
            r = res[tag] = anatomy(runner, b, args.context, args.top, args.ops, args.timeline)
            line = (f"{tag:<5} step {r['step_ms']:.3f} ms = prepare (host) {r['prepare_host_ms']:.3f} + graph replay "
                    f"{r['replay_ms']:.3f} ms")
            if r.get("kernels"):
                gaps = r["span_us"] - r["kernel_us"]
                line += (f"; inside the replay {r['kernels']} kernels, {r['kernel_us']:.0f} us of kernels over a "
                         f"{r['span_us']:.0f} us span ({gaps:.0f} us between kernels, "
                         f"{gaps / max(1, r['kernels'] - 1):.2f} us per gap)")
            else:
                line += "; the profiler recorded no kernels inside the replay"
            print(line, flush=True)
            hp = r["host_pieces_ms"]
            print(f"      host: SeqContexts {hp['seqs']:.3f} ms, prepare {hp['prepare']:.3f}, graph.replay() call "
                  f"{hp['replay_call']:.3f}; steps without a sync between them: {r['pipelined_step_ms']:.3f} ms "
                  f"a step", flush=True)
            for name, n, us in r.get("top", []):
                print(f"   {us:9.1f} us {n:5d}x  {name}")
            if r.get("timeline"):
                print(r["timeline"], flush=True)
            if r.get("ops_table"):
                print(r.pop("ops_table"), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_anatomy.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
