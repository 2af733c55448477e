"""Pure-decode steps of a fast-numerics `V41EngineModel` (V4.1-Flash) in fixed-shape device ops: every sequence
adds one token, the whole batch at once (no per-sequence Python loop inside a layer, no shape that depends on
positions), so `decode_step.DecodeRunner` runs it eagerly or replays it from CUDA graphs per bucket, as V4's.

Owns: `decode_logits(model, ids, meta, engram)` (embedding, Engram, every block with `decode_attention`, the
final collapse and the head), `decode_attention` (one layer) and `EngramInputs` (a bucket's static buffers of
the Engram table rows a step reads, filled on the host before the step: the tables stay on the host, see
model/engram.py).
Same math and rounding points as `V41Attention._forward_official` with fast=True (the varlen path, this
path's reference: on the CPU twins the logits are bit-identical where the index rows have the same width,
tests/test_engine_fast_v41_decode.py); the differences are in layout only:
* the new token's window KV is written into the ring FIRST, then the window is read from the ring in the
  official decode order (ring slots oldest first, -1 for positions before 0: the varlen path's order at P > 0);
* kv-source layers advance their compressor with `compress_decode_step` (V4's decode kernel, no overlap, a
  zero `ape`: V4.1 has none, and gate + 0 is gate) and store the entry only where this token completes one
  (ratio 1: every token); the index keys come from the pre-RoPE latent, as official;
* index sources score every entry of their kv source straight from its packed key cache over
  `max_context // r` padded columns (`indexer_scores_paged_bf16`; V4.1's index keys have V4's FP4 layout),
  apply the candidate-block filter of the candidate source (published in the step's dict), take the stable
  top-k (k = min(index_topk, padded width): the picks past a row's visible entries sort last and become -1,
  the varlen path's own -1 padding) and publish the index rows (window, then picks: `decode_select_rows`);
  consumer layers reuse them;
* the attention reads the window rows from the ring and the picks from the kv source's latents where they
  are stored (`sparse_attn_sink_paged_mixed`: on cuda one kernel decodes both layouts in registers).
Must not: import the oracle; read device values on the host; allocate per-sequence state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepinfer import kernels
from deepinfer.model.compressor import project
from deepinfer.model.context import SeqContext
from deepinfer.model.decode_metadata import DecodeMetadata, DecodeRows, RatioRows
from deepinfer.model.out_lora import out_lora
from deepinfer.model.stacked import pair
from deepinfer.model.step_memo import rope_table, step_memo
from deepinfer.model.v41_attention import V41Attention, _rms_bf16, select_candidate_blocks
from deepinfer.model.v41_cache import V41Cache, V41LayerCache

F32, BF16 = torch.float32, torch.bfloat16


def ring_order_rows(rows: DecodeRows, window: int) -> torch.Tensor:
    """[B, window] flat ring rows in the official decode order: slots (p % window) + 1 .. window - 1, 0 ..
    p % window (oldest position first), -1 where the slot's position p - ((p - slot) mod window) is < 0.
    Once per step (every layer's ring has the same shape)."""
    def build() -> torch.Tensor:
        p = rows.positions.unsqueeze(1)
        slot = (p % window + 1 + torch.arange(window, device=p.device)) % window
        wpos = p - (p - slot) % window
        return torch.where(wpos >= 0, rows.window_slots.unsqueeze(1) * window + slot, -1)

    return step_memo(rows, ("v41 ring order", window), build)


def _k(attn: V41Attention, name: str):
    return kernels.get(name, attn.kdev)


def _compress(attn: V41Attention, lc: V41LayerCache, x: torch.Tensor, rows: DecodeRows, rr: RatioRows) -> torch.Tensor:
    """The kv source's compressor advanced by one token per row -> normalised latents BEFORE RoPE [B, hd] bf16,
    valid where rr.complete (ratio 1: every row; ratio 2: 0 elsewhere)."""
    p, eps = attn.comp_p, attn.eps
    if attn.ratio == 1:  # the per-token latent: bf16 linear, fp32 norm -> bf16
        return _rms_bf16(_k(attn, "blinear")(x, p["wkv.weight"]), p["norm.weight"], eps, attn.kdev)
    kv, gate = project(_k(attn, "linear_f32"), x, p)  # fp32 [B, hd] each (one stacked GEMM when stacked)
    r, w = attn.ratio, kv.shape[1]
    ape = step_memo(rows, ("v41 zero ape", r, w), lambda: torch.zeros(r, w, dtype=F32, device=x.device))
    return _k(attn, "compress_decode_step")(kv, gate, ape, lc.state_kv, lc.state_score, rows.state_slots,
                                            rows.positions, rr.complete, p["norm.weight"], eps, False)


def _store_entries(attn: V41Attention, lc: V41LayerCache, lat: torch.Tensor, rows: DecodeRows,
                   rr: RatioRows) -> None:
    """The index key (from the pre-RoPE latent) and the latent, each rotated to its group's first position,
    into the source's caches at the entry's row, only where this token completes the entry."""
    table = rope_table(attn, rows, rr.block_pos, of=("blocks", attn.ratio))
    rope32, into = _k(attn, "rope32"), _k(attn, "kv_encode_into")
    keys = attn.index_keys_of(lat)
    into(lc.layouts["index"], rope32(keys, rr.block_pos, attn.inv_freq, table=table, inplace=True), lc.index_keys,
         rr.new_row, rr.complete)
    # (the keys are made: the latent may rotate in place; it is this step's fresh compressor output)
    into(lc.layouts["latent"], rope32(lat, rr.block_pos, attn.inv_freq, table=table, inplace=True), lc.comp,
         rr.new_row, rr.complete)


def _select(attn: V41Attention, lc: V41LayerCache, src: V41LayerCache, x: torch.Tensor, qr: torch.Tensor,
            rows: DecodeRows, rr: RatioRows, table: torch.Tensor, step: dict) -> torch.Tensor:
    """An index source's top-k (`V41Attention._select` of every row at once) -> the attention's index rows
    [B, window + K]: the window's ring rows in the official order, then the picks in position order as rows of
    the kv source's compressed cache counted after the ring's (-1 past the row's visible entries). Every
    layer's ring has lc's shape, so the group's consumers attend with the same rows."""
    cfg, B = attn.cfg, x.shape[0]
    ihd, nh = cfg.index_head_dim, cfg.index_n_heads
    q_idx = _k(attn, "fp8_linear")(qr, attn.idx_p["wq_b.weight"]).view(B, nh, ihd)
    q_idx = _k(attn, "rope32")(q_idx, rows.positions, attn.inv_freq, table=table, inplace=True)
    q_idx = _k(attn, "fp4_fake_quant")(q_idx, 32)  # no Hadamard in V4.1
    w_idx = _k(attn, "blinear_scaled")(x, attn.idx_p["weights_proj.weight"], ihd**-0.5 * nh**-0.5)
    scores = _k(attn, "indexer_scores_paged_bf16")(q_idx, w_idx, src.index_keys, rr.entry_rows, rr.hidden,
                                                   src.layouts["index"])  # [B, E], -inf past the visible entries
    if attn.is_cand_source:
        step["candidates"] = select_candidate_blocks(scores, rr.visible, cfg.candidate_topk_blocks,
                                                     cfg.candidate_block_size, attn.kdev)
    elif attn.uses_cand:
        scores = scores.masked_fill(~step["candidates"], float("-inf"))
    top = _k(attn, "topk_positions")(scores, min(cfg.index_topk, scores.shape[1]))  # the stable top-k, ascending
    # V4's decode op for the rest (one kernel on cuda): the window rows, then the picks' cache rows after the ring's
    return _k(attn, "decode_select_rows")(ring_order_rows(rows, attn.win), top, rr.visible, rr.entry_rows,
                                          lc.ring.shape[0] * lc.ring.shape[1])


def _attend(attn: V41Attention, q: torch.Tensor, lc: V41LayerCache, src: V41LayerCache | None,
            idx: torch.Tensor) -> torch.Tensor:
    """Sparse attention with the sink over index rows `idx` [B, window (+ K)]: this layer's ring rows, then
    (src: the kv source of a compressed layer) rows of src's compressed cache counted after the ring's. On cuda
    one kernel decodes the FP8 ring rows and the FP4 latents in registers (the running max from -1e30: V4.1's
    kernel); the twin gathers and decodes each part into a pool first: the same bits unsplit."""
    comp, comp_layout = (None, None) if src is None else (src.comp, src.layouts["latent"])
    return _k(attn, "sparse_attn_sink_paged_mixed")(q, lc.ring, lc.layouts["window"], comp, comp_layout,
                                                    attn.p["attn_sink"], idx, attn.hd**-0.5, attn.win, -1e30)


def decode_attention(attn: V41Attention, x: torch.Tensor, rows: DecodeRows, cache: V41Cache,
                     step: dict) -> torch.Tensor:
    """x [B, D] bf16 (one token per row, normed) -> [B, D] bf16. `step`: the step's dict shared by its layers
    (index sources publish their index rows under their layer, the candidate source its mask)."""
    if not attn.fast:
        raise ValueError("the batched decode path runs fast numerics only")
    p, r, eps, B = attn.p, attn.ratio, attn.eps, x.shape[0]
    qlinear, rope32 = _k(attn, "fp8_linear"), _k(attn, "rope32")
    lc = cache.layers[attn.layer]
    pos = rows.positions
    table = rope_table(attn, rows, pos)
    q_lora, kv_lin = pair(qlinear, x, p, "wq_a_wkv.weight", "wq_a.weight", "wkv.weight")  # one GEMM, stacked
    qr = _rms_bf16(q_lora, p["q_norm.weight"], eps, attn.kdev)
    # rotations in place: each input is the fresh output of the op before it (only the rope channels move)
    q = rope32(qlinear(qr, p["wq_b.weight"]).view(B, attn.H, attn.hd), pos, attn.inv_freq, table=table, inplace=True)
    kv = rope32(_rms_bf16(kv_lin, p["kv_norm.weight"], eps, attn.kdev), pos, attn.inv_freq, table=table,
                inplace=True)
    _k(attn, "kv_encode_into")(lc.layouts["window"], kv, lc.ring.flatten(0, 1), rows.ring_row)  # FP8 per 32
    src, idx = None, ring_order_rows(rows, attn.win)  # (a window-only layer attends over its window alone)
    if r:
        rr, src = rows.ratios[r], cache.layers[attn.kv_src]
        if attn.is_kv_source:  # the entry this token completes is visible to it
            _store_entries(attn, lc, _compress(attn, lc, x, rows, rr), rows, rr)
        if attn.is_index_source:
            idx = step[attn.layer] = _select(attn, lc, src, x, qr, rows, rr, table, step)
        else:
            idx = step[attn.idx_src]
    o = _attend(attn, q, lc, src, idx)
    o = rope32(o, pos, attn.inv_freq, inverse=True, table=table, inplace=True)
    z = out_lora(lambda name: _k(attn, name), o.reshape(B, attn.G, -1), p["wo_a.weight"])
    return qlinear(z.flatten(1), p["wo_b.weight"])


class EngramInputs:
    """The Engram table rows of one batch bucket's steps, in static device buffers: per engram layer the
    stored values [batch, cols, hd] and scale bytes [batch, cols, hd / 32] of the rows each row's hashes name.
    `fill` hashes the step's tokens on the host (advancing the slots' n-gram histories), gathers the rows
    from the host tables and copies them in; padding rows read each column's first row (any valid row: their
    output is discarded) and advance no history."""

    def __init__(self, model, batch: int) -> None:
        self.model, self.batch = model, batch
        self.buffers = {}
        for i, layer in model.engrams.items():
            table, scale = layer.p["embed.weight"], layer.p["embed.scale"]
            cols = model.hasher.offsets.shape[1]
            self.buffers[i] = (torch.zeros(batch, cols, table.shape[1], dtype=table.dtype, device=model.device),
                               torch.zeros(batch, cols, scale.shape[1], dtype=scale.dtype, device=model.device))

    def fill(self, ids: torch.Tensor, seqs: Sequence[SeqContext]) -> None:
        """ids [n] (the step's tokens; device ids are read back: the hashes need them on the host)."""
        hasher, n = self.model.hasher, len(seqs)
        hashes = hasher.offsets.unsqueeze(0).repeat(self.batch, 1, 1)  # [batch, n layers, cols]
        if n:
            slots = torch.tensor([s.state_slot for s in seqs], dtype=torch.long)
            positions = torch.tensor([s.start_pos for s in seqs], dtype=torch.long)
            hashes[:n] = hasher.decode_hashes(ids.cpu(), slots, positions)
        for i, (w, s) in self.buffers.items():
            hw, hs = self.model.engrams[i].stored_rows(hashes[:, hasher.layer_index(i)])
            w.copy_(hw, non_blocking=True)
            s.copy_(hs, non_blocking=True)


def decode_hidden(model, ids: torch.Tensor, meta: DecodeMetadata,
                  engram: EngramInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B] on the model's device, meta (and engram) filled -> (final 4-stream residual [B, hc, D], the
    last block's pre mix [B, hc])."""
    rows = meta.derive()  # once per step, shared by every layer
    x, pre_mix = model.embed(ids)
    step: dict = {}
    for i, block in enumerate(model.layers):
        if i in model.engrams:
            layer = model.engrams[i]
            x = layer.update_official(x, layer.dequant(*engram.buffers[i]))
        x, pre_mix = block.official_block(
            x, pre_mix, lambda y, b=block: decode_attention(b.attn, y, rows, model.cache, step))
    return x, pre_mix


def decode_logits(model, ids: torch.Tensor, meta: DecodeMetadata, engram: EngramInputs | None) -> torch.Tensor:
    return model.logits(*decode_hidden(model, ids, meta, engram))  # [B, vocab] on the device
