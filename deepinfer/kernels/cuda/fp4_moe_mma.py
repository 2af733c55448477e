"""Launcher of `fp4_moe_mma.cu`: one routed-expert GEMM of the decode regime on mma.sync (see the .cu's header).

`expert_gemm_partials(a, w, w_scale, out, sorted_slots, block_expert, n_slots, a_row_div, config)`:
out[s, slot, n] = fp32 sum over split s's K range of a[slot // a_row_div, k] * W[e, n, k] for every routed
slot of every routing block (blocks of TOKENS slots of one expert, `fp4_moe.route_slots(..., TOKENS)`),
with W the exact FP4 x E8M0 weights. a: bf16 [rows, K] (act_quant's exact q * s); w uint8 [E, N, K/2] and
w_scale uint8 [E, N, K/32] (FP4ExpertBank's layout); out fp32 [S, n_slots, N] (S = the split count).
The caller adds the S partials in a fixed order (fp4_moe's reduce kernels). The weights' E8M0 bytes
must be <= 128 (the expansion's exact range; FP4ExpertBank.scale_max).
config: MT, WARPS, STAGES, KSTEP, ASYNC (compile-time; `DEFAULT_TILES`), each distinct set its own cubin.
Must not: import triton; know about SwiGLU, routing weights or the k-row sum (the Triton op's).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "fp4_moe_mma.cu"
TOKENS = 8  # slots per routing block: the MMA's n8
SCALE_MAX = 128  # E8M0 bytes up to this: E2M1 x 2^(S-127) exact by one bf16x2 multiply
DEFAULT_TILES = dict(MT=2, WARPS=4, STAGES=2, KSTEP=128, ASYNC=0, LOAD_ONLY=0)  # KSTEP: K per pipeline stage
# (128 or 256); ASYNC 1: the stages go through a shared-memory ring by cp.async (`ring_bytes`) instead of
# registers; LOAD_ONLY 1: a diagnostic, the loads alone (garbage out; benchmarks/bench_moe_load_bound.py)
_SIGNATURE = "plpllpllpllppiiii"  # the kernel parameters in order: p pointer, l int64, i int32
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict) -> CudaKernel:
    key = tuple(sorted((k, cfg[k]) for k in DEFAULT_TILES))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp4_expert_gemm_mma", _SIGNATURE, dict(key), pdl=True)
    return _KERNELS[key]


def tiles(config: dict | None = None) -> dict:
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    if cfg["KSTEP"] not in (128, 256) or cfg["STAGES"] < 1 or cfg["MT"] < 1 or cfg["WARPS"] < 1 \
            or (cfg["ASYNC"] and cfg["STAGES"] < 2):
        raise ValueError(f"fp4_moe_mma tiles: KSTEP 128 or 256, STAGES >= 1 (ASYNC: >= 2), MT and WARPS >= 1, "
                         f"got {cfg}")
    return cfg


def ring_bytes(cfg: dict) -> int:
    """Dynamic shared memory of an ASYNC launch: per stage and lane, the weight and activation 16-byte chunks
    and a scale word (4 bytes per 128 K) per weight row."""
    if not cfg["ASYNC"]:
        return 0
    wv = cfg["KSTEP"] // 128
    per_lane = (cfg["MT"] * 2 * wv + 4 * wv) * 16 + cfg["MT"] * 2 * 4 * wv
    return cfg["STAGES"] * cfg["WARPS"] * 32 * per_lane


def rows_per_cta(cfg: dict) -> int:
    return 16 * cfg["MT"] * cfg["WARPS"]


def check_shapes(k: int, split: int, cfg: dict) -> str | None:
    """Why this K and split cannot run (None: they can): each split must be whole pipeline rounds of KSTEP K."""
    if split < 1 or k % split:
        return f"split {split} must divide K={k}"
    if (k // split) % (cfg["KSTEP"] * cfg["STAGES"]):
        return f"K per split {k // split} must be a multiple of KSTEP {cfg['KSTEP']} x STAGES {cfg['STAGES']}"
    return None


def input_problems(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                   sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int) -> list[str]:
    """What is wrong with `expert_gemm_partials`' tensors (dtypes, shapes, strides, alignment), one text each;
    the TMA form's launcher (fp4_moe_tma.py) runs the same checks and adds its own."""
    e, n, half_k = w.shape
    k = 2 * half_k
    problems = []
    if a.dtype != torch.bfloat16 or a.dim() != 2 or a.shape[1] < k or a.stride(1) != 1 or a.stride(0) % 8:
        problems.append(f"a must be bf16 [rows, >= {k}] with unit column stride and rows 16-byte aligned, "
                        f"got {a.dtype} {tuple(a.shape)} strides {a.stride()}")
    if w.dtype != torch.uint8 or w.stride(2) != 1 or w.stride(1) % 16 or w.stride(0) % 16:
        problems.append(f"w must be uint8 [E, N, K/2] with 16-byte aligned rows, got {w.dtype} strides {w.stride()}")
    if tuple(w_scale.shape) != (e, n, k // 32) or w_scale.dtype != torch.uint8 or w_scale.stride(2) != 1:
        problems.append(f"w_scale must be uint8 [{e}, {n}, {k // 32}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    if out.dtype != torch.float32 or out.dim() != 3 or out.shape[1] != n_slots or out.shape[2] != n or out.stride(2) != 1:
        problems.append(f"out must be fp32 [S, {n_slots}, {n}] with unit column stride, got {out.dtype} {tuple(out.shape)}")
    if sorted_slots.dtype != torch.int32 or block_expert.dtype != torch.int32 \
            or sorted_slots.numel() != block_expert.numel() * TOKENS:
        problems.append(f"routing must be int32 blocks of {TOKENS} slots: sorted_slots {sorted_slots.numel()}, "
                        f"block_expert {block_expert.numel()}")
    if any(t.data_ptr() % 16 for t in (a, w)):
        problems.append("a and w must start 16-byte aligned")
    return problems


def expert_gemm_partials(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                         sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int, a_row_div: int,
                         config: dict | None = None) -> torch.Tensor:
    cfg = tiles(config)
    _, n, half_k = w.shape
    k = 2 * half_k
    split = out.shape[0]
    why = check_shapes(k, split, cfg)
    problems = ([why] if why else []) + input_problems(a, w, w_scale, out, sorted_slots, block_expert, n_slots)
    if problems:
        raise ValueError("expert_gemm_partials: " + "; ".join(problems))
    if n_slots == 0 or block_expert.numel() == 0:
        return out
    grid = (block_expert.numel(), -(-n // rows_per_cta(cfg)), split)
    kernel(cfg).launch(
        grid, (32 * cfg["WARPS"], 1, 1),
        (a, a.stride(0), w, w.stride(0), w.stride(1), w_scale, w_scale.stride(0), w_scale.stride(1),
         out, out.stride(0), out.stride(1), sorted_slots, block_expert, n_slots, n, k // split, a_row_div),
        a.device, shared=ring_bytes(cfg))
    return out
