"""The batched decode path of V4.1 fast numerics (`model/v41_decode.py` through `decode_step.DecodeRunner`) on
the tiny V4.1 checkpoint.

CPU: against the varlen fast path (`V41EngineModel.forward`, its reference) on the same params and inputs,
teacher-forced over steps that cross the window (16), complete ratio-2 groups and ratio-1 entries, with the
candidate-block filter engaged (> 4 entries) and the Engram hashing across the prefill/decode boundary:
logits bit-identical where every row sees at least index_topk entries (the index rows then have the same
width on both paths; measured: bit-identical at every step), within 1e-6 otherwise (a row that sees fewer
than index_topk entries has more -1 padding here: only summation order may differ; measured: also
bit-identical), and every cache row the real sequences will read again equal at the end. Padding rows of a
bucket change neither the real rows' logits nor anything the real sequences own. The engine routes V4.1's
pure-decode steps through the path, with the tokens of the engine without it.
GPU (-m gpu): graph replay vs the eager decode path, bit-identical; the graphed path on cuda (Triton kernels)
vs the oracle within its noise floor (the `test_engine_fast` judge, the V4.1 tests' oracle run).
"""
from __future__ import annotations

import pytest
import torch

import test_engine_fast as v4_fast
import test_engine_fast_v41 as tf41
from test_engine_fast_decode import (engine_decodes_with_and_without_the_batched_path, padded_steps_equal_full,
                                     prefilled_models, rel_err, replay_steps_equal_eager)
from test_engine_fast_v41 import oracle_run, parts  # noqa: F401  (module-scoped fixtures)
from deepinfer.model import ForwardContext, SeqContext
from deepinfer.model.decode_step import DecodeRunner
from deepinfer.model.v41 import V41EngineModel, build_v41_model, v41_params

LONG = (70, 17, 9, 41)  # every row sees >= index_topk (4) entries of both ratios from the first decode step
SHORT = (70, 17, 5, 3)  # rows 2 and 3 see fewer: their index rows get more -1 padding on this path
STEPS = 12
BPS = 2  # blocks per sequence: 256 positions
SLOTS = 5  # 4 sequences + the decode path's scratch slot (and block)


def table(i: int) -> tuple[int, ...]:
    return tuple(range(BPS * i, BPS * (i + 1)))


@pytest.fixture(scope="module")
def fast_params(parts):  # noqa: F811
    cfg, raw, _ = parts
    return v41_params(raw, cfg, "fast", "cpu")


def fresh_model(parts, params, device="cpu") -> V41EngineModel:  # noqa: F811
    cfg, raw, tok = parts
    return build_v41_model(cfg, raw, tok, "fast", device, num_blocks=BPS * SLOTS, max_num_seqs=SLOTS, params=params)


def prefilled_pair(parts, params, lens, device="cpu"):  # noqa: F811
    """Two models over the same params, both with `lens` prompts prefilled by the varlen path."""
    return prefilled_models(lambda: fresh_model(parts, params, device), parts[0].vocab_size, lens, table, device)


def runner_for(model, max_batch=4, **kw) -> DecodeRunner:
    return DecodeRunner(model, max_batch=max_batch, max_context=BPS * 128, scratch_slot=SLOTS - 1,
                        scratch_block=BPS * (SLOTS - 1), **kw)


def cache_tensors(model: V41EngineModel) -> dict[str, torch.Tensor]:
    out = {}
    for i, lc in enumerate(model.cache.layers):
        out[f"{i}.ring"] = lc.ring
        for name in ("comp", "index_keys", "state_kv", "state_score"):
            if getattr(lc, name) is not None:
                out[f"{i}.{name}"] = getattr(lc, name)
    out["engram.history"] = model.hasher.history
    return out


def assert_caches_equal(got_model, ref_model, ends: dict[int, int]) -> None:
    """Every cache row sequence i (ending at position ends[i]) reads again is equal: its ring, its blocks'
    latents and index keys, its n-gram history; of a ratio-2 state the rows of the unfinished group (the
    varlen path clears the rest after a group completes, this path leaves them: neither reads them)."""
    cfg = ref_model.cfg
    ref, got = cache_tensors(ref_model), cache_tensors(got_model)
    for name in ref:
        if name.endswith(("ring", "history")):
            idx = torch.tensor(list(ends))
        elif name.endswith(("state_kv", "state_score")):
            r = cfg.compress_ratios[int(name.split(".")[0])]
            for i, end in ends.items():
                assert torch.equal(got[name][i, : end % r], ref[name][i, : end % r]), (name, i)
            continue
        else:
            epb = ref_model.cache.block_size // cfg.compress_ratios[int(name.split(".")[0])]
            blocks = torch.tensor([b for i in ends for b in table(i)])
            idx = (blocks.unsqueeze(1) * epb + torch.arange(epb)).flatten()
        assert torch.equal(got[name][idx], ref[name][idx]), name


def run_both(models, tok, lens, runner, steps=STEPS):
    """Teacher-forced decode steps: models[0] by the varlen path, models[1] by `runner` -> per-step rel_err."""
    errs = []
    for k in range(steps):
        seqs = [SeqContext(n + k, 1, i, i, table(i)) for i, n in enumerate(lens)]
        ref = models[0](tok, ForwardContext(tuple(seqs)))
        got = runner(tok, seqs).clone()
        errs.append(0.0 if torch.equal(got, ref) else rel_err(got, ref))
        tok = ref.argmax(-1)
    return errs


# ---------------------------------------------------------------------------------------------- CPU
def test_v41_batched_decode_equals_the_varlen_path(parts, fast_params):  # noqa: F811
    cfg = parts[0]
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size < min(LONG)  # the candidate filter engages
    models, tok = prefilled_pair(parts, fast_params, LONG)
    runner = runner_for(models[1])
    errs = run_both(models, tok, LONG, runner)
    print(f"\nV4.1 batched decode vs varlen path: per-step rel_err {errs}")
    assert errs == [0.0] * STEPS, errs
    assert runner.eager == STEPS and runner.replayed == 0
    assert_caches_equal(models[1], models[0], {i: n + STEPS for i, n in enumerate(LONG)})


def test_v41_batched_decode_with_fewer_entries_than_topk(parts, fast_params):  # noqa: F811
    models, tok = prefilled_pair(parts, fast_params, SHORT)
    errs = run_both(models, tok, SHORT, runner_for(models[1]))
    print(f"\nshort rows: per-step rel_err {errs}")
    assert max(errs) <= 1e-6, errs
    assert_caches_equal(models[1], models[0], {i: n + STEPS for i, n in enumerate(SHORT)})


def test_v41_padding_rows_touch_only_the_scratch(parts, fast_params):  # noqa: F811
    """3 sequences padded to a bucket of 4 vs the same 3 with a real 4th sequence in the 4th row (same shapes:
    CPU GEMMs round per row count): the real rows' logits and caches are bit-identical, and nothing of the
    unused slot 3 and its blocks changed (its n-gram history neither)."""
    models, tok = prefilled_pair(parts, fast_params, LONG)
    runners = [runner_for(m) for m in models]
    assert runners[1].bucket(3) == 4
    before = {k: v.clone() for k, v in cache_tensors(models[1]).items()}
    steps = 5
    padded_steps_equal_full(runners, tok, LONG, steps, table)
    assert_caches_equal(models[1], models[0], {i: n + steps for i, n in enumerate(LONG[:3])})
    cfg, got = parts[0], cache_tensors(models[1])
    for name, t in got.items():
        if name.endswith(("ring", "state_kv", "state_score", "history")):
            idx = 3
        else:
            epb = models[1].cache.block_size // cfg.compress_ratios[int(name.split(".")[0])]
            idx = (torch.tensor(table(3)).unsqueeze(1) * epb + torch.arange(epb)).flatten()
        assert torch.equal(t[idx], before[name][idx]), name
    assert not torch.equal(got["0.ring"][SLOTS - 1], before["0.ring"][SLOTS - 1])  # the padding row ran


def test_v41_engram_decode_hashes_equal_the_varlen_hasher(parts):  # noqa: F811
    """`EngramHasher.decode_hashes` (one token per row, no loop) == `__call__` on the same decode batch, and both
    leave the same histories (fresh slot, slots mid-sequence, a reset slot)."""
    from deepinfer.model.engram import EngramHasher, compressed_token_map

    cfg, _, tok = parts
    token_map, size = compressed_token_map(tok)
    hashers = [EngramHasher(cfg, 4, token_map, size) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    for h in hashers:  # slots 0 and 2 mid-sequence, slot 1 one token in, slot 3 fresh
        ids = torch.randint(0, cfg.vocab_size, (9,), generator=g.manual_seed(5))
        h(ids, ForwardContext((SeqContext(0, 6, 0, 0, (0,)), SeqContext(0, 1, 1, 1, (1,)),
                               SeqContext(0, 2, 2, 2, (2,)))))
    for k in range(4):
        ids = torch.randint(0, cfg.vocab_size, (4,), generator=g)
        seqs = (SeqContext(6 + k, 1, 0, 0, (0,)), SeqContext(1 + k, 1, 1, 1, (1,)), SeqContext(2 + k, 1, 2, 2, (2,)),
                SeqContext(k, 1, 3, 3, (3,)))
        want = hashers[0](ids, ForwardContext(seqs))
        got = hashers[1].decode_hashes(ids, torch.tensor([s.state_slot for s in seqs]),
                                       torch.tensor([s.start_pos for s in seqs]))
        assert torch.equal(got, want), k
        assert torch.equal(hashers[1].history, hashers[0].history), k


def test_llm_fast_v41_decodes_through_the_batched_path(tiny_v41_dir):
    """LLM(numerics="fast") on V4.1: pure-decode steps go through the runner's DecodeRunner, and the greedy
    tokens equal those of the same engine with the decode path switched off (prompts long enough that every
    row sees index_topk entries, finishing together: bit-identical on the CPU twins)."""
    from deepinfer.config import ModelConfig

    engine_decodes_with_and_without_the_batched_path(tiny_v41_dir, ModelConfig.from_checkpoint(tiny_v41_dir),
                                                     (30, 9, 131, 12))


def test_v41_decode_runner_errors(parts, fast_params):  # noqa: F811
    model = fresh_model(parts, fast_params)
    runner = runner_for(model, max_batch=2)
    with pytest.raises(ValueError, match="one new token"):
        runner(torch.tensor([5]), [SeqContext(3, 2, 0, 0, table(0))])
    with pytest.raises(ValueError, match="scratch"):
        runner(torch.tensor([5]), [SeqContext(3, 1, SLOTS - 1, 0, table(0))])
    with pytest.raises(ValueError, match="max_context"):
        runner(torch.tensor([5]), [SeqContext(BPS * 128, 1, 0, 0, table(0))])
    cfg, raw, tok = parts
    official = build_v41_model(cfg, raw, tok, "official", "cpu", num_blocks=4, max_num_seqs=2)
    with pytest.raises(ValueError, match="fast numerics"):
        DecodeRunner(official, 1, 256, scratch_slot=1, scratch_block=3)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_v41_graph_replay_is_bit_identical_to_eager(parts, cuda_kernels):  # noqa: F811
    """Two models in the same state; one replays the captured graphs, the other runs the same decode path
    eagerly: logits and every cache tensor bit-identical after each step (bucket 4 full, and 3 sequences
    padded to it)."""
    cfg, raw, _ = parts
    params = v41_params(raw, cfg, "fast", "cuda")
    models, tok = prefilled_pair(parts, params, LONG, "cuda")
    runners = [runner_for(m, cuda_graphs=True) for m in models]
    assert set(runners[1]._graphs) == {(b, c) for b in (1, 2, 4) for c in (128, 256)}
    replay_steps_equal_eager(runners, tok, LONG, STEPS, table)
    assert runners[1].replayed == STEPS
    for name, ref in cache_tensors(models[0]).items():  # same path both sides: every row, stale ones too
        assert torch.equal(cache_tensors(models[1])[name].cpu(), ref.cpu()), name


@pytest.mark.gpu
def test_v41_fast_decode_cuda_matches_the_oracle_within_its_noise(parts, oracle_run, cuda_kernels):  # noqa: F811
    """Prefill by the varlen path, then the oracle's greedy tokens decoded by the graphed decode path, judged
    like test_engine_fast_v41 (the oracle's own noise floors)."""
    cfg, raw, tok = parts
    n, bps = len(tf41.LENS), tf41.BLOCKS_PER_SEQ
    model = build_v41_model(cfg, raw, tok, "fast", "cuda", num_blocks=bps * (n + 1), max_num_seqs=n + 1)
    runner = DecodeRunner(model, max_batch=n, max_context=bps * 128, scratch_slot=n, scratch_block=bps * n)

    def tab(i):
        return tuple(range(bps * i, bps * (i + 1)))

    ps, tokens = tf41.prompts(cfg), oracle_run[1]
    ctx = ForwardContext(tuple(SeqContext(0, len(p), i, i, tab(i)) for i, p in enumerate(ps)))
    out = [model(torch.cat(ps).cuda(), ctx)]
    for k in range(v4_fast.STEPS):
        seqs = [SeqContext(len(p) + k, 1, i, i, tab(i)) for i, p in enumerate(ps)]
        out.append(runner(tokens[k], seqs).clone())
    assert runner.replayed == v4_fast.STEPS
    v4_fast.judge("V4.1 fast decode path (cuda graphs) vs oracle official", torch.stack(out).to("cpu", torch.float64),
                  oracle_run)
