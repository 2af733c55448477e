"""Parallel serving against one process on any device: the same greedy prompts through LLM(...) at world
size 1 and with --tp/--ep/--dp; prints token agreement and the worst logits rel_err per configuration.

    python scripts/parallel_smoke.py --family v4 --device cuda --numerics exact --configs 2,2,1 2,1,1 1,2,2
(configs are tp,ep,dp; world = tp*dp processes, one GPU each on cuda). Exact numerics must agree to
~1e-15 with identical tokens; official/fast numerics under TP are only chaotically close (bf16 partials).
"""
from __future__ import annotations

import argparse
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import default_model_dir


def run(model, prompts, params, **kw):
    llm = LLM(model, **kw)
    seen: dict[str, list[torch.Tensor]] = {}
    execute = llm.engine.runner.execute

    def recording(out, want=frozenset()):
        result = execute(out, want)
        for rid, rows in out.sample_rows().items():
            seen.setdefault(rid, []).extend(result.sample_logits[list(rows)])
        return result

    llm.engine.runner.execute = recording
    start = time.monotonic()
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    rows = [seen[next(r for r in seen if r.endswith(f"-{i}-0"))] for i in range(len(outs))]
    return [o.outputs[0].token_ids for o in outs], rows, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="v4", choices=("v4", "v41"))
    ap.add_argument("--model", help="checkpoint directory (default: the tiny model of --family)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--configs", nargs="+", default=["2,2,1", "2,1,1", "1,2,2"])
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    model = args.model or str(default_model_dir(args.family))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (3, 21, 45, 130)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engine = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_bytes=1 << 28,
                  device=args.device, numerics=args.numerics)
    ref_tokens, ref_rows, t = run(model, prompts, params, **engine)
    print(f"world 1: {t:.1f}s")
    for c in args.configs:
        tp, ep, dp = (int(v) for v in c.split(","))
        tokens, rows, t = run(model, prompts, params, tensor_parallel_size=tp, expert_parallel_size=ep,
                              data_parallel_size=dp, **engine)
        same = sum(a == b for r, o in zip(ref_tokens, tokens) for a, b in zip(r, o))
        errs = [float((x.double() - y.double()).norm() / y.double().norm())
                for gr, rr in zip(rows, ref_rows) for x, y in zip(gr, rr)]
        print(f"tp {tp} ep {ep} dp {dp}: {same}/{sum(map(len, ref_tokens))} tokens equal, "
              f"max logits rel_err {max(errs):.3g}, {t:.1f}s")


if __name__ == "__main__":
    main()
