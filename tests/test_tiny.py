"""The synthetic checkpoint: official on-disk format, every V4 feature on, deterministic, decisive."""
from __future__ import annotations

import hashlib
import json
import os

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


_WRITE_ONCE = r"""
import sys, time
from deepinfer import tiny
real = tiny.write_tiny
def counted(*a, **k):
    print("wrote", flush=True)
    time.sleep(0.5)  # widen the window in which a second process, without the lock, would also write
    return real(*a, **k)
tiny.write_tiny = counted
while time.time() < float(sys.argv[1]):  # both processes start generating at the same moment
    time.sleep(0.001)
path = tiny.default_model_dir("v4", seed=0)
assert (path / "deepinfer_tiny.json").exists()
print("ok", flush=True)
"""


def test_default_model_dir_is_written_once_by_concurrent_processes(tmp_path):
    """Parallel test workers (or two servers started together) ask for the embedded model at once: one
    writes it, the other waits and reuses it, and neither sees a directory being replaced."""
    import subprocess
    import sys
    import time

    env = dict(os.environ, DEEPINFER_CACHE_DIR=str(tmp_path))
    start = str(time.time() + 3.0)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITE_ONCE, start], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split().count("ok") == 1
    assert sum(out.split().count("wrote") for out, _ in outs) == 1
