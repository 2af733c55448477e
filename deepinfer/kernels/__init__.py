"""Kernel registry: `get(op_name)` returns the implementation of one op for the engine model.

Owns: the name -> callable table. Every op has a plain torch version (`torch_ops.py`, the twin that
faster versions are tested against); Triton/CUDA versions will `register(name, fn, device="cuda")` later
with the same signature. Must not: import the model, the reference oracle or hold per-batch state.
"""
from __future__ import annotations

from typing import Callable

from deepinfer.kernels import official, official_fused, torch_ops

_REGISTRY: dict[tuple[str, str], Callable] = {}


def register(op_name: str, fn: Callable, device: str = "cpu") -> None:
    """Install `fn` as op `op_name` for `device` ("cpu" entries are the torch twins, used everywhere)."""
    _REGISTRY[(op_name, device)] = fn


def get(op_name: str, device: str = "cpu") -> Callable:
    """The implementation of `op_name` for `device`, falling back to the torch version."""
    fn = _REGISTRY.get((op_name, device)) or _REGISTRY.get((op_name, "cpu"))
    if fn is None:
        raise KeyError(f"unknown kernel op {op_name!r}; known: {sorted({n for n, _ in _REGISTRY})}")
    return fn


def find(op_name: str, device: str) -> Callable | None:
    """The implementation registered for exactly `device`, or None (no fallback to the torch version): for
    callers whose twin is their own general path (the sampler's greedy step)."""
    return _REGISTRY.get((op_name, device))


def ops() -> list[str]:
    return sorted({n for n, _ in _REGISTRY})


for _name in torch_ops.__all__:
    register(_name, getattr(torch_ops, _name))
for _name in official.__all__:  # official-numerics emulation (bf16 activations, FP8 act quant, ...)
    register(_name, getattr(official, _name))
for _name in official_fused.__all__:  # fused official-numerics steps (hc_pre_fused, ...): Triton twins' references
    register(_name, getattr(official_fused, _name))

# quantised-weight ops: the torch twins (the Triton versions register for "cuda" via kernels.triton)
from deepinfer.kernels import quant_weights  # noqa: E402  (it imports `official`, loaded above)

register("fp8_linear", quant_weights.fp8_linear_torch)
register("fp8_linear_unsummed", quant_weights.fp8_linear_torch)  # a bf16 tensor here; a SplitK on cuda (split_k.py)
register("fp4_moe", quant_weights.fp4_moe_torch)
register("fp4_moe_shared", quant_weights.fp4_moe_shared_torch)
register("grouped_proj_fp8", quant_weights.grouped_proj_fp8_torch)  # wo_a kept FP8 (model/out_lora.py)

# bf16-weight GEMMs of fast numerics: torch twins everywhere, cuBLAS on bf16 operands for cuda (no upcasts;
# these cuda versions need no triton, so they register here rather than in kernels.triton)
from deepinfer.kernels import bf16_gemm  # noqa: E402

register("grouped_proj_bf16", bf16_gemm.grouped_proj_bf16_torch)
register("linear_f32", bf16_gemm.linear_f32_torch)
register("grouped_proj_bf16", bf16_gemm.grouped_proj_bf16_cublas, device="cuda")
register("linear_f32", bf16_gemm.linear_f32_cublas, device="cuda")
register("blinear", bf16_gemm.blinear_cublas, device="cuda")
register("blinear_scaled", bf16_gemm.blinear_scaled_cublas, device="cuda")

# the batched decode step's index rows (plain index arithmetic; one Triton launch per ratio on cuda)
from deepinfer.kernels import decode_rows  # noqa: E402

register("decode_rows", decode_rows.decode_rows_torch)
register("decode_select_rows", decode_rows.decode_select_rows_torch)
register("stable_topk_rows", decode_rows.stable_topk_rows_torch)
