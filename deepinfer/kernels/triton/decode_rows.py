"""Triton op "decode_rows" (the twin and the meaning of every output: `kernels/decode_rows.py`): one launch per
compression ratio, one program per batch row, instead of ~16 small torch kernels per ratio (and 8 for the
window rows, folded into the first launch). Plain int64 index arithmetic: bit-identical to the twin
(positions are non-negative, so floor and truncating division agree).
Op "decode_select_rows" (twin `decode_select_rows_torch`): an indexer layer's index rows from its top-k picks
in one launch, one program per batch row, instead of six torch kernels (compare, two wheres, gather, add,
cat: ~1.5 us each on the H200, on the indexer's chain, which is a decode layer's longest).
Must not: be imported without triton.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.decode_rows import TABLE, decode_rows_torch, decode_select_rows_torch
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

ENTRY_BLOCK = 1024  # entry columns per loop step of a program


@fast_launch
@triton.jit
def _decode_rows_kernel(buf_ptr, ring_ptr, win_ptr, entry_ptr, vis_ptr, hidden_ptr, complete_ptr, new_ptr, bpos_ptr,
                        COLS: tl.constexpr, T0: tl.constexpr, WINDOW: tl.constexpr, WIN_P2: tl.constexpr, DO_WINDOW: tl.constexpr,
                        R: tl.constexpr, EPB: tl.constexpr, E: tl.constexpr, EB: tl.constexpr, N_E: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program b: DO_WINDOW -> ring_row[b], window_rows[b, :]; R > 0 -> ratio R's rows of b (E entry columns
    in N_E steps of EB). Columns of a buf row: position, window slot (POS, WIN = 0, 1), block table from T0."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = buf_ptr + b * COLS
    pos = tl.load(row + 0)
    if DO_WINDOW:
        slot = tl.load(row + 1)
        w = tl.arange(0, WIN_P2)
        wpos = tl.maximum(pos - WINDOW + 1, 0) + w
        rows = tl.where(wpos <= pos, slot * WINDOW + wpos % WINDOW, -1)
        tl.store(win_ptr + b * WINDOW + w, rows, mask=w < WINDOW)
        tl.store(ring_ptr + b, slot * WINDOW + pos % WINDOW)
    if R > 0:
        visible = (pos + 1) // R
        cur = pos // R
        tl.store(vis_ptr + b, visible)
        tl.store(complete_ptr + b, (pos + 1) % R == 0)
        tl.store(new_ptr + b, tl.load(row + T0 + cur // EPB) * EPB + cur % EPB)
        tl.store(bpos_ptr + b, cur * R)
        for c in range(0, N_E):
            j = c * EB + tl.arange(0, EB)
            ok = j < E
            blk = tl.load(row + T0 + j // EPB, mask=ok, other=0)
            tl.store(entry_ptr + b * E + j, blk * EPB + j % EPB, mask=ok)
            tl.store(hidden_ptr + b * E + j, j >= visible, mask=ok)


def decode_rows(buf: torch.Tensor, window: int, block_size: int, max_context: int, ratios: Sequence[int]) -> tuple:
    """Same contract as `kernels.decode_rows.decode_rows_torch` (buf int64 [B, 3 + blocks], contiguous)."""
    if not buf.is_cuda and not interpreting():
        return decode_rows_torch(buf, window, block_size, max_context, ratios)
    if buf.dtype != torch.int64 or buf.dim() != 2 or buf.shape[1] <= TABLE or not buf.is_contiguous():
        raise ValueError(f"decode_rows: buf must be contiguous int64 [B, {TABLE} + blocks], got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    bsz, cols = buf.shape
    dev = buf.device
    i64 = dict(dtype=torch.int64, device=dev)
    ring_row, window_rows = torch.empty(bsz, **i64), torch.empty(bsz, window, **i64)
    per_ratio = []
    launches = [(r, i == 0) for i, r in enumerate(ratios)] or [(0, True)]
    for r, do_window in launches:
        if r:
            epb, e = block_size // r, max_context // r
            if epb < 1 or -(-e // epb) > cols - TABLE:
                raise ValueError(f"decode_rows: ratio {r} with block_size {block_size} and max_context {max_context} "
                                 f"needs {-(-e // max(epb, 1))} table columns, buf has {cols - TABLE}")
            outs = (torch.empty(bsz, e, **i64), torch.empty(bsz, **i64), torch.empty(bsz, e, dtype=torch.bool, device=dev),
                    torch.empty(bsz, dtype=torch.bool, device=dev), torch.empty(bsz, **i64), torch.empty(bsz, **i64))
            per_ratio.append(outs)
        else:
            epb, e = 1, 0
            outs = (ring_row,) * 6  # not written (R = 0)
        entry, vis, hidden, complete, new_row, bpos = outs
        eb = min(ENTRY_BLOCK, next_power_of_2(max(e, 16)))
        if bsz:
            _decode_rows_kernel[(bsz,)](buf, ring_row, window_rows, entry, vis, hidden, complete, new_row, bpos,
                                        COLS=cols, T0=TABLE, WINDOW=window, WIN_P2=next_power_of_2(window),
                                        DO_WINDOW=do_window, R=r, EPB=epb, E=e, EB=eb, N_E=cdiv(e, eb),
                                        num_warps=4)
    return ring_row, window_rows, tuple(per_ratio)


SELECT_BLOCK = 256  # columns per loop step of a decode_select_rows program


@fast_launch
@triton.jit
def _select_rows_kernel(win_ptr, top_ptr, vis_ptr, entry_ptr, out_ptr, n_ring, W, K, stride_w, stride_t, stride_e,
                        stride_o, BLOCK: tl.constexpr, N_W: tl.constexpr, N_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: out[b, :W] = window_rows[b]; out[b, W + i] = entry_rows[b, top[b, i]] + n_ring where
    top[b, i] < visible[b], else -1 (a pick at or past visible reads column 0, as the twin's where)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    out = out_ptr + b * stride_o
    for c in range(0, N_W):
        j = c * BLOCK + tl.arange(0, BLOCK)
        ok = j < W
        tl.store(out + j, tl.load(win_ptr + b * stride_w + j, mask=ok, other=0), mask=ok)
    visible = tl.load(vis_ptr + b)
    for c in range(0, N_K):
        i = c * BLOCK + tl.arange(0, BLOCK)
        ok = i < K
        top = tl.load(top_ptr + b * stride_t + i, mask=ok, other=0)
        hid = top >= visible
        col = tl.where(hid, 0, top)
        chosen = tl.load(entry_ptr + b * stride_e + col, mask=ok, other=0)
        tl.store(out + W + i, tl.where(hid, -1, chosen + n_ring), mask=ok)


def decode_select_rows(window_rows: torch.Tensor, top: torch.Tensor, visible: torch.Tensor, entry_rows: torch.Tensor,
                       n_ring: int) -> torch.Tensor:
    """Same contract as `kernels.decode_rows.decode_select_rows_torch` (int64 tensors, unit column strides)."""
    if (not top.is_cuda and not interpreting()) or not env.attn_fusions_enabled():
        return decode_select_rows_torch(window_rows, top, visible, entry_rows, n_ring)
    problems = [f"{name} must be int64 [{shape}] with unit column stride, got {t.dtype} {tuple(t.shape)}"
                for name, t, shape, dims in (("window_rows", window_rows, "B, W", 2), ("top", top, "B, K", 2),
                                             ("visible", visible, "B", 1), ("entry_rows", entry_rows, "B, E", 2))
                if t.dtype != torch.int64 or t.dim() != dims or (dims == 2 and t.shape[1] > 1 and t.stride(1) != 1)]
    if not problems and len({window_rows.shape[0], top.shape[0], visible.shape[0], entry_rows.shape[0]}) != 1:
        problems.append(f"batch sizes differ: window_rows {window_rows.shape[0]}, top {top.shape[0]}, visible "
                        f"{visible.shape[0]}, entry_rows {entry_rows.shape[0]}")
    if not problems and top.shape[1] and not entry_rows.shape[1]:
        problems.append("top has picks but entry_rows has no entry columns")
    if problems:
        raise ValueError("decode_select_rows: " + "; ".join(problems))
    bsz, w = window_rows.shape
    k = top.shape[1]
    visible = visible.contiguous()
    out = torch.empty(bsz, w + k, dtype=torch.int64, device=top.device)
    if bsz:
        _select_rows_kernel[(bsz,)](window_rows, top, visible, entry_rows, out, int(n_ring), w, k,
                                    window_rows.stride(0), top.stride(0), entry_rows.stride(0), out.stride(0),
                                    BLOCK=SELECT_BLOCK, N_W=cdiv(w, SELECT_BLOCK), N_K=cdiv(k, SELECT_BLOCK),
                                    num_warps=4)
    return out


REGISTRATIONS = {"decode_rows": decode_rows, "decode_select_rows": decode_select_rows}
