"""The serving engine itself (`LLMEngine.step`: scheduling, the batched decode replayed from its CUDA graph,
sampling over the 129,280-token vocabulary, detokenizing, outputs) on the V4-Flash slice: real dimensions,
random weights written as an official-format checkpoint directory and loaded by the engine's own loader.
The slice benchmarks (run_slice.py, decode_anatomy.py) time the model's decode step alone; this is what a
user of `LLM` / the server gets, synchronous loop against asynchronous scheduling.

Every request has a `--context`-token prompt and decodes `--new` tokens (ignore_eos); each `step()` is
timed with the host clock, median over the pure-decode steps of the whole batch (the first two dropped).

    PYTHONPATH=$PWD python benchmarks/bench_engine_slice.py [--layers 4] [--batches 1 32 128]
        [--context 256] [--new 24] [--async-modes off on] [--dir /tmp/v4_slice_ckpt] [--transformers]
        [--linear-batch-forms auto swap] [--env-sets "DEEPINFER_SIDE_STREAMS=0,DEEPINFER_FUSED_GREEDY=0" ""]

--linear-batch-forms: one engine per DEEPINFER_LINEAR_BATCH_FORM value (the batched-decode linears' form,
read when the engine captures its graphs: "auto" the wgmma CUDA kernel, "swap" the Triton swap form before
it), for A/B runs in one process. --env-sets: the same with any variables, one engine per set.

--transformers: then the same slice through transformers' DeepseekV4ForCausalLM in the same process
(hf_slice.py: its decode step at the same batches and prompt length; transformers' step moved between 35
and 58 ms across runs at b128, so the ratio means something only within one run).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import env_sets  # noqa: E402
from bench_engine_step import pure_decode_steps  # noqa: E402
from slice_config import slice_config  # noqa: E402

from deepinfer import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from deepinfer.tiny import make_tensors, write_model_dir  # noqa: E402


def write_slice(layers: int, out: str) -> str:
    if os.path.exists(os.path.join(out, "deepinfer_tiny.json")):
        return out
    cfg = slice_config(layers)
    t0 = time.perf_counter()
    raw = {k: v.cpu() for k, v in make_tensors(cfg, seed=0, device="cuda").items()}
    torch.cuda.empty_cache()
    write_model_dir(out, cfg, raw, max_shard_bytes=4 << 30)
    print(f"wrote {sum(t.numel() * t.element_size() for t in raw.values()) / 1e9:.1f} GB to {out} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return out


def host_probe_ms() -> float:
    """ms of a fixed pure-Python loop (median of 5): a slow series on a host that is slow right then shows here."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        acc = 0
        for i in range(100_000):
            acc += i & 7
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def thread_cpu_ms() -> dict[str, float]:
    """CPU ms (user + system) each of this process's threads has used so far, keyed "name/tid" (Linux /proc;
    empty elsewhere): a series slowed by a busy thread of our own (the GIL) shows that thread here."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) * 1e3 / tick  # utime, stime
    return out


def decode_steps(llm: LLM, batch: int, context: int, new: int, pieces: bool = False,
                 kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> tuple[float, list[float], str]:
    """(median step ms, the steps, a note: decode steps replayed / eager, gen-2 collections in the series, the
    last decode bucket; with `pieces` the median host ms of each piece of the step) -- the note tells a
    host-side slow series (eager steps, collections, a host piece near the step's time) from a device one."""
    eng = llm.engine
    dec = getattr(eng.runner, "decoder", None)
    before = (dec.replayed, dec.eager) if dec is not None else (0, 0)
    gen2 = gc.get_stats()[2]["collections"]
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", torch.randint(2, 120000, (context,), generator=g).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, output_kind=kind))
    cpu0, wall0 = thread_cpu_ms(), time.perf_counter()
    steps, medians = pure_decode_steps(eng, batch, pieces)
    steps = [dt for dt, _ in steps]
    wall = (time.perf_counter() - wall0) * 1e3
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in thread_cpu_ms().items()}
    busy = ", ".join(f"{k} {v / wall:.0%}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])[:4] if v > 0)
    note = (f"gen-2 collections {gc.get_stats()[2]['collections'] - gen2}, host probe {host_probe_ms():.2f} ms, "
            f"threads' CPU over the series' {wall:.0f} ms: {busy or 'n/a'}, load {os.getloadavg()[0]:.1f}")
    if pieces:
        note += "; host pieces (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items())
    if dec is not None:
        note = (f"decode steps replayed {dec.replayed - before[0]} / eager {dec.eager - before[1]}, bucket "
                f"{dec.last_bucket}, " + note)
    return statistics.median(steps), steps, note


ARRIVAL_EVERY = 3  # steps between arriving prompts (--arrivals)


def arrival_steps(llm: LLM, batch: int, context: int, new: int, every: int = ARRIVAL_EVERY,
                  kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> str:
    """Continuous batching: `batch` requests decoding, and a new `context`-token prompt arriving every `every`
    steps (each one joins the decoding batch when its prefill is done; a request that finishes is not
    replaced). Returns a line: median host-clock ms of the steps that mixed decode rows with a prefill and
    of the pure-decode steps in between, and how many of each (the runner's `forward_batch` tells them)."""
    eng = llm.engine
    kinds = []
    inner = eng.runner.forward_batch

    def watched(ids, ctx):
        n_dec = sum(1 for s in ctx.seqs if s.num_new == 1)
        kinds.append("mixed" if 0 < n_dec < len(ctx.seqs) else ("decode" if n_dec else "prefill"))
        return inner(ids, ctx)

    eng.runner.forward_batch = watched
    g = torch.Generator().manual_seed(batch + 1)
    prompt = lambda: torch.randint(2, 120000, (context,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, output_kind=kind)
    try:
        for i in range(batch):
            eng.add_request(f"a{batch}-{i}", prompt(), params)
        while len(kinds) < 3 or kinds[-1] != "decode":  # every first batch request prefilled
            eng.step()
        times: dict[str, list[float]] = {"mixed": [], "decode": []}
        arrived = 0
        for n in range(new - 2):
            if n % every == 0:
                eng.add_request(f"a{batch}-new{arrived}", prompt(), params)
                arrived += 1
            k = len(kinds)
            t0 = time.perf_counter()
            eng.step()
            dt = (time.perf_counter() - t0) * 1e3
            step_kinds = set(kinds[k:])
            if step_kinds <= {"mixed", "decode"} and step_kinds:
                times["mixed" if "mixed" in step_kinds else "decode"].append(dt)
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.runner.forward_batch = inner
    med = {k: (statistics.median(v) if v else float("nan"), len(v)) for k, v in times.items()}
    return (f"B={batch:4d} + a {context}-token prompt every {every} steps: mixed steps {med['mixed'][0]:7.2f} ms "
            f"(n={med['mixed'][1]}), pure-decode steps {med['decode'][0]:7.2f} ms (n={med['decode'][1]})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--output-kind", default="cumulative", choices=("cumulative", "delta", "final_only"),
                    help="the requests' SamplingParams.output_kind (LLM.generate asks final_only, a stream delta)")
    ap.add_argument("--async-modes", nargs="+", default=["off", "on"], choices=("off", "on"))
    ap.add_argument("--dir", default="/tmp/v4_slice_ckpt")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.collect() + gc.freeze() after each engine's start-up (gc.unfreeze() after it)")
    ap.add_argument("--pieces", action="store_true", help="also time the step's host pieces (bench_engine_step's)")
    ap.add_argument("--arrivals", action="store_true",
                    help="also time steps with a prompt arriving every 3 steps beside each batch (mixed steps; "
                         "A/B with --env-sets DEEPINFER_SPLIT_MIXED_STEPS=off \"\")")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' slice (same process)")
    ap.add_argument("--linear-batch-forms", nargs="+", default=[None], choices=("auto", "swap", "bf16"),
                    help="one engine per value, in order (repeat one to see the first engine's warm-up cost: in "
                         "the 2026-12-04 runs the process's first engine drew 6.4-7.2 ms b128 steps, later ones "
                         "5.4-5.5)")
    ap.add_argument("--env-sets", nargs="+", default=None,
                    help="comma-separated KEY=VALUE sets (\"\" = none), one engine per set in order, the set's "
                         "variables in the environment and every other set's removed (instead of "
                         "--linear-batch-forms)")
    args = ap.parse_args()
    kind = RequestOutputKind[args.output_kind.upper()]
    if args.env_sets is not None:
        sets = env_sets.parse(args.env_sets)
    else:
        sets = [None if f is None else {"DEEPINFER_LINEAR_BATCH_FORM": f} for f in args.linear_batch_forms]
    path = write_slice(args.layers, args.dir)
    os.sync()  # the checkpoint's dirty pages written back before any timing, not during the first engine's
    print(f"{torch.cuda.get_device_name()}, V4-Flash slice of {args.layers} layers, prompts of {args.context}, "
          f"greedy, {args.new} new tokens, {args.output_kind} outputs", flush=True)
    engine_ms = {}
    for i, env_set in enumerate(sets):
        if env_set is not None:  # read by the ops at each call (at capture) and by the sampler per step; PDL's
            env_sets.apply(env_set, [st for st in sets if st])  # switch too (each engine captures anew)
        label = "" if env_set is None else f"[{i}] " + (",".join(f"{k[len('DEEPINFER_'):].lower()}={v}"
                                                                   for k, v in env_set.items()) or "default") + " "
        for mode in args.async_modes:
            t0 = time.perf_counter()
            # --arrivals: room for the arriving prompts beside the largest batch (with max_num_seqs at the
            # batch, the 2026-12-05 b128 series had its arrivals wait for a free slot: 2 mixed steps of 22)
            extra = -(-args.new // ARRIVAL_EVERY) if args.arrivals else 0
            llm = LLM(path, numerics="fast", device="cuda", max_model_len=args.context + args.new + 64,
                      max_num_seqs=max(args.batches) + extra, max_num_batched_tokens=8192,
                      async_scheduling=mode == "on")
            print(f"{label}async {mode}: engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
            if args.gc_freeze:
                gc.collect()
                gc.freeze()
            for b in args.batches:
                ms, steps, note = decode_steps(llm, b, args.context, args.new, args.pieces, kind)
                engine_ms[(label, mode, b)] = ms
                print(f"{label}async {mode:3s} B={b:4d} LLMEngine.step {ms:7.2f} ms  {b / ms * 1e3:8.0f} tok/s "
                      f"({ms / args.layers:.3f} ms a layer, head and host included; steps {min(steps):.2f}.."
                      f"{max(steps):.2f} ms; {note})", flush=True)
                if args.arrivals:
                    print(f"{label}async {mode:3s} {arrival_steps(llm, b, args.context, args.new, kind=kind)}",
                          flush=True)
            del llm
            gc.unfreeze()
            gc.collect()  # the engine's graphs and caches hold GPU memory until collected
            torch.cuda.empty_cache()
    if args.transformers:
        import hf_slice

        cfg = slice_config(args.layers)
        model, _ = hf_slice.build(cfg.n_layers, list(cfg.compress_ratios[: cfg.n_layers]))
        for b in args.batches:
            ms = hf_slice.decode_ms(model, cfg.vocab_size, b, args.context)
            ratios = ", ".join(f"{label}async {mode} {ms / t:.1f}x" for (label, mode, bb), t in engine_ms.items()
                               if bb == b)
            print(f"transformers B={b:4d} decode step {ms:7.2f} ms  {b / ms * 1e3:8.0f} tok/s; the engine: {ratios}",
                  flush=True)


if __name__ == "__main__":
    main()
