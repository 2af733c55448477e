"""Triton lightning-indexer scores with the official bf16 rounding points.

Owns:
* `indexer_scores_bf16(q, weights, keys, visible=None)`: the CUDA twin of `official.indexer_scores_bf16`.
  One program per (pair of query tokens, chunk of up to 8 blocks of 64 entries): per token and block all heads
  q.k in one MMA (fp32 accumulation), rounded to bf16, relu, times the bf16 head weight rounded to bf16,
  summed over heads in fp32, rounded to bf16 (`head_sum`). The [T, h, E] per-head scores never reach memory
  (the torch version writes them twice); the two tokens share each key block and keep their q in registers
  over the chunk. With `visible`, entries past a token's count are -inf and blocks neither token sees (a
  prefill's causal half) are written -inf without a load or MMA.
* `indexer_scores_paged_bf16(q, weights, store, entry_rows, hidden, layout)`: the batched decode step's
  scores straight from the packed FP4 index-key cache (the CUDA twin of `official.indexer_scores_paged_bf16`).
  One program per (sequence, block of 64 entries) gathers its entries' 68-byte rows, decodes E2M1 x E8M0 to
  bf16 in registers (exact) and runs the same `head_sum`: the packed bytes are read
  once, where gather + kv_decode + the torch scores move many times them (a gathered copy, a bf16 copy 4x
  its size, that copy's fp32 upcast). Hidden entries are not read at all.
The top-k after it stays `torch_ops.stable_topk` on CUDA too: `torch.sort(stable=True)` is stable there (a
radix sort; tested with heavy ties in tests/test_kernels_attn.py), and measured on the H200 it beat a top-k
over packed (score, position) int64 keys 4-10x (T=1, E=65536: 40 us vs 393 us; T=8192, E=2048: 345 us vs
1684 us), so no kernel is registered for it. V4.1, which wants the picks in position order, not score order,
takes `topk_positions` (kernels/triton/topk_positions.py: a histogram selection, no sort) instead.
Must not: be imported off CUDA (imports triton); import `cache` (the layout object is passed in); change
`head_sum`'s tile shapes in one kernel only (the paged decode kernel's rows are tested bit-identical to
`indexer_scores_bf16`'s: the batched decode path's tokens against the per-sequence path's).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import official
from deepinfer.kernels.triton.fp4_quant import fp4_codec_supported
from deepinfer.kernels.triton.fp8_gemm import sm_count
from deepinfer.kernels.triton.kv_pack import e8m0_value
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def head_sum(q, keys, w, INTERPRET: tl.constexpr):
    """q [BLOCK_H, D] bf16, keys [BLOCK_E, D] bf16, w [BLOCK_H] fp32 -> [BLOCK_E] fp32: all heads' q.k in one MMA
    (fp32 accumulation), rounded to bf16, relu, times the head weight, rounded to bf16, summed over heads in fp32
    (padded heads: weight 0, score 0). One function for both kernels: the same tile math, the same bits.
    The MMA is keys x q^T ([BLOCK_E, BLOCK_H]: the heads on its N), so the sum over heads runs within a thread and
    its quad's lanes; as q x keys^T the heads sat on M, spread over the warps, and the sum went through shared
    memory (written in the thirty-eighth session; H100, fortieth session: the 8k prefill's scores 1385 -> 1011 us
    a call, the batched decode's at B = 128, E = 16384 258 -> 216 us; the same bits in the GPU tests)."""
    if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; fp32 operands give the same exact products
        s = tl.dot(keys.to(tl.float32), tl.trans(q).to(tl.float32))
    else:
        s = tl.dot(keys, tl.trans(q))  # [BLOCK_E, BLOCK_H] fp32
    s = tl.maximum(s.to(tl.bfloat16).to(tl.float32), 0.0)
    return tl.sum((s * w[None, :]).to(tl.bfloat16).to(tl.float32), axis=1)


@triton.jit
def _token_pair_block(q0, q1, w0, w1, vis0, vis1, k_ptr, out_ptr, t0, T, E, e_lo, stride_ke, stride_ot,
                      D: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr):
    """Entries [e_lo, e_lo + BLOCK_E) of tokens t0 and t0 + 1: the keys loaded once, each token's scores by
    `head_sum` on the same [BLOCK_H, D] x [BLOCK_E, D] tiles as every other caller of it (the same bits);
    entries at or past a token's visible count are -inf."""
    ents = e_lo + tl.arange(0, BLOCK_E)
    emask = ents < E
    dims = tl.arange(0, D)
    keys = tl.load(k_ptr + ents.to(tl.int64)[:, None] * stride_ke + dims[None, :], mask=emask[:, None], other=0.0)
    ninf = float("-inf")
    s0 = tl.where(ents < vis0, head_sum(q0, keys, w0, INTERPRET), ninf)
    tl.store(out_ptr + t0 * stride_ot + ents, s0.to(tl.bfloat16), mask=emask)
    if t0 + 1 < T:  # (an odd T's last program has one token)
        s1 = tl.where(ents < vis1, head_sum(q1, keys, w1, INTERPRET), ninf)
        tl.store(out_ptr + (t0 + 1) * stride_ot + ents, s1.to(tl.bfloat16), mask=emask)


@fast_launch
@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr, T, NH, E, stride_qt, stride_qh, stride_wt,
                           stride_ke, stride_ot, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                           CHUNK: tl.constexpr, HAS_VIS: tl.constexpr, INTERPRET: tl.constexpr,
                           PDL: tl.constexpr = False):
    # One program: a pair of query tokens x CHUNK blocks of BLOCK_E entries. Both tokens' q and head weights
    # stay in registers while the key blocks stream past (each key block loaded once for two tokens, each q
    # once for CHUNK blocks: the one-token-one-block form moved ~8 GB through L2 at T = 8192, E = 2048);
    # blocks no token of the pair sees (a prefill's causal half) are written -inf without a load or MMA.
    pdl_enter(PDL)
    t0 = tl.program_id(0).to(tl.int64) * 2
    c_lo = tl.program_id(1) * (CHUNK * BLOCK_E)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < NH
    dims = tl.arange(0, D)
    has1 = t0 + 1 < T
    q0 = tl.load(q_ptr + t0 * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_ptr + (t0 + 1) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                 mask=hmask[:, None] & has1, other=0.0)
    w0 = tl.load(w_ptr + t0 * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + (t0 + 1) * stride_wt + heads, mask=hmask & has1, other=0.0).to(tl.float32)
    if HAS_VIS:
        vis0 = tl.load(vis_ptr + t0).to(tl.int32)
        vis1 = tl.load(vis_ptr + t0 + 1, mask=has1, other=0).to(tl.int32)
    else:
        vis0 = E
        vis1 = E
    seen = tl.minimum(tl.maximum(vis0, vis1), E)  # entries [0, seen) are visible to one token of the pair
    n_live = tl.minimum(tl.maximum(tl.cdiv(seen - c_lo, BLOCK_E), 0), CHUNK)
    for j in range(0, n_live):
        _token_pair_block(q0, q1, w0, w1, vis0, vis1, k_ptr, out_ptr, t0, T, E, c_lo + j * BLOCK_E, stride_ke,
                          stride_ot, D, BLOCK_E, INTERPRET)
    ninf = tl.full([BLOCK_E], float("-inf"), tl.float32).to(tl.bfloat16)
    for j in range(n_live, CHUNK):
        ents = c_lo + j * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = ents < E
        tl.store(out_ptr + t0 * stride_ot + ents, ninf, mask=emask)
        tl.store(out_ptr + (t0 + 1) * stride_ot + ents, ninf, mask=emask & has1)


INDEXER_CHUNK_BLOCKS = 8  # at most this many key blocks of 64 entries a program streams past its token pair,
MIN_PROGRAMS_PER_SM = 4  # fewer (a power of two) while the grid would have fewer programs than this an SM: a
# mixed step's one-token call over a long context (T = 1, E = 65536: 1024 blocks) needs its blocks spread


def _chunk_blocks(n_pairs: int, n_blocks: int, device: torch.device) -> int:
    per_program = n_pairs * n_blocks // max(1, MIN_PROGRAMS_PER_SM * sm_count(device))
    return 1 << (max(1, min(INDEXER_CHUNK_BLOCKS, per_program)).bit_length() - 1)


def indexer_scores_bf16(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                        visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, h, d] bf16, weights [T, h] bf16, keys [E, d] bf16 -> [T, E] bf16 (official rounding points);
    visible [T] (optional): token t sees entries [0, visible[t]), the rest of its row is -inf."""
    official.check_indexer_scores(q, weights, keys, visible)
    T, nh, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"indexer_scores_bf16: head dim {d} must be a power of two >= 16")
    if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16:
        return official.indexer_scores_bf16(q, weights, keys, visible)  # other dtypes: the torch version's promotion
    E = keys.shape[0]
    out = torch.empty(T, E, dtype=torch.bfloat16, device=q.device)
    if T == 0 or E == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.contiguous()
    vis = visible.contiguous() if visible is not None else out  # (unread without HAS_VIS)
    block_h = max(16, next_power_of_2(nh))
    block_e = 64
    chunk = _chunk_blocks(cdiv(T, 2), cdiv(E, block_e), q.device)
    _indexer_scores_kernel[(cdiv(T, 2), cdiv(E, block_e * chunk))](
        q, weights, keys, vis, out, T, nh, E, q.stride(0), q.stride(1), weights.stride(0), keys.stride(0),
        out.stride(0), D=d, BLOCK_H=block_h, BLOCK_E=block_e, CHUNK=chunk, HAS_VIS=visible is not None,
        INTERPRET=_interpreting(), num_warps=4)
    return out


@triton.jit
def _e2m1_pair(byte):
    """Packed E2M1 bytes (int32 0..255) -> (even value, odd value) in fp32, exact: the two codes become one word of
    two fp16 bit patterns by two multiplies and masks (fp4_moe's expand 5: magnitude bits e1 e0 m to 11..9 /
    27..25, signs to 15 / 31), i.e. 2**(e-15) * (1 + m/2) for e > 0 and the subnormal m * 2**-15: the E2M1
    value times 2**-14, widened exactly to fp32 and times 2**14 (code 8 gives -0.0, as the layout codec)."""
    b = byte.to(tl.uint32)
    word = ((b * 0x00200200) & 0x0E000E00) | ((b * 0x01001000) & 0x80008000)
    lo = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    hi = (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    return lo, hi


@fast_launch
@triton.jit
def _indexer_scores_paged_kernel(q_ptr, w_ptr, store_ptr, rows_ptr, hidden_ptr, out_ptr, NH, E, stride_qb, stride_qh,
                                 stride_wb, stride_rb, stride_hb, stride_ob, STRIDE_S: tl.constexpr,
                                 D: tl.constexpr, NB: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    # STRIDE_S, the cache's row stride (68 bytes for V4's keys), is a constexpr (one compile per layout) so the
    # compiler knows every row starts 4-byte aligned and loads a row's value bytes as words, not byte by byte
    pdl_enter(PDL)
    b = tl.program_id(1).to(tl.int64)
    ents = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ents < E
    hid = tl.load(hidden_ptr + b * stride_hb + ents, mask=emask, other=1) != 0
    live = emask & ~hid  # hidden entries never touch the cache: a short sequence in a long bucket reads its own
    if tl.max(live.to(tl.int32), axis=0) == 0:  # the whole block hidden: no q load, no decode, no MMA
        tl.store(out_ptr + b * stride_ob + ents, tl.full([BLOCK_E], float("-inf"), tl.float32).to(tl.bfloat16),
                 mask=emask)
    else:
        rows = tl.load(rows_ptr + b * stride_rb + ents, mask=live, other=0).to(tl.int64)
        # the layout's entry: D/2 value bytes (byte i: value 2i in the low nibble, 2i + 1 in the high one), then
        # NB E8M0 scale bytes, one per block of 2 * HALF values; viewed here as [entry, block, byte of block]
        nb = tl.arange(0, NB)
        row_base = rows[:, None] * STRIDE_S
        byte = tl.load(store_ptr + row_base[:, :, None] + nb[None, :, None] * HALF + tl.arange(0, HALF)[None, None, :],
                       mask=live[:, None, None], other=0).to(tl.int32)
        sb = tl.load(store_ptr + row_base + D // 2 + nb[None, :], mask=live[:, None], other=127)
        s = e8m0_value(sb)  # 2**(sb - 127) as the layout codec reads every byte
        lo, hi = _e2m1_pair(byte)
        lo = (lo * s[:, :, None]).to(tl.bfloat16)  # exact products, the layout codec's fp32 multiply
        hi = (hi * s[:, :, None]).to(tl.bfloat16)
        keys = tl.reshape(tl.interleave(lo, hi), (BLOCK_E, D))  # values 2i, 2i + 1 side by side: the key order
        # from here on `_indexer_scores_kernel`'s q load, dot shape and epilogue (`head_sum`), so a query's scores
        # come from the same tile math as the per-sequence path's kernel: on the GPU they are bit-identical to it
        # (H200, 2026-12-02, tests/test_kernels_indexer_paged.py -m gpu; masked keys are 0 and only change their
        # own columns, which are stored as -inf or not at all)
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < NH
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=hmask[:, None],
                    other=0.0)
        w = tl.load(w_ptr + b * stride_wb + heads, mask=hmask, other=0.0).to(tl.float32)
        total = tl.where(hid, float("-inf"), head_sum(q, keys, w, INTERPRET))
        tl.store(out_ptr + b * stride_ob + ents, total.to(tl.bfloat16), mask=emask)


def indexer_scores_paged_bf16(q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, entry_rows: torch.Tensor,
                              hidden: torch.Tensor, layout) -> torch.Tensor:
    """Same contract as `official.indexer_scores_paged_bf16`: q [B, h, d] bf16, weights [B, h] bf16, store uint8
    [rows, bytes_per_token] (fp4_e8m0 packed index keys), entry_rows [B, E] int32/int64 (valid rows, hidden
    entries included: they are not read), hidden [B, E] bool -> [B, E] bf16, -inf where hidden.
    Other layouts (bf16 keys, the seed's FP8) and non-bf16 q / weights go to the torch twin."""
    official._check_indexer_paged(q, weights, store, entry_rows, hidden, layout)
    d = q.shape[2]
    if (not fp4_codec_supported(layout) or d & (d - 1) or d < 16
            or not (q.dtype == weights.dtype == torch.bfloat16)):
        return official.indexer_scores_paged_bf16(q, weights, store, entry_rows, hidden, layout)
    if store.stride(1) != 1:  # copying a whole layer's cache to fix this would cost more than the op saves
        raise ValueError(f"indexer_scores_paged_bf16: store rows must be contiguous bytes; got strides "
                         f"{store.stride()}")
    B, nh, _ = q.shape
    E = entry_rows.shape[1]
    out = torch.empty(B, E, dtype=torch.bfloat16, device=q.device)
    if B == 0 or E == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights.contiguous()
    entry_rows = entry_rows if entry_rows.stride(-1) == 1 else entry_rows.contiguous()
    hidden = (hidden if hidden.stride(-1) == 1 else hidden.contiguous()).view(torch.uint8)
    block_h = max(16, next_power_of_2(nh))
    block_e = 64  # as indexer_scores_bf16: the same dot shape, hence the same scores
    _indexer_scores_paged_kernel[(cdiv(E, block_e), B)](
        q, weights, store, entry_rows, hidden, out, nh, E, q.stride(0), q.stride(1), weights.stride(0),
        entry_rows.stride(0), hidden.stride(0), out.stride(0), STRIDE_S=store.stride(0), D=d, NB=layout.n_scales,
        HALF=layout.block // 2, BLOCK_H=block_h, BLOCK_E=block_e, INTERPRET=_interpreting(), num_warps=4)
    return out


REGISTRATIONS = {
    "indexer_scores_bf16": indexer_scores_bf16,
    "indexer_scores_paged_bf16": indexer_scores_paged_bf16,
}
