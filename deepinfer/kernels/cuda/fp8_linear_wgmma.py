"""Launcher of `fp8_linear_wgmma.cu`: op "fp8_linear" for batched decode (M <= MAX_M rows) on Hopper's
warpgroup MMA, fed by TMA (see the .cu's header for the layout and the math).

`fp8_linear_wgmma(xp, w, out, config=None)`: xp bf16 [M, K] = act_quant's exact q * s of the activations with
each 128-column group in `act_quant.linear_wgmma_k_order` (`act_quant.act_quant_dequant_bf16(x, w.act_block,
wgmma_order=True)` writes it), w a `QuantLinearWeight` (E4M3 [N, K], fp32 pow2 block scales, block 128 or 32,
scales up to 2^7: `usable`), out bf16 [M, N]. One launch: split-K partials are added in split order by the
last CTA of each row tile (a per-device counter array, `_counters`, that the kernel leaves zeroed).
`plan(m, n, k, sms, config)`: NT (tokens per CTA, the wgmma's N), CWG (consumer warpgroups of 64 weight rows),
STAGES (the ring's depth) and SPLIT_K. The op wrapper (the ordered activation pass, the dispatch by M) is
fp8_gemm.fp8_linear(..., mma="wgmma").
Needs compute capability 9.0 exactly (wgmma is sm_90a). Must not: import triton; allocate per-call weights
(the split-K workspace is a per-call activation-sized buffer).
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime
from deepinfer.kernels.cuda.fp8_linear_mma import SCALE_EXP_MAX
from deepinfer.kernels.cuda.runtime import CudaKernel
from deepinfer.kernels.quant_weights import QuantLinearWeight

SOURCE = "fp8_linear_wgmma.cu"
KSTEP = 128
NTS = (8, 16, 32, 64, 128)  # the wgmma N sizes compiled: one CTA multiplies every row of x
MAX_M = NTS[-1]
MAX_SPLIT = 16
SMEM_BUDGET = 200 * 1024  # the ring's bytes at most (an SM has 227 KB)
COUNTERS = 4096  # row tiles per launch at most (N = 32768 in 64-row tiles is 512)
_SIGNATURE = "mmpliplppiii"  # tensor maps, ws, stride_wsn, block, out, stride_om, part, counters, M, N, k_split
_KERNELS: dict[tuple, CudaKernel] = {}
_COUNTER_BUFFERS: dict[int, torch.Tensor] = {}


def kernel(cfg: dict, split: bool) -> CudaKernel:
    key = (cfg["NT"], cfg["CWG"], cfg["STAGES"], int(split))
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp8_linear_wgmma", _SIGNATURE,
                                   dict(NT=key[0], CWG=key[1], STAGES=key[2], SPLIT=key[3]), arch_suffix="a")
    return _KERNELS[key]


def rows_per_cta(cfg: dict) -> int:
    return 64 * cfg["CWG"]


def stage_bytes(cfg: dict) -> int:
    return rows_per_cta(cfg) * KSTEP + 2 * cfg["NT"] * 128


def smem_bytes(cfg: dict) -> int:
    """One CTA's dynamic shared memory: STAGES x (ROWS x 128 weight bytes + NT x 256 activation bytes), the
    mbarriers, 1024 bytes of slack to align the swizzled boxes."""
    return cfg["STAGES"] * stage_bytes(cfg) + 16 * cfg["STAGES"] + 1024


def tokens_tile(m: int) -> int:
    """The smallest compiled wgmma N that holds m rows."""
    for nt in NTS:
        if m <= nt:
            return nt
    raise ValueError(f"fp8_linear_wgmma: M={m} rows is more than {MAX_M}")


def plan(m: int, n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """NT = `tokens_tile(m)`; CWG 1 up to 32 rows, else 2 (128 weight rows per CTA: each CTA reads the whole
    activation from L2, so wider tiles read it fewer times); STAGES as many as SMEM_BUDGET holds, at most 8;
    SPLIT_K the largest power of 2 <= MAX_SPLIT reached by doubling while the grid stays within 2 CTAs per SM
    and each split keeps >= 2 stages of whole 128-K steps. `config` keys (NT, CWG, STAGES, SPLIT_K) override."""
    config = config or {}
    cfg = dict(NT=int(config.get("NT", tokens_tile(max(m, 1)))))
    cfg["CWG"] = int(config.get("CWG", 1 if cfg["NT"] <= 32 else 2))
    cfg["STAGES"] = int(config.get("STAGES", max(2, min(8, SMEM_BUDGET // stage_bytes(cfg)))))
    tiles = -(-n // rows_per_cta(cfg))
    steps = k // KSTEP
    if "SPLIT_K" in config:
        split = int(config["SPLIT_K"])
    else:
        split = 1
        while split * 2 <= MAX_SPLIT and tiles * split * 2 <= 2 * sms and steps % (split * 2) == 0 \
                and steps // (split * 2) >= 2:
            split *= 2
    cfg["SPLIT_K"] = split
    why = check(m, n, k, cfg)
    if why:
        raise ValueError(f"fp8_linear_wgmma plan {cfg}: {why}")
    return cfg


def check(m: int, n: int, k: int, cfg: dict) -> str | None:
    """Why this shape and plan cannot run (None: they can)."""
    if cfg["NT"] not in NTS:
        return f"NT must be one of {NTS}, got {cfg['NT']}"
    if m > cfg["NT"]:
        return f"M={m} rows do not fit NT={cfg['NT']}"
    if cfg["CWG"] not in (1, 2) or not 2 <= cfg["STAGES"] <= 12:
        return f"CWG must be 1 or 2 and STAGES 2..12, got {cfg['CWG']}, {cfg['STAGES']}"
    if smem_bytes(cfg) > 227 * 1024:
        return f"{smem_bytes(cfg)} bytes of shared memory do not fit an SM's 227 KB"
    split = cfg["SPLIT_K"]
    if k % KSTEP or split < 1 or (k // KSTEP) % split:
        return f"K={k} must be whole 128-K steps that SPLIT_K={split} divides"
    if -(-n // rows_per_cta(cfg)) > COUNTERS:
        return f"N={n} needs more than {COUNTERS} row tiles"
    return None


def usable(w: QuantLinearWeight, device: torch.device) -> bool:
    """The kernel can run this weight here: compute capability 9.0 with NVRTC and the driver, blocks of 128 or
    32, K whole 128-steps, power-of-two scales up to 2^7 (checked once per weight: one host sync)."""
    if device.type != "cuda" or not runtime.available() or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    if w.block not in (128, 32) or w.act_block not in (128, 32) or w.in_features % KSTEP:
        return False
    try:
        return w.scale_exponent_max() <= SCALE_EXP_MAX
    except ValueError:
        return False


def _counters(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _COUNTER_BUFFERS.get(index)
    if buf is None:
        buf = _COUNTER_BUFFERS[index] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def fp8_linear_wgmma(xp: torch.Tensor, w: QuantLinearWeight, out: torch.Tensor, config: dict | None = None,
                     sms: int | None = None) -> torch.Tensor:
    """Launch the kernel into out (bf16 [M, N]) and return it. xp: the activations in the kernel's order."""
    data, scale = w.data, w.scale
    n, k = data.shape
    problems = []
    if xp.dtype != torch.bfloat16 or xp.dim() != 2 or xp.shape[1] != k or not xp.is_contiguous():
        problems.append(f"xp must be contiguous bf16 [M, {k}], got {xp.dtype} {tuple(xp.shape)}")
    m = xp.shape[0] if xp.dim() == 2 else 0
    if data.dtype != torch.float8_e4m3fn or not data.is_contiguous() or data.data_ptr() % 16:
        problems.append(f"w.data must be contiguous 16-byte aligned float8_e4m3fn [N, K], got {data.dtype}")
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.stride(1) != 1:
        problems.append(f"w.scale must be fp32 [N/block, K/block] with unit column stride, got {scale.dtype}")
    if w.block not in (128, 32):
        problems.append(f"w.block must be 128 or 32, got {w.block}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
        problems.append(f"out must be bf16 [{m}, {n}] with unit column stride, got {out.dtype} {tuple(out.shape)}")
    if len({t.device for t in (xp, data, scale, out)}) != 1:
        problems.append(f"xp, w and out must be on one device, got {xp.device}, {data.device}, {out.device}")
    if xp.device.type != "cuda":
        problems.append(f"CUDA tensors only, got {xp.device}")
    if problems:
        raise ValueError("fp8_linear_wgmma: " + "; ".join(problems))
    if w.scale_exponent_max() > SCALE_EXP_MAX:
        raise ValueError(f"fp8_linear_wgmma: the E4M3 expansion is exact for weight scales up to 2^7; this weight "
                         f"has a scale 2^{w.scale_exponent_max() - 127}")
    if m == 0 or n == 0:
        return out
    if sms is None:
        sms = torch.cuda.get_device_properties(xp.device).multi_processor_count
    cfg = plan(m, n, k, sms, config)
    split = cfg["SPLIT_K"]
    rows = rows_per_cta(cfg)
    tmap_w = runtime.cached_tensor_map(data.view(torch.uint8), (rows, KSTEP), swizzle=128)
    tmap_a = runtime.encode_tensor_map(xp.view(torch.uint8), (cfg["NT"], 128), swizzle=128)
    part = torch.empty((split, m, n), dtype=torch.float32, device=xp.device) if split > 1 else out
    kernel(cfg, split > 1).launch(
        (-(-n // rows), split, 1), (128 * cfg["CWG"] + 32, 1, 1),
        (tmap_w, tmap_a, scale, scale.stride(0), w.block, out, out.stride(0), part, _counters(xp.device), m, n,
         k // split),
        xp.device, shared=smem_bytes(cfg))
    return out
