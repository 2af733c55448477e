"""The engine's sampling step on V4's 129,280-token vocabulary: the host path (the fp32 logits copied to the
host, `Sampler` there with CPU generators: the engine before 2026-12-03) against the device path (`Sampler` on
the GPU with CUDA generators, only the [B] / [B, k] result rows copied back: the engine now), at decode
batch sizes. Every request is seeded, as in the engine (an unseeded request gets the engine's seed + a
counter), so each row draws its noise from its own generator.

The result is read on the host either way, so each call is timed with the host clock from a synchronised
start to the host-side result (median of `--reps`). Greedy rows are checked to pick the same tokens on both
paths, and the logprobs to agree within 1e-4.

    PYTHONPATH=$PWD python benchmarks/bench_sampling.py [--batches 1 8 32 128] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.sampling import Sampler, SamplingParams, make_generator

VOCAB = 129280
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+5 logprobs": SamplingParams(temperature=0.0, logprobs=5),
    "T=0.8 top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "T=0.8 top-k 50": SamplingParams(temperature=0.8, top_k=50),
}


def timed_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    sampler = Sampler()
    print(f"{torch.cuda.get_device_name()}, host threads {torch.get_num_threads()}, vocab {VOCAB}, fp32 logits")
    for b in args.batches:
        logits = torch.randn(b, VOCAB, device="cuda") * 3
        for name, p in MODES.items():
            params = [p] * b
            host_gens = [make_generator(1000 + i) for i in range(b)]
            dev_gens = [make_generator(1000 + i, "cuda") for i in range(b)]
            host = timed_ms(lambda: sampler.sample(logits.to("cpu"), params, host_gens), args.reps)
            dev = timed_ms(lambda: sampler.sample(logits, params, dev_gens), args.reps)
            line = f"B={b:4d} {name:18s} host path {host:9.2f} ms   device path {dev:7.2f} ms   x{host / dev:6.1f}"
            if p.greedy:
                a, c = sampler.sample(logits.to("cpu"), params, host_gens), sampler.sample(logits, params, dev_gens)
                same = torch.equal(a.token_ids, c.token_ids) and torch.equal(a.ranks, c.ranks)
                lp = float((a.logprobs - c.logprobs).abs().max())
                line += f"   same tokens/ranks={same}, logprob diff {lp:.1e}"
                assert same and lp < 1e-4, line
            print(line, flush=True)


if __name__ == "__main__":
    main()
