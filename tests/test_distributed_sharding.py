"""Per-rank checkpoint slicing (no processes): FP8 block scales sliced with their weights, the grouped
output projection split exactly even past the o_groups cap, experts and engram rows owned once."""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.config import ModelConfig
from deepinfer.distributed import ParallelConfig, shard_checkpoint
from deepinfer.model.params import prepare_params
from deepinfer.weights import load_tensors


@pytest.fixture(scope="module")
def v4(tiny_v4_dir):
    cfg = ModelConfig.from_checkpoint(tiny_v4_dir)
    raw = load_tensors(tiny_v4_dir, cfg, progress=False)
    return cfg, raw


def _ranks(cfg, raw, tp, ep=1):
    return [shard_checkpoint(raw, cfg, ParallelConfig(tp, ep, 1, r)) for r in range(tp)]


def test_fp8_scales_follow_their_rows(v4):
    cfg, raw = v4
    name = "layers.2.attn.wq_b"
    full = formats.dequant_fp8_blocks(raw[name + ".weight"], raw[name + ".scale"], cfg.weight_block)
    parts = [formats.dequant_fp8_blocks(s[name + ".weight"], s[name + ".scale"], cfg.weight_block)
             for s in _ranks(cfg, raw, 2)]
    assert torch.equal(torch.cat(parts), full)


@pytest.mark.parametrize("tp", [2, 4])  # 4 > o_groups = 2: each group's input columns split over 2 ranks
def test_grouped_output_partials_sum_to_the_full_projection(v4, tp):
    cfg, raw = v4
    full = prepare_params(raw, cfg)
    H, hd, R = cfg.n_heads, cfg.head_dim, cfg.o_lora_rank
    o = torch.randn(5, H, hd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def project(p, o_local):
        G = p["layers.1.attn.wo_a.weight"].shape[0] // R
        wo_a = p["layers.1.attn.wo_a.weight"].to(torch.float64).view(G, R, -1)
        z = torch.einsum("tgd,grd->tgr", o_local.reshape(5, G, -1), wo_a)
        return z.flatten(1) @ p["layers.1.attn.wo_b.weight"].T

    want = project(full, o)
    got = sum(project(prepare_params(s, cfg), o[:, r * H // tp : (r + 1) * H // tp])
              for r, s in enumerate(_ranks(cfg, raw, tp)))
    assert float((got - want).norm() / want.norm()) < 1e-13


def test_every_routed_expert_lives_on_exactly_one_rank(v4):
    cfg, raw = v4
    shards = _ranks(cfg, raw, 2, ep=2)
    for e in range(cfg.n_routed_experts):
        name = f"layers.3.ffn.experts.{e}.w1.weight"
        holders = [r for r, s in enumerate(shards) if name in s]
        assert holders == [e // (cfg.n_routed_experts // 2)]
        assert torch.equal(shards[holders[0]][name].view(torch.uint8), raw[name].view(torch.uint8))


def test_engram_rows_cover_the_table_once(tiny_v41_dir):
    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    layer = cfg.engram_layer_ids[0]
    names = [f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"]
    raw = load_tensors(tiny_v41_dir, cfg, names=names, progress=False, check=False)
    for tp in (2, 4):  # 4062 rows over 4 ranks: 1016, 1016, 1016, 1014
        parts = [shard_checkpoint(raw, cfg, ParallelConfig(tp, 1, 1, r)) for r in range(tp)]
        for n in names:
            glued = torch.cat([p[n].view(torch.uint8) for p in parts])
            assert torch.equal(glued, raw[n].view(torch.uint8))


def test_misaligned_split_names_the_tensor(v4):
    cfg, raw = v4
    bad = {"layers.0.attn.wq_b.weight": raw["layers.0.attn.wq_b.weight"][:, :],
           "layers.0.attn.wq_b.scale": raw["layers.0.attn.wq_b.scale"][:1]}  # one 128-row block for 1024 rows
    with pytest.raises(ValueError, match="layers.0.attn.wq_b.scale"):
        shard_checkpoint(bad, cfg, ParallelConfig(2, 1, 1, 1))
