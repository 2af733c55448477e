"""Launcher of `fp4_moe_wgmma_fp8.cu`: the routed-expert GEMMs of the prefill regime on Hopper's FP8
warpgroup MMA with the official fp4_gemm promotion every 32 of K (see the .cu's header for the layout and the
math).

`expert_gemm(aq, a_scale_t, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, gated, act_block,
limit, config)`:
* aq float8_e4m3fn [n_blocks * BT, K] and a_scale_t fp32 [K / act_block, n_blocks * BT]: act_quant's codes of
  the routed slots in the routing's sorted order, columns in `act_quant.wgmma_fp8_k_order`, and their
  power-of-two scales transposed (`act_quant.act_quant_gather_fp8` writes both);
* w uint8 [E, R, K/2] and w_scale uint8 [E, R, K/32] (FP4ExpertBank's layout), E8M0 bytes <= SCALE_MAX;
* gated / out / route_w / limit as `fp4_moe_wgmma.expert_gemm`.
config: BT (64 or 128), CWG (consumer warpgroups of 64 weight rows), STAGES, PBUFS (1: issue, wait, promote;
2: the next 32-K step's wgmma in flight while a step is promoted), MIN_CTAS (compile-time; `DEFAULT_TILES`).
Needs compute capability 9.0 exactly (`fp4_moe_wgmma.usable`).
Must not: import triton; know about routing (the caller passes sorted slots and blocks).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.fp4_moe_wgmma import KSTEP, routing_problems
from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "fp4_moe_wgmma_fp8.cu"
SCALE_MAX = 248  # E8M0 bytes up to this: the weight scale 2^(S-121) is built from fp32 exponent bits
ACT_BLOCKS = (32, 64, 128)  # activation scale blocks the kernel promotes by (V4: 128, V4.1: 32)
DEFAULT_TILES = dict(BT=64, CWG=2, STAGES=4, PBUFS=1, MIN_CTAS=1)
_SIGNATURE = "mmppllplpppiiiif"  # tensor maps, pointers (p), int64 strides (l), int32 (i), the float limit (f)
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict, gated: bool, out_f32: bool, act_block: int) -> CudaKernel:
    key = tuple(sorted((k, cfg[k]) for k in DEFAULT_TILES)) + (
        ("GATED", int(gated)), ("OUT_F32", int(out_f32)), ("ABLK", int(act_block)))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp4_expert_gemm_wgmma_fp8", _SIGNATURE, dict(key), arch_suffix="a")
    return _KERNELS[key]


def smem_bytes(cfg: dict, act_block: int = 32) -> int:
    """Dynamic shared memory of one CTA: per stage the activation box (BT x 128 bytes), the weight box (64 CWG
    rows x 64 bytes) and the activation scales (128 / act_block x BT fp32; sized here for the most, 32), the
    mbarriers, and 1024 bytes of slack to align the swizzled boxes."""
    per_stage = cfg["BT"] * KSTEP + 64 * cfg["CWG"] * KSTEP // 2 + (KSTEP // act_block) * cfg["BT"] * 4
    return cfg["STAGES"] * per_stage + 16 * cfg["STAGES"] + 1024


def tiles(config: dict | None = None) -> dict:
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    if cfg["BT"] not in (64, 128) or cfg["CWG"] not in (1, 2, 3, 4) or cfg["STAGES"] < 2 \
            or cfg["PBUFS"] not in (1, 2) or cfg["MIN_CTAS"] not in (1, 2, 3):
        raise ValueError(f"fp4_moe_wgmma_fp8 tiles: BT 64/128, CWG 1..4, STAGES >= 2, PBUFS 1/2, MIN_CTAS 1..3, "
                         f"got {cfg}")
    if smem_bytes(cfg) * cfg["MIN_CTAS"] > 228 * 1024 - 1024 * (cfg["MIN_CTAS"] - 1):
        raise ValueError(f"fp4_moe_wgmma_fp8 tiles {cfg} need {smem_bytes(cfg)} bytes of shared memory per CTA: "
                         f"{cfg['MIN_CTAS']} CTA(s) do not fit an SM's 227 KB")
    return cfg


def input_problems(aq: torch.Tensor, a_scale_t: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out: torch.Tensor, route_w: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
                   n_slots: int, gated: bool, act_block: int, cfg: dict) -> list[str]:
    """Everything wrong with the inputs (empty: they can run), each naming the argument."""
    bt = cfg["BT"]
    problems = routing_problems(dict(aq=aq, a_scale_t=a_scale_t), w, w_scale, out, route_w, sorted_slots,
                                block_expert, n_slots, gated, bt)
    if w.dim() != 3:
        return problems
    k, rows = 2 * w.shape[2], block_expert.numel() * bt
    if k <= 0 or k % KSTEP:
        problems.append(f"K={k} must be a positive multiple of {KSTEP}")
    if act_block not in ACT_BLOCKS:
        problems.append(f"act_block must be one of {ACT_BLOCKS}, got {act_block}")
    if w_scale.dim() == 3 and (w_scale.stride(0) % 4 or w_scale.stride(1) % 4 or w_scale.data_ptr() % 4):
        problems.append(f"w_scale rows must be 4-byte aligned (one 32-bit load a row and stage), got strides "
                        f"{w_scale.stride()}")
    if aq.dtype != torch.float8_e4m3fn or aq.dim() != 2 or aq.shape[1] != k or not aq.is_contiguous():
        problems.append(f"aq must be contiguous float8_e4m3fn [n_blocks * {bt}, {k}], got {aq.dtype} "
                        f"{tuple(aq.shape)}")
    elif aq.shape[0] != rows:
        problems.append(f"aq has {aq.shape[0]} rows, the routing {block_expert.numel()} blocks of {bt}")
    if act_block in ACT_BLOCKS and (a_scale_t.dtype != torch.float32 or not a_scale_t.is_contiguous()
                                    or tuple(a_scale_t.shape) != (k // act_block, rows)):
        problems.append(f"a_scale_t must be contiguous fp32 [{k // act_block}, {rows}], got {a_scale_t.dtype} "
                        f"{tuple(a_scale_t.shape)}")
    return problems


def expert_gemm(aq: torch.Tensor, a_scale_t: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                route_w: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int,
                gated: bool, act_block: int, limit: float = 0.0, config: dict | None = None) -> torch.Tensor:
    cfg = tiles(config)
    problems = input_problems(aq, a_scale_t, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, gated,
                              act_block, cfg)
    if problems:
        raise ValueError("fp4_moe_wgmma_fp8.expert_gemm: " + "; ".join(problems))
    if n_slots == 0 or block_expert.numel() == 0:
        return out
    _, rows, half_k = w.shape
    k, bt, cta_rows = 2 * half_k, cfg["BT"], 64 * cfg["CWG"]
    n_out = rows // 2 if gated else rows
    box_rows = cta_rows // 2 if gated else cta_rows
    # the weights' 64-byte rows with the 64-byte swizzle: a warp's 32-bit reads of one 32-K block hit 32 banks
    tmap_w = runtime.cached_tensor_map(w, (1, box_rows, KSTEP // 2), swizzle=64)
    tmap_a = runtime.encode_tensor_map(aq.view(torch.uint8), (bt, KSTEP), swizzle=128)
    grid = (-(-n_out // box_rows), block_expert.numel(), 1)
    kernel(cfg, gated, out.dtype == torch.float32, act_block).launch(
        grid, (128 * cfg["CWG"] + 32, 1, 1),
        (tmap_w, tmap_a, a_scale_t, w_scale, w_scale.stride(0), w_scale.stride(1), out, out.stride(0), route_w,
         sorted_slots, block_expert, n_slots, aq.shape[0], n_out, k, float(limit)),
        aq.device, shared=smem_bytes(cfg, act_block))
    return out
