"""The host's work on a decode step's sampled tokens against the output's length: the engine's real
asynchronous-step tail (`LLMEngine._finish_in_flight`: the scheduler's commit, detokenizing, stop strings,
logprobs; then the step's outputs) plus the scheduler's schedule and advance, for B requests, with no model
(this part of `LLMEngine.step` runs on the host whatever the model is; bench_engine_step.py and
bench_engine_slice.py time it with one). A step of B sequences must cost the same at any output length;
what copies a request's whole output each step grows with it, and V4's thinking traces run to tens of
thousands of tokens.

The engine is the embedded tiny checkpoint's (its tokenizer and validation are the real ones); its scheduler
is swapped for one with a block pool as large as the run needs (bookkeeping only: no model runs, so no KV
is written). Each step "samples" the next token of an English text, the request's own offset into it, and
hands the engine those ids the way the sampler's host copy does (a `SamplerOutput` on the CPU).

    PYTHONPATH=$PWD python benchmarks/bench_output_host.py [--batch 128] [--lengths 256 2048 8192 32768]
        [--kinds cumulative delta final_only]

Prints, per output kind and length reached, the median us per step of: schedule + advance, the
tail (commit, detokenize, stop strings), the outputs, and their total. Between the lengths it times, the
run advances without building outputs (a CUMULATIVE run would otherwise spend most of its time there).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.llm_engine import _InFlight
from deepinfer.engine.model_runner import PendingTokens
from deepinfer.sampling import SamplerOutput
from deepinfer.scheduler import Scheduler, SchedulerConfig
from deepinfer.tiny import default_model_dir

TEXT = ("The engine schedules every request, runs the model on the device and turns the sampled tokens into "
        "text while the next step runs. A long answer, such as a reasoning trace, grows by one token per "
        "step; nothing the host does per step may grow with it, or a batch of long answers ends host-bound. ")


def kinds_available() -> dict:
    try:
        from deepinfer.sampling import RequestOutputKind
    except ImportError:  # the engine before output kinds: every output cumulative
        return {"cumulative": None}
    return {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA,
            "final_only": RequestOutputKind.FINAL_ONLY}


def outputs_of(engine, touched):
    if hasattr(engine, "_outputs"):
        return engine._outputs(touched)
    return [engine._output(r) for r in touched.values()]


def run(kind_name: str, kind, batch: int, lengths: list[int], steps: int = 12) -> list[tuple[int, dict]]:
    llm = LLM(default_model_dir(), max_model_len=256, max_num_seqs=batch, max_num_batched_tokens=4096)
    eng = llm.engine
    tok = eng.tokenizer
    block = eng.config.block_size
    longest = max(lengths) + steps + 64
    max_len = 16 + longest
    eng.scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(4096, 16 * batch),
                                              max_model_len=max_len, block_size=block,
                                              num_blocks=batch * -(-max_len // block)))
    source = tok.encode(TEXT * 8)
    extra = {} if kind is None else {"output_kind": kind}
    params = SamplingParams(temperature=0, max_tokens=longest, ignore_eos=True, **extra)
    for i in range(batch):
        eng.add_request(f"r{i}", source[i % 50: i % 50 + 16], params)
    sched = eng.scheduler
    made = {f"r{i}": 0 for i in range(batch)}
    prev: _InFlight | None = None
    results, times = [], {"schedule + advance": [], "commit + detokenize": [], "outputs": []}
    targets = iter(sorted(lengths))
    target = next(targets)
    while True:
        timing = made["r0"] >= target
        t0 = time.perf_counter()
        out = sched.schedule()
        touched = eng._finished_since_last_step(out)
        rows = out.sample_rows()
        scheduled = [sr for sr in out.scheduled if sr.request_id in rows]
        sched.advance(out)
        t1 = time.perf_counter()
        if prev is not None:
            eng._finish_in_flight(prev, touched)
        t2 = time.perf_counter()
        if timing:
            outputs_of(eng, touched)
        t3 = time.perf_counter()
        ids = []
        for sr in scheduled:  # the next token of the request's own walk through the text
            i = int(sr.request_id[1:])
            ids.append(source[(i % 50 + 16 + made[sr.request_id]) % len(source)])
            made[sr.request_id] += 1
        n = len(ids)
        sampled = SamplerOutput(torch.tensor(ids), torch.zeros(n), torch.ones(n, dtype=torch.long),
                                torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0), (0,) * n)
        order = {sr.request_id: r for r, sr in enumerate(scheduled)}
        prev = _InFlight(out, PendingTokens(sampled.token_ids, order), sampled, None)
        if timing:
            for key, dt in (("schedule + advance", t1 - t0), ("commit + detokenize", t2 - t1), ("outputs", t3 - t2)):
                times[key].append(dt * 1e6)
            if len(times["outputs"]) == steps:
                med = {k: statistics.median(v[2:]) for k, v in times.items()}
                results.append((made["r0"], med))
                print(f"{kind_name:10s} output {made['r0']:6d} tokens ({len(eng._requests['r0'].payload.text)} chars): "
                      + ", ".join(f"{k} {v:8.1f}" for k, v in med.items())
                      + f", total {sum(med.values()):8.1f} us", flush=True)
                times = {k: [] for k in times}
                target = next(targets, None)
                if target is None:
                    return results


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    ap.add_argument("--kinds", nargs="+", default=["cumulative", "delta", "final_only"])
    args = ap.parse_args()
    available = kinds_available()
    print(f"decode steps of {args.batch} requests, host us a step (median of 10), no model")
    for name in args.kinds:
        if name not in available:
            print(f"{name}: not in this engine")
            continue
        run(name, available[name], args.batch, args.lengths)


if __name__ == "__main__":
    main()
