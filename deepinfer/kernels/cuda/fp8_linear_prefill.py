"""Launcher of `fp8_linear_prefill.cu`: the FP8 linear of the prefill regime on Hopper's warpgroup MMA, both
operands' E4M3 codes TMA-fed into shared memory, the official per-128-K promotion (see the .cu's header for the
layout and the math: `fp8_gemm`'s "fp8" Triton form, bit for bit).

`fp8_linear_prefill(xq, xs, w, out, cfg, sms)`: xq float8_e4m3fn [M, K] and xs fp32 [M, K / 128] (act_quant's codes
and scales, block 128), w a `QuantLinearWeight` of 128 x 128 blocks (`usable_weight`), out bf16 [M, N] with
16-byte aligned rows, sms the device's SM count (the persistent form's grid; the caller's cached
`fp8_gemm.sm_count`). `tiles(config)`: the plan (CWG, BN, STAGES, GROUP_M, PIPE, PERSIST).
The weights' tensor maps are kept (`runtime.cached_tensor_map`); the activation's is encoded per call (one
driver call, ~us).
Needs compute capability 9.0 exactly (wgmma is sm_90a): `usable(device)`.
Must not: import triton; allocate.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.runtime import CudaKernel
from deepinfer.kernels.quant_weights import QuantLinearWeight

SOURCE = "fp8_linear_prefill.cu"
KSTEP = 128  # K per ring stage = the promotion group (V4's act block)
SMEM_BUDGET = 220 * 1024  # of an SM's 227 KB: one CTA an SM, as deep a ring as fits
# CWG 3 (192 rows) spills in the sm_90a build (416 threads leave 128 registers a thread for 2 x 64 accumulators)
DEFAULT_TILES = dict(CWG=2, BN=128, STAGES=0, GROUP_M=8, PIPE=0, PERSIST=0)  # STAGES 0: as deep as SMEM_BUDGET
# allows; PIPE 1: two partials, a stage's wgmmas issued before the previous one is promoted; PERSIST 1: one CTA an
# SM walks the tiles, the ring running on across them (the .cu's `fp8_linear_prefill_persistent`)
_SIGNATURE = "mmplplpliii"  # tensor maps x / w, xs, stride_xsm, ws, stride_wsn, out, stride_om, M, N, K
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict) -> CudaKernel:
    key = tuple((k, cfg[k]) for k in DEFAULT_TILES)
    if key not in _KERNELS:
        name = "fp8_linear_prefill_persistent" if cfg["PERSIST"] else "fp8_linear_prefill"
        _KERNELS[key] = CudaKernel(SOURCE, name, _SIGNATURE, dict(key), arch_suffix="a", pdl=True)
    return _KERNELS[key]


def rows_per_cta(cfg: dict) -> int:
    return 64 * cfg["CWG"]


def threads(cfg: dict) -> int:
    """The CTA: CWG consumer warpgroups and a producer warp (a warpgroup that hands its registers to the
    consumers for PIPE's two partials at CWG 2: the .cu's PRODUCER_THREADS)."""
    return 128 * cfg["CWG"] + (128 if cfg["PIPE"] and cfg["CWG"] == 2 else 32)


def stage_bytes(cfg: dict) -> int:
    """One ring stage: the activation box (BM x 128 bytes) and the weight box (BN x 128 bytes)."""
    return (rows_per_cta(cfg) + cfg["BN"]) * KSTEP


def smem_bytes(cfg: dict) -> int:
    """Dynamic shared memory of one CTA: the ring, its mbarriers, 1024 bytes of slack to align the swizzle."""
    return cfg["STAGES"] * stage_bytes(cfg) + 16 * cfg["STAGES"] + 1024


def tiles(config: dict | None = None) -> dict:
    """DEFAULT_TILES with config's keys on top; STAGES (when 0) as deep as SMEM_BUDGET allows. ValueError
    naming the rule a plan breaks."""
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    if cfg["CWG"] not in (1, 2) or cfg["BN"] not in (64, 128) or cfg["GROUP_M"] < 1 or cfg["STAGES"] < 0 \
            or cfg["PIPE"] not in (0, 1) or cfg["PERSIST"] not in (0, 1) or (cfg["PIPE"] and cfg["PERSIST"]):
        raise ValueError(f"fp8_linear_prefill tiles: CWG 1/2, BN 64/128, GROUP_M >= 1, STAGES >= 2 (0: as deep "
                         f"as fits), PIPE 0/1, PERSIST 0/1 (not both), got {cfg}")
    if cfg["STAGES"] == 0:
        cfg["STAGES"] = min(8, (SMEM_BUDGET - 1024) // (stage_bytes(cfg) + 16))
    if cfg["STAGES"] < 2:  # (2 stages always hold the epilogue's staging tile: the .cu's static_assert)
        raise ValueError(f"fp8_linear_prefill tiles {cfg}: the ring needs at least 2 stages")
    if smem_bytes(cfg) > 227 * 1024:
        raise ValueError(f"fp8_linear_prefill tiles {cfg} need {smem_bytes(cfg)} bytes of shared memory per CTA "
                         f"(an SM has 227 KB)")
    return cfg


def usable(device: torch.device) -> bool:
    """A CUDA device of compute capability exactly 9.0 (wgmma is sm_90a) with NVRTC and the driver."""
    return runtime.sm90a_usable(device)


def usable_weight(w: QuantLinearWeight, bn: int = DEFAULT_TILES["BN"]) -> bool:
    """The kernel can multiply this weight: V4's 128 x 128 blocks with act block 128, K whole stages, N whole
    tiles of bn rows."""
    return (w.block == 128 and w.act_block == 128 and w.in_features % KSTEP == 0 and w.out_features % bn == 0
            and w.data.is_contiguous() and w.data.data_ptr() % 16 == 0)


def input_problems(xq: torch.Tensor, xs: torch.Tensor, w: QuantLinearWeight, out: torch.Tensor,
                   cfg: dict) -> list[str]:
    """Everything wrong with the inputs (empty: they can run), each naming the argument."""
    problems = []
    data, scale = w.data, w.scale
    n, k = data.shape
    if w.block != 128 or w.act_block != 128:
        problems.append(f"w must have 128 x 128 blocks and act block 128 (V4), got block {w.block}, act block "
                        f"{w.act_block}")
    if k % KSTEP or n % cfg["BN"]:
        problems.append(f"w [{n}, {k}]: K must be a multiple of {KSTEP} and N of the plan's BN {cfg['BN']}")
    # (QuantLinearWeight itself holds data E4M3 [N, K] and scale fp32 [N / block, K / block] on data's device)
    if not data.is_contiguous() or data.data_ptr() % 16:
        problems.append(f"w.data must be contiguous 16-byte aligned float8_e4m3fn [N, K] (the TMA), got strides "
                        f"{data.stride()}")
    if scale.stride(1) != 1:
        problems.append(f"w.scale must have unit column stride, got strides {scale.stride()}")
    if xq.dtype != torch.float8_e4m3fn or xq.dim() != 2 or xq.shape[1] != k or not xq.is_contiguous() \
            or xq.data_ptr() % 16:
        problems.append(f"xq must be contiguous 16-byte aligned float8_e4m3fn [M, {k}] (act_quant's codes), got "
                        f"{xq.dtype} {tuple(xq.shape)}")
    m = xq.shape[0] if xq.dim() == 2 else 0
    if xs.dtype != torch.float32 or xs.dim() != 2 or tuple(xs.shape) != (m, k // 128) or xs.stride(1) != 1:
        problems.append(f"xs must be fp32 [{m}, {k // 128}] with unit column stride (act_quant's scales), got "
                        f"{xs.dtype} {tuple(xs.shape)}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1 or out.stride(0) % 8 \
            or out.data_ptr() % 16:
        problems.append(f"out must be bf16 [{m}, {n}] with unit column stride and 16-byte aligned rows, got "
                        f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if len({t.device for t in (xq, xs, data, out)}) != 1:
        problems.append(f"xq, xs, w and out must be on one device, got {xq.device}, {xs.device}, {data.device}, "
                        f"{out.device}")
    return problems


def fp8_linear_prefill(xq: torch.Tensor, xs: torch.Tensor, w: QuantLinearWeight, out: torch.Tensor,
                       cfg: dict, sms: int) -> torch.Tensor:
    """Launch the kernel with plan `cfg` (`tiles`) into `out` and return it (ValueError naming every problem
    with the inputs, before any launch). sms: the SMs the persistent form's CTAs may fill."""
    problems = input_problems(xq, xs, w, out, cfg)
    if problems:
        raise ValueError("fp8_linear_prefill: " + "; ".join(problems))
    m, (n, k) = xq.shape[0], w.data.shape
    if m == 0 or n == 0:
        return out
    bm = rows_per_cta(cfg)
    tmap_w = runtime.cached_tensor_map(w.data.view(torch.uint8), (cfg["BN"], KSTEP), swizzle=128)
    tmap_x = runtime.encode_tensor_map(xq.view(torch.uint8), (bm, KSTEP), swizzle=128)
    n_tiles = -(-m // bm) * (n // cfg["BN"])
    grid = (min(n_tiles, sms) if cfg["PERSIST"] else n_tiles, 1, 1)
    kernel(cfg).launch(grid, (threads(cfg), 1, 1),
                       (tmap_x, tmap_w, xs, xs.stride(0), w.scale, w.scale.stride(0), out, out.stride(0), m, n, k),
                       xq.device, shared=smem_bytes(cfg))
    return out
