"""Asynchronous scheduling (engine/llm_engine.py): step n+1 is scheduled and run with its decode ids read
from step n's sampled tokens on the device, before the host reads them. On the tiny V4 checkpoint (exact
numerics, CPU: the same code path, the device being the CPU) it must give the synchronous loop's tokens,
text, finish reasons and stop reasons, logprobs within float64 last bits (a finishing request frees its
sequence slot one step later, so batches differ and BLAS sums in another order), through chunked
prefill, stop strings and stop tokens, seeded sampling, prompt logprobs, preemption and aborts."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from engine_watch import record_preemptions

REL = 1e-9


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in lengths]


def engine(model_dir, async_on, **kw):
    kw = {"max_model_len": 256, "max_num_seqs": 3, "max_num_batched_tokens": 32, **kw}
    llm = LLM(model_dir, async_scheduling=async_on, **kw)
    assert llm.engine.async_scheduling is async_on
    return llm


def record_positions(llm):
    """(request id, first position, count) of everything the runner computes."""
    seen = []
    execute = llm.engine.runner.execute

    def wrapped(out, want_prompt=frozenset(), pending=None):
        seen.extend((sr.request_id.rsplit("-", 2)[1], sr.start_position, sr.num_new_tokens) for sr in out.scheduled)
        return execute(out, want_prompt, pending=pending)

    llm.engine.runner.execute = wrapped
    return seen


def summary(outs):
    """What a user reads (one completion each: a request reported finished twice would add another)."""
    return [(len(o.outputs), o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


def assert_close_logprobs(a, b):
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert abs(cx.cumulative_logprob - cy.cumulative_logprob) <= REL * max(1.0, abs(cx.cumulative_logprob))
        for ex, ey in zip(cx.logprobs or [], cy.logprobs or []):
            assert ex.keys() == ey.keys()
            for t in ex:
                assert ex[t].rank == ey[t].rank and ex[t].decoded_token == ey[t].decoded_token
                assert abs(ex[t].logprob - ey[t].logprob) <= REL * max(1.0, abs(ex[t].logprob))
        assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)
        for ex, ey in zip(x.prompt_logprobs or [], y.prompt_logprobs or []):
            assert (ex is None) == (ey is None)
            for t in ex or {}:
                assert ex[t].rank == ey[t].rank and abs(ex[t].logprob - ey[t].logprob) <= REL


def test_async_gives_the_synchronous_tokens(tiny_v4_dir):
    ps = prompts([3, 17, 40, 130, 5, 64, 9])
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = engine(tiny_v4_dir, False).generate(ps, base)
    # stops that really fire mid-stream: a stop string and a stop token from what the free run produced
    text1, toks3 = free[1].outputs[0].text, free[3].outputs[0].token_ids
    stop_str = text1[len(text1) // 2 : len(text1) // 2 + 2]
    params = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop=[stop_str], ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, logprobs=1),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks3[5]], ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=6, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.7, max_tokens=10),  # unseeded: the engine's per-request seed
    ]
    runs, positions = {}, {}
    for mode in (False, True):
        llm = engine(tiny_v4_dir, mode)
        positions[mode] = record_positions(llm)
        runs[mode] = llm.generate(ps, params)
        pool = llm.engine.block_pool
        assert pool.num_free == pool.num_blocks and not llm.engine.has_unfinished()
    sync, asyn = runs[False], runs[True]
    assert summary(asyn) == summary(sync)
    assert sync[1].outputs[0].finish_reason == "stop" and sync[1].outputs[0].stop_reason == stop_str
    assert sync[3].outputs[0].stop_reason == toks3[5] and len(sync[3].outputs[0].token_ids) < 12
    assert_close_logprobs(sync, asyn)
    # one position more at most, and only for a request that stopped (the step after its stop was queued)
    ends = {m: {} for m in positions}
    for m, seen in positions.items():
        for rid, start, n in seen:
            ends[m][rid] = max(ends[m].get(rid, 0), start + n)
    stopped = {str(i) for i, o in enumerate(sync) if o.outputs[0].finish_reason == "stop"}
    assert {"1", "3"} <= stopped
    for rid in ends[False]:
        extra = ends[True][rid] - ends[False][rid]
        assert extra in ((0, 1) if rid in stopped else (0,)), (rid, extra)


def test_async_preemption_and_chunking_keep_the_tokens(tiny_v4_dir):
    # five prompts that each fit one 128-token block and cross into a second while decoding, five blocks
    # in all: sequences are preempted (recompute) with a token still pending on the device
    ps = prompts([100, 110, 120, 125, 90], seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = engine(tiny_v4_dir, False, max_num_seqs=5, max_num_batched_tokens=64).generate(ps, params)
    llm = engine(tiny_v4_dir, True, max_num_seqs=5, max_num_batched_tokens=64, num_blocks=5)
    preempted = record_preemptions(llm)
    tight = llm.generate(ps, params)
    assert preempted, "the block budget was meant to force preemption"
    assert summary(tight) == summary(free)
    assert llm.engine.block_pool.num_free == 5


def test_async_abort_while_a_step_is_in_flight(tiny_v4_dir):
    llm = engine(tiny_v4_dir, True, max_num_seqs=4)
    eng = llm.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6))
    eng.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=30))
    eng.step()
    eng.step()
    assert eng._in_flight is not None and "b" in eng._in_flight.rows  # b's token is on the way
    assert eng.abort("b")
    reports: dict[str, list] = {}
    while eng.has_unfinished():
        for out in eng.step():
            reports.setdefault(out.request_id, []).append(out)
    assert [o.outputs[0].finish_reason for o in reports["b"]] == ["abort"]  # reported once, its token dropped
    a = reports["a"][-1].outputs[0]
    assert a.finish_reason == "length" and len(a.token_ids) == 6
    alone = engine(tiny_v4_dir, False, max_num_seqs=4).generate([[5, 6, 7]], SamplingParams(temperature=0,
                                                                                          max_tokens=6))
    assert a.token_ids == alone[0].outputs[0].token_ids
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


def test_async_request_at_max_model_len(tiny_v4_dir):
    """A prompt one short of max_model_len gets exactly one token (nothing past the limit is computed)."""
    ps = prompts([255, 250], seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {m: engine(tiny_v4_dir, m).generate(ps, params) for m in (False, True)}
    assert summary(outs[True]) == summary(outs[False])
    assert [len(o.outputs[0].token_ids) for o in outs[True]] == [1, 6]


def test_async_scheduling_settings(tiny_v4_dir):
    with pytest.raises(ValueError, match="async_scheduling does not run with speculative decoding"):
        LLM(tiny_v4_dir, max_model_len=256, async_scheduling=True,
            speculative={"method": "mtp", "num_speculative_tokens": 1})
    assert LLM(tiny_v4_dir, max_model_len=256).engine.async_scheduling is False  # default: on for CUDA only


def test_a_pending_position_without_a_sampled_token_is_named(tiny_v4_dir):
    from deepinfer.scheduler.request import PENDING_TOKEN

    llm = engine(tiny_v4_dir, True)
    eng = llm.engine
    eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    out = eng.scheduler.schedule()
    sr = out.scheduled[0]
    bad = type(out)((type(sr)(sr.request, sr.start_position, sr.num_new_tokens, 0, (5, 6, PENDING_TOKEN),
                              sr.slots, 1),), (), (), 3)
    with pytest.raises(ValueError, match="'r': position 2 is pending but the previous step sampled no token"):
        eng.runner.execute(bad)


def test_an_id_reused_while_its_old_request_is_in_flight(tiny_v4_dir):
    """A request that stops at step n (known only when step n is committed, with step n+1 already queued
    for it) is reported finished; its id may then be used again at once. The old request's step n+1,
    resolved afterwards, must not report it again nor touch the new request of that id."""
    first = engine(tiny_v4_dir, False).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
    stop_at = first[0].outputs[0].token_ids[0]
    eng = engine(tiny_v4_dir, True).engine
    eng.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))
    assert eng.step() == []  # the prefill is queued
    outs = eng.step()  # the decode step is queued with x's pending token, then x's first token: a stop
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("x", True, "stop")]
    assert "x" in eng._in_flight.rows  # the old x's extra step is still to be resolved
    eng.add_request("x", [8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    reports = []
    while eng.has_unfinished():
        reports += [(o.request_id, o.prompt_token_ids, len(o.outputs[0].token_ids), o.finished) for o in eng.step()]
    assert all(r[1] == [8, 9] for r in reports), reports  # only the new x is reported
    assert all(r[2] >= 1 for r in reports), reports  # ... and not as "finished since the last step"
    assert reports[-1] == ("x", [8, 9], 3, True)
    assert eng.block_pool.num_free == eng.block_pool.num_blocks


def test_step_ids_from_the_previous_steps_tokens():
    """The runner's step ids with pending positions: the steady decode step (one pending token per request,
    in the previous step's order) takes the previous step's token tensor as it is; a reordered batch, a
    batch with a prefill chunk or with fewer requests gathers the same values the general way."""
    from deepinfer.cache.block_pool import BlockPool
    from deepinfer.engine.model_runner import ModelRunner, PendingTokens
    from deepinfer.scheduler.output import ScheduledRequest, SchedulerOutput
    from deepinfer.scheduler.request import PENDING_TOKEN, Request

    pool = BlockPool(num_blocks=32, block_size=4, max_num_seqs=8)

    def sched(rid, tokens):
        req = Request(rid, [1, 2, 3], max_tokens=9)
        return ScheduledRequest(req, 3, len(tokens), 0, tuple(tokens), pool.allocate_for(rid, 3 + len(tokens)), 1)

    prev = PendingTokens(torch.tensor([50, 51, 52]), {"a": 0, "b": 1, "c": 2})

    def ids(scheduled):
        out = SchedulerOutput(tuple(scheduled), (), (), sum(s.num_new_tokens for s in scheduled))
        flat = [t for s in scheduled for t in s.token_ids]
        return ModelRunner._token_ids(None, out, flat, prev)

    steady = ids([sched(r, [PENDING_TOKEN]) for r in "abc"])
    assert steady is prev.token_ids  # nothing copied
    assert ids([sched(r, [PENDING_TOKEN]) for r in "cab"]).tolist() == [52, 50, 51]
    assert ids([sched(r, [PENDING_TOKEN]) for r in "ab"]).tolist() == [50, 51]
    assert ids([sched("a", [PENDING_TOKEN]), sched("d", [7, 8]), sched("c", [PENDING_TOKEN])]).tolist() == \
        [50, 7, 8, 52]
    with pytest.raises(ValueError, match="pending but the previous step sampled no token"):
        ids([sched("a", [PENDING_TOKEN]), sched("e", [PENDING_TOKEN])])
