"""The serving engine's decode step end to end (`LLMEngine.step`: schedule, the runner's batched decode replayed
from its CUDA graph, sampling, scheduler update, detokenizing, outputs) on the embedded tiny V4 checkpoint
on CUDA. Its layers are tiny, but its vocabulary is V4's 129,280 tokens, so the step is what the engine
adds around the model: sampling over the real vocabulary and the host's per-request work. A/B: sampling on
the host (DEEPINFER_SAMPLE_ON=host, the engine before 2026-12-03) against on the device (the default).

Every request gets a 16-token prompt and decodes `--new` tokens; after every request's prefill, each
`step()` is timed with the host clock (it returns host outputs, so it ends synchronised), median over the
decode steps. "forward" is the runner's part of the step (synchronised at its end), the rest is
sampling + the engine's host work.

    PYTHONPATH=$PWD python benchmarks/bench_engine_step.py [--batches 1 32 128] [--new 24] [--profile]
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import default_model_dir

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "T=0.8 top-p 0.95, 5 logprobs": SamplingParams(temperature=0.8, top_p=0.95, logprobs=5),
}


def decode_steps(llm: LLM, batch: int, params: SamplingParams, new: int) -> tuple[float, float]:
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        eng.add_request(f"r{i}", torch.randint(2, 120000, (16,), generator=g).tolist(),
                        replace(params, max_tokens=new, ignore_eos=True))
    runner, forward = eng.runner, []
    inner = runner.forward_batch

    def timed(ids, ctx):
        t0 = time.perf_counter()
        out = inner(ids, ctx)
        if out.is_cuda:
            torch.cuda.synchronize()
        forward.append((time.perf_counter() - t0) * 1e3)
        return out

    runner.forward_batch = timed
    steps = []
    try:
        while eng.has_unfinished():
            t0 = time.perf_counter()
            outs = eng.step()
            dt = (time.perf_counter() - t0) * 1e3
            if all(len(o.outputs[0].token_ids) >= 2 for o in outs) and len(outs) == batch:
                steps.append((dt, forward[-1]))  # a pure-decode step of the whole batch
    finally:
        runner.forward_batch = inner
    steps = steps[2:]  # the first decode steps still see cold caches
    return statistics.median(s for s, _ in steps), statistics.median(f for _, f in steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--profile", action="store_true",
                    help="also print the host functions of the last mode's steps (cProfile, by own time)")
    args = ap.parse_args()
    model = default_model_dir("v4", seed=0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, host threads {torch.get_num_threads()}; tiny V4, vocab 129280")
    for where in ("host", "device"):
        os.environ["DEEPINFER_SAMPLE_ON"] = where
        llm = LLM(model, numerics="fast", device=args.device, max_model_len=256, max_num_seqs=max(args.batches),
                  max_num_batched_tokens=4096)
        for b in args.batches:
            for name, params in MODES.items():
                step, fwd = decode_steps(llm, b, params, args.new)
                print(f"sample on {where:6s} B={b:4d} {name:30s} step {step:8.2f} ms  (forward {fwd:6.2f}, "
                      f"sampling + engine {step - fwd:8.2f})  {b / step * 1e3:9.0f} tok/s", flush=True)
        if args.profile and where == "device":  # a separate run: the profiler slows what it watches
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            decode_steps(llm, args.batches[-1], MODES["greedy"], args.new)
            prof.disable()
            print(f"host functions of B={args.batches[-1]} greedy (cProfile, own time):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
