"""Tensor, expert and data parallel serving on CPU (gloo), both families: greedy tokens identical to one
process and every sampled logits row within 1e-9 (exact numerics; a TP all-reduce only reorders sums),
for TP, the o_groups cap (tp 4 > 2 groups), EP over the tp group and over the world, DP attention with
world-wide EP; a rank that fails stops the group with an error naming it instead of hanging."""
from __future__ import annotations

import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.distributed_runner import FAULT_ENV, GroupFailure

REL = 1e-9
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_bytes=1 << 27,
              distributed_timeout_s=120)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (3, 21, 45)]


def _run(model_dir, **parallel):
    """(tokens per prompt, the sampled logits rows per prompt) of one LLM; the group is shut down after."""
    llm = LLM(model_dir, **ENGINE, **parallel)
    seen: dict[str, list[torch.Tensor]] = {}
    execute = llm.engine.runner.execute

    def recording(out, want_prompt=frozenset()):
        result = execute(out, want_prompt)
        for rid, rows in out.sample_rows().items():
            seen.setdefault(rid, []).extend(result.sample_logits[list(rows)])
        return result

    llm.engine.runner.execute = recording
    try:
        outs = llm.generate(_prompts(), GREEDY)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logits = [seen[next(r for r in seen if r.endswith(f"-{i}-0"))] for i in range(len(outs))]
    return tokens, logits


@pytest.fixture(scope="module")
def single(tiny_v4_dir, tiny_v41_dir):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _run(tiny_v4_dir if family == "v4" else tiny_v41_dir)
        return cache[family]

    return get


@pytest.mark.parametrize("family,tp,ep,dp", [
    ("v4", 2, 2, 1),  # the official mp=2 layout: heads, groups, vocabulary and experts over 2 ranks
    ("v4", 4, 1, 1),  # tp 4 > o_groups 2: the grouped-output cap workaround; experts replicated
    ("v4", 1, 2, 2),  # data-parallel attention, experts over the world (token all-gather)
    ("v4", 2, 4, 2),  # all three: 2 dp groups of tp 2, 8 experts over 4 ranks
    ("v41", 2, 2, 1),  # + engram tables split by rows
    ("v41", 4, 4, 1),
    ("v41", 1, 2, 2),
])
def test_parallel_matches_one_process(single, tiny_v4_dir, tiny_v41_dir, family, tp, ep, dp):
    ref_tokens, ref_logits = single(family)
    tokens, logits = _run(tiny_v4_dir if family == "v4" else tiny_v41_dir, tensor_parallel_size=tp,
                          expert_parallel_size=ep, data_parallel_size=dp)
    assert tokens == ref_tokens
    for got_rows, ref_rows in zip(logits, ref_logits):
        assert len(got_rows) == len(ref_rows)
        for step, (got, ref) in enumerate(zip(got_rows, ref_rows)):
            err = float((got - ref).norm() / ref.norm())
            assert err <= REL, f"step {step}: rel_err {err:.3g}"


def test_official_converted_shards(single, tiny_v4_dir, tmp_path):
    """`model{rank}-mp2.safetensors` from the official converter (emulated), served with tp 2 / ep 2: each
    rank reads a layer at a time and keeps its slices; same tokens and logits as the HF checkpoint."""
    import shutil

    from deepinfer.weights.convert import convert_checkpoint

    convert_checkpoint(tiny_v4_dir, tmp_path, 2, progress=False)
    shutil.copy(tiny_v4_dir / "config.json", tmp_path)  # the official layout ships it beside the shards
    ref_tokens, ref_logits = single("v4")
    tokens, logits = _run(tmp_path, tensor_parallel_size=2, expert_parallel_size=2)
    assert tokens == ref_tokens
    for got_rows, ref_rows in zip(logits, ref_logits):
        for got, ref in zip(got_rows, ref_rows):
            assert float((got - ref).norm() / ref.norm()) <= REL


def test_prompt_logprobs_under_data_parallel(tiny_v4_dir):
    """All-rows steps (prompt logprobs) through the dp split: each group's rows come back in batch order."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)

    def prompt_lps(**parallel):
        llm = LLM(tiny_v4_dir, **ENGINE, **parallel)
        try:
            return [o.prompt_logprobs for o in llm.generate(_prompts(), params)]
        finally:
            llm.shutdown()

    want, got = prompt_lps(), prompt_lps(data_parallel_size=2, expert_parallel_size=2)
    assert [len(p) for p in got] == [len(p) for p in want] == [len(p) for p in _prompts()]
    for g, w in zip(got, want):
        for eg, ew in zip(g[1:], w[1:]):
            assert eg.keys() == ew.keys()
            assert all(abs(eg[t].logprob - ew[t].logprob) < 1e-9 for t in ew)


_TORCHRUN_SCRIPT = '''
import json, os, sys, torch
from deepinfer import LLM, SamplingParams
torch.set_num_threads(1)
prompts, engine, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(sys.argv[4], **engine, data_parallel_size=2, expert_parallel_size=2)  # ranks > 0 never return
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
json.dump([o.outputs[0].token_ids for o in outs], open(out, "w"))
llm.shutdown()
'''


def test_torchrun_launch(single, tiny_v4_dir, tmp_path):
    """The multi-node launch path on one host: torchrun sets RANK/WORLD_SIZE, every process builds the LLM,
    rank 0 gets the results, the other rank serves until it stops."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script, out = tmp_path / "run.py", tmp_path / "tokens.json"
    script.write_text(_TORCHRUN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           str(script), json.dumps(_prompts()), json.dumps(ENGINE), str(out), str(tiny_v4_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text()) == single("v4")[0]


def test_failing_rank_stops_the_group(tiny_v4_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:2")  # rank 1 raises at its third step
    llm = LLM(tiny_v4_dir, **ENGINE, tensor_parallel_size=2)
    start = time.monotonic()
    with pytest.raises(GroupFailure, match=r"rank 1 of the parallel group failed(.|\n)*injected fault"):
        llm.generate(_prompts(), GREEDY)
    assert time.monotonic() - start < 60  # an error, not a hang until the collective timeout
    with pytest.raises(GroupFailure, match="rank 1"):  # the group stays down: no silent desync
        llm.generate(_prompts()[:1], GREEDY)
    llm.shutdown()
    assert all(not p.is_alive() for p in llm.engine.runner.workers)


@pytest.mark.parametrize("fault,rank", [("1:load", 1), ("0:1", 0)])  # a worker while loading; rank 0 itself
def test_failure_at_load_or_on_rank0_names_the_rank(tiny_v4_dir, monkeypatch, fault, rank):
    monkeypatch.setenv(FAULT_ENV, fault)
    start = time.monotonic()
    with pytest.raises(GroupFailure, match=rf"rank {rank} of the parallel group failed(.|\n)*injected fault"):
        llm = LLM(tiny_v4_dir, **ENGINE, tensor_parallel_size=2)
        try:
            llm.generate(_prompts(), GREEDY)
        finally:
            llm.shutdown()
    assert time.monotonic() - start < 60


def test_bad_split_is_refused_before_any_process_starts(tiny_v4_dir):
    with pytest.raises(ValueError, match="not divisible by tp 3"):
        LLM(tiny_v4_dir, **ENGINE, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size"):
        LLM(tiny_v4_dir, **ENGINE, tensor_parallel_size=2, expert_parallel_size=3)


def test_shutdown_lets_the_group_go(tiny_v4_dir):
    """After `LLM.shutdown()` nothing keeps rank 0's runner (and its model shard) alive: an application that
    starts and stops parallel engines must not keep a model per group it ran (the exit hook held them)."""
    import gc
    import weakref

    llm = LLM(tiny_v4_dir, **ENGINE, tensor_parallel_size=2)
    runner = weakref.ref(llm.engine.runner)
    assert llm.generate(_prompts()[:1], GREEDY)[0].outputs[0].token_ids
    llm.shutdown()
    del llm
    gc.collect()
    assert runner() is None
