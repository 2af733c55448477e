"""One compressor of one layer over every sequence of a varlen extend step at once (fast numerics): the same
entries and state rows as `compressor.compress_extend` run sequence by sequence, in a fixed number of ops.

Why: `compress_extend` costs ~20 torch ops per sequence and compressor (the concatenation of a sequence's
stored partial block with its new rows, the pooling, norm, RoPE, Hadamard and the state writes), which a
prefill step of many prompts pays per sequence on every compressed layer (a step of 16 new 128-token prompts:
2,656 of the tiny model's 5,170 torch calls; each is a launch on cuda).

How: every sequence's rows are read from one source, [its stored state rows | the step's new projected rows],
through a gather plan built once per step and ratio on the host (`CompressPlan`, shared by both compressors
and every layer of the ratio). The completed blocks of all sequences go to ONE `compress_pool` call: with
overlap (ratio 4) each sequence contributes its previous block then its completed ones, and the entries the
op computes across a boundary between two sequences are dropped, so every kept entry is computed from
exactly the rows, by exactly the code path, of the per-sequence call. Norm, RoPE and Hadamard are row-wise.
The state keeps what `compress_extend` keeps: the last complete block (overlap) and the rows of the
unfinished block, read before anything is written.
Must not: decide visibility or write the compressed-entry store (`extend_attention.compress_step` does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer import kernels
from deepinfer.devices import host_to_device
from deepinfer.model.cache import CompressorState
from deepinfer.model.context import ForwardContext


@dataclass
class CompressPlan:
    """Index tensors (device) of one step and ratio; rows index the source [B * R state rows | T new rows]."""

    slots: torch.Tensor  # [B] the sequences' state slots
    pool_rows: torch.Tensor  # [NB * r] source rows of the blocks to pool (sequence order)
    keep: torch.Tensor | None  # [N] which of compress_pool's outputs are entries (None: all of them)
    block_pos: torch.Tensor  # [N] the first position of each entry's block (its RoPE position)
    entry_index: torch.Tensor  # [N] index into the ratio's entry_rows (RatioExtendRows) of each entry
    state_dest: torch.Tensor  # [W] rows of state.kv.flatten(0, 1) the step writes
    state_src: torch.Tensor  # [W] their source rows
    num_entries: int


def build_plan(ctx: ForwardContext, ratio: int, rows_per_slot: int, ent_start: tuple[int, ...],
               device: torch.device, overlap: bool | None = None) -> CompressPlan:
    """The gather plan of `ctx`'s sequences for a compressor of `ratio` whose state holds `rows_per_slot`
    rows per slot (2r with overlap, r without); overlap: V4's rule (ratio 4) unless given (V4.1: never).
    Host ints only; one pinned copy per index tensor."""
    r = ratio
    overlap = ratio == 4 if overlap is None else overlap
    off = r if overlap else 0
    B, R = len(ctx.seqs), rows_per_slot
    pool_rows, keep, block_pos, entry_index, dest, src = [], [], [], [], [], []
    n_blocks = 0  # blocks handed to compress_pool so far
    for i, s in enumerate(ctx.seqs):
        a = ctx.cu_tokens[i]
        first_block = s.start_pos // r
        n_part = s.start_pos - first_block * r
        end = s.start_pos + s.num_new
        n = end // r - first_block  # blocks this extend completes
        stored = off + n_part  # the sequence's virtual rows: [stored state rows | its new rows]

        def virtual(j: int, i=i, a=a, stored=stored) -> int:
            return i * R + j if j < stored else B * R + a + (j - stored)

        if n:
            pool_rows.extend(virtual(j) for j in range(off + n * r))
            nb = n + (1 if overlap else 0)
            # overlap: compress_pool pairs block b with block b + 1; this sequence's entries are the pairs
            # starting at its own blocks but the last (the pair after it crosses into the next sequence)
            keep.extend(range(n_blocks, n_blocks + n))
            n_blocks += nb
            block_pos.extend((first_block + k) * r for k in range(n))
            entry_index.extend(ent_start[i] + first_block + k for k in range(n))
            if overlap:  # the last complete block feeds the next entry's A-half
                dest.extend(s.state_slot * R + j for j in range(r))
                src.extend(virtual(off + (n - 1) * r + j) for j in range(r))
        left = end % r
        if left:  # the unfinished block's rows
            dest.extend(s.state_slot * R + off + j for j in range(left))
            src.extend(virtual(off + n * r + j) for j in range(left))

    def dev(values: list[int]) -> torch.Tensor:
        return host_to_device(torch.tensor(values, dtype=torch.long), device)

    all_kept = not overlap or len(keep) == max(n_blocks - 1, 0)  # (compress_pool pools n_blocks - 1 pairs)
    return CompressPlan(dev([s.state_slot for s in ctx.seqs]), dev(pool_rows), None if all_kept else dev(keep),
                        dev(block_pos), dev(entry_index), dev(dest), dev(src), len(block_pos))


def compress_batch(p: dict[str, torch.Tensor], state: CompressorState, plan: CompressPlan, kv: torch.Tensor,
                   gate: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, rotate: bool,
                   kernel_device: str) -> torch.Tensor | None:
    """kv, gate [T, c*width] (the step's projected rows, fp32), positions [T] -> the step's entries [N, width]
    in plan order (bf16, not yet fake-quantised; None when the step completes no block), the state updated
    in place: `compress_extend(..., official=True, projected=...)` of every sequence, bit for bit."""
    def k(name: str):
        return kernels.get(name, kernel_device)

    r = state.ratio
    score = gate + p["ape"][positions % r]
    pooled = pool_and_advance(k, plan, r, state.overlap, state.kv, state.score, kv, score)
    if pooled is None:
        return None
    pooled = pooled.to(torch.bfloat16).to(torch.float32)
    entries = k("rms_norm")(pooled, p["norm.weight"], eps).to(torch.bfloat16)
    entries = k("rope32")(entries, plan.block_pos, inv_freq)
    return k("hadamard32")(entries) if rotate else entries


def pool_and_advance(k, plan: CompressPlan, r: int, overlap: bool, state_kv: torch.Tensor,
                     state_score: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                     clear: bool = False) -> torch.Tensor | None:
    """The plan's blocks pooled by one `compress_pool` call -> [N, width] fp32 in plan order (None: no block
    completed), and the state advanced in place: the rows `plan` keeps are copied in, read before anything
    is written. kv, score [T, width] the step's new rows (score with V4's ape added); state_kv / state_score
    [slots, rows, width]; clear: every slot of the plan is first emptied (kv 0, score -inf), as V4.1's
    per-sequence compressor does (V4's keeps the rows it does not overwrite). Both families' batches."""
    cw = kv.shape[-1]
    # the batch's stored rows first, then the new ones: one source per tensor for every gather below
    src_kv = torch.cat([state_kv[plan.slots].flatten(0, 1), kv])
    src_score = torch.cat([state_score[plan.slots].flatten(0, 1), score])
    pooled = None
    if plan.num_entries:
        kv_b = src_kv[plan.pool_rows].view(-1, r, cw)
        sc_b = src_score[plan.pool_rows].view(-1, r, cw)
        pooled = k("compress_pool")(kv_b, sc_b, overlap)
        if plan.keep is not None:
            pooled = pooled[plan.keep]
    if clear:  # (the sources above are copies: read before this)
        state_kv.index_fill_(0, plan.slots, 0)
        state_score.index_fill_(0, plan.slots, float("-inf"))
    if plan.state_dest.numel():
        state_kv.flatten(0, 1).index_copy_(0, plan.state_dest, src_kv[plan.state_src])
        state_score.flatten(0, 1).index_copy_(0, plan.state_dest, src_score[plan.state_src])
    return pooled
