"""V4 attention of the engine over a varlen batch: low-rank q, single-latent KV, window ring + paged
compressed entries, the lightning indexer on ratio-4 layers, sparse attention with the sink, grouped
low-rank output (spec §3.5-§3.8).

Visibility (the invariant both implementations share): a query at position p sees window positions
max(0, p-window+1)..p and compressed entries j < (p+1)//r — on ratio-4 layers only the indexer's top-k of
those (ties toward the lower entry), k = min(index_topk, visible count).

Per layer and sequence the keys are gathered into one flat pool [ring rows of positions < start_pos;
this chunk's new rows; compressed entries 0..end//r-1] and one sparse-attention call serves the batch.
Official numerics (`official=True`): the official kernels' rounding points (kernels/official.py), KV
values fake-quantised by the cache's packed layouts (the new rows are stored once and the DECODED values
are what attention uses, like the oracle), and one sparse-attention call per sequence whose index rows
follow the official kernel's order exactly (its online softmax over blocks of 64 indices makes the order
and width visible in the last bits): window positions ascending then -1 up to min(S, window) columns for
a prefill from 0 (window otherwise); then the compressed selection (indexer top-k in score order, or
entries ascending) padded with -1 to min(topk, end//r) (or end//r) columns.
Fast numerics (`fast=True`): the official rounding points with FP8 weights kept quantised
(`fp8_linear`), the registry's kernels for the tensors' device, and one sparse-attention call for the
batch (each sequence's index rows offset into one flat pool, padded with -1): same math, other last bits.
Must not: import the reference oracle; keep per-batch state outside the cache and the ForwardContext.
"""
from __future__ import annotations

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.cache import LayerCache, V4Cache
from deepinfer.model.compressor import compress_extend, project
from deepinfer.model.context import ForwardContext
from deepinfer.model.out_lora import out_lora
from deepinfer.model.stacked import pair


def causal_window(qpos: torch.Tensor, win: int) -> torch.Tensor:
    """[S, win] absolute positions each query may see: its causal window [p - win + 1, p] (negative: none).
    The one place the engine's causality lives (the seed's P1 was a prefill without this mask)."""
    return qpos.unsqueeze(1) - win + 1 + torch.arange(win, device=qpos.device)


def _sub(p: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}


class V4Attention:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig, official: bool = False,
                 fast: bool = False, comm=None) -> None:
        self.layer, self.p, self.cfg = layer, params, cfg
        self.comm = comm  # deepinfer.distributed.Communicator, or None in one process
        self.official = official or fast  # fast numerics keeps the official rounding points
        self.fast = fast
        self.device = params["attn_sink"].device
        # Only fast numerics asks the registry for device kernels (Triton on cuda); exact and official keep
        # the torch twins, which run on any device and stay bit-identical to their CPU runs.
        self.kdev = self.device.type if fast else "cpu"
        self.ratio = cfg.compress_ratios[layer]
        self.win, self.hd = cfg.window_size, cfg.head_dim
        # this rank's heads and output groups, read off the (tensor-parallel sliced) weights
        wq_b = params["wq_b.weight"]  # a tensor, or a QuantLinearWeight in fast numerics
        self.H = getattr(wq_b, "out_features", None) or wq_b.shape[0]
        self.H //= cfg.head_dim
        wo_a = params["wo_a.weight"]  # a tensor, or a QuantLinearWeight in fast numerics (model/out_lora.py)
        self.G = (getattr(wo_a, "out_features", None) or wo_a.shape[0]) // cfg.o_lora_rank
        self.eps = cfg.norm_eps
        original = cfg.original_seq_len if cfg.uses_yarn(layer) else 0  # window-only layers: plain RoPE
        self.inv_freq = kernels.get("rope_inv_freq")(
            cfg.rope_head_dim, original, cfg.rope_base(layer), cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
        ).to(self.device)
        if self.official:  # fp32 frequencies, rotation in complex64 (the official precompute_freqs_cis)
            self.inv_freq = kernels.get("rope_freqs32")(
                cfg.rope_head_dim, original, cfg.rope_base(layer), cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
            ).to(self.device)
        # what determines inv_freq's values: layers with equal keys share one RoPE table per step (fast paths)
        self.rope_key = (self.official, cfg.rope_head_dim, original, cfg.rope_base(layer), cfg.rope_factor,
                         cfg.beta_fast, cfg.beta_slow)
        self.comp_p = _sub(params, "compressor.")
        self.has_indexer = bool(self.ratio) and cfg.has_indexer(layer)
        self.idx_p = _sub(params, "indexer.")
        self.idx_comp_p = _sub(params, "indexer.compressor.")

    # ------------------------------------------------------------------ compressed entries
    def _compress(self, lc: LayerCache, cache: V4Cache, ctx: ForwardContext, x: torch.Tensor) -> None:
        """Run the compressors of every sequence and write the entries its extend completes."""
        jobs = [(self.comp_p, lc.comp_state, lc.comp, False, "compressed")]
        if self.has_indexer:
            jobs.append((self.idx_comp_p, lc.index_state, lc.index_keys, True, "index"))
        batched = {}
        if self.fast:  # one projection GEMM per compressor for the whole batch (official: per sequence)
            lin = kernels.get("linear_f32", self.kdev)  # the official fp32 matmul of the bf16 x and weights
            batched = {role: project(lin, x, p) for p, _, _, _, role in jobs}
        for i, s in enumerate(ctx.seqs):
            xs = x[ctx.rows(i)]
            for p, state, store, rotate, role in jobs:
                proj = tuple(t[ctx.rows(i)] for t in batched[role]) if batched else None
                first, entries = compress_extend(p, state, s.state_slot, xs, s.start_pos, self.inv_freq, self.eps,
                                                 rotate, self.official, self.kdev, proj)
                if entries.shape[0]:
                    rows = cache.entry_rows(s.block_table, self.ratio, first + entries.shape[0])[first:]
                    store[rows] = lc.encode(role, entries)

    def _index_topk(self, q_idx: torch.Tensor, w_idx: torch.Tensor, keys: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
        """Indexer selection for one sequence: q_idx [S, h, d], w_idx [S, h], keys [E, d], visible [S]
        -> entry indices [S, min(topk, E)], -1 where a query sees fewer entries than that."""
        scores = kernels.get("indexer_scores")(q_idx, w_idx, keys)  # [S, E]
        hidden = torch.arange(keys.shape[0], device=keys.device).unsqueeze(0) >= visible.unsqueeze(1)
        scores = scores.masked_fill(hidden, float("-inf"))  # invisible entries sort after every visible one
        top = kernels.get("stable_topk")(scores, min(self.cfg.index_topk, keys.shape[0]))
        return torch.where(top >= visible.unsqueeze(1), -1, top)

    # ------------------------------------------------------------------ forward
    # fast numerics: the batched extend path (model/extend_attention.py); False runs the per-sequence
    # `_forward_official` loop instead (the reference the batched path is tested bit-identical against)
    batched_extend = True

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, cache: V4Cache) -> torch.Tensor:
        """x [T, D] (normed input of the flat batch) -> [T, D]."""
        if self.fast and self.batched_extend:
            from deepinfer.model.extend_attention import extend_attention  # imports this module

            return extend_attention(self, x, ctx, cache)
        if self.official:
            return self._forward_official(x, ctx, cache)
        cfg, p, r, win = self.cfg, self.p, self.ratio, self.win
        rms, rope = kernels.get("rms_norm"), kernels.get("rope")
        lc = cache.layers[self.layer]
        pos = ctx.positions
        T = x.shape[0]
        dev = x.device
        qr = rms(x @ p["wq_a.weight"].T, p["q_norm.weight"], self.eps)  # [T, q_lora_rank]
        q = (qr @ p["wq_b.weight"].T).view(T, self.H, self.hd)
        q = rope(kernels.get("head_rms_norm")(q, self.eps), pos, self.inv_freq)  # [T, H, hd]
        kv = rope(rms(x @ p["wkv.weight"].T, p["kv_norm.weight"], self.eps), pos, self.inv_freq)  # [T, hd]
        if r:
            self._compress(lc, cache, ctx, x)  # entries completed by this chunk are visible to it
        if self.has_indexer:
            ihd, nh = cfg.index_head_dim, cfg.index_n_heads
            q_idx = (qr @ self.idx_p["wq_b.weight"].T).view(T, nh, ihd)
            q_idx = kernels.get("hadamard")(rope(q_idx, pos, self.inv_freq))  # [T, nh, ihd]
            w_idx = (x @ self.idx_p["weights_proj.weight"].T) * (ihd**-0.5 * nh**-0.5)  # [T, nh]

        pool, idx_rows, base = [], [], 0
        for i, s in enumerate(ctx.seqs):
            rows = ctx.rows(i)
            P, S, end = s.start_pos, s.num_new, s.end_pos
            lo = max(0, P - win + 1)  # oldest position the first query can see
            kv_s = kv[rows]
            ring_kv = lc.ring_extend(s.window_slot, P, end, kv_s)  # [P - lo, hd]
            qpos = pos[rows]
            wpos = causal_window(qpos, win)  # [S, win] absolute positions
            n_win = P - lo + S
            parts = [torch.where(wpos >= 0, wpos - lo + base, -1)]  # pool row = position - lo
            pool += [ring_kv, kv_s]
            n_ent = end // r if r else 0
            if n_ent:
                ent_rows = cache.entry_rows(s.block_table, r, n_ent)
                pool.append(lc.comp[ent_rows])  # [n_ent, hd]
                visible = (qpos + 1) // r  # [S]
                if self.has_indexer:
                    sel = self._index_topk(q_idx[rows], w_idx[rows], lc.index_keys[ent_rows], visible)
                else:
                    sel = torch.arange(n_ent, device=dev).expand(S, -1)
                    sel = torch.where(sel >= visible.unsqueeze(1), -1, sel)
                parts.append(torch.where(sel >= 0, sel + base + n_win, -1))
            idx_rows.append(torch.cat(parts, dim=1))
            base += n_win + n_ent
        width = max(t.shape[1] for t in idx_rows)
        idx = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in idx_rows])  # [T, K]
        o = kernels.get("sparse_attn_sink")(q, torch.cat(pool), p["attn_sink"], idx, self.hd**-0.5)  # [T, H, hd]
        o = rope(o, pos, self.inv_freq, inverse=True)  # undo the rotation carried by the values
        G = self.G
        wo_a = p["wo_a.weight"].view(G, cfg.o_lora_rank, -1)
        z = torch.einsum("tgd,grd->tgr", o.reshape(T, G, -1), wo_a)  # [T, G, o_lora_rank]
        out = z.flatten(1) @ p["wo_b.weight"].T
        return out if self.comm is None else self.comm.attn_out(out)  # row-parallel wo_b: sum the partials

    # ------------------------------------------------------------------ official / fast numerics
    def _forward_official(self, x: torch.Tensor, ctx: ForwardContext, cache: V4Cache) -> torch.Tensor:
        """x [T, D] bf16 -> [T, D] bf16 with the official kernels' rounding points.
        Official: FP8 weights as exact fp32 values (`qlinear`), one sparse-attention call per sequence.
        Fast: FP8 weights as `QuantLinearWeight` (`fp8_linear`), the kernels of the tensors' device, and
        ONE sparse-attention call for the whole batch over a flat pool of every sequence's keys."""
        cfg, p, r, win = self.cfg, self.p, self.ratio, self.win

        def k(name: str):
            return kernels.get(name, self.kdev)

        qlinear, rope = k("fp8_linear" if self.fast else "qlinear"), k("rope32")
        f32, bf16 = torch.float32, torch.bfloat16

        # The fused ops the batched path (model/extend_attention.py) calls: their twins are exactly the separate
        # official ops (so official numerics keeps its bits), and on cuda this reference path then runs the
        # batched path's kernels (one bf16 ulp apart from the separate ones: tests/test_engine_fast_prefill.py
        # holds the two paths bit-identical on the GPU too)
        def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return k("rms_norm_bf16")(t, w, self.eps)  # = rms_norm(t.to(fp32), w).to(bf16)

        lc = cache.layers[self.layer]
        pos = ctx.positions
        T = x.shape[0]
        dev = x.device
        q_lora, kv_lin = pair(qlinear, x, p, "wq_a_wkv.weight", "wq_a.weight", "wkv.weight")  # one GEMM, stacked
        qr = rms(q_lora, p["q_norm.weight"])
        q = qlinear(qr, p["wq_b.weight"]).view(T, self.H, self.hd)
        q = k("head_rms_norm_rope")(q, self.eps, pos, self.inv_freq, None)  # per-head norm in bf16, RoPE
        kv = rope(rms(kv_lin, p["kv_norm.weight"]), pos, self.inv_freq)  # [T, hd]
        kv_stored = lc.encode("window", kv)
        kv = lc.decode("window", kv_stored)  # the fake-quantised values the oracle attends to and caches
        if r:
            self._compress(lc, cache, ctx, x)
        if self.has_indexer:
            ihd, nh = cfg.index_head_dim, cfg.index_n_heads
            q_idx = qlinear(qr, self.idx_p["wq_b.weight"]).view(T, nh, ihd)
            q_idx = k("indexer_q_rotate")(q_idx, pos, self.inv_freq, None)  # RoPE, Hadamard, FP4 fake quant
            w_idx = k("blinear_scaled")(x, self.idx_p["weights_proj.weight"], ihd**-0.5 * nh**-0.5)

        outs, pools, idxs, base = [], [], [], 0
        for i, s in enumerate(ctx.seqs):
            rows = ctx.rows(i)
            P, S, end = s.start_pos, s.num_new, s.end_pos
            lo = max(0, P - win + 1)
            ring_kv = lc.ring_extend(s.window_slot, P, end, kv_stored[rows])
            qpos = pos[rows]
            width = min(S, win) if P == 0 else win  # the official index width of a prefill / a decode
            qlo = (qpos - win + 1).clamp(min=0)  # oldest visible position per query
            wpos = qlo.unsqueeze(1) + torch.arange(width, device=dev)  # ascending, then -1
            parts = [torch.where(wpos <= qpos.unsqueeze(1), wpos - lo, -1)]
            pool = [ring_kv, kv[rows]]
            n_win = P - lo + S
            n_ent = end // r if r else 0
            if n_ent:
                ent_rows = cache.entry_rows(s.block_table, r, n_ent)
                pool.append(lc.decode("compressed", lc.comp[ent_rows]))
                visible = (qpos + 1) // r
                if self.has_indexer:
                    keys = lc.decode("index", lc.index_keys[ent_rows])
                    scores = k("indexer_scores_bf16")(q_idx[rows], w_idx[rows], keys, visible)  # [S, E], masked
                    sel = k("stable_topk")(scores, min(cfg.index_topk, n_ent))
                else:
                    sel = torch.arange(n_ent, device=dev).expand(S, -1)
                sel = torch.where(sel >= visible.unsqueeze(1), -1, sel)
                parts.append(torch.where(sel >= 0, sel + n_win, -1))
            idx = torch.cat(parts, dim=1)
            if self.fast:  # pool rows of this sequence start at `base` in the batch's flat pool
                pools += pool
                idxs.append(torch.where(idx >= 0, idx + base, -1))
                base += n_win + n_ent
            else:
                outs.append(k("sparse_attn_sink_official")(q[rows], torch.cat(pool), p["attn_sink"], idx,
                                                           self.hd**-0.5))
        if self.fast:
            width = max(t.shape[1] for t in idxs)
            idx = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in idxs])
            o = k("sparse_attn_sink_official")(q, torch.cat(pools), p["attn_sink"], idx, self.hd**-0.5)
        else:
            o = torch.cat(outs)
        o = rope(o, pos, self.inv_freq, inverse=True)
        G = self.G
        if self.fast:  # the official bf16 einsum's math (fp32 accumulation, bf16 out), wo_a kept FP8 (out_lora)
            z = out_lora(k, o.reshape(T, G, -1), p["wo_a.weight"])  # o is bf16, as official
        else:
            wo_a = p["wo_a.weight"].view(G, cfg.o_lora_rank, -1)  # the same values as official's fp32
            z = torch.einsum("tgd,grd->tgr", o.reshape(T, G, -1).to(f32), wo_a.to(f32)).to(bf16)  # bf16 einsum
        out = qlinear(z.flatten(1), p["wo_b.weight"])
        return out if self.comm is None else self.comm.attn_out(out)
