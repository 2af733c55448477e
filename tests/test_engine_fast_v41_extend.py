"""V4.1's batched extend path (model/v41_extend.py: the window ring read and written for every sequence at once,
the compressor over the batch, one decode per cache, one top-k per index source) against the per-sequence path
it replaces (`V41Attention._forward_official` with fast=True, `batched_extend = False`): only the organisation
of the ops differs, so on the CPU twins every logit and every cache byte must be bit-identical. Scenarios:
fresh prefills (one shorter than the window), a long extend beside decodes, extends starting inside the first
window (V4.1 lists those windows oldest slot first: -1 columns first), extends ending inside a ratio-2 group,
a fresh one-token prompt (no ratio-2 entry yet) beside long sequences, several sequences at different positions
in one step, one sequence alone. `-m gpu`: the same on cuda with the Triton kernels registered.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import ForwardContext, SeqContext
from deepinfer.model.v41 import build_v41_model
from deepinfer.model.v41_attention import V41Attention
from test_engine_fast_prefill import assert_identical, run_schedule  # (tests/ is on sys.path under pytest)

BLOCKS = 3  # blocks of 128 positions per sequence


@pytest.fixture(scope="module")
def parts(tiny_v41_dir):
    from deepinfer.config import ModelConfig
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    return cfg, load_tensors(tiny_v41_dir, cfg, progress=False), Tokenizer.from_checkpoint(tiny_v41_dir)


def _schedule():
    """Steps of (seq index, start_pos, num_new)."""
    return [
        [(0, 0, 37), (1, 0, 150), (2, 0, 7)],                # fresh prefills, one shorter than the window (16)
        [(0, 37, 100), (1, 150, 1), (2, 7, 4)],             # a long extend beside a decode; 2 extends at 7 < 15
        [(0, 137, 1), (1, 151, 60), (3, 0, 1)],             # a decode, an odd extend, a fresh one-token prompt
        [(0, 138, 1), (1, 211, 1), (2, 11, 200), (3, 1, 2)],  # decodes of long sequences + a long extend
        [(2, 211, 3)],                                      # one sequence alone
        [(0, 139, 3), (1, 212, 1), (2, 214, 1), (3, 3, 130)],
    ]


def _run(parts, batched: bool, monkeypatch, device: str = "cpu"):
    cfg, raw, tok = parts
    monkeypatch.setattr(V41Attention, "batched_extend", batched)
    model = build_v41_model(cfg, raw, tok, "fast", device, num_blocks=4 * BLOCKS, max_num_seqs=4)
    logits = run_schedule(model, _schedule(), cfg.vocab_size, 5, BLOCKS)
    caches = []
    for lc in model.cache.layers:
        caches += [t.cpu() for t in (lc.ring, lc.comp, lc.index_keys, lc.state_kv, lc.state_score) if t is not None]
    return logits, caches


def test_batched_v41_extend_is_bit_identical_to_the_per_sequence_path(parts, monkeypatch):
    assert_identical(_run(parts, True, monkeypatch), _run(parts, False, monkeypatch))


def test_v41_extend_rows_window_order():
    """V4.1's window columns: a prefill from 0 ascending then -1 (V4's), an extend at P > 0 the ring oldest
    slot first, positions q - window + 1 .. q with -1 for those before 0 listed FIRST."""
    from deepinfer.model.extend_metadata import build_extend_rows

    win = 16
    ctx = ForwardContext((SeqContext(5, 2, 1, 1, (0,)), SeqContext(0, 2, 0, 0, (1,))))
    v4 = build_extend_rows(ctx, win, 128, (2,), torch.device("cpu"))
    v41 = build_extend_rows(ctx, win, 128, (2,), torch.device("cpu"), ring_order=True)
    assert v41.window_width == (win, 2)
    # sequence 0 at P = 5: ring rows 0..4 hold positions 0..4, its new rows are pool rows 5, 6
    assert v41.window_idx[0].tolist() == [-1] * 10 + [0, 1, 2, 3, 4, 5]  # query at position 5
    assert v4.window_idx[0].tolist() == [0, 1, 2, 3, 4, 5] + [-1] * 10
    assert v41.window_idx[1].tolist() == [-1] * 9 + [0, 1, 2, 3, 4, 5, 6]
    assert torch.equal(v41.window_idx[2:], v4.window_idx[2:])  # the fresh prefill: the same columns


@pytest.mark.gpu
def test_batched_v41_extend_cuda_matches_the_per_sequence_path(parts, monkeypatch):
    """On cuda with the Triton kernels: the batched path equals the per-sequence one bit for bit (both call
    the same kernels on the same rows)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from deepinfer.engine.model_runner import start_cuda_kernels

    start_cuda_kernels()
    assert_identical(_run(parts, True, monkeypatch, "cuda"), _run(parts, False, monkeypatch, "cuda"))


def test_reused_slots_start_clean(parts):
    """Fresh prompts in slots that served other sequences (rings, ratio-2 states, engram histories dirty):
    `reset_fresh` clears every per-slot tensor and the n-gram history of all of them at once, and touches no
    other slot; the step then gives the logits of the same step on a fresh model."""
    from deepinfer.model.engram import DEAD

    cfg, raw, tok = parts
    g = torch.Generator().manual_seed(9)

    def ctx_of(seqs):
        return ForwardContext(tuple(SeqContext(p, n, i, i, tuple(range(i * BLOCKS, (i + 1) * BLOCKS)))
                                    for i, p, n in seqs), all_logits=True)

    def step(model, seqs):
        ids = torch.randint(2, cfg.vocab_size, (sum(n for _, _, n in seqs),), generator=g)
        return model(ids, ctx_of(seqs))

    used = build_v41_model(cfg, raw, tok, "fast", "cpu", num_blocks=4 * BLOCKS, max_num_seqs=4)
    step(used, [(0, 0, 40), (1, 0, 45), (2, 0, 33)])
    step(used, [(0, 40, 1), (1, 45, 1), (2, 33, 1)])
    fresh = [(1, 0, 21), (2, 0, 3), (3, 0, 9)]
    cache, hist = used.cache, used.hasher.history

    def slot0() -> list[torch.Tensor]:  # every per-slot row of slot 0, which stays in use
        rows = [hist[0]]
        for lc in cache.layers:
            rows += [t[0] for t in (lc.ring, lc.state_kv, lc.state_score) if t is not None]
        return [t.clone() for t in rows]

    before = slot0()
    assert (hist[1:3] != DEAD).any() and any(lc.ring[1:3].any() for lc in cache.layers)  # dirty before
    cache.reset_fresh(ctx_of(fresh).seqs)
    assert (hist[1:4] == DEAD).all()
    for lc in cache.layers:
        assert not lc.ring[1:4].any()
        if lc.state_kv is not None:
            assert not lc.state_kv[1:4].any() and torch.isinf(lc.state_score[1:4]).all()
    assert all(torch.equal(x, y) for x, y in zip(before, slot0()))
    state = g.get_state()
    got = step(used, fresh)
    g.set_state(state)
    want = step(build_v41_model(cfg, raw, tok, "fast", "cpu", num_blocks=4 * BLOCKS, max_num_seqs=4), fresh)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_v41_extend_step_runs_without_a_stream_sync(parts):
    """A V4.1 extend step of host ids (two fresh prompts, then an extend beside a decode) queues its work
    without waiting for the stream: the step rows go in one pinned copy, the engram rows too."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from deepinfer.engine.model_runner import start_cuda_kernels

    start_cuda_kernels()
    cfg, raw, tok = parts
    model = build_v41_model(cfg, raw, tok, "fast", "cuda", num_blocks=4 * BLOCKS, max_num_seqs=4)
    g = torch.Generator().manual_seed(2)

    def step(seqs):
        ids = torch.randint(2, cfg.vocab_size, (sum(n for _, _, n in seqs),), generator=g)
        ctx = ForwardContext(tuple(SeqContext(p, n, i, i, tuple(range(i * BLOCKS, (i + 1) * BLOCKS)))
                                   for i, p, n in seqs))
        return model(ids, ctx)

    step([(0, 0, 40), (1, 0, 30)])  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the step raises
    try:
        step([(2, 0, 50), (3, 0, 20)])
        step([(0, 40, 9), (1, 30, 1)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
