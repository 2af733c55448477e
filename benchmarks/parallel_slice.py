"""Scaling of the fast engine over GPUs (issue 10): the real-dimension V4-Flash slice (slice_config.py) at
world size 1 and at tensor parallel T (one process per GPU, NCCL), decode and prefill through the general
varlen path (the engine's parallel runner now decodes through the batched decode path, eagerly: its CUDA
graphs stay off under a communicator; this script times the general path's forward), with the time spent in
collectives measured separately: CUDA events on the compute stream around every Communicator call, so a
collective's time includes waiting for the slowest rank.

    PYTHONPATH=$PWD python benchmarks/parallel_slice.py --layers 4 --tp 2          # one H200 per rank
    PYTHONPATH=$PWD python benchmarks/parallel_slice.py --tiny --device cpu --tp 2 # smoke test on CPU (gloo)

Status: smoke-tested on CPU (tiny config, gloo, tp 2); never run on GPUs: no multi-GPU machine was lent in
the session that wrote it (issue 10 is blocked on that).
Prints one row per (world size, case) and writes `$OUT/parallel_slice.json` (or ./parallel_slice.json).
Expert parallel is not combined with fast numerics yet (one FP4 bank per layer), so experts are replicated:
TP here splits what `distributed/sharding.py` splits with ep=1 (heads, o-groups, vocabulary); the routed
experts are computed on every rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
BLOCK = 128
COMM_METHODS = ("embed", "attn_out", "engram_sum", "gather_vocab", "moe_dispatch", "moe_combine")


def _timed_comm(comm, device):
    """Wrap the communicator's boundary methods with event pairs; returns the list they append to."""
    spans = []

    def wrap(fn):
        def timed(*a, **kw):
            if device.type != "cuda":
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                spans.append(("host", (time.perf_counter() - t0) * 1e3))
                return out
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*a, **kw)
            e.record()
            spans.append((s, e))
            return out
        return timed

    for name in COMM_METHODS:
        if hasattr(comm, name):
            setattr(comm, name, wrap(getattr(comm, name)))
    return spans


def _span_ms(spans) -> float:
    total = 0.0
    for a, b in spans:
        total += b if a == "host" else a.elapsed_time(b)
    return total


def _time(fn, device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def worker(rank: int, world: int, args, port: int, out_q) -> None:
    from deepinfer.distributed.communicator import Communicator
    from deepinfer.distributed.parallel_config import ParallelConfig
    from deepinfer.distributed.sharding import shard_checkpoint
    from deepinfer.model.context import ForwardContext, SeqContext
    from deepinfer.model.factory import v4_cache, v4_params
    from deepinfer.model.v4 import V4EngineModel
    from deepinfer.tiny import make_tensors, tiny_config
    from slice_config import slice_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device notes)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        from deepinfer.kernels.triton import register_cuda_kernels

        register_cuda_kernels()
    else:
        torch.set_num_threads(1)
    comm = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        pc = ParallelConfig(tp=world, ep=1, dp=1, rank=rank)
        comm = Communicator(pc)
    cfg = tiny_config("v4") if args.tiny else slice_config(args.layers)
    raw = make_tensors(cfg, seed=0, device=device)
    if comm is not None:
        raw = shard_checkpoint(raw, cfg, comm.parallel)
    max_batch = max(args.batches)
    per_seq = -(-max(max(args.prefills), args.context + 64) // BLOCK)
    params = v4_params(raw, cfg, "fast", device)
    del raw
    cache = v4_cache(cfg, "fast", max_batch * per_seq, BLOCK, max_batch, device)
    model = V4EngineModel(cfg, params, cache, "fast", comm=comm)
    spans = _timed_comm(comm, device) if comm is not None else []
    g = torch.Generator().manual_seed(0)  # host ids, identical on every rank
    table = lambda i: tuple(range(i * per_seq, (i + 1) * per_seq))  # noqa: E731
    res = {}
    with torch.no_grad():
        for b in args.batches:
            for s in range(0, b, 8):
                part = range(s, min(b, s + 8))
                ctx = ForwardContext(tuple(SeqContext(0, args.context, i, i, table(i)) for i in part))
                model.forward(torch.randint(0, cfg.vocab_size, (args.context * len(part),), generator=g), ctx)
            pos = [args.context]

            def step():
                ctx = ForwardContext(tuple(SeqContext(pos[0], 1, i, i, table(i)) for i in range(b)))
                model.forward(torch.randint(0, cfg.vocab_size, (b,), generator=g), ctx)
                pos[0] += 1

            step()
            spans.clear()
            ms = _time(step, device, args.reps, warmup=0)
            res[f"decode_b{b}"] = {"step_ms": ms, "comm_ms": _span_ms(spans) / args.reps}
        for n in args.prefills:
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
            ctx = ForwardContext((SeqContext(0, n, 0, 0, table(0)),))
            model.forward(ids, ctx)
            spans.clear()
            ms = _time(lambda: model.forward(ids, ctx), device, max(1, args.reps // 3), warmup=0)
            res[f"prefill_{n}"] = {"ms": ms, "comm_ms": _span_ms(spans) / max(1, args.reps // 3)}
    if rank == 0:
        out_q.put(res)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_world(world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + world + (os.getpid() % 1000)
    procs = [ctx.Process(target=worker, args=(r, world, args, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    while True:  # a rank that dies must not leave rank 0's result queue waiting forever
        try:
            res = q.get(timeout=5)
            break
        except Exception:  # queue.Empty
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"world {world}: rank(s) {dead} failed" if dead else f"world {world}: timed out")
    for p in procs:
        p.join(timeout=60)
        if p.exitcode not in (0, None):
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny v4 config (CPU smoke test)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefills", default="1024,8192")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    args.batches = [int(v) for v in args.batches.split(",")]
    args.prefills = [int(v) for v in args.prefills.split(",")]
    out = {"command": " ".join(sys.argv), "tp": args.tp, "layers": args.layers, "context": args.context}
    for world in (1, args.tp):
        out[f"world{world}"] = run_world(world, args)
        print(f"world {world}: {out[f'world{world}']}", flush=True)
    w1, wn = out["world1"], out[f"world{args.tp}"]
    print(f"{'case':<14}{'1 GPU ms':>10}{f'{args.tp} GPUs ms':>12}{'speed-up':>10}{'comm ms':>10}")
    for key in w1:
        a = w1[key].get("step_ms", w1[key].get("ms"))
        b = wn[key].get("step_ms", wn[key].get("ms"))
        print(f"{key:<14}{a:10.2f}{b:12.2f}{a / b:10.2f}{wn[key]['comm_ms']:10.2f}")
    with open(os.path.join(os.environ.get("OUT", "."), "parallel_slice.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
