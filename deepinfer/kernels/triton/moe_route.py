"""The MoE's routing at decode in ONE launch: gate GEMV, gate, the experts' slot blocks and act_quant(x).

Why: at b1 the routed experts' chain is a decode layer's critical path, and it opened with four small
kernels of 2.5-4.2 us each (H100, PDL off, results/decode_timeline_h100_2026-12-07_s32.log): the gate's
logits GEMV (`bf16_gemv`), the gate (`moe_gate`), the slot blocks (`fp4_moe.align_by_expert_small`) and
act_quant(x) (`act_quant_dequant_bf16`, which needs no routing at all). Each is latency: launch, one wave,
a few dependent reductions. Here they are one grid.

How: the grid is the GEMV's (`bf16_gemv._gemv_tiles`: one program per BN weight rows). Every program runs
its GEMV share (`bf16_gemv.gemv_program`, the same tiles: the logits have the GEMV's bits), then, while
there are groups left, act_quant of a group of x (`act_quant.quantise_rows`, as the stand-alone kernel),
then adds one to a per-device counter (release). The program that finds it last (acquire) runs the gate of
every row (`moe_gate.gate_row` / `hash_gate_row`, as the gate kernels) and `fp4_moe.align_small` over the
ids it wrote, and puts the counter back to 0 for the next launch. No program waits for another: the last
one to arrive does the rest, so the grid cannot deadlock however its programs are scheduled (and PDL stays
safe, pdl.py). Every output equals the unfused ops' on the same inputs, bit for bit: same code, same
tiles, same warps (`FUSED_WARPS`; the renormalising tree sum's order follows the layout).

Owns: op "moe_route" on CUDA (twin `official_fused.moe_route`): (weights, indices, routed or None), where
routed (`quant_weights.PreRouted`) carries the slot blocks for `fp4_moe`'s decode forms (blocks of
ROUTE_BLOCK_M = their TOKENS) and x's act_quant (q * s in bf16). Calls it does not fuse (more than
FUSED_ROUTE_MAX_ROWS rows, an fp32 gate weight, a weight the GEMV would not take, a gate_temp other than 1,
DEEPINFER_FUSED_ROUTE=0) run the unfused ops and return routed None (fp4_moe then routes itself).
gate_temp (V4.1; 1 in its released config) stays unfused: torch's `logits / gate_temp` on the GPU is a
multiply by the fp32 reciprocal (a CPU tensor a true division), and the first fused form's IEEE division
differed from it in the last bit of the weights on the H100 (results/gpu_tests_s33_h100_2026-12-07.log); the
reciprocal form was written but not run on a GPU before the device time ran out, so it is not here.
Must not: run two launches at once on one device (one counter per device; a layer's route follows the
last one's in stream order) or be imported off CUDA (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels import official_fused
from deepinfer.kernels.quant_weights import PreRouted
from deepinfer.kernels.triton import bf16_gemv, fp4_moe, moe_gate
from deepinfer.kernels.triton.act_quant import interpreting, quantise_rows
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

ROUTE_BLOCK_M = 8  # slots per routing block of fp4_moe's decode forms (fp4_moe_mma / fp4_moe_tma TOKENS)
FUSED_ROUTE_MAX_ROWS = 1  # rows (tokens) the fused launch takes; more go to the unfused ops. H100, graph replay,
# PDL on (benchmarks/bench_moe_route.py, results/bench_moe_route_h100_2026-12-07_s33.log), fused against unfused:
# V4-Flash 1 row 8.3 vs 9.7 us, 2 rows 11.6 vs 10.4, 4 rows 18.4 vs 11.0 (V4.1-Flash 10.3 vs 11.8, 15.3 vs 13.2,
# 27.2 vs 17.1): the last program runs the rows' gates one after the other. The kernel itself takes up to
# FUSED_KERNEL_MAX_ROWS (tests, the benchmark)
FUSED_KERNEL_MAX_ROWS = 4  # the GEMV tiles of up to 4 rows run 4 warps (`_gemv_tiles`), the gate kernel's count
FUSED_WARPS = 4
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # device -> int32 [1], 0 between launches (a device named two
# ways, "cuda" and "cuda:0", gets two counters: harmless, each is back at 0 after every launch)


def _counter(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@fast_launch
@triton.jit
def _route_kernel(x_ptr, w_ptr, logits_ptr, bias_ptr, tid_ptr, ids_ptr, wout_ptr, idx_ptr, sorted_ptr,
                  block_expert_ptr, xa_ptr, counter_ptr, M, E, D, stride_xm, stride_wn, stride_tid, stride_xam,
                  route_scale, norm_eps, n_blocks, n_groups,
                  M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TOPK: tl.constexpr,
                  K_P2: tl.constexpr, E_P2: tl.constexpr, AB: tl.constexpr, ACT_ITERS: tl.constexpr,
                  HASH: tl.constexpr, BM: tl.constexpr, SP: tl.constexpr, EP: tl.constexpr,
                  NBP: tl.constexpr, TP: tl.constexpr, PACKED: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # 1. this program's logits (the GEMV's tiles and code: its bits)
    bf16_gemv.gemv_program(x_ptr, w_ptr, logits_ptr, pid, M, E, D, stride_xm, stride_wn, E, 1.0, M_PAD, BN, BK,
                           False)
    # 2. act_quant of groups pid, pid + nprog, ... of the M x D / AB (as _act_quant_kernel's DEQUANT form)
    c = tl.arange(0, AB)
    for it in tl.static_range(ACT_ITERS):
        grp = pid + it * nprog
        if grp < M * n_groups:
            row = (grp // n_groups).to(tl.int64)
            cols = (grp % n_groups) * AB + c
            xv = tl.load(x_ptr + row * stride_xm + cols[None, :]).to(tl.float32)  # [1, AB]
            q, scale = quantise_rows(xv)
            tl.store(xa_ptr + row * stride_xam + cols[None, :], (q.to(tl.float32) * scale[:, None]).to(tl.bfloat16))
    # 3. arrive; the last program to arrive routes every row
    tl.debug_barrier()  # every thread's logits stored before the one atomic releases them
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:
        for t in range(M):  # (t * E and t * TOPK fit int32: M <= FUSED_KERNEL_MAX_ROWS)
            if HASH:
                tid = tl.load(ids_ptr + t).to(tl.int64)
                moe_gate.hash_gate_row(logits_ptr + t * E, tid_ptr, tid, wout_ptr + t * TOPK,
                                       idx_ptr + t * TOPK, stride_tid, route_scale, TOPK, K_P2, ".cg")
            else:
                moe_gate.gate_row(logits_ptr + t * E, bias_ptr, wout_ptr + t * TOPK, idx_ptr + t * TOPK, E,
                                  route_scale, norm_eps, TOPK, E_P2, K_P2, ".cg", PACKED)
        tl.debug_barrier()  # the ids stored before the slot blocks read them
        fp4_moe.align_small(idx_ptr, sorted_ptr, block_expert_ptr, M * TOPK, n_blocks, E, BM, SP, EP, NBP, TP,
                            ".cg")
        tl.store(counter_ptr, 0)  # for the next launch (every program has arrived)


def fused_route_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `moe_route` fuses a call: CUDA (or the interpreter), 1..FUSED_ROUTE_MAX_ROWS rows and a
    contiguous bf16 gate weight the GEMV takes at that row count."""
    m = x.shape[0]
    return ((x.is_cuda or interpreting()) and 0 < m <= min(FUSED_ROUTE_MAX_ROWS, FUSED_KERNEL_MAX_ROWS)
            and weight.dtype == torch.bfloat16 and weight.is_contiguous() and bf16_gemv.takes_shape(m, weight.shape[0]))


def launch_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float,
                 norm_eps: float, act_block: int, tid2eid: torch.Tensor | None,
                 ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, PreRouted]:
    """The fused launch on checked arguments (the op checks; benchmarks and tests call this directly); the
    logits are the gate's as they are (gate_temp 1)."""
    m, d = x.shape
    e = weight.shape[0]
    if m > FUSED_KERNEL_MAX_ROWS:
        raise ValueError(f"moe_route: the fused kernel takes up to {FUSED_KERNEL_MAX_ROWS} rows, got {m}")
    if d % act_block:
        raise ValueError(f"moe_route: D={d} must be a multiple of act_block {act_block}")
    x = x if x.stride(1) == 1 else x.contiguous()
    dev = x.device
    tiles = bf16_gemv._gemv_tiles(m, e, d)
    if tiles["num_warps"] != FUSED_WARPS:
        raise ValueError(f"moe_route: the GEMV tiles of {m} rows run {tiles['num_warps']} warps, the fused "
                         f"kernel {FUSED_WARPS}")
    nprog = cdiv(e, tiles["BN"])
    n_slots = m * topk
    n_blocks = fp4_moe.n_routing_blocks(n_slots, e, ROUTE_BLOCK_M)
    n_groups = d // act_block
    logits = torch.empty((m, e), dtype=torch.float32, device=dev)
    weights = torch.empty((m, topk), dtype=torch.float32, device=dev)
    indices = torch.empty((m, topk), dtype=torch.int64, device=dev)
    sorted_slots = torch.empty(n_blocks * ROUTE_BLOCK_M, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    xa = torch.empty((m, d), dtype=torch.bfloat16, device=dev)
    hashed = tid2eid is not None
    tid = tid2eid.contiguous() if hashed else indices  # (an unread placeholder pointer when not hashed)
    _route_kernel[(nprog,)](
        x, weight, logits, bias if bias is not None else logits, tid, ids.contiguous() if hashed else indices,
        weights, indices, sorted_slots, block_expert, xa, _counter(dev), m, e, d, x.stride(0), weight.stride(0),
        tid.stride(0) if hashed else 0, xa.stride(0), float(route_scale), float(norm_eps),
        n_blocks, n_groups, M_PAD=next_power_of_2(m), BN=tiles["BN"], BK=tiles["BK"], TOPK=topk,
        K_P2=next_power_of_2(topk), E_P2=next_power_of_2(e), AB=act_block,
        ACT_ITERS=cdiv(m * n_groups, nprog), HASH=hashed, BM=ROUTE_BLOCK_M, PACKED=env.gate_packed_key(),
        **fp4_moe.align_small_sizes(n_slots, e, n_blocks, ROUTE_BLOCK_M), num_warps=FUSED_WARPS,
        num_stages=tiles["num_stages"])
    return weights, indices, PreRouted(sorted_slots, block_expert, ROUTE_BLOCK_M, xa, act_block)


def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float,
              norm_eps: float = 0.0, gate_temp: float = 1.0, act_block: int = 128,
              tid2eid: torch.Tensor | None = None, ids: torch.Tensor | None = None):
    """Op "moe_route" (see the module docstring and the twin `official_fused.moe_route`)."""
    official_fused.check_moe_route(x, weight, bias, topk, tid2eid, ids)
    if (fused_route_takes(x, weight) and topk * x.shape[0] <= fp4_moe.SMALL_ROUTING_SLOTS and gate_temp == 1.0
            and env.fused_route_enabled()):
        return launch_fused(x, weight, bias, topk, route_scale, norm_eps, act_block, tid2eid, ids)
    from deepinfer import kernels

    w, idx = official_fused.route_steps(kernels.get("linear_f32", "cuda"), moe_gate.moe_gate_sqrtsoftplus,
                                        moe_gate.moe_gate_hash_sqrtsoftplus, x, weight, bias, topk, route_scale,
                                        norm_eps, gate_temp, tid2eid, ids)
    return w, idx, None


REGISTRATIONS = {"moe_route": moe_route}
