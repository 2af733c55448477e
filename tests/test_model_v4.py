"""The V4 engine model (exact numerics) against the oracle: chunked prefill, decode, mixed varlen batches,
window wrap and compressed-block edges. Both run in float64 without quantisation, so any chunking of a
sequence must reproduce the oracle's logits to ~1e-12 (tolerance 1e-9)."""
from __future__ import annotations

import pytest
import torch

from deepinfer.cache.block_pool import BlockPool
from deepinfer.model import ForwardContext, SeqContext, V4Cache, V4EngineModel, forward_context, prepare_params

TOL = 1e-9
BLOCK = 128  # tokens per block: a multiple of both compression ratios (4, 128)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def engine_parts(tiny_v4_raw):
    cfg, raw = tiny_v4_raw
    return cfg, prepare_params(raw, cfg)


def make_engine(engine_parts, num_blocks=16, max_num_seqs=4):
    cfg, params = engine_parts
    return V4EngineModel(cfg, params, V4Cache(cfg, num_blocks, BLOCK, max_num_seqs))


@pytest.fixture(scope="module")
def oracle_logits(oracle_factory, tiny_v4_raw):
    """oracle_logits(ids [N]) -> [N, V]: one exact prefill of the whole sequence, every position's logits."""
    memo = {}

    def run(ids: torch.Tensor) -> torch.Tensor:
        key = tuple(ids.tolist())
        if key not in memo:
            memo[key] = oracle_factory(numerics="exact", max_batch=1, max_seq_len=512)(ids[None], 0, all_logits=True)[0]
        return memo[key]

    return run


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(seed))


class Runner:
    """Drives the engine like the model runner would: a BlockPool hands out slots and blocks."""

    def __init__(self, model: V4EngineModel, pool: BlockPool) -> None:
        self.model, self.pool = model, pool
        self.done: dict[str, int] = {}

    def step(self, work: list[tuple[str, torch.Tensor, int]], all_logits: bool = True) -> list[torch.Tensor]:
        """work: (seq_id, full ids, number of new tokens); returns per sequence its new rows' logits."""
        seqs, flat = [], []
        for seq_id, ids, n in work:
            start = self.done.get(seq_id, 0)
            slots = self.pool.allocate_for(seq_id, start + n)
            seqs.append(SeqContext.from_slots(slots, start, n))
            flat.append(ids[start : start + n])
            self.done[seq_id] = start + n
        ctx = ForwardContext.build(seqs, all_logits=all_logits)
        with forward_context(ctx):
            out = self.model(torch.cat(flat))
        if not all_logits:
            return list(out.unsqueeze(1))
        return [out[ctx.rows(i)] for i in range(len(seqs))]


def check_chunks(engine_parts, oracle_logits, ids: torch.Tensor, chunks: list[int]) -> float:
    ref = oracle_logits(ids)
    run = Runner(make_engine(engine_parts), BlockPool(16, BLOCK, 4))
    worst, pos = 0.0, 0
    for n in chunks:
        (got,) = run.step([("a", ids, n)])
        for k in range(n):
            err = rel_err(got[k], ref[pos + k])
            assert err <= TOL, f"position {pos + k} (chunk of {n} at {pos}): rel_err {err:.3g}"
            worst = max(worst, err)
        pos += n
    assert pos == len(ids)
    return worst


def test_one_sequence_chunked_prefill_then_decode(engine_parts, oracle_logits):
    ids = tokens(96, seed=1)
    worst = check_chunks(engine_parts, oracle_logits, ids, [1, 7, 64] + [1] * 24)
    print(f"one sequence: worst rel_err {worst:.3g}")


def test_window_wrap_and_block_edges(engine_parts, oracle_logits):
    # chunk boundaries at 15|16|17 (window 16 wraps), 4-aligned and unaligned ratio-4 edges, single tokens at
    # 126, 127 (completes the first ratio-128 entry) and 128, a long chunk completing many ratio-4 blocks,
    # and a decode run across later window wraps
    ids = tokens(200, seed=2)
    chunks = [3, 12, 1, 1, 2, 4, 5, 98, 1, 1, 1, 2, 10, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 25, 18]
    assert sum(chunks) == 200
    worst = check_chunks(engine_parts, oracle_logits, ids, chunks)
    print(f"edges: worst rel_err {worst:.3g}")


def test_single_extend_across_first_compressed_entry(engine_parts, oracle_logits):
    ids = tokens(140, seed=3)
    check_chunks(engine_parts, oracle_logits, ids, [120, 12, 8])  # 120..131 holds 127|128


def test_mixed_varlen_batch(engine_parts, oracle_logits):
    """Sequences of different lengths in one forward: some prefilling, some decoding, some extending."""
    lengths = {"s1": 1 + 9, "s20": 20 + 9, "s150": 150 + 9, "s40": 40 + 9}
    ids = {k: tokens(n, seed=10 + i) for i, (k, n) in enumerate(lengths.items())}
    refs = {k: oracle_logits(v) for k, v in ids.items()}
    run = Runner(make_engine(engine_parts, num_blocks=16, max_num_seqs=4), BlockPool(16, BLOCK, 4))
    schedule = [
        [("s1", 1), ("s20", 20), ("s150", 70)],  # s40 not started yet
        [("s150", 80), ("s1", 1), ("s20", 1), ("s40", 13)],  # s150 finishes its prefill beside decodes
        [("s1", 1), ("s40", 27), ("s20", 1), ("s150", 1)],
        [("s150", 3), ("s20", 4), ("s1", 5), ("s40", 1)],  # multi-token extends (draft-sized)
        [("s40", 1), ("s150", 1), ("s1", 1), ("s20", 1)],
        [("s20", 2), ("s150", 4), ("s1", 1), ("s40", 7)],
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


def test_last_row_logits_and_slot_reuse(engine_parts, oracle_logits):
    """Default output is each sequence's last row; a slot reused at position 0 starts clean."""
    model = make_engine(engine_parts, num_blocks=1, max_num_seqs=1)
    pool = BlockPool(1, BLOCK, 1)  # one of everything: b must reuse a's ring, state slot and block
    run = Runner(model, pool)
    a, b = tokens(30, seed=20), tokens(25, seed=21)
    run.step([("a", a, 30)], all_logits=False)
    slots_a = pool.slots("a")
    pool.free("a")
    run.done.clear()
    (first,) = run.step([("b", b, 18)], all_logits=False)
    slots_b = pool.slots("b")
    assert (slots_b.window_slot, slots_b.state_slot, slots_b.block_table) == (
        slots_a.window_slot, slots_a.state_slot, slots_a.block_table)
    assert first.shape == (1, 129280)
    assert rel_err(first[0], oracle_logits(b)[17]) <= TOL
    (last,) = run.step([("b", b, 7)], all_logits=False)
    assert rel_err(last[0], oracle_logits(b)[24]) <= TOL


def test_context_validation(engine_parts):
    model = make_engine(engine_parts, num_blocks=2, max_num_seqs=2)
    with pytest.raises(ValueError):
        SeqContext(0, 0, 0, 0)
    with pytest.raises(ValueError):  # two sequences on one ring
        ForwardContext.build([SeqContext(0, 1, 0, 0, (0,)), SeqContext(0, 1, 0, 1, (1,))])
    with pytest.raises(RuntimeError):
        model(torch.tensor([5]))  # no ForwardContext entered
    with pytest.raises(ValueError):  # block table too short for compressed entries
        model(torch.tensor([5] * 4), ForwardContext.build([SeqContext(0, 4, 0, 0, ())]))
    with pytest.raises(ValueError):
        V4Cache(engine_parts[0], 2, 100, 2)  # block size not a multiple of 128


def test_forward_context_positions_and_row_offsets():
    """Token t of sequence i sits at start_i + (t - cu_i): mixed prefill chunks and decode rows, built in one
    vectorised pass (checked against the per-sequence ranges)."""
    seqs = [SeqContext(0, 5, 0, 0), SeqContext(300, 1, 1, 1), SeqContext(17, 3, 2, 2), SeqContext(9, 1, 3, 3)]
    ctx = ForwardContext.build(seqs)
    assert ctx.positions.dtype == torch.int64
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 300, 17, 18, 19, 9]
    assert ctx.cu_tokens == (0, 5, 6, 9, 10) and all(type(c) is int for c in ctx.cu_tokens)
    assert ctx.rows(2) == slice(6, 9) and ctx.num_tokens == 10


def test_kernel_registry():
    from deepinfer import kernels

    assert "sparse_attn_sink" in kernels.ops()
    assert kernels.get("rms_norm", device="cuda") is kernels.get("rms_norm")  # torch twin is the fallback
    with pytest.raises(KeyError):
        kernels.get("no_such_op")
