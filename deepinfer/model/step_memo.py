"""What every layer of one step would compute alike, computed once: the step's rows object (`DecodeRows` of
the batched decode path, `ExtendRows` of the varlen extend path) carries a `memo` dict; the first layer that
needs a shared value (the RoPE table of the step's positions per frequency table, index rows of non-indexer
ratios, visibility masks, pool columns) builds it and the others reuse it, since each tensor op is a kernel
on cuda. Inside a CUDA graph capture the build is captured with the first layer, so a replay recomputes it
from the step's buffers (the decode path's shapes are fixed per bucket); a new rows object starts empty.
Must not: hold anything across steps.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from deepinfer import kernels

T = TypeVar("T")


def memoised(memo: dict, key, make: Callable[[], T]) -> T:
    """`make()` once per key of `memo`: a step's (`rows.memo`) or, on V4.1's varlen path, one forward's
    (the `shared` dict its layers get)."""
    v = memo.get(key)
    if v is None:
        v = memo[key] = make()
    return v


def step_memo(rows, key, make: Callable[[], T]) -> T:
    """`make()` once per step and key (rows: the step's DecodeRows / ExtendRows)."""
    return memoised(rows.memo, key, make)


def rope_table(attn, rows, pos: torch.Tensor, of: object = "tokens") -> torch.Tensor:
    """The step's `rope_table32` of `pos` for attn's frequencies: one per step, frequency table
    (`attn.rope_key`: window-only and compressed layers differ) and kind of position `of` ("tokens": the
    step's positions; ("blocks", r): the first positions of the ratio-r blocks the compressors rotate), not
    one per rope32 call."""
    return rope_table_in(rows.memo, attn, pos, of)


def rope_table_in(memo: dict, attn, pos: torch.Tensor, of: object = "tokens") -> torch.Tensor:
    """`rope_table` kept in `memo` (`memoised`'s dicts)."""
    def build_rope_table() -> torch.Tensor:
        return kernels.get("rope_table32", attn.kdev)(pos, attn.inv_freq)

    return memoised(memo, ("rope", attn.rope_key, of), build_rope_table)
