"""V4.1 attention of a varlen extend batch (prefill chunks, long extends, mixed prefill + decode) in fast
numerics, every sequence at once: the step's rows come from `extend_metadata` (built once per forward, one
host-to-device copy) and a layer runs a fixed number of ops plus, on index-source layers, one scoring call per
sequence (its keys are its own).

Why: `V41Attention._forward_official` walks the batch sequence by sequence in every layer (ring read/write,
compressor, entry rows, decodes, scoring, top-k, index rows): ~580 torch calls per sequence on the tiny
checkpoint, each a launch (and tens of microseconds of host time) on cuda, so a prefill step of 16 prompts
cost 9,924 calls against V4's 790 (`benchmarks/count_prefill_ops.py --family v41 --seqs 16`).

Owns: `extend_attention_v41(attn, x, ctx, cache, rows, shared)` (one layer) as `attention_pre` (what the rows
compute alone: `V41Pre`, which the extend graphs capture per token bucket, model/v41_extend_graphs.py),
`attention_core` (the cache work and the sparse attention, eager) and `V41Attention.attention_post`;
`write_entries` (a kv source's compressor and its stored latents and index keys); `step_rows` (the forward's
`ExtendRows`). Same math, rounding points and index-row order
as `_forward_official` with fast=True (the per-sequence path, kept as this path's reference:
`V41Attention.batched_extend = False`; CPU results bit-identical, tests/test_engine_fast_v41_extend.py); the
differences are in organisation only:
* the window ring is read for every sequence in one gather and written in one scatter (`ExtendRows`, built
  with V4.1's window order: `build_extend_rows(..., ring_order=True)`);
* the compressor runs on the batch: ratio 1 over every row (an entry per token), ratio 2 through
  `compress_batch`'s plan (one `compress_pool` for every completed group, the state advanced in one
  gather / fill / copy); the latents and index keys of all sequences are normed, rotated, encoded and stored
  in one call each;
* the pool is [every sequence's ring rows | the step's new rows | every sequence's decoded latents of the kv
  source]: the same values the per-sequence pools hold, so the same index columns (other numbers) read the
  same values in the same order;
* index sources score each sequence into one [T, widest] buffer (-inf padding), mask, filter by the
  candidate blocks and take ONE position-order top-k for the step: padding sorts after every real entry, so
  each row keeps the per-sequence picks (its extra columns are -1, as the per-sequence rows' padding); the
  full index rows are kept for the consumers of that index source.
Must not: import the oracle; read device values on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer import kernels
from deepinfer.model.compress_batch import build_plan, pool_and_advance
from deepinfer.model.context import ForwardContext
from deepinfer.model.extend_attention import _index_rows
from deepinfer.model.extend_metadata import ExtendRows, RatioExtendRows, current_extend_rows
from deepinfer.model.step_memo import memoised, rope_table, step_memo
from deepinfer.model.v41_attention import _rms_bf16, select_candidate_blocks
from deepinfer.model.v41_cache import V41Cache, V41LayerCache


def step_rows(shared: dict, ctx: ForwardContext, cfg, cache: V41Cache) -> ExtendRows:
    """The forward's `ExtendRows` (`current_extend_rows`: V4.1's window order), built by its first layer and
    kept in `shared`."""
    return memoised(shared, "v41 extend rows", lambda: current_extend_rows(ctx, cfg, cache))


def _k(attn, name: str):
    return kernels.get(name, attn.kdev)


def write_entries(attn, lc: V41LayerCache, ctx: ForwardContext, proj: tuple[torch.Tensor, ...],
                  rows: ExtendRows) -> None:
    """A kv-source layer's compressor over the whole batch: the batch's projections (`_compressor_proj`:
    (latent,) at ratio 1, (kv, score) at ratio 2) -> the entries the step completes (ratio 1: one per new
    token; ratio 2: one per completed group), their latents and index keys (normed, rotated at the entry's
    first position, encoded) stored at their cache rows. `compress_extend_v41` (official=True) and
    `_write_entries_official`, every sequence at once."""
    r, eps, kdev = attn.ratio, attn.eps, attn.kdev
    rr = rows.ratios[r]
    if r == 1:
        lat = _rms_bf16(proj[0], attn.comp_p["norm.weight"], eps, kdev)
        gpos, where = rows.positions, step_memo(rows, ("v41 token entries", r),
                                                lambda: rr.entry_rows[rr.ent_start_row + rows.positions])
        table = rope_table(attn, rows, gpos)
    else:
        plan = step_memo(rows, ("v41 compress plan", r), lambda: build_plan(
            ctx, r, lc.state_kv.shape[1], rr.ent_start, rr.entry_rows.device, overlap=False))
        pooled = pool_and_advance(lambda name: _k(attn, name), plan, r, False, lc.state_kv, lc.state_score, *proj,
                                  clear=True)
        if pooled is None:
            return
        lat = _rms_bf16(pooled.to(torch.bfloat16), attn.comp_p["norm.weight"], eps, kdev)
        gpos, where = plan.block_pos, step_memo(rows, ("v41 group entries", r), lambda: rr.entry_rows[plan.entry_index])
        table = rope_table(attn, rows, gpos, ("blocks", r))
    attn.store_entries(lc, lat, gpos, where, table)


def _select_rows(attn, src: V41LayerCache, ctx: ForwardContext, rows: ExtendRows, rr: RatioExtendRows,
                 q_idx: torch.Tensor, w_idx: torch.Tensor, shared: dict, base: int) -> torch.Tensor:
    """An index source's top-k for the step -> the full index rows [T, K] (window columns, then the picks
    as pool rows counted from `base`, -1 = none): `_select` of every sequence at once."""
    cfg, dev, T = attn.cfg, q_idx.device, q_idx.shape[0]
    keys = src.decode("index", src.index_keys[rr.entry_rows], attn.kdev)  # every sequence's keys, one decode
    widest = max(rr.n_ent)
    scores = torch.full((T, widest), float("-inf"), dtype=torch.bfloat16, device=dev)
    score = _k(attn, "indexer_scores_bf16")
    for i, s in enumerate(ctx.seqs):
        n, e0, a = rr.n_ent[i], rr.ent_start[i], ctx.cu_tokens[i]
        if n:  # the per-sequence kernel call: the same score bits, -inf past what each query sees
            scores[a : a + s.num_new, :n] = score(q_idx[a : a + s.num_new], w_idx[a : a + s.num_new],
                                                  keys[e0 : e0 + n], rr.visible[a : a + s.num_new])
    visible = rr.visible  # (columns past a sequence's n stay the fill's -inf)
    if attn.is_cand_source:  # (padding and invisible entries are -inf: never a reachable block)
        shared["v41 candidates"] = select_candidate_blocks(scores, visible, cfg.candidate_topk_blocks,
                                                           cfg.candidate_block_size, attn.kdev)
    elif attn.uses_cand:
        scores.masked_fill_(~shared["v41 candidates"], float("-inf"))
    top = _k(attn, "topk_positions")(scores, min(cfg.index_topk, widest))  # the stable top-k, ascending
    cols = torch.where(top < visible.unsqueeze(1), top + base + rr.ent_start_row.unsqueeze(1), -1)
    return _index_rows(rows, cols, tuple(min(cfg.index_topk, n) for n in rr.n_ent))


@dataclass
class V41Pre:
    """What one layer's attention computes from its input rows alone (no cache read, no batch layout): every
    op's shapes depend on the token count only, so the extend graphs (model/v41_extend_graphs.py) capture it
    per token bucket; `attention_core` reads it for the step's rows."""

    q: torch.Tensor  # [T, H, hd] rotated queries
    kv_stored: torch.Tensor  # [T, bytes] the new window rows as stored
    kv: torch.Tensor  # [T, hd] their decoded values (what attention reads)
    q_idx: torch.Tensor | None  # [T, nh, ihd] the indexer's queries (index sources)
    w_idx: torch.Tensor | None  # [T, nh] its head weights
    proj: tuple[torch.Tensor, ...]  # the compressor's projections (kv sources; else empty)

    def map(self, fn) -> "V41Pre":
        """A new V41Pre of fn(name, tensor) for every tensor (None fields stay None)."""
        def f(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(name, t)

        return V41Pre(f("q", self.q), f("kv_stored", self.kv_stored), f("kv", self.kv), f("q_idx", self.q_idx),
                      f("w_idx", self.w_idx), tuple(fn(f"proj {j}", t) for j, t in enumerate(self.proj)))


def attention_pre(attn, x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, lc: V41LayerCache) -> V41Pre:
    """x [T, D] bf16 (the normed input of the flat batch), its positions and RoPE table -> V41Pre."""
    q, kv_stored, kv, q_idx, w_idx = attn.attention_pre(x, pos, table, lc)
    proj = attn._compressor_proj(x) if attn.is_kv_source else ()
    return V41Pre(q, kv_stored, kv, q_idx, w_idx, proj)


def attention_core(attn, pre: V41Pre, ctx: ForwardContext, cache: V41Cache, rows: ExtendRows, shared: dict,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's cache reads and writes and the sparse attention: pre's rows -> o [T, H, hd] bf16 (before
    the inverse RoPE), into `out` when given (the extend graphs' static buffer). `shared`: the forward's
    dict (the index sources' rows and the candidate mask, for the layers after them)."""
    r, lc, T = attn.ratio, cache.layers[attn.layer], pre.q.shape[0]
    if attn.is_kv_source:
        write_entries(attn, lc, ctx, pre.proj, rows)  # the entries this step completes are visible to it
    ring_kv = lc.ring_extend_rows(rows, pre.kv_stored, attn.kdev)  # read before this step's rows overwrite it
    pool = [ring_kv, pre.kv]
    idx = rows.window_idx
    if r and any(rows.ratios[r].n_ent):
        rr, src = rows.ratios[r], cache.layers[attn.kv_src]
        pool.append(src.decode("latent", src.comp[rr.entry_rows], attn.kdev))
        if attn.is_index_source:
            idx = shared[("v41 index rows", attn.layer)] = _select_rows(
                attn, src, ctx, rows, rr, pre.q_idx, pre.w_idx, shared, ring_kv.shape[0] + T)
        else:
            idx = shared[("v41 index rows", attn.idx_src)]
    return _k(attn, "sparse_attn_sink_official_v41")(pre.q, torch.cat(pool), attn.p["attn_sink"], idx,
                                                     attn.hd**-0.5, out=out)


def extend_attention_v41(attn, x: torch.Tensor, ctx: ForwardContext, cache: V41Cache, rows: ExtendRows,
                         shared: dict) -> torch.Tensor:
    """x [T, D] bf16 (normed input of the flat batch) -> [T, D] bf16: pre, core, `attention_post`."""
    pos = rows.positions
    table = rope_table(attn, rows, pos)
    pre = attention_pre(attn, x, pos, table, cache.layers[attn.layer])
    return attn.attention_post(attention_core(attn, pre, ctx, cache, rows, shared), pos, table)
