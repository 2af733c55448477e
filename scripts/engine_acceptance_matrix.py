"""The engine's full exact-numerics acceptance matrix, too slow for CI on 2 cores (~15 min):
20 prompts of 1-400 tokens x 48 greedy tokens in every configuration (batch 1/3/8/16, token budget
1/7/64) for both families, each step checked against the oracle teacher-forced on the same prefix.
CI runs a reduced matrix of the same check (tests/test_engine.py).

    python scripts/engine_acceptance_matrix.py
"""
from __future__ import annotations

import gc
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.reference import load_reference
from deepinfer.tiny import default_model_dir

LENGTHS = [1, 2, 3, 5, 8, 13, 17, 31, 64, 100, 127, 128, 129, 150, 200, 255, 256, 300, 350, 400]
CONFIGS = [(1, 64), (3, 64), (8, 7), (16, 64), (16, 1)]
NEW = 48


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in LENGTHS]


def run(family: str, batch: int, budget: int) -> str:
    model_dir = default_model_dir(family)
    ref = load_reference(model_dir, "exact", max_batch_size=1, max_seq_len=512, progress=False)
    ps = prompts(batch * 100 + budget)
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=batch, max_num_batched_tokens=budget)
    seen: dict[str, list[torch.Tensor]] = {}
    execute = llm.engine.runner.execute

    def recording(out, want=frozenset()):
        result = execute(out, want)
        for rid, rows in out.sample_rows().items():
            seen.setdefault(rid, []).extend(result.sample_logits[list(rows)])
        return result

    llm.engine.runner.execute = recording
    start = time.time()
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    worst, identical = 0.0, 0
    for i, (p, o) in enumerate(zip(ps, outs)):
        tokens = o.outputs[0].token_ids
        full = ref.forward(torch.tensor([p + tokens[:-1]]), 0, all_logits=True)[0][len(p) - 1 :]
        rid = next(r for r in seen if r.endswith(f"-{i}-0"))
        identical += all(int(full[j].argmax()) == tokens[j] for j in range(NEW))
        worst = max(worst, max(float((g - full[j]).norm() / full[j].norm()) for j, g in enumerate(seen[rid])))
    return (f"{family} batch {batch} budget {budget}: {identical}/{len(ps)} prompts greedy-identical x {NEW} "
            f"tokens, worst logits rel_err {worst:.3g} ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for family in ("v4", "v41"):
        for batch, budget in CONFIGS:
            print(run(family, batch, budget), flush=True)
            gc.collect()  # each run holds an engine (1 GiB KV budget) and ~1 GB of recorded logits
