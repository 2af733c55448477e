"""Per-step metadata of a pure-decode batch (every sequence adds exactly one token), in fixed-shape device
tensors, so a decode step has no per-sequence Python loop inside a layer and can be captured in a CUDA graph.

Owns: `DecodeMetadata` (static buffers for a batch bucket of `batch` rows and a maximum context: positions,
window-ring slots, compressor-state slots, block tables), `fill` (the ONE host-side build per step: one
pinned host tensor, one host-to-device copy; rows past the real sequences are padding that writes only to a
scratch slot and a scratch block no request owns) and `derive` (the rows every layer reads, computed once per
step on the device from those buffers: window index rows, entry rows per compression ratio, visible counts,
completion masks and the row each completed entry is written to).
Must not: run model math or touch cache tensors (the decode attention does).

Why the derived rows are computed on the device and not on the host: entry rows are [batch, max_context / r]
per ratio (131K rows at batch 128 and 4K context for ratio 4); building them on the host each step would cost
more than the step. They are pure functions of the filled buffers, so a graph replays them too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Sequence

import numpy as np
import torch

from deepinfer import kernels
from deepinfer.kernels.decode_rows import POS as _POS, STATE as _STATE, TABLE as _TABLE, WIN as _WIN
from deepinfer.model.context import SeqContext


@dataclass
class RatioRows:
    """The rows one compression ratio's layers read and write in a decode step (B = the bucket size)."""

    entry_rows: torch.Tensor  # [B, E] flat cache rows of entries 0..E-1 (E = max_context // r); padding: a real row
    visible: torch.Tensor  # [B] entries the query may see: (p + 1) // r
    hidden: torch.Tensor  # [B, E] bool: entry column >= visible
    complete: torch.Tensor  # [B] bool: this token completes entry p // r
    new_row: torch.Tensor  # [B] flat row of entry p // r (written only where complete)
    block_pos: torch.Tensor  # [B] first position of entry p // r (its RoPE position)


@dataclass
class DecodeRows:
    """Everything a decode layer reads, derived once per step (see `DecodeMetadata.derive`)."""

    positions: torch.Tensor  # [B] int64
    window_slots: torch.Tensor  # [B] ring rows
    state_slots: torch.Tensor  # [B] compressor-state rows
    ring_row: torch.Tensor  # [B] flat ring row (slot * window + p % window) the new token's KV goes to
    window_rows: torch.Tensor  # [B, window] flat ring rows (slot * window + column) of the window, -1 = none
    ratios: dict[int, RatioRows]
    # what the layers derive from these rows and share within the step (RoPE tables per frequency table,
    # the ascending selection of non-indexer ratios, pool columns), built by the first layer that needs it
    # (`model.step_memo`): device ops on this step's tensors only, so a captured graph replays
    # them with the step; a new DecodeRows (one per derive) starts empty
    memo: dict = field(default_factory=dict, repr=False)


_PADDING = object()  # DecodeMetadata._written's mark of a padding row (its table columns hold the scratch block)


def _check(bad: np.ndarray, message: Callable[[int], str]) -> None:
    """Raise ValueError(message(i)) for the first row i where `bad` holds (fill's per-sequence checks)."""
    if bad.any():
        raise ValueError(message(int(bad.argmax())))


class DecodeMetadata:
    """Static buffers of one decode bucket: `batch` rows, contexts below `max_context` tokens."""

    def __init__(self, batch: int, max_context: int, block_size: int, window: int, ratios: Sequence[int],
                 device: torch.device | str) -> None:
        if batch <= 0 or max_context <= 0:
            raise ValueError(f"DecodeMetadata needs batch > 0 and max_context > 0, got {batch}, {max_context}")
        self.batch, self.max_context, self.block_size, self.window = batch, max_context, block_size, window
        self.ratios = tuple(sorted({int(r) for r in ratios if r}))
        self.max_blocks = -(-max_context // block_size)
        self.device = torch.device(device)
        cols = _TABLE + self.max_blocks
        pin = self.device.type == "cuda"
        self.host = torch.zeros(batch, cols, dtype=torch.long, pin_memory=pin)
        self._host_np = self.host.numpy()  # the same memory: fill writes it through numpy (see there)
        self.buf = torch.zeros(batch, cols, dtype=torch.long, device=self.device)  # the static device copy
        self.num_real = 0
        # per row, the block-table object its table columns were last written from (_PADDING: the scratch
        # block): a row whose sequence brings the same (cached, immutable) tuple again is not rewritten, so a
        # step's host work does not grow with the context (SequenceSlots.table keeps one tuple per table)
        self._written: list[object] = [None] * batch
        self._written_scratch: int | None = None
        # the previous step's host-to-device copy: the host buffer is rewritten only once it has been read
        self._copied = torch.cuda.Event() if pin else None

    def fill(self, seqs: Sequence[SeqContext], scratch_slot: int, scratch_block: int,
             num_slots: int | None = None) -> None:
        """Write one step's batch into the buffers. Padding rows (past len(seqs)) decode position 0 in the
        scratch slot over the scratch block: their writes reach only state no request owns. With `num_slots`
        (the cache's slot count) every real row's slots must lie in [0, num_slots) and no real row may use
        the scratch slot or block. Nothing is copied to the device when a check fails."""
        n = len(seqs)
        if not 0 <= n <= self.batch:  # 0: all padding (the graph capture's warm-up)
            raise ValueError(f"decode batch of {n} sequences does not fit bucket {self.batch}")
        h = self.host
        if self._copied is not None:
            self._copied.synchronize()
        mb = self.max_blocks
        # the row memory holds only for the scratch block it was written with
        written = self._written if self._written_scratch == scratch_block else [None] * self.batch
        if n:
            # every per-sequence field read once into numpy, checked and written as columns: at b128 a Python
            # loop of checks per sequence cost ~0.1-0.2 ms of a step's host time (H200 host, 2026-12-03)
            hn = self._host_np
            pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
            new = np.fromiter((s.num_new for s in seqs), dtype=np.int64, count=n)
            win = np.fromiter((s.window_slot for s in seqs), dtype=np.int64, count=n)
            state = np.fromiter((s.state_slot for s in seqs), dtype=np.int64, count=n)
            tables = [s.block_table for s in seqs]
            tlen = np.fromiter(map(len, tables), dtype=np.int64, count=n)
            _check(new != 1, lambda i: f"the decode path takes one new token per sequence, got {seqs[i]}")
            _check(pos >= self.max_context, lambda i: f"position {pos[i]} is past the decode path's max_context "
                                                      f"{self.max_context}")
            _check(tlen <= pos // self.block_size,
                   lambda i: f"block table of {tlen[i]} blocks does not cover position {pos[i]}")
            changed = [i for i in range(n) if tables[i] is not written[i]]  # rows whose table columns change
            ch = np.array(changed, dtype=np.int64)
            lens = np.minimum(tlen[ch], mb)
            total = int(lens.sum())
            flat = np.fromiter(chain.from_iterable(tables[i][:mb] for i in changed), dtype=np.int64, count=total)
            if num_slots is not None:
                _check((win < 0) | (win >= num_slots) | (state < 0) | (state >= num_slots),
                       lambda i: f"slot out of range in {seqs[i]}")
                on_scratch = np.zeros(n, dtype=bool)  # (an unchanged row's table was checked when written)
                hits = np.flatnonzero(flat == scratch_block)
                if hits.size:  # which rows those table entries belong to
                    on_scratch[ch[np.searchsorted(np.cumsum(lens), hits, side="right")]] = True
                scratch = (scratch_slot, scratch_block)
                _check((win == scratch_slot) | (state == scratch_slot) | on_scratch,
                       lambda i: f"{seqs[i]} uses the decode path's scratch slot/block {scratch}")
            hn[:n, _POS] = pos
            hn[:n, _WIN] = win
            hn[:n, _STATE] = state
            if total == ch.size * mb:
                hn[ch, _TABLE:] = flat.reshape(ch.size, mb)
            elif ch.size:  # shorter tables: past its end a row repeats its first block (a row of its own, masked)
                starts = np.cumsum(lens) - lens
                hn[ch, _TABLE:] = flat[starts][:, None]
                cols = np.arange(total) - np.repeat(starts, lens)
                hn[np.repeat(ch, lens), _TABLE + cols] = flat
            for i in changed:
                written[i] = tables[i]
        h[n:, _POS] = 0
        h[n:, _WIN] = scratch_slot
        h[n:, _STATE] = scratch_slot
        pad = [i for i in range(n, self.batch) if written[i] is not _PADDING]
        if pad:
            h[pad[0]:, _TABLE:] = scratch_block  # (rows past n that were already padding hold it already)
            for i in range(pad[0], self.batch):
                written[i] = _PADDING
        self._written, self._written_scratch = written, scratch_block
        self.buf.copy_(h, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.num_real = n

    def derive(self) -> DecodeRows:
        """The per-layer rows from the device buffers (op "decode_rows": device ops only, graph-capturable; one
        Triton launch per ratio on cuda)."""
        b = self.buf
        ring_row, window_rows, per_ratio = kernels.get("decode_rows", self.device.type)(
            b, self.window, self.block_size, self.max_context, self.ratios)
        ratios = {r: RatioRows(*rows) for r, rows in zip(self.ratios, per_ratio)}
        return DecodeRows(b[:, _POS], b[:, _WIN], b[:, _STATE], ring_row, window_rows, ratios)
