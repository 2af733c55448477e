"""Per-step rows of a varlen extend batch (prefill chunks, long extends, mixed decodes) in fast numerics,
built ONCE per step on the host and moved to the device in ONE pinned, non-blocking copy, so the attention
layers run no host-to-device copy (each would be a stream sync on cuda) and no per-sequence window ops.

Owns: `ExtendRows` / `RatioExtendRows` (what every layer of the step reads: ring rows to gather and write,
the window part of the sparse-attention index rows, each sequence's compressed-entry rows per ratio) and
`build_extend_rows`; `extend_step(rows)` makes them the current step's rows (a ContextVar, like
`forward_context`) and `current_extend_rows(ctx, cache)` returns them (or builds them for a direct call).

Pool layout of one layer's sparse attention (the same for every layer of the step):
  [ring rows of every sequence's positions lo..P-1 (sequence order) | the step's T new KV rows |
   compressed entries (the layer appends them)]
The window index rows keep `V4Attention._forward_official`'s per-sequence order and width exactly (window
positions ascending then -1 up to min(S, window) columns for a prefill from 0, window otherwise); only the
pool row numbers differ, so the attention reads the same values in the same order. V4.1 (`ring_order`) lists
an extend at start_pos > 0 as its official kernels do (`V41Attention`'s `_window_rows`): the ring in slot
order, oldest first, i.e. positions q - window + 1 .. q with -1 for those before 0 (first, not last).
Must not: touch cache tensors or run model math; decide visibility differently from attention.py.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from deepinfer.model.context import ForwardContext


@dataclass
class RatioExtendRows:
    """The compressed entries one ratio's layers read: sequence i's entries 0..n_ent[i]-1 are
    entry_rows[ent_start[i] : ent_start[i] + n_ent[i]]."""

    entry_rows: torch.Tensor  # [sum n_ent] flat cache rows, sequence order (device)
    ent_start: tuple[int, ...]  # host offsets into entry_rows
    n_ent: tuple[int, ...]  # host: end_pos // r per sequence
    ent_start_row: torch.Tensor  # [T] ent_start of each token's sequence (device)
    visible: torch.Tensor  # [T] entries each query may see: (p + 1) // r (device)


@dataclass
class ExtendRows:
    positions: torch.Tensor  # [T] int64 (device)
    ring_read: torch.Tensor  # [N_ring] flat ring rows (window_slot * window + p % window), positions lo..P-1
    ring_write: torch.Tensor  # [N_write] flat ring rows of the positions the ring keeps after the step
    kv_write: torch.Tensor  # [N_write] rows of the step's flat new KV that go there
    window_idx: torch.Tensor  # [T, W] pool rows of each query's window (-1: none), W = the widest sequence's
    window_width: tuple[int, ...]  # host: window columns of each sequence (its compressed part starts there)
    window_width_row: torch.Tensor  # [T] the same per token (device)
    ratios: dict[int, RatioExtendRows]
    # what the layers derive from these rows and share within the step (RoPE tables per frequency table,
    # the index rows of non-indexer ratios, per-sequence visibility masks), built by the first layer that
    # needs it (`model.step_memo`)
    memo: dict = field(default_factory=dict, repr=False)


def _window_host(ctx: ForwardContext, win: int) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """Host rows: ring reads, ring writes, their kv rows, per-token columns [5, T] (start_pos, lowest
    window position, first ring row in the pool, first new row in the pool, window width) -> and the
    window width of each sequence. Built with numpy: a handful of host torch calls per sequence (each a few
    us) made a 16-prompt step's row building cost milliseconds."""
    ring_read, ring_write, kv_write, per_tok, widths = [], [], [], [], []
    n_ring = sum(s.start_pos - max(0, s.start_pos - win + 1) for s in ctx.seqs)
    ring_base = 0
    for i, s in enumerate(ctx.seqs):
        P, S, end = s.start_pos, s.num_new, s.end_pos
        lo = max(0, P - win + 1)
        ring_read.append(s.window_slot * win + np.arange(lo, P) % win)
        keep = max(P, end - win)  # the ring keeps the last `win` positions, p at slot p % win
        ring_write.append(s.window_slot * win + np.arange(keep, end) % win)
        kv_write.append(ctx.cu_tokens[i] + np.arange(keep - P, S))
        widths.append(min(S, win) if P == 0 else win)
        per_tok.append(np.repeat(np.array([[P], [lo], [ring_base], [n_ring + ctx.cu_tokens[i]], [widths[-1]]]), S, 1))
        ring_base += P - lo
    host = [torch.from_numpy(np.concatenate(part).astype(np.int64)) for part in (ring_read, ring_write, kv_write)]
    return host + [torch.from_numpy(np.concatenate(per_tok, 1).astype(np.int64))], tuple(widths)


def _entry_rows_host(ctx: ForwardContext, block_size: int, ratio: int, n_ent: tuple[int, ...]) -> torch.Tensor:
    """Every sequence's entry rows for one ratio, sequence order (`cache.paged_entry_rows` of each, joined):
    entry j at block_table[j // epb] * epb + j % epb."""
    epb = block_size // ratio
    parts = []
    for s, n in zip(ctx.seqs, n_ent):
        if n:
            need = -(-n // epb)
            if len(s.block_table) < need:
                raise ValueError(f"block table of {len(s.block_table)} blocks cannot hold {n} entries of ratio {ratio}")
            j = np.arange(n)
            parts.append(np.asarray(s.block_table[:need], dtype=np.int64)[j // epb] * epb + j % epb)
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


def build_extend_rows(ctx: ForwardContext, win: int, block_size: int, ratios: tuple[int, ...],
                      device: torch.device, ring_order: bool = False) -> ExtendRows:
    """Every row the step's layers read, from the host batch description, in one host-to-device copy.
    ring_order: V4.1's window columns for sequences extending at start_pos > 0 (module doc)."""
    T = ctx.num_tokens
    (ring_read, ring_write, kv_write, per_tok), widths = _window_host(ctx, win)
    # host positions from the batch description: ctx.positions may already live on the device (ctx.on)
    positions = torch.from_numpy(np.concatenate([np.arange(s.start_pos, s.end_pos) for s in ctx.seqs]).astype(np.int64))
    parts = [positions, ring_read, ring_write, kv_write, per_tok.flatten()]
    ratio_host = {}
    counts = [s.num_new for s in ctx.seqs]
    for r in ratios:
        n_ent = tuple(s.end_pos // r for s in ctx.seqs)
        starts, acc = [], 0
        for n in n_ent:
            starts.append(acc)
            acc += n
        start_row = torch.from_numpy(np.repeat(np.asarray(starts, dtype=np.int64), counts))
        ratio_host[r] = (tuple(starts), n_ent)
        parts += [_entry_rows_host(ctx, block_size, r, n_ent), start_row]
    host = torch.cat([p.to(torch.long) for p in parts])
    if device.type == "cuda":  # pinned + non_blocking: no stream sync (the caching host allocator keeps the
        host = host.pin_memory()  # pinned block until the copy's event has passed)
    flat = host.to(device, non_blocking=True)
    views, at = [], 0
    for p in parts:
        views.append(flat[at : at + p.numel()].view(p.shape))
        at += p.numel()
    pos, ring_read, ring_write, kv_write, per_tok = views[:5]
    P, lo, ring_base, new_base, width_row = (per_tok.view(5, T)[j].unsqueeze(1) for j in range(5))
    # the window part of the index rows: qlo + j for j < width, valid while <= the query's position
    j = torch.arange(max(widths), device=device)
    wpos = (pos - win + 1).clamp(min=0).unsqueeze(1) + j
    valid = wpos <= pos.unsqueeze(1)
    if ring_order:  # V4.1 at P > 0 (width = window): q - win + 1 + j, valid from position 0 on
        ring = (pos - win + 1).unsqueeze(1) + j
        wpos, valid = torch.where(P > 0, ring, wpos), torch.where(P > 0, ring >= 0, valid)
    pool_row = torch.where(wpos < P, ring_base + wpos - lo, new_base + wpos - P)
    window_idx = torch.where(valid, pool_row, -1)
    out = {}
    for j, r in enumerate(ratios):
        entry_rows, start_row = views[5 + 2 * j], views[6 + 2 * j]
        starts, n_ent = ratio_host[r]
        out[r] = RatioExtendRows(entry_rows, starts, n_ent, start_row, torch.div(pos + 1, r, rounding_mode="floor"))
    return ExtendRows(pos, ring_read, ring_write, kv_write, window_idx, widths, width_row.squeeze(1), out)


_CURRENT: contextvars.ContextVar[tuple[ForwardContext, ExtendRows] | None] = contextvars.ContextVar(
    "deepinfer_extend_rows", default=None)


@contextlib.contextmanager
def extend_step(ctx: ForwardContext, rows: ExtendRows) -> Iterator[ExtendRows]:
    """Make `rows` (built for `ctx`) the current step's rows for the duration of the block."""
    token = _CURRENT.set((ctx, rows))
    try:
        yield rows
    finally:
        _CURRENT.reset(token)


def current_extend_rows(ctx: ForwardContext, cfg, cache) -> ExtendRows:
    """The rows of the step `ctx` (built by the model once per step), or built now for a direct layer call."""
    cur = _CURRENT.get()
    if cur is not None and cur[0] is ctx:
        return cur[1]
    ratios = tuple(sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r}))
    return build_extend_rows(ctx, cfg.window_size, cache.block_size, ratios, cache.device, cfg.is_v41)
