"""Triton sparse attention with the sink over the STORED caches: the CUDA twin of
`kernels.official_fused.sparse_attn_sink_paged`, for the batched decode step.

Owns: one kernel that reads each index row's KV entries straight from the packed FP8 window ring and
compressed cache (layouts of codec fp8_e8m0: E4M3 values x E8M0 scale per `block` channels, an optional raw
bf16 rope tail), decodes them in registers (exact: an E4M3 value times a power of two is a bf16 value, the
same bits `kv_pack.kv_decode` writes) and runs `sparse_attn.attend_block`'s online softmax on them. It
replaces, per decode layer, the ring gather, the compressed-row gather, two decode passes and the pool
concatenation (each a full write and re-read of the bf16 rows) with one read of the packed bytes.
Rows: index value r < ring rows is ring row r (the ring [slots, window, bytes] flattened), r >= that is
compressed row r - ring rows, -1 skips. Unsplit, the same rows in the same order and the same tiles
(`_block_h`, blocks of 64 indices) as `sparse_attn_sink_triton` over a decoded pool, so the same bits.
Small batches split the index row over programs (flash-decoding, `split_plan`): each split runs the online
softmax over its whole blocks in order and writes its state, `_combine_splits_kernel` merges the states in
split order with the sink. P is then rounded to bf16 against a split's running max instead of the row's, so
the last bits move (rel_err ~1.3e-3 against the twin where the unsplit kernel is at ~1e-4; both judged against
the oracle's noise floors in the engine tests; tests/test_kernels_attn_paged.py).
Layouts the kernel does not decode (bf16 caches, FP4 latents) go through gather + `kv_decode` + the pool kernel.
Must not: import `cache` (the layout object is passed in), reorder an index row, or be imported off CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.official_fused import paged_rows
from deepinfer.kernels.triton.kv_pack import e8m0_value, kv_decode
from deepinfer.kernels.triton import norm_hc
from deepinfer.kernels.triton.launch import cdiv, fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter
from deepinfer.kernels.triton.rope import rotate_tail
from deepinfer.kernels.triton.sparse_attn import (SPARSE_ATTN_BLOCK, _block_h, _check, _interpreting,
                                                  attend_block, finish_heads, finish_heads_rope, head_block,
                                                  sparse_attn_sink_triton)


@triton.jit
def _paged_block(ring_ptr, comp_ptr, ring16_ptr, comp16_ptr, idx_ptr, t, stride_it, start, K, n_ring,
                 BPT: tl.constexpr, QDIM: tl.constexpr, SBLOCK: tl.constexpr, D: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Index columns [start, start + BLOCK_K) of row t, decoded in registers -> (kv [BLOCK_K, D] bf16, valid)."""
    dims = tl.arange(0, D)
    quant = dims < QDIM  # E4M3 channels; the rest (D - QDIM) is the raw bf16 rope tail
    nb = tl.arange(0, D // SBLOCK)  # scale blocks over all D channels: the tail's read as 2**0 (masked)
    offs = start + tl.arange(0, BLOCK_K)
    rows = tl.load(idx_ptr + t * stride_it + offs, mask=offs < K, other=-1).to(tl.int64)
    valid = rows >= 0
    in_ring = rows < n_ring
    entry = tl.where(in_ring, rows, rows - n_ring) * BPT  # byte offset of the entry in its cache
    base = tl.where(in_ring, ring_ptr, comp_ptr) + entry
    m = valid[:, None] & quant[None, :]
    v = tl.load(base[:, None] + dims[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = e8m0_value(tl.load(base[:, None] + (QDIM + 2 * (D - QDIM)) + nb[None, :],
                           mask=valid[:, None] & (nb < QDIM // SBLOCK)[None, :], other=127))
    kv = tl.reshape(tl.reshape(v, (BLOCK_K, D // SBLOCK, SBLOCK)) * s[:, :, None], (BLOCK_K, D)).to(tl.bfloat16)
    if QDIM < D:  # the rope tail: ROPE raw bf16 at byte QDIM of the entry (the int16 views), loaded as its
        # own [BLOCK_K, ROPE] tile (a masked [BLOCK_K, D] load would stage 8x the bytes in shared memory)
        # and put in place as the last of D // ROPE column chunks by a broadcast select
        ROPE: tl.constexpr = D - QDIM
        base16 = tl.where(in_ring, ring16_ptr, comp16_ptr) + entry // 2
        raw = tl.load(base16[:, None] + QDIM // 2 + tl.arange(0, ROPE)[None, :], mask=valid[:, None],
                      other=0).to(tl.bfloat16, bitcast=True)
        last = (tl.arange(0, D // ROPE) == D // ROPE - 1)[None, :, None]
        kv = tl.reshape(tl.where(last, raw[:, None, :], tl.reshape(kv, (BLOCK_K, D // ROPE, ROPE))), (BLOCK_K, D))
    return kv, valid


@triton.jit
def _norm_rope_heads(q, t, dims, cos_ptr, sin_ptr, eps, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     HALF: tl.constexpr):
    """q [BLOCK_H, D] bf16 raw heads of token t -> the per-head RMSNorm (`norm_hc.head_rms_factor`: the bf16
    torch ops' roundings), then the RoPE of the last 2 HALF channels by the token's cos / sin (fp32, rounded
    to bf16): `attn_norm_rope._head_rms_norm_rope_kernel`'s arithmetic on the same values, so the same bits
    but where the fp32 sum of squares, summed over this tile's layout instead of that kernel's, rounds to
    another bf16 mean (`norm_hc.head_rms_norm`'s note). The pass-through pairs are kept as normed, not
    rotated by cos 1 / sin 0 (which could turn a -0.0 into +0.0)."""
    x = q.to(tl.float32)
    normed = (x * norm_hc.head_rms_factor(x, D, eps)[:, None]).to(tl.bfloat16)
    rot = rotate_tail(normed.to(tl.float32), t, cos_ptr, sin_ptr, BLOCK_H, D, HALF, False).to(tl.bfloat16)
    return tl.where((dims >= D - 2 * HALF)[None, :], rot, normed)


@fast_launch
@triton.jit
def _sparse_attn_paged_kernel(
    q_ptr, ring_ptr, comp_ptr, ring16_ptr, comp16_ptr, sink_ptr, idx_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, cos_ptr, sin_ptr,
    H, K, n_ring, scale, initial_max, chunk, qnorm_eps,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh,
    BPT: tl.constexpr, QDIM: tl.constexpr, SBLOCK: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    ROPE_HALF: tl.constexpr, QNORM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Program axis 2 = split s takes index columns [s * chunk, (s + 1) * chunk) in order. SPLIT False (one
    split): the sink, bf16 out (ROPE_HALF > 0: then the inverse RoPE of each head's last 2 ROPE_HALF
    channels, `finish_heads_rope`). SPLIT True: writes its online-softmax state (running max, sum, the
    unnormalised fp32 acc) for `_combine_splits_kernel`. QNORM (with ROPE_HALF > 0): q is the raw query
    projection; each head's RMSNorm (eps qnorm_eps) and the RoPE of its tail at token t come first
    (`_norm_rope_heads`: `head_rms_norm_rope`'s arithmetic), in every program that reads the heads."""
    pdl_enter(PDL)
    t, heads, hmask, dims, q, run_max, run_sum, acc = head_block(q_ptr, H, stride_qt, stride_qh, initial_max, D,
                                                                  BLOCK_H)
    if QNORM:
        q = _norm_rope_heads(q, t, dims, cos_ptr, sin_ptr, qnorm_eps, D, BLOCK_H, ROPE_HALF)
    lo = tl.program_id(2) * chunk  # without a split: one program, chunk = K rounded up to whole blocks
    for start in range(0, chunk, BLOCK_K):  # the last split may walk masked blocks past K
        kv, valid = _paged_block(ring_ptr, comp_ptr, ring16_ptr, comp16_ptr, idx_ptr, t, stride_it, lo + start, K,
                                 n_ring, BPT, QDIM, SBLOCK, D, BLOCK_K)
        run_max, run_sum, acc = attend_block(q, kv, valid, run_max, run_sum, acc, scale, INTERPRET)
    if SPLIT:
        row = (t * tl.num_programs(2) + tl.program_id(2)) * H + heads  # [T, S, H] state, [T, S, H, D] acc
        tl.store(part_max_ptr + row, run_max, mask=hmask)
        tl.store(part_sum_ptr + row, run_sum, mask=hmask)
        tl.store(part_acc_ptr + row[:, None] * D + dims[None, :], acc, mask=hmask[:, None])
    elif ROPE_HALF > 0:
        finish_heads_rope(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh,
                          cos_ptr, sin_ptr, D, BLOCK_H, ROPE_HALF)
    else:
        finish_heads(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh)


@triton.jit
def _split_state(part_acc_ptr, part_max_ptr, part_sum_ptr, t, S, s, H, heads, hmask, dims, big, D: tl.constexpr):
    """Split s's state of the heads (nothing past S): (its weight exp(m_s - M), acc [heads, D], sum)."""
    live = hmask & (s < S)
    row = (t * S + s) * H + heads
    w = tl.exp(tl.load(part_max_ptr + row, mask=live, other=-1e30) - big)
    acc = tl.load(part_acc_ptr + row[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
    return w, acc, tl.load(part_sum_ptr + row, mask=live, other=0.0)


@triton.jit
def _add_split(acc, total, w, a, n, inside):
    """acc += a w, total += n w for a split inside the row (past S: unchanged, not + 0.0, which makes -0.0 +0.0)."""
    return tl.where(inside, acc + a * w[:, None], acc), tl.where(inside, total + n * w, total)


@fast_launch
@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, H, S,
                           stride_ot, stride_oh, D: tl.constexpr, BLOCK_H: tl.constexpr, ROPE_HALF: tl.constexpr,
                           UNROLL: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Merge a row's S split states: M = the largest running max, every state rescaled by exp(m_s - M) and
    summed in split order, the sink in the denominator (exp(sink - M), as `finish_heads`). Split states start
    from a finite max (the launcher's max(initial_max, -1e30)), so a split whose columns are all -1 holds
    m_s = -1e30, sum 0, acc 0 and adds exactly nothing. UNROLL splits' loads are issued together, then added
    in split order (a split past S leaves the sums as they are, not + 0.0, which would turn -0.0 into +0.0):
    one split a trip left each trip a wait on L2 (the sm_90 build: 4-10 loads, then their FMAs)."""
    pdl_enter(PDL)
    t = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dims = tl.arange(0, D)
    big = tl.full((BLOCK_H,), -1e30, tl.float32)
    for s in range(S):
        big = tl.maximum(big, tl.load(part_max_ptr + (t * S + s) * H + heads, mask=hmask, other=-1e30))
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    for s0 in range(0, S, UNROLL):  # UNROLL 1, 2 or 4 (the launcher's), spelled out: Triton has no tensor lists
        w0, a0, n0 = _split_state(part_acc_ptr, part_max_ptr, part_sum_ptr, t, S, s0, H, heads, hmask, dims, big, D)
        if UNROLL >= 2:
            w1, a1, n1 = _split_state(part_acc_ptr, part_max_ptr, part_sum_ptr, t, S, s0 + 1, H, heads, hmask, dims,
                                      big, D)
        if UNROLL == 4:
            w2, a2, n2 = _split_state(part_acc_ptr, part_max_ptr, part_sum_ptr, t, S, s0 + 2, H, heads, hmask, dims,
                                      big, D)
            w3, a3, n3 = _split_state(part_acc_ptr, part_max_ptr, part_sum_ptr, t, S, s0 + 3, H, heads, hmask, dims,
                                      big, D)
        acc, total = _add_split(acc, total, w0, a0, n0, s0 < S)
        if UNROLL >= 2:
            acc, total = _add_split(acc, total, w1, a1, n1, s0 + 1 < S)
        if UNROLL == 4:
            acc, total = _add_split(acc, total, w2, a2, n2, s0 + 2 < S)
            acc, total = _add_split(acc, total, w3, a3, n3, s0 + 3 < S)
    if ROPE_HALF > 0:
        finish_heads_rope(acc, big, total, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh, cos_ptr,
                          sin_ptr, D, BLOCK_H, ROPE_HALF)
    else:
        finish_heads(acc, big, total, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh)


def _fused(layout, d: int) -> bool:
    """Layouts this kernel decodes: fp8_e8m0 with a power-of-two scale block that also tiles the rope tail,
    a power-of-two tail dividing d (V4: 64 of 512; V4.1's window has none), even byte offsets for the int16
    view, and d = the layout's channels."""
    if layout is None or layout.codec != "fp8_e8m0" or layout.dim != d:
        return False
    blk, rope = layout.block, layout.raw_dim
    tail_ok = rope == 0 or (rope & (rope - 1) == 0 and d % rope == 0)  # the tail is one column chunk of d
    return (blk & (blk - 1) == 0 and d % blk == 0 and layout.quant_dim % blk == 0 and tail_ok
            and layout.bytes_per_token % 2 == 0 and layout.quant_dim % 2 == 0)


def _check_stores(ring: torch.Tensor, comp: torch.Tensor | None, layout) -> None:
    width = layout.bytes_per_token
    for name, x in (("ring", ring), ("comp", comp)):
        if x is None:
            continue
        if x.dtype != torch.uint8 or x.shape[-1] != width or not x.is_contiguous():
            raise ValueError(f"sparse_attn_sink_paged: {name} must be contiguous uint8 [..., {width}] "
                             f"({layout.name}), got {x.dtype} {tuple(x.shape)}")
        if not x.is_cuda and not _interpreting():
            raise ValueError(f"sparse_attn_sink_paged: {name} is on {x.device}, the Triton kernel needs CUDA tensors")


def split_plan(T: int, K: int, H: int) -> tuple[int, int]:
    """(heads per program, index columns per split; 0 = no split) for T query rows of K indices over H heads.
    Without a split a decode batch is T * H / 16 programs, a handful of SMs at small T, each walking the
    whole index row; splitting the row (flash-decoding) spreads it over the GPU at the price of one fp32
    state per split and a combine launch. Programs of 16 heads each decode the same kv blocks again (4x the
    decode work at 64 heads), so they split only while the grid stays near one wave; past that, programs
    of all the heads take two blocks each. Measured on the H200 at V4-Flash dims (H=64, d=512,
    benchmarks/bench_decode_attn.py, results/decode_attn_h200_2026-12-03_s9.log): 640 indices at T=1
    71.7 -> 19.9 us, T=8 74.0 -> 31.7, T=32 75.3 -> 57.5; 192 indices at T=1 25.5 -> 16.4; from T=64 the
    unsplit grid is as fast or faster (T=128, 640 indices: 89 us unsplit, 147-224 split). The plan
    depends on T, so a row's last bits may differ between batch sizes (as every flash-decoding engine's)."""
    blocks = cdiv(K, SPARSE_ATTN_BLOCK)
    narrow = cdiv(H, 16)  # head blocks of 16
    # one head block (<= 16 heads, e.g. a rank of 8-way tensor parallelism): no decode is repeated across
    # head blocks, so it splits to larger grids and batches (H=8: T=64, 640 indices 72 -> 57 us; T=128 not)
    max_t, limit = (SPLIT_MAX_T, SPLIT_WAVE) if narrow > 1 else (2 * SPLIT_MAX_T, 4 * SPLIT_WAVE)
    if blocks <= 1 or T >= max_t:
        return _block_h(T, H), 0
    for per in (1, 2) if narrow > 1 else (1, 2, 4):  # blocks per split
        splits = cdiv(blocks, per)
        if splits > 1 and T * narrow * splits <= limit:
            return 16, cdiv(blocks, splits) * SPARSE_ATTN_BLOCK  # equal whole blocks per split
    splits = cdiv(blocks, 2)
    if narrow > 1 and splits > 1 and splits >= narrow:  # no fewer programs than the unsplit grid's
        return (32 if H <= 32 else 64), cdiv(blocks, splits) * SPARSE_ATTN_BLOCK
    return _block_h(T, H), 0


SPLIT_MAX_T, SPLIT_WAVE = 64, 128


def sparse_attn_sink_paged_triton(q: torch.Tensor, ring: torch.Tensor, comp: torch.Tensor | None, layout,
                                  sink: torch.Tensor, idx: torch.Tensor, scale: float,
                                  initial_max: float = float("-inf"), block_h: int | None = None,
                                  num_warps: int = 8, num_stages: int = 1,
                                  chunk: int | None = None, rope_table: torch.Tensor | None = None,
                                  q_norm_eps: float | None = None) -> torch.Tensor:
    """Same contract as `official_fused.sparse_attn_sink_paged` (q [T, H, d] bf16, ring [slots, window, w],
    comp [rows, w] or None, idx [T, K] of ring-then-compressed rows, -1 = skip) -> [T, H, d] bf16.
    block_h / num_warps / num_stages / chunk (index columns per split, 0 = none; default `split_plan`):
    launch knobs for benchmarks (DEEPINFER_DECODE_ATTN_SPLIT=off: no split by default). Defaults from sm_90
    builds (no GPU needed, scripts/sass_sm90.py): the [64, d] tile is decoded in registers, so 4 warps spill
    (16 heads: 255 registers + 560 B of stack) where 8 do not (227 registers), and software pipelining
    (stages >= 2) stages the masked [64, d] byte and int16 tiles in shared memory: 246 KB at 16 heads, past
    the 227 KB a block may have; one stage takes 147 KB.
    rope_table: `rope.rope_table32`'s fp32 [2, T, half] of the tokens' positions: then each head's last
    2 * half output channels are rotated back (the inverse RoPE) in the kernel's epilogue
    (`sparse_attn_sink_paged_rope`). q_norm_eps (with rope_table): q is the raw query projection, and each
    head's RMSNorm and the RoPE of its tail by the same table run on the kernel's q load (`_norm_rope_heads`):
    `head_rms_norm_rope`'s launch taken off the decode step's main chain."""
    if q.dim() != 3 or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_attn_sink_paged: want q [T, H, d] and idx [T, K], got {tuple(q.shape)}, "
                         f"{tuple(idx.shape)}")
    T, H, d = q.shape
    K = idx.shape[1]
    if not _fused(layout, d):
        # gather + decode to a pool, then the pool kernel: the same rows and order
        stored = paged_rows(ring, comp, idx)
        kv = stored if layout is None else kv_decode(layout, stored)
        pool_idx = torch.arange(T * K, device=idx.device, dtype=torch.int32).view(T, -1)
        if rope_table is not None or q_norm_eps is not None:
            raise ValueError(f"sparse_attn_sink_paged: rope_table and q_norm_eps need a layout the kernel decodes, "
                             f"got {getattr(layout, 'name', layout)} (sparse_attn_sink_paged_rope runs them apart)")
        return sparse_attn_sink_triton(q, kv.reshape(-1, d), sink, torch.where(idx >= 0, pool_idx, -1), scale,
                                       initial_max)
    _check_stores(ring, comp, layout)
    _check(q, None, sink, idx)
    half = 0 if rope_table is None else rope_table.shape[-1]
    if rope_table is not None and (rope_table.dtype != torch.float32 or tuple(rope_table.shape) != (2, T, half)
                                   or not rope_table.is_contiguous() or 2 * half > d or half & (half - 1)):
        raise ValueError(f"sparse_attn_sink_paged: rope_table {rope_table.dtype} {tuple(rope_table.shape)} is not "
                         f"rope_table32's fp32 [2, {T}, half] (a power of two <= d/2 = {d // 2})")
    if q_norm_eps is not None and not half:
        raise ValueError("sparse_attn_sink_paged: q_norm_eps needs the rope_table of the tokens' positions (the "
                         "query's RoPE after its norm)")
    cos, sin = (rope_table[0], rope_table[1]) if half else (sink, sink)  # (never read without ROPE_HALF)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = PagedLaunch.make("sparse_attn_sink_paged", q, idx, sink, out, chunk, block_h, initial_max)
    if T == 0:
        return out
    comp = ring if comp is None or comp.shape[0] == 0 else comp  # no compressed rows: every index is a ring row
    _sparse_attn_paged_kernel[plan.grid](
        plan.q, ring, comp, ring.view(torch.int16), comp.view(torch.int16), plan.sink, plan.idx, out,
        plan.part_acc, plan.part_max, plan.part_sum, cos, sin, H, K, ring.numel() // layout.bytes_per_token,
        float(scale), plan.initial_max, plan.chunk, 0.0 if q_norm_eps is None else float(q_norm_eps),
        plan.q.stride(0), plan.q.stride(1), K, out.stride(0), out.stride(1), BPT=layout.bytes_per_token,
        QDIM=layout.quant_dim, SBLOCK=layout.block, D=d, BLOCK_H=plan.bh, BLOCK_K=SPARSE_ATTN_BLOCK, SPLIT=plan.split,
        INTERPRET=_interpreting(), ROPE_HALF=half, QNORM=q_norm_eps is not None, num_warps=num_warps,
        num_stages=num_stages)
    plan.combine(out, cos, sin, half)
    return out


@dataclass
class PagedLaunch:
    """What both paged kernels' launchers share (this module's and `sparse_attn_paged_mixed`'s): the heads per
    program and the split of the index row (`split_plan`, or none with DEEPINFER_DECODE_ATTN_SPLIT=off; a
    `chunk` / `block_h` given overrides), the split states, the kernel's chunk and initial max arguments, and
    the combine launch."""

    q: torch.Tensor  # (unit last stride)
    sink: torch.Tensor  # fp32
    idx: torch.Tensor  # the index rows as they come when int32/int64 and contiguous (the kernel widens each)
    bh: int
    grid: tuple[int, int, int]  # (head blocks, T, splits)
    chunk: int  # index columns a program walks (the whole row rounded up to blocks without a split)
    initial_max: float  # split states start finite (`_combine_splits_kernel`'s note)
    part_max: torch.Tensor  # [T, S, H] running max and sum, [T, S, H, d] unnormalised acc (out: unused unsplit)
    part_sum: torch.Tensor
    part_acc: torch.Tensor

    @property
    def split(self) -> bool:
        return self.grid[2] > 1

    @staticmethod
    def make(op: str, q: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, out: torch.Tensor, chunk: int | None,
             block_h: int | None, initial_max: float) -> "PagedLaunch":
        T, H, d = q.shape
        K = idx.shape[1]
        plan_h, plan_chunk = split_plan(T, K, H) if env.decode_attn_split() == "auto" else (_block_h(T, H), 0)
        chunk = plan_chunk if chunk is None else chunk
        if chunk < 0 or chunk % SPARSE_ATTN_BLOCK:
            raise ValueError(f"{op}: chunk {chunk} must be a non-negative multiple of {SPARSE_ATTN_BLOCK}")
        bh = block_h or (plan_h if chunk == plan_chunk else _block_h(T, H))
        S = cdiv(K, chunk) if chunk else 1
        f32 = dict(dtype=torch.float32, device=q.device)
        split = S > 1
        # the index rows as they come (int64 from the decode step's row ops): no int32 copy, which was one more
        # launch per layer on the decode step's main chain
        rows = idx if idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous() else idx.to(torch.int32).contiguous()
        return PagedLaunch(
            q if q.stride(-1) == 1 else q.contiguous(), sink.to(torch.float32).contiguous(), rows, bh,
            (cdiv(H, bh), T, S), chunk if split else cdiv(K, SPARSE_ATTN_BLOCK) * SPARSE_ATTN_BLOCK,
            max(float(initial_max), -1e30) if split else float(initial_max),
            torch.empty(T, S, H, **f32) if split else out, torch.empty(T, S, H, **f32) if split else out,
            torch.empty(T, S, H, d, **f32) if split else out)

    def combine(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int,
                heads: int | None = None) -> None:
        """Merge the split states into out (nothing without a split); `heads` per program (default
        `combine_heads`: every head's merge is its own, so any count gives the same bits)."""
        if self.split:
            T, H, d = out.shape
            bh = heads or combine_heads(T, H)
            _combine_splits_kernel[(cdiv(H, bh), T)](
                self.part_acc, self.part_max, self.part_sum, self.sink, out, cos, sin, H, self.grid[2], out.stride(0),
                out.stride(1), D=d, BLOCK_H=bh, ROPE_HALF=half, UNROLL=min(4, max(1, COMBINE_LOADS // bh)), num_warps=4)


def sparse_attn_sink_paged_rope(q: torch.Tensor, ring: torch.Tensor, comp: torch.Tensor | None, layout,
                                sink: torch.Tensor, idx: torch.Tensor, scale: float, positions: torch.Tensor,
                                freqs: torch.Tensor, table: torch.Tensor | None,
                                q_norm_eps: float | None = None) -> torch.Tensor:
    """Op "sparse_attn_sink_paged_rope" (twin: `official_fused.sparse_attn_sink_paged_rope`): the decode
    attention's output with the inverse RoPE of each head's tail at `positions` applied in the kernel's
    epilogue (the unsplit kernel's or the split combine's): one launch less on the decode step's main chain.
    q_norm_eps: q is the raw query projection, normed per head and rotated at `positions` on the kernel's
    q load (`head_rms_norm_rope` first, in its own launch, where the fusions are off or the layout is not
    the kernel's): one launch less again. `table`: `rope.rope_table32(positions, freqs)` or None (built here)."""
    from deepinfer.kernels.triton import attn_norm_rope, rope

    if table is None:
        table = rope.rope_table32(positions, freqs)
    if table.shape[-1] != freqs.shape[0]:
        raise ValueError(f"sparse_attn_sink_paged_rope: table {tuple(table.shape)} is not for {freqs.shape[0]} "
                         f"frequencies")
    fused = env.attn_fusions_enabled() and _fused(layout, q.shape[-1])
    if q_norm_eps is not None and not (fused and q.dtype == torch.bfloat16 and env.attn_qnorm_in_kernel()):
        q = attn_norm_rope.head_rms_norm_rope(q, q_norm_eps, positions, freqs, table)
        q_norm_eps = None
    if not fused:  # the attention, then rope32
        o = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale)
        return rope.rope32(o, positions, freqs, True, table=table, inplace=True)
    return sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, rope_table=table,
                                         q_norm_eps=q_norm_eps)


COMBINE_HEADS = (8, 4, 2)  # heads per combine program, the most first: [<= 8, 512] fp32 over 4 warps
COMBINE_MIN_PROGRAMS = 256  # ~2 a SM
COMBINE_LOADS = 8  # heads x splits a combine program loads at once (UNROLL = this / heads: 4 splits of 2 heads)


def combine_heads(T: int, H: int) -> int:
    """Heads per combine program: the most of COMBINE_HEADS that still gives COMBINE_MIN_PROGRAMS programs,
    else the fewest. A program reads its heads' S fp32 states from L2 (S x heads x d x 4 bytes: 160 KB at
    b1's 10 splits of 8 heads x 512) one split after the other, each a wait on L2: at b1's T = 1 the 8
    programs of 8 heads each took 4-4.5 us a layer of the H100's b1 critical path (the thirty-fourth session's
    timeline). With 2 heads, 32 programs read 40 KB each, 4 splits' loads at once (COMBINE_LOADS)."""
    for bh in COMBINE_HEADS:
        if T * cdiv(H, bh) >= COMBINE_MIN_PROGRAMS:
            return bh
    return COMBINE_HEADS[-1]


REGISTRATIONS = {"sparse_attn_sink_paged": sparse_attn_sink_paged_triton,
                 "sparse_attn_sink_paged_rope": sparse_attn_sink_paged_rope}
