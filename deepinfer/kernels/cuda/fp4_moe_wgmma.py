"""Launcher of `fp4_moe_wgmma.cu`: the routed-expert GEMMs of the prefill regime on Hopper's warpgroup MMA
(see the .cu's header for the layout and the math).

`expert_gemm(a, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, gated, limit, config)`:
* a bf16 [n_blocks * BT, K]: the routed slots' activation rows in the routing's sorted order (row p = the
  row of the slot at sorted position p; padding rows any finite values), each 128-K group's columns in
  `act_quant.wgmma_k_order` (`act_quant.act_quant_gather` writes it);
* w uint8 [E, R, K/2] and w_scale uint8 [E, R, K/32] (FP4ExpertBank's layout), E8M0 bytes <= SCALE_MAX;
* gated False: out [n_slots, R] bf16 (fp32 when out is fp32: a test form with no output rounding) = the
  rows a . W^T; gated True (R = 2N, gate rows then up rows): out bf16 [n_slots, N] = route_w[slot] *
  silu(gate) * up with the official bf16 roundings and `limit` clamps.
config: BT (slots per routing block: 64 or 128), CWG (consumer warpgroups of 64 weight rows), STAGES,
FRAG_BUFS, HALVES, MIN_CTAS, TRIM, PRODUCER_WARP (compile-time; `DEFAULT_TILES`; the .cu's header says what
each does). The weights' tensor maps are kept (`runtime.cached_tensor_map`); the activation buffer is a fresh tensor per
call in eager use, so its map is encoded per call (one driver call, ~us).
Needs compute capability 9.0 exactly (wgmma is sm_90a): `usable(device)`.
Must not: import triton; know about routing (the caller passes sorted slots and blocks).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.runtime import CudaKernel

SOURCE = "fp4_moe_wgmma.cu"
SCALE_MAX = 128  # E8M0 bytes up to this: E2M1 x 2^(S-127) exact by one bf16x2 multiply
KSTEP = 128  # K per ring stage
# the tiles when no plan names them (fp4_moe.plan_wgmma picks per regime); TRIM 1: a routing block's wgmmas span
# only the smallest N (16 .. BT) holding its real slots
DEFAULT_TILES = dict(BT=128, CWG=4, STAGES=4, FRAG_BUFS=1, HALVES=0, MIN_CTAS=1, TRIM=1, PRODUCER_WARP=1)
_SIGNATURE = "mmpllplpppiiif"  # tensor maps, pointers (p), int64 strides (l), int32 (i), the float limit (f)
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict, gated: bool, out_f32: bool) -> CudaKernel:
    key = tuple(sorted((k, cfg[k]) for k in DEFAULT_TILES)) + (("GATED", int(gated)), ("OUT_F32", int(out_f32)))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp4_expert_gemm_wgmma", _SIGNATURE, dict(key), arch_suffix="a",
                                   pdl=True)
    return _KERNELS[key]


def tiles(config: dict | None = None) -> dict:
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    # BT 256 (128 accumulators a lane) spills: a CTA of 288 threads gets 168 registers a thread
    if cfg["BT"] not in (64, 128) or cfg["CWG"] not in (1, 2, 4) or cfg["STAGES"] < 2 \
            or cfg["FRAG_BUFS"] not in (1, 2) or cfg["HALVES"] not in (0, 1) or (cfg["HALVES"] and cfg["FRAG_BUFS"] != 1) \
            or cfg["MIN_CTAS"] not in (1, 2, 3) or cfg["TRIM"] not in (0, 1) \
            or cfg["PRODUCER_WARP"] not in (0, 1):
        raise ValueError(f"fp4_moe_wgmma tiles: BT 64/128, CWG 1/2/4, STAGES >= 2, FRAG_BUFS 1/2, HALVES 0/1 (only "
                         f"with FRAG_BUFS 1), MIN_CTAS 1..3, TRIM 0/1, PRODUCER_WARP 0/1, got {cfg}")
    if threads(cfg) * cfg["MIN_CTAS"] > 896:  # fewer than 72 registers a thread: ptxas refuses
        raise ValueError(f"fp4_moe_wgmma tiles {cfg}: {cfg['MIN_CTAS']} CTAs of {threads(cfg)} threads "
                         f"leave too few registers (at most 896 threads an SM)")
    if smem_bytes(cfg) * cfg["MIN_CTAS"] > 228 * 1024 - 1024 * (cfg["MIN_CTAS"] - 1):
        raise ValueError(f"fp4_moe_wgmma tiles {cfg} need {smem_bytes(cfg)} bytes of shared memory per CTA: "
                         f"{cfg['MIN_CTAS']} CTAs do not fit an SM's 227 KB")
    return cfg


def threads(cfg: dict) -> int:
    """A CTA's threads: the consumer warpgroups, and the producer warp unless thread 0 issues the loads."""
    return 128 * cfg["CWG"] + 32 * cfg["PRODUCER_WARP"]


def rows_per_cta(cfg: dict) -> int:
    return 64 * cfg["CWG"]


def smem_bytes(cfg: dict) -> int:
    """Dynamic shared memory of one CTA: the activation ring (two BT x 128-byte boxes per stage), the weight
    ring, the mbarriers, and 1024 bytes of slack to align the swizzled boxes."""
    per_stage = 2 * cfg["BT"] * 128 + rows_per_cta(cfg) * KSTEP // 2
    return cfg["STAGES"] * per_stage + 16 * cfg["STAGES"] + 1024


def check_k(k: int, cfg: dict) -> str | None:
    """Why K cannot run (None: it can): whole stages, an even count of them with two fragment buffers."""
    step = KSTEP * cfg["FRAG_BUFS"]
    if k <= 0 or k % step:
        return f"K={k} must be a positive multiple of {step} (128-K stages, FRAG_BUFS={cfg['FRAG_BUFS']} at a time)"
    return None


def usable(device: torch.device) -> bool:
    """A CUDA device of compute capability exactly 9.0 (wgmma is sm_90a) with NVRTC and the driver."""
    return runtime.sm90a_usable(device)


def input_problems(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, route_w: torch.Tensor,
                   sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int, gated: bool,
                   cfg: dict) -> list[str]:
    """Everything wrong with the inputs (empty: they can run), each naming the argument."""
    problems = []
    tensors = dict(a=a, w=w, w_scale=w_scale, out=out, route_w=route_w, sorted_slots=sorted_slots,
                   block_expert=block_expert)
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        problems.append(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if w.dim() != 3 or w.dtype != torch.uint8:
        return problems + [f"w must be uint8 [E, R, K/2], got {w.dtype} {tuple(w.shape)}"]
    e, rows, half_k = w.shape
    k = 2 * half_k
    why = check_k(k, cfg)
    if why:
        problems.append(why)
    if w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (e, rows, k // 32):
        problems.append(f"w_scale must be uint8 [{e}, {rows}, {k // 32}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    elif w_scale.stride(-1) != 1:
        problems.append("w_scale's last dimension must be contiguous")
    if w.stride(-1) != 1 or w.stride(1) % 16 or w.stride(0) % 16 or w.data_ptr() % 16:
        problems.append(f"w must have contiguous 16-byte aligned rows (the TMA), got strides {w.stride()}")
    bt = cfg["BT"]
    if a.dtype != torch.bfloat16 or a.dim() != 2 or a.shape[1] != k or not a.is_contiguous():
        problems.append(f"a must be contiguous bf16 [n_blocks * {bt}, {k}], got {a.dtype} {tuple(a.shape)}")
    elif a.shape[0] != block_expert.numel() * bt:
        problems.append(f"a has {a.shape[0]} rows, the routing {block_expert.numel()} blocks of {bt}")
    if sorted_slots.dtype != torch.int32 or sorted_slots.numel() != block_expert.numel() * bt:
        problems.append(f"sorted_slots must be int32 [{block_expert.numel() * bt}] (blocks of {bt}), got "
                        f"{sorted_slots.dtype} [{sorted_slots.numel()}]")
    if block_expert.dtype != torch.int32:
        problems.append(f"block_expert must be int32, got {block_expert.dtype}")
    n_out = rows // 2 if gated else rows
    if gated and rows % 2:
        problems.append(f"gated: w must hold gate and up rows (an even count), got {rows}")
    want_dtypes = (torch.bfloat16,) if gated else (torch.bfloat16, torch.float32)
    if out.dim() != 2 or tuple(out.shape) != (n_slots, n_out) or out.dtype not in want_dtypes or out.stride(1) != 1:
        problems.append(f"out must be [{n_slots}, {n_out}] {' or '.join(str(d) for d in want_dtypes)} with "
                        f"contiguous rows, got {out.dtype} {tuple(out.shape)}")
    if route_w.dtype != torch.float32 or route_w.numel() < n_slots:
        problems.append(f"route_w must be fp32 with >= {n_slots} entries, got {route_w.dtype} [{route_w.numel()}]")
    return problems


def expert_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, route_w: torch.Tensor,
                sorted_slots: torch.Tensor, block_expert: torch.Tensor, n_slots: int, gated: bool,
                limit: float = 0.0, config: dict | None = None) -> torch.Tensor:
    cfg = tiles(config)
    problems = input_problems(a, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, gated, cfg)
    if problems:
        raise ValueError("fp4_moe_wgmma.expert_gemm: " + "; ".join(problems))
    if n_slots == 0 or block_expert.numel() == 0:
        return out
    _, rows, half_k = w.shape
    k, bt, cta_rows = 2 * half_k, cfg["BT"], rows_per_cta(cfg)
    n_out = rows // 2 if gated else rows
    box_rows = cta_rows // 2 if gated else cta_rows
    tmap_w = runtime.cached_tensor_map(w, (1, box_rows, KSTEP // 2))
    # the activations as bytes [P, 2K]: boxes of BT rows x 128 bytes (64 bf16), 128-byte swizzle
    tmap_a = runtime.encode_tensor_map(a.view(torch.uint8), (bt, 128), swizzle=128)
    # row tiles fastest: a routing block's tiles run at once (its activations read once from HBM, then L2)
    grid = (-(-n_out // box_rows), block_expert.numel(), 1)
    kernel(cfg, gated, out.dtype == torch.float32).launch(
        grid, (threads(cfg), 1, 1),
        (tmap_w, tmap_a, w_scale, w_scale.stride(0), w_scale.stride(1), out, out.stride(0), route_w,
         sorted_slots, block_expert, n_slots, n_out, k, float(limit)),
        a.device, shared=smem_bytes(cfg))
    return out
