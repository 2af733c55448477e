"""The batched decode path in a parallel group (CPU, gloo, 2 processes, fast numerics, tiny V4): every rank
runs a pure-decode step (with dp > 1: its dp group's share) through `model/decode_step.py`, the steps' block tables
cross as changes (engine/step_message.py). Against the same group with the path off
(DEEPINFER_BATCHED_DECODE=0: the general varlen path, as before 2026-12-05): the same tokens and
bit-identical sampled logits. Four prompts that finish together keep every decode step at bucket 4 (the
CPU twins' GEMMs round by row count, so a padded batch would be another draw, tests/test_engine_fast_decode.py),
and one prompt crosses a 128-token block while decoding (a table that grows: a tail on the wire)."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

ENGINE = dict(numerics="fast", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512,
              kv_cache_bytes=1 << 27, distributed_timeout_s=120)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 129280, (n,), generator=g).tolist() for n in (30, 9, 125, 4)]


def _run(model_dir, **parallel):
    llm = LLM(model_dir, **ENGINE, **parallel)
    runner = llm.engine.runner
    seen: dict[str, list[torch.Tensor]] = {}
    execute = runner.execute

    def recording(out, want_prompt=frozenset()):
        result = execute(out, want_prompt)
        for rid, rows in out.sample_rows().items():
            seen.setdefault(rid, []).extend(result.sample_logits[list(rows)].clone())
        return result

    runner.execute = recording
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        decoded = None if runner.decoder is None else runner.decoder.eager + runner.decoder.replayed
    finally:
        llm.shutdown()
    logits = [seen[next(r for r in seen if r.endswith(f"-{i}-0"))] for i in range(len(outs))]
    return [o.outputs[0].token_ids for o in outs], logits, decoded


@pytest.mark.parametrize("tp,ep,dp", [
    (2, 2, 1),  # the official mp=2 layout
    (2, 1, 1),  # experts replicated
    (1, 2, 2),  # two dp groups, each decoding its own 2 sequences (bucket 2), experts over the world
])
def test_parallel_decode_path_is_the_general_path_bit_for_bit(tiny_v4_dir, monkeypatch, tp, ep, dp):
    split = dict(tensor_parallel_size=tp, expert_parallel_size=ep, data_parallel_size=dp)
    tokens, logits, decoded = _run(tiny_v4_dir, **split)
    assert decoded == 7, f"rank 0 ran {decoded} decode steps through the batched path, want the 7 after the prefill"
    monkeypatch.setenv("DEEPINFER_BATCHED_DECODE", "0")  # read by every rank at start (spawned: inherited)
    ref_tokens, ref_logits, off = _run(tiny_v4_dir, **split)
    assert off is None
    assert tokens == ref_tokens
    for p, (got_rows, ref_rows) in enumerate(zip(logits, ref_logits)):
        assert len(got_rows) == len(ref_rows) == 8
        for step, (got, ref) in enumerate(zip(got_rows, ref_rows)):
            assert torch.equal(got, ref), f"prompt {p} step {step}: max diff {float((got - ref).abs().max()):.3g}"
