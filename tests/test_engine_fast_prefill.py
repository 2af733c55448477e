"""The fast-numerics extend path (model/extend_attention.py + extend_metadata.py: batched window ring
gather/scatter, batched entry gathers, registry KV codec, one host-to-device copy per step) against the
per-sequence path it replaces (`V4Attention._forward_official` with fast=True, `batched_extend = False`):
only the organisation of the ops differs, so on the CPU twins every logit and every cache byte must be
bit-identical. Scenarios: chunked prefills, long extends, a fresh short prefill (narrow window columns)
batched with decodes of long sequences (whose indexer layers decode only the selected entries), and
several sequences extending at different positions in one step. `-m gpu`: the same on cuda with the
Triton kernels registered (the batched path there is also checked to run without a stream sync).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import ForwardContext, SeqContext
from deepinfer.model.attention import V4Attention
from deepinfer.model.factory import build_v4_model

BLOCKS = 4  # blocks of 128 positions per sequence


def _schedule():
    """Steps of (seq index, start_pos, num_new): chunked prefills, long extends, mixed prefill + decode."""
    return [
        [(0, 0, 37), (1, 0, 150), (2, 0, 7)],          # fresh prefills, one shorter than the window
        [(0, 37, 100), (1, 150, 1), (2, 7, 1)],       # a long extend next to decodes
        [(0, 137, 1), (1, 151, 60), (3, 0, 5)],       # decode, extend across a ratio-128 entry, fresh short
        [(0, 138, 1), (1, 211, 1), (2, 8, 200), (3, 5, 1)],  # decodes of long sequences + a long extend
        [(0, 139, 3), (1, 212, 1), (2, 208, 1), (3, 6, 130)],
    ]


def run_schedule(model, schedule, vocab: int, seed: int, blocks: int = BLOCKS) -> list[torch.Tensor]:
    """Every step's logits (all rows, on the host) of `schedule` (steps of (seq index, start_pos, num_new);
    sequence i in slots i and blocks i * blocks ..) with random ids from `seed`. Shared with V4.1's test."""
    g = torch.Generator().manual_seed(seed)
    logits = []
    for step in schedule:
        seqs = tuple(SeqContext(p, n, i, i, tuple(range(i * blocks, (i + 1) * blocks))) for i, p, n in step)
        ids = torch.randint(2, vocab, (sum(n for _, _, n in step),), generator=g)
        logits.append(model(ids, ForwardContext(seqs, all_logits=True)).cpu())
    return logits


def _run(cfg, raw, batched: bool, monkeypatch, device: str = "cpu"):
    monkeypatch.setattr(V4Attention, "batched_extend", batched)
    model = build_v4_model(cfg, raw, "fast", device, num_blocks=4 * BLOCKS, max_num_seqs=4)
    logits = run_schedule(model, _schedule(), cfg.vocab_size, 3)
    caches = []
    for lc in model.cache.layers:
        caches.append(lc.ring.cpu())
        for t in (lc.comp, lc.index_keys):
            if t is not None:
                caches.append(t.cpu())
        for st in (lc.comp_state, lc.index_state):
            if st is not None:
                caches += [st.kv.cpu(), st.score.cpu()]
    return logits, caches


def assert_identical(a, b) -> None:
    """(logits, cache tensors) of two runs: equal bit for bit."""
    (la, ca), (lb, cb) = a, b
    for step, (x, y) in enumerate(zip(la, lb)):
        assert torch.equal(x, y), f"step {step}: logits differ, max {float((x - y).abs().max()):.3g}"
    for i, (x, y) in enumerate(zip(ca, cb)):
        assert torch.equal(x, y), f"cache tensor {i} differs"


def test_batched_extend_is_bit_identical_to_the_per_sequence_path(tiny_v4_raw, monkeypatch):
    cfg, raw = tiny_v4_raw
    assert_identical(_run(cfg, raw, True, monkeypatch), _run(cfg, raw, False, monkeypatch))


def test_extend_rows_window_layout(tiny_v4_raw):
    """The window index rows point at the ring rows of positions < start_pos and at the new rows after them,
    ascending, -1 past each query (and past min(S, window) columns for a fresh prefill)."""
    from deepinfer.model.extend_metadata import build_extend_rows

    cfg, _ = tiny_v4_raw
    win = cfg.window_size
    ctx = ForwardContext((SeqContext(20, 3, 1, 1, (0,)), SeqContext(0, 2, 0, 0, (1,))))
    rows = build_extend_rows(ctx, win, 128, (4,), torch.device("cpu"))
    n_ring = 20 - (20 - win + 1)  # positions 5..19 of sequence 0
    assert rows.ring_read.tolist() == [1 * win + p % win for p in range(20 - win + 1, 20)]
    assert rows.window_width == (win, 2)
    first = rows.window_idx[0].tolist()  # query at position 20 sees 5..20: ring rows 0..14, new row 0
    assert first == list(range(n_ring)) + [n_ring]
    assert rows.window_idx[3].tolist()[:2] == [n_ring + 3, -1]  # fresh sequence's first token: itself only
    assert rows.window_idx[4].tolist()[:3] == [n_ring + 3, n_ring + 4, -1]
    assert rows.ratios[4].n_ent == (5, 0) and rows.ratios[4].visible.tolist() == [5, 5, 5, 0, 0]


@pytest.mark.gpu
def test_batched_extend_cuda_matches_the_per_sequence_path(tiny_v4_raw, monkeypatch):
    """On cuda with the Triton kernels: the batched path equals the per-sequence one bit for bit (both call
    the same kernels on the same rows), and a step's layers run without a stream sync."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from deepinfer.engine.model_runner import start_cuda_kernels

    start_cuda_kernels()
    cfg, raw = tiny_v4_raw
    assert_identical(_run(cfg, raw, True, monkeypatch, "cuda"), _run(cfg, raw, False, monkeypatch, "cuda"))
    monkeypatch.setattr(V4Attention, "batched_extend", True)
    model = build_v4_model(cfg, raw, "fast", "cuda", num_blocks=BLOCKS, max_num_seqs=1)
    ctx = ForwardContext((SeqContext(0, 300, 0, 0, tuple(range(BLOCKS))),))
    ids = torch.randint(2, cfg.vocab_size, (300,))
    model(ids, ctx)  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the step raises
    try:
        model(ids, ForwardContext((SeqContext(0, 300, 0, 0, tuple(range(BLOCKS))),)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
