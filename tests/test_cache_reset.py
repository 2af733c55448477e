"""`reset_fresh` of both families' caches (`cache.SlotResets`): the slots of a step's fresh sequences (start
position 0) reset together, one fill per cache tensor, must leave every cache tensor exactly as resetting them
one by one does, and touch no other slot (every numerics: plain values, and the packed bytes of official /
fast); the cache-wide `reset` is every layer's own reset (V4.1: and the engram history's)."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.model.context import SeqContext
from deepinfer.model.factory import v4_cache, value_dtype
from deepinfer.model.v41_cache import V41Cache


@pytest.fixture(params=["v4", "v41"])
def family_cfg(request, tiny_v4_raw, tiny_v41_dir):
    if request.param == "v4":
        return tiny_v4_raw[0]
    from deepinfer.config import ModelConfig

    return ModelConfig.from_checkpoint(tiny_v41_dir)


def _cache(cfg, numerics):
    if cfg.is_v41:
        return V41Cache(cfg, 4, 128, 8, value_dtype(numerics), numerics)
    return v4_cache(cfg, numerics, 4, max_num_seqs=8)


def _tensors(cache):
    out = {}
    for i, layer in enumerate(cache.layers):
        out[f"{i}.ring"] = layer.ring
        for name in ("comp_state", "index_state"):
            state = getattr(layer, name, None)
            if state is not None:
                out[f"{i}.{name}.kv"], out[f"{i}.{name}.score"] = state.kv, state.score
        if getattr(layer, "state_kv", None) is not None:  # V4.1's ratio-2 kv sources
            out[f"{i}.state.kv"], out[f"{i}.state.score"] = layer.state_kv, layer.state_score
    return out


def _scramble(cache, seed):
    g = torch.Generator().manual_seed(seed)
    for t in _tensors(cache).values():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
        else:
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype))


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
def test_reset_fresh_is_the_one_by_one_reset(family_cfg, numerics):
    cfg = family_cfg
    rng = random.Random(numerics)
    for trial in range(6):
        a, b = (_cache(cfg, numerics) for _ in range(2))
        _scramble(a, trial)
        _scramble(b, trial)
        slots = rng.sample(range(8), rng.randrange(1, 7))
        seqs = [SeqContext(0 if rng.random() < 0.6 else 5, 3, w, s)
                for w, s in zip(slots, rng.sample(range(8), len(slots)))]
        a.reset_fresh(seqs)
        for s in seqs:
            if s.start_pos == 0:
                b.reset(s.window_slot, s.state_slot)
        ta, tb = _tensors(a), _tensors(b)
        for name in ta:
            assert torch.equal(ta[name], tb[name]), f"trial {trial}: {name}"
        fresh = [s for s in seqs if s.start_pos == 0]
        if fresh:  # the reset did happen (a -inf score row, a zero ring row)
            s = fresh[0]
            assert not _tensors(a)["0.ring"][s.window_slot].any()


@pytest.mark.parametrize("numerics", ["exact", "official", "fast"])
def test_cache_reset_is_every_layer_reset(family_cfg, numerics):
    """The cache's `reset` (two multi-tensor ops over all layers) leaves every tensor as each layer's own
    `reset` does: the slot's ring row zero, kv rows zero, score rows -inf, other slots untouched."""
    cfg = family_cfg
    for window_slot, state_slot in ((0, 0), (3, 5), (7, 2)):
        a, b = (_cache(cfg, numerics) for _ in range(2))
        _scramble(a, window_slot * 8 + state_slot)
        _scramble(b, window_slot * 8 + state_slot)
        before = {k: v.clone() for k, v in _tensors(a).items()}
        a.reset(window_slot, state_slot)
        for layer in b.layers:
            layer.reset(window_slot, state_slot)
        ta, tb = _tensors(a), _tensors(b)
        for name in ta:
            assert torch.equal(ta[name], tb[name]), f"slots {window_slot}, {state_slot}: {name}"
        changed = [name for name in ta if not torch.equal(ta[name], before[name])]
        assert any(n.endswith(".score") for n in changed) and any(n.endswith(".ring") for n in changed)
        score = ta["2.comp_state.score"] if "2.comp_state.score" in ta else next(
            v for k, v in ta.items() if k.endswith(".score"))
        assert torch.isinf(score[state_slot]).all() and not torch.isinf(score[(state_slot + 1) % 8]).all()
