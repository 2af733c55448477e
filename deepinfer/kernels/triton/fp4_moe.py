"""Triton op "fp4_moe": the routed experts of one MoE layer with the weights kept packed in FP4 on the GPU.

fp4_moe(x bf16 [T, D], topk_ids [T, k], topk_weights fp32 [T, k], bank: FP4ExpertBank, swiglu_limit)
-> fp32 [T, D] = sum over each token's k experts (ascending expert id, like the official loop) of the
official expert: gate/up = fp4_gemm(act_quant(x)) -> bf16; fp32 clamp, silu(gate) * up * routing weight
-> bf16 -> act_quant -> w2 fp4_gemm -> bf16. Stages:
1. routing: slots (t*k + j) sorted by expert into blocks of BM rows, each block one expert
   (`route_slots`: `align_by_expert`, torch on the device, no host sync; on CUDA up to
   PARALLEL_ROUTING_SLOTS slots one launch with the same outputs: `align_by_expert_small` (one program,
   up to 8 slots), else `align_by_expert_parallel` (one program per expert): 6-9 us per call from b1 to
   b128 on the H200, where the torch path's sort and ~19 launches take 48-75 us);
2. act_quant(x) once (a token's row is shared by its k experts);
3. grouped GEMM w13 with the SwiGLU epilogue -> h bf16 [T*k, I];
4. act_quant(h); grouped GEMM w2 -> bf16 [T*k, D];
5. per-token fp32 sum of its k rows in ascending expert order (bit-identical to the twin's accumulation).
FP4 expansion inside the GEMM: each byte's two E2M1 codes (low nibble = even K) become their values times
the per-32 E8M0 scale, exact in bf16 (like the activation's E4M3 x pow2 scale), so the tensor cores form
exact products and accumulate them in fp32: the official fp4_gemm math (per-32 scaled FP8 partial sums)
up to fp32 summation order, with the expert weights exact (no per-128 requantisation). The expansion is
the GEMMs' main cost (integer ops per weight element), so it has variants (`EXPANSIONS`, all tested against
the twin); H200 2026-11-29, one run, V4-Flash dims, decode T=1 as CUDA-graph replay of the whole op:
  0 fp32 bit assembly per code 168 us; 1 fp16 bit trick 114 us (T=128 3.0 ms, T=8192 16.2 ms = 153
  TFLOP/s; variant 0 measured 5.2 / 20.1 ms in the run of 190d767); 2 tl.dot_scaled 143 us (T=128 4.1 ms,
  T=8192 19.2 ms).
  Default: 1. Narrower decode tiles (BN=32) were slower (227-239 us).
  3 (H200, 2026-12-01, benchmarks/bench_fp4_moe.py; removed 2026-12-02): E4M3 codes by byte ops and FP8
  tensor-core dots of 32 K, each promoted into fp32 with scale_a x scale_w = the official fp4_gemm's own
  Hopper math. Slower than 1 everywhere: T=1 127 vs 113 us, T=128 3.6 vs 2.9 ms, T=8192 68 vs 16 ms (every
  32 of K the dot must finish before `acc +=`, which serialises the wgmma pipeline; Triton 3.6 has no
  warp-specialised ping-pong to hide it). Superseded by the FP8 form (`kernels/triton/fp4_fp8_gemm.py`,
  config FP8: the same math, faster) and removed with its tests (git history: 659a7a8).
  Also tried and dropped the same day: expanding the packed tile where it was loaded (low / high nibbles
  into two bf16 tiles, even- and odd-K activation columns, two dots per step, no interleave): 1.3x slower
  at T=1 and 5x at T=8192 (the strided activation loads and doubled dots cost more than the interleave).
  v2 path (`_fp4_moe_v2`, selected by a config with any of `V2_KEYS`, and by default up to 16 slots per expert
  as `DECODE_V2`; -m gpu tests passed on the H200, 2026-12-01): split-K for few tokens (fp32 partials [S, slots, N] + fixed-order
  reduce kernels: w13's fuses the SwiGLU epilogue and act_quant(h), w2's fuses the k-row sum; rule
  `split_k`), bf16 activations pre-dequantised once (A_BF16), one gate+up weight tile per program, and the
  k-row order computed in the sum kernel (no argsort launch); expand 5 (the fp16 trick by two 32-bit
  multiplies per byte). Static sm_90 SASS of one K step (BM=16, 64 weight columns, 4 warps; compiled on CPU
  with the launcher's divisibility hints): default kernel 756 instructions per thread, v2 fp8 act 745, v2
  bf16 act 603, v2 bf16 act + expand 5 469 (the default's activation dequant is replicated in each warp's
  dot operand: ~190 of its 756). benchmarks/bench_fp4_moe.py --variants, H200 2026-12-01 (graph replay of the
  whole op, V4-Flash dims): bf16 activations + expand 5 1.27-1.44x over the old default at T=1..128 (T=128
  2.71 -> 1.93 ms); split-K only matters at T=1 (S=4..8: 86 vs 96 us unsplit); the one gate+up tile with
  FP8 activations 1.03-1.08x; 8 warps slower (results/fp4_moe_variants_h200.log).
  Expand 6 (H200 2026-12-01, results/fp4_moe_variants_h200_e6.log): the byte's two codes as bf16 bit
  patterns in one word, scaled by one PTX mul.rn.bf16x2 (no fp16 -> fp32 -> x scale -> bf16 per code):
  1.14-1.26x over expand 5 in the decode plan (T=1 74.8 us, T=128 1.55 ms = 2.14 TB/s). Exact for scale
  bytes up to 128 (scale 2; the checkpoints' are ~2**-8), so the default takes it when the bank's
  `scale_max` allows and expand 5 otherwise. Default since then: the v2 path in every regime
  (`DECODE_V2`, `PREFILL_V2`), the kernel below only with an explicit expand or config.
Prefill (above `WGMMA_SLOTS_PER_EXPERT` = 10 slots per expert; 16 until 2026-12-06) on sm_90 runs the wgmma form
(kernels/cuda/fp4_moe_wgmma.cu, `_fp4_moe_wgmma`, `PREFILL_FORM`): T=8192 6.5 ms against this module's v2
plan's 8.8 (H200 2026-12-02 s8).
Must not: be imported without triton; know about gates, hash routing or the shared expert (the caller's).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.quant_weights import FP4ExpertBank, PreRouted, check_routing, check_shared, fp4_moe_torch
from deepinfer.kernels.triton.act_quant import (_perm32, act_quant, act_quant_dequant_bf16, act_quant_gather,
                                               e8m0_to_f32, interpreting, quantise_rows)
from deepinfer.kernels.triton.expert_tile import expert_rows, swiglu_bf16
from deepinfer.kernels.triton.fp4_fp8_gemm import fp4_fp8_grouped_gemm
from deepinfer.kernels.triton.fp8_gemm import sm_count  # SMs per device (cached there)
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

_ASM = tl.constexpr(not interpreting())  # inline PTX (expand 6) only on the GPU: the interpreter runs no asm
FP4_BLOCK = tl.constexpr(32)  # K values per E8M0 weight scale, and per promotion of the fp32 partial sum
# FP4 -> bf16 expansion inside the GEMM (the same exact operand values; only the instruction count differs)
EXPANSIONS = {0: "fp32 bit assembly per code", 1: "fp16 bit trick (4 int ops per byte)",
              2: "tl.dot_scaled (Triton's microscaling dot, upcast to bf16 on Hopper)",
              5: "fp16 bit trick, both codes of a byte in one 32-bit word by two multiplies (fewer int ops)",
              6: "bf16 bit patterns of both codes in one word, times the scale by one bf16x2 multiply"}
DEFAULT_EXPAND = 1
EXPAND6_SCALE_MAX = 128  # expand 6's multiplier 2**(S-1) must be a normal bf16: S + 126 <= 254


# ----------------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------------
def n_routing_blocks(n_slots: int, n_experts: int, block_m: int) -> int:
    """The routing's block count from the shapes alone (no device read): sum_e ceil(c_e / BM) <= S // BM +
    min(E, S), and <= S."""
    return max(1, min(n_slots, n_slots // block_m + min(n_experts, n_slots)))


def align_by_expert(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots (t*k + j) grouped by expert into blocks of `block_m` rows (vLLM's moe_align_block_size).

    Returns sorted_slots int32 [n_blocks * block_m] (padding = T*k) and block_expert int32 [n_blocks]
    (-1 for blocks past the last expert's). n_blocks is an upper bound computed from the shapes alone,
    so nothing waits on the device (no bincount, no .item(): CUDA-graph capturable):
    sum_e ceil(c_e / BM) <= S // BM + min(E, S), and <= S. Few torch ops on purpose: at decode each one's
    host launch cost is most of this function's time."""
    flat = topk_ids.reshape(-1)
    n_slots = flat.numel()
    n_blocks = n_routing_blocks(n_slots, n_experts, block_m)
    sorted_expert, order = torch.sort(flat, stable=True)
    # count_start[e] = first sorted position of expert e; count_start[E] = S
    count_start = torch.searchsorted(sorted_expert, torch.arange(n_experts + 1, device=flat.device, dtype=flat.dtype))
    padded = (count_start[1:] - count_start[:-1] + (block_m - 1)).div_(block_m, rounding_mode="floor").mul_(block_m)
    padded_end = padded.cumsum(0)
    # slot at sorted position i of expert e goes to padded_start[e] + (i - count_start[e])
    shift = padded_end - padded - count_start[:-1]
    dest = shift[sorted_expert] + torch.arange(n_slots, device=flat.device)
    sorted_slots = torch.full((n_blocks * block_m,), n_slots, dtype=torch.int32, device=flat.device)
    sorted_slots[dest] = order.to(torch.int32)
    block_start = torch.arange(0, n_blocks * block_m, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # E past the last expert's blocks
    return sorted_slots, block_expert.masked_fill_(block_expert >= n_experts, -1).to(torch.int32)


SMALL_ROUTING_SLOTS = 64  # up to this many slots (T * k) `align_by_expert_small` can route (one program)
ONE_PROGRAM_ROUTING_SLOTS = 8  # and route_slots takes it up to this many: 6 slots 6.3 us vs the per-expert
# kernel's 6.9; 48 slots 10.1 vs 7.0 (H200, results/routing_h200_2026-12-02_s4.log)


@triton.jit
def align_small(ids_ptr, sorted_ptr, block_expert_ptr, n_slots, n_blocks, E: tl.constexpr, BM: tl.constexpr,
                SP: tl.constexpr, EP: tl.constexpr, NBP: tl.constexpr, TP: tl.constexpr, CACHE: tl.constexpr):
    """`align_by_expert` in one program over the n_slots <= SP expert ids at ids_ptr: slot i goes to
    padded_start[e_i] + (number of earlier slots of expert e_i), the stable sort's order. Also the last stage
    of the MoE's fused decode route (moe_route.py), which reads the ids its own program just wrote (CACHE)."""
    i = tl.arange(0, SP)
    ok = i < n_slots
    ids = tl.load(ids_ptr + i, mask=ok, other=EP, cache_modifier=CACHE).to(tl.int32)  # EP: matches no expert
    e = tl.arange(0, EP)
    onehot = ids[:, None] == e[None, :]  # [SP, EP]
    padded = (tl.sum(onehot.to(tl.int32), axis=0) + (BM - 1)) // BM * BM
    padded_end = tl.cumsum(padded, axis=0)
    start = tl.sum(tl.where(onehot, (padded_end - padded)[None, :], 0), axis=1)  # [SP] its expert's start
    earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    dest = start + tl.sum(earlier.to(tl.int32), axis=1)
    p = tl.arange(0, TP)
    tl.store(sorted_ptr + p, tl.full((TP,), 0, tl.int32) + n_slots, mask=p < n_blocks * BM)  # padding
    tl.debug_barrier()  # the padding lands before the slots overwrite their places
    tl.store(sorted_ptr + dest, i, mask=ok)
    b = tl.arange(0, NBP)
    owner = tl.sum((padded_end[None, :] <= (b * BM)[:, None]).to(tl.int32), axis=1)  # searchsorted, right
    tl.store(block_expert_ptr + b, tl.where(owner >= E, -1, owner), mask=b < n_blocks)


@fast_launch
@triton.jit
def _align_small_kernel(ids_ptr, sorted_ptr, block_expert_ptr, n_slots, n_blocks, E: tl.constexpr,
                        BM: tl.constexpr, SP: tl.constexpr, EP: tl.constexpr, NBP: tl.constexpr, TP: tl.constexpr,
                        PDL: tl.constexpr = False):
    """`align_by_expert` in one program (decode: its ~19 torch launches cost more host time than the GEMMs)."""
    pdl_enter(PDL)
    align_small(ids_ptr, sorted_ptr, block_expert_ptr, n_slots, n_blocks, E, BM, SP, EP, NBP, TP, "")


def align_small_sizes(n_slots: int, n_experts: int, n_blocks: int, block_m: int) -> dict:
    """`align_small`'s block sizes for n_slots slots of n_experts experts in n_blocks blocks of block_m."""
    return dict(SP=max(16, next_power_of_2(n_slots)), EP=next_power_of_2(n_experts),
                NBP=max(16, next_power_of_2(n_blocks)), TP=next_power_of_2(n_blocks * block_m))


PARALLEL_ROUTING_SLOTS = 24576  # up to this many slots the one-program-per-expert kernel below: H200 2026-12-02
# (benchmarks/bench_routing.py, graph replay, E=256; results/routing_h200_2026-12-02_s4.log): 48 slots 7.0 us
# (the one-program kernel 10.1), 192 7.5 (the chunked one-program kernel it replaced: 30.8, torch 69.4), 768 8.9
# (torch 75.1), 12288 62 (torch 126); at 49152 (an 8k prefill) 252 against torch's 122: each program reads
# every slot twice
PARALLEL_CHUNK = 1024  # slots per pass of each program
PARALLEL_ROUTING_WORK = 256 * 18432  # and while experts x slots stays within this: its programs each read every
# slot, so its time grows with E x S while the torch sort's stays ~120 us. H100 2026-12-06 (graph replay,
# results/bench_routing_h100_2026-12-06_s30.log): E=256 18432 slots 113 us (torch 120), 24576 122 (119);
# E=384 (V4.1) 12288 76 (131), 18432 146 (122), 24576 146 (121)


@fast_launch
@triton.jit
def _align_per_expert_kernel(ids_ptr, sorted_ptr, block_expert_ptr, n_slots, n_blocks, E: tl.constexpr,
                             BM: tl.constexpr, CH: tl.constexpr, EB: tl.constexpr, PB: tl.constexpr,
                             N_CH: tl.constexpr, N_BL: tl.constexpr, N_TAIL_BL: tl.constexpr,
                             N_TAIL: tl.constexpr, PDL: tl.constexpr = False):
    """`align_by_expert` with one program per expert e (grid (E,)), no sort and no atomics: every output
    position is written by exactly one program. Each program histograms all slots (the padded starts of
    every expert come from the counts alone), then walks the slots in order and places its own expert's at
    start[e] + (earlier slots of e): the stable sort's order. It pads its last block with n_slots and names
    its blocks; the last program also fills the blocks past the last expert's (-1) and their slots.
    EB: histogram bins (> E: bin E takes the masked tail). N_CH, N_BL, N_TAIL_BL, N_TAIL: compile-time loop
    counts (powers of two covering the slots in chunks of CH, an expert's blocks and the tail's blocks in
    chunks of PB, the tail's slots in chunks of CH; masked past the end: the interpreter's range() over a
    run-time bound fails with numpy >= 2.4). The tail is at most min(E, S) blocks: every expert's padded
    total is >= S, and n_blocks <= S // BM + min(E, S)."""
    pdl_enter(PDL)
    e = tl.program_id(0)
    j = tl.arange(0, CH)
    bins = tl.arange(0, EB)
    counts = tl.zeros((EB,), tl.int32)
    for c in range(0, N_CH):
        i = c * CH + j
        ids = tl.load(ids_ptr + i, mask=i < n_slots, other=E).to(tl.int32)  # bin E: past the slots
        counts += tl.histogram(ids, EB)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + (BM - 1)) // BM * BM
    padded_end = tl.cumsum(padded, axis=0)
    start = tl.sum(tl.where(bins == e, padded_end - padded, 0), axis=0)
    count = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    end = tl.sum(tl.where(bins == e, padded_end, 0), axis=0)
    seen = count * 0
    for c in range(0, N_CH):
        i = c * CH + j
        mine = tl.load(ids_ptr + i, mask=i < n_slots, other=E).to(tl.int32) == e
        rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(sorted_ptr + start + seen + rank, i, mask=mine)
        seen += tl.sum(mine.to(tl.int32), axis=0)
    r = tl.arange(0, BM)
    tl.store(sorted_ptr + start + count + r, tl.full((BM,), 0, tl.int32) + n_slots, mask=start + count + r < end)
    pb = tl.arange(0, PB)
    for c in range(0, N_BL):
        b = start // BM + c * PB + pb
        tl.store(block_expert_ptr + b, tl.full((PB,), 0, tl.int32) + e, mask=b < end // BM)
    if e == E - 1:  # past the last expert's blocks (end = every expert's padded total): -1, slots n_slots
        for c in range(0, N_TAIL_BL):
            b = end // BM + c * PB + pb
            tl.store(block_expert_ptr + b, tl.full((PB,), -1, tl.int32), mask=b < n_blocks)
        for c in range(0, N_TAIL):
            p = end + c * CH + j
            tl.store(sorted_ptr + p, tl.full((CH,), 0, tl.int32) + n_slots, mask=p < n_blocks * BM)


def align_by_expert_parallel(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s exact outputs in one launch of one program per expert, for 1..PARALLEL_ROUTING_SLOTS
    slots."""
    flat, n_slots, n_blocks, sorted_slots, block_expert = _routing_outputs(
        "align_by_expert_parallel", topk_ids, n_experts, block_m, PARALLEL_ROUTING_SLOTS)
    pb = 64
    ch = min(PARALLEL_CHUNK, max(16, next_power_of_2(n_slots)))
    # an expert owns at most ceil(S / BM) blocks; the tail past the last expert's at most min(E, S)
    tail = min(n_experts, n_slots)
    _align_per_expert_kernel[(n_experts,)](
        flat, sorted_slots, block_expert, n_slots, n_blocks, E=n_experts, BM=block_m, CH=ch,
        EB=next_power_of_2(n_experts + 1), PB=pb, N_CH=next_power_of_2(cdiv(n_slots, ch)),
        N_BL=next_power_of_2(cdiv(cdiv(n_slots, block_m), pb)),
        N_TAIL_BL=next_power_of_2(cdiv(tail, pb)),
        N_TAIL=next_power_of_2(cdiv(tail * block_m, ch)), num_warps=4)
    return sorted_slots, block_expert


def _routing_outputs(name: str, topk_ids: torch.Tensor, n_experts: int, block_m: int, max_slots: int):
    """A one-program routing kernel's flat ids, slot and block counts and empty outputs (sorted_slots,
    block_expert) sized as `align_by_expert`'s; 1..max_slots slots, else ValueError."""
    flat = topk_ids.reshape(-1).contiguous()
    n_slots = flat.numel()
    if n_slots > max_slots or n_slots == 0:
        raise ValueError(f"{name}: 1..{max_slots} slots, got {n_slots}")
    n_blocks = n_routing_blocks(n_slots, n_experts, block_m)
    sorted_slots = torch.empty(n_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=flat.device)
    return flat, n_slots, n_blocks, sorted_slots, block_expert


def check_pre_routed(routed: PreRouted, x: torch.Tensor, n_slots: int, n_experts: int) -> None:
    """A `PreRouted` fits the call: its blocks sized as `align_by_expert`'s for n_slots slots of n_experts
    experts, its activations x's shape (ValueError otherwise; the contents are the maker's promise)."""
    n_blocks = n_routing_blocks(n_slots, n_experts, routed.block_m)
    if (routed.sorted_slots.numel() != n_blocks * routed.block_m or routed.block_expert.numel() != n_blocks
            or routed.xa.shape != x.shape or routed.xa.dtype != torch.bfloat16):
        raise ValueError(f"fp4_moe: routed made for another call: {routed.block_expert.numel()} blocks and xa "
                         f"{routed.xa.dtype} {tuple(routed.xa.shape)}, want {n_blocks} blocks of {routed.block_m} "
                         f"and bf16 {tuple(x.shape)}")


def routing_form(n_slots: int, n_experts: int, cuda: bool) -> str:
    """Which routing `route_slots` runs: "small" (one program), "parallel" (one program per expert) or "torch"
    (the sort path; also off CUDA). Every form gives the same outputs: only the time differs."""
    if cuda and 0 < n_slots <= ONE_PROGRAM_ROUTING_SLOTS:
        return "small"
    if cuda and 0 < n_slots <= PARALLEL_ROUTING_SLOTS and n_slots * n_experts <= PARALLEL_ROUTING_WORK:
        return "parallel"
    return "torch"


def route_slots(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s outputs by the cheapest path on CUDA: one Triton program up to
    ONE_PROGRAM_ROUTING_SLOTS slots (`align_by_expert_small`), one program per expert up to
    PARALLEL_ROUTING_SLOTS and PARALLEL_ROUTING_WORK experts x slots (`align_by_expert_parallel`), the torch
    sort path above and off CUDA."""
    form = routing_form(topk_ids.numel(), n_experts, topk_ids.is_cuda)
    if form == "small":
        return align_by_expert_small(topk_ids, n_experts, block_m)
    if form == "parallel":
        return align_by_expert_parallel(topk_ids, n_experts, block_m)
    return align_by_expert(topk_ids, n_experts, block_m)


def align_by_expert_small(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert`'s exact outputs in one launch, for at most SMALL_ROUTING_SLOTS slots on CUDA."""
    flat, n_slots, n_blocks, sorted_slots, block_expert = _routing_outputs(
        "align_by_expert_small", topk_ids, n_experts, block_m, SMALL_ROUTING_SLOTS)
    _align_small_kernel[(1,)](flat, sorted_slots, block_expert, n_slots, n_blocks, E=n_experts, BM=block_m,
                              **align_small_sizes(n_slots, n_experts, n_blocks, block_m), num_warps=8)
    return sorted_slots, block_expert


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_bytes_to_f32(packed):
    """uint8 [R, C] (two E2M1 codes per byte, low nibble = even K) -> their exact fp32 values [R, 2C].
    E2M1 code s|e1e0|m: e > 0 -> fp32 exponent e+126, mantissa m<<22; e == 0 -> 0 or 0.5 (0x3F000000)."""
    b = packed.to(tl.int32)
    codes = tl.interleave(b & 0xF, b >> 4)
    mag = codes & 7
    e = mag >> 1
    m = mag & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * 0x3F000000) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_bytes_to_f32_fp16_trick(packed):
    """Same values as `_e2m1_bytes_to_f32` TIMES 2**-14, in 4 integer ops per byte instead of ~9 per code:
    the 3 magnitude bits e1 e0 m go to fp16 bits 11..9 (exponent field e, top mantissa bit m) and the sign
    to bit 15, so the fp16 is 2**(e-15) * (1 + m/2) for e > 0 and m * 2**-15 for e == 0 (the subnormal
    0.5 * 2**-14): exactly the E2M1 value times 2**-14. The caller folds 2**14 into the block scale."""
    b = packed.to(tl.uint16)
    lo = ((b & 0x7) << 9) | ((b & 0x8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    return tl.interleave(lo, hi).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_bytes_to_f32_fp16_mul(packed):
    """`_e2m1_bytes_to_f32_fp16_trick`'s values (E2M1 x 2**-14) with the two fp16 codes of a byte built in one
    32-bit word by two multiplies (copies of the byte at bits 9 / 21 and 12 / 24, no overlap, so no carries)
    and two masks: magnitude bits to 9..11 / 25..27, signs to 15 / 31 (low half = even K)."""
    b = packed.to(tl.uint32)
    word = ((b * 0x00200200) & 0x0E000E00) | ((b * 0x01001000) & 0x80008000)
    lo = (word & 0xFFFF).to(tl.uint16)
    hi = (word >> 16).to(tl.uint16)
    return tl.interleave(lo, hi).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_bytes_bf16x2_scaled(packed, byte, BN: tl.constexpr, KB: tl.constexpr):
    """[BN, KB/2] packed bytes and [BN, KB/32] E8M0 bytes S -> the exact scaled weights, bf16 [BN, KB], by one
    bf16x2 multiply per byte: the byte's two codes become one 32-bit word of two bf16 bit patterns (magnitude
    bits e1 e0 m at bf16 bits 8..6 / 24..22, signs at 15 / 31, by two 32-bit multiplies and masks as expand
    5), i.e. 2**(e-127) * (1 + m/2) for e > 0 and the subnormal m * 2**-127 for e == 0: exactly the E2M1 value
    times 2**-126. Times the bf16 2**(S-1) (exponent field S + 126) that is E2M1 x 2**(S-127), exact (the
    smallest product, 2**-128, is a bf16 subnormal) for S <= 128, i.e. scales up to 2 (`fp4_moe` checks
    the bank's `scale_max` before it picks this). The multiply is PTX mul.rn.bf16x2 (sm_90) by inline asm; the
    interpreter (no asm) takes the same values through fp32."""
    b = tl.reshape(packed.to(tl.uint32), (BN, KB // FP4_BLOCK, FP4_BLOCK // 2))
    word = ((b * 0x00040040) & 0x01C001C0) | ((b * 0x01001000) & 0x80008000)
    s = byte.to(tl.uint32) + 126
    mult = tl.broadcast_to(((s << 7) | (s << 23))[:, :, None], (BN, KB // FP4_BLOCK, FP4_BLOCK // 2))
    if _ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }", "=h,=h,r,r", [word, mult],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        m = (s << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2**(S-1) in fp32 (the interpreter's fp32 keeps subnormals)
        lo = ((word & 0xFFFF) << 16).to(tl.float32, bitcast=True) * m
        hi = (word & 0xFFFF0000).to(tl.float32, bitcast=True) * m
        lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    return tl.reshape(tl.interleave(lo, hi), (BN, KB))


@triton.jit
def _fp4_rows(w_ptrs, ws_ptrs, n_ok, BN: tl.constexpr, KB: tl.constexpr, EXPAND: tl.constexpr):
    """[BN, KB/2] packed bytes and [BN, KB/32] E8M0 scales -> the exact weights, bf16 [BN, KB] (E2M1 x pow2
    has at most 2 significant bits: exact in bf16). EXPAND 0: fp32 bit assembly per code; 1: the fp16 trick
    with 2**14 folded into the scale (exact for E8M0 exponents below 241, i.e. scales below 2**114); 5: the
    same values with the byte's two fp16 codes built by 32-bit multiplies (sm_90 SASS of the v2 w13 K step
    with bf16 activations: 469 instructions per thread against 603 with 1, 756 in the default kernel);
    6: bf16 bit patterns times the scale by one bf16x2 multiply per byte (`_e2m1_bytes_bf16x2_scaled`)."""
    packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
    byte = tl.load(ws_ptrs, mask=n_ok[:, None], other=0)
    if EXPAND == 6:
        return _e2m1_bytes_bf16x2_scaled(packed, byte, BN, KB)
    if EXPAND == 1 or EXPAND == 5:
        if EXPAND == 5:
            vals = _e2m1_bytes_to_f32_fp16_mul(packed)
        else:
            vals = _e2m1_bytes_to_f32_fp16_trick(packed)
        scale = ((byte.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    else:
        vals = _e2m1_bytes_to_f32(packed)
        scale = e8m0_to_f32(byte)
    vals = tl.reshape(tl.reshape(vals, (BN, KB // FP4_BLOCK, FP4_BLOCK)) * scale[:, :, None], (BN, KB))
    return vals.to(tl.bfloat16)


@triton.jit
def _fp4_tile(w_ptrs, ws_ptrs, n_ok, BN: tl.constexpr, KB: tl.constexpr, EXPAND: tl.constexpr):
    """`_fp4_rows` transposed: the weight tile as the dot's right operand, bf16 [KB, BN]."""
    return tl.trans(_fp4_rows(w_ptrs, ws_ptrs, n_ok, BN, KB, EXPAND))


@triton.jit
def _fp4_dot(a, acc, w_ptrs, wt_ptrs, ws_ptrs, n_ok, BN: tl.constexpr, KB: tl.constexpr, EXPAND: tl.constexpr):
    """acc + a [BM, KB] bf16 @ the exact weights of the tile [KB, BN]. EXPAND 2: Triton's microscaling dot
    (packed E2M1 [KB/2, BN] + E8M0 [BN, KB/32]; on Hopper it upcasts to bf16 with the scale applied, the
    same exact operands, and uses the bf16 tensor cores); 0/1: `_fp4_tile` then a bf16 dot."""
    if EXPAND == 2:
        packed = tl.load(wt_ptrs, mask=n_ok[None, :], other=0)
        byte = tl.load(ws_ptrs, mask=n_ok[:, None], other=0)
        return tl.dot_scaled(a, None, "bf16", packed, byte, "e2m1", acc)
    return tl.dot(a, _fp4_tile(w_ptrs, ws_ptrs, n_ok, BN, KB, EXPAND), acc)


@triton.jit
def _store_expert_rows(acc, acc_up, out_ptr, route_w_ptr, slots, valid, offs_n, n_ok, stride_om, limit,
                       GATED: tl.constexpr):
    """The grouped GEMMs' epilogue: GATED, out = bf16(w_slot * silu(g) * u) from the bf16-rounded gate and up
    (the official rounding points; the clamp when limit > 0); else out = bf16(acc)."""
    if GATED:
        h = swiglu_bf16(acc, acc_up, limit)
        route_w = tl.load(route_w_ptr + slots, mask=valid, other=0.0)
        result = route_w[:, None] * h
    else:
        result = acc
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result.to(tl.bfloat16), mask=valid[:, None] & n_ok[None, :])


@fast_launch
@triton.jit
def _fp4_grouped_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, route_w_ptr, sorted_slots_ptr,
                             block_expert_ptr, n_slots, N, limit,
                             stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                             K: tl.constexpr, A_ROW_DIV: tl.constexpr, ACT_BLOCK: tl.constexpr, GATED: tl.constexpr,
                             KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EXPAND: tl.constexpr,
                             PDL: tl.constexpr = False):
    """One block of BM slots of one expert x BN output columns. A = fp8 activations [rows, K] with fp32
    scales per ACT_BLOCK (row = slot // A_ROW_DIV); W = packed FP4 [E, (2 if GATED) N, K/2] with E8M0
    [E, ..., K/32]. GATED: out[slot, n] = bf16(w_slot * silu(g) * u) with g/u from rows n and N + n;
    else out[slot, n] = bf16(A @ W[e]^T). KB: K per loop step (a multiple of 32 and of ACT_BLOCK)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = tl.load(sorted_slots_ptr + pid_m * BM + tl.arange(0, BM))
    valid = slots < n_slots
    rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    a_ptrs = a_ptr + rows[:, None] * stride_am + tl.arange(0, KB)[None, :]
    as_ptrs = as_ptr + rows[:, None] * stride_asm + tl.arange(0, KB // ACT_BLOCK)[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn \
        + tl.arange(0, KB // 2)[None, :]
    wt_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn \
        + tl.arange(0, KB // 2)[:, None]  # the same bytes as [KB/2, BN] (EXPAND 2)
    ws_ptrs = ws_ptr + expert.to(tl.int64) * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn \
        + tl.arange(0, KB // FP4_BLOCK)[None, :]
    up_w = N * stride_wn
    up_s = N * stride_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, KB):
        # activation: E4M3 x its pow2 scale per ACT_BLOCK, exact in bf16
        a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0).to(tl.float32)
        a_scale = tl.load(as_ptrs + k0 // ACT_BLOCK, mask=valid[:, None], other=0.0)
        a = tl.reshape(tl.reshape(a, (BM, KB // ACT_BLOCK, ACT_BLOCK)) * a_scale[:, :, None], (BM, KB))
        a = a.to(tl.bfloat16)
        # exact products, fp32 accumulation: official fp4_gemm up to fp32 summation order
        acc = _fp4_dot(a, acc, w_ptrs + k0 // 2, wt_ptrs + k0 // 2, ws_ptrs + k0 // FP4_BLOCK, n_ok, BN, KB, EXPAND)
        if GATED:
            acc_up = _fp4_dot(a, acc_up, w_ptrs + up_w + k0 // 2, wt_ptrs + up_w + k0 // 2,
                              ws_ptrs + up_s + k0 // FP4_BLOCK, n_ok, BN, KB, EXPAND)
    _store_expert_rows(acc, acc_up, out_ptr, route_w_ptr, slots, valid, offs_n, n_ok, stride_om, limit, GATED)


@fast_launch
@triton.jit
def _sum_expert_rows_kernel(y_ptr, rows_ptr, order_ptr, D, TOPK: tl.constexpr, BD: tl.constexpr,
                            PDL: tl.constexpr = False):
    """y[t] = fp32 sum of rows[t*k + order[t, j]] for j = 0..k-1, sequentially from 0 (the twin's order)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = offs < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        slot = t * TOPK + tl.load(order_ptr + t * TOPK + j)
        acc += tl.load(rows_ptr + slot.to(tl.int64) * D + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * D + offs, acc, mask=ok)


@fast_launch
@triton.jit
def _fp4_gemm_v2_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, route_w_ptr, sorted_slots_ptr, block_expert_ptr,
                        n_slots, N, limit, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                        stride_om, stride_os,
                        K_SPLIT: tl.constexpr, A_ROW_DIV: tl.constexpr, ACT_BLOCK: tl.constexpr, A_BF16: tl.constexpr,
                        GATED: tl.constexpr, SPLIT_OUT: tl.constexpr, KB: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, EXPAND: tl.constexpr, PDL: tl.constexpr = False):
    """The v2 grouped GEMM (`fp4_moe(config=...)` with V2 keys; `_fp4_grouped_gemm_kernel`'s math):
    * A_BF16: the activation is already act_quant's exact q * s in bf16 (one pass per op: no E4M3 -> fp32 ->
      x scale -> bf16 here; in the default kernel that dequant is replicated in each of the 4 warps and was
      ~1/4 of the K loop's instructions in the sm_90 SASS);
    * GATED: ONE weight tile of BN rows = BN/2 gate rows (n0..) then the matching BN/2 up rows (N + n0..):
      one expansion pipeline and one dot per step, split into gate / up in the epilogue (then the SwiGLU
      epilogue as the default kernel);
    * SPLIT_OUT: program (block, tile, split) reduces K range [split * K_SPLIT, (split + 1) * K_SPLIT) and
      stores its fp32 partial at out[split, slot, n] (a reduce kernel adds the splits in a fixed order);
      else bf16 rows out[slot, n]. SPLIT_OUT is never GATED: the split w13 treats its 2N rows as plain N.
    Tried and dropped (H200 2026-12-01, results/fp4_moe_variants_h200_e6.log): swapping the dot's operands
    (acc^T = W @ A^T, the expanded weights as wgmma's register operand, no transpose): slower at every T
    (T=1 114 vs 75 us, T=128 1.72 vs 1.55 ms with expand 6)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots, valid, rows, col, w_row, n_ok, k_lo = expert_rows(sorted_slots_ptr, n_slots, N, pid_m, pid_n, A_ROW_DIV,
                                                             GATED, SPLIT_OUT, K_SPLIT, BM, BN)
    a_ptrs = a_ptr + rows[:, None] * stride_am + tl.arange(0, KB)[None, :]
    as_ptrs = as_ptr + rows[:, None] * stride_asm + tl.arange(0, KB // ACT_BLOCK)[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_row[:, None].to(tl.int64) * stride_wn \
        + tl.arange(0, KB // 2)[None, :]
    ws_ptrs = ws_ptr + expert.to(tl.int64) * stride_wse + w_row[:, None].to(tl.int64) * stride_wsn \
        + tl.arange(0, KB // FP4_BLOCK)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k_step in range(0, K_SPLIT, KB):  # constant trip count (k_lo is added to the offsets)
        k0 = k_lo + k_step
        if A_BF16:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0).to(tl.float32)
            a_scale = tl.load(as_ptrs + k0 // ACT_BLOCK, mask=valid[:, None], other=0.0)
            a = tl.reshape(tl.reshape(a, (BM, KB // ACT_BLOCK, ACT_BLOCK)) * a_scale[:, :, None], (BM, KB))
            a = a.to(tl.bfloat16)
        acc = tl.dot(a, _fp4_tile(w_ptrs + k0 // 2, ws_ptrs + k0 // FP4_BLOCK, n_ok, BN, KB, EXPAND), acc)
    if SPLIT_OUT:
        ptrs = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + slots[:, None].to(tl.int64) * stride_om \
            + col[None, :]
        tl.store(ptrs, acc, mask=valid[:, None] & n_ok[None, :])
    elif GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        h = swiglu_bf16(gate, up, limit)
        route_w = tl.load(route_w_ptr + slots, mask=valid, other=0.0)
        result = route_w[:, None] * h
        cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(ptrs, result.to(tl.bfloat16), mask=valid[:, None] & (cols < N)[None, :])
    else:
        ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + col[None, :]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=valid[:, None] & n_ok[None, :])


@fast_launch
@triton.jit
def _swiglu_split_reduce_kernel(p_ptr, route_w_ptr, hq_ptr, hs_ptr, N, limit, stride_ps, stride_pm, stride_hq,
                                stride_hs, S: tl.constexpr, ACT_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                                A_BF16: tl.constexpr, PERM32: tl.constexpr = False, PDL: tl.constexpr = False):
    """Split w13 epilogue for one slot x BLOCK columns: gate = bf16(sum_s p[s, slot, n]), up = bf16(sum_s
    p[s, slot, N + n]) (s = 0, 1, ..., S-1 in that order, fp32), the clamp, h = bf16(w * silu(gate) * up),
    then act_quant(h) per ACT_BLOCK (bit-identical to the act_quant kernel on the bf16 h): A_BF16 stores the
    exact q * s as bf16 (the next GEMM's bf16 operand), else the E4M3 codes and the fp32 scales (PERM32: the
    code of column c at column perm32(c), the FP8 form's operand order)."""
    pdl_enter(PDL)
    slot = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    base = p_ptr + slot * stride_pm + c
    gate = tl.load(base, mask=ok, other=0.0)
    up = tl.load(base + N, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        gate += tl.load(base + s * stride_ps, mask=ok, other=0.0)
        up += tl.load(base + s * stride_ps + N, mask=ok, other=0.0)
    h = swiglu_bf16(gate, up, limit)
    route_w = tl.load(route_w_ptr + slot)
    h = (route_w * h).to(tl.bfloat16).to(tl.float32)
    q, scale = quantise_rows(tl.reshape(h, (BLOCK // ACT_BLOCK, ACT_BLOCK)))
    if A_BF16:
        tl.store(hq_ptr + slot * stride_hq + c, tl.reshape(q.to(tl.float32) * scale[:, None], (BLOCK,)).to(tl.bfloat16),
                 mask=ok)
    else:
        dest = c
        if PERM32:
            dest = _perm32(c)
        tl.store(hq_ptr + slot * stride_hq + dest, tl.reshape(q, (BLOCK,)), mask=ok)
        g = tl.program_id(1) * (BLOCK // ACT_BLOCK) + tl.arange(0, BLOCK // ACT_BLOCK)
        tl.store(hs_ptr + slot * stride_hs + g, scale, mask=g * ACT_BLOCK < N)


@fast_launch
@triton.jit
def _combine_kernel(y_ptr, p_ptr, ids_ptr, sh_ptr, D, stride_ps, S: tl.constexpr, TOPK: tl.constexpr,
                    KP: tl.constexpr, BD: tl.constexpr, PARTIAL: tl.constexpr, SHARED: tl.constexpr,
                    PDL: tl.constexpr = False):
    """y[t] = fp32 sum over token t's k slots in ascending expert id (stable: ties by position, like a stable
    argsort; computed here, no torch argsort launch) of its w2 row. PARTIAL: the row is bf16(sum_s p[s, slot])
    (s = 0..S-1 in that order, fp32: the split w2's reduce, fused); else p holds the bf16 rows. SHARED: the
    shared expert's bf16 row sh[t] is added last (fp32) and y is stored in its dtype (bf16): the official
    `y += shared; y.to(bf16)` of the MoE, in the same order."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = offs < D
    j = tl.arange(0, KP)
    j_ok = j < TOPK
    ids = tl.load(ids_ptr + t * TOPK + j, mask=j_ok, other=0).to(tl.int64)
    before = ((ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None]))) \
        & j_ok[None, :]
    rank = tl.where(j_ok, tl.sum(before.to(tl.int32), axis=1), KP)
    acc = tl.zeros((BD,), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        slot = t * TOPK + tl.sum(tl.where(rank == r, j, 0), axis=0)
        if PARTIAL:
            row = tl.load(p_ptr + slot * D + offs, mask=ok, other=0.0)
            for s in tl.static_range(1, S):
                row += tl.load(p_ptr + s * stride_ps + slot * D + offs, mask=ok, other=0.0)
            acc += row.to(tl.bfloat16).to(tl.float32)
        else:
            acc += tl.load(p_ptr + slot * D + offs, mask=ok, other=0.0).to(tl.float32)
    if SHARED:
        acc += tl.load(sh_ptr + t * D + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------
DECODE_SLOTS_PER_EXPERT = 16  # up to this many routed slots per expert: the decode tiles and plan (BM=16)


def _config(n_slots: int, n_experts: int) -> dict:
    """Tiles by slots per expert, from the tile sweep of benchmarks/bench_fp4_moe.py (H200, 2026-12-01,
    V4-Flash dims, CUDA-graph replay of the whole op, expand 1):
    * few per expert (decode): BM=16; BN=64 while the step has few slots (T=1: 112 us, BN=128 128 us),
      BN=128 above (T=32: 1600 vs 1782 us; T=128: 2647 vs 2933 us);
    * 17..96 per expert: BM=64, BN=128 (T=2048: 4.5 ms, the BM=32/BN=64 tiles used before took 16.1 ms);
    * more (prefill): BM=128, BN=256, 8 warps (T=8192: 12.2 ms = 203 TFLOP/s, 128x128 took 16.1 ms)."""
    per_expert = n_slots / max(1, n_experts)
    if per_expert <= DECODE_SLOTS_PER_EXPERT:
        if n_slots <= SMALL_ROUTING_SLOTS:
            return dict(BM=16, BN=64, num_warps=4, num_stages=6)
        return dict(BM=16, BN=128, num_warps=4, num_stages=4)
    if per_expert <= 96:
        return dict(BM=64, BN=128, num_warps=4, num_stages=3)
    return dict(BM=128, BN=256, num_warps=8, num_stages=3)


def _grouped_gemm(a, a_scale, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, n, k, limit,
                  a_row_div, act_block, gated, cfg, expand):
    bn = cfg["BN"] // 2 if gated else cfg["BN"]  # two accumulators when gated
    grid = (block_expert.numel(), cdiv(n, bn))
    _fp4_grouped_gemm_kernel[grid](
        a, a_scale, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, n, float(limit),
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        K=k, A_ROW_DIV=a_row_div, ACT_BLOCK=act_block, GATED=gated, KB=128, BM=cfg["BM"], BN=bn, EXPAND=expand,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


V2_KEYS = ("SPLIT_K", "SPLIT_K13", "SPLIT_K2", "A_BF16", "WAVES")  # a config with any of these takes the v2 path (`_fp4_moe_v2`)
SPLIT_WAVES = 8  # auto SPLIT_K: programs per SM the split aims for (small 4-warp programs, several resident)


def split_k(tiles: int, k: int, kb: int, sms: int, waves: int = SPLIT_WAVES) -> int:
    """Deterministic split-K count S (a power of 2, at most 16) for a grid of `tiles` (block, n-tile)
    programs: double S while tiles * S < waves * sms, S divides the K steps of kb and each split keeps
    >= 4 steps. T=1 V4-Flash (6 blocks x 64 tiles = 384 programs, 132 SMs): w13 (32 steps) S=4, w2 (16) S=4;
    from T=8 (48 blocks) S=1."""
    steps = k // kb
    s = 1
    while s * 2 <= 16 and tiles * s < waves * sms and steps % (s * 2) == 0 and steps // (s * 2) >= 4:
        s *= 2
    return s


def plan_v2(n_slots: int, n_experts: int, n_blocks: int, d: int, inter: int, sms: int, config: dict) -> dict:
    """The v2 launch plan: `_config`'s tiles, then `config` on top (BM, BN, num_warps, num_stages, A_BF16,
    WAVES, SPLIT_K (None/0: auto by `split_k`; else an int applied to both GEMMs), SPLIT_K13 / SPLIT_K2
    per GEMM). Returns the dict with S13 and S2 resolved (1 = no split: w13 keeps the fused SwiGLU
    epilogue)."""
    cfg = dict(_config(n_slots, n_experts))
    cfg.update(config)
    return _plan_splits(cfg, n_blocks, cfg["BN"], d, inter, sms)


def _plan_splits(cfg: dict, n_blocks: int, tile_n: int, d: int, inter: int, sms: int) -> dict:
    """cfg's S13 / S2: SPLIT_K13 / SPLIT_K2, else SPLIT_K, applied as given; None/0: `split_k` for the grid of
    n_blocks x (output columns / tile_n) programs over 128-wide K steps."""
    kb = 128
    waves = cfg.get("WAVES", SPLIT_WAVES)
    for name, n, k in (("S13", 2 * inter, d), ("S2", d, inter)):
        want = cfg.get("SPLIT_K" + name[1:], cfg.get("SPLIT_K"))
        s = split_k(n_blocks * cdiv(n, tile_n), k, kb, sms, waves) if not want else int(want)
        if s < 1 or (k // kb) % s:
            raise ValueError(f"fp4_moe: SPLIT_K {s} must divide the {k // kb} K steps of {kb}")
        cfg[name] = s
    return cfg


def _v2_gemm(a, a_scale, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, n, k, limit, a_row_div,
             act_block, a_bf16, gated, split, cfg, expand):
    bn = cfg["BN"]
    grid = (block_expert.numel(), cdiv(n, bn // 2 if gated else bn), split)
    stride_os = out.stride(0) if split > 1 else 0
    stride_om = out.stride(1) if split > 1 else out.stride(0)
    if a_scale is None:  # A_BF16: no scales (the pointer is not read)
        a_scale = a
    _fp4_gemm_v2_kernel[grid](
        a, a_scale, w, w_scale, out, route_w, sorted_slots, block_expert, n_slots, n, float(limit),
        a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), stride_om, stride_os, K_SPLIT=k // split, A_ROW_DIV=a_row_div, ACT_BLOCK=act_block,
        A_BF16=a_bf16, GATED=gated, SPLIT_OUT=split > 1, KB=128, BM=cfg["BM"], BN=bn, EXPAND=expand,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _reduce_split_w13(part, route_w, act_block, limit, a_bf16, perm32=False):
    """The split w13's fp32 partials [S, slots, 2I] -> the w2 GEMM's activation: `_swiglu_split_reduce_kernel`
    (fixed-order split sum, SwiGLU, act_quant(h)); (bf16 q*s, None) for A_BF16, else (E4M3 codes, in perm32
    order for the FP8 form, fp32 scales)."""
    s13, n_slots, inter = part.shape[0], part.shape[1], part.shape[2] // 2
    ha = torch.empty((n_slots, inter), dtype=torch.bfloat16 if a_bf16 else torch.float8_e4m3fn, device=part.device)
    hs = None if a_bf16 else torch.empty((n_slots, inter // act_block), dtype=torch.float32, device=part.device)
    block = 512 if inter % 512 == 0 else 128
    _swiglu_split_reduce_kernel[(n_slots, inter // block)](
        part, route_w, ha, hs if hs is not None else ha, inter, float(limit), part.stride(0), part.stride(1),
        ha.stride(0), hs.stride(0) if hs is not None else 0, S=s13, ACT_BLOCK=act_block, BLOCK=block, A_BF16=a_bf16,
        PERM32=perm32, num_warps=4)
    return ha, hs


def _w2_rows(s2, n_slots, d, device):
    """The w2 GEMM's output: fp32 split partials [S2, slots, D] when split, else the bf16 rows [slots, D]."""
    if s2 > 1:
        return torch.empty((s2, n_slots, d), dtype=torch.float32, device=device)
    return torch.empty((n_slots, d), dtype=torch.bfloat16, device=device)


def _combine_rows(y, rows, topk_ids, shared=None):
    """y[t] = the ordered fp32 sum of token t's k w2 rows (`_combine_kernel`): rows fp32 split partials
    [S2, slots, D] (3-D, any S2 >= 1: their fixed-order sum rounded to bf16 per row, fused) or bf16 [slots, D].
    shared (bf16 [T, D], op fp4_moe_shared): added last in fp32, y bf16 (the MoE's one rounding, fused)."""
    t, topk = topk_ids.shape
    d = y.shape[1]
    partial = rows.dim() == 3
    s2 = rows.shape[0] if partial else 1
    bd = min(1024, next_power_of_2(d))
    if (shared is None) != (y.dtype == torch.float32):
        raise ValueError(f"fp4_moe: the output is fp32 without a shared expert and bf16 with one, got {y.dtype} "
                         f"with shared={'given' if shared is not None else None}")
    if shared is not None:
        shared = shared.wait()  # the caller's side stream joins here: after every expert GEMM was queued
    _combine_kernel[(t, cdiv(d, bd))](y, rows, topk_ids.contiguous(), shared if shared is not None else y, d,
                                             rows.stride(0) if partial else 0,
                                             S=s2, TOPK=topk, KP=max(2, next_power_of_2(topk)), BD=bd,
                                             PARTIAL=partial, SHARED=shared is not None, num_warps=4)
    return y


def _fp4_moe_v2(x, topk_ids, topk_weights, bank, swiglu_limit, expand, config, y, shared=None):
    """The v2 path (variants under measurement, same function as the default path): pre-dequantised bf16
    activations (A_BF16), one gate+up tile per program, split-K with fixed-order reduce kernels (the w13
    reduce fuses the SwiGLU epilogue and act_quant(h), the w2 reduce fuses the k-row sum), and the k-row sum
    ordering computed in its kernel (no argsort launch). No host sync: CUDA-graph capturable."""
    if expand not in (0, 1, 5, 6):
        raise ValueError(f"fp4_moe v2 path: expand must be 0, 1, 5 or 6, got {expand}")
    topk = topk_ids.shape[1]
    d, inter, n_slots, ab = bank.dim, bank.inter_dim, topk_ids.numel(), bank.act_block
    bm = {**_config(n_slots, bank.plan_experts), **config}["BM"]
    # the split-K plan from the plan geometry (an expert-parallel shard plans as its whole bank: same bits);
    # the routing below bounds its blocks with the bank's own count
    n_blocks = n_routing_blocks(n_slots, bank.plan_experts, bm)
    cfg = plan_v2(n_slots, bank.plan_experts, n_blocks, d, inter, sm_count(x.device), config)
    a_bf16 = bool(cfg.get("A_BF16", False))
    sorted_slots, block_expert = route_slots(topk_ids, bank.n_experts, bm)
    route_w = topk_weights.contiguous().view(-1)
    if a_bf16:
        xa, xs = act_quant_dequant_bf16(x, ab), None
    else:
        xa, xs = act_quant(x, ab)
    s13, s2 = cfg["S13"], cfg["S2"]
    if s13 > 1:
        part = torch.empty((s13, n_slots, 2 * inter), dtype=torch.float32, device=x.device)
        _v2_gemm(xa, xs, bank.w13, bank.w13_scale, part, route_w, sorted_slots, block_expert, n_slots, 2 * inter,
                 d, 0.0, topk, ab, a_bf16, False, s13, cfg, expand)
        ha, hs = _reduce_split_w13(part, route_w, ab, swiglu_limit, a_bf16)
    else:
        h = torch.empty((n_slots, inter), dtype=torch.bfloat16, device=x.device)
        _v2_gemm(xa, xs, bank.w13, bank.w13_scale, h, route_w, sorted_slots, block_expert, n_slots, inter, d,
                 swiglu_limit, topk, ab, a_bf16, True, 1, cfg, expand)
        if a_bf16:
            ha, hs = act_quant_dequant_bf16(h, ab), None
        else:
            ha, hs = act_quant(h, ab)
    rows = _w2_rows(s2, n_slots, d, x.device)
    _v2_gemm(ha, hs, bank.w2, bank.w2_scale, rows, route_w, sorted_slots, block_expert, n_slots, d, inter, 0.0, 1,
             ab, a_bf16, False, s2, cfg, expand)
    return _combine_rows(y, rows, topk_ids, shared)


MMA_KEYS = ("MMA_SYNC",)  # a config with any of these takes the mma.sync kernels (`_fp4_moe_mma`)
MMA_WAVES = 4  # auto split-K of the mma.sync form: programs per SM the split aims for (DEEPINFER_MOE_MMA_WAVES:
# another, for A/B runs). At b1 it gives w13 / w2 2 splits each; 1 each (waves 2) took the op 54.5 -> 50.6 us on
# an H100 but the 4-layer step only 1.057 -> 1.051 ms, within its run-to-run spread (2026-12-07, BENCHMARKS.md)
# its tiles (H200 2026-12-02, bench_fp4_moe.py --mma, whole op, results/fp4_moe_mma_h200_2026-12-02_run3.log):
# 256 K per stage (a quad reads whole 128-byte lines of each weight row), two register stages; up to 8 slots
# (b1) one m16 tile per warp: T=1 53.7 us (two tiles: 55.7; 128-K stages 60.1); above, two m16 tiles per
# warp: T=8 / 32 / 128 236 / 627 / 1180 us (2.81 TB/s) against 254 / 683 / 1203 with 128-K stages x 4 and
# 256 / 703 / 1239 x 2 (one tile: 243 / 662 / 1292; Triton v2 347 / 811 / 1425)
MMA_TILES_FEW = dict(MT=1, WARPS=4, STAGES=2, KSTEP=256)
MMA_TILES = dict(MT=2, WARPS=4, STAGES=2, KSTEP=256)


def plan_mma(n_slots: int, n_experts: int, d: int, inter: int, sms: int, config: dict) -> dict:
    """The mma.sync form's plan: `fp4_moe_mma.tiles(config)` (MT, WARPS, STAGES), then S13 / S2 split-K counts:
    SPLIT_K13 / SPLIT_K2, else SPLIT_K, as given; None/0: doubled while the grid of routing blocks (of
    fp4_moe_mma.TOKENS slots) x weight-row tiles x S stays under WAVES (default MMA_WAVES) programs per SM
    and each split keeps whole pipeline rounds (STAGES x KSTEP K). ValueError for a split that cannot run."""
    from deepinfer.kernels.cuda import fp4_moe_mma as mma

    cfg = mma.tiles({**(MMA_TILES_FEW if n_slots <= ONE_PROGRAM_ROUTING_SLOTS else MMA_TILES), **config})
    if "STAGES" not in config and "KSTEP" not in config and any(mma.check_shapes(k, 1, cfg) for k in (d, inter)):
        # D or I not whole rounds of the default stages (small models): 128 K per stage, the deepest ring that fits
        steps = math.gcd(d, inter) // 128
        cfg.update(KSTEP=128, STAGES=next(st for st in (4, 2, 1) if steps % st == 0))
    n_blocks = n_routing_blocks(n_slots, n_experts, mma.TOKENS)
    return _cuda_form_splits(cfg, config, mma.rows_per_cta(cfg), n_blocks, d, inter, sms,
                             config.get("WAVES", env.moe_mma_waves() or MMA_WAVES),
                             lambda k, s: (k // cfg["KSTEP"]) % (2 * s * cfg["STAGES"]) == 0, mma.check_shapes,
                             "mma.sync")


def _cuda_form_splits(cfg: dict, config: dict, rows: int, n_blocks: int, d: int, inter: int, sms: int, waves: int,
                      doubles, check, form: str, grow_to_fit: bool = False) -> dict:
    """cfg's S13 / S2 for the CUDA decode forms: SPLIT_K13 / SPLIT_K2, else SPLIT_K, as given; None/0: doubled
    (up to 16) while the grid of n_blocks x ceil(N / rows) x S CTAs stays under waves x sms and `doubles(k, s)`
    says a split of 2S keeps whole stages; grow_to_fit: then doubled on while `check` refuses it. ValueError
    naming the form for a split `check(k, s, cfg)` refuses."""
    for name, n, k in (("S13", 2 * inter, d), ("S2", d, inter)):
        want = config.get("SPLIT_K" + name[1:], config.get("SPLIT_K"))
        if want:
            s = int(want)
        else:
            grid, s = n_blocks * cdiv(n, rows), 1
            while s * 2 <= 16 and grid * s < waves * sms and doubles(k, s):
                s *= 2
            while grow_to_fit and check(k, s, cfg) and s < 16 and k % (2 * s) == 0:
                s *= 2
        why = check(k, s, cfg)
        if why:
            raise ValueError(f"fp4_moe {form} form: {why}")
        cfg[name] = s
    return cfg


def mma_form_usable(bank: FP4ExpertBank, device: torch.device) -> bool:
    """The mma.sync form can run this bank here: a CUDA device with NVRTC and the driver, the weights' scale
    bytes in the exact expansion's range, and D and I multiples of 128 (`plan_mma` picks stages that fit)."""
    from deepinfer.kernels.cuda import fp4_moe_mma as mma
    from deepinfer.kernels.cuda import runtime

    return (device.type == "cuda" and bank.scale_max <= mma.SCALE_MAX and bank.dim % 128 == 0
            and bank.inter_dim % 128 == 0 and runtime.available())


TMA_KEYS = ("TMA",)  # a config with any of these takes the TMA-fed kernels (kernels/cuda/fp4_moe_tma.cu)
TMA_WAVES = 4  # auto split-K of the TMA form: CTAs per SM the split aims for


def plan_tma(n_slots: int, n_experts: int, d: int, inter: int, sms: int, config: dict) -> dict:
    """The TMA form's plan: `fp4_moe_tma.tiles(config)` (MT, CWARPS, STAGES), then S13 / S2 split-K counts:
    SPLIT_K13 / SPLIT_K2, else SPLIT_K, as given; None/0: doubled (up to 16) while the grid of routing blocks
    x weight-row tiles x S stays under WAVES (default TMA_WAVES) CTAs per SM and each split keeps whole
    128-K stages. ValueError for a split that cannot run (`fp4_moe_tma.check_shapes`)."""
    from deepinfer.kernels.cuda import fp4_moe_tma as tma

    cfg = tma.tiles(config)
    n_blocks = n_routing_blocks(n_slots, n_experts, tma.TOKENS)
    # grow_to_fit: a split too long for one scale box (K per split > 7680) doubles until it fits
    return _cuda_form_splits(cfg, config, tma.rows_per_cta(cfg), n_blocks, d, inter, sms,
                             config.get("WAVES", TMA_WAVES),
                             lambda k, s: k % (2 * s) == 0 and (k // (2 * s)) % tma.KSTEP == 0, tma.check_shapes,
                             "TMA", grow_to_fit=True)


def tma_form_usable(bank: FP4ExpertBank, device: torch.device) -> bool:
    """The TMA form can run this bank here: sm_90+ with NVRTC and the driver, scale bytes in the exact
    expansion's range, D and I multiples of 128 (whole ring stages; the bank keeps its scale rows 16-byte
    strided for the tensor maps, so V4.1-Flash's I = 2304 runs too)."""
    from deepinfer.kernels.cuda import fp4_moe_tma as tma

    return (bank.scale_max <= tma.SCALE_MAX and bank.dim % tma.KSTEP == 0 and bank.inter_dim % tma.KSTEP == 0
            and tma.usable(device))


def _fp4_moe_mma(x, topk_ids, topk_weights, bank, swiglu_limit, config, y, shared=None, routed=None):
    """The CUDA forms of the decode regime: the mma.sync kernel (kernels/cuda/fp4_moe_mma.cu, config MMA_SYNC)
    or the TMA-fed one (fp4_moe_tma.cu, config TMA), which share the contract: routing in blocks of 8 slots,
    bf16 activations (act_quant's exact q * s), both GEMMs as fp32 split partials (S >= 1) on mma.sync with
    the FP4 expansion in the MMA's registers, the w13 partials through the SwiGLU + act_quant reduce and the
    w2 partials through the ordered k-row sum (the v2 path's reduce kernels). Official fp4_gemm math up to
    fp32 summation order, like the Triton kernels. No host sync: CUDA-graph capturable (compiled on first use).
    routed: a `PreRouted` in blocks of TOKENS (op "moe_route" at b1) replaces the routing and act_quant(x)."""
    from deepinfer.kernels.cuda import fp4_moe_mma, fp4_moe_tma

    use_tma = any(key in config for key in TMA_KEYS)
    mma = fp4_moe_tma if use_tma else fp4_moe_mma
    form = "TMA" if use_tma else "mma.sync"
    if config.get("LOAD_ONLY"):
        raise ValueError(f"fp4_moe {form} form: LOAD_ONLY is a benchmark diagnostic (the loads alone, garbage out), "
                         "not a tile of the op")
    if bank.scale_max > mma.SCALE_MAX:
        raise ValueError(f"fp4_moe {form} form: exact for E8M0 scale bytes up to {mma.SCALE_MAX}; this bank has "
                         f"{bank.scale_max}")
    topk = topk_ids.shape[1]
    d, inter, n_slots, ab = bank.dim, bank.inter_dim, topk_ids.numel(), bank.act_block
    plan = plan_tma if use_tma else plan_mma
    cfg = plan(n_slots, bank.plan_experts, d, inter, sm_count(x.device), config)
    if routed is not None and routed.block_m == mma.TOKENS and routed.act_block == ab:
        check_pre_routed(routed, x, n_slots, bank.n_experts)
        sorted_slots, block_expert, xa = routed.sorted_slots, routed.block_expert, routed.xa
    else:
        sorted_slots, block_expert = route_slots(topk_ids, bank.n_experts, mma.TOKENS)
        xa = act_quant_dequant_bf16(x, ab)
    route_w = topk_weights.contiguous().view(-1)
    part = torch.empty((cfg["S13"], n_slots, 2 * inter), dtype=torch.float32, device=x.device)
    mma.expert_gemm_partials(xa, bank.w13, bank.w13_scale, part, sorted_slots, block_expert, n_slots, topk, cfg)
    ha, _ = _reduce_split_w13(part, route_w, ab, swiglu_limit, True)
    rows = torch.empty((cfg["S2"], n_slots, d), dtype=torch.float32, device=x.device)
    mma.expert_gemm_partials(ha, bank.w2, bank.w2_scale, rows, sorted_slots, block_expert, n_slots, 1, cfg)
    return _combine_rows(y, rows, topk_ids, shared)


WGMMA_KEYS = ("WGMMA",)  # a config with any of these takes the wgmma prefill form (kernels/cuda/fp4_moe_wgmma.cu)


def wgmma_form_usable(bank: FP4ExpertBank, device: torch.device) -> bool:
    """The wgmma form can run this bank here: compute capability 9.0 with NVRTC and the driver, scale bytes
    in the exact expansion's range, D and I multiples of 128 (whole 128-K stages; `plan_wgmma`'s tiles take
    one fragment buffer, so the tiny checkpoints' I = 128 runs)."""
    from deepinfer.kernels.cuda import fp4_moe_wgmma as wg

    return (bank.scale_max <= wg.SCALE_MAX and bank.dim % 128 == 0 and bank.inter_dim % 128 == 0
            and wg.usable(device))


WGMMA_FEW_PER_EXPERT = 96  # up to this many slots per expert the wgmma form's BT=64 tiles, above BT=128
WGMMA_TILES_FEW = dict(BT=64, CWG=2, STAGES=3, FRAG_BUFS=1, HALVES=1, MIN_CTAS=3)
WGMMA_TILES = dict(BT=128, CWG=4, STAGES=4, FRAG_BUFS=1, HALVES=0, MIN_CTAS=1)
# H200 2026-12-02 s8 (bench_fp4_moe.py --wgmma, whole op, CUDA-graph replay, V4-Flash dims, four runs in
# results/fp4_moe_wgmma_h200_2026-12-02_s8.log): T=8192 6.49 / 6.50 ms (381 TFLOP/s) against 6.41 with 2 CTAs
# of 2 consumer warpgroups an SM (within run-to-run noise), 6.84 with HALVES, 7.72 for 2 warpgroups x 2
# fragment buffers, 7.19 with CTA pairs multicasting the activations (removed), 8.42 at BT=64 and the Triton
# plan's 8.80-8.87. T=2048 (48 slots per expert): BT=64 in 3 CTAs an SM of 2 consumer warpgroups 2.33 ms,
# one CTA of 4 2.57, BT=128 3.08, Triton 2.82.


def plan_wgmma(n_slots: int, n_experts: int, config: dict) -> dict:
    """The wgmma form's tiles: WGMMA_TILES_FEW up to WGMMA_FEW_PER_EXPERT slots per expert, else WGMMA_TILES,
    then `config` on top (`fp4_moe_wgmma.tiles` checks them). Both take one fragment buffer, so any D and I
    of whole 128-K stages run (FRAG_BUFS 2, given, needs multiples of 256: the launcher says so)."""
    from deepinfer.kernels.cuda import fp4_moe_wgmma as wg

    few = n_slots / max(1, n_experts) <= WGMMA_FEW_PER_EXPERT
    return wg.tiles({**(WGMMA_TILES_FEW if few else WGMMA_TILES), **config})


def _fp4_moe_wgmma(x, topk_ids, topk_weights, bank, swiglu_limit, config, y, shared=None):
    """The wgmma form of the prefill regime (kernels/cuda/fp4_moe_wgmma.cu): routing in blocks of BT slots,
    the activations act_quant'ed, gathered into sorted order and permuted into the kernel's K order in one
    pass (`act_quant_gather`), w13 with the SwiGLU epilogue in the kernel -> h bf16 [slots, I], act_quant(h)
    gathered the same way, w2 -> bf16 rows, the ordered k-row sum. Official fp4_gemm math up to fp32
    summation order (exact bf16 products, fp32 sums in the tensor cores). No host sync: CUDA-graph
    capturable (compiled on first use)."""
    from deepinfer.kernels.cuda import fp4_moe_wgmma as wg

    if bank.scale_max > wg.SCALE_MAX:
        raise ValueError(f"fp4_moe wgmma form: exact for E8M0 scale bytes up to {wg.SCALE_MAX}; this bank has "
                         f"{bank.scale_max}")
    topk = topk_ids.shape[1]
    cfg = plan_wgmma(topk_ids.numel(), bank.plan_experts, config)
    d, inter, n_slots, ab, bt = bank.dim, bank.inter_dim, topk_ids.numel(), bank.act_block, cfg["BT"]
    sorted_slots, block_expert = route_slots(topk_ids, bank.n_experts, bt)
    route_w = topk_weights.contiguous().view(-1)
    xg = act_quant_gather(x, ab, sorted_slots, block_expert, n_slots, topk, bt)
    h = torch.empty((n_slots, inter), dtype=torch.bfloat16, device=x.device)
    wg.expert_gemm(xg, bank.w13, bank.w13_scale, h, route_w, sorted_slots, block_expert, n_slots, True,
                   swiglu_limit, cfg)
    hg = act_quant_gather(h, ab, sorted_slots, block_expert, n_slots, 1, bt)
    rows = torch.empty((n_slots, d), dtype=torch.bfloat16, device=x.device)
    wg.expert_gemm(hg, bank.w2, bank.w2_scale, rows, route_w, sorted_slots, block_expert, n_slots, False, 0.0, cfg)
    return _combine_rows(y, rows, topk_ids, shared)


FP8_KEYS = ("FP8",)  # a config with any of these takes the FP8 form (`_fp4_moe_fp8`)


def plan_fp8(n_slots: int, n_experts: int, d: int, inter: int, sms: int, config: dict) -> dict:
    """The FP8 form's launch plan: BT (tokens per routing block) from `_config`'s BM, BW weight rows per
    program, then `config` on top; S13 / S2 split-K counts as `plan_v2` (SPLIT_K None/0: auto) over the
    routing's `n_routing_blocks` of BT."""
    cfg = dict(BT=_config(n_slots, n_experts)["BM"], BW=128, num_warps=4, num_stages=3)
    cfg.update({key: v for key, v in config.items() if key != "FP8"})
    return _plan_splits(cfg, n_routing_blocks(n_slots, n_experts, cfg["BT"]), cfg["BW"], d, inter, sms)


def _fp4_moe_fp8(x, topk_ids, topk_weights, bank, swiglu_limit, config, y, shared=None):
    """The FP8 form (`fp4_fp8_gemm.py`: the official fp4_gemm math on the FP8 tensor cores, the weights as
    the dot's left operand): activations quantised once into perm32 column order, w13 with the SwiGLU
    epilogue (or split-K partials + the split reduce, which quantises h into perm32 order), act_quant(h),
    w2, the ordered k-row sum. No host sync: CUDA-graph capturable."""
    topk = topk_ids.shape[1]
    d, inter, n_slots, ab = bank.dim, bank.inter_dim, topk_ids.numel(), bank.act_block
    if ab % 32 or 128 % ab:
        raise ValueError(f"fp4_moe FP8 form: act_block {ab} must be 32, 64 or 128")
    cfg = plan_fp8(n_slots, bank.plan_experts, d, inter, sm_count(x.device), config)
    sorted_slots, block_expert = route_slots(topk_ids, bank.n_experts, cfg["BT"])
    route_w = topk_weights.contiguous().view(-1)
    xq, xs = act_quant(x, ab, perm32=True)
    s13, s2 = cfg["S13"], cfg["S2"]
    if s13 > 1:
        part = torch.empty((s13, n_slots, 2 * inter), dtype=torch.float32, device=x.device)
        fp4_fp8_grouped_gemm(xq, xs, bank.w13, bank.w13_scale, part, route_w, sorted_slots, block_expert, n_slots,
                             2 * inter, 0.0, topk, ab, False, s13, cfg)
        hq, hs = _reduce_split_w13(part, route_w, ab, swiglu_limit, False, perm32=True)
    else:
        h = torch.empty((n_slots, inter), dtype=torch.bfloat16, device=x.device)
        fp4_fp8_grouped_gemm(xq, xs, bank.w13, bank.w13_scale, h, route_w, sorted_slots, block_expert, n_slots,
                             inter, swiglu_limit, topk, ab, True, 1, cfg)
        hq, hs = act_quant(h, ab, perm32=True)
    rows = _w2_rows(s2, n_slots, d, x.device)
    fp4_fp8_grouped_gemm(hq, hs, bank.w2, bank.w2_scale, rows, route_w, sorted_slots, block_expert, n_slots, d,
                         0.0, 1, ab, False, s2, cfg)
    return _combine_rows(y, rows, topk_ids, shared)


PREFILL_V2 = dict(A_BF16=True)  # the default plan above 16 slots per expert (`_config`'s tiles), expand 6
# (H200 2026-12-01, bench_fp4_moe.py --variants, results/fp4_moe_variants_h200_e6.log, with expand 5:
# T=2048 3.05 vs 4.48 ms, T=8192 9.25 vs 12.1 ms for the kernel below with its tiles and expand 1)
DECODE_V2 = dict(SPLIT_K=0, A_BF16=True, BN=128)  # the default plan up to 16 slots per expert, expand 6
# (expand 6 against 5, same run: T=1 74.8 vs 85.2 us, T=8 353 vs 421, T=32 893 vs 1125, T=128 1552 vs 1944 us
# = 2.14 TB/s); before expand 6:
# (H200 2026-12-01, bench_fp4_moe.py --variants, CUDA-graph replay of the whole op, V4-Flash dims, against
# the kernel below with its tiles and expand 1: T=1 85.6 vs 112 us, T=8 421 vs 606 us, T=32 1119 vs 1558 us,
# T=128 1931 vs 2710 us = 1.72 TB/s; results/fp4_moe_variants_h200.json). Not measured above 16 per expert.


DECODE_FORM = "tma"  # what DEEPINFER_MOE_DECODE_KERNEL=auto runs up to 16 slots per expert: "tma", "mma" or
# "triton". "tma": the TMA form above ONE_PROGRAM_ROUTING_SLOTS slots, the mma.sync form up to them (H200
# 2026-12-02 s7, bench_fp4_moe.py --tma, whole op: T=1 54.0 mma.sync vs 55.0 us TMA at best; T=8 / 32 / 128
# TMA 205 / 528 / 980 vs mma.sync 237 / 637 / 1189 us, results/fp4_moe_tma_h200_2026-12-02_s7.log). Before:
# H200 2026-12-02 (benchmarks/bench_fp4_moe.py --mma, whole op, CUDA-graph replay, V4-Flash dims; first run
# results/fp4_moe_mma_h200_2026-12-02.log, tiles below from _run3): the mma.sync form against the Triton v2
# decode plan (expand 6): T=1 54 vs 75 us, T=8 236 vs 347, T=32 627 vs 811, T=128 1180 vs 1425 us; where
# it cannot run (no NVRTC, scale bytes > 128, D or I not whole pipeline rounds) the Triton v2 plan runs
PREFILL_FORM = "wgmma"  # what DEEPINFER_MOE_PREFILL_KERNEL=auto runs above WGMMA_SLOTS_PER_EXPERT: "wgmma" (where
# `wgmma_form_usable`, else the Triton plan above 16 slots per expert) or "triton" (PREFILL_V2)
WGMMA_SLOTS_PER_EXPERT = 10  # above this many slots per expert the wgmma form runs (where usable), below it the
# decode forms. H100 2026-12-06 (bench_fp4_moe.py --wgmma [--dims], whole op, CUDA-graph replay; BENCHMARKS.md
# twenty-ninth session): the TMA form against the wgmma form's plan, V4-Flash dims at 6 / 8 / 10 / 12 slots 1324 /
# 1465 / 1693 / 1979 us against 1682 / 1676 / 1704 / 1710; V4.1-Flash dims (384 experts, D 5120, I 2304) at 8 /
# 10 / 11 / 12 / 14 / 16 slots 3217 / 3712 / 3942 / 4201 / 4751 / 5234 against 3799 / 3824 / 3874 / 3869 / 3910 /
# 3938 (a 1k-token V4.1 prefill is 16 slots an expert: 1.33x). The boundary was 16 (the Triton plans') before.
PREFILL_WGMMA = dict(WGMMA=True)  # the wgmma form with `plan_wgmma`'s tiles for the regime
DECODE_MMA = dict(MMA_SYNC=True)  # the mma.sync form's default plan (`plan_mma`)
DECODE_TMA = dict(TMA=True)  # the TMA form's default plan (`plan_tma`), above ONE_PROGRAM_ROUTING_SLOTS slots


def _decode_form() -> str:
    choice = env.moe_decode_kernel()
    return DECODE_FORM if choice == "auto" else choice


def _prefill_form() -> str:
    choice = env.moe_prefill_kernel()
    return PREFILL_FORM if choice == "auto" else choice


class _SharedRows:
    """The shared expert's bf16 rows and the caller's join, run just before the rows are first read (its
    rows may still be in flight on a side stream while the expert GEMMs are queued)."""

    def __init__(self, rows: torch.Tensor, ready: Callable[[], None] | None) -> None:
        self.rows, self.ready = rows, ready

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready()
        return self.rows


def fp4_moe_shared(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: FP4ExpertBank,
                   swiglu_limit: float, shared: torch.Tensor, ready: Callable[[], None] | None = None,
                   expand: int | None = None, config: dict | None = None,
                   routed: PreRouted | None = None) -> torch.Tensor:
    """Op "fp4_moe_shared": bf16(fp4_moe(...) + shared), the MoE's output with the shared expert's bf16 rows
    added last in fp32 and one rounding (twin: `quant_weights.fp4_moe_shared_torch`). The forms that end in
    `_combine_kernel` do both in it (two launches fewer than an add and a cast); the others add after.
    ready: called once before anything reads `shared` (model/moe.py passes its side stream's join, so the
    shared expert runs beside the routing and the expert GEMMs). routed: op "moe_route"'s ready-made
    routing of these topk_ids, if any (`PreRouted`)."""
    check_shared("fp4_moe_shared", x, shared)
    return fp4_moe(x, topk_ids, topk_weights, bank, swiglu_limit, expand, config,
                   shared=_SharedRows(shared, ready), routed=routed)


def _add_shared(y: torch.Tensor, shared: _SharedRows | None) -> torch.Tensor:
    """The unfused end of fp4_moe_shared: y fp32 += shared (upcast inside the add: exact), one bf16 rounding."""
    return y if shared is None else y.add_(shared.wait()).to(torch.bfloat16)


def fp4_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: FP4ExpertBank,
            swiglu_limit: float, expand: int | None = None, config: dict | None = None,
            shared: _SharedRows | None = None, routed: PreRouted | None = None) -> torch.Tensor:
    """Op "fp4_moe" on CUDA tensors (see the module docstring); CPU tensors go to the torch twin.
    topk_ids must lie in [0, E) (not checked on the device: that would force a host sync).
    expand: how the kernel turns FP4 into bf16 (`EXPANSIONS`; with config None too: the measured default,
    `DECODE_V2` up to 16 slots per expert, else `PREFILL_V2`, both with expand 6 when the bank's scales
    allow it (`EXPAND6_SCALE_MAX`), else 5; on sm_90 the TMA / mma.sync forms up to WGMMA_SLOTS_PER_EXPERT
    and the wgmma form above it; an expand without a config runs the kernel below); config:
    tile override (benchmarks); a config with any of `V2_KEYS` takes the v2 path (`_fp4_moe_v2`: split-K,
    bf16 activations; see `plan_v2`)."""
    if expand is None and config is None:  # the measured default: the v2 plan of the regime, expand 6 when exact
        per_expert = topk_ids.numel() / max(1, bank.plan_experts)
        few = per_expert <= DECODE_SLOTS_PER_EXPERT
        config = DECODE_V2 if few else PREFILL_V2
        expand = 6 if bank.scale_max <= EXPAND6_SCALE_MAX else 5
        form = _decode_form() if few else "triton"
        if form == "tma" and topk_ids.numel() > ONE_PROGRAM_ROUTING_SLOTS and tma_form_usable(bank, x.device):
            config = DECODE_TMA
        elif form in ("tma", "mma") and mma_form_usable(bank, x.device):  # tma falls back to mma.sync, then Triton
            config = DECODE_MMA
        if per_expert > WGMMA_SLOTS_PER_EXPERT and _prefill_form() == "wgmma" and wgmma_form_usable(bank, x.device):
            config = PREFILL_WGMMA
    expand = DEFAULT_EXPAND if expand is None else expand
    if expand not in EXPANSIONS:
        raise ValueError(f"fp4_moe: expand must be one of {sorted(EXPANSIONS)}, got {expand!r}")
    if expand == 6 and bank.scale_max > EXPAND6_SCALE_MAX:
        raise ValueError(f"fp4_moe: expand 6 is exact for E8M0 scale bytes up to {EXPAND6_SCALE_MAX} (scale 2); "
                         f"this bank has {bank.scale_max}")
    if not x.is_cuda and not interpreting():
        return _add_shared(fp4_moe_torch(x, topk_ids, topk_weights, bank, swiglu_limit), shared)
    check_routing("fp4_moe", x, topk_ids, topk_weights, bank)
    if bank.w13.device != x.device:
        raise ValueError(f"fp4_moe: the expert bank is on {bank.w13.device}, x on {x.device} (FP4ExpertBank.to)")
    t, topk = topk_ids.shape
    d, inter, n_slots = bank.dim, bank.inter_dim, topk_ids.numel()
    if d % 128 or inter % 128 or 128 % bank.act_block:
        raise ValueError(f"fp4_moe kernel needs D={d} and I={inter} multiples of 128 and act_block "
                         f"{bank.act_block} dividing 128")
    y = torch.empty((t, d), dtype=torch.float32 if shared is None else torch.bfloat16, device=x.device)
    if t == 0:
        return y
    if config and any(key in config for key in MMA_KEYS + TMA_KEYS):
        return _fp4_moe_mma(x, topk_ids, topk_weights, bank, swiglu_limit, config, y, shared, routed)
    if config and any(key in config for key in WGMMA_KEYS):
        return _fp4_moe_wgmma(x, topk_ids, topk_weights, bank, swiglu_limit, config, y, shared)
    if config and any(key in config for key in FP8_KEYS):
        return _fp4_moe_fp8(x, topk_ids, topk_weights, bank, swiglu_limit, config, y, shared)
    if config and any(key in config for key in V2_KEYS):
        return _fp4_moe_v2(x, topk_ids, topk_weights, bank, swiglu_limit, expand, config, y, shared)
    y = y if shared is None else torch.empty((t, d), dtype=torch.float32, device=x.device)
    cfg = config or _config(n_slots, bank.plan_experts)
    sorted_slots, block_expert = route_slots(topk_ids, bank.n_experts, cfg["BM"])
    route_w = topk_weights.contiguous().view(-1)
    xq, xs = act_quant(x, bank.act_block)
    h = torch.empty((n_slots, inter), dtype=torch.bfloat16, device=x.device)
    _grouped_gemm(xq, xs, bank.w13, bank.w13_scale, h, route_w, sorted_slots, block_expert, n_slots, inter, d,
                  swiglu_limit, topk, bank.act_block, True, cfg, expand)
    hq, hs = act_quant(h, bank.act_block)
    rows = torch.empty((n_slots, d), dtype=torch.bfloat16, device=x.device)
    _grouped_gemm(hq, hs, bank.w2, bank.w2_scale, rows, route_w, sorted_slots, block_expert, n_slots, d, inter,
                  0.0, 1, bank.act_block, False, cfg, expand)
    order = torch.argsort(topk_ids, dim=1).to(torch.int32).contiguous()
    bd = min(1024, next_power_of_2(d))
    _sum_expert_rows_kernel[(t, cdiv(d, bd))](y, rows, order, d, TOPK=topk, BD=bd)
    return _add_shared(y, shared)


REGISTRATIONS = {"fp4_moe": fp4_moe, "fp4_moe_shared": fp4_moe_shared}
