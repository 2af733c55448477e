"""V4.1 attention of the engine over a varlen batch (spec §10.3): low-rank q without a head norm, window
ring, the V4.1 compressor (ratio 1: per-token latent; ratio 2: gated softmax pooling of 2 tokens, no ape)
on kv-source layers, cross-layer sharing of compressed KV (`kv_source_of`) and top-k indices
(`index_source_of`), the indexer whose keys (wk/k_norm) belong to the kv source, the two-level candidate
block filter, sparse attention with the sink.

Visibility: a query at p sees window positions max(0, p-window+1)..p and compressed entries j < (p+1)//r;
index sources pick top-k of those (ties toward the lower entry; after the candidate-source layer only
inside the candidate blocks), consumers reuse the latest index source's picks for the same queries.
Official numerics (`official=True`, one sequence per call from the model): the official V4.1 kernels'
rounding points (kernels/official.py, activation blocks of cfg.act_block): bf16 activations, FP8 act quant
before FP8/FP4 GEMMs, bf16-weight linears for the ratio-1 compressor / indexer keys / indexer weights, fp32
ratio-2 compressor, complex64 RoPE, no Hadamard; the window KV, latents and index keys fake-quantised by
the cache's packed layouts (new rows stored once, the DECODED values are what attention uses); the
indexer query FP4 per 32 and bf16 score rounding; the V4.1 sparse-attention kernel (running max from
-1e30) with the official index order and width: a prefill from 0 lists window positions ascending then -1
(min(S, window) columns), an extend at P > 0 lists the ring in slot order oldest first (-1 for unfilled
slots, window columns); then the compressed top-k in position order padded to min(topk, end//r).
Fast numerics (`fast=True`): the official rounding points with FP8 weights kept quantised (`fp8_linear`,
32x32 blocks, activations quantised per 32), wo_a in bf16 (`grouped_proj_bf16`), the registry's kernels for
the tensors' device, the compressor projections as one GEMM for the batch, and ONE sparse-attention call for
the batch (each sequence's official index rows offset into one flat pool, padded with -1): same math,
other last bits than official. Every tensor (index rows, positions) lives on the params' device.
Must not: import the reference oracle; per-forward sharing lives in the `shared` dict of one forward.
"""
from __future__ import annotations

import torch

from deepinfer import formats, kernels
from deepinfer.config import ModelConfig
from deepinfer.model.compressor import project
from deepinfer.model.context import ForwardContext
from deepinfer.model.out_lora import out_lora
from deepinfer.model.stacked import pair
from deepinfer.model.step_memo import memoised, rope_table_in
from deepinfer.model.v41_cache import V41Cache, V41LayerCache


def _sub(p: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}


def _rms_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, kdev: str = "cpu") -> torch.Tensor:
    """Official RMSNorm: the (bf16) input upcast, fp32 math, bf16 out (kdev: whose registered kernel). A bf16
    x takes `rms_norm_bf16` (one launch on cuda instead of three, within one bf16 ulp of them there; the same
    bits on the CPU twin), as V4's fast path does."""
    if x.dtype == torch.bfloat16:
        return kernels.get("rms_norm_bf16", kdev)(x, weight, eps)
    return kernels.get("rms_norm", kdev)(x.to(torch.float32), weight, eps).to(torch.bfloat16)


def compress_extend_v41(p: dict[str, torch.Tensor], lc: V41LayerCache, slot: int, x: torch.Tensor,
                        start_pos: int, eps: float, official: bool = False, kdev: str = "cpu",
                        proj: tuple[torch.Tensor, ...] | None = None) -> tuple[int, torch.Tensor]:
    """x [S, D] new tokens -> (first entry index, normalised latents BEFORE RoPE [n, hd]) of the groups
    this extend completes; the partial group's rows stay in the state.
    official: ratio 1 a bf16 linear + fp32 norm -> bf16; ratio 2 fp32 projections / state / pooling, the
    pooled latent rounded to bf16, fp32 norm -> bf16. kdev: whose registered kernels (fast numerics);
    proj: this sequence's rows of projections computed for the whole batch (ratio 1: (latent,), ratio 2:
    (kv, score)), or None to project here."""
    r, S = lc.ratio, x.shape[0]
    if official:
        def rms(t, w, e):
            return _rms_bf16(t, w, e, kdev)
    else:
        rms = kernels.get("rms_norm")
    if r == 1:
        if proj is not None:
            lin = proj[0]
        elif official:
            lin = kernels.get("blinear", kdev)(x, p["wkv.weight"])
        else:
            lin = x @ p["wkv.weight"].T
        return start_pos, rms(lin, p["norm.weight"], eps)
    if proj is not None:
        kv, score = proj
    else:
        xf = x.to(torch.float32) if official else x
        kv, score = xf @ p["wkv.weight"].T, xf @ p["wgate.weight"].T
    first, n_part = start_pos // r, start_pos % r
    kv_all = torch.cat([lc.state_kv[slot, :n_part], kv])
    sc_all = torch.cat([lc.state_score[slot, :n_part], score])
    n = (start_pos + S) // r - first
    left = kv_all.shape[0] - n * r
    lat = kv.new_zeros(0, kv.shape[-1])
    if n:
        pooled = kernels.get("compress_pool", kdev)(kv_all[: n * r].view(n, r, -1), sc_all[: n * r].view(n, r, -1),
                                                    False)
        if official:
            pooled = pooled.to(torch.bfloat16)
        lat = rms(pooled, p["norm.weight"], eps)
    lc.state_kv[slot].zero_()
    lc.state_score[slot].fill_(float("-inf"))
    if left:
        lc.state_kv[slot, :left] = kv_all[n * r :]
        lc.state_score[slot, :left] = sc_all[n * r :]
    return first, lat


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, top_blocks: int, block: int,
                            kdev: str = "cpu"):
    """scores [S, E] (-inf where invisible), visible [S] -> keep mask [S, E]: each query's best `top_blocks`
    blocks (block score = max), the block of its newest visible entry always kept, empty blocks never."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=float("-inf"))
    bs = padded.unflatten(-1, (-1, block)).amax(dim=-1)  # [S, nb]
    nb = bs.shape[-1]
    newest = ((visible - 1) // block).unsqueeze(-1)
    bs = bs.masked_fill(torch.arange(nb, device=scores.device) == newest, float("inf"))
    chosen = kernels.get("topk_positions", kdev)(bs, min(top_blocks, nb))  # the stable top-k's set (order unused)
    reachable = bs.gather(-1, chosen) > float("-inf")
    keep = torch.zeros_like(bs, dtype=torch.bool).scatter(-1, chosen, reachable)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


def _window_rows(shared: dict, i: int, qpos: torch.Tensor, P: int, win: int) -> torch.Tensor:
    """Sequence i's window columns of the official index rows (official / fast numerics), relative to its
    oldest visible position max(0, P - win + 1): a prefill from 0 lists the visible positions ascending, then
    -1; an extend at P > 0 the ring in slot order, oldest first, -1 for unfilled slots. Every layer of a
    forward has the same window, so the rows are made once per forward (kept in `shared`)."""
    def build_window_rows() -> torch.Tensor:
        q, dev = qpos.unsqueeze(1), qpos.device
        if P == 0:  # prefill pattern: ascending from the oldest visible position, then -1
            wpos = (q - win + 1).clamp(min=0) + torch.arange(min(q.shape[0], win), device=dev)
            wpos = torch.where(wpos <= q, wpos, -1)
        else:  # the ring in slot order, oldest first; unfilled slots -1
            slot = (q % win + 1 + torch.arange(win, device=dev)) % win
            wpos = q - (q - slot) % win
        return torch.where(wpos >= 0, wpos - max(0, P - win + 1), -1)

    return memoised(shared, ("window rows", i), build_window_rows)


class V41Attention:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig,
                 all_params: dict[str, torch.Tensor], official: bool = False, comm=None, fast: bool = False) -> None:
        self.layer, self.p, self.cfg = layer, params, cfg
        self.official, self.fast = official or fast, fast  # fast numerics keeps the official rounding points
        self.comm = comm  # deepinfer.distributed.Communicator, or None in one process
        self.device = params["attn_sink"].device
        # Only fast numerics asks the registry for device kernels (Triton on cuda); exact and official keep
        # the torch twins, which run on any device and stay bit-identical to their CPU runs.
        self.kdev = self.device.type if fast else "cpu"
        self.ratio = r = cfg.compress_ratios[layer]
        self.win, self.hd, self.eps = cfg.window_size, cfg.head_dim, cfg.norm_eps
        # this rank's heads and output groups, read off the (tensor-parallel sliced) weights
        wq_b = params["wq_b.weight"]  # a tensor, or a QuantLinearWeight in fast numerics
        self.H = (getattr(wq_b, "out_features", None) or wq_b.shape[0]) // cfg.head_dim
        wo_a = params["wo_a.weight"]  # a tensor, or a QuantLinearWeight in fast numerics (model/out_lora.py)
        self.G = (getattr(wo_a, "out_features", None) or wo_a.shape[0]) // cfg.o_lora_rank
        original = cfg.original_seq_len if cfg.uses_yarn(layer) else 0
        freqs = "rope_freqs32" if self.official else "rope_inv_freq"  # official: fp32 table, complex64 rotation
        self.inv_freq = kernels.get(freqs)(
            cfg.rope_head_dim, original, cfg.rope_base(layer), cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
        ).to(self.device)
        # what determines inv_freq's values: layers with equal keys share one RoPE table per step (the batched
        # decode path's `step_memo.rope_table`, as V4Attention.rope_key)
        self.rope_key = (self.official, cfg.rope_head_dim, original, cfg.rope_base(layer), cfg.rope_factor,
                         cfg.beta_fast, cfg.beta_slow)
        self.is_kv_source = bool(r) and layer in cfg.kv_source_layers
        self.is_index_source = bool(r) and layer in cfg.index_source_layers
        self.kv_src = cfg.kv_source_of(layer) if r else None
        self.idx_src = cfg.index_source_of(layer) if r else None
        if r and (self.kv_src is None or self.idx_src is None):
            raise ValueError(f"layer {layer}: compressed layer without a kv or index source")
        if r and (cfg.compress_ratios[self.kv_src] != r or cfg.compress_ratios[self.idx_src] != r):
            raise NotImplementedError(f"layer {layer}: sharing across different compression ratios")
        self.comp_p = _sub(params, "compressor.")
        self.idx_p = _sub(params, "indexer.")
        # the indexer keys' projection belongs to the kv source (wk/k_norm live on its indexer)
        self.key_p = _sub(all_params, f"layers.{self.kv_src}.attn.indexer.") if r else {}
        cand = cfg.candidate_source_layer
        self.is_cand_source = layer == cand
        self.uses_cand = 0 <= cand < layer

    def _k(self, name: str):
        return kernels.get(name, self.kdev)

    def _write_entries(self, lc: V41LayerCache, cache: V41Cache, ctx: ForwardContext, x: torch.Tensor) -> None:
        rope, rms, r = kernels.get("rope"), kernels.get("rms_norm"), self.ratio
        for i, s in enumerate(ctx.seqs):
            first, lat = compress_extend_v41(self.comp_p, lc, s.state_slot, x[ctx.rows(i)], s.start_pos, self.eps)
            n = lat.shape[0]
            if not n:
                continue
            gpos = (first + torch.arange(n, device=x.device)) * r  # an entry stands for the first position of its group
            keys = rms(lat @ self.key_p["wk.weight"].T, self.key_p["k_norm.weight"], self.eps)
            rows = cache.entry_rows(s.block_table, r, first + n)[first:]
            lc.index_keys[rows] = rope(keys, gpos, self.inv_freq)
            lc.comp[rows] = rope(lat, gpos, self.inv_freq)

    def _select(self, i: int, rows: slice, qpos: torch.Tensor, keys: torch.Tensor, q_idx, w_idx, shared,
                scores_op: str = "indexer_scores") -> torch.Tensor:
        """Index-source top-k for sequence i -> entry indices [S, k] in position order, -1 = none."""
        n_ent = keys.shape[0]
        visible = (qpos + 1) // self.ratio
        scores = self._k(scores_op)(q_idx[rows], w_idx[rows], keys)
        hidden = torch.arange(n_ent, device=keys.device).unsqueeze(0) >= visible.unsqueeze(1)
        scores = scores.masked_fill(hidden, float("-inf"))
        cand = shared.setdefault("candidates", {})
        if self.is_cand_source:
            cand[i] = select_candidate_blocks(scores, visible, self.cfg.candidate_topk_blocks,
                                              self.cfg.candidate_block_size, self.kdev)
        elif self.uses_cand:
            scores = scores.masked_fill(~cand[i], float("-inf"))
        top = self._k("topk_positions")(scores, min(self.cfg.index_topk, n_ent))  # the stable top-k, ascending
        return torch.where(top < visible.unsqueeze(1), top, -1)

    # fast numerics: the batched extend path (model/v41_extend.py); False runs the per-sequence
    # `_forward_official` loop instead (the reference the batched path is tested bit-identical against)
    batched_extend = True

    def __call__(self, x: torch.Tensor, ctx: ForwardContext, cache: V41Cache, shared: dict) -> torch.Tensor:
        """x [T, D] (normed input of the flat batch) -> [T, D]."""
        if self.fast and self.batched_extend:
            from deepinfer.model.v41_extend import extend_attention_v41, step_rows  # imports this module

            return extend_attention_v41(self, x, ctx, cache, step_rows(shared, ctx, self.cfg, cache), shared)
        if self.official:
            return self._forward_official(x, ctx, cache, shared)
        cfg, p, r, win = self.cfg, self.p, self.ratio, self.win
        rms, rope = kernels.get("rms_norm"), kernels.get("rope")
        lc = cache.layers[self.layer]
        pos, T, dev = ctx.positions, x.shape[0], x.device
        qr = rms(x @ p["wq_a.weight"].T, p["q_norm.weight"], self.eps)
        q = rope((qr @ p["wq_b.weight"].T).view(T, self.H, self.hd), pos, self.inv_freq)  # no head norm in V4.1
        kv = rope(rms(x @ p["wkv.weight"].T, p["kv_norm.weight"], self.eps), pos, self.inv_freq)
        if self.is_kv_source:
            self._write_entries(lc, cache, ctx, x)
        src = cache.layers[self.kv_src] if r else None
        if self.is_index_source:
            ihd, nh = cfg.index_head_dim, cfg.index_n_heads
            q_idx = rope((qr @ self.idx_p["wq_b.weight"].T).view(T, nh, ihd), pos, self.inv_freq)
            w_idx = (x @ self.idx_p["weights_proj.weight"].T) * (ihd**-0.5 * nh**-0.5)
            shared[self.layer] = {}

        pool, idx_rows, base = [], [], 0
        for i, s in enumerate(ctx.seqs):
            rows = ctx.rows(i)
            P, S, end = s.start_pos, s.num_new, s.end_pos
            lo = max(0, P - win + 1)
            kv_s = kv[rows]
            ring_kv = lc.ring_extend(s.window_slot, P, end, kv_s)
            qpos = pos[rows]
            wpos = qpos.unsqueeze(1) - win + 1 + torch.arange(win, device=dev)
            n_win = P - lo + S
            parts = [torch.where(wpos >= 0, wpos - lo + base, -1)]
            pool += [ring_kv, kv_s]
            n_ent = end // r if r else 0
            if n_ent:
                ent_rows = cache.entry_rows(s.block_table, r, n_ent)
                pool.append(src.comp[ent_rows])
                if self.is_index_source:
                    sel = self._select(i, rows, qpos, src.index_keys[ent_rows], q_idx, w_idx, shared)
                    shared[self.layer][i] = sel
                else:
                    sel = shared[self.idx_src][i]
                parts.append(torch.where(sel >= 0, sel + base + n_win, -1))
            idx_rows.append(torch.cat(parts, dim=1))
            base += n_win + n_ent
        width = max(t.shape[1] for t in idx_rows)
        idx = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in idx_rows])
        o = kernels.get("sparse_attn_sink")(q, torch.cat(pool), p["attn_sink"], idx, self.hd**-0.5)
        o = rope(o, pos, self.inv_freq, inverse=True)
        G = self.G
        wo_a = p["wo_a.weight"].view(G, cfg.o_lora_rank, -1)
        z = torch.einsum("tgd,grd->tgr", o.reshape(T, G, -1), wo_a)
        out = z.flatten(1) @ p["wo_b.weight"].T
        return out if self.comm is None else self.comm.attn_out(out)  # row-parallel wo_b: sum the partials

    # ------------------------------------------------------------------ official / fast numerics
    def _compressor_proj(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Fast numerics: the compressor's projections of the whole batch in one GEMM each (official projects
        per sequence: same math, other last bits). None outside fast numerics."""
        if not self.fast:
            return None
        p = self.comp_p
        if self.ratio == 1:
            return (self._k("blinear")(x, p["wkv.weight"]),)
        # the official fp32 matmul of the bf16 x and weights; one GEMM over the stacked [wkv; wgate]
        return project(self._k("linear_f32"), x, p)

    def _write_entries_official(self, lc: V41LayerCache, cache: V41Cache, ctx: ForwardContext,
                                x: torch.Tensor) -> None:
        eps, r, kdev = self.eps, self.ratio, self.kdev
        proj = self._compressor_proj(x)
        for i, s in enumerate(ctx.seqs):
            rows = ctx.rows(i)
            first, lat = compress_extend_v41(self.comp_p, lc, s.state_slot, x[rows], s.start_pos, eps, True, kdev,
                                             None if proj is None else tuple(t[rows] for t in proj))
            n = lat.shape[0]
            if not n:
                continue
            gpos = (first + torch.arange(n, device=x.device)) * r
            self.store_entries(lc, lat, gpos, cache.entry_rows(s.block_table, r, first + n)[first:])

    def index_keys_of(self, lat: torch.Tensor) -> torch.Tensor:
        """Official numerics: the indexer keys of latents [n, hd] bf16 BEFORE RoPE (the kv source's wk as a bf16
        linear, its k_norm) -> [n, ihd] bf16. Every path's kv sources (varlen, batched extend, decode)."""
        return _rms_bf16(self._k("blinear")(lat, self.key_p["wk.weight"]), self.key_p["k_norm.weight"], self.eps,
                         self.kdev)

    def store_entries(self, lc: V41LayerCache, lat: torch.Tensor, gpos: torch.Tensor, where: torch.Tensor,
                      table: torch.Tensor | None = None) -> None:
        """Official numerics: new entries' latents [n, hd] (before RoPE) and their index keys, each rotated to
        its group's first position `gpos` (`table`: the rope_table32 of gpos, or None), encoded into the kv
        source's caches at rows `where`."""
        rope, kdev = self._k("rope32"), self.kdev
        keys = self.index_keys_of(lat)
        lc.index_keys[where] = lc.encode("index", rope(keys, gpos, self.inv_freq, table=table), kdev)  # FP4, E8M0/32
        lc.comp[where] = lc.encode("latent", rope(lat, gpos, self.inv_freq, table=table), kdev)  # FP4, E4M3 per 16

    def _linears(self):
        """(kernel lookup, the FP8 linear, the official bf16 RMSNorm) of this layer's numerics."""
        k = self._k
        if self.fast:
            qlinear = k("fp8_linear")  # the weight carries its act_block (cfg.act_block)
        else:
            def qlinear(t, w):
                return kernels.get("qlinear")(t, w, self.cfg.act_block)

        def rms(t, w):
            return _rms_bf16(t, w, self.eps, self.kdev)

        return k, qlinear, rms

    def attention_pre(self, x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, layouts: V41LayerCache):
        """What the layer computes from its input rows alone (no cache read, no batch layout): x [T, D] bf16,
        their positions and RoPE table -> (q [T, H, hd], the new window rows as stored and decoded (what
        attention reads), the indexer's queries [T, nh, ihd] and weights [T, nh] on index sources, else
        None). `layouts`: the layer cache whose packed window layout stores the rows."""
        cfg, p = self.cfg, self.p
        k, qlinear, rms = self._linears()
        rope, T = k("rope32"), x.shape[0]
        # fast numerics: wq_a and wkv in one GEMM (`params_fast.STACKS`); official: two
        q_lora, kv_lin = pair(qlinear, x, p, "wq_a_wkv.weight", "wq_a.weight", "wkv.weight")
        qr = rms(q_lora, p["q_norm.weight"])
        # rotations in place: each input is the fresh output of the op before it (only the rope channels move)
        q = rope(qlinear(qr, p["wq_b.weight"]).view(T, self.H, self.hd), pos, self.inv_freq, table=table,
                 inplace=True)
        kv = rope(rms(kv_lin, p["kv_norm.weight"]), pos, self.inv_freq, table=table, inplace=True)
        kv_stored = layouts.encode("window", kv, self.kdev)  # FP8 of all channels, E8M0 per 32
        kv = layouts.decode("window", kv_stored, self.kdev)
        q_idx = w_idx = None
        if self.is_index_source:
            ihd, nh = cfg.index_head_dim, cfg.index_n_heads
            q_idx = rope(qlinear(qr, self.idx_p["wq_b.weight"]).view(T, nh, ihd), pos, self.inv_freq, table=table,
                         inplace=True)
            q_idx = formats.fp4_fake_quant(q_idx, 32)  # no Hadamard in V4.1
            w_idx = k("blinear_scaled")(x, self.idx_p["weights_proj.weight"], ihd**-0.5 * nh**-0.5)
        return q, kv_stored, kv, q_idx, w_idx

    def attention_post(self, o: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """o [T, H, hd] (the sparse attention's fresh output, rotated in place) -> [T, D] bf16: inverse RoPE,
        the grouped wo_a, wo_b (and the tensor-parallel sum)."""
        k, qlinear, _ = self._linears()
        T, G = o.shape[0], self.G
        o = k("rope32")(o, pos, self.inv_freq, inverse=True, table=table, inplace=True)
        if self.fast:  # the official bf16 einsum's math (fp32 accumulation, bf16 out), wo_a kept FP8 (out_lora)
            z = out_lora(k, o.reshape(T, G, -1), self.p["wo_a.weight"])
        else:
            wo_a = self.p["wo_a.weight"].view(G, self.cfg.o_lora_rank, -1)  # the same values as official's
            z = torch.einsum("tgd,grd->tgr", o.reshape(T, G, -1).to(torch.float32), wo_a).to(torch.bfloat16)
        out = qlinear(z.flatten(1), self.p["wo_b.weight"])
        return out if self.comm is None else self.comm.attn_out(out)

    def _forward_official(self, x: torch.Tensor, ctx: ForwardContext, cache: V41Cache, shared: dict) -> torch.Tensor:
        """x [T, D] bf16 -> [T, D] bf16 with the official V4.1 kernels' rounding points, sequence by sequence.
        Official: FP8 weights as exact fp32 values (`qlinear`), one sparse-attention call per sequence.
        Fast (with `batched_extend` off: the reference of model/v41_extend.py): FP8 weights as
        `QuantLinearWeight` (`fp8_linear`), the kernels of the tensors' device, ONE sparse-attention call for
        the batch over a flat pool of every sequence's keys."""
        r, win, fast, k = self.ratio, self.win, self.fast, self._k
        lc = cache.layers[self.layer]
        pos = ctx.positions
        # one rotation table per forward and frequency set (`rope_table32`: the same bits as rope32 building its
        # own, which is 4 more kernels a call on cuda); window-only and compressed layers have their own
        table = rope_table_in(shared, self, pos)
        q, kv_stored, kv, q_idx, w_idx = self.attention_pre(x, pos, table, lc)
        if self.is_kv_source:
            self._write_entries_official(lc, cache, ctx, x)
        src = cache.layers[self.kv_src] if r else None
        if self.is_index_source:
            shared[self.layer] = {}

        outs, pools, idxs, base = [], [], [], 0
        for i, s in enumerate(ctx.seqs):
            rows = ctx.rows(i)
            P, S, end = s.start_pos, s.num_new, s.end_pos
            lo = max(0, P - win + 1)
            ring_kv = lc.ring_extend(s.window_slot, P, end, kv_stored[rows], self.kdev)
            parts = [_window_rows(shared, i, pos[rows], P, win)]
            pool = [ring_kv, kv[rows]]
            n_win = P - lo + S
            n_ent = end // r if r else 0
            if n_ent:
                ent_rows = cache.entry_rows(s.block_table, r, n_ent)
                pool.append(src.decode("latent", src.comp[ent_rows], self.kdev))
                if self.is_index_source:
                    keys = src.decode("index", src.index_keys[ent_rows], self.kdev)
                    sel = self._select(i, rows, pos[rows], keys, q_idx, w_idx, shared, "indexer_scores_bf16")
                    shared[self.layer][i] = sel
                else:
                    sel = shared[self.idx_src][i]
                parts.append(torch.where(sel >= 0, sel + n_win, -1))
            idx = torch.cat(parts, dim=1)
            if fast:  # this sequence's pool rows start at `base` in the batch's flat pool
                pools += pool
                idxs.append(torch.where(idx >= 0, idx + base, -1))
                base += n_win + n_ent
            else:
                outs.append(k("sparse_attn_sink_official_v41")(q[rows], torch.cat(pool), self.p["attn_sink"], idx,
                                                               self.hd**-0.5))
        if fast:
            width = max(t.shape[1] for t in idxs)
            idx = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in idxs])
            o = k("sparse_attn_sink_official_v41")(q, torch.cat(pools), self.p["attn_sink"], idx, self.hd**-0.5)
        else:
            o = torch.cat(outs)
        return self.attention_post(o, pos, table)
