"""Launcher of `fp4_moe_fp8_mma.cu`: one routed-expert GEMM of the decode regime in the official fp4_gemm math
(E4M3 activations x E2M1 weights as E4M3 on FP8 mma.sync, each 32-K block's dot promoted into fp32 with its
activation and weight scales; see the .cu's header).

`expert_gemm_partials(a, a_scale, w, w_scale, out, sorted_slots, block_expert, n_slots, a_row_div, act_block,
config)`: out[s, slot, n] = fp32 sum over split s's 32-K blocks kb of a_scale[row, kb*32 // act_block] *
2^(w_scale[e, n, kb] - 127) * (FP8 tensor-core dot of the block), row = slot // a_row_div, for every routed
slot of every routing block (blocks of `tokens(config)` slots of one expert, `fp4_moe.route_slots`).
a: E4M3 codes [rows, K] (act_quant's), a_scale fp32 [rows, K / act_block]; w uint8 [E, N, K/2], w_scale uint8
[E, N, K/32] (FP4ExpertBank's layout); out fp32 [S, n_slots, N] (S = the split count). The caller adds the S
partials in a fixed order (fp4_moe's reduce kernels). The weights' E8M0 bytes must be <= SCALE_MAX.
config: MT, WARPS, STAGES, KSTEP, PASSES (compile-time; `DEFAULT_TILES`), each distinct set its own cubin.
Must not: import triton; know about SwiGLU, routing weights or the k-row sum (the Triton op's).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "fp4_moe_fp8_mma.cu"
SCALE_MAX = 240  # E8M0 bytes up to this: the promotion's 2^(S - 127 + 14) is an fp32 normal power of two
ACT_BLOCKS = (32, 64, 128)  # the activation scale blocks the kernel is compiled for
DEFAULT_TILES = dict(MT=2, WARPS=4, STAGES=2, KSTEP=128, PASSES=1, CVT=1)  # PASSES: token pairs per routing
# block; CVT: how an A register becomes f16x2 (0 E4M3 bytes + cvt, 1 E5M2 bytes + byte permute)
_SIGNATURE = "plplpllpllpllppiiii"  # the kernel parameters in order: p pointer, l int64, i int32
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict, act_block: int) -> CudaKernel:
    key = tuple(sorted((k, cfg[k]) for k in DEFAULT_TILES)) + (("AB", act_block),)
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp4_expert_gemm_fp8mma", _SIGNATURE, dict(key))
    return _KERNELS[key]


def tiles(config: dict | None = None) -> dict:
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    if cfg["KSTEP"] not in (128, 256) or cfg["STAGES"] < 1 or cfg["MT"] < 1 or cfg["WARPS"] < 1 \
            or cfg["PASSES"] not in (1, 2, 3, 4) or cfg["CVT"] not in (0, 1):
        raise ValueError(f"fp4_moe_fp8_mma tiles: KSTEP 128 or 256, STAGES, MT and WARPS >= 1, PASSES 1..4, CVT 0 "
                         f"or 1, got {cfg}")
    return cfg


def tokens(config: dict | None = None) -> int:
    """Slots per routing block: two per pass (a pass is the MMA's 8 columns, 2 tokens x 4 blocks)."""
    return 2 * tiles(config)["PASSES"]


def rows_per_cta(cfg: dict) -> int:
    return 16 * cfg["MT"] * cfg["WARPS"]


def check_shapes(k: int, split: int, cfg: dict) -> str | None:
    """Why this K and split cannot run (None: they can): each split must be whole pipeline rounds of KSTEP K."""
    if split < 1 or k % split:
        return f"split {split} must divide K={k}"
    if (k // split) % (cfg["KSTEP"] * cfg["STAGES"]):
        return f"K per split {k // split} must be a multiple of KSTEP {cfg['KSTEP']} x STAGES {cfg['STAGES']}"
    return None


def expert_gemm_partials(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         out: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int,
                         a_row_div: int, act_block: int, config: dict | None = None) -> torch.Tensor:
    cfg = tiles(config)
    e, n, half_k = w.shape
    k = 2 * half_k
    split = out.shape[0]
    why = check_shapes(k, split, cfg)
    problems = [why] if why else []
    if act_block not in ACT_BLOCKS:
        problems.append(f"act_block must be one of {ACT_BLOCKS}, got {act_block}")
    elif a_scale.dtype != torch.float32 or a_scale.dim() != 2 or a_scale.shape[1] < k // act_block \
            or a_scale.shape[0] != a.shape[0] or a_scale.stride(1) != 1:
        problems.append(f"a_scale must be fp32 [{a.shape[0]}, >= {k // act_block}] with unit column stride, "
                        f"got {a_scale.dtype} {tuple(a_scale.shape)} strides {a_scale.stride()}")
    if a.dtype != torch.float8_e4m3fn or a.dim() != 2 or a.shape[1] < k or a.stride(1) != 1 or a.stride(0) % 16:
        problems.append(f"a must be float8_e4m3fn [rows, >= {k}] with unit column stride and rows 16-byte aligned, "
                        f"got {a.dtype} {tuple(a.shape)} strides {a.stride()}")
    if w.dtype != torch.uint8 or w.stride(2) != 1 or w.stride(1) % 16 or w.stride(0) % 16:
        problems.append(f"w must be uint8 [E, N, K/2] with 16-byte aligned rows, got {w.dtype} strides {w.stride()}")
    if tuple(w_scale.shape) != (e, n, k // 32) or w_scale.dtype != torch.uint8 or w_scale.stride(2) != 1 \
            or w_scale.stride(1) % 4 or w_scale.stride(0) % 4:
        problems.append(f"w_scale must be uint8 [{e}, {n}, {k // 32}] with 4-byte aligned rows, got {w_scale.dtype} "
                        f"{tuple(w_scale.shape)} strides {w_scale.stride()}")
    if out.dtype != torch.float32 or out.dim() != 3 or out.shape[1] != n_slots or out.shape[2] != n or out.stride(2) != 1:
        problems.append(f"out must be fp32 [S, {n_slots}, {n}] with unit column stride, got {out.dtype} {tuple(out.shape)}")
    per_block = tokens(cfg)
    if sorted_slots.dtype != torch.int32 or block_expert.dtype != torch.int32 \
            or sorted_slots.numel() != block_expert.numel() * per_block:
        problems.append(f"routing must be int32 blocks of {per_block} slots: sorted_slots {sorted_slots.numel()}, "
                        f"block_expert {block_expert.numel()}")
    if any(t.data_ptr() % 16 for t in (a, w)) or w_scale.data_ptr() % 4:
        problems.append("a and w must start 16-byte aligned, w_scale 4-byte aligned")
    if problems:
        raise ValueError("fp4_moe_fp8_mma.expert_gemm_partials: " + "; ".join(problems))
    if n_slots == 0 or block_expert.numel() == 0:
        return out
    grid = (block_expert.numel(), -(-n // rows_per_cta(cfg)), split)
    kernel(cfg, act_block).launch(
        grid, (32 * cfg["WARPS"], 1, 1),
        (a, a.stride(0), a_scale, a_scale.stride(0), w, w.stride(0), w.stride(1), w_scale, w_scale.stride(0),
         w_scale.stride(1), out, out.stride(0), out.stride(1), sorted_slots, block_expert, n_slots, n, k // split,
         a_row_div),
        a.device)
    return out
