"""The serving engine's decode step end to end (`LLMEngine.step`: schedule, the runner's batched decode replayed
from its CUDA graph, sampling, scheduler update, detokenizing, outputs) on the embedded tiny V4 checkpoint
on CUDA. Its layers are tiny, but its vocabulary is V4's 129,280 tokens, so the step is what the engine
adds around the model: sampling over the real vocabulary and the host's per-request work. A/B: sampling on
the host (DEEPINFER_SAMPLE_ON=host, the engine before 2026-12-03) against on the device (the default); and
the synchronous step loop against asynchronous scheduling (the default on CUDA since the thirteenth
session: step n+1 is queued before the host works on step n's tokens).

Every request gets a 16-token prompt and decodes `--new` tokens; after every request's prefill, each
`step()` is timed with the host clock (it returns host outputs, so it ends synchronised), median over the
decode steps. "forward" is the runner's part of the step (synchronised at its end), the rest is
sampling + the engine's host work. With asynchronous scheduling the forward is not synchronised (that is
the point), so only the step is timed; each step() then returns the previous step's tokens.

    PYTHONPATH=$PWD python benchmarks/bench_engine_step.py [--batches 1 32 128] [--new 24] [--profile]
        [--sample-on host device] [--async-modes off on]
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import statistics
import time

import torch

from deepinfer import LLM, RequestOutputKind, SamplingParams
from deepinfer.tiny import default_model_dir
from timing import host_timed  # (this directory: run as a script, or imported by bench_engine_slice.py)

OUTPUT_KIND = RequestOutputKind.CUMULATIVE  # --output-kind: what each step's outputs carry (the host builds them)
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "T=0.8 top-p 0.95, 5 logprobs": SamplingParams(temperature=0.8, top_p=0.95, logprobs=5),
}


PIECES = ("scheduler.schedule", "runner.execute", "sampler.sample", "event waits", "scheduler.commit",
          "detokenize + logprobs", "outputs")


def timed_pieces(eng) -> tuple[dict[str, list[float]], callable]:
    """Wrap the step's pieces with host timers (ms, summed per step); returns (times, undo)."""
    times: dict[str, list[float]] = {k: [0.0] for k in PIECES}
    undo = []

    def wrap(obj, name, key):
        inner = getattr(obj, name)

        def add(ms: float) -> None:
            times[key][-1] += ms

        setattr(obj, name, host_timed(inner, add))
        undo.append(lambda: setattr(obj, name, inner))

    wrap(eng.scheduler, "schedule", "scheduler.schedule")
    wrap(eng.runner, "execute", "runner.execute")
    wrap(eng.sampler, "sample", "sampler.sample")
    wrap(torch.cuda.Event, "synchronize", "event waits")
    wrap(eng.scheduler, "commit", "scheduler.commit")
    wrap(eng, "_absorb", "detokenize + logprobs")
    wrap(eng, "_output", "outputs")
    return times, lambda: [u() for u in reversed(undo)]


def pure_decode_steps(eng, batch: int, pieces: bool, extra=lambda: None) -> tuple[list[tuple], dict[str, float]]:
    """Step `eng` until every request is done. Returns, for each pure-decode step of the whole batch (all
    `batch` requests running, each with >= 2 tokens committed: read from the scheduler, as outputs differ by
    output kind) but the first two (cold caches), (host-clock ms of `step()`, `extra()` read right after
    it); and with `pieces` each step piece's median host ms over those steps."""
    times, undo = timed_pieces(eng) if pieces else ({}, lambda: None)
    steps, kept, n = [], [], 0
    try:
        while eng.has_unfinished():
            for v in times.values():
                v.append(0.0)
            n += 1  # the step's index in the pieces' lists (their entry 0 is the time before the first step)
            t0 = time.perf_counter()
            eng.step()
            dt = (time.perf_counter() - t0) * 1e3
            running = eng.scheduler.running
            if len(running) == batch and all(r.num_output_tokens >= 2 for r in running):
                steps.append((dt, extra()))
                kept.append(n)
    finally:
        undo()
    medians = {k: statistics.median(v[i] for i in kept[2:]) for k, v in times.items()}
    return steps[2:], medians


def decode_steps(llm: LLM, batch: int, params: SamplingParams, new: int,
                 pieces: bool = False) -> tuple[float, float | None]:
    eng = llm.engine
    sync = not eng.async_scheduling
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        eng.add_request(f"r{i}", torch.randint(2, 120000, (16,), generator=g).tolist(),
                        replace(params, max_tokens=new, ignore_eos=True, output_kind=OUTPUT_KIND))
    runner, forward = eng.runner, []
    inner = runner.forward_batch

    def timed(ids, ctx):
        t0 = time.perf_counter()
        out = inner(ids, ctx)
        if out.is_cuda and sync:
            torch.cuda.synchronize()
        forward.append((time.perf_counter() - t0) * 1e3)
        return out

    runner.forward_batch = timed
    try:
        steps, medians = pure_decode_steps(eng, batch, pieces, lambda: forward[-1])
    finally:
        runner.forward_batch = inner
    if pieces:
        print("      host pieces of a step (median ms): " + ", ".join(
            f"{k} {v:.3f}" for k, v in medians.items()), flush=True)
    return statistics.median(s for s, _ in steps), statistics.median(f for _, f in steps) if sync else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--output-kind", default="cumulative", choices=("cumulative", "delta", "final_only"),
                    help="the requests' SamplingParams.output_kind (LLM.generate asks final_only, a stream delta)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--profile", action="store_true",
                    help="also print the host functions of the last mode's steps (cProfile, by own time)")
    ap.add_argument("--pieces", action="store_true", help="also time the step's pieces (host clock)")
    ap.add_argument("--sample-on", nargs="+", default=["host", "device"], choices=("host", "device"))
    ap.add_argument("--async-modes", nargs="+", default=["off", "on"], choices=("off", "on"),
                    help="the engine's async_scheduling, each mode a separate engine")
    args = ap.parse_args()
    global OUTPUT_KIND
    OUTPUT_KIND = RequestOutputKind[args.output_kind.upper()]
    model = default_model_dir("v4", seed=0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, host threads {torch.get_num_threads()}; tiny V4, vocab 129280")
    for where, mode in [(w, m) for w in args.sample_on for m in args.async_modes]:
        os.environ["DEEPINFER_SAMPLE_ON"] = where
        llm = LLM(model, numerics="fast", device=args.device, max_model_len=256, max_num_seqs=max(args.batches),
                  max_num_batched_tokens=4096, async_scheduling=mode == "on")
        for b in args.batches:
            for name, params in MODES.items():
                step, fwd = decode_steps(llm, b, params, args.new, args.pieces)
                split = (f"(forward {fwd:6.2f}, sampling + engine {step - fwd:8.2f})" if fwd is not None else
                         "(forward overlapped)" + " " * 27)
                print(f"sample on {where:6s} async {mode:3s} B={b:4d} {name:30s} step {step:8.2f} ms  {split}  "
                      f"{b / step * 1e3:9.0f} tok/s", flush=True)
        if args.profile and where == "device":  # a separate run: the profiler slows what it watches
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            decode_steps(llm, args.batches[-1], MODES["greedy"], args.new)
            prof.disable()
            print(f"host functions of B={args.batches[-1]} greedy, async {mode} (cProfile, own time):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
