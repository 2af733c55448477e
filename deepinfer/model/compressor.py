"""V4 KV compressor for extends of any length: resume the stored partial block, pool every block that
completes, store what is left (spec §3.6).

Owns: the per-extend math of one compressor (main KV: rotate=False; indexer keys: rotate=True) over one
sequence's new tokens. Equivalent to the official prefill-then-one-token-at-a-time state machine: the
pooled rows and their order are the same, only the split into calls differs.
Must not: decide which entries a query may see, or write entries (the caller owns the paged cache).
"""
from __future__ import annotations

import torch

from deepinfer import kernels
from deepinfer.model.cache import CompressorState
from deepinfer.model.stacked import pair


def project(lin, x: torch.Tensor, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ wkv.T, x @ wgate.T) through the GEMM op `lin` ("linear_f32"): one GEMM over the stacked
    [wkv; wgate] when the fast params hold it (`stacked.pair`)."""
    return pair(lin, x, p, "wkv_wgate.weight", "wkv.weight", "wgate.weight")


def compress_extend(p: dict[str, torch.Tensor], state: CompressorState, slot: int, x: torch.Tensor | None,
                    start_pos: int, inv_freq: torch.Tensor, eps: float, rotate: bool,
                    official: bool = False, kernel_device: str = "cpu",
                    projected: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[int, torch.Tensor]:
    """x [S, D] = the sequence's new tokens at positions start_pos.. ; returns (first entry index, entries
    [n, width]) for the n blocks completed by this extend (n may be 0) and updates the state in place.

    official=True (x bf16, `inv_freq` = the fp32 `rope_freqs32` table): projections, state and pooling in
    fp32, the pooled entry rounded to bf16, fp32 RMSNorm -> bf16, complex64 RoPE, fp32 Hadamard -> bf16.
    The returned entries are NOT fake-quantised: the cache's packed layout does that when they are stored.
    kernel_device: whose registry kernels to use ("cpu": the torch twins, which run on any device).
    projected: (x @ wkv.T, x @ wgate.T) of these rows when the caller projected the whole batch at once
    (fast numerics: one GEMM per compressor and layer instead of one per sequence); x may then be None.
    """
    def k(name: str):
        return kernels.get(name, kernel_device)

    r, overlap = state.ratio, state.overlap
    if projected is not None:  # x itself is not read: no fp32 copy of it (an [S, dim] cast per call)
        kv, gate = projected
    else:
        if x is None:
            raise ValueError("compress_extend needs x or its projections")
        if official:
            x = x.to(torch.float32)
        kv, gate = x @ p["wkv.weight"].T, x @ p["wgate.weight"].T  # [S, c*width]
    S = kv.shape[0]
    end = start_pos + S
    positions = torch.arange(start_pos, end, device=kv.device)
    score = gate + p["ape"][positions % r]
    first_block = start_pos // r
    n_part = start_pos - first_block * r  # rows of the current block already stored
    off = r if overlap else 0  # overlap: the previous complete block sits in rows [0, r)
    if off + n_part:  # [off + n_part + S, c*width]
        kv_all = torch.cat([state.kv[slot, : off + n_part], kv])
        score_all = torch.cat([state.score[slot, : off + n_part], score])
    else:  # nothing stored before (a block-aligned start without overlap): no copy
        kv_all, score_all = kv, score
    n = end // r - first_block  # blocks completed by this extend
    left = kv_all.shape[0] - off - n * r  # == end % r
    entries = kv.new_zeros(0, state.kv.shape[-1] // (2 if overlap else 1))
    if n:
        cw = kv_all.shape[-1]
        kv_b = kv_all[: off + n * r].view(-1, r, cw)  # overlap: [n+1, r, 2w] (block 0 = previous block)
        sc_b = score_all[: off + n * r].view(-1, r, cw)
        pooled = k("compress_pool")(kv_b, sc_b, overlap)  # [n, width]
        # RoPE at each block's first position (one launch: the arange's step is r)
        block_pos = torch.arange(first_block * r, (first_block + n) * r, r, device=kv.device)
        if official:
            pooled = pooled.to(torch.bfloat16).to(torch.float32)
            entries = k("rms_norm")(pooled, p["norm.weight"], eps).to(torch.bfloat16)
            entries = k("rope32")(entries, block_pos, inv_freq)
            if rotate:
                entries = k("hadamard32")(entries)
        else:
            entries = kernels.get("rms_norm")(pooled, p["norm.weight"], eps)
            entries = kernels.get("rope")(entries, block_pos, inv_freq)
            if rotate:
                entries = kernels.get("hadamard")(entries)
        if overlap:  # the last complete block's rows feed the next entry's A-half
            state.kv[slot, :r] = kv_all[off + (n - 1) * r : off + n * r]
            state.score[slot, :r] = score_all[off + (n - 1) * r : off + n * r]
    if left:
        state.kv[slot, off : off + left] = kv_all[off + n * r :]
        state.score[slot, off : off + left] = score_all[off + n * r :]
    return first_block, entries
