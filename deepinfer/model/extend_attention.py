"""V4 attention of a varlen extend batch (prefill chunks, long extends, mixed prefill + decode) in fast
numerics, with the step's rows from `extend_metadata` (built once per step, one host-to-device copy) and no
host sync: a layer is a fixed handful of ops plus, only on indexer layers, one scoring + top-k per sequence
(its keys are its own).

Owns: `extend_attention(attn, x, ctx, cache)` (one layer) and `compress_step` (its compressors). What every
layer of the step would compute alike (the RoPE table per frequency table, non-indexer index rows,
per-sequence visibility masks, pool columns) goes through `step_memo` on the step's `ExtendRows`.
Same math, rounding points and index-row order as `V4Attention._forward_official` with fast=True (the
per-sequence path, kept for official numerics and as this path's reference: CPU results are bit-identical,
tests/test_engine_fast_prefill.py); the differences are in organisation only:
* the cache codec goes through the registry's `kv_encode` / `kv_decode` (one Triton kernel each on cuda for
  the FP8 layouts; the layout's own codec elsewhere: the same bytes);
* the window ring is read for every sequence in one gather and written in one scatter;
* every sequence's compressed entries of a ratio are gathered (and their indexer keys decoded) at once; on
  indexer layers a sequence whose S queries select fewer entries in total (S * k) than it has decodes only
  the selected ones (decode-like steps of long sequences), else all of its visible entries once;
* the completed entries of all sequences are encoded in one call per compressor and stored in one scatter.
Must not: import the oracle; read host values of device tensors (no .item(), .tolist(), nonzero).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer import kernels
from deepinfer.model.cache import LayerCache, V4Cache
from deepinfer.model.compress_batch import build_plan, compress_batch
from deepinfer.model.compressor import compress_extend, project
from deepinfer.model.context import ForwardContext
from deepinfer.model.extend_metadata import ExtendRows, RatioExtendRows, current_extend_rows
from deepinfer.model.indexer_select import build_select_plan, select_batched
from deepinfer.model.out_lora import out_lora
from deepinfer.model.step_memo import rope_table, step_memo
from deepinfer.model.stacked import pair

F32, BF16 = torch.float32, torch.bfloat16
# several sequences' compressors (compress_batch) and indexer selection (indexer_select) in one pass each;
# False: sequence by sequence (the tests' reference)
BATCH_SEQUENCES = True


def compress_step(attn, lc: LayerCache, ctx: ForwardContext, projected: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  rr: RatioExtendRows, rows: ExtendRows | None = None) -> None:
    """Run both compressors of every sequence on the batch's projections (`projected[role]` = (x @ wkv.T,
    x @ wgate.T) of the layer's input x, one GEMM each: `attention_pre`) and store the entries the step
    completes: one encode and one scatter per compressor. Several sequences go through `compress_batch` (a
    fixed number of ops for the batch, its plan built once per step and ratio); one sequence through
    `compress_extend` (views of its rows, no gathers)."""
    jobs = [(attn.comp_p, lc.comp_state, lc.comp, False, "compressed")]
    if attn.has_indexer:
        jobs.append((attn.idx_comp_p, lc.index_state, lc.index_keys, True, "index"))
    if BATCH_SEQUENCES and rows is not None and len(ctx.seqs) > 1:
        plan = step_memo(rows, ("compress plan", attn.ratio), lambda: build_plan(
            ctx, attn.ratio, lc.comp_state.kv.shape[1], rr.ent_start, rr.entry_rows.device))
        for p, state, store, rotate, role in jobs:
            kv_all, gate_all = projected[role]
            e = compress_batch(p, state, plan, kv_all, gate_all, rows.positions, attn.inv_freq, attn.eps, rotate,
                               attn.kdev)
            if e is not None:
                store[rr.entry_rows[plan.entry_index]] = lc.encode(role, e, attn.kdev)
        return
    for p, state, store, rotate, role in jobs:
        kv_all, gate_all = projected[role]
        entries, where = [], []
        for i, s in enumerate(ctx.seqs):
            rows_i = ctx.rows(i)
            first, e = compress_extend(p, state, s.state_slot, None, s.start_pos, attn.inv_freq, attn.eps,
                                       rotate, True, attn.kdev, (kv_all[rows_i], gate_all[rows_i]))
            if e.shape[0]:
                start = rr.ent_start[i] + first
                entries.append(e)
                where.append(rr.entry_rows[start : start + e.shape[0]])
        if entries:  # (one sequence: no cat, which would copy each)
            rows_e, e = (where[0], entries[0]) if len(entries) == 1 else (torch.cat(where), torch.cat(entries))
            store[rows_e] = lc.encode(role, e, attn.kdev)


def _indexer_selection_batched(attn, lc: LayerCache, ctx: ForwardContext, rows: ExtendRows, rr: RatioExtendRows,
                               q_idx: torch.Tensor, w_idx: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_indexer_selection` of several sequences in a fixed number of ops besides one scoring call per
    sequence (model/indexer_select.py): the same pool rows and columns."""
    keys = lc.decode("index", lc.index_keys[rr.entry_rows], attn.kdev)
    plan = step_memo(rows, ("select plan", attn.ratio, base), lambda: build_select_plan(
        ctx, rr.n_ent, rr.ent_start, attn.cfg.index_topk, base, q_idx.device))
    return select_batched(lambda name: kernels.get(name, attn.kdev), plan, q_idx, w_idx, keys, rr.visible,
                          rr.entry_rows, lc.comp)


def _indexer_selection(attn, lc: LayerCache, ctx: ForwardContext, rows: ExtendRows, rr: RatioExtendRows,
                       q_idx: torch.Tensor, w_idx: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: score its entries, take the stable top-k of the visible ones -> (stored entries the pool
    appends [N, bytes], index columns [T, C] into the pool counted from `base`, -1 = none). The masks of
    invisible entries and the pool columns depend on the step only: built once for the step's indexer layers."""
    k = lambda name: kernels.get(name, attn.kdev)  # noqa: E731
    keys = lc.decode("index", lc.index_keys[rr.entry_rows], attn.kdev)  # every sequence's keys in one decode
    dev = q_idx.device
    pieces, parts = [], []
    for i, s in enumerate(ctx.seqs):
        S, n, e0 = s.num_new, rr.n_ent[i], rr.ent_start[i]
        if not n:
            parts.append(torch.full((S, 0), -1, dtype=torch.long, device=dev))
            continue
        tok = ctx.rows(i)
        visible = rr.visible[tok].unsqueeze(1)
        # [S, n], -inf past what each query sees (the op masks, and skips the blocks no query sees)
        scores = k("indexer_scores_bf16")(q_idx[tok], w_idx[tok], keys[e0 : e0 + n], rr.visible[tok])
        sel = k("stable_topk")(scores, min(attn.cfg.index_topk, n))
        hidden = sel >= visible  # picks past the visible entries (a query that sees fewer than k)
        ent = rr.entry_rows[e0 : e0 + n]
        K = sel.shape[1]
        if S * K < n:  # fewer selections than entries: gather and decode only what the queries read
            pieces.append(lc.comp[ent[torch.where(hidden, 0, sel)].flatten()])

            def build_pool_cols(b=base, S=S, K=K) -> torch.Tensor:
                return torch.arange(b, b + S * K, device=dev).view(S, K)

            cols = step_memo(rows, ("pool cols", attn.ratio, i, base, K), build_pool_cols)
            parts.append(torch.where(hidden, -1, cols))
            base += S * K
        else:  # one where over [S, k]: a pick is visible exactly when it is a column (top-k indices are >= 0)
            pieces.append(lc.comp[ent])
            parts.append(torch.where(hidden, -1, sel + base))
            base += n
    width = max(t.shape[1] for t in parts)
    # no pad / cat copy of the [T, k] columns when there is nothing to pad or join (one prefill)
    padded = [t if t.shape[1] == width else F.pad(t, (0, width - t.shape[1]), value=-1) for t in parts]
    cols = padded[0] if len(padded) == 1 else torch.cat(padded)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)), cols


def _index_rows(rows: ExtendRows, comp_cols: torch.Tensor | None, comp_width: tuple[int, ...]) -> torch.Tensor:
    """[T, K] index rows: each sequence's window columns, then its compressed columns, padded with -1 to
    the widest sequence's total (the per-sequence path's layout exactly)."""
    win = rows.window_idx
    if comp_cols is None:
        return win
    widths = rows.window_width
    total = max(w + c for w, c in zip(widths, comp_width))
    if len(set(widths)) == 1:  # every sequence's compressed part starts at the same column
        return torch.cat([win, comp_cols], dim=1)[:, :total]
    T, C = comp_cols.shape
    out = torch.full((T, win.shape[1] + C), -1, dtype=torch.long, device=win.device)
    out[:, : win.shape[1]] = win
    cols = rows.window_width_row.unsqueeze(1) + torch.arange(C, device=win.device)
    return out.scatter_(1, cols, comp_cols)[:, :total]


@dataclass
class AttnPre:
    """What one layer's attention computes from its input rows alone (no cache, no batch layout): the
    queries, the new KV rows as stored and as attended to, the indexer's queries and weights, the
    compressors' projections. Every op's shapes depend on the token count only, so the extend graphs
    (model/extend_graphs.py) capture it per token bucket; `attention_core` reads it for the step's rows."""

    q: torch.Tensor  # [T, H, hd] normed, rotated queries (norm_q=False: the raw projection, which the attention
    #                   norms and rotates: op sparse_attn_sink_qnorm, `attention_core`'s q_rope)
    kv_stored: torch.Tensor  # [T, bytes] the new rows in the window layout (kv itself without a layout)
    kv: torch.Tensor  # [T, hd] their decoded values: what the oracle attends to and caches
    q_idx: torch.Tensor | None  # [T, nh, ihd] the indexer's queries (indexer layers)
    w_idx: torch.Tensor | None  # [T, nh] its head weights
    projected: dict[str, tuple[torch.Tensor, torch.Tensor]]  # role -> (x @ wkv.T, x @ wgate.T) (ratio layers)

    def map(self, fn) -> "AttnPre":
        """A new AttnPre of fn(name, tensor) for every tensor (None fields stay None); the projections are
        named "{role} kv" and "{role} gate"."""
        def f(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(name, t)

        return AttnPre(f("q", self.q), f("kv_stored", self.kv_stored), f("kv", self.kv), f("q_idx", self.q_idx),
                       f("w_idx", self.w_idx),
                       {role: (fn(f"{role} kv", a), fn(f"{role} gate", b)) for role, (a, b) in self.projected.items()})


def step_tables(attn, ctx: ForwardContext, cache: V4Cache) -> tuple[ExtendRows, torch.Tensor, torch.Tensor]:
    """(the step's rows, its positions, the RoPE table of attn's frequencies at them), shared by the layers."""
    rows = current_extend_rows(ctx, attn.cfg, cache)
    return rows, ctx.positions, rope_table(attn, rows, ctx.positions)


def attention_pre(attn, x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, layouts: dict | None,
                  indexer: bool = True, q_out: torch.Tensor | None = None, norm_q: bool = True) -> AttnPre:
    """x [T, D] bf16 (normed input of the flat batch), its positions and RoPE table, the cache's packed
    layouts (`V4Cache.layouts`) -> AttnPre. indexer=False skips the indexer's queries (a step whose
    sequences see no compressed entry yet reads none); q_out: a [T, H, hd] bf16 buffer for the queries;
    norm_q=False: the queries stay the raw wq_b projection (`attention_core` with q_rope norms them)."""
    cfg, p = attn.cfg, attn.p

    def k(name: str):
        return kernels.get(name, attn.kdev)

    qlinear, rope32 = k("fp8_linear"), k("rope32")

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # upcast, fp32 RMSNorm, bf16 round: one kernel on cuda instead of three (within one bf16 ulp of the
        # three there, bit-identical on the CPU twin; norm_hc.rms_norm_bf16 says why)
        return k("rms_norm_bf16")(t, w, attn.eps)

    T = x.shape[0]
    q_lora, kv_lin = pair(qlinear, x, p, "wq_a_wkv.weight", "wq_a.weight", "wkv.weight")  # one GEMM, stacked
    qr = rms(q_lora, p["q_norm.weight"])
    q = qlinear(qr, p["wq_b.weight"]).view(T, attn.H, attn.hd)
    if norm_q:
        q = k("head_rms_norm_rope")(q, attn.eps, pos, attn.inv_freq, table, out=q_out)  # per-head norm, RoPE: one kernel
    elif q_out is not None:
        raise ValueError("attention_pre: q_out is the normed queries' buffer; norm_q=False keeps the projection's")
    # RoPE in place: the normed rows are this op's fresh output (only the rope channels move)
    kv = rope32(rms(kv_lin, p["kv_norm.weight"]), pos, attn.inv_freq, table=table, inplace=True)  # [T, hd]
    kv_stored = kv if layouts is None else k("kv_encode")(layouts["window"], kv)
    if layouts is not None:  # the fake-quantised values the oracle attends to and caches
        kv = k("kv_decode")(layouts["window"], kv_stored)
    q_idx = w_idx = None
    projected = {}
    if attn.ratio:
        lin = k("linear_f32")  # the official fp32 matmul of the bf16 x and weights
        projected["compressed"] = project(lin, x, attn.comp_p)
        if attn.has_indexer:
            projected["index"] = project(lin, x, attn.idx_comp_p)
            if indexer:
                ihd, nh = cfg.index_head_dim, cfg.index_n_heads
                q_idx = qlinear(qr, attn.idx_p["wq_b.weight"]).view(T, nh, ihd)
                q_idx = k("indexer_q_rotate")(q_idx, pos, attn.inv_freq, table)  # RoPE, Hadamard, FP4 fake quant
                w_idx = k("blinear_scaled")(x, attn.idx_p["weights_proj.weight"], ihd**-0.5 * nh**-0.5)
    return AttnPre(q, kv_stored, kv, q_idx, w_idx, projected)


def attention_core(attn, pre: AttnPre, ctx: ForwardContext, cache: V4Cache, rows: ExtendRows,
                   out: torch.Tensor | None = None,
                   q_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The step's cache reads and writes and the sparse attention: pre's rows -> o [T, H, hd] bf16 (before
    the inverse RoPE), into `out` when given (the extend graphs' static buffer). q_rope (positions, RoPE
    table): pre.q is the raw projection (`attention_pre`'s norm_q=False); the attention op norms and rotates it
    first (op sparse_attn_sink_qnorm: on CUDA inside the prefill kernel with DEEPINFER_ATTN_QNORM=kernel)."""
    cfg, p, r = attn.cfg, attn.p, attn.ratio
    lc = cache.layers[attn.layer]
    T = pre.q.shape[0]
    ring_kv = lc.ring_extend_rows(rows, pre.kv_stored, attn.kdev)  # read before this step's rows overwrite it
    pool = [ring_kv, pre.kv]
    comp_cols, comp_width, idx = None, (), None  # idx: set here when the step already built it
    if r:
        rr = rows.ratios[r]
        compress_step(attn, lc, ctx, pre.projected, rr, rows)  # entries completed by this step are visible
        base = ring_kv.shape[0] + T  # the compressed entries' first pool row
        if any(rr.n_ent):
            if attn.has_indexer:
                if pre.q_idx is None:
                    raise ValueError(f"layer {attn.layer}: the step's sequences see compressed entries, but "
                                     f"attention_pre ran without the indexer's queries")
                select = _indexer_selection_batched if BATCH_SEQUENCES and len(ctx.seqs) > 1 else _indexer_selection
                stored, comp_cols = select(attn, lc, ctx, rows, rr, pre.q_idx, pre.w_idx, base)
                comp_width = tuple(min(cfg.index_topk, n) for n in rr.n_ent)
            else:  # every visible entry, ascending: the same index rows for every layer of this ratio
                stored = lc.comp[rr.entry_rows]

                def build_ascending(base=base) -> torch.Tensor:
                    j = torch.arange(max(rr.n_ent), device=pre.q.device)
                    cols = torch.where(j < rr.visible.unsqueeze(1), base + rr.ent_start_row.unsqueeze(1) + j, -1)
                    return _index_rows(rows, cols, rr.n_ent)

                idx = step_memo(rows, ("ascending", r, base), build_ascending)
            pool.append(lc.decode("compressed", stored, attn.kdev))
    if idx is None:
        idx = _index_rows(rows, comp_cols, comp_width)
    if q_rope is not None:
        return kernels.get("sparse_attn_sink_qnorm", attn.kdev)(pre.q, torch.cat(pool), p["attn_sink"], idx,
                                                                attn.hd**-0.5, attn.eps, q_rope[0], attn.inv_freq,
                                                                q_rope[1], out=out)
    return kernels.get("sparse_attn_sink_official", attn.kdev)(pre.q, torch.cat(pool), p["attn_sink"], idx,
                                                               attn.hd**-0.5, out=out)


def attention_post(attn, o: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """o [T, H, hd] -> the layer's output [T, D] bf16: inverse RoPE, the grouped wo_a, wo_b (and the
    tensor-parallel sum). o is rotated in place (the core's fresh output, or the graphs' buffer of it)."""
    def k(name: str):
        return kernels.get(name, attn.kdev)

    T = o.shape[0]
    o = k("rope32")(o, pos, attn.inv_freq, True, table=table, inplace=True)
    z = out_lora(k, o.reshape(T, attn.G, -1), attn.p["wo_a.weight"])  # the official bf16 einsum's math, wo_a FP8
    out = k("fp8_linear")(z.flatten(1), attn.p["wo_b.weight"])
    return out if attn.comm is None else attn.comm.attn_out(out)


def extend_attention(attn, x: torch.Tensor, ctx: ForwardContext, cache: V4Cache) -> torch.Tensor:
    """x [T, D] bf16 (normed input of the flat batch) -> [T, D] bf16."""
    rows, pos, table = step_tables(attn, ctx, cache)
    indexer = bool(attn.ratio) and any(rows.ratios[attn.ratio].n_ent)
    # the queries' per-head norm and RoPE go with the attention (one op: on CUDA, with DEEPINFER_ATTN_QNORM=kernel,
    # inside the prefill kernel instead of a full write and re-read of q; the extend graphs keep them in
    # attention_pre, their captured part)
    pre = attention_pre(attn, x, pos, table, cache.layers[attn.layer].layouts, indexer, norm_q=False)
    return attention_post(attn, attention_core(attn, pre, ctx, cache, rows, q_rope=(pos, table)), pos, table)
