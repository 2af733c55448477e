"""The V4.1 engine model (exact numerics) against the V4.1 oracle: chunked prefill, decode, mixed varlen
batches (window wrap, ratio-2 groups, cross-layer sharing, the candidate-block filter beyond 4 compressed
entries), slot reuse including the engram n-gram history, and the engine's hashing vs the oracle's.
Both run in float64 without quantisation, so any chunking must reproduce the oracle to ~1e-15 (tol 1e-9)."""
from __future__ import annotations

import pytest
import torch

from deepinfer.cache.block_pool import BlockPool
from deepinfer.model import ForwardContext, SeqContext, forward_context, prepare_params
from deepinfer.model.v41 import V41EngineModel
from deepinfer.model.v41_cache import V41Cache

TOL = 1e-9
BLOCK = 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def parts(tiny_v41_dir):
    from deepinfer.config import ModelConfig
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    raw = load_tensors(tiny_v41_dir, cfg, progress=False)
    return cfg, raw, prepare_params(raw, cfg), Tokenizer.from_checkpoint(tiny_v41_dir)


def make_engine(parts, num_blocks=8, max_num_seqs=4):
    cfg, raw, params, tok = parts
    return V41EngineModel(cfg, params, V41Cache(cfg, num_blocks, BLOCK, max_num_seqs), raw=raw, tokenizer=tok)


@pytest.fixture(scope="module")
def oracle_logits(oracle41_factory):
    """oracle_logits(ids [N]) -> [N, V]: one exact prefill of the whole sequence, every position's logits."""
    memo = {}

    def run(ids: torch.Tensor) -> torch.Tensor:
        key = tuple(ids.tolist())
        if key not in memo:
            memo[key] = oracle41_factory(numerics="exact", max_batch=1)(ids[None], 0, all_logits=True)[0]
        return memo[key]

    return run


class Runner:
    """Drives the engine like the model runner would: a BlockPool hands out slots and blocks."""

    def __init__(self, model: V41EngineModel, pool: BlockPool) -> None:
        self.model, self.pool = model, pool
        self.done: dict[str, int] = {}

    def step(self, work, all_logits: bool = True) -> list[torch.Tensor]:
        seqs, flat = [], []
        for seq_id, ids, n in work:
            start = self.done.get(seq_id, 0)
            seqs.append(SeqContext.from_slots(self.pool.allocate_for(seq_id, start + n), start, n))
            flat.append(ids[start : start + n])
            self.done[seq_id] = start + n
        ctx = ForwardContext.build(seqs, all_logits=all_logits)
        with forward_context(ctx):
            out = self.model(torch.cat(flat))
        if not all_logits:
            return list(out.unsqueeze(1))
        return [out[ctx.rows(i)] for i in range(len(seqs))]


def test_one_sequence_chunked_prefill_then_decode(parts, oracle_logits):
    ids = tokens(48, seed=1)
    ref = oracle_logits(ids)
    run = Runner(make_engine(parts), BlockPool(8, BLOCK, 4))
    worst, pos = 0.0, 0
    for n in [1, 3, 16, 16, 3] + [1] * 9:  # window 16 wraps inside and across chunks
        (got,) = run.step([("a", ids, n)])
        for k in range(n):
            err = rel_err(got[k], ref[pos + k])
            assert err <= TOL, f"position {pos + k} (chunk of {n} at {pos}): rel_err {err:.3g}"
            worst = max(worst, err)
        pos += n
    assert pos == len(ids)
    print(f"one sequence: worst rel_err {worst:.3g}")


def test_mixed_varlen_batch(parts, oracle_logits):
    """Sequences of lengths 1..70 extended together: prefill chunks, decodes, multi-token extends."""
    lengths = {"s1": 1 + 4, "s12": 12 + 4, "s40": 40 + 4, "s70": 70 + 4}
    ids = {k: tokens(n, seed=10 + i) for i, (k, n) in enumerate(lengths.items())}
    refs = {k: oracle_logits(v) for k, v in ids.items()}
    run = Runner(make_engine(parts), BlockPool(8, BLOCK, 4))
    schedule = [
        [("s1", 1), ("s12", 5), ("s70", 33)],  # s40 not started yet
        [("s70", 37), ("s1", 1), ("s12", 7), ("s40", 13)],  # odd/even group edges of the ratio-2 layers
        [("s1", 1), ("s40", 27), ("s12", 1), ("s70", 1)],
        [("s70", 3), ("s12", 2), ("s1", 1), ("s40", 3)],  # multi-token extends (draft-sized)
        [("s40", 1), ("s12", 1), ("s1", 1)],
    ]
    worst = 0.0
    for step in schedule:
        work = [(k, ids[k], n) for k, n in step]
        starts = [run.done.get(k, 0) for k, _ in step]
        for (k, n), start, got in zip(step, starts, run.step(work)):
            for j in range(n):
                err = rel_err(got[j], refs[k][start + j])
                assert err <= TOL, f"{k} position {start + j}: rel_err {err:.3g}"
                worst = max(worst, err)
    assert all(run.done[k] == n for k, n in lengths.items())
    print(f"mixed batch: worst rel_err {worst:.3g}")


def test_paged_entries_across_blocks(parts, oracle_logits):
    """A sequence past one block (128 tokens: 64 ratio-2 / 128 ratio-1 entries) on non-adjacent blocks,
    beside a short one, with extends straddling the block edge."""
    ids, other = tokens(140, seed=30), tokens(6, seed=31)
    ref, ref_o = oracle_logits(ids), oracle_logits(other)
    pool = BlockPool(8, BLOCK, 4)
    run = Runner(make_engine(parts), pool)
    run.step([("o", other, 2)])  # takes the first free block so the long one is not on blocks 0, 1
    pos, worst = 0, 0.0
    for n in [100, 27, 2, 1, 7, 1, 1, 1]:  # the 2-token extend holds 127|128
        work = [("a", ids, n)] + ([("o", other, 1)] if run.done["o"] < len(other) else [])
        start_o = run.done["o"]
        got, *rest = run.step(work)
        for got_o in rest:
            worst = max(worst, rel_err(got_o[0], ref_o[start_o]))
        for k in range(n):
            worst = max(worst, rel_err(got[k], ref[pos + k]))
        pos += n
    assert pos == len(ids) and worst <= TOL, worst
    assert pool.slots("a").block_table != (0, 1)
    print(f"paged: worst rel_err {worst:.3g}")


def test_last_row_logits_and_slot_reuse(parts, oracle_logits):
    """Default output is each sequence's last row; a slot reused at position 0 starts clean (window ring,
    ratio-2 compressor state and the engram n-gram history)."""
    model = make_engine(parts, num_blocks=1, max_num_seqs=1)
    pool = BlockPool(1, BLOCK, 1)  # one of everything: b must reuse a's ring, state slot and block
    run = Runner(model, pool)
    a, b = tokens(31, seed=20), tokens(25, seed=21)
    run.step([("a", a, 31)], all_logits=False)  # odd: leaves a partial ratio-2 group behind
    slots_a = pool.slots("a")
    pool.free("a")
    run.done.clear()
    (first,) = run.step([("b", b, 3)], all_logits=False)
    slots_b = pool.slots("b")
    assert (slots_b.window_slot, slots_b.state_slot, slots_b.block_table) == (
        slots_a.window_slot, slots_a.state_slot, slots_a.block_table)
    assert first.shape == (1, 129280)
    assert rel_err(first[0], oracle_logits(b)[2]) <= TOL
    for n, last_pos in [(1, 3), (21, 24)]:
        (last,) = run.step([("b", b, n)], all_logits=False)
        assert rel_err(last[0], oracle_logits(b)[last_pos]) <= TOL


def test_hashes_match_oracle_hasher(parts):
    """The engine's n-gram hashes, carried per slot across calls of any length, equal the oracle's."""
    from deepinfer.reference.engram import NgramHasher, engram_primes, hash_multipliers

    cfg, _, _, tok = parts
    model = make_engine(parts, max_num_seqs=2)
    ref = NgramHasher(cfg, 1, 64, tok)
    assert model.hasher.primes.tolist() == [list(map(list, x)) for x in engram_primes(
        tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)]
    assert torch.equal(model.hasher.mult, hash_multipliers(
        tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size))
    assert torch.equal(model.hasher.token_map, ref.token_map)
    ids = torch.tensor([2, 7, 7, 100, 5000, 2, 2, 129279, 9, 9, 9, 31, 64000])  # repeats and the pad id
    want = torch.cat([ref(ids[None, :1], 0)[0]] + [ref(ids[None, p : p + 1], p)[0] for p in range(1, len(ids))])
    model.hasher.reset(1)
    got, pos = [], 0
    for n in [1, 1, 4, 7]:
        ctx = ForwardContext.build([SeqContext(pos, n, 0, 1, (0,))])
        got.append(model.hasher(ids[pos : pos + n], ctx))
        pos += n
    assert torch.equal(torch.cat(got), want)


def test_context_validation(parts):
    model = make_engine(parts, num_blocks=2, max_num_seqs=2)
    with pytest.raises(RuntimeError):
        model(torch.tensor([5]))  # no ForwardContext entered
    with pytest.raises(ValueError):  # block table too short for compressed entries
        model(torch.tensor([5] * 4), ForwardContext.build([SeqContext(0, 4, 0, 0, ())]))
    with pytest.raises(ValueError):
        V41Cache(parts[0], 2, 101, 2)  # block size not a multiple of the ratio 2
    with pytest.raises(ValueError):
        V41EngineModel(parts[0], parts[2], V41Cache(parts[0], 2, BLOCK, 2))  # engram needs raw + tokenizer


def test_llm_generate_greedy_matches_oracle(tiny_v41_dir, oracle41_factory):
    """LLM over the tiny V4.1 checkpoint (runner -> V41EngineModel): 3 prompts batched with a token budget
    of 16 (chunked prefill beside decodes) give the oracle's greedy tokens and step logits."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.reference.generate import generate

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (1, 9, 30)]
    llm = LLM(tiny_v41_dir, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=16)
    seen: dict[str, list[torch.Tensor]] = {}
    runner, execute = llm.engine.runner, llm.engine.runner.execute

    def wrapped(out, want_prompt=frozenset()):
        result = execute(out, want_prompt)
        for rid, rows in out.sample_rows().items():
            seen.setdefault(rid, []).extend(result.sample_logits[list(rows)])
        return result

    runner.execute = wrapped
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(seen) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        rows = seen[next(r for r in seen if r.endswith(f"-{i}-0"))]  # scheduler ids: <request>-<i>-<sample>
        assert len(rows) == 8
        (ref,) = generate(oracle41_factory(numerics="exact", max_batch=1), [prompt], 8, eos_id=-1)
        assert list(out.outputs[0].token_ids) == ref.tokens
        for got, want in zip(rows, ref.step_logits):
            assert rel_err(got, want) <= TOL
