"""model/extend_graphs.py: extend steps through the pieces (token-count-only ops graphed per bucket, the
attention's cache work eager between them).

CPU (the twins, the pieces run eagerly): a sequence of extend steps (several prompts, then chunks and
extends of several sequences at once, padded to their buckets) gives the logits and the cache rows of
`V4EngineModel.forward` on a twin model; bucket choice; a batch past max_tokens or with a tap goes to
`forward`. GPU (-m gpu): the replayed graphs are bit-identical to the same pieces run eagerly, cache rows
included, and within the fast path's noise of `forward`.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import ForwardContext, SeqContext
from deepinfer.model.extend_graphs import ExtendGraphs
from test_engine_fast_decode import BPS, assert_caches_equal, fresh_model, table

# (sequence, start, new tokens) per step: four prompts, then chunks / extends of several sequences
STEPS = [[(0, 0, 37), (1, 0, 7), (2, 0, 20)], [(3, 0, 64)], [(0, 37, 90), (2, 20, 38)],
         [(1, 7, 1), (3, 64, 30), (0, 127, 33)]]
EXACT = (64, 128)  # buckets each step's token count fills exactly (no padding rows)
PADDED = (16, 100, 160)  # every step padded: 64 -> 100, 128 -> 160


class RandomPadding(ExtendGraphs):
    """Padding rows of random tokens at random positions, and random values in the o buffer's padding rows."""

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        self.g = torch.Generator().manual_seed(seed)
        super().__init__(*args, **kwargs)

    def _pad(self, T: int, Tb: int) -> None:
        n = Tb - T
        self._ids[T:Tb] = torch.randint(0, self.model.cfg.vocab_size, (n,), generator=self.g).to(self._ids.device)
        self._pos[T:Tb] = torch.randint(0, 4096, (n,), generator=self.g).to(self._pos.device)
        self._o[T:Tb] = torch.randn(self._o[T:Tb].shape, generator=self.g).to(self._o)


@pytest.fixture(scope="module")
def fast_params_cuda(tiny_v4_raw, cuda_kernels):
    from deepinfer.model.factory import v4_params

    cfg, raw = tiny_v4_raw
    return cfg, v4_params(raw, cfg, "fast", "cuda")


def _run(cfg, params, device, graphs: bool | None, buckets, cls=ExtendGraphs, steps=STEPS, **kw):
    """`steps` through an ExtendGraphs (its `graphs` argument) and through forward on a twin model ->
    (runner, [runner's model, twin], [(runner's logits, forward's)], the sequences' end positions)."""
    g = torch.Generator().manual_seed(3)
    models = [fresh_model(cfg, params, device) for _ in range(2)]
    runner = cls(models[0], max_tokens=max(buckets), cuda_graphs=graphs is not False, buckets=buckets, **kw)
    ends, out = {}, []
    for step in steps:
        ctx = ForwardContext(tuple(SeqContext(start, n, i, i, table(i)) for i, start, n in step))
        ids = torch.randint(2, cfg.vocab_size, (ctx.num_tokens,), generator=g)
        got = runner(ids.to(device), ctx, graphs=graphs)
        out.append((got.clone(), models[1](ids.to(device), ctx)))
        ends.update({i: start + n for i, start, n in step})
    return runner, models, out, ends


def test_pieces_without_padding_are_forward_bit_for_bit(fast_params):
    """Every step fills its bucket: the pieces and cores compute forward's ops on forward's shapes."""
    cfg, params = fast_params
    runner, models, out, ends = _run(cfg, params, "cpu", None, EXACT)
    assert runner.eager == len(STEPS) and runner.replayed == 0 and not runner.graphs_on
    for got, ref in out:
        assert torch.equal(got, ref)
    assert_caches_equal(models[0], models[1], ends)


def test_padding_rows_change_no_real_row(fast_params):
    """Padded to buckets, with the padding rows' tokens, positions and attention outputs at random: the real
    rows' logits and every cache row are bit-identical between two draws of the padding. (Against forward
    at the unpadded shapes the CPU twins' bf16 elementwise ops round a last bit by a row's place in the
    tensor, which V4 amplifies: the comparison is the GPU test's, within its noise.)"""
    cfg, params = fast_params
    runs = [_run(cfg, params, "cpu", None, PADDED, RandomPadding, seed=seed) for seed in (1, 2)]
    for (got, _), (other, _) in zip(runs[0][2], runs[1][2]):
        assert torch.equal(got, other)
    assert_caches_equal(runs[0][1][0], runs[1][1][0], runs[0][3])
    # and the draws did differ (the last step's padding rows are still in the buffers)
    assert not torch.equal(runs[0][0]._ids, runs[1][0]._ids) and not torch.equal(runs[0][0]._o, runs[1][0]._o)


def test_buckets_and_fallbacks(fast_params):
    cfg, params = fast_params
    model = fresh_model(cfg, params)
    runner = ExtendGraphs(model, max_tokens=100, buckets=(16, 64, 128, 256))
    assert runner.buckets == (16, 64, 100)
    assert [runner.bucket(t) for t in (1, 16, 17, 64, 65, 100, 101)] == [16, 16, 64, 64, 100, 100, None]
    ctx = ForwardContext((SeqContext(0, 101, 0, 0, table(0)),))
    assert not runner.fits(ctx)
    ids = torch.randint(2, cfg.vocab_size, (101,), generator=torch.Generator().manual_seed(0))
    twin = fresh_model(cfg, params)
    assert torch.equal(runner(ids, ctx), twin(ids, ctx))  # past max_tokens: forward itself
    assert runner.eager == 0
    model.tap = lambda *a: None
    assert not runner.fits(ForwardContext((SeqContext(0, 5, 1, 1, table(1)),)))


def test_extend_graph_tokens_setting(monkeypatch):
    from deepinfer import env

    for value, want in (("", None), ("0", 0), (" 512 ", 512)):
        if value:
            monkeypatch.setenv("DEEPINFER_EXTEND_GRAPH_TOKENS", value)
        else:
            monkeypatch.delenv("DEEPINFER_EXTEND_GRAPH_TOKENS", raising=False)
        assert env.extend_graph_tokens() == (2048 if want is None else want)
    for bad in ("-1", "many"):
        monkeypatch.setenv("DEEPINFER_EXTEND_GRAPH_TOKENS", bad)
        with pytest.raises(ValueError, match="DEEPINFER_EXTEND_GRAPH_TOKENS"):
            env.extend_graph_tokens()


def test_bad_setups_are_refused(fast_params, tiny_v4_raw):
    from deepinfer.model import V4EngineModel
    from deepinfer.model.factory import v4_cache, v4_params

    cfg, params = fast_params
    with pytest.raises(ValueError, match="max_tokens > 0"):
        ExtendGraphs(fresh_model(cfg, params), max_tokens=0)
    cfg, raw = tiny_v4_raw
    exact = V4EngineModel(cfg, v4_params(raw, cfg, "exact", "cpu"), v4_cache(cfg, "exact", BPS, 128, 1, "cpu"))
    with pytest.raises(ValueError, match="fast numerics only"):
        ExtendGraphs(exact, max_tokens=64)
    runner = ExtendGraphs(fresh_model(cfg, params), max_tokens=64)
    runner.bind(fresh_model(cfg, params))  # another model over the same params: fine
    with pytest.raises(ValueError, match="share the captured model.s params"):
        runner.bind(fresh_model(cfg, dict(params)))


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
def test_replay_is_bit_identical_to_the_eager_pieces(fast_params_cuda, padded):
    """Replayed graphs == the same pieces run eagerly (logits and cache rows); against forward at the
    unpadded shapes the kernels' plans may differ (the same math in another order): within the noise."""
    cfg, params = fast_params_cuda
    buckets = PADDED if padded else EXACT
    (graphs, g_models, g_out, ends), (eager, e_models, e_out, _) = (
        _run(cfg, params, "cuda", mode, buckets) for mode in (None, False))
    assert graphs.replayed == len(STEPS) and eager.eager == len(STEPS)
    for (got, ref), (e_got, _) in zip(g_out, e_out):
        assert torch.equal(got, e_got)
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 5e-2, rel
    assert_caches_equal(g_models[0], e_models[0], ends)


@pytest.mark.gpu
def test_padding_rows_change_no_real_row_on_gpu(fast_params_cuda):
    cfg, params = fast_params_cuda
    runs = [_run(cfg, params, "cuda", None, PADDED, RandomPadding, seed=seed) for seed in (1, 2)]
    for (got, _), (other, _) in zip(runs[0][2], runs[1][2]):
        assert torch.equal(got, other)
    assert_caches_equal(runs[0][1][0], runs[1][1][0], runs[0][3])


@pytest.mark.gpu
def test_bound_model_replays_after_the_captured_one_is_dropped(fast_params_cuda):
    """The engine captures on its KV-sizing model and binds the serving one: the graphs must not read
    anything the sizing model owned and freed (its layers' RoPE frequencies were, until kept alive)."""
    import gc

    cfg, params = fast_params_cuda
    runner = ExtendGraphs(fresh_model(cfg, params, "cuda"), max_tokens=128, buckets=EXACT)
    serving = fresh_model(cfg, params, "cuda")
    runner.bind(serving)
    gc.collect()  # (no empty_cache: the allocator keeps the freed blocks, and the junk below takes them)
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (16, 32, 64, 128, 256, 1024) * 300]
    twin = fresh_model(cfg, params, "cuda")
    g = torch.Generator().manual_seed(5)
    for step in STEPS:
        ctx = ForwardContext(tuple(SeqContext(start, n, i, i, table(i)) for i, start, n in step))
        ids = torch.randint(2, cfg.vocab_size, (ctx.num_tokens,), generator=g).cuda()
        assert torch.equal(runner(ids, ctx), twin(ids, ctx))
    assert runner.replayed == len(STEPS)
    del junk
