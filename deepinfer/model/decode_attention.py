"""V4 attention and KV compressors for a pure-decode batch in fast numerics: every sequence adds one token,
the whole batch in fixed-shape tensor ops (no per-sequence Python loop, no shape that depends on positions),
so a step can be captured in a CUDA graph per batch bucket.

Owns: `decode_attention(attn, x, rows, cache)` (one layer) and `compress_decode` (its compressors). What
every layer of a step would compute alike (the RoPE table of the step's positions per frequency table, the
ascending selection of non-indexer ratios, pool columns) goes through `step_memo` on the step's `DecodeRows`
(launches per step, not per layer).
Same math and official rounding points as `V4Attention._forward_official` with fast=True; the differences
are in layout only:
* the new token's KV is written into the window ring FIRST; the attention then reads every key straight
  from the stored caches (op `sparse_attn_sink_paged`: index rows name ring rows, then compressed rows; on
  cuda one kernel decodes the packed FP8 entries in registers, no gathered or decoded copy);
* compressed entries are addressed for every sequence at once over `max_context // r` padded columns;
  ratio-4 layers with an indexer score them per sequence straight from the packed key cache
  (`indexer_scores_paged_bf16`: invisible columns -inf), take the stable top-k (ties to the lower entry) and
  turn the picks into index rows (`stable_topk_rows`: one kernel on cuda);
* compressor state is updated by a per-slot scatter; every row pools its state, and the entry is stored only
  where the completion mask says this token completed it (the KV compressor's step, RoPE and store one op,
  `compress_decode_store`: one kernel on cuda);
* the query's per-head norm and RoPE run with the attention (`sparse_attn_sink_paged_rope`'s q_norm_eps: on
  the paged kernel's q load on cuda).
On CUDA the compressors and the indexer run on side streams beside the query path (one chain on one side
stream; an indexer layer's in three lanes, `select_in_lanes`, unless DEEPINFER_INDEXER_LANES=0).
The sparse-attention index rows have the per-sequence path's order (window ascending, then the selection)
with more -1 padding, so only summation order differs (GEMM shapes, batched dot products). The window ring
and the compressed cache must share one layout (they do in every V4 revision: `cache/layouts.layouts_for`).
Must not: import the oracle; allocate per-sequence state; read anything that lives on the host.
"""
from __future__ import annotations

import contextlib

import torch

from deepinfer import env, kernels
from deepinfer.model.attention import V4Attention
from deepinfer.model.cache import LayerCache, V4Cache
from deepinfer.model.compressor import project
from deepinfer.model.decode_metadata import DecodeRows
from deepinfer.model.out_lora import out_lora
from deepinfer.model.side_stream import forked, mark, on_side, wait_mark
from deepinfer.model.step_memo import rope_table, step_memo
from deepinfer.model.stacked import pair

F32, BF16 = torch.float32, torch.bfloat16


def compress_decode(attn: V4Attention, lc: LayerCache, x: torch.Tensor, rows: DecodeRows, which: str = "both") -> None:
    """Advance the compressors of a ratio layer by one token per row and store the entries completed:
    `which` "both", "kv" (the attention's compressed KV) or "index" (the indexer's keys; indexer layers)."""
    rr = rows.ratios[attn.ratio]
    jobs = []
    if which in ("both", "kv"):
        jobs.append((attn.comp_p, lc.comp_state, lc.comp, False, "compressed"))
    if attn.has_indexer and which in ("both", "index"):
        jobs.append((attn.idx_comp_p, lc.index_state, lc.index_keys, True, "index"))
    # RoPE at the blocks' first positions (their table once per step and ratio: both compressors of every layer
    # of the ratio rotate the same positions by the same frequencies), then the store, only in the rows this
    # token completes; the index keys are Hadamard-rotated before theirs (one op on cuda)
    table = rope_table(attn, rows, rr.block_pos, of=("blocks", attn.ratio))
    for p, state, store, rotate, role in jobs:
        kv, gate = project(kernels.get("linear_f32", attn.kdev), x, p)  # the official fp32 matmul, one stacked GEMM
        step = (kv, gate, p["ape"], state.kv, state.score, rows.state_slots, rows.positions, rr.complete,
                p["norm.weight"], attn.eps, state.overlap)  # ape[p % r] is added inside the ops
        if rotate:
            entries = kernels.get("compress_decode_step", attn.kdev)(*step)
            kernels.get("index_key_rotate_store", attn.kdev)(entries, rr.block_pos, attn.inv_freq, table,
                                                             lc.layouts[role], store, rr.new_row, rr.complete)
        else:  # the step, the entries' RoPE and their packed store (one launch on cuda when fused)
            kernels.get("compress_decode_store", attn.kdev)(*step, rr.block_pos, attn.inv_freq, table,
                                                            lc.layouts[role], store, rr.new_row)


def decode_attention(attn: V4Attention, x: torch.Tensor, rows: DecodeRows, cache: V4Cache) -> torch.Tensor:
    """x [B, D] bf16 (one token per row) -> [B, D] bf16 (a `SplitK` of it where wo_b's partials are left to
    the next hc_pre: env.split_sum_consumers)."""
    if not attn.fast:
        raise ValueError("the batched decode path runs fast numerics only")
    cfg, p, r = attn.cfg, attn.p, attn.ratio

    def k(name: str):
        return kernels.get(name, attn.kdev)

    qlinear = k("fp8_linear")
    lc = cache.layers[attn.layer]
    pos = rows.positions
    table = rope_table(attn, rows, pos)

    B = x.shape[0]
    # split-K partials left to their consumers (env.split_sum_consumers): the stacked wq_a | wkv's to
    # qkv_norm_rope_store, wo_b's to the next sublayer's hc_pre (a SplitK rides in the block's PendingPost)
    consumers = env.split_sum_consumers()
    qkv_linear = k("fp8_linear_unsummed") if "qkv" in consumers else qlinear
    q_lora, kv_lin = pair(qkv_linear, x, p, "wq_a_wkv.weight", "wq_a.weight", "wkv.weight")  # one GEMM, stacked
    # qr = RMSNorm(q_lora); the KV normed, rotated and written into the window ring FIRST (the query sees it;
    # nothing on the side streams reads the ring): one kernel on cuda for what were four
    qr = k("qkv_norm_rope_store")(q_lora, kv_lin, p["q_norm.weight"], p["kv_norm.weight"], attn.eps, pos,
                                  attn.inv_freq, table, lc.layouts["window"], lc.ring.flatten(0, 1), rows.ring_row)

    n_ring = lc.ring.shape[0] * lc.ring.shape[1]  # compressed row c is attention row n_ring + c
    rr = rows.ratios[r] if r else None
    E = rr.entry_rows.shape[1] if r else 0
    lanes = 3 if attn.has_indexer and E and env.indexer_lanes_enabled() else 1  # side streams (select_in_lanes)
    if lanes > 1:  # the compressors' table of the step's block positions, built on main before the fork: two
        # lanes use it at once and must not race to build it (step_memo builds on first use, on that stream)
        rope_table(attn, rows, rr.block_pos, of=("blocks", r))

    def indexer_weights() -> torch.Tensor:  # [B, heads] bf16: the indexer's per-head weights of each row
        ihd, nh = cfg.index_head_dim, cfg.index_n_heads
        return k("blinear_scaled")(x, attn.idx_p["weights_proj.weight"], ihd**-0.5 * nh**-0.5)

    def indexer_query() -> torch.Tensor:  # [B, heads, ihd] bf16: rotated, Hadamard-mixed, FP4 fake-quantised
        q_idx = qlinear(qr, attn.idx_p["wq_b.weight"]).view(B, cfg.index_n_heads, cfg.index_head_dim)
        return k("indexer_q_rotate")(q_idx, pos, attn.inv_freq, table)  # RoPE, Hadamard, FP4: one kernel on cuda

    def indexer_rows(q_idx: torch.Tensor, w_idx: torch.Tensor) -> torch.Tensor:
        """Score every entry straight from the packed key cache (cuda: one kernel; hidden entries -inf, never
        read), take the stable top-k, and make the attention's index rows: the window's, then the picks'
        cache rows (-1 past the visible entries: the official sel = where(hid, -1, top))."""
        scores = k("indexer_scores_paged_bf16")(q_idx, w_idx, lc.index_keys, rr.entry_rows, rr.hidden,
                                                lc.layouts["index"])
        # the stable top-k (every pick in [0, E)), then its rows (one launch on cuda with DEEPINFER_TOPK_ROWS=fused)
        return k("stable_topk_rows")(scores, min(cfg.index_topk, E), rows.window_rows, rr.visible, rr.entry_rows,
                                     n_ring)

    def select() -> tuple[torch.Tensor, torch.Tensor | None]:
        """Advance the compressors and pick the rows to attend: (index rows, compressed cache or None)."""
        idx = rows.window_rows  # a window-only layer attends over these alone (no cat: it would be a copy)
        if not r:
            return idx, None
        compress_decode(attn, lc, x, rows)  # entries this token completes are visible to it
        if not E:
            return idx, None
        if attn.has_indexer:
            return indexer_rows(indexer_query(), indexer_weights()), lc.comp

        def build_ascending() -> torch.Tensor:  # every entry ascending: the same rows for every layer of r
            return torch.cat([idx, torch.where(rr.hidden, -1, rr.entry_rows + n_ring)], dim=1)
        return step_memo(rows, ("ascending", r), build_ascending), lc.comp

    def select_in_lanes(lanes) -> tuple[torch.Tensor, torch.Tensor]:
        """`select()` of an indexer layer over three side streams (default; DEEPINFER_INDEXER_LANES=0 keeps one
        chain): its one chain of ~25 small kernels was a decode layer's longest, longer than the query path
        beside it (H200, 2026-12-05: back-to-back steps 13-34 us faster with the lanes). Lane 0: the
        indexer's weights, then the KV compressor; lane 1: the index-key compressor; lane 2: the indexer's
        query, then (once lane 0's weights and lane 1's new keys are in) the scores, top-k and index rows.
        The same kernels on the same inputs: the compressors write different caches and states, and the
        scores read the keys only after lane 1's mark."""
        a, b, c = lanes
        with on_side(a):
            w_idx = indexer_weights()  # (made on lane 0, read on lane 2: referenced until the layer's join)
        weights_ready = mark(a)
        with on_side(a):
            compress_decode(attn, lc, x, rows, "kv")
        with on_side(b):
            compress_decode(attn, lc, x, rows, "index")  # this token's key is visible to its own scores
        keys_ready = mark(b)
        with on_side(c):
            q_idx = indexer_query()
            wait_mark(c, weights_ready)
            wait_mark(c, keys_ready)
            idx = indexer_rows(q_idx, w_idx)
        return idx, lc.comp

    # The compressors and the indexer need only x and qr, and the query path does not need them until the
    # attention: on CUDA they run on side streams beside it (model/side_stream.py); their cache writes
    # (compressed entries, index keys) and the window write above touch different caches.
    with contextlib.ExitStack() as forks:  # every lane joined at the block's end
        branches = [forks.enter_context(forked(x.device, lane)) for lane in range(lanes)]
        if lanes > 1:
            idx, comp = select_in_lanes(branches)
        else:
            with on_side(branches[0]):
                idx, comp = select()
        q = qlinear(qr, p["wq_b.weight"]).view(B, attn.H, attn.hd)  # normed per head and rotated in the attention
    layout = lc.layouts["window"]  # fast numerics stores the packed layouts (model/cache.py: cache_layouts)
    if comp is not None and layout != lc.layouts["compressed"]:
        raise ValueError(f"decode attention reads the ring and the compressed cache as one layout; got "
                         f"{layout.name} and {lc.layouts['compressed'].name}")
    # q's per-head norm and RoPE, the attention, then the inverse RoPE of its output: on cuda one kernel (the
    # norm and RoPE on its q load, the inverse RoPE in its epilogue), `head_rms_norm_rope` and `rope32` apart
    # being two launches more on the step's main chain
    o = k("sparse_attn_sink_paged_rope")(q, lc.ring, comp, layout, p["attn_sink"], idx, attn.hd**-0.5, pos,
                                         attn.inv_freq, table, q_norm_eps=attn.eps)
    G = attn.G
    z = out_lora(k, o.reshape(B, G, -1), p["wo_a.weight"])  # the official bf16 einsum's math, wo_a kept FP8
    if attn.comm is not None:
        return attn.comm.attn_out(qlinear(z.flatten(1), p["wo_b.weight"]))
    return k("fp8_linear_unsummed" if "post" in consumers else "fp8_linear")(z.flatten(1), p["wo_b.weight"])
