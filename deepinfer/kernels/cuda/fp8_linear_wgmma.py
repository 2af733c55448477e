"""Launcher of `fp8_linear_wgmma.cu`: the FP8 linear of the batched-decode regime on Hopper's warpgroup MMA,
TMA-fed and warp-specialised (see the .cu's header for the layout and the math).

`fp8_linear_partials(a, w, out, cfg)`: a bf16 [M, K] = act_quant's exact q * s in `act_quant.wgmma_k_order`
(`act_quant.act_quant_wgmma`), w a `QuantLinearWeight` (blocks 32 or 128, power-of-two scales up to 2^7:
`usable_weight`), out bf16 [M, N] (S = 1) or fp32 [S, M, N] (S partials, summed in order by the caller).
`plan(m, n, k, sms, config)`: the tiles and the split (`tiles`, `split_k`).
`group_rows=R` (the grouped output LoRA, wo_a at 9..256 tokens): w [G R, K], a [M, G K] = o's bf16 in the same
order (`act_quant_wgmma(o, block, quant=False)`), weight rows of group g multiply a's columns of group g.
The weights' tensor maps are kept (`runtime.cached_tensor_map`); the activation's is encoded per call (one
driver call, ~us; inside a CUDA-graph capture its bytes are part of the captured launch, and the graph's
activation buffer keeps its address at every replay).
Needs compute capability 9.0 exactly (wgmma is sm_90a): `usable(device)`.
Must not: import triton; allocate per-call weights.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime, serial_split
from deepinfer.kernels.cuda.runtime import CudaKernel
from deepinfer.kernels.quant_weights import QuantLinearWeight, check_e4m3_expansion, e4m3_expansion_exact

SOURCE = "fp8_linear_wgmma.cu"
KSTEP = 128  # K per ring stage
MAX_SPLIT = 16
SMEM_BUDGET = 200 * 1024  # of an SM's 227 KB: one CTA an SM, as deep a ring as fits
DEFAULT_TILES = dict(BT=128, CWG=2, STAGES=4, HALVES=0)
_SIGNATURE = "mmpliplliiiplp"  # tensor maps, ws, stride_wsn, block, out, stride_os, stride_om, M, N, k_split,
#                                 fin, stride_fm, counters (the serial split's; 0 otherwise)
_KERNELS: dict[tuple, CudaKernel] = {}


def kernel(cfg: dict, split_out: bool, group_rows: int = 0, serial: bool = False) -> CudaKernel:
    """The kernel for plan `cfg`: fp32 partials out (split_out; serial: also their ordered sum by each tile's
    last split CTA) or bf16 out; group_rows > 0: the grouped form."""
    key = tuple((k, cfg[k]) for k in DEFAULT_TILES) + (("SPLIT_OUT", int(split_out)),)
    if serial:
        key += (("SERIAL_SPLIT", 1),)
    if cfg.get("DIAG"):  # a diagnostic build (the .cu's DIAG: not the GEMM), for benchmarks only
        key += (("DIAG", int(cfg["DIAG"])),)
    if group_rows:
        key += (("GROUP_ROWS", int(group_rows)),)
    if key not in _KERNELS:
        _KERNELS[key] = CudaKernel(SOURCE, "fp8_linear_wgmma", _SIGNATURE, dict(key), arch_suffix="a", pdl=True)
    return _KERNELS[key]


def tile_count(m: int, n: int, cfg: dict) -> int:
    """Output tiles of a launch (BT tokens x rows_per_cta weight rows): the serial split's counters."""
    return -(-m // cfg["BT"]) * -(-n // rows_per_cta(cfg))


def rows_per_cta(cfg: dict) -> int:
    return 64 * cfg["CWG"]


def stage_bytes(bt: int, cwg: int) -> int:
    """Shared memory of one ring stage: the activation boxes (BT x 256 bytes) and the weight box (64 CWG x 128)."""
    return 2 * bt * 128 + 64 * cwg * KSTEP


def smem_bytes(cfg: dict) -> int:
    """Dynamic shared memory of one CTA: the ring, the mbarriers, 1024 bytes of slack to align the swizzle."""
    return cfg["STAGES"] * stage_bytes(cfg["BT"], cfg["CWG"]) + 16 * cfg["STAGES"] + 1024


def token_tile(m: int) -> int:
    """wgmma's N for M tokens: the smallest of 16 / 32 / 64 / 128 that holds them (more take several tiles)."""
    return next(bt for bt in (16, 32, 64, 128) if m <= bt or bt == 128)


def warpgroups(m: int, n: int, k: int) -> int:
    """Consumer warpgroups (64 weight rows each) for M rows of an N x K weight, from the H200 sweep
    (scripts/bench_gemm_kernels.py --batch-wgmma, BENCHMARKS.md): 4 for the tall wq_b (N >= 16384: a CTA
    reads each activation tile for 256 weight rows), 1 for small weights within one token tile (N*K <= 9M:
    more CTAs without splitting K), else 2."""
    if n >= 16384:
        return 4
    if n * k <= 9 << 20 and m <= 128:
        return 1
    return 2


def tiles(m: int, config: dict | None = None, n: int = 0, k: int = 0) -> dict:
    """BT from M (`token_tile`), CWG from the shape (`warpgroups`; 2 without one), STAGES as deep as
    SMEM_BUDGET allows (<= 8), HALVES where CWG is 4 (whole-stage fragment buffers beside 4 warpgroups'
    accumulators would spill); config's keys (BT, CWG, STAGES, HALVES) on top."""
    config = config or {}
    cfg = dict(DEFAULT_TILES, BT=token_tile(m), CWG=warpgroups(m, n, k) if n and k else DEFAULT_TILES["CWG"])
    cfg.update({k: int(v) for k, v in config.items() if k in DEFAULT_TILES or k == "DIAG"})
    if "STAGES" not in config:
        cfg["STAGES"] = max(2, min(8, SMEM_BUDGET // stage_bytes(cfg["BT"], cfg["CWG"])))
    if "HALVES" not in config:
        cfg["HALVES"] = int(cfg["CWG"] == 4)
    if cfg["BT"] not in (16, 32, 64, 128) or cfg["CWG"] not in (1, 2, 4) or cfg["STAGES"] < 2 \
            or cfg["HALVES"] not in (0, 1):
        raise ValueError(f"fp8_linear_wgmma tiles: BT 16/32/64/128, CWG 1/2/4, STAGES >= 2, HALVES 0/1, got {cfg}")
    if cfg.get("DIAG") == 3 and cfg["HALVES"]:
        raise ValueError(f"fp8_linear_wgmma tiles {cfg}: DIAG 3 (the wgmmas alone) needs HALVES 0")
    if cfg["BT"] * (64 * cfg["CWG"] * 4 + 16) > cfg["STAGES"] * stage_bytes(cfg["BT"], cfg["CWG"]):
        raise ValueError(f"fp8_linear_wgmma tiles {cfg}: the epilogue's staging tile (BT x (64 CWG fp32 + 16 "
                         f"bytes)) does not fit in the ring")
    if smem_bytes(cfg) > 227 * 1024:
        raise ValueError(f"fp8_linear_wgmma tiles {cfg} need {smem_bytes(cfg)} bytes of shared memory per CTA "
                         f"(an SM has 227 KB)")
    return cfg


def split_k(m: int, n: int, k: int, cfg: dict, sms: int) -> int:
    """Deterministic split-K count S (a power of 2, at most MAX_SPLIT): double S while the CTAs (token tiles x
    row tiles x S) stay within one per SM (each CTA holds STAGES stages of weights in flight: one a SM is
    enough to stream at the copy rate), every split keeps >= 2 stages (the pipeline), and S divides the
    stages. The fp32 partials (8 S M N bytes written and read) stay in L2 at decode sizes."""
    ctas = -(-m // cfg["BT"]) * -(-n // rows_per_cta(cfg))
    steps = k // KSTEP
    s = 1
    while s * 2 <= MAX_SPLIT and ctas * s * 2 <= sms and steps % (s * 2) == 0 and steps // (s * 2) >= 2:
        s *= 2
    return s


def plan(m: int, n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """`tiles` and SPLIT_K (config's, else `split_k`); ValueError if K cannot be split that way."""
    cfg = tiles(m, config, n, k)
    split = int((config or {}).get("SPLIT_K", 0)) or split_k(m, n, k, cfg, sms)
    why = check_k(k, split)
    if why:
        raise ValueError(f"fp8_linear_wgmma: {why}")
    cfg["SPLIT_K"] = split
    return cfg


def check_k(k: int, split: int) -> str | None:
    """Why K cannot run in `split` splits (None: it can): whole 128-K stages in every split."""
    if split < 1 or k <= 0 or k % (KSTEP * split):
        return f"K={k} must be a positive multiple of {KSTEP} x SPLIT_K ({split})"
    return None


def usable(device: torch.device) -> bool:
    """A CUDA device of compute capability exactly 9.0 (wgmma is sm_90a) with NVRTC and the driver."""
    return runtime.sm90a_usable(device)


def usable_weight(w: QuantLinearWeight) -> bool:
    """The kernel can multiply this weight: blocks of 32 or 128 (one scale a lane and stage), K whole stages,
    power-of-two scales up to 2^7 (checked once per weight: one host sync, before any graph capture)."""
    if w.block not in (32, 128) or w.act_block not in (32, 128) or w.in_features % KSTEP:
        return False
    return e4m3_expansion_exact(w)


def input_problems(a: torch.Tensor, w: QuantLinearWeight, out: torch.Tensor, group_rows: int = 0) -> list[str]:
    """Everything wrong with the inputs (empty: they can run), each naming the argument. group_rows R: w is
    [G R, K] and a [M, G K]."""
    problems = []
    data, scale = w.data, w.scale
    n, k = data.shape
    grouped = group_rows > 0 and n % group_rows == 0
    if group_rows and not grouped:
        problems.append(f"group_rows {group_rows} must divide the weight's {n} rows")
    groups = n // group_rows if grouped else 1
    if a.dtype != torch.bfloat16 or a.dim() != 2 or not a.is_contiguous() or a.shape[1] != groups * k:
        problems.append(f"a must be contiguous bf16 [M, {groups * k}] (act_quant_wgmma's order), got {a.dtype} "
                        f"{tuple(a.shape)}")
    if data.dtype != torch.float8_e4m3fn or not data.is_contiguous() or data.data_ptr() % 16 or k % 16:
        problems.append(f"w.data must be contiguous 16-byte aligned float8_e4m3fn [N, K] (the TMA), got "
                        f"{data.dtype} strides {data.stride()}")
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.stride(1) != 1:
        problems.append(f"w.scale must be fp32 [N/block, K/block] with unit column stride, got {scale.dtype} "
                        f"strides {scale.stride()}")
    if w.block not in (32, 128):
        problems.append(f"w.block must be 32 or 128, got {w.block}")
    m = a.shape[0] if a.dim() == 2 else 0
    want = (m, n)
    if out.dim() == 3:
        if out.dtype != torch.float32 or tuple(out.shape[1:]) != want or out.stride(2) != 1:
            problems.append(f"out must be fp32 [S, {m}, {n}] (partials) or bf16 [{m}, {n}] with unit column "
                            f"stride, got {out.dtype} {tuple(out.shape)}")
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != want or out.stride(-1) != 1:
        problems.append(f"out must be bf16 [{m}, {n}] or fp32 [S, {m}, {n}] (partials) with unit column stride, "
                        f"got {out.dtype} {tuple(out.shape)}")
    if len({t.device for t in (a, data, scale, out)}) != 1:
        problems.append(f"a, w and out must be on one device, got {a.device}, {data.device}, {scale.device}, "
                        f"{out.device}")
    return problems


def fp8_linear_partials(a: torch.Tensor, w: QuantLinearWeight, out: torch.Tensor, cfg: dict,
                        scale_max_exp: int | None = None, group_rows: int = 0, fin: torch.Tensor | None = None,
                        counters: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel with plan `cfg` into `out` (bf16 [M, N] when cfg's SPLIT_K is 1, else fp32
    [SPLIT_K, M, N]) and return it. group_rows R > 0: the grouped form (module docstring); R must be a
    multiple of the plan's weight rows per CTA. fin (with fp32 partials): bf16 [M, N] that each tile's last
    split CTA fills with the ordered sum of the partials, counting in `counters` (int32, >= `tile_count`
    entries, all zero; left zero); returns fin."""
    problems = input_problems(a, w, out, group_rows)
    split = cfg["SPLIT_K"]
    problems += serial_split.problems(out, split, fin, counters, tile_count(out.shape[-2], out.shape[-1], cfg))
    if group_rows and group_rows % rows_per_cta(cfg):
        problems.append(f"group_rows {group_rows} must be a multiple of the plan's {rows_per_cta(cfg)} weight rows "
                        f"per CTA (CWG {cfg['CWG']})")
    if (out.dim() == 3) != (split > 1) or (out.dim() == 3 and out.shape[0] != split):
        problems.append(f"out must be fp32 [{split}, M, N] for SPLIT_K {split} (bf16 [M, N] for 1), got "
                        f"{out.dtype} {tuple(out.shape)}")
    why = check_k(w.in_features, split)
    if why:
        problems.append(why)
    if problems:
        raise ValueError("fp8_linear_wgmma: " + "; ".join(problems))
    check_e4m3_expansion(w, "fp8_linear_wgmma", scale_max_exp)
    m = a.shape[0]
    n, k = w.out_features, w.in_features
    if m == 0 or n == 0:
        return out if fin is None else fin
    bt, rows = cfg["BT"], rows_per_cta(cfg)
    tmap_w = runtime.cached_tensor_map(w.data.view(torch.uint8), (rows, KSTEP), swizzle=128)
    # the activations as bytes [M, 2K] ([M, 2GK] grouped): boxes of BT rows x 128 bytes (64 bf16), 128-byte swizzle
    tmap_a = runtime.encode_tensor_map(a.view(torch.uint8), (bt, 128), swizzle=128)
    grid = (-(-m // bt), -(-n // rows), split)
    kernel(cfg, split > 1, group_rows, fin is not None).launch(
        grid, (128 * cfg["CWG"] + 32, 1, 1),
        (tmap_w, tmap_a, w.scale, w.scale.stride(0), w.block, out, out.stride(0) if out.dim() == 3 else 0,
         out.stride(-2), m, n, k // split, 0 if fin is None else fin, 0 if fin is None else fin.stride(0),
         0 if counters is None else counters),
        a.device, shared=smem_bytes(cfg))
    return out if fin is None else fin
