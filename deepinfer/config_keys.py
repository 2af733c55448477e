"""HF `config.json` key names -> official `ModelArgs` names (spec §1.2, §10.1).

Owns the translation table and the reading of an HF config (including V4.1's `text_config` nesting and
`quantization_config`). Values that exist only in HF form (token ids, max positions) are mapped where the
engine needs them; everything else that is not architectural is returned as `extra`.
"""
from __future__ import annotations

from typing import Any

# HF name -> ModelArgs name. Identical names (compress_ratios, o_groups, ...) pass through unchanged.
# `num_nextn_predict_layers` is deliberately not mapped: V4-Flash-0731 says 1 there but ships 3 DSpark
# stages; the number of MTP/DSpark layers is len(compress_ratios) - n_layers (or n_mtp_layers when the
# inference config states it).
HF_TO_ARGS: dict[str, str] = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "num_hash_layers": "n_hash_layers",
    "routed_scaling_factor": "route_scale",
    "scoring_func": "score_func",
    "sliding_window": "window_size",
    "rms_norm_eps": "norm_eps",
    "qk_rope_head_dim": "rope_head_dim",
    "index_topk": "index_topk",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}

# ModelArgs names that only V4.1 (and DSpark checkpoints) carry; omitted from a V4 inference config.
V41_ONLY_KEYS = frozenset(
    {
        "kv_source_layers", "index_source_layers", "candidate_source_layer", "candidate_topk_blocks",
        "candidate_block_size", "gate_temp", "norm_topk_prob", "engram_layer_ids", "engram_num_embeddings",
        "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_id",
        "engram_compressed_vocab_size", "dspark_block_size", "dspark_noise_token_id",
        "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
        "dspark_n_activated_experts",
    }
)

# keys whose ModelArgs name equals the HF name
_SAME_NAME = {
    "vocab_size", "q_lora_rank", "head_dim", "o_groups", "o_lora_rank", "compress_ratios",
    "compress_rope_theta", "index_n_heads", "index_head_dim", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "swiglu_limit", "expert_dtype", "rope_theta",
} | set(V41_ONLY_KEYS)


def read_hf_config(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """HF config dict -> (ModelArgs-named args, extra keys). V4.1 nests the LM under `text_config`."""
    text = dict(hf.get("text_config") or {})
    outer = {k: v for k, v in hf.items() if k != "text_config"}
    src = {**outer, **text} if text else dict(hf)
    args: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in src.items():
        if key in HF_TO_ARGS:
            args[HF_TO_ARGS[key]] = value
        elif key in _SAME_NAME:
            args[key] = value
        else:
            extra[key] = value
    rope = src.get("rope_scaling") or src.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("type", rope.get("rope_type")) == "yarn":
        args["rope_factor"] = rope.get("factor", 1.0)
        args["original_seq_len"] = rope.get("original_max_position_embeddings", 0)
        args["beta_fast"] = rope.get("beta_fast", 32)
        args["beta_slow"] = rope.get("beta_slow", 1)
    quant = src.get("quantization_config") or {}
    if isinstance(quant, dict) and quant:
        args["dtype"] = "fp8" if quant.get("quant_method") == "fp8" else "bf16"
        for key in ("scale_fmt", "expert_dtype"):  # V4.1 keeps expert_dtype inside quantization_config
            if key in quant:
                args[key] = quant[key]
        block = quant.get("weight_block_size")
        if block is not None:
            extra["weight_block_size"] = list(block)
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(args.get(key), list):
            args[key] = args[key][0]
    return args, extra
