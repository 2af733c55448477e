"""Build the V4 engine model from in-memory checkpoint tensors, in any numerics, on any device.

Owns: the one recipe (params for the numerics -> a `V4Cache` of the same numerics, revision and device ->
`V4EngineModel`) shared by the engine's ModelRunner and by benchmarks that make checkpoint-format tensors
in memory (`tiny.make_tensors(cfg, device=...)` with real dimensions and a truncated `n_layers`) without
writing files:

    raw = make_tensors(cfg, seed=0, device="cuda")       # checkpoint names, dtypes and layouts
    model = build_v4_model(cfg, raw, "fast", "cuda", num_blocks=64, max_num_seqs=32)
    with forward_context(ctx):  logits = model(token_ids)  # or model.forward(token_ids, ctx)

Must not: read files (the caller loads or makes the tensors), or import the reference oracle.
"""
from __future__ import annotations

from typing import Mapping

import torch

from deepinfer.config import ModelConfig
from deepinfer.model.cache import V4Cache
from deepinfer.model.params import prepare_params
from deepinfer.model.params_fast import prepare_params_fast
from deepinfer.model.v4 import SUPPORTED_NUMERICS, V4EngineModel


def value_dtype(numerics: str) -> torch.dtype:
    """The dtype of exact-valued tensors: logits and plain caches (float64 exact, else fp32)."""
    return torch.float64 if numerics == "exact" else torch.float32


def v4_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, numerics: str,
              device: torch.device | str = "cpu") -> dict:
    """Params for `numerics` on `device`: fast keeps the weights quantised (params_fast); exact and official
    dequantise on the host (their reference forms), then move."""
    if numerics not in SUPPORTED_NUMERICS:
        raise ValueError(f"numerics must be one of {SUPPORTED_NUMERICS}, got {numerics!r}")
    if numerics == "fast":
        return prepare_params_fast(raw, cfg, device)
    params = prepare_params(raw, cfg, value_dtype(numerics), numerics=numerics)
    return {name: t.to(device) for name, t in params.items()}


def v4_cache(cfg: ModelConfig, numerics: str, num_blocks: int, block_size: int = 128, max_num_seqs: int = 8,
             device: torch.device | str = "cpu", revision: str = "current") -> V4Cache:
    return V4Cache(cfg, num_blocks, block_size, max_num_seqs, value_dtype(numerics), numerics, revision, device)


def build_v4_model(cfg: ModelConfig, raw: Mapping[str, torch.Tensor], numerics: str = "fast",
                   device: torch.device | str = "cuda", num_blocks: int = 16, block_size: int = 128,
                   max_num_seqs: int = 8, revision: str = "current") -> V4EngineModel:
    """A ready V4EngineModel over a fresh paged cache of `num_blocks` blocks (block_size token positions each)
    and `max_num_seqs` window/compressor-state slots."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # params and cache must compare equal
    params = v4_params(raw, cfg, numerics, device)
    cache = v4_cache(cfg, numerics, num_blocks, block_size, max_num_seqs, device, revision)
    return V4EngineModel(cfg, params, cache, numerics, revision)
