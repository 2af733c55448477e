"""Triton sparse attention with the sink over the STORED caches: the CUDA twin of
`kernels.official_fused.sparse_attn_sink_paged`, for the batched decode step.

Owns: one kernel that reads each index row's KV entries straight from the packed FP8 window ring and
compressed cache (layouts of codec fp8_e8m0: E4M3 values x E8M0 scale per `block` channels, an optional raw
bf16 rope tail), decodes them in registers (exact: an E4M3 value times a power of two is a bf16 value, the
same bits `kv_pack.kv_decode` writes) and runs `sparse_attn.attend_block`'s online softmax on them. It
replaces, per decode layer, the ring gather, the compressed-row gather, two decode passes and the pool
concatenation (each a full write and re-read of the bf16 rows) with one read of the packed bytes.
Rows: index value r < ring rows is ring row r (the ring [slots, window, bytes] flattened), r >= that is
compressed row r - ring rows, -1 skips. Same rows in the same order and the same tiles (`_block_h`, blocks
of 64 indices) as `sparse_attn_sink_triton` over a decoded pool, so the same bits (tests/test_kernels_attn_paged.py).
Layouts the kernel does not decode (bf16 caches, FP4 latents), and a few queries over long index rows
(`SMALL_T`, `LONG_K`), go through gather + `kv_decode` + the pool kernel.
Must not: import `cache` (the layout object is passed in), reorder an index row, or be imported off CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.official_fused import paged_rows
from deepinfer.kernels.triton.kv_pack import e8m0_value, kv_decode
from deepinfer.kernels.triton.sparse_attn import (SPARSE_ATTN_BLOCK, _block_h, _check, _interpreting,
                                                  attend_block, finish_heads, head_block, sparse_attn_sink_triton)


# A few queries over long index rows go through the pool instead: with T * H / 16 programs the in-register
# decode runs on a handful of SMs (H200, V4-Flash dims, benchmarks/bench_decode_attn.py, 2026-12-02: 640
# indices at T=1 paged 69 us vs pool route 49, T=8 71 vs 59; T=32 73 vs 109; 192 indices at T=1 23 vs 30,
# T=8 26 vs 29)
SMALL_T, LONG_K = 8, 384


@triton.jit
def _sparse_attn_paged_kernel(
    q_ptr, ring_ptr, comp_ptr, ring16_ptr, comp16_ptr, sink_ptr, idx_ptr, out_ptr,
    H, K, n_ring, scale, initial_max,
    stride_qt, stride_qh, stride_it, stride_ot, stride_oh,
    BPT: tl.constexpr, QDIM: tl.constexpr, SBLOCK: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    t, heads, hmask, dims, q, run_max, run_sum, acc = head_block(q_ptr, H, stride_qt, stride_qh, initial_max, D,
                                                                  BLOCK_H)
    quant = dims < QDIM  # E4M3 channels; the rest (D - QDIM) is the raw bf16 rope tail
    nb = tl.arange(0, D // SBLOCK)  # scale blocks over all D channels: the tail's read as 2**0 (masked)
    for start in range(0, K, BLOCK_K):
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
        run_max, run_sum, acc = attend_block(q, kv, valid, run_max, run_sum, acc, scale, INTERPRET)
    finish_heads(acc, run_max, run_sum, sink_ptr, out_ptr, t, heads, hmask, dims, stride_ot, stride_oh)


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


def sparse_attn_sink_paged_triton(q: torch.Tensor, ring: torch.Tensor, comp: torch.Tensor | None, layout,
                                  sink: torch.Tensor, idx: torch.Tensor, scale: float,
                                  initial_max: float = float("-inf"), block_h: int | None = None,
                                  num_warps: int = 8, num_stages: int = 1) -> torch.Tensor:
    """Same contract as `official_fused.sparse_attn_sink_paged` (q [T, H, d] bf16, ring [slots, window, w],
    comp [rows, w] or None, idx [T, K] of ring-then-compressed rows, -1 = skip) -> [T, H, d] bf16.
    block_h / num_warps / num_stages: launch knobs for benchmarks. Defaults from sm_90 builds (no GPU
    needed, scripts/sass_sm90.py): the [64, d] tile is decoded in registers, so 4 warps spill (16 heads:
    255 registers + 560 B of stack) where 8 do not (227 registers), and software pipelining (stages >= 2)
    stages the masked [64, d] byte and int16 tiles in shared memory: 246 KB at 16 heads, past the 227 KB
    a block may have; one stage takes 147 KB."""
    if q.dim() != 3 or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_attn_sink_paged: want q [T, H, d] and idx [T, K], got {tuple(q.shape)}, "
                         f"{tuple(idx.shape)}")
    T, H, d = q.shape
    if not _fused(layout, d) or (T <= SMALL_T and idx.shape[1] >= LONG_K):
        # gather + decode to a pool, then the pool kernel: the same rows and order
        stored = paged_rows(ring, comp, idx)
        kv = stored if layout is None else kv_decode(layout, stored)
        pool_idx = torch.arange(T * idx.shape[1], device=idx.device, dtype=torch.int32).view(T, -1)
        return sparse_attn_sink_triton(q, kv.reshape(-1, d), sink, torch.where(idx >= 0, pool_idx, -1), scale,
                                       initial_max)
    _check_stores(ring, comp, layout)
    _check(q, None, sink, idx)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    comp = ring if comp is None or comp.shape[0] == 0 else comp  # no compressed rows: every index is a ring row
    bh = block_h or _block_h(T, H)
    _sparse_attn_paged_kernel[(triton.cdiv(H, bh), T)](
        q, ring, comp, ring.view(torch.int16), comp.view(torch.int16), sink.to(torch.float32).contiguous(),
        idx.to(torch.int32).contiguous(), out, H, idx.shape[1], ring.numel() // layout.bytes_per_token,
        float(scale), float(initial_max), q.stride(0), q.stride(1), idx.shape[1], out.stride(0), out.stride(1),
        BPT=layout.bytes_per_token, QDIM=layout.quant_dim, SBLOCK=layout.block, D=d, BLOCK_H=bh,
        BLOCK_K=SPARSE_ATTN_BLOCK, INTERPRET=_interpreting(), num_warps=num_warps, num_stages=num_stages)
    return out


REGISTRATIONS = {"sparse_attn_sink_paged": sparse_attn_sink_paged_triton}
