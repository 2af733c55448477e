"""Asynchronous scheduling on the GPU (-m gpu): the CUDA engine's default. Step n+1 is queued (its decode
ids gathered on the device from step n's sampled tokens, the CUDA graph replayed) before the host reads
step n's tokens from pinned memory. Against the synchronous loop on the tiny V4 checkpoint (fast
numerics): the same batches (every request admitted at once, the same lengths, no early stops), so the
same kernels on the same inputs: greedy and seeded tokens identical, logprobs equal to fp32 rounding.
The logic around stops, preemption and aborts is tested on the CPU (test_engine_async.py)."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 123, 7, 64], [3, 1000, 2000, 11], list(range(40, 90)), [77] * 9, [1, 2, 3]]


def run(model_dir, async_on, params):
    llm = LLM(model_dir, numerics="fast", device="cuda", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=512, num_blocks=16, async_scheduling=async_on)
    assert llm.engine.async_scheduling is async_on
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.block_pool.num_free == 16
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12, logprobs=1, ignore_eos=True),
], ids=["greedy", "seeded-top-p"])
def test_async_cuda_engine_gives_the_synchronous_tokens(tiny_v4_dir, cuda_kernels, params):
    sync, asyn = run(tiny_v4_dir, False, params), run(tiny_v4_dir, True, params)
    for (ta, la), (tb, lb) in zip(sync, asyn):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb)) < 1e-5


def test_async_is_the_cuda_default_and_leaves_the_next_step_queued(tiny_v4_dir, cuda_kernels):
    llm = LLM(tiny_v4_dir, numerics="fast", device="cuda", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=512, num_blocks=16)
    eng = llm.engine
    assert eng.async_scheduling  # the CUDA default
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert eng.step() == []  # the prefill's token is on its way: reported by the next step
    flight = eng._in_flight
    assert flight.pending.token_ids.is_cuda and flight.ready is not None  # tokens on the GPU, copy event
    assert flight.host.token_ids.is_pinned()
    outs = eng.step()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    while eng.has_unfinished():
        outs = eng.step() or outs
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 4


def test_async_decode_steps_never_wait_for_the_device(tiny_v4_dir, cuda_kernels):
    """A pure-decode step's host work (schedule, ids from the pending tokens, graph replay, sampling with
    filters, the copy of the sampled rows, the previous step's outputs) issues no synchronising CUDA call;
    the one wait is on the previous step's copy event. torch's sync debug mode raises on any other."""
    llm = LLM(tiny_v4_dir, numerics="fast", device="cuda", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=512, num_blocks=16)
    eng = llm.engine
    for i, params in enumerate([SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
                                SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=1,
                                               max_tokens=12, ignore_eos=True)]):
        eng.add_request(f"r{i}", [5 + i, 6, 7, 8], params)
    for _ in range(3):  # the prefill (its varlen path may read sizes on the host) and two decode steps
        eng.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [eng.step() for _ in range(4)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(o) == 2 for o in outs)
    while eng.has_unfinished():
        eng.step()
