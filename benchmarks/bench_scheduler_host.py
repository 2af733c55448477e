"""The host's bookkeeping of one decode step against the context length: the scheduler (schedule, advance,
commit with the step's sampled ids), the runner's per-sequence contexts (`SeqContext.from_slots`) and the
batched decode path's metadata (`DecodeMetadata.fill`, on the CPU: the same host work as on CUDA but the
pinned copy), with no model (this is the part of `LLMEngine.step` that runs on the host whatever the model is; the rest --
the decode metadata, sampling, detokenizing, outputs -- is timed by bench_engine_step.py / bench_engine_slice.py
with a real model). A step of B sequences must cost the same at any context: anything that walks a
sequence's tokens or blocks each step grows with it.

    PYTHONPATH=$PWD python benchmarks/bench_scheduler_host.py [--batch 128] [--contexts 256 4096 32768 131072]

Prints, per context, the median us per decode step of each piece (asynchronous scheduling's order:
schedule n+1, advance it, then commit n).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.model.context import SeqContext
from deepinfer.model.decode_metadata import DecodeMetadata
from deepinfer.scheduler.config import SchedulerConfig
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.scheduler import Scheduler


def decode_step_us(batch: int, context: int, steps: int = 30) -> dict[str, float]:
    block = 64
    max_len = context + 4096
    blocks_per_seq = -(-max_len // block)
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
                                      max_model_len=max_len, block_size=block,
                                      num_blocks=blocks_per_seq * batch))
    # V4-Flash's window and ratios; the scratch slot and block lie past the pool's (the runner's layout)
    meta = DecodeMetadata(batch, max_len, block, 128, (4, 128), "cpu")
    scratch = (batch, blocks_per_seq * batch)
    for i in range(batch):
        sched.add_request(Request(f"r{i}", [(7 * i + j) % 100_000 for j in range(context)], max_tokens=100_000))
    # the prefill: chunked steps until every request has sampled its first token
    while True:
        out = sched.schedule()
        sched.update(out, {sr.request_id: [1] for sr in out.scheduled if sr.num_sampled_rows})
        if all(r.num_output_tokens for r in sched.requests.values()) and len(sched.running) == batch:
            break
    times: dict[str, list[float]] = {"schedule": [], "advance": [], "SeqContexts": [], "fill": [], "commit": []}
    prev = None
    for n in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        seqs = [SeqContext.from_slots(sr.slots, sr.start_position, sr.num_new_tokens) for sr in out.scheduled]
        t2 = time.perf_counter()
        meta.fill(seqs, *scratch, num_slots=batch + 1)
        t2b = time.perf_counter()
        sched.advance(out)
        t3 = time.perf_counter()
        if prev is not None:
            sched.commit(prev, {sr.request_id: [n % 1000 + 2] for sr in prev.scheduled if sr.num_sampled_rows})
        t4 = time.perf_counter()
        prev = out
        assert len(seqs) == batch, f"step {n}: {len(seqs)} sequences scheduled, want {batch}"
        for key, dt in (("schedule", t1 - t0), ("SeqContexts", t2 - t1), ("fill", t2b - t2),
                        ("advance", t3 - t2b), ("commit", t4 - t3)):
            times[key].append(dt * 1e6)
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)  # the fill's CPU tensor copy must not spin up (or wait for) intra-op threads
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 32768, 131072])
    args = ap.parse_args()
    print(f"decode step of {args.batch} sequences, host us (median of 28 steps)")
    for c in args.contexts:
        t = decode_step_us(args.batch, c)
        print(f"context {c:7d}: " + ", ".join(f"{k} {v:8.1f}" for k, v in t.items())
              + f", total {sum(t.values()):8.1f}", flush=True)


if __name__ == "__main__":
    main()
