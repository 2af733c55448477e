"""Engine KV storage of V4.1, paged by the BlockPool's block tables.

Exact numerics: float64 values. Official numerics (`numerics="official"`): the ring, the compressed
latents and the index keys hold the PACKED uint8 entries of `cache/layouts.py` (`layouts_for(cfg)`:
window `v41_window_fp8`, latent `v41_latent_fp4`, index `v41_index_fp4`), the ratio-2 partial-group
state stays fp32; `encode`/`decode` convert between stored form and values (identity in exact numerics),
so `decode(encode(x))` is the oracle's cached value. Fast numerics stores the same packed entries.
Every tensor lives on the cache's `device`, and so do the entry-row maps it returns (memoised per step:
one host-to-device copy per sequence and ratio, not per layer).

Owns, per layer:
  ring        [max_num_seqs, window, head_dim]   every layer: position p at slot p % window, row = window_slot
  kv source layers (cfg.kv_source_layers, ratio r):
    comp        [num_blocks * (block_size // r), head_dim]        compressed entries (RoPE applied)
    index_keys  [num_blocks * (block_size // r), index_head_dim]  indexer keys (wk/k_norm, RoPE applied)
    state kv / score [max_num_seqs, r, head_dim] (r > 1 only): the current partial group, position p at
      row p % r (score -inf = empty), row = the sequence's state_slot.
  Consumer layers own no compressed storage: they read their kv source's (cfg.kv_source_of).
Plus the engram n-gram history per state slot (owned by `EngramHasher`, reset through this cache).

Entry mapping: entry j of a ratio-r layer lives at flat row block_table[j // epb] * epb + j % epb,
epb = block_size // r (same rule as `V4Cache.entry_rows`).
Must not: compute model math or decide visibility.
"""
from __future__ import annotations

import torch

from deepinfer.cache.layouts import KVLayout, layouts_for
from deepinfer.config import ModelConfig
from deepinfer.model.cache import STATE_DTYPE_OFFICIAL, EntryRowMemo, PackedStore, SlotResets



def cache_layouts(cfg: ModelConfig, numerics: str) -> dict[str, KVLayout] | None:
    """Packed layout per cache role (window, latent, index) in official numerics; None in exact."""
    if numerics == "exact":
        return None
    if numerics not in ("official", "fast"):  # fast numerics stores the same packed entries as official
        raise ValueError(f"unknown numerics {numerics!r}")
    return layouts_for(cfg)


class V41LayerCache(PackedStore):
    def __init__(self, cfg: ModelConfig, layer: int, num_blocks: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype, layouts: dict[str, KVLayout] | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.ratio = r = cfg.compress_ratios[layer]
        state_dtype = self._init_store(cfg, max_num_seqs, dtype, layouts, device)
        store = self.store
        self.comp = self.index_keys = self.state_kv = self.state_score = None
        if r and layer in cfg.kv_source_layers:
            self.comp = store("latent", num_blocks * (block_size // r), cfg.head_dim)
            self.index_keys = store("index", num_blocks * (block_size // r), cfg.index_head_dim)
            if r > 1:
                self.state_kv = torch.zeros(max_num_seqs, r, cfg.head_dim, dtype=state_dtype, device=device)
                self.state_score = torch.full((max_num_seqs, r, cfg.head_dim), float("-inf"), dtype=state_dtype,
                                              device=device)

    # stored form <-> values (identity in exact numerics); roles: window, latent, index
    def reset(self, window_slot: int, state_slot: int) -> None:
        self.ring[window_slot].zero_()
        if self.state_kv is not None:
            self.state_kv[state_slot].zero_()
            self.state_score[state_slot].fill_(float("-inf"))


class V41Cache(EntryRowMemo, SlotResets):
    """All layers' caches of one V4.1 engine instance (exact numerics: float64 values; official/fast: packed)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype = torch.float64, numerics: str = "exact",
                 device: torch.device | str = "cpu") -> None:
        for r in cfg.compress_ratios[: cfg.n_layers]:
            if r and block_size % r:
                raise ValueError(f"block_size {block_size} must be a multiple of every compression ratio ({r})")
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.numerics, self.device = numerics, torch.device(device)
        self._entry_rows: dict[tuple, torch.Tensor] = {}
        self.layouts = cache_layouts(cfg, numerics)
        self.layers = [V41LayerCache(cfg, i, num_blocks, block_size, max_num_seqs, dtype, self.layouts, device)
                       for i in range(cfg.n_layers)]
        self.hasher = None  # the model attaches its EngramHasher (history per state slot)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype = torch.float64,
                        numerics: str = "exact") -> int:
        layouts = cache_layouts(cfg, numerics)
        size = torch.empty((), dtype=dtype).element_size()
        width = (cfg.head_dim + cfg.index_head_dim) * size if layouts is None else \
            layouts["latent"].bytes_per_token + layouts["index"].bytes_per_token
        return sum((block_size // cfg.compress_ratios[i]) * width
                   for i in cfg.kv_source_layers if i < cfg.n_layers and cfg.compress_ratios[i])

    @staticmethod
    def bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype = torch.float64, numerics: str = "exact") -> int:
        layouts = cache_layouts(cfg, numerics)
        size = torch.empty((), dtype=dtype).element_size()
        ring_row = cfg.head_dim * size if layouts is None else layouts["window"].bytes_per_token
        state_size = size if layouts is None else torch.empty((), dtype=STATE_DTYPE_OFFICIAL).element_size()
        total = cfg.n_layers * cfg.window_size * ring_row
        for i in cfg.kv_source_layers:
            r = cfg.compress_ratios[i] if i < cfg.n_layers else 0
            if r > 1:
                total += 2 * r * cfg.head_dim * state_size
        return total + 8 * max(0, cfg.engram_max_ngram_size - 1)

    def _slot_tensors(self) -> list[tuple[torch.Tensor, str, float]]:
        out = [(layer.ring, "window", 0.0) for layer in self.layers]
        for layer in self.layers:
            if layer.state_kv is not None:
                out += [(layer.state_kv, "state", 0.0), (layer.state_score, "state", float("-inf"))]
        return out

    def _reset_host(self, state_slot: int) -> None:
        if self.hasher is not None:
            self.hasher.reset(state_slot)
