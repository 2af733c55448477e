"""Per-sequence cache state saved before a verification step and restored when a draft is rejected.

What a verify step of k + 1 tokens at positions [s, s + k] changes besides paged entries:
  * the window ring: slots (s + i) % window now hold rejected positions, overwriting positions
    s + i - window that later queries still see;
  * compressor partial-block state (V4: main and indexer compressors, the overlap block of ratio 4; V4.1:
    the ratio-2 partial group): rows of rejected positions, and possibly a block completed by them;
  * V4.1's engram n-gram history (the last n - 1 token ids of the sequence).
Paged compressed entries / indexer keys written for blocks that a rejected position completed are
harmless: an entry j is only visible to queries at positions >= (j + 1) * r - 1, and the extend that
computes that position rewrites entry j before anything reads it (the compressors run before attention).

Policy (engine): when every draft is accepted the state after the step is exactly the non-drafting state
and nothing is restored. Otherwise the snapshot (the state at position s) is restored and the request's
computed length rewinds to s; the next step recomputes the accepted tokens together with the new ones in
one extend. This needs no replay of partial compressor rows and is correct for any draft length.

Must not: decide acceptance, or touch another sequence's slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def slot_tensors(cache, window_slot: int, state_slot: int) -> list[tuple[torch.Tensor, int]]:
    """(tensor, row) pairs holding one sequence's non-paged state in a V4Cache, V41Cache or a drafter's
    cache with the same per-layer attributes (`layers` a list or dict of layer caches)."""
    layers = cache.layers.values() if isinstance(cache.layers, dict) else cache.layers
    out: list[tuple[torch.Tensor, int]] = []
    for lc in layers:
        out.append((lc.ring, window_slot))
        for name in ("comp_state", "index_state"):  # V4 compressor states
            state = getattr(lc, name, None)
            if state is not None:
                out += [(state.kv, state_slot), (state.score, state_slot)]
        for name in ("state_kv", "state_score"):  # V4.1 ratio-2 partial group
            t = getattr(lc, name, None)
            if t is not None:
                out.append((t, state_slot))
    hasher = getattr(cache, "hasher", None)
    if hasher is not None:
        out.append((hasher.history, state_slot))
    return out


@dataclass
class SequenceSnapshot:
    saved: list[tuple[torch.Tensor, int, torch.Tensor]]

    @classmethod
    def take(cls, cache, window_slot: int, state_slot: int) -> "SequenceSnapshot":
        return cls([(t, row, t[row].clone()) for t, row in slot_tensors(cache, window_slot, state_slot)])

    def restore(self) -> None:
        for t, row, value in self.saved:
            t[row].copy_(value)
