"""The compressors and the indexer selection of a multi-sequence extend step in one pass each
(`model/compress_batch.py`, `model/indexer_select.py`) against running them sequence by sequence, inside the
same fast-numerics model on the same batches (CPU torch twins): logits and every cache tensor bit-identical,
over steps that start fresh sequences, resume partial ratio-4 and ratio-128 blocks, complete several blocks
at once, and leave sequences with no completed block beside ones with many (the overlap pooling's
cross-sequence pairs must be dropped, the state rows must be read before any is written), with both of the
indexer's pool layouts (all entries; only the picked rows)."""
from __future__ import annotations

import pytest
import torch

import deepinfer.model.extend_attention as extend_attention
from deepinfer.model import ForwardContext, SeqContext, V4EngineModel
from deepinfer.model.factory import v4_cache, v4_params

BPS, SLOTS = 3, 5  # 384 positions per sequence


def table(i: int) -> tuple[int, ...]:
    return tuple(range(BPS * i, BPS * (i + 1)))


@pytest.fixture(scope="module")
def fast_params_cuda(tiny_v4_raw, cuda_kernels):
    cfg, raw = tiny_v4_raw
    return cfg, v4_params(raw, cfg, "fast", "cuda")


# each step: (slot, start position, new tokens); a sequence's start is its previous end (or 0: fresh)
STEPS = [
    [(0, 0, 5), (1, 0, 130), (2, 0, 64), (3, 0, 3)],
    [(0, 5, 1), (1, 130, 7), (2, 64, 70), (3, 3, 200)],  # partial blocks resumed, many blocks completed
    [(1, 137, 1), (2, 134, 2), (3, 203, 1), (4, 0, 9)],  # decode-like rows beside a fresh prompt
    [(0, 6, 250), (4, 9, 4)],
]


def run(cfg, params, batched: bool, monkeypatch, device="cpu"):
    monkeypatch.setattr(extend_attention, "BATCH_SEQUENCES", batched)
    model = V4EngineModel(cfg, params, v4_cache(cfg, "fast", BPS * SLOTS, 128, SLOTS, device), "fast")
    g = torch.Generator().manual_seed(4)
    outs = []
    for step in STEPS:
        ctx = ForwardContext(tuple(SeqContext(start, n, slot, slot, table(slot)) for slot, start, n in step))
        ids = torch.randint(2, cfg.vocab_size, (sum(n for _, _, n in step),), generator=g)
        outs.append(model(ids.to(device), ctx).cpu())
    return outs, model


def test_batched_compressors_are_the_per_sequence_ones_bit_for_bit(fast_params, monkeypatch):
    check(fast_params, monkeypatch, "cpu")


@pytest.mark.gpu
def test_batched_compressors_on_cuda_bit_for_bit(fast_params_cuda, monkeypatch):
    """The same on cuda: compress_pool, rms_norm, rope32 and hadamard32 are the Triton kernels (row-wise,
    so a batched call must give each row the per-sequence call's bits). Written 2026-12-05 without a
    device: not run yet."""
    check(fast_params_cuda, monkeypatch, "cuda")


def check(cfg_params, monkeypatch, device):
    cfg, params = cfg_params
    calls, modes = [], set()
    inner = extend_attention.compress_batch
    monkeypatch.setattr(extend_attention, "compress_batch", lambda *a, **k: calls.append(1) or inner(*a, **k))
    plan_of = extend_attention.build_select_plan

    def planned(*a, **k):
        plan = plan_of(*a, **k)
        modes.update(bool(v) for v in plan.all_rows[plan.kmax > 0].tolist())
        return plan

    monkeypatch.setattr(extend_attention, "build_select_plan", planned)
    got, got_model = run(cfg, params, True, monkeypatch, device)
    assert calls, "the batched compressors did not run"
    # the indexer's two pool layouts both ran: sequences putting all their entries in the pool (prefills)
    # and sequences putting only their picked rows there (few queries, more entries than picks)
    assert modes == {True, False}, modes
    ref, ref_model = run(cfg, params, False, monkeypatch, device)
    for k, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"step {k}: logits max diff {float((a - b).abs().max()):.3g}"
    for i, (lg, lr) in enumerate(zip(got_model.cache.layers, ref_model.cache.layers)):
        for name in ("ring", "comp", "index_keys"):
            if getattr(lr, name) is not None:
                assert torch.equal(getattr(lg, name), getattr(lr, name)), f"layer {i} {name}"
        for name in ("comp_state", "index_state"):
            sg, sr = getattr(lg, name), getattr(lr, name)
            if sr is not None:
                assert torch.equal(sg.kv, sr.kv) and torch.equal(sg.score, sr.score), f"layer {i} {name}"


_BATCHED_ROWS_UNDER_INTERPRETER = """
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import torch
from deepinfer.kernels.triton import compress_pool as cp, hadamard, norm_hc, rope

launched = {}
for mod, name in ((cp, "_compress_pool_kernel"), (norm_hc, "_rms_norm_kernel"), (rope, "_rope_kernel"),
                  (hadamard, "_hadamard_kernel")):
    kernel = getattr(mod, name)

    class Counted:
        def __init__(self, k, n):
            self.k, self.n = k, n

        def __getitem__(self, grid):
            launched[self.n] = launched.get(self.n, 0) + 1
            return self.k[grid]

    setattr(mod, name, Counted(kernel, name))

def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                                              b.view(torch.int32 if b.dtype == torch.float32 else torch.int16))

g = torch.Generator().manual_seed(0)
r, w = 4, 64
for overlap in (True, False):
    blocks = [3, 1, 4] if overlap else [2, 1, 3]  # per sequence: its blocks (with overlap: previous + completed)
    kv = [torch.randn(n, r, (2 if overlap else 1) * w, generator=g) for n in blocks]
    sc = [torch.randn(n, r, (2 if overlap else 1) * w, generator=g) for n in blocks]
    whole = cp.compress_pool(torch.cat(kv), torch.cat(sc), overlap)
    at = 0
    for k, s in zip(kv, sc):
        own = cp.compress_pool(k, s, overlap)
        assert same(whole[at : at + own.shape[0]], own), ("compress_pool", overlap)
        at += own.shape[0] + (1 if overlap else 0)  # the pair across a sequence boundary is dropped
rows = [torch.randn(n, 128, generator=g).float() for n in (3, 1, 5)]
wt = torch.randn(128, generator=g)
whole = norm_hc.rms_norm(torch.cat(rows), wt, 1e-6)
parts = [norm_hc.rms_norm(x, wt, 1e-6) for x in rows]
assert same(whole, torch.cat(parts)), "rms_norm"
xs = [torch.randn(n, 128, generator=g).bfloat16() for n in (3, 1, 5)]
pos = [torch.tensor([4, 8, 12]), torch.tensor([0]), torch.tensor([128, 132, 136, 140, 144])]
freqs = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
whole = rope.rope32(torch.cat(xs), torch.cat(pos), freqs)
assert same(whole, torch.cat([rope.rope32(x, p, freqs) for x, p in zip(xs, pos)])), "rope32"
whole = hadamard.hadamard32(torch.cat(xs))
assert same(whole, torch.cat([hadamard.hadamard32(x) for x in xs])), "hadamard32"
assert set(launched) == {"_compress_pool_kernel", "_rms_norm_kernel", "_rope_kernel", "_hadamard_kernel"}, launched
print("ok")
"""


def test_triton_kernels_give_batched_rows_the_per_sequence_bits_under_the_interpreter():
    """The kernels the batched compressors call on cuda (compress_pool, rms_norm, rope32, hadamard32), run by
    Triton's interpreter on the CPU: a call over several sequences' rows gives each its per-sequence call's
    bits (compress_pool: once the pair across each boundary is dropped). The kernels' own code, not the
    twins'; the GPU run of the whole path is the -m gpu test above."""
    pytest.importorskip("triton")
    from interpreted import assert_ran_ok, run_interpreted

    res = run_interpreted(_BATCHED_ROWS_UNDER_INTERPRETER, timeout=600)
    assert_ran_ok(res)
