"""Asynchronous scheduling in a parallel group (CPU, gloo, tiny V4, exact numerics): rank 0 queues step n+1
with its decode ids taken from step n's sampled tokens on its device and broadcasts them as a tensor (the
workers never see them on the host). Against the same group's synchronous loop: the same tokens, texts,
finish and stop reasons, sampled logits within 1e-9 (a finishing request frees its slot a step later, so
batches differ and sums reorder), for tp 2 ep 2 and for two dp groups; a request aborted while a step is in
flight frees its blocks; every KV block is back at the end."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

REL = 1e-9
ENGINE = dict(max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32, kv_cache_bytes=1 << 27,
              distributed_timeout_s=120)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (3, 21, 45, 8)]


def _params(stop_token: int):
    return [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, logprobs=1),
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
    ]


def _run(model_dir, async_on, params, **split):
    llm = LLM(model_dir, **ENGINE, **split, async_scheduling=async_on)
    assert llm.engine.async_scheduling is async_on
    seen: dict[str, list[torch.Tensor]] = {}
    execute = llm.engine.runner.execute

    def recording(out, want_prompt=frozenset(), pending=None):
        result = execute(out, want_prompt, pending=pending)
        for rid, rows in out.sample_rows().items():
            seen.setdefault(rid, []).extend(result.sample_logits[list(rows)].clone())
        return result

    llm.engine.runner.execute = recording
    try:
        outs = llm.generate(_prompts(), params)
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks and not llm.engine.has_unfinished()
    finally:
        llm.shutdown()
    summary = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
               for o in outs]
    logits = [seen[next(r for r in seen if r.endswith(f"-{i}-0"))] for i in range(len(outs))]
    return summary, logits


@pytest.mark.parametrize("tp,ep,dp", [(2, 2, 1), (1, 2, 2)])
def test_async_group_gives_the_synchronous_tokens(tiny_v4_dir, tp, ep, dp):
    split = dict(tensor_parallel_size=tp, expert_parallel_size=ep, data_parallel_size=dp)
    free, _ = _run(tiny_v4_dir, False, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), **split)
    params = _params(free[2][0][4])  # a stop token the third prompt really produces, mid-stream
    sync, sync_logits = _run(tiny_v4_dir, False, params, **split)
    asyn, asyn_logits = _run(tiny_v4_dir, True, params, **split)
    assert asyn == sync
    assert sync[2][2] == "stop" and len(sync[2][0]) == 5
    for p, (a_rows, s_rows) in enumerate(zip(asyn_logits, sync_logits)):
        n = len(sync[p][0])
        assert len(s_rows) == n and len(a_rows) >= n  # (async may compute one step past a stop)
        for step, (got, ref) in enumerate(zip(a_rows[:n], s_rows)):
            err = float((got - ref).norm() / ref.norm())
            assert err <= REL, f"prompt {p} step {step}: rel_err {err:.3g}"


def test_abort_in_flight_in_a_group(tiny_v4_dir):
    llm = LLM(tiny_v4_dir, **ENGINE, tensor_parallel_size=2, async_scheduling=True)
    eng = llm.engine
    try:
        for i, p in enumerate(_prompts()[:3]):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        for _ in range(4):
            eng.step()
        assert eng.abort("r1")
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        assert done["r1"].finish_reason == "abort" and len(done["r0"].token_ids) == 20
        assert eng.block_pool.num_free == eng.block_pool.num_blocks
    finally:
        llm.shutdown()
