"""Launcher of `fp4_moe_tma.cu`: the routed-expert GEMM of the decode regime with a TMA-fed shared-memory
ring and a producer warp (see the .cu's header). Same call and result as `fp4_moe_mma.expert_gemm_partials`:

`expert_gemm_partials(a, w, w_scale, out, sorted_slots, block_expert, n_slots, a_row_div, config)`:
out[s, slot, n] = fp32 sum over split s's K range of a[slot // a_row_div, k] * W[e, n, k] for every routed
slot of every routing block of TOKENS slots; a bf16 [rows, K] (act_quant's exact q * s), w uint8 [E, N, K/2],
w_scale uint8 [E, N, K/32], out fp32 [S, n_slots, N]. E8M0 bytes <= 128 (the exact expansion's range).
config: MT, CWARPS, STAGES (compile-time, `DEFAULT_TILES`). The weights' and scales' tensor maps are encoded
per (tensor, box) once and kept (`runtime.cached_tensor_map`): a CUDA-graph replay reuses the captured parameter bytes.
Needs sm_90 or newer (TMA, mbarrier transaction counts): `usable(device)`.
Must not: import triton; know about SwiGLU, routing weights or the k-row sum.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.fp4_moe_mma import input_problems
from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "fp4_moe_tma.cu"
TOKENS = 8  # slots per routing block: the MMA's n8
SCALE_MAX = 128  # E8M0 bytes up to this: E2M1 x 2^(S-127) exact by one bf16x2 multiply
KSTEP = 128  # K per ring stage (64 bytes of each weight row)
DEFAULT_TILES = dict(MT=4, CWARPS=4, STAGES=3)
# H200 2026-12-02 s7 (bench_fp4_moe.py --tma, whole op, CUDA-graph replay, V4-Flash dims,
# results/fp4_moe_tma_h200_2026-12-02_s7.log): 4 m16 tiles per consumer warp, 3 stages, T=8 / 32 / 128 205 /
# 528 / 980 us against 203 / 532 / 1000 (MT2 x 4 stages), 218 / 569 / 1090 (MT2 x 6), 208 / 530 / 983 (MT2 x 8
# consumer warps x 4), and the mma.sync form's 237 / 637 / 1189. Fewer stages with more or longer consumer
# warps win: the consumers' expansion, not the bytes in flight, limits this kernel. A second run
# (_s7_run2.log): 204 / 518 / 911 us. Three variants were slower at every T and removed (BENCHMARKS.md). At T=1 (6 slots) the mma.sync form stays faster (54.0 us vs 55.0 at best here).
TOK_STRIDE, A_STAGE = 400, 8 * 400  # the .cu's activation tile: bytes per token, per stage
_SIGNATURE = "mmplpllppiiii"  # the parameters in order: m tensor map, p pointer, l int64, i int32
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict) -> CudaKernel:
    key = tuple(sorted((k, cfg[k]) for k in DEFAULT_TILES))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp4_expert_gemm_tma", _SIGNATURE, dict(key), pdl=True)
    return _KERNELS[key]


def tiles(config: dict | None = None) -> dict:
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    if cfg["MT"] < 1 or cfg["CWARPS"] < 1 or cfg["STAGES"] < 1 or rows_per_cta(cfg) > 256:
        raise ValueError(f"fp4_moe_tma tiles: MT, CWARPS, STAGES >= 1 and 16 x MT x CWARPS <= 256 rows (one TMA "
                         f"box), got {cfg}")
    return cfg


def rows_per_cta(cfg: dict) -> int:
    return 16 * cfg["MT"] * cfg["CWARPS"]


def scale_row_bytes(k_split: int) -> int:
    """Shared-memory bytes per weight row of the split's scales: rounded up to 16 (a TMA box row), + 16 so
    consecutive rows start in different banks, + 16 more where a split's first scale byte can sit inside a
    16-byte group (the box starts at the aligned column before it; the .cu's header)."""
    blocks = k_split // 32
    return -(-blocks // 16) * 16 + 16 + (16 if blocks % 16 else 0)


def smem_bytes(cfg: dict, k_split: int) -> int:
    """Dynamic shared memory of one CTA: the weight and activation rings, the split's scales, the mbarriers."""
    rows, st = rows_per_cta(cfg), cfg["STAGES"]
    return st * (rows * KSTEP // 2 + A_STAGE) + rows * scale_row_bytes(k_split) + 8 * (2 * st + 1)


def check_shapes(k: int, split: int, cfg: dict) -> str | None:
    """Why this K and split cannot run (None: they can): whole 128-K stages per split, the split's scale box at
    most 256 bytes, the CTA's shared memory within the 227 KB an sm_90 block may have. The scales' rows must
    also be 16-byte strided (a tensor map's rule; any K, as `quant_weights.sixteen_byte_rows` lays them out):
    `expert_gemm_partials` checks the tensor itself."""
    if split < 1 or k % split or (k // split) % KSTEP:
        return f"split {split} must divide K={k} into multiples of {KSTEP}"
    if scale_row_bytes(k // split) > 256:
        return f"K per split {k // split}: its scale box would exceed 256 bytes; split more"
    if smem_bytes(cfg, k // split) > 227 * 1024:
        return f"tiles {cfg} need {smem_bytes(cfg, k // split)} bytes of shared memory (> 227 KB)"
    return None


def usable(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer with NVRTC and the driver (TMA and mbarrier tx counts)."""
    return (device.type == "cuda" and runtime.available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def expert_gemm_partials(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                         sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int, a_row_div: int,
                         config: dict | None = None) -> torch.Tensor:
    cfg = tiles(config)
    _, n, half_k = w.shape
    k = 2 * half_k
    split = out.shape[0]
    why = check_shapes(k, split, cfg)
    problems = ([why] if why else []) + input_problems(a, w, w_scale, out, sorted_slots, block_expert, n_slots)
    if w_scale.stride(1) % 16 or w_scale.stride(0) % 16 or w_scale.data_ptr() % 16:  # the scales' tensor map
        problems.append(f"w_scale must start 16-byte aligned with 16-byte aligned rows (FP4ExpertBank lays them out "
                        f"so: quant_weights.sixteen_byte_rows), got strides {w_scale.stride()}")
    if problems:
        raise ValueError("fp4_moe_tma.expert_gemm_partials: " + "; ".join(problems))
    if n_slots == 0 or block_expert.numel() == 0:
        return out
    rows, k_split = rows_per_cta(cfg), k // split
    tmap_w = runtime.cached_tensor_map(w, (1, rows, KSTEP // 2))
    tmap_s = runtime.cached_tensor_map(w_scale, (1, rows, scale_row_bytes(k_split)))
    grid = (block_expert.numel(), -(-n // rows), split)
    kernel(cfg).launch(
        grid, (32 * (cfg["CWARPS"] + 1), 1, 1),
        (tmap_w, tmap_s, a, a.stride(0), out, out.stride(0), out.stride(1), sorted_slots, block_expert,
         n_slots, n, k_split, a_row_div),
        a.device, shared=smem_bytes(cfg, k_split))
    return out
