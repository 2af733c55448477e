"""The official fp4_gemm math on Hopper's FP8 tensor cores, for the routed experts (`fp4_moe`'s "fp8" form).

Owns: `_fp4_fp8_gemm_kernel` (one block of BT routed slots of one expert x BW weight rows) and its launcher
`fp4_fp8_grouped_gemm`. Its activations come from `act_quant(x, block, perm32=True)` (act_quant.py owns the
`perm32` column order).
Math (spec §6.4): per 32-wide K block, the E4M3 activation codes and the weight's E2M1 values as E4M3 (exact)
enter one FP8 tensor-core dot (a fresh fp32 partial), promoted into the fp32 accumulator with the activation
row scale x the weight's per-32 E8M0 scale: C = sum_k32 sa[m, k32 // 4] * sb[n, k32] * dot. With act_block 128
the four partials of a 128-K step are first summed scaled by sb (FFMA), then multiplied by sa once (exact pow2
scalings: only the fp32 summation order differs from adding each promoted partial to C).
Layout (why it is fast): the weights are the dot's LEFT operand (rows on the MMA's M, the step's tokens on
N, so a few tokens per expert waste no MMA rows and the weights never go through shared memory as E4M3).
Each thread of an FP8 MMA holds, per row, K groups {4t..4t+3} and {16+4t..16+4t+3} of a 32-K block, one
register each; one 32-bit word of the checkpoint's packed FP4 (8 codes, low nibble first) feeds exactly
those two registers if logical K position L = 16h + 4t + c carries stored code 8t + 4h + c (`perm32`). The
weights stay in the checkpoint's bytes; the ACTIVATIONS are stored in that permuted column order instead
(act_quant's `perm32` option: a different store address, the same codes and scales), so both operands agree and
the dot is unchanged. A word becomes its two E4M3 registers by byte permutes (PTX prmt) on a constant
8-entry table of the E2M1 magnitudes, plus the sign bits: ~15 integer instructions per 8 weights in the SASS
(expand 6's bf16 form: ~24).
Error: the products are exact; Hopper's FP8 MMA sums the 32 products of one dot with reduced precision
(the official kernel's own arithmetic on this hardware); everything after is fp32. Against the twin on the
H200 (2026-12-02): rel_err 1.4e-3 at V4-Flash dims (the bf16 forms: ~1e-4), as expand 3 (same math).
Speed (H200 2026-12-02, benchmarks/bench_fp4_moe.py --fp8, results/fp4_moe_fp8_form_h200_2026-12-02.log):
NOT faster than the default bf16 form (v2 plan, expand 6): T=1 94 vs 75 us, T=8 479 vs 351 us, T=32 1347 vs
877 us, T=128 2354 vs 1489 us, T=2048 5.3 vs 2.8 ms (expand 3, the same math in the older kernel: T=1 127 us,
T=128 3.6 ms). Its K step has 18% fewer instructions than expand 6's (sm_90 SASS, scripts/sass_sm90.py: 510
vs 621 per thread), but each 32-K partial is a separate wgmma that must complete before its promotion:
four waits per 128 K, which Triton 3.6 issues back to back (no second accumulator in flight), so the
latency is exposed; and the large (prefill) tiles run out of registers (a second accumulator and the
partial: 255 registers, spills at BT=128). Kept as the tested official-math form, not the default.
Must not: be imported without triton; know about routing (the caller passes sorted slots and blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.act_quant import e8m0_to_f32, interpreting
from deepinfer.kernels.triton.expert_tile import expert_rows, swiglu_bf16
from deepinfer.kernels.triton.launch import cdiv, fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter

_ASM = tl.constexpr(not interpreting())  # PTX prmt only on the GPU; the interpreter takes the tl twin below
K_STEP = 128  # K per loop step: four 32-K dots (one per E8M0 weight scale)
KSTEP = tl.constexpr(K_STEP)


@triton.jit
def _fp4_e4m3_halves(packed, ASM: tl.constexpr):
    """uint8 [R, C] (C % 4 == 0: each 4 bytes one word of 8 E2M1 codes, low nibble first) -> two E4M3 [R, C]:
    lo[.., 4i + c] = code c of word i, hi[.., 4i + c] = code 4 + c (c = 0..3), the E2M1 values exactly.
    GPU: per word, prmt selects each 3-bit magnitude's byte from the table (0x3C383000: the E4M3 bytes of
    0, 0.5, 1, 1.5; 0x4C484440: of 2, 3, 4, 6), the sign bits are moved to bit 7 of their bytes (the half's
    two bytes spread by prmt, then a 4-bit shift for the even codes)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            """{
            .reg .b32 m, v, y, a, t, w, tlo;
            mov.b32 tlo, 0x3C383000;
            and.b32 m, $2, 0x7777;
            prmt.b32 v, tlo, 0x4C484440, m;
            prmt.b32 y, $2, 0, 0x1100;
            shl.b32 a, y, 4;
            lop3.b32 t, a, 0x00800080, v, 0xEA;
            lop3.b32 $0, y, 0x80008000, t, 0xEA;
            shr.b32 w, $2, 16;
            and.b32 m, w, 0x7777;
            prmt.b32 v, tlo, 0x4C484440, m;
            prmt.b32 y, $2, 0, 0x3322;
            shl.b32 a, y, 4;
            lop3.b32 t, a, 0x00800080, v, 0xEA;
            lop3.b32 $1, y, 0x80008000, t, 0xEA;
            }""",
            "=r,=r,r", [packed], dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
        return lo, hi
    R: tl.constexpr = packed.shape[0]
    C: tl.constexpr = packed.shape[1]
    b = tl.reshape(packed, (R, C // 4, 2, 2)).to(tl.int32)
    codes = tl.interleave(b & 0xF, b >> 4)  # [R, word, half, c]
    mag = codes & 7
    e = mag >> 1
    # E2M1 as E4M3: 0.5 -> exponent field 6; e >= 1 -> field e + 6, mantissa bit m at bit 2; sign to bit 7
    bits = tl.where(mag == 0, 0, tl.where(e == 0, 0x30, ((e + 6) << 3) | ((mag & 1) << 2))) | ((codes & 8) << 4)
    lo, hi = tl.split(tl.permute(bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True), (0, 1, 3, 2)))
    return tl.reshape(lo, (R, C)), tl.reshape(hi, (R, C))


@triton.jit
def _k32_tile(packed, ASM: tl.constexpr):
    """uint8 [R, 16] (one 32-K block of R weight rows) -> E4M3 [R, 32] in `perm32` order: position 16h + 4t + c
    holds code 8t + 4h + c (word t's half h). Register-local: a thread's word lands in its own registers."""
    R: tl.constexpr = packed.shape[0]
    lo, hi = _fp4_e4m3_halves(packed, ASM)
    j = tl.join(tl.reshape(lo, (R, 4, 4)), tl.reshape(hi, (R, 4, 4)))  # [R, t, c, h]
    return tl.reshape(tl.permute(j, (0, 3, 1, 2)), (R, 32))


@triton.jit
def _k32_dot(w_ptrs, ws_ptrs, a_ptrs, k, n_ok, valid, ASM: tl.constexpr):
    """One 32-K block: (fresh fp32 partial [BW, BT] of the E4M3 dot, the rows' weight scales fp32 [BW])."""
    w = _k32_tile(tl.load(w_ptrs + k // 2, mask=n_ok[:, None], other=0), ASM)
    a = tl.load(a_ptrs + k, mask=valid[None, :], other=0.0)
    part = tl.dot(w, a)
    sw = e8m0_to_f32(tl.load(ws_ptrs + k // 32, mask=n_ok, other=0))
    return part, sw


@fast_launch
@triton.jit
def _fp4_fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, route_w_ptr, sorted_slots_ptr, block_expert_ptr,
                         n_slots, N, limit, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                         stride_om, stride_os,
                         K_SPLIT: tl.constexpr, A_ROW_DIV: tl.constexpr, ACT_BLOCK: tl.constexpr,
                         GATED: tl.constexpr, SPLIT_OUT: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
                         STEP_SUM: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token block, weight tile, split): BT slots of one expert (row = slot // A_ROW_DIV of the
    `perm32`-ordered E4M3 activations a, fp32 scales as per ACT_BLOCK) x BW weight rows (GATED: BW/2 gate
    rows n0.. and the matching BW/2 up rows N + n0.., one tile), K range [split * K_SPLIT, +K_SPLIT).
    Outputs as `_fp4_gemm_v2_kernel`: SPLIT_OUT the fp32 partial at out[split, slot, n]; GATED bf16(w *
    silu(gate) * up) with the official bf16 roundings of gate/up; else bf16 rows. STEP_SUM (act_block 128):
    the four partials of a step summed scaled by sb, then times sa (5 instead of 8 fp32 ops per output and
    step, one more accumulator's registers)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots, valid, rows, col, w_row, n_ok, k_lo = expert_rows(sorted_slots_ptr, n_slots, N, pid_m, pid_n, A_ROW_DIV,
                                                             GATED, SPLIT_OUT, K_SPLIT, BT, BW)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_row[:, None].to(tl.int64) * stride_wn \
        + tl.arange(0, 16)[None, :]
    ws_ptrs = ws_ptr + expert.to(tl.int64) * stride_wse + w_row.to(tl.int64) * stride_wsn
    a_ptrs = a_ptr + rows[None, :] * stride_am + tl.arange(0, 32)[:, None]  # [32, BT]: K-major B operand
    as_ptrs = as_ptr + rows * stride_asm
    acc = tl.zeros((BW, BT), dtype=tl.float32)
    for k_step in range(0, K_SPLIT, KSTEP):  # constant trip count (k_lo is added to the offsets)
        k0 = k_lo + k_step
        if STEP_SUM and ACT_BLOCK == KSTEP:  # one activation scale per step: sum the sb-scaled partials first
            part, sw = _k32_dot(w_ptrs, ws_ptrs, a_ptrs, k0, n_ok, valid, ASM)
            step = part * sw[:, None]
            for q in tl.static_range(1, KSTEP // 32):
                part, sw = _k32_dot(w_ptrs, ws_ptrs, a_ptrs, k0 + 32 * q, n_ok, valid, ASM)
                step += part * sw[:, None]
            sa = tl.load(as_ptrs + k0 // ACT_BLOCK, mask=valid, other=0.0)
            acc += step * sa[None, :]
        else:  # promote every partial with its sa x sb (V4.1's 32-wide activation blocks; large tiles, whose
            # step sum would be a second accumulator's registers)
            for q in tl.static_range(KSTEP // 32):
                part, sw = _k32_dot(w_ptrs, ws_ptrs, a_ptrs, k0 + 32 * q, n_ok, valid, ASM)
                sa = tl.load(as_ptrs + (k0 + 32 * q) // ACT_BLOCK, mask=valid, other=0.0)
                acc += (part * sw[:, None]) * sa[None, :]
    if SPLIT_OUT:
        ptrs = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + slots[None, :].to(tl.int64) * stride_om \
            + col[:, None]
        tl.store(ptrs, acc, mask=n_ok[:, None] & valid[None, :])
    elif GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BW // 2, BT)), (1, 2, 0)))
        h = swiglu_bf16(gate, up, limit)
        route_w = tl.load(route_w_ptr + slots, mask=valid, other=0.0)
        h = route_w[None, :] * h
        cols = pid_n * (BW // 2) + tl.arange(0, BW // 2)
        ptrs = out_ptr + slots[None, :].to(tl.int64) * stride_om + cols[:, None]
        tl.store(ptrs, h.to(tl.bfloat16), mask=(cols < N)[:, None] & valid[None, :])
    else:
        ptrs = out_ptr + slots[None, :].to(tl.int64) * stride_om + col[:, None]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=n_ok[:, None] & valid[None, :])


def step_sum(bw: int, bt: int, num_warps: int) -> bool:
    """Sum a step's partials in a second accumulator while it stays small (<= 32 fp32 per thread): decode
    tiles; the prefill tiles' 64+ per thread would spill (sm_90 SASS: BT=128 BW=128 8 warps, 121 LDL)."""
    return bw * bt // (32 * num_warps) <= 32


def fp4_fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         out: torch.Tensor, route_w: torch.Tensor, sorted_slots: torch.Tensor,
                         block_expert: torch.Tensor, n_slots: int, n: int, limit: float, a_row_div: int,
                         act_block: int, gated: bool, split: int, cfg: dict) -> None:
    """Launch `_fp4_fp8_gemm_kernel`: a E4M3 [rows, K] in `perm32` column order with fp32 scales [rows,
    K/act_block], w uint8 [E, (2 if gated) n, K/2] + E8M0 [E, .., K/32] (the checkpoint's packing), out as
    the kernel says (split > 1: fp32 [split, slots, n]). cfg: BT (= the routing block), BW, num_warps,
    num_stages."""
    k = a.shape[1]
    if k % (K_STEP * split) or K_STEP % act_block:
        raise ValueError(f"fp4_fp8_grouped_gemm: K={k} must split into {split} ranges of {K_STEP}-wide steps "
                         f"and act_block {act_block} must divide {K_STEP}")
    bw = cfg["BW"]
    grid = (block_expert.numel(), cdiv(n, bw // 2 if gated else bw), split)
    stride_os = out.stride(0) if split > 1 else 0
    stride_om = out.stride(1) if split > 1 else out.stride(0)
    _fp4_fp8_gemm_kernel[grid](
        a, a_scale, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, n, float(limit), a.stride(0),
        a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), stride_om, stride_os,
        K_SPLIT=k // split, A_ROW_DIV=a_row_div, ACT_BLOCK=act_block, GATED=gated, SPLIT_OUT=split > 1,
        BT=cfg["BT"], BW=bw, STEP_SUM=cfg.get("STEP_SUM", step_sum(bw, cfg["BT"], cfg["num_warps"])), ASM=_ASM,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
