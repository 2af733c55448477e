"""model/v41_extend_graphs.py: V4.1's extend steps through the pieces (token-count-only ops graphed per bucket,
the attention's cache work eager between them), on the tiny V4.1 checkpoint (ratio-2 and ratio-1 kv sources,
their consumers, the candidate filter, two Engram layers).

CPU (the twins, the pieces run eagerly): steps of several prompts, then chunks, extends and a decode beside
them, filling their buckets exactly, give the logits and every cache tensor of `V41EngineModel.forward` on a
twin model bit for bit; padded to buckets, two random draws of the padding rows change no real row; the
fallbacks and refusals. GPU (-m gpu): replayed graphs are bit-identical to the same pieces run eagerly, and
within the fast path's noise of `forward`; a bound model replays after the captured one is dropped.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import ForwardContext, SeqContext
from deepinfer.model.v41 import build_v41_model, v41_params
from deepinfer.model.v41_extend_graphs import V41ExtendGraphs
from test_extend_graphs import RandomPadding  # (tests/ is on sys.path under pytest)

BPS = 2  # blocks of 128 positions per sequence
STEPS = [[(0, 0, 37), (1, 0, 7), (2, 0, 20)], [(3, 0, 64)], [(0, 37, 90), (2, 20, 38)],
         [(1, 7, 1), (3, 64, 30), (0, 127, 33)]]
EXACT = (64, 128)  # buckets each step's token count fills exactly (no padding rows)
PADDED = (16, 100, 160)  # every step padded: 64 -> 100, 128 -> 160


class V41RandomPadding(RandomPadding, V41ExtendGraphs):
    """V4.1's pieces with test_extend_graphs' random padding rows (tokens, positions, o buffer)."""


def _table(i: int) -> tuple[int, ...]:
    return tuple(range(BPS * i, BPS * (i + 1)))


@pytest.fixture(scope="module")
def parts(tiny_v41_dir):
    from deepinfer.config import ModelConfig
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    return cfg, load_tensors(tiny_v41_dir, cfg, progress=False), Tokenizer.from_checkpoint(tiny_v41_dir)


def _model(parts, params, device="cpu"):
    cfg, raw, tok = parts
    return build_v41_model(cfg, raw, tok, "fast", device, num_blocks=BPS * 4, max_num_seqs=4, params=params)


def _caches(model) -> list[torch.Tensor]:
    return [t.cpu() for lc in model.cache.layers
            for t in (lc.ring, lc.comp, lc.index_keys, lc.state_kv, lc.state_score) if t is not None]


def _run(parts, device, graphs: bool | None, buckets, cls=V41ExtendGraphs, **kw):
    """STEPS through a V41ExtendGraphs (its `graphs` argument) and through forward on a twin model ->
    (runner, [runner's model, twin], [(runner's logits, forward's)])."""
    cfg = parts[0]
    params = v41_params(parts[1], cfg, "fast", torch.device(device))
    g = torch.Generator().manual_seed(3)
    models = [_model(parts, params, device) for _ in range(2)]
    runner = cls(models[0], max_tokens=max(buckets), cuda_graphs=graphs is not False, buckets=buckets, **kw)
    out = []
    for step in STEPS:
        ctx = ForwardContext(tuple(SeqContext(start, n, i, i, _table(i)) for i, start, n in step))
        ids = torch.randint(2, cfg.vocab_size, (ctx.num_tokens,), generator=g)
        got = runner(ids, ctx, graphs=graphs)
        out.append((got.clone(), models[1](ids, ctx)))
    return runner, models, out


def test_v41_pieces_without_padding_are_forward_bit_for_bit(parts):
    runner, models, out = _run(parts, "cpu", None, EXACT)
    assert runner.eager == len(STEPS) and runner.replayed == 0 and not runner.graphs_on
    assert runner._emb, "the tiny V4.1 checkpoint has Engram layers: their buffers must exist"
    for got, ref in out:
        assert torch.equal(got, ref)
    for a, b in zip(_caches(models[0]), _caches(models[1])):
        assert torch.equal(a, b)


def test_v41_padding_rows_change_no_real_row(parts):
    runs = [_run(parts, "cpu", None, PADDED, V41RandomPadding, seed=seed) for seed in (1, 2)]
    for (got, _), (other, _) in zip(runs[0][2], runs[1][2]):
        assert torch.equal(got, other)
    for a, b in zip(_caches(runs[0][1][0]), _caches(runs[1][1][0])):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0][0]._ids, runs[1][0]._ids)  # the draws did differ


def test_v41_fallbacks_and_refusals(parts, fast_params):
    cfg = parts[0]
    params = v41_params(parts[1], cfg, "fast", torch.device("cpu"))
    runner = V41ExtendGraphs(_model(parts, params), max_tokens=100, buckets=(16, 64))
    assert runner.buckets == (16, 64, 100)
    ctx = ForwardContext((SeqContext(0, 101, 0, 0, _table(0)),))
    ids = torch.randint(2, cfg.vocab_size, (101,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(runner(ids, ctx), _model(parts, params)(ids, ctx))  # past max_tokens: forward itself
    assert runner.eager == 0
    from test_engine_fast_decode import fresh_model

    with pytest.raises(ValueError, match="V4.1 model"):
        V41ExtendGraphs(fresh_model(*fast_params), max_tokens=64)
    exact = build_v41_model(cfg, parts[1], parts[2], "exact", "cpu", num_blocks=BPS, max_num_seqs=1)
    with pytest.raises(ValueError, match="fast numerics only"):
        V41ExtendGraphs(exact, max_tokens=64)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
def test_v41_replay_is_bit_identical_to_the_eager_pieces(parts, cuda_kernels, padded):
    """Replayed graphs == the same pieces run eagerly (logits and cache tensors); against forward at the
    unpadded shapes the kernels' plans may differ (the same math in another order): within the noise."""
    buckets = PADDED if padded else EXACT
    (graphs, g_models, g_out), (eager, e_models, e_out) = (_run(parts, "cuda", mode, buckets) for mode in (None, False))
    assert graphs.replayed == len(STEPS) and eager.eager == len(STEPS)
    for (got, ref), (e_got, _) in zip(g_out, e_out):
        assert torch.equal(got, e_got)
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 5e-2, rel
    for a, b in zip(_caches(g_models[0]), _caches(e_models[0])):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_v41_bound_model_replays_after_the_captured_one_is_dropped(parts, cuda_kernels):
    import gc

    cfg = parts[0]
    params = v41_params(parts[1], cfg, "fast", torch.device("cuda"))
    runner = V41ExtendGraphs(_model(parts, params, "cuda"), max_tokens=128, buckets=EXACT)
    serving = _model(parts, params, "cuda")
    runner.bind(serving)
    gc.collect()
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (16, 32, 64, 128, 256, 1024) * 300]
    twin = _model(parts, params, "cuda")
    g = torch.Generator().manual_seed(5)
    for step in STEPS:
        ctx = ForwardContext(tuple(SeqContext(start, n, i, i, _table(i)) for i, start, n in step))
        ids = torch.randint(2, cfg.vocab_size, (ctx.num_tokens,), generator=g)
        assert torch.equal(runner(ids, ctx), twin(ids, ctx))
    assert runner.replayed == len(STEPS)
    del junk
