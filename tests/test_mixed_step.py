"""model/mixed_step.py: a step mixing decode rows with prefills / extends, split into the batched decode path
(decode rows) and the extend path (the rest), on the CPU twins (fast numerics).

What the split adds is plumbing: which ids go to which path, and each row back in its sequence's place.
So the split step must be bit-identical to the two sub-steps run by hand on a twin model (decode rows
through a DecodeRunner, the rest through the extend path), with every cache row the sequences own equal,
with the decode rows first (the scheduler's order) and interleaved. (Against the whole step through the
extend path it is not bit-comparable: fast numerics is chaotic, and the extend path's rows already move by
percents when the batch around them changes; that the decode path computes a row as the extend path does
is tests/test_engine_fast_decode.py's, within 1e-6 on the same batch.) The engine takes the split on a
workload that mixes them, and not with DEEPINFER_SPLIT_MIXED_STEPS=0."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model import ForwardContext, SeqContext
from deepinfer.model.decode_step import DecodeRunner
from deepinfer.model.mixed_step import can_split, forward_split
from test_engine_fast_decode import BPS, LENS, SLOTS, assert_caches_equal, prefilled_pair, table


def _runner(model) -> DecodeRunner:
    return DecodeRunner(model, max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1,
                        scratch_block=BPS * (SLOTS - 1))


def test_split_step_equals_its_two_sub_steps_by_hand(fast_params):
    cfg, params = fast_params
    models, tok, lens = prefilled_pair(cfg, params, LENS)
    runners = [_runner(m) for m in models]
    pos = list(lens)
    g = torch.Generator().manual_seed(7)
    # (sequence, new tokens) per step: decode rows first, then interleaved with the extends
    steps = [[(0, 1), (1, 1), (3, 1), (2, 20)], [(0, 1), (2, 9), (1, 1), (3, 1)], [(2, 3), (0, 1), (1, 14), (3, 1)]]
    for step in steps:
        seqs = tuple(SeqContext(pos[i], n, i, i, table(i)) for i, n in step)
        ctx = ForwardContext(seqs)
        assert can_split(ctx)
        ids = torch.randint(2, cfg.vocab_size, (sum(n for _, n in step),), generator=g)
        got = forward_split(models[1], runners[1], ids, ctx)
        # by hand on the twin: each sequence's ids from its own rows of the flat batch
        own = {i: ids[ctx.cu_tokens[k] : ctx.cu_tokens[k + 1]] for k, (i, _) in enumerate(step)}
        dec = [i for i, n in step if n == 1]
        ext = [i for i, n in step if n != 1]
        d = runners[0](torch.cat([own[i] for i in dec]), [SeqContext(pos[i], 1, i, i, table(i)) for i in dec]).clone()
        e = models[0](torch.cat([own[i] for i in ext]),
                      ForwardContext(tuple(SeqContext(pos[i], n, i, i, table(i)) for i, n in step if n != 1)))
        row = {i: d[k] for k, i in enumerate(dec)} | {i: e[k] for k, i in enumerate(ext)}
        ref = torch.stack([row[i] for i, _ in step])
        assert torch.equal(got, ref)
        for i, n in step:
            pos[i] += n
        assert_caches_equal(models[1], models[0], {i: p for i, p in enumerate(pos)})


def test_split_setting(tiny_v4_dir, monkeypatch):
    from deepinfer import env

    for value, want in (("", "auto"), ("AUTO", "auto"), ("1", "on"), ("off", "off"), ("no", "off")):
        monkeypatch.setenv("DEEPINFER_SPLIT_MIXED_STEPS", value)
        assert env.split_mixed_steps() == want
    monkeypatch.setenv("DEEPINFER_SPLIT_MIXED_STEPS", "sometimes")
    with pytest.raises(ValueError, match="DEEPINFER_SPLIT_MIXED_STEPS='sometimes'"):
        env.split_mixed_steps()
    monkeypatch.delenv("DEEPINFER_SPLIT_MIXED_STEPS")
    _, split_steps = _generate(tiny_v4_dir, monkeypatch, split=None)  # auto on the CPU: not split
    assert split_steps == 0


def test_only_mixed_one_row_steps_split():
    d, e = SeqContext(5, 1, 0, 0, (0,)), SeqContext(0, 4, 1, 1, (1,))
    assert can_split(ForwardContext((d, e)))
    assert not can_split(ForwardContext((d,)))  # all decode: the decode path alone
    assert not can_split(ForwardContext((e,)))  # no decode row
    assert not can_split(ForwardContext((d, e), all_logits=True))  # every row wanted
    with pytest.raises(ValueError, match="decode rows and other sequences"):
        forward_split(None, None, torch.zeros(4, dtype=torch.long), ForwardContext((e,)))


def _generate(model_dir, monkeypatch, split: bool | None):
    if split is not None:  # None: the default ("auto": CUDA only)
        monkeypatch.setenv("DEEPINFER_SPLIT_MIXED_STEPS", "on" if split else "off")
    llm = LLM(model_dir, numerics="fast", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              async_scheduling=False)
    eng = llm.engine
    calls = []
    from deepinfer.engine import model_runner

    def counted(extend, decode, ids, ctx):
        calls.append(1)
        return forward_split(extend, decode, ids, ctx)

    monkeypatch.setattr(model_runner, "forward_split", counted)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 129000, (n,), generator=g).tolist() for n in (9, 40, 23, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = {}
    for k, p in enumerate(prompts):  # a new prompt every other step: steps mix decodes with prefills
        eng.add_request(f"r{k}", p, params)
        for _ in range(2):
            for o in eng.step():
                outs[o.request_id] = o
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return {k: o.outputs[0] for k, o in outs.items()}, sum(calls)


def test_the_engine_splits_mixed_steps(tiny_v4_dir, monkeypatch):
    outs, split_steps = _generate(tiny_v4_dir, monkeypatch, split=True)
    assert split_steps >= 3  # the workload mixes decodes with prefills, and those steps took the split
    assert len(outs) == 4 and all(len(o.token_ids) == 10 and len(o.logprobs) == 10 for o in outs.values())
    whole, split_steps = _generate(tiny_v4_dir, monkeypatch, split=False)
    assert split_steps == 0 and all(len(o.token_ids) == 10 for o in whole.values())
