"""Engine KV storage of V4, paged by the BlockPool's block tables.

Exact numerics: every cache is a float64 tensor of values. Official numerics: the ring, the compressed
entries and the indexer keys hold the PACKED uint8 entries of `cache/layouts.py` (`layouts_for(cfg,
revision)`: window/compressed `v4_fp8_ds_mla`, or `bf16` for the initial revision; indexer keys
`v4_index_fp4`), and the compressor partial-block states stay fp32. `encode_*`/`decode_*` convert between
stored form and values (identity in exact numerics), so `decode(encode(x))` is the oracle's cached value.
Fast numerics stores the official packed layouts too. Every tensor lives on the cache's `device` (the
entry-row maps it returns too, so a CUDA forward never indexes with host tensors).

Owns, per layer:
  ring        [max_num_seqs, window, head_dim]      the last `window` latent KV rows, position p at slot
                                                    p % window, row = the sequence's window_slot
  comp        [num_blocks * (block_size // r), head_dim]   compressed entries (ratio-r layers)
  index_keys  [num_blocks * (block_size // 4), index_head_dim]  indexer keys (ratio-4 layers)
  comp_state / index_state: (kv, score) [max_num_seqs, c*r, c*width] per compressor (c = 2 for the
      overlapping ratio 4, else 1), row = the sequence's state_slot.

Entry mapping (the one place it is defined): a block of `block_size` TOKEN positions holds
`block_size // r` entries of a ratio-r layer, so entry j (tokens [j*r, (j+1)*r)) of a sequence lives at
flat row `block_table[j // epb] * epb + j % epb` with epb = block_size // r. block_size must be a multiple
of every compression ratio (128) so no entry straddles two blocks.

Compressor state layout (why: an extend of any length resumes exactly where the last one stopped):
  ratio 4 (overlap): rows [0, r) = the last COMPLETE block's raw kv/score rows (its A-half feeds the next
    entry), rows [r, 2r) = the current partial block, position p at row r + p % r.
  ratio 128: rows [0, r) = the current partial block, position p at row p % r.
  Scores are stored with ape[p % r] already added; empty rows hold kv 0 and score -inf (weight 0).

Must not: compute model math or decide visibility (the model does); it only stores and maps rows.
"""
from __future__ import annotations

import functools

from typing import Sequence

import torch

from deepinfer import kernels
from deepinfer.cache.layouts import KVLayout, layouts_for
from deepinfer.config import ModelConfig
from deepinfer.devices import host_to_device

STATE_DTYPE_OFFICIAL = torch.float32  # the official compressor keeps its partial blocks in fp32


def cache_layouts(cfg: ModelConfig, numerics: str, revision: str) -> dict[str, KVLayout] | None:
    """The packed layout of each cache role in official numerics; None in exact numerics (raw values)."""
    if numerics == "exact":
        return None
    if numerics not in ("official", "fast"):  # fast numerics stores the same packed entries as official
        raise ValueError(f"unknown numerics {numerics!r}")
    return layouts_for(cfg, revision)


def paged_entry_rows(block_table: Sequence[int], block_size: int, ratio: int, num_entries: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows of entries 0..num_entries-1 of a ratio-r layer: a block of `block_size` tokens holds
    block_size // r entries, entry j at block_table[j // epb] * epb + j % epb."""
    epb = block_size // ratio
    j = torch.arange(num_entries)
    need = -(-num_entries // epb)
    if len(block_table) < need:
        raise ValueError(f"block table of {len(block_table)} blocks cannot hold {num_entries} entries of ratio {ratio}")
    table = torch.tensor(list(block_table[:need]), dtype=torch.long)
    return (table[j // epb] * epb + j % epb).to(device)


class CompressorState:
    """(kv, score) partial-block rows of one compressor for every state slot."""

    def __init__(self, max_num_seqs: int, ratio: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        c = 2 if ratio == 4 else 1
        self.ratio, self.overlap = ratio, ratio == 4
        self.kv = torch.zeros(max_num_seqs, c * ratio, c * width, dtype=dtype, device=device)
        self.score = torch.full((max_num_seqs, c * ratio, c * width), float("-inf"), dtype=dtype, device=device)

    def reset(self, slot: int) -> None:
        self.kv[slot].zero_()
        self.score[slot].fill_(float("-inf"))


class PackedStore:
    """What every layer cache of both families shares: tensors either plain (exact numerics: compute dtype)
    or packed bytes of a `cache/layouts.py` layout (official numerics), the per-slot window ring, and the
    role-keyed encode/decode between values and what is stored."""

    layouts: dict[str, KVLayout] | None

    def _init_store(self, cfg: ModelConfig, max_num_seqs: int, dtype: torch.dtype,
                    layouts: dict[str, KVLayout] | None, device: torch.device | str = "cpu") -> torch.dtype:
        """Sets layouts and the window ring; returns the dtype of the compressor partial-block state."""
        self.layouts, self._dtype, self.device = layouts, dtype, torch.device(device)
        self.ring = self.store("window", max_num_seqs * cfg.window_size, cfg.head_dim).unflatten(
            0, (max_num_seqs, cfg.window_size))
        return dtype if layouts is None else STATE_DTYPE_OFFICIAL

    def store(self, role: str, rows: int, width: int) -> torch.Tensor:
        if self.layouts is None:
            return torch.zeros(rows, width, dtype=self._dtype, device=self.device)
        return torch.zeros(rows, self.layouts[role].bytes_per_token, dtype=torch.uint8, device=self.device)

    # kdev: which registry codec runs ("cpu": the layout's own torch codec; "cuda", fast numerics only: the
    # Triton codecs of kernels/triton/kv_pack.py and fp4_quant.py, bit-identical to it, one launch each where
    # the torch codec makes ~10-15; the layouts they do not cover fall back to the torch codec)
    def encode(self, role: str, x: torch.Tensor, kdev: str = "cpu") -> torch.Tensor:
        return x if self.layouts is None else kernels.get("kv_encode", kdev)(self.layouts[role], x)

    def decode(self, role: str, stored: torch.Tensor, kdev: str = "cpu") -> torch.Tensor:
        return stored if self.layouts is None else kernels.get("kv_decode", kdev)(self.layouts[role], stored)

    def ring_extend(self, slot: int, start: int, end: int, new_stored: torch.Tensor,
                    kdev: str = "cpu") -> torch.Tensor:
        """One sequence extends [start, end) through its window ring: returns the decoded rows of positions
        [max(0, start - win + 1), start) (what its first query can see, read BEFORE the write), then stores the
        new tokens' rows (`new_stored` [end - start, ...] in stored form; only the last `win` are kept,
        position p at slot p % win)."""
        win, dev = self.ring.shape[1], self.ring.device
        old = self.decode("window", self.ring[slot, torch.arange(max(0, start - win + 1), start, device=dev) % win],
                          kdev)
        keep = max(start, end - win)
        self.ring[slot, torch.arange(keep, end, device=dev) % win] = new_stored[keep - start :]
        return old

    def ring_extend_rows(self, rows, new_stored: torch.Tensor, kdev: str = "cpu") -> torch.Tensor:
        """`ring_extend` of every sequence of a varlen step at once, by the step's `ExtendRows` (model/
        extend_metadata.py): returns the decoded ring rows `rows.ring_read` (read BEFORE the write), then
        stores the new rows `new_stored[rows.kv_write]` at `rows.ring_write`. One gather, one scatter."""
        if not self.ring.is_contiguous():  # flatten would copy, and the write below would be lost
            raise ValueError("the window ring must be contiguous")
        ring = self.ring.flatten(0, 1)  # [slots * window, bytes] view
        old = self.decode("window", ring[rows.ring_read], kdev)
        ring[rows.ring_write] = new_stored[rows.kv_write]
        return old


class LayerCache(PackedStore):
    def __init__(self, cfg: ModelConfig, layer: int, num_blocks: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype, layouts: dict[str, KVLayout] | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.ratio = r = cfg.compress_ratios[layer]
        self.window = cfg.window_size
        state_dtype = self._init_store(cfg, max_num_seqs, dtype, layouts, device)
        store = self.store
        self.comp = self.comp_state = self.index_keys = self.index_state = None
        if r:
            self.comp = store("compressed", num_blocks * (block_size // r), cfg.head_dim)
            self.comp_state = CompressorState(max_num_seqs, r, cfg.head_dim, state_dtype, device)
            if cfg.has_indexer(layer):
                self.index_keys = store("index", num_blocks * (block_size // r), cfg.index_head_dim)
                self.index_state = CompressorState(max_num_seqs, r, cfg.index_head_dim, state_dtype, device)

    # stored form <-> values (identity in exact numerics)
    def reset(self, window_slot: int, state_slot: int) -> None:
        """A sequence (re)starts at position 0: nothing of a previous owner may leak into it."""
        self.ring[window_slot].zero_()
        for state in (self.comp_state, self.index_state):
            if state is not None:
                state.reset(state_slot)


class EntryRowMemo:
    """The paged entry-row maps of one step, shared by the V4 and V4.1 caches (needs `block_size`, `device`
    and a `_entry_rows` dict). Memoised on the full input (so never stale): every layer of one ratio reuses
    one tensor, and a device cache pays one host-to-device copy per (sequence, ratio) and step instead of
    one per layer."""

    block_size: int
    device: torch.device
    _entry_rows: dict

    def entry_rows(self, block_table: Sequence[int], ratio: int, num_entries: int) -> torch.Tensor:
        """Flat rows [num_entries] of a sequence's compressed entries 0..num_entries-1 (see module doc)."""
        key = (tuple(block_table), ratio, num_entries)
        rows = self._entry_rows.get(key)
        if rows is None:
            rows = self._entry_rows[key] = paged_entry_rows(block_table, self.block_size, ratio, num_entries,
                                                            self.device)
        return rows

    def begin_step(self) -> None:
        """A new forward: drop the previous step's memoised row maps (bounds the memo's size)."""
        self._entry_rows.clear()


class SlotResets:
    """Resetting the slots of sequences that (re)start at position 0, shared by the V4 and V4.1 caches (they
    list their per-slot tensors in `_slot_tensors`; `_reset_host` clears what lives on the host): in a few
    multi-tensor ops instead of small fills per layer and tensor (~200 launches for each new prompt on
    V4-Flash's 43 layers, each ~8 us of host time on the H200's host; V4.1's 28 a prompt on the tiny model)."""

    def _slot_tensors(self) -> list[tuple[torch.Tensor, str, float]]:
        """(tensor [slots, ...], "window" | "state": which slot indexes it, the value a reset writes)."""
        raise NotImplementedError

    def _reset_host(self, state_slot: int) -> None:
        """What a reset clears on the host (V4.1: the engram n-gram history)."""

    @functools.cached_property
    def _fills(self) -> list[tuple[torch.Tensor, str, float]]:
        return self._slot_tensors()

    @functools.cached_property
    def _fill_rows(self) -> dict[tuple, torch.Tensor]:
        """One slot's row of each non-zero fill value per shape and dtype (what `reset` copies in)."""
        return {}

    def reset(self, window_slot: int, state_slot: int) -> None:
        """Every layer's slot rows as a fresh sequence needs them: the ring and kv rows zero (one foreach op
        per dtype: it takes its fast route per dtype only), the score rows -inf (copied from one -inf row per
        shape: same values)."""
        zeros: dict[torch.dtype, list[torch.Tensor]] = {}
        filled, sources = [], []
        rows_of = self._fill_rows
        for t, kind, value in self._fills:
            row = t[window_slot if kind == "window" else state_slot]
            if value == 0:
                zeros.setdefault(row.dtype, []).append(row)
                continue
            key = (tuple(row.shape), row.dtype, value)
            if key not in rows_of:
                rows_of[key] = torch.full_like(row, value)
            filled.append(row)
            sources.append(rows_of[key])
        for group in zeros.values():  # fast numerics: the packed uint8 rings, the fp32 kv rows
            torch._foreach_zero_(group)
        if filled:
            torch._foreach_copy_(filled, sources)
        self._reset_host(state_slot)

    def reset_fresh(self, seqs) -> None:
        """Reset the slots of the step's sequences that start at position 0 (nothing of a slot's previous
        owner may leak in): several at once with one fill per cache tensor (a prefill step of 16 new prompts
        made 36 small fills per sequence on the tiny model's 6 layers, ~200 on V4-Flash's 43)."""
        fresh = [s for s in seqs if s.start_pos == 0]
        if len(fresh) == 1:
            self.reset(fresh[0].window_slot, fresh[0].state_slot)
        elif fresh:
            slots = {"window": host_to_device(torch.tensor([s.window_slot for s in fresh]), self.device),
                     "state": host_to_device(torch.tensor([s.state_slot for s in fresh]), self.device)}
            for t, kind, value in self._fills:
                t.index_fill_(0, slots[kind], value)
            for s in fresh:
                self._reset_host(s.state_slot)


class V4Cache(EntryRowMemo, SlotResets):
    """All layers' caches of one engine instance (exact numerics: float64 values; official: packed)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype = torch.float64, numerics: str = "exact", revision: str = "current",
                 device: torch.device | str = "cpu") -> None:
        ratios = [r for r in cfg.compress_ratios[: cfg.n_layers] if r]
        for r in ratios:
            if block_size % r:
                raise ValueError(f"block_size {block_size} must be a multiple of every compression ratio ({r})")
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.numerics, self.revision, self.device = numerics, revision, torch.device(device)
        self._entry_rows: dict[tuple, torch.Tensor] = {}
        self.layouts = cache_layouts(cfg, numerics, revision)
        self.layers = [LayerCache(cfg, i, num_blocks, block_size, max_num_seqs, dtype, self.layouts, device)
                       for i in range(cfg.n_layers)]

    def _slot_tensors(self) -> list[tuple[torch.Tensor, str, float]]:
        out = [(layer.ring, "window", 0.0) for layer in self.layers]
        for layer in self.layers:
            for state in (layer.comp_state, layer.index_state):
                if state is not None:
                    out += [(state.kv, "state", 0.0), (state.score, "state", float("-inf"))]
        return out

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype = torch.float64,
                        numerics: str = "exact", revision: str = "current") -> int:
        """Bytes one KV block adds over all layers (compressed entries + indexer keys of its tokens);
        packed entry sizes in official numerics."""
        layouts = cache_layouts(cfg, numerics, revision)
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in range(cfg.n_layers):
            r = cfg.compress_ratios[layer]
            if r:
                has_index = cfg.has_indexer(layer)
                if layouts is None:
                    width = (cfg.head_dim + (cfg.index_head_dim if has_index else 0)) * size
                else:
                    width = layouts["compressed"].bytes_per_token + (
                        layouts["index"].bytes_per_token if has_index else 0)
                total += (block_size // r) * width
        return total

    @staticmethod
    def bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype = torch.float64, numerics: str = "exact",
                           revision: str = "current") -> int:
        """Fixed bytes per sequence slot: window rings (packed in official numerics) and compressor
        partial-block states (fp32 in official numerics)."""
        layouts = cache_layouts(cfg, numerics, revision)
        size = torch.empty((), dtype=dtype).element_size()
        state_size = size if layouts is None else torch.empty((), dtype=STATE_DTYPE_OFFICIAL).element_size()
        ring_row = cfg.head_dim * size if layouts is None else layouts["window"].bytes_per_token
        total = 0
        for layer in range(cfg.n_layers):
            total += cfg.window_size * ring_row
            r = cfg.compress_ratios[layer]
            if r:
                c = 2 if r == 4 else 1
                total += 2 * c * r * c * cfg.head_dim * state_size
                if cfg.has_indexer(layer):
                    total += 2 * c * r * c * cfg.index_head_dim * state_size
        return total
