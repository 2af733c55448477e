"""The V4.1 oracle on the tiny V4.1 checkpoint: exact prefill/decode equivalence and causality across
ratio-2 groups, the window wrap and the KV/index sharing groups; the index-key sharing quirk; the
candidate-block filter and other V4.1 pieces against hand-computed cases."""
from __future__ import annotations

import pytest
import torch

from deepinfer.reference import ops
from deepinfer.reference.numerics import Numerics
from deepinfer.reference.v41_attention import select_candidate_blocks, window_indices_v41

REL = 1e-9


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def ids_for(n, seed, batch=1):
    return torch.randint(0, 129280, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_decode_chain_matches_prefill(oracle41_factory):
    """Every decode step (ratio-2 group edges, window wrap at 16, candidate filter beyond 4 positions)
    equals the all-positions prefill in exact numerics."""
    n = 60
    ids = ids_for(n, 1, batch=2)
    full = oracle41_factory().forward(ids, 0, all_logits=True)
    m = oracle41_factory()
    m.forward(ids[:, :2], 0)
    worst = max(rel_err(m.forward(ids[:, p : p + 1], p), full[:, p]) for p in range(2, n))
    assert worst <= REL, worst


@pytest.mark.parametrize("split", [1, 2, 3, 16, 17, 33])
def test_prefill_then_decode_equals_longer_prefill(oracle41_factory, split):
    ids = ids_for(split + 1, split, batch=2)
    longer = oracle41_factory().forward(ids, 0)
    m = oracle41_factory()
    m.forward(ids[:, :split], 0)
    assert rel_err(m.forward(ids[:, split:], split), longer) <= REL


@pytest.mark.parametrize("change_at", [2, 11, 30])
def test_causality(oracle41_factory, change_at):
    ids = ids_for(40, change_at)
    base = oracle41_factory().forward(ids, 0, all_logits=True)[0]
    other_ids = ids.clone()
    other_ids[0, change_at] = (other_ids[0, change_at] + 999) % 129280
    other = oracle41_factory().forward(other_ids, 0, all_logits=True)[0]
    # float64 summation order may differ in the last bit (an expert sees a different set of rows)
    assert (base[:change_at] - other[:change_at]).abs().max() <= 1e-12 * base.abs().max()
    assert (base[change_at:] - other[change_at:]).abs().max() > 1e-3


def test_index_key_sharing_quirk(oracle41_factory):
    """quirks='official': on decode steps where a ratio-2 owner's group is incomplete, ratio-2 layers
    score against the keys the ratio-1 source published last. Prefill is unaffected; decode diverges
    once there are more compressed entries than index_topk (4) to choose from, i.e. from position 10."""
    n = 24
    ids = ids_for(n, 5)
    intended_full = oracle41_factory().forward(ids, 0, all_logits=True)[0]
    official_full = oracle41_factory(quirks="official").forward(ids, 0, all_logits=True)[0]
    assert torch.equal(intended_full, official_full)  # prefill is the same
    official, intended = oracle41_factory(quirks="official"), oracle41_factory()
    official.forward(ids[:, :3], 0)
    intended.forward(ids[:, :3], 0)
    diff = {}
    for p in range(3, n):
        a, b = official.forward(ids[:, p : p + 1], p)[0], intended.forward(ids[:, p : p + 1], p)[0]
        diff[p] = rel_err(a, b)
        assert rel_err(b, intended_full[p]) <= REL  # the intended oracle stays exact
    assert all(diff[p] <= REL for p in range(3, 10))
    assert diff[10] > 1e-3  # first even position with > 4 entries: wrong keys change the top-k


def test_official_numerics_track_exact(oracle41_factory):
    ids = ids_for(30, 2)
    exact = oracle41_factory().forward(ids, 0, all_logits=True)[0]
    official = oracle41_factory("official").forward(ids, 0, all_logits=True)[0]
    cos = torch.nn.functional.cosine_similarity(official.double(), exact, dim=-1)
    assert 0.98 < float(cos.median()) < 1 - 1e-7


def test_engram_and_main_hidden_are_used(oracle41_factory):
    m = oracle41_factory()
    seen = []
    m.tap = lambda name, x: seen.append(name)
    m.forward(ids_for(8, 3), 0)
    assert "layers.1.engram" in seen and "layers.4.engram" in seen
    assert m.main_hidden.shape == (1, 8, 3 * 256)  # inputs of the DSpark target layers 7, 8, 9


def test_window_indices_v41_decode():
    assert window_indices_v41(4, 1, 1, 1).tolist() == [[[-1, -1, 0, 1]]]  # ring filling: slots > P are -1
    assert window_indices_v41(4, 1, 1, 5).tolist() == [[[2, 3, 0, 1]]]  # full ring, oldest first


def test_candidate_blocks_hand_case():
    # 7 positions in blocks of 2: block maxima [5, 9, 1, -inf(pad)]; keep 2 blocks; the newest visible
    # position (index 4, block 2) is always kept, so blocks 2 and 1 (score 9) win over block 0 (score 5)
    scores = torch.tensor([[5.0, 0.0, 9.0, 1.0, 1.0, float("-inf"), float("-inf")]])
    keep = select_candidate_blocks(scores, torch.tensor([[5]]), top_blocks=2, block=2)
    assert keep.tolist() == [[False, False, True, True, True, True, False]]
    # unreachable blocks are never kept even when there is room
    keep = select_candidate_blocks(scores[:, :2], torch.tensor([[1]]), top_blocks=4, block=2)
    assert keep.tolist() == [[True, True]]


def test_sparse_attn_empty_row_gives_zero_with_finite_init():
    num = Numerics("official", act_block=32)
    q = torch.randn(1, 1, 2, 8).bfloat16()
    kv = torch.randn(1, 3, 8).bfloat16()
    out = ops.sparse_attn(q, kv, torch.zeros(2), torch.full((1, 1, 4), -1), 1.0, num, finite_init=True)
    assert torch.equal(out, torch.zeros_like(out))


def test_vision_weights_are_skipped_with_a_note(tiny_v41_dir, tmp_path, caplog):
    import shutil

    from safetensors.torch import save_file

    from deepinfer.config import ModelConfig
    from deepinfer.weights import CheckpointReader, check_checkpoint, load_tensors

    ckpt = tmp_path / "with_vision"
    shutil.copytree(tiny_v41_dir, ckpt)
    save_file({"vision.norm.weight": torch.ones(8, dtype=torch.bfloat16)}, ckpt / "vision.safetensors")
    import json

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["vision.norm.weight"] = "vision.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = ModelConfig.from_checkpoint(ckpt)
    report = check_checkpoint(CheckpointReader(ckpt), cfg)
    assert report.ok and "vision.norm.weight" in report.ignored
    with caplog.at_level("WARNING"):
        loaded = load_tensors(ckpt, cfg, progress=False)
    assert "vision.norm.weight" not in loaded and "skipped 1 tensors" in caplog.text
