"""The oracle: an independent implementation of the official DeepSeek-V4 reference forward.

It mirrors the official `inference/model.py` (static batch, contiguous caches, prefill then one token per
decode call) and emulates its kernels (`numerics="official"`), or runs the same math exactly in float64
(`numerics="exact"`). It imports only `config`, `formats` and `weights`, never `kernels`, `model` or
`engine`, so it cannot share a bug with the code it checks.
"""
from __future__ import annotations

from pathlib import Path

from deepinfer.config import ModelConfig
from deepinfer.reference.numerics import NUMERICS, REVISIONS, Numerics
from deepinfer.reference.params import prepare_params
from deepinfer.reference.quirks import QUIRKS, check_mode
from deepinfer.reference.v4 import V4Model


def load_reference(
    model_dir: str | Path, numerics: str = "official", revision: str = "current", quirks: str = "intended",
    max_batch_size: int = 4, max_seq_len: int = 4096, progress: bool = True,
) -> V4Model:
    """Build the oracle from a checkpoint directory (HF shards or converted model{rank}-mp{n} files)."""
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(model_dir)
    check_mode(quirks)
    num = Numerics(numerics, revision, cfg.act_block)
    raw = load_tensors(model_dir, cfg, progress=progress)
    params = prepare_params(raw, cfg, num)
    del raw
    if cfg.is_v41:
        from deepinfer.reference.v41 import V41Model
        from deepinfer.tokenizer import Tokenizer

        return V41Model(cfg, params, num, max_batch_size, max_seq_len, quirks_official=quirks == "official",
                        tokenizer=Tokenizer.from_checkpoint(model_dir))
    return V4Model(cfg, params, num, max_batch_size, max_seq_len, keep_stale_state=quirks == "official")


__all__ = ["load_reference", "V4Model", "Numerics", "NUMERICS", "REVISIONS", "QUIRKS"]
