"""Speculative decoding through the engine (exact numerics, tiny V4): greedy output token-for-token
identical with and without drafting for 20 prompts (1-127 tokens, decoding across the window and the
ratio-4/ratio-128 compressed-block boundaries) in batches of 1 and 8, with forced drafters (100%, 0% and
every partial acceptance) and the real MTP drafter; logprobs identical; seeded sampling identical;
acceptance statistics per draft position; a planted off-by-one row map is caught."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.scheduler.output import SchedulerOutput
from engine_watch import record_preemptions
from spec_proposers import ForcedProposer

LENGTHS = [1, 2, 3, 5, 8, 13, 15, 16, 17, 20, 31, 33, 60, 100, 120, 122, 123, 124, 125, 127]
NEW = 10
K = 3


def make_prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in lengths]


def generate(model_dir, prompts, params, batch=8, speculative=None):
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=batch, max_num_batched_tokens=128,
              kv_cache_bytes=1 << 27, speculative=speculative)
    return llm, llm.generate(prompts, params)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def baseline(tiny_v4_dir):
    prompts = make_prompts()
    _, outs = generate(tiny_v4_dir, prompts, GREEDY)
    return prompts, outs


def forced(baseline, mode, k=K):
    prompts, outs = baseline
    cont = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
    return {"method": "custom", "proposer": ForcedProposer(cont, mode), "num_speculative_tokens": k}


def assert_same(base, got, logprobs=True):
    for i, (a, b) in enumerate(zip(base, got)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb, f"prompt {i}: tokens differ at {next(j for j, (x, y) in enumerate(zip(ta, tb)) if x != y)}"
        if logprobs:
            for j, (la, lb) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
                assert la.keys() == lb.keys(), f"prompt {i} token {j}: top tokens differ"
                for t in la:
                    assert abs(la[t].logprob - lb[t].logprob) <= 1e-9, f"prompt {i} token {j}: logprob"
                    assert la[t].rank == lb[t].rank
            assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) <= 1e-8


@pytest.mark.parametrize("mode,rates", [("oracle", [1.0] * K), ("wrong", [0.0] * K), ("mixed", None)])
def test_forced_drafts_greedy_identity_batch8(tiny_v4_dir, baseline, mode, rates):
    prompts, base = baseline
    llm, outs = generate(tiny_v4_dir, prompts, GREEDY, speculative=forced(baseline, mode))
    assert_same(base, outs)
    stats = llm.engine.spec_stats
    assert stats.num_steps > 0
    if rates is not None:
        assert stats.rates() == rates
    else:  # every acceptance length occurs, so every rollback length was exercised
        assert 0 < stats.rates()[-1] < stats.rates()[0] < 1


def test_forced_drafts_greedy_identity_batch1(tiny_v4_dir, baseline):
    prompts, base = baseline
    _, outs = generate(tiny_v4_dir, prompts, GREEDY, batch=1, speculative=forced(baseline, "mixed"))
    assert_same(base, outs)


@pytest.mark.parametrize("batch", [1, 8])
def test_mtp_greedy_identity(tiny_v4_dir, baseline, batch):
    prompts, base = baseline
    if batch == 1:
        prompts, base = prompts[::4], base[::4]  # batch 1 runs the prompts one by one: a subset keeps it short
    llm, outs = generate(tiny_v4_dir, prompts, GREEDY, batch=batch,
                         speculative={"method": "mtp", "num_speculative_tokens": 2})
    assert_same(base, outs)
    stats = llm.engine.spec_stats.as_dict()
    assert stats["num_steps"] > 0 and len(stats["proposed"]) == 2


def test_seeded_sampling_identical_with_drafts(tiny_v4_dir, baseline):
    """Verification draws one noise row per emitted token from the request's generator, as plain decoding
    does, so a seeded sampled run is token-identical with drafts (whatever their quality)."""
    prompts = baseline[0][::2]
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=NEW, ignore_eos=True, seed=7, logprobs=1)
    _, base = generate(tiny_v4_dir, prompts, params)
    # drafts from the greedy continuation: often right for the first tokens, then wrong
    _, outs = generate(tiny_v4_dir, prompts, params, speculative=forced(baseline, "oracle"))
    assert_same(base, outs)


def test_planted_off_by_one_row_map_is_caught(tiny_v4_dir, baseline, monkeypatch):
    """Shift every request's sampled rows by one (row j of a request read as row j + 1, wrapping): the
    identity check must fail."""
    original = SchedulerOutput.sample_rows

    def shifted(self):
        rows = original(self)
        total = sum(len(r) for r in rows.values())
        return {rid: [(i + 1) % total for i in r] for rid, r in rows.items()}

    monkeypatch.setattr(SchedulerOutput, "sample_rows", shifted)
    prompts, base = baseline
    _, outs = generate(tiny_v4_dir, prompts[:8], GREEDY, speculative=forced(baseline, "oracle"))
    with pytest.raises(AssertionError, match="tokens differ"):
        assert_same(base[:8], outs)


def test_bad_speculative_config(tiny_v4_dir, tiny_v41_dir):
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(tiny_v4_dir, speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_v4_dir, speculative={"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(tiny_v4_dir, speculative={"method": "mtp", "k": 2})
    with pytest.raises(ValueError, match="family v4"):
        LLM(tiny_v41_dir, speculative={"method": "mtp"})


def test_stop_string_inside_accepted_drafts(tiny_v4_dir, baseline):
    """A stop string matched at an accepted draft ends the output there: the tokens verified after it are
    dropped, so text, ids and logprobs equal the non-drafting run's."""
    prompts, base = baseline
    prompts = prompts[:6]
    stops = [b.outputs[0].text[len(b.outputs[0].text) // 2 :][:2] for b in base[:6]]
    stops = [s for s in stops if s.strip()] or ["a"]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1, stop=stops)
    _, plain = generate(tiny_v4_dir, prompts, params)
    _, drafted = generate(tiny_v4_dir, prompts, params, speculative=forced(baseline, "oracle"))
    assert any(o.outputs[0].finish_reason == "stop" for o in plain)
    assert_same(plain, drafted)
    for a, b in zip(plain, drafted):
        assert (a.outputs[0].text, a.outputs[0].finish_reason) == (b.outputs[0].text, b.outputs[0].finish_reason)
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)


def test_preemption_under_drafting(tiny_v4_dir, baseline):
    """Too few KV blocks for 8 sequences: requests are preempted and recomputed while drafting."""
    prompts, base = baseline
    llm = LLM(tiny_v4_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, num_blocks=5,
              speculative=forced(baseline, "mixed"))
    preempted = record_preemptions(llm)
    outs = llm.generate(prompts, GREEDY)
    assert preempted, "the test needs preemptions to happen"
    assert_same(base, outs)


def test_prompt_logprobs_with_mtp(tiny_v4_dir, baseline):
    """The drafter's target step (spec/target.py) returns the same prompt logprob rows as the runner."""
    prompts = baseline[0][:3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    _, plain = generate(tiny_v4_dir, prompts, params)
    _, drafted = generate(tiny_v4_dir, prompts, params, speculative={"method": "mtp", "num_speculative_tokens": 2})
    assert_same(plain, drafted)
    for a, b in zip(plain, drafted):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for u, v in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert u.keys() == v.keys()
            assert all(abs(u[t].logprob - v[t].logprob) <= 1e-9 for t in u)
