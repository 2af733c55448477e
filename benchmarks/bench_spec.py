"""Speculative-decoding benchmark: offline greedy generation with and without drafting on one checkpoint;
reports tokens/s, the speed-up, the acceptance rate per draft position, the mean tokens per verification
step, and whether the outputs are token-identical (they must be, greedy).

  python benchmarks/bench_spec.py --model DIR --method mtp|dspark -k 3 --prompts 16 --new 64
(default model: the tiny v4 checkpoint; its random draft weights make acceptance near 0, so on it this
measures the overhead of drafting, not a speed-up.) Host wall clock over whole generate() calls: each call
ends with the last token on the host, so no device work is left unmeasured.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--method", choices=("mtp", "dspark"), default="mtp")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from deepinfer import LLM, SamplingParams
    from deepinfer.tiny import default_model_dir

    model = args.model or str(default_model_dir("v4" if args.method == "mtp" else "v41"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 129280, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    engine = dict(numerics=args.numerics, device=args.device, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.prompt_len + args.new + 8)
    results = {}
    outs = {}
    for name, spec in (("plain", None),
                       ("spec", {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens})):
        llm = LLM(model, speculative=spec, **engine)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        t = time.perf_counter()
        outs[name] = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs[name])
        results[name] = {"seconds": dt, "tokens_per_s": n / dt}
        if spec:
            results[name]["acceptance"] = llm.engine.spec_stats.as_dict()
        del llm
    results["speedup"] = results["spec"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
    results["identical"] = all(a.outputs[0].token_ids == b.outputs[0].token_ids
                               for a, b in zip(outs["plain"], outs["spec"]))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
