"""Triton FP8 activation quantisation, bit-identical to `formats.act_quant` (the official `act_quant` with
power-of-two ue8m0 scales): per group of `block` elements of a row, amax floored at 1e-4,
s = 2**ceil(log2(amax * fp32(1/448))) by the exponent-bit trick, q = E4M3_rne(clamp(x / s, +-448)).

Owns: the jit helpers `pow2_scale` / `quantise_rows` (also used inline by the fused FP8 GEMM), `e8m0_to_f32`
(the FP4 expert GEMMs' weight scales) and the
stand-alone kernel: `act_quant(x, block[, perm32]) -> (q fp8 [M, K], s fp32 [M, K/block])` (the MoE; perm32:
the FP8 expert form's column order, `perm32`) and
`act_quant_dequant_bf16(x, block)` -> q * s exactly in bf16 (the large-M FP8 linear).
Must not: be imported without triton (only `kernels.triton` CUDA paths import it).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: the kernels then run on CPU tensors (slow; tests at tiny shapes)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def pow2_scale(amax):
    """(s, 1/s) with s = 2**ceil(log2(amax * fp32(1/448))) for amax already floored (a normal fp32).
    Reads the exponent of the product and adds one when any mantissa bit is set, like the kernels do;
    1/s is built from the exponent too, so x * (1/s) equals x / s exactly."""
    prod = amax * (1.0 / 448.0)
    bits = prod.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exp << 23).to(tl.float32, bitcast=True)
    inv = ((254 - exp) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def e8m0_to_f32(byte):
    """E8M0 scale bytes -> their fp32 value 2**(byte-127) (the exponent field; bytes 1..254 are normal)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantise_rows(x):
    """x fp32 [R, C] (one quantisation group per row) -> (E4M3 [R, C], fp32 scales [R])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    scale, inv = pow2_scale(amax)
    q = tl.clamp(x * inv[:, None], -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return q, scale


def perm32(cols: torch.Tensor) -> torch.Tensor:
    """Stored position of natural column P within its 32-block in the FP8 expert form's operand order
    (kernels/triton/fp4_fp8_gemm.py): L = 16h + 4t + c for P = 8t + 4h + c."""
    return (cols & ~31) | (((cols >> 2) & 1) << 4) | (((cols >> 3) & 3) << 2) | (cols & 3)


@triton.jit
def _perm32(cols):
    """`perm32` in a kernel."""
    return (cols & ~31) | (((cols >> 2) & 1) << 4) | (((cols >> 3) & 3) << 2) | (cols & 3)


@fast_launch
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, K, stride_xm, stride_qm, stride_sm,
                      BLOCK: tl.constexpr, GROUPS: tl.constexpr, DEQUANT: tl.constexpr,
                      PERM32: tl.constexpr = False, PDL: tl.constexpr = False):
    """DEQUANT: write q * s as bf16 (exact: E4M3 x pow2) to q_ptr and no scales; else q (E4M3) and s, the
    code of column P at column perm32(P) when PERM32."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (g < n_groups)[:, None]
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantise_rows(x)
    if DEQUANT:
        tl.store(q_ptr + row * stride_qm + cols, (q.to(tl.float32) * scale[:, None]).to(tl.bfloat16), mask=mask)
    else:
        dest = cols
        if PERM32:
            dest = _perm32(cols)
        tl.store(q_ptr + row * stride_qm + dest, q, mask=mask)
        tl.store(s_ptr + row * stride_sm + g, scale, mask=g < n_groups)


def _launch(x: torch.Tensor, block: int, dequant: bool, perm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"act_quant: x must be [M, K] with K a multiple of {block}, got {tuple(x.shape)}")
    if perm and block % 32:
        raise ValueError(f"act_quant(perm32=True): block {block} must be a multiple of 32")
    x = x.contiguous()
    m, k = x.shape
    n_groups = k // block
    q = torch.empty((m, k), dtype=torch.bfloat16 if dequant else torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 0 if dequant else n_groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    groups = max(1, min(next_power_of_2(n_groups), 4096 // block))
    grid = (m, cdiv(n_groups, groups))
    _act_quant_kernel[grid](x, q, s, n_groups, k, x.stride(0), q.stride(0), max(1, s.stride(0)), BLOCK=block,
                            GROUPS=groups, DEQUANT=dequant, PERM32=perm)
    return q, s


def act_quant(x: torch.Tensor, block: int, perm32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32, CUDA) -> (q float8_e4m3fn [M, K], s fp32 [M, K/block]). perm32: the same codes
    and scales, column P's code stored at column `perm32(P)` (the FP8 expert form's operand order)."""
    return _launch(x, block, dequant=False, perm=perm32)


def act_quant_dequant_bf16(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] -> bf16 [M, K] holding q * s exactly (what an FP8 GEMM multiplies; formats.act_quant_dequant)."""
    return _launch(x, block, dequant=True)[0]


# The wgmma expert GEMM's operand column order (kernels/cuda/fp4_moe_wgmma.cu's header): within each group of
# 128 columns, logical column L = 16s + 8h + 2t + e holds natural column P = 32t + 8(s >> 1) + 2(s & 1) + h + 4e
# (s < 8, t < 4, h, e < 2), so that a lane's 16 contiguous bytes of a packed FP4 weight row feed its A
# fragments of all 8 16-K steps of the group. `wgmma_k_order(L)` = P; `_wgmma_k_order_rows` applies it to a tile.
WGMMA_K_GROUP = 128


def wgmma_k_order(cols: torch.Tensor) -> torch.Tensor:
    """Natural column P held at logical column L (any int tensor of column indices, groups of 128)."""
    low = cols % WGMMA_K_GROUP
    s, h, t, e = low >> 4, (low >> 3) & 1, (low >> 1) & 3, low & 1
    return cols - low + 32 * t + 8 * (s >> 1) + 2 * (s & 1) + h + 4 * e


@triton.jit
def _wgmma_k_order_rows(y, G: tl.constexpr):
    """y [G, 128] in natural column order -> the same values in `wgmma_k_order` (logical column L holds natural
    column P). The order is a permutation of the 7 index bits: P = (t1 t0 s2 s1 e s0 h) -> L = (s2 s1 s0 h t1 t0 e),
    so it is a reshape to 2 x ... x 2, an axis permutation and a reshape back: the compiler moves the values
    through shared memory and the stores stay contiguous (16-byte vectors) instead of 2-byte scatters."""
    y = tl.reshape(y, [G, 2, 2, 2, 2, 2, 2, 2])
    y = tl.permute(y, (0, 3, 4, 6, 7, 1, 2, 5))
    return tl.reshape(y, [G, 128])


@fast_launch
@triton.jit
def _act_quant_gather_kernel(x_ptr, out_ptr, sorted_ptr, block_expert_ptr, n_slots, stride_xm, stride_om,
                             ROW_DIV: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr,
                             QUANT: tl.constexpr, DENSE: tl.constexpr = False, ROWS: tl.constexpr = 1,
                             PDL: tl.constexpr = False):
    """out[p, L] = act_quant's q * s of x[sorted[p] // ROW_DIV, wgmma_k_order(L)] (bf16; QUANT False: x's
    value as bf16), zeros for padding slots; nothing for the rows of unused routing blocks (block_expert -1:
    their GEMM programs exit). DENSE: row p of x itself (no routing: the dense linears' operand; ROWS 1).
    A program writes COLS columns of ROWS consecutive slots (ROWS divides BT: one routing block), so that a
    K that only 256-column programs divide (V4.1-Flash's I = 2304) is not one tiny program per 512 bytes."""
    pdl_enter(PDL)
    p0 = tl.program_id(0) * ROWS
    NB: tl.constexpr = COLS // BLOCK  # quantisation groups of a row's COLS columns
    G: tl.constexpr = COLS // 128  # groups of WGMMA_K_GROUP columns
    ps = p0 + tl.arange(0, ROWS)
    if DENSE:
        valid = ps >= 0  # every row (the grid is M rows, ROWS 1)
        rows = ps.to(tl.int64)
    else:
        if tl.load(block_expert_ptr + p0 // BT) < 0:
            return
        slot = tl.load(sorted_ptr + ps)
        valid = slot < n_slots
        rows = (tl.where(valid, slot, 0) // ROW_DIV).to(tl.int64)
    i = tl.arange(0, ROWS * NB)  # (row r, group g) = (i // NB, i % NB)
    cols = (tl.program_id(1) * COLS + (i % NB) * BLOCK)[:, None] + tl.arange(0, BLOCK)[None, :]
    x_row = tl.reshape(tl.broadcast_to(rows[:, None], (ROWS, NB)), [ROWS * NB])
    x_ok = tl.reshape(tl.broadcast_to(valid[:, None], (ROWS, NB)), [ROWS * NB])
    x = tl.load(x_ptr + x_row[:, None] * stride_xm + cols, mask=x_ok[:, None], other=0.0).to(tl.float32)
    if QUANT:
        q, scale = quantise_rows(x)
        y = (q.to(tl.float32) * scale[:, None]).to(tl.bfloat16)
    else:
        y = x.to(tl.bfloat16)
    y = _wgmma_k_order_rows(tl.reshape(y, [ROWS * G, 128]), ROWS * G)
    j = tl.arange(0, ROWS * G)  # (row r, group g) = (j // G, j % G)
    out_row = tl.reshape(tl.broadcast_to(ps[:, None], (ROWS, G)), [ROWS * G]).to(tl.int64)
    dest = (out_row[:, None] * stride_om + (tl.program_id(1) * COLS + (j % G) * 128)[:, None]
            + tl.arange(0, 128)[None, :])
    tl.store(out_ptr + dest, y)


GATHER_ELEMS, GATHER_WARPS = 8192, 8  # a gather program's values (ROWS slots x COLS columns) and warps: H100
# 2026-12-07 (benchmarks/bench_act_quant_gather.py, the 8k prefill's shapes, the same bits): x [8192, 4096] at
# top-6 398.6 -> 274.9 us (50% -> 73% of the copy rate), h [49152, 2048] 213.6 -> 174.8 us (73% -> 89%) against
# 1024 values and 4 warps (one slot of 1024 columns a program, the rule before); 4096 x 4 within 1%, 16384 no
# better. One 8k prefill's 8 gathers (profiler): 2,516 -> 1,808 us. (The slice's blocks in alternated rounds
# spread by 1.4-6 ms on these H100s, more than the gain: results/run_slice_prefill_gather_*_s38.log)


def act_quant_gather(x: torch.Tensor, block: int, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
                     n_slots: int, row_div: int, bt: int, quant: bool = True, elems: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """The wgmma expert GEMM's activation operand: bf16 [len(sorted_slots), K], row p = act_quant's exact q * s
    of x[sorted_slots[p] // row_div] (zeros for padding slots >= n_slots; rows of unused blocks unwritten),
    columns in `wgmma_k_order` within each 128. x [M, K] bf16/fp32 with K % 128 == 0 and block | 128.
    quant False: x's values as they are (the kernel tests' exact operands). elems / num_warps: a program's
    values (a power of two >= 128) and warps (default DEEPINFER_GATHER_PLAN's, else GATHER_ELEMS /
    GATHER_WARPS; the same bits at any)."""
    if x.dim() != 2 or x.shape[1] % WGMMA_K_GROUP or WGMMA_K_GROUP % block:
        raise ValueError(f"act_quant_gather: x must be [M, K] with K a multiple of {WGMMA_K_GROUP} and block "
                         f"{block} dividing it, got {tuple(x.shape)}")
    if sorted_slots.numel() != block_expert.numel() * bt:
        raise ValueError(f"act_quant_gather: {sorted_slots.numel()} sorted slots for {block_expert.numel()} "
                         f"blocks of {bt}")
    x = x.contiguous()
    k = x.shape[1]
    out = torch.empty((sorted_slots.numel(), k), dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0:
        return out
    plan = env.gather_plan()
    elems = elems or plan.get("elems", GATHER_ELEMS)
    num_warps = num_warps or plan.get("warps", GATHER_WARPS)
    if elems < WGMMA_K_GROUP or elems & (elems - 1):
        raise ValueError(f"act_quant_gather: elems {elems} must be a power of two >= {WGMMA_K_GROUP}")
    # 1024 columns: 16-byte loads and stores (fewer where K is not a multiple; never more than elems)
    cols = next(c for c in (1024, 512, 256, WGMMA_K_GROUP) if k % c == 0 and c <= elems)
    rows = 1  # slots a program: up to elems // cols, a power of two dividing bt (the programs stay in one block)
    while rows * 2 * cols <= elems and bt % (rows * 2) == 0:
        rows *= 2
    _act_quant_gather_kernel[(sorted_slots.numel() // rows, k // cols)](
        x, out, sorted_slots, block_expert, n_slots, x.stride(0), out.stride(0), ROW_DIV=row_div, BT=bt,
        BLOCK=block, COLS=cols, QUANT=quant, ROWS=rows, num_warps=num_warps)
    return out


def act_quant_wgmma(x: torch.Tensor, block: int, quant: bool = True) -> torch.Tensor:
    """The wgmma FP8 linear's activation operand (kernels/cuda/fp8_linear_wgmma.cu): bf16 [M, K], row m =
    act_quant's exact q * s of x[m], columns in `wgmma_k_order` within each 128. x [M, K] bf16/fp32 with
    K % 128 == 0 and block | 128. quant False: x's values as bf16, only reordered (the grouped output LoRA's
    operand: the official einsum multiplies o's bf16 as it is)."""
    if x.dim() != 2 or x.shape[1] % WGMMA_K_GROUP or WGMMA_K_GROUP % block:
        raise ValueError(f"act_quant_wgmma: x must be [M, K] with K a multiple of {WGMMA_K_GROUP} and block "
                         f"{block} dividing it, got {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0:
        return out
    cols = next(c for c in (1024, 512, 256, WGMMA_K_GROUP) if k % c == 0)
    _act_quant_gather_kernel[(m, k // cols)](x, out, x, x, m, x.stride(0), out.stride(0), ROW_DIV=1, BT=1,
                                             BLOCK=block, COLS=cols, QUANT=quant, DENSE=True)
    return out
