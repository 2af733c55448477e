"""Triton kernels for CUDA devices, registered into the `deepinfer.kernels` registry on demand.

Owns: the list of Triton kernel modules and `register_cuda_kernels()`, which imports them and installs
each module's `REGISTRATIONS` ({op name: callable}) with `register(name, fn, device="cuda")`.
Must not: import triton (or any kernel module) at import time. CI machines have no triton; only a CUDA
path calls `register_cuda_kernels()`, so importing this package is always safe.

To add kernels: write a module here that exposes `REGISTRATIONS` and add its name to `KERNEL_MODULES`.
"""
from __future__ import annotations

import importlib

# one entry per engineer-owned module; each exposes REGISTRATIONS = {op_name: fn}
KERNEL_MODULES: tuple[str, ...] = (
    "fp8_gemm",   # fp8_linear: fused act_quant + block-scaled FP8 GEMM
    "fp4_moe",    # fp4_moe: routing + grouped FP4 expert GEMMs
    "sparse_attn",  # sparse_attn_sink_official(_v41): window + compressed sparse attention with the sink
    "sparse_attn_paged",  # sparse_attn_sink_paged: the same over the stored FP8 ring / compressed rows (decode)
    "sparse_attn_paged_mixed",  # sparse_attn_sink_paged_mixed: V4.1's FP8 ring + FP4 latents (decode)
    "norm_hc",    # rms_norm, rms_norm_bf16, head_rms_norm, hc_pre_fused, hc_post, hc_post_fused
    "rope",       # rope32, rope_table32
    "indexer",    # indexer_scores_bf16, indexer_scores_paged_bf16 (decode: straight from the packed key cache)
    "topk_positions",  # topk_positions, stable_topk: a row's stable top-k by histogram selection (in position
    #                    order; in value order by one sort of the k picks), no sort of the whole row
    "compress_pool",  # compress_pool: the compressor's gated softmax pooling
    "compress_decode",  # compress_decode_step: a decode token through one compressor (scatter..RMSNorm), 1 launch
    "kv_pack",    # kv_encode, kv_decode: the FP8 KV layouts' codec, and the FP4 index keys' (fp4_quant's kernels)
    "fp4_quant",  # fp4_fake_quant: the indexer q's FP4 fake quantisation (bit-identical to its twin)
    "moe_gate",   # moe_gate_sqrtsoftplus: sqrt-softplus scores, biased top-k, renormalised weights in one kernel
    "moe_route",  # moe_route: the MoE gate GEMV, gate, slot blocks and act_quant(x) in one launch at b1
    "hadamard",   # hadamard32: the indexer's rotation as one bf16 MMA kernel (fp32 accumulation, one rounding)
    "swiglu",     # swiglu_bf16: the shared experts' upcast, clamps, silu * up and bf16 rounding in one kernel
    "decode_rows",  # decode_rows: a batched decode step's window / entry / write rows, one launch per ratio
    "bf16_gemv",  # linear_f32, blinear at M <= 16: one GEMV launch (overrides kernels/__init__'s cuBLAS entries)
    "grouped_proj",  # grouped_proj_fp8: the output LoRA on wo_a's FP8 bytes (expanded in registers at decode)
    "greedy",     # greedy_sample: the sampler's all-greedy step (token, raw logprob, rank) in one read of the logits
    "attn_norm_rope",  # qkv_norm_rope_store, head_rms_norm_rope: the decode attention's norms, RoPE and ring store
    "indexer_rotate",  # indexer_q_rotate, index_key_rotate_store: the indexer's RoPE + Hadamard + FP4, one launch each
)


def register_cuda_kernels() -> list[str]:
    """Import every Triton kernel module and register its ops for device "cuda" (re-registering
    overwrites, so calling it twice is harmless).
    Returns the op names registered. Raises ImportError (naming the module) when triton is missing."""
    from deepinfer.kernels import register

    names: list[str] = []
    for module_name in KERNEL_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{module_name}")
        except ImportError as err:
            raise ImportError(f"Triton kernel module {module_name!r} could not be imported: {err}") from err
        registrations = getattr(module, "REGISTRATIONS", None)
        if not isinstance(registrations, dict):
            raise TypeError(f"{module.__name__} must define REGISTRATIONS = {{op_name: fn}}")
        for op_name, fn in registrations.items():
            register(op_name, fn, device="cuda")
            names.append(op_name)
    return names
