"""Op "decode_rows": the rows every layer of a batched decode step reads and writes, from the step's packed
metadata buffer (`model/decode_metadata.py`: per row its position, window-ring slot, compressor-state slot and
block table).

Owns: `decode_rows_torch(buf, window, block_size, max_context, ratios)`, the torch version (the twin of
`kernels/triton/decode_rows.py`, one or two launches on cuda where these ~43 small torch ops were as many
kernels per step). Returns (ring_row [B], window_rows [B, window], one tuple per ratio r in `ratios`' order:
(entry_rows [B, E], visible [B], hidden [B, E] bool, complete [B] bool, new_row [B], block_pos [B]) with
E = max_context // r), every index int64:
* ring_row: the flat ring row (slot * window + p % window) the new token's KV goes to;
* window_rows: the flat ring rows of positions max(0, p - window + 1) .. p ascending, -1 past p;
* entry_rows: the flat compressed-cache row of entry j (block table[j // epb] * epb + j % epb, epb = entries
  per block); visible = (p + 1) // r entries the query may see, hidden = j >= visible; complete: this token
  completes entry p // r, new_row its flat row, block_pos = r * (p // r) its first position.
Also op "decode_select_rows" (`decode_select_rows_torch`): an indexer layer's attention index rows from its
top-k picks, the tail of the decode step's selection (six small torch kernels on cuda before 2026-12-05); and
op "stable_topk_rows" (`stable_topk_rows_torch`): the stable top-k of the scores, then those rows (one kernel
on cuda with DEEPINFER_TOPK_ROWS=fused).
Must not: know about layers, caches or sequences (plain index arithmetic on the buffer).
"""
from __future__ import annotations

from typing import Sequence

import torch

POS, WIN, STATE, TABLE = 0, 1, 2, 3  # columns of the packed buffer; block table from column 3 on


def decode_rows_torch(buf: torch.Tensor, window: int, block_size: int, max_context: int,
                      ratios: Sequence[int]) -> tuple:
    pos, dev = buf[:, POS], buf.device
    tables = buf[:, TABLE:]
    qlo = (pos - window + 1).clamp(min=0)
    wpos = qlo.unsqueeze(1) + torch.arange(window, device=dev)  # ascending from the oldest visible position
    window_rows = torch.where(wpos <= pos.unsqueeze(1), buf[:, WIN:WIN + 1] * window + wpos % window, -1)
    per_ratio = []
    for r in ratios:
        epb = block_size // r
        j = torch.arange(max_context // r, device=dev)
        entry_rows = tables[:, j // epb] * epb + j % epb  # [B, E]
        visible = (pos + 1) // r
        cur = pos // r
        new_row = tables.gather(1, (cur // epb).unsqueeze(1)).squeeze(1) * epb + cur % epb
        per_ratio.append((entry_rows, visible, j.unsqueeze(0) >= visible.unsqueeze(1), (pos + 1) % r == 0, new_row,
                          cur * r))
    return buf[:, WIN] * window + pos % window, window_rows, tuple(per_ratio)


def decode_select_rows_torch(window_rows: torch.Tensor, top: torch.Tensor, visible: torch.Tensor,
                             entry_rows: torch.Tensor, n_ring: int) -> torch.Tensor:
    """The attention's index rows of an indexer layer at decode: [B, W + K] int64 = each row's window rows
    [B, W], then its K top-k picks (`top` [B, K], entry columns in [0, E)) as cache rows counted after the
    ring's n_ring rows (`entry_rows` [B, E] + n_ring), -1 for a pick at or past the row's `visible` [B]
    entries (a query that sees fewer than K). The official selection's order and padding."""
    hid = top >= visible.unsqueeze(1)
    chosen = entry_rows.gather(1, torch.where(hid, 0, top))
    return torch.cat([window_rows, torch.where(hid, -1, chosen + n_ring)], dim=1)


def stable_topk_rows_torch(scores: torch.Tensor, k: int, window_rows: torch.Tensor, visible: torch.Tensor,
                           entry_rows: torch.Tensor, n_ring: int) -> torch.Tensor:
    """An indexer layer's attention index rows at decode from its scores [B, E]: the stable top-k
    (`torch_ops.stable_topk`, min(k, E) picks in descending score order, ties to the lower entry), then
    `decode_select_rows_torch` of them: exactly the two ops the decode step ran."""
    from deepinfer.kernels import torch_ops

    return decode_select_rows_torch(window_rows, torch_ops.stable_topk(scores, k), visible, entry_rows, n_ring)

