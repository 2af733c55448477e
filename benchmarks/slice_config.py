"""The benchmark's model: real V4-Flash dimensions (the official inference/config.json kept in
tests/fixtures/configs), truncated to a slice of `num_layers` blocks that alternates the two compressed kinds
(ratio 4 with the indexer, ratio 128) like the bulk of the real 43-layer schedule, score-routed (the 3 hash
layers of the real model route by token id, which is cheaper and unrepresentative), no MTP layer.

Also the counting the roofline needs: bytes a decode step must read per layer and FLOPs per token.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer.config import ModelConfig

V4_FLASH_CONFIG = Path(__file__).resolve().parents[1] / "tests/fixtures/configs/v4-flash/inference/config.json"


def slice_config(num_layers: int) -> ModelConfig:
    args = json.loads(V4_FLASH_CONFIG.read_text())
    ratios = [4 if i % 2 == 0 else 128 for i in range(num_layers)]
    args.update(n_layers=num_layers, n_hash_layers=0, n_mtp_layers=0, compress_ratios=ratios)
    return ModelConfig.from_dict(args, family="v4")


def layer_weight_bytes(tensors: dict, layer: int) -> tuple[int, int]:
    """(bytes of the layer's weights that every token reads, bytes of ONE routed expert) from the
    checkpoint-format tensors (FP8 + scales, packed FP4 + scales, bf16/fp32 small tensors)."""
    prefix = f"layers.{layer}."
    always, expert0 = 0, 0
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        nbytes = t.numel() * t.element_size()
        if ".ffn.experts." in name:
            if ".ffn.experts.0." in name:
                expert0 += nbytes
        else:
            always += nbytes
    return always, expert0


def expected_distinct_experts(cfg: ModelConfig, batch: int) -> float:
    """Experts a batch of `batch` tokens touches under uniform routing: E * (1 - (1 - k/E)^batch)."""
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    return e * (1 - (1 - k / e) ** batch)


def decode_bytes_per_layer(cfg: ModelConfig, tensors: dict, layer: int, batch: int, context: int) -> float:
    """The fewest bytes one decode step must move for one layer: its always-read weights, the experts the
    batch touches, and the KV each sequence attends to (window + compressed entries, 1 byte FP8 nope +
    bf16 rope channels per entry as the packed layout stores them; small next to the weights here)."""
    always, expert = layer_weight_bytes(tensors, layer)
    ratio = cfg.compress_ratios[layer]
    entries = min(context, cfg.window_size) + (min(context // ratio, cfg.index_topk) if ratio else 0)
    kv = batch * entries * (cfg.head_dim - cfg.rope_head_dim + 2 * cfg.rope_head_dim)
    return always + expected_distinct_experts(cfg, batch) * expert + kv


def flops_per_token_layer(cfg: ModelConfig, tensors: dict, layer: int, context: int) -> float:
    """2 x (weights a token multiplies: every non-expert matrix + k routed experts + the shared one) plus the
    sparse attention (q.k and p.v over window + top-k entries for every head)."""
    prefix = f"layers.{layer}."
    params = 0
    for name, t in tensors.items():
        if not name.startswith(prefix) or not name.endswith(".weight") or t.dim() != 2:
            continue
        n = t.numel() * (2 if t.dtype in (torch.int8, torch.uint8) else 1)  # packed FP4: two weights a byte
        if ".ffn.experts." in name:
            if ".ffn.experts.0." in name:
                params += n * cfg.n_activated_experts
        elif "norm" not in name:
            params += n
    ratio = cfg.compress_ratios[layer]
    entries = min(context, cfg.window_size) + (min(context // ratio, cfg.index_topk) if ratio else 0)
    attn = 2 * 2 * cfg.n_heads * cfg.head_dim * entries
    return 2 * params + attn
