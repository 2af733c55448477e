"""The synthetic checkpoint: official on-disk format, every V4 feature on, deterministic, decisive."""
from __future__ import annotations

import hashlib
import json

import torch

from deepinfer.config import ModelConfig
from deepinfer.weights import CheckpointReader, check_checkpoint
from deepinfer.weights.schema import expected_tensors


def test_tiny_has_every_feature(tiny_v4_dir):
    cfg = ModelConfig.from_checkpoint(tiny_v4_dir)
    ratios = cfg.compress_ratios[: cfg.n_layers]
    assert {0, 4, 128} <= set(ratios)  # window-only, overlapping+indexer, ratio-128 layers
    assert cfg.n_hash_layers >= 1 and any(not cfg.is_hash_layer(i) for i in range(cfg.n_layers))
    assert cfg.n_shared_experts == 1 and cfg.n_mtp_layers == 1 and cfg.fp4_experts
    assert cfg.vocab_size == 129280 and cfg.window_size == 16


def test_tiny_is_in_official_format(tiny_v4_dir):
    cfg = ModelConfig.from_checkpoint(tiny_v4_dir)
    report = check_checkpoint(CheckpointReader(tiny_v4_dir), cfg)
    assert report.ok, report.summary()
    index = json.loads((tiny_v4_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_tensors(cfg))
    for f in ("config.json", "inference/config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_v4_dir / f).exists(), f
    reader = CheckpointReader(tiny_v4_dir)
    assert reader.shape_dtype("layers.2.ffn.experts.0.w1.weight")[1] == torch.int8  # packed FP4, as HF ships it
    assert reader.shape_dtype("layers.2.ffn.experts.0.w1.scale")[1] == torch.float8_e8m0fnu
    assert reader.shape_dtype("layers.2.attn.wq_a.weight")[1] == torch.float8_e4m3fn
    assert reader.shape_dtype("layers.0.ffn.gate.tid2eid")[1] == torch.int64
    hf = json.loads((tiny_v4_dir / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == [128, 128] and "hidden_size" in hf


def _digest(path):
    h = hashlib.sha256()
    for f in sorted(path.rglob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def test_make_tiny_is_deterministic(tmp_path, monkeypatch):
    from deepinfer import tiny

    small = tiny.tiny_config()
    small = ModelConfig.from_dict({**small.to_inference_json(), "vocab_size": 512})  # fast: small vocab
    monkeypatch.setattr(tiny, "tiny_config", lambda family="v4": small)
    a = tiny.write_tiny(tmp_path / "a", seed=3)
    b = tiny.write_tiny(tmp_path / "b", seed=3)
    c = tiny.write_tiny(tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b) != _digest(c)


def test_tiny_is_decisive_and_layers_matter(oracle_factory):
    """Most greedy margins above 1 logit, yet the layers change the choice (not a bigram table)."""
    m = oracle_factory("official", max_batch=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 129280, (1, 64), generator=g)
    logits = m.forward(ids, 0, all_logits=True)[0]
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert float((margins > 1).float().mean()) >= 0.6
    x = m.embed(ids).unsqueeze(2).repeat(1, 1, m.cfg.hc_mult, 1)
    embed_only = m.logits_from_hidden(x, all_logits=True)[0]
    assert float((embed_only.argmax(-1) == logits.argmax(-1)).float().mean()) < 0.5
