"""Engine KV storage of V4 for exact numerics (float64), paged by the BlockPool's block tables.

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

from typing import Sequence

import torch

from deepinfer.config import ModelConfig


class CompressorState:
    """(kv, score) partial-block rows of one compressor for every state slot."""

    def __init__(self, max_num_seqs: int, ratio: int, width: int, dtype: torch.dtype) -> None:
        c = 2 if ratio == 4 else 1
        self.ratio, self.overlap = ratio, ratio == 4
        self.kv = torch.zeros(max_num_seqs, c * ratio, c * width, dtype=dtype)
        self.score = torch.full((max_num_seqs, c * ratio, c * width), float("-inf"), dtype=dtype)

    def reset(self, slot: int) -> None:
        self.kv[slot].zero_()
        self.score[slot].fill_(float("-inf"))


class LayerCache:
    def __init__(self, cfg: ModelConfig, layer: int, num_blocks: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype) -> None:
        self.ratio = r = cfg.compress_ratios[layer]
        self.window = cfg.window_size
        self.ring = torch.zeros(max_num_seqs, cfg.window_size, cfg.head_dim, dtype=dtype)
        self.comp = self.comp_state = self.index_keys = self.index_state = None
        if r:
            self.comp = torch.zeros(num_blocks * (block_size // r), cfg.head_dim, dtype=dtype)
            self.comp_state = CompressorState(max_num_seqs, r, cfg.head_dim, dtype)
            if cfg.has_indexer(layer):
                self.index_keys = torch.zeros(num_blocks * (block_size // r), cfg.index_head_dim, dtype=dtype)
                self.index_state = CompressorState(max_num_seqs, r, cfg.index_head_dim, dtype)

    def reset(self, window_slot: int, state_slot: int) -> None:
        """A sequence (re)starts at position 0: nothing of a previous owner may leak into it."""
        self.ring[window_slot].zero_()
        for state in (self.comp_state, self.index_state):
            if state is not None:
                state.reset(state_slot)


class V4Cache:
    """All layers' caches of one engine instance (exact numerics: float64)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype = torch.float64) -> None:
        ratios = [r for r in cfg.compress_ratios[: cfg.n_layers] if r]
        for r in ratios:
            if block_size % r:
                raise ValueError(f"block_size {block_size} must be a multiple of every compression ratio ({r})")
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.layers = [LayerCache(cfg, i, num_blocks, block_size, max_num_seqs, dtype) for i in range(cfg.n_layers)]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype = torch.float64) -> int:
        """Bytes one KV block adds over all layers (compressed entries + indexer keys of its tokens)."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in range(cfg.n_layers):
            r = cfg.compress_ratios[layer]
            if r:
                width = cfg.head_dim + (cfg.index_head_dim if cfg.has_indexer(layer) else 0)
                total += (block_size // r) * width * size
        return total

    @staticmethod
    def bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype = torch.float64) -> int:
        """Fixed bytes per sequence slot: window rings and compressor partial-block states."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in range(cfg.n_layers):
            total += cfg.window_size * cfg.head_dim * size
            r = cfg.compress_ratios[layer]
            if r:
                c = 2 if r == 4 else 1
                total += 2 * c * r * c * cfg.head_dim * size
                if cfg.has_indexer(layer):
                    total += 2 * c * r * c * cfg.index_head_dim * size
        return total

    def entry_rows(self, block_table: Sequence[int], ratio: int, num_entries: int) -> torch.Tensor:
        """Flat rows [num_entries] of a sequence's compressed entries 0..num_entries-1 (see module doc)."""
        epb = self.block_size // ratio
        j = torch.arange(num_entries)
        need = -(-num_entries // epb)
        if len(block_table) < need:
            raise ValueError(
                f"block table of {len(block_table)} blocks cannot hold {num_entries} entries of ratio {ratio}")
        table = torch.tensor(list(block_table[:need]), dtype=torch.long)
        return table[j // epb] * epb + j % epb

    def reset(self, window_slot: int, state_slot: int) -> None:
        for layer in self.layers:
            layer.reset(window_slot, state_slot)
