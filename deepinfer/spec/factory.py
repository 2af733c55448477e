"""Build the `SpecDecoder` an engine asks for: the drafter of `SpeculativeConfig.method` for the loaded
target (family and numerics), with its weights from the same checkpoint.

Must not: import the engine (it passes what is needed: checkpoint path, target model and params).
"""
from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.decoder import SpecDecoder
from deepinfer.spec.proposer import Proposer


def build_spec_decoder(spec: SpeculativeConfig, cfg: ModelConfig, checkpoint: str, target_model,
                       target_params: dict[str, torch.Tensor], numerics: str, max_num_seqs: int) -> SpecDecoder:
    if spec.method != "custom" and target_params["embed.weight"].device.type != "cpu":
        raise NotImplementedError(f"the {spec.method} drafter runs on CPU engines only (its weights and caches "
                                  f"are host tensors); the target is on {target_params['embed.weight'].device}")
    if spec.method == "custom":
        if not isinstance(spec.proposer, Proposer):
            raise ValueError(f"speculative proposer must be a spec.proposer.Proposer, "
                             f"got {type(spec.proposer).__name__}")
        proposer = spec.proposer
    elif spec.method == "mtp":
        proposer = _mtp(cfg, checkpoint, target_model, target_params, numerics, max_num_seqs)
    else:  # dspark
        from deepinfer.spec.dspark_proposer import build_dspark_proposer

        proposer = build_dspark_proposer(cfg, checkpoint, target_model, target_params, numerics, max_num_seqs)
    return SpecDecoder(proposer, spec.num_speculative_tokens, target_model.cache, cfg.vocab_size)


def _mtp(cfg: ModelConfig, checkpoint: str, target_model, target_params, numerics: str, max_num_seqs: int):
    from deepinfer.model.mtp import MTPCache, V4MTP, prepare_mtp_params
    from deepinfer.spec.mtp_proposer import MTPProposer
    from deepinfer.weights import load_tensors

    if cfg.is_v41:
        raise ValueError("speculative method 'mtp' is for family v4; V4.1 checkpoints draft with 'dspark'")
    if cfg.n_mtp_layers < 1:
        raise ValueError("speculative method 'mtp': the checkpoint has no MTP layer (n_mtp_layers = 0)")
    if numerics not in ("exact", "official"):
        raise ValueError(f"speculative method 'mtp' runs in exact or official numerics, not {numerics!r}")
    dtype = torch.float64 if numerics == "exact" else torch.float32
    raw = load_tensors(checkpoint, cfg, progress=False)
    params = prepare_mtp_params(raw, cfg, dtype, numerics)
    revision = getattr(target_model.cache, "revision", "current")
    cache = MTPCache(cfg, cfg.mtp_layer_ids[0], max_num_seqs, dtype, numerics, revision)
    return MTPProposer(V4MTP(cfg, params, target_params, cache, numerics))
