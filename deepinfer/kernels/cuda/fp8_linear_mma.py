"""Launcher of `fp8_linear_mma.cu`: op "fp8_linear" at decode (M <= 8 rows per CTA) on mma.sync (see the .cu's header).

`fp8_linear_partials(x, w, out, config=None, scale_max_exp=None)`: x bf16 [M, K] (raw activations: the
official act_quant per w.act_block is fused into the kernel), w a `QuantLinearWeight` (E4M3 [N, K], fp32
pow2 block scales, block 128 or 32). `out` says the form: bf16 [M, N] -> the finished output (one launch:
S = 1, or S = `cluster_split` > 1 splits of K that a thread-block cluster adds up inside the kernel, in the
fixed order of the separate sum: the same bits); fp32 [S, M, N] -> S partial sums over K / S each (split-K:
the caller adds them in a fixed order, e.g. fp8_gemm._split_sum_kernel; this module does not import triton),
or, given `fin` (bf16 [M, N]) and `counters` (int32, zero, one per tile), the tile's last split CTA adds them
in that order into fin inside the same launch (serial split-K: no second kernel; the .cu's SERIAL_SPLIT).
`plan(m, n, k, sms, config)`: tiles (MT, WARPS, STAGES: `DEFAULT_TILES`) and the split count SPLIT_K.
The op wrapper (allocation, plan, the ordered split sum) is fp8_gemm.fp8_linear(..., mma="sync").

The weight expansion is exact for scales up to 2^7 (fp32 exponent field <= SCALE_EXP_MAX = 134) and needs
power-of-two scales: `QuantLinearWeight.scale_exponent_max()` checks both once per weight (one host sync,
cached on the weight); pass `scale_max_exp` to skip it.
Needs sm_90 (mul.rn.bf16x2) or newer. The ops' dispatch (fp8_gemm.py) decides when this form is used.
Launched with programmatic dependent launch (runtime.CudaKernel(pdl=True)): the source reads its first
weight and scale stages before it waits for the previous kernel (ptxas moves the wait above them in the sm_90
build, but another build may not), so w's bytes and scales must not be written by the kernels just before it
in the stream (model weights are written at load time; a test that makes a weight on the GPU must not do it
with one of this package's PDL kernels right before the launch).
Must not: import triton; allocate per-call weights.
"""
from __future__ import annotations

import torch

from deepinfer.kernels.cuda import runtime, serial_split
from deepinfer.kernels.cuda.runtime import CudaKernel
from deepinfer.kernels.quant_weights import E4M3_EXPANSION_EXP_MAX, QuantLinearWeight, check_e4m3_expansion

SOURCE = "fp8_linear_mma.cu"
TOKENS = 8  # rows of x per CTA: the MMA's n8
K_STEP = 128  # K per pipeline stage (each lane: 32 K of 2 weight rows per m16 tile)
MAX_SPLIT = 16
SCALE_EXP_MAX = E4M3_EXPANSION_EXP_MAX  # fp32 exponent field of the largest exact scale (2^7)
DEFAULT_TILES = dict(MT=1, WARPS=8, STAGES=2)  # H200 2026-12-02 (benchmarks/bench_linear_sync.py, HBM-cold
# weights): the V4-Flash layer's seven decode projections 62.3 us at M=1 (MT2 w4 s2 66.1, MT1 w4 s2 66.4, MT4 w4
# s2 69.2, MT2 w4 s4 75.5; the Triton bf16 form 75.8), 65.2 at M=8 (Triton 77.0)
_SIGNATURE = "pliplplplliiiiplp"  # x, stride_xm, M, w, stride_wn, ws, stride_wsn, out, stride_os, stride_om, N,
#                                   k_split, block, act_block, fin, stride_fm, counters (p pointer, l int64, i int32)
MAX_CLUSTER_SPLIT = 16  # the largest (non-portable) thread-block cluster of sm_90
_KERNELS: dict[tuple[int, ...], CudaKernel] = {}


def kernel(mt: int, warps: int, stages: int, split_out: bool, cluster_split: int = 0,
           group_rows: int = 0, serial: bool = False) -> CudaKernel:
    """The kernel for these tiles: fp32 partials out (split_out; serial: also their ordered sum by each tile's
    last split CTA), bf16 out from one CTA per tile (cluster_split 0), or bf16 out from a cluster of
    `cluster_split` split CTAs per tile; group_rows > 0: the grouped output LoRA form (raw bf16 x of the rows'
    group, no act_quant)."""
    key = (mt, warps, stages, int(split_out), cluster_split, group_rows, int(serial))
    if key not in _KERNELS:
        defines = dict(MT=mt, WARPS=warps, STAGES=stages, SPLIT_OUT=int(split_out), SERIAL_SPLIT=int(serial))
        if group_rows:
            defines.update(RAW_ACT=1, GROUP_ROWS=group_rows)
        if cluster_split:
            defines["CLUSTER_SPLIT"] = cluster_split
        _KERNELS[key] = CudaKernel(SOURCE, "fp8_linear_mma", _SIGNATURE, defines,
                                   attributes=runtime.cluster_attributes(cluster_split), pdl=True)
    return _KERNELS[key]


def cluster_fits(m: int, n: int, cfg: dict, device: torch.device, group_rows: int = 0) -> bool:
    """The cluster form of plan `cfg` (its SPLIT_K CTAs of a tile one cluster) can be resident on `device`:
    at least one such cluster fits a GPC at the CTAs' registers and shared memory (asked of the driver once
    per launch shape; a launch that cannot fit would fail, so the op adds the partials separately)."""
    split = cfg["SPLIT_K"]
    k = kernel(cfg["MT"], cfg["WARPS"], cfg["STAGES"], False, split, group_rows)
    grid = (-(-m // TOKENS), -(-n // rows_per_cta(cfg)), split)
    return k.max_active_clusters(grid, (32 * cfg["WARPS"], 1, 1), device) > 0


def tile_count(m: int, n: int, cfg: dict) -> int:
    """Output tiles of a launch (8 rows of x x rows_per_cta weight rows): the serial split's counters."""
    return -(-m // TOKENS) * -(-n // rows_per_cta(cfg))


def tiles(config: dict | None = None) -> dict:
    cfg = dict(DEFAULT_TILES)
    cfg.update({k: int(v) for k, v in (config or {}).items() if k in DEFAULT_TILES})
    return cfg


def rows_per_cta(cfg: dict) -> int:
    return 16 * cfg["MT"] * cfg["WARPS"]


def check_shapes(k: int, split: int, cfg: dict) -> str | None:
    """Why this K and split cannot run (None: they can): each split must be whole pipeline rounds of 128 K."""
    if not 1 <= cfg["STAGES"] <= 8:
        return f"STAGES {cfg['STAGES']} must be 1..8"
    if split < 1 or k % split:
        return f"split {split} must divide K={k}"
    if (k // split) % (K_STEP * cfg["STAGES"]):
        return f"K per split {k // split} must be a multiple of {K_STEP} x STAGES {cfg['STAGES']}"
    return None


def plan(m: int, n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """Tiles (`tiles(config)`) and SPLIT_K: config's, else the largest power of 2 <= MAX_SPLIT reached by
    doubling while the grid (8-row groups x row tiles) times it stays within 4 CTAs per SM and every split
    keeps whole pipeline rounds (K / S a multiple of 128 STAGES; STAGES falls back to 1 unless configured when
    K is not whole rounds of the default). Decode is weight-bandwidth bound: a V4-Flash
    projection gives only 8..256 CTAs of 128 rows, too few to keep enough weight loads in flight."""
    cfg = tiles(config)
    if "STAGES" not in (config or {}) and k % (K_STEP * cfg["STAGES"]):
        cfg["STAGES"] = 1  # K not whole rounds of the default depth: no register double buffering
    grid = -(-m // TOKENS) * -(-n // rows_per_cta(cfg))
    if config and "SPLIT_K" in config:
        split = int(config["SPLIT_K"])
    else:
        split = 1
        while (split * 2 <= MAX_SPLIT and grid * split * 2 <= 4 * sms
               and check_shapes(k, split * 2, cfg) is None):
            split *= 2
    why = check_shapes(k, split, cfg)
    if why:
        raise ValueError(f"fp8_linear_mma: {why}")
    cfg["SPLIT_K"] = split
    return cfg


def fp8_linear_partials(x: torch.Tensor, w: QuantLinearWeight, out: torch.Tensor, config: dict | None = None,
                        scale_max_exp: int | None = None, cluster_split: int = 1,
                        group_rows: int = 0, fin: torch.Tensor | None = None,
                        counters: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel into `out` (bf16 [M, N]: S = cluster_split, added up inside the kernel when > 1;
    fp32 [S, M, N]: S partials) and return it. group_rows R > 0: the grouped output LoRA, x = o bf16 [M, G, K]
    (each token's G groups contiguous) against w [G R, K], its bf16 values as they are (no act_quant).
    fin (with fp32 partials out, S > 1): bf16 [M, N] that each tile's last split CTA fills with the ordered sum
    of the partials, counting in `counters` (int32, >= `tile_count` entries, all zero; left zero); returns fin."""
    cfg = tiles(config)
    problems = []
    data, scale = w.data, w.scale
    n, k = data.shape
    if group_rows:
        if (x.dtype != torch.bfloat16 or x.dim() != 3 or x.stride(-1) != 1 or x.stride(1) != k or x.stride(0) % 8
                or x.shape[1] * group_rows != n or x.shape[2] != k):
            problems.append(f"o must be bf16 [M, G, {k}] with G x {group_rows} = {n} weight rows, each token's groups "
                            f"contiguous and 16-byte aligned, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        if group_rows % rows_per_cta(cfg):
            problems.append(f"group_rows {group_rows} must be whole CTA tiles of {rows_per_cta(cfg)} rows")
    elif x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1 or x.stride(0) % 8:
        problems.append(f"x must be bf16 [M, K] with unit column stride and rows 16-byte aligned, got {x.dtype} "
                        f"{tuple(x.shape)} strides {x.stride()}")
    if data.dtype != torch.float8_e4m3fn or not data.is_contiguous():
        problems.append(f"w.data must be contiguous float8_e4m3fn [N, K], got {data.dtype} strides {data.stride()}")
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.stride(1) != 1:
        problems.append(f"w.scale must be fp32 [N/block, K/block] with unit column stride, got {scale.dtype} "
                        f"strides {scale.stride()}")
    if w.block not in (128, 32):
        problems.append(f"w.block must be 128 or 32, got {w.block}")
    if w.act_block not in (128, 32) or (w.act_block != w.block and w.block % w.act_block):
        problems.append(f"w.act_block must be 128 or 32 and divide the weight block {w.block}, got {w.act_block}")
    if x.dim() == 2 and x.shape[1] != k:
        problems.append(f"x has K={x.shape[1]} but the weight has in_features {k}")
    m = x.shape[0] if x.dim() == (3 if group_rows else 2) else 0
    if out.dim() == 3:
        split = out.shape[0]
        if out.dtype != torch.float32 or tuple(out.shape[1:]) != (m, n) or out.stride(2) != 1:
            problems.append(f"out must be fp32 [S, {m}, {n}] (partials) or bf16 [{m}, {n}] with unit column stride, "
                            f"got {out.dtype} {tuple(out.shape)}")
    else:
        split = cluster_split
        if not 1 <= split <= MAX_CLUSTER_SPLIT:
            problems.append(f"cluster_split must be 1..{MAX_CLUSTER_SPLIT}, got {split}")
        elif split > 1 and (TOKENS * rows_per_cta(cfg)) % split:
            problems.append(f"cluster_split {split} must divide the tile's {TOKENS * rows_per_cta(cfg)} outputs")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(-1) != 1:
            problems.append(f"out must be bf16 [{m}, {n}] or fp32 [S, {m}, {n}] (partials) with unit column stride, "
                            f"got {out.dtype} {tuple(out.shape)}")
    problems += serial_split.problems(out, split, fin, counters, tile_count(m, n, cfg))
    why = check_shapes(k, split, cfg)
    if why:
        problems.append(why)
    if len({t.device for t in (x, data, scale, out)}) != 1:
        problems.append(f"x, w and out must be on one device, got {x.device}, {data.device}, {scale.device}, {out.device}")
    if x.data_ptr() % 16 or data.data_ptr() % 16:
        problems.append("x and w.data must start 16-byte aligned")
    if problems:
        raise ValueError("fp8_linear_partials: " + "; ".join(problems))
    check_e4m3_expansion(w, "fp8_linear_partials", scale_max_exp)
    if x.device.type != "cuda":
        raise ValueError(f"fp8_linear_partials: CUDA tensors only, got {x.device}")
    if m == 0 or n == 0:
        return out if fin is None else fin
    grid = (-(-m // TOKENS), -(-n // rows_per_cta(cfg)), split)
    cluster = split if out.dim() == 2 and split > 1 else 0
    kernel(cfg["MT"], cfg["WARPS"], cfg["STAGES"], out.dim() == 3, cluster, group_rows, fin is not None).launch(
        grid, (32 * cfg["WARPS"], 1, 1),
        (x, x.stride(0), m, data, data.stride(0), scale, scale.stride(0), out,
         out.stride(0) if out.dim() == 3 else 0, out.stride(-2), n, k // split, w.block, w.act_block,
         0 if fin is None else fin, 0 if fin is None else fin.stride(0), 0 if counters is None else counters),
        x.device)
    return out if fin is None else fin
