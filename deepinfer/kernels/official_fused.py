"""Torch twins of the fused official-numerics ops that have no single torch op: registered for every device
(the CPU fallback) and the references the Triton versions in `kernels/triton/norm_hc.py` are tested against.

Owns: `hc_pre_fused` (hc mixes, Sinkhorn split, collapse, bf16 round, RMSNorm, bf16 round: exactly the
steps `V4Block._hc_official` runs before a sublayer), `hc_head_fused` (the model head's collapse and final
norm, exactly `V4EngineModel.logits`' steps before the head GEMM), `hc_post_fused` (hc_post rounded once to bf16),
`hc_post_pre_fused` (one sublayer's hc_post_fused, then the next one's hc_pre_fused), and
`kv_encode` / `kv_decode` (a `cache/layouts.py` KVLayout's own store/load, as ops a device can replace),
`moe_gate_sqrtsoftplus` (the V4 gate after its logits GEMM: sqrt-softplus, bias-only selection, top-k,
renormalise, scale: exactly `V4MoE.route`'s ops) and `moe_gate_hash_sqrtsoftplus` (the hash layers' gate:
the experts from the token-id table, their sqrt-softplus scores renormalised and scaled), `moe_route` (the
gate's logits GEMM and then either gate: the MoE layers' routing as one op, which CUDA runs in one launch
at decode), `fp4_fake_quant` (`formats.fp4_fake_quant` as a registry op),
`compress_decode_step` (one decode token per row through a compressor: state scatter, block pooling, overlap
shift, bf16 round, RMSNorm, bf16 round: exactly the torch ops the decode step's compressors ran before it),
`compress_decode_store` (that step, the entries' RoPE and their packed store: the KV compressor's whole decode),
`sparse_attn_sink_paged` (the official sparse attention over rows read straight from the stored window ring
and compressed cache: gather, the layout's decode, `official.sparse_attn_sink_official`),
`qkv_norm_rope_store` (after the attention's stacked wq_a | wkv projection at decode: the q LoRA's RMSNorm, and
the KV's RMSNorm, RoPE and packed store into the window ring), `head_rms_norm_rope` (the per-head q norm,
then RoPE), `sparse_attn_sink_paged_rope` (that attention, then the inverse RoPE of its output; optionally the
per-head q norm first), `sparse_attn_sink_qnorm` (the prefill's: the per-head q norm, then the pool attention),
`indexer_q_rotate` (the indexer query's RoPE, Hadamard and FP4 fake quantisation) and `index_key_rotate_store`
(a new index key's RoPE, Hadamard and packed store): exactly the ops the attention paths ran one by one.
Must not: hold state or import the model or the reference oracle; change a rounding point of the
unfused sequence (the engine may call either and must get the same bits on CPU).
"""
from __future__ import annotations

import torch

from deepinfer import formats
from deepinfer.kernels import official, torch_ops

__all__ = ["hc_pre_fused", "hc_pre_deferred_fused", "hc_head_fused", "hc_post_fused", "kv_encode", "kv_encode_into", "kv_decode", "kv_decode_rows",
           "moe_gate_sqrtsoftplus",
           "moe_gate_hash_sqrtsoftplus", "moe_route", "fp4_fake_quant",
           "compress_decode_step", "compress_decode_store", "sparse_attn_sink_paged", "qkv_norm_rope_store", "head_rms_norm_rope",
           "sparse_attn_sink_paged_rope", "sparse_attn_sink_paged_mixed", "sparse_attn_sink_qnorm", "indexer_q_rotate",
           "index_key_rotate_store",
           "hc_post_pre_fused"]

F32, BF16 = torch.float32, torch.bfloat16


def hc_pre_fused(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 norm_weight: torch.Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, D] bf16 residual streams -> y [T, D] bf16 (collapsed, normed sublayer input),
    post [T, hc] fp32, comb [T, hc, hc] fp32 (Sinkhorn-normalised; hc_post contracts its first index)."""
    if x.dim() != 3 or x.shape[1] != hc:
        raise ValueError(f"hc_pre_fused: x must be [T, hc={hc}, D], got {tuple(x.shape)}")
    y, _, post, comb = _hc_pre(x, None, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps)
    return y, post, comb


def hc_pre_deferred_fused(x: torch.Tensor, pre_mix: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                          base: torch.Tensor, norm_weight: torch.Tensor, hc: int, iters: int, hc_eps: float,
                          norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """V4.1's deferred hc_pre (spec §10.2): x [T, hc, D] bf16, pre_mix [T, hc] fp32 (the PREVIOUS sublayer's
    pre) -> y [T, D] bf16 = bf16(RMSNorm(bf16(sum_j pre_mix_j x_j))) and this sublayer's mixes of x: pre [T, hc]
    (the next sublayer's pre_mix), post [T, hc], comb [T, hc, hc] fp32. `hc_pre_fused`'s steps, collapsing with
    the given pre instead of the one it computes."""
    if x.dim() != 3 or x.shape[1] != hc or tuple(pre_mix.shape) != (x.shape[0], hc):
        raise ValueError(f"hc_pre_deferred_fused: x must be [T, hc={hc}, D] and pre_mix [T, hc]; got "
                         f"{tuple(x.shape)}, {tuple(pre_mix.shape)}")
    return _hc_pre(x, pre_mix, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps)


def _hc_pre(x, pre_mix, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps):
    """Both hc_pre twins' steps -> (y, pre, post, comb): fp32 mixes, the Sinkhorn split, the collapse with
    pre_mix (V4.1's deferred pre) or, None, with the pre just computed, bf16, RMSNorm, bf16."""
    xf = x.to(F32)
    pre, post, comb = torch_ops.hc_split_sinkhorn(torch_ops.hc_mix(xf, fn, norm_eps), scale, base, hc, iters, hc_eps)
    y = torch_ops.hc_collapse(xf, pre if pre_mix is None else pre_mix).to(BF16).to(F32)
    return torch_ops.rms_norm(y, norm_weight, norm_eps).to(BF16), pre, post, comb


def hc_head_fused(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                  norm_weight: torch.Tensor, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The model head's collapse in official rounding: x [N, hc, D] -> bf16 [N, D]: fp32 r-normalised mixes
    (fn [hc, hc*D]), pre = sigmoid(mix * scale + base) + hc_eps, collapse, bf16 round, RMSNorm, bf16 round."""
    xf = x.to(F32)
    pre = torch.sigmoid(torch_ops.hc_mix(xf, fn, norm_eps) * scale + base) + hc_eps
    y = torch_ops.hc_collapse(xf, pre).to(BF16).to(F32)
    return torch_ops.rms_norm(y, norm_weight, norm_eps).to(BF16)


def hc_post_fused(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """bf16(post_k * F + sum_j comb[j, k] * R_j) with fp32 arithmetic: f [T, D], residual [T, hc, D]."""
    return torch_ops.hc_post(f.to(F32), residual.to(F32), post, comb).to(BF16)


def kv_encode(layout, x: torch.Tensor) -> torch.Tensor:
    """`layout.store(x)`: values [..., dim] -> the layout's packed bytes (the layout object is passed in, so
    kernels never import cache)."""
    return layout.store(x)


def kv_encode_into(layout, x: torch.Tensor, store: torch.Tensor, rows: torch.Tensor,
                   keep: torch.Tensor | None = None) -> None:
    """Encode x [T, dim] and write row t's bytes into store [n_rows, bytes_per_token] at row rows[t], only
    where keep[t] (bool [T]; None: every row): `store[rows] = where(keep, layout.store(x), store[rows])`.
    The cache writes of the batched decode step (window ring, compressed entries) as one op a device can fuse
    (on cuda the encode kernel stores straight into the cache: no encoded copy, gather or scatter)."""
    _check_encode_into(layout, x, store, rows, keep)
    enc = layout.store(x)
    store[rows] = enc if keep is None else torch.where(keep.unsqueeze(1), enc, store[rows])


def _check_encode_into(layout, x, store, rows, keep) -> None:
    if x.dim() != 2 or x.shape[1] != layout.dim:
        raise ValueError(f"kv_encode_into: {layout.name} takes x [T, {layout.dim}], got {tuple(x.shape)}")
    _check_store_rows(layout, x.shape[0], store, rows, keep)


def _check_store_rows(layout, t: int, store, rows, keep) -> None:
    """kv_encode_into's checks of the cache and the rows t values go to (the fused ops that store without an x)."""
    if store.dtype != torch.uint8 or store.dim() != 2 or store.shape[1] != layout.bytes_per_token:
        raise ValueError(f"kv_encode_into: store must be uint8 [rows, {layout.bytes_per_token}], got "
                         f"{store.dtype} {tuple(store.shape)}")
    if rows.shape != (t,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_encode_into: rows must be int [{t}], got {rows.dtype} {tuple(rows.shape)}")
    if keep is not None and (keep.shape != (t,) or keep.dtype != torch.bool):
        raise ValueError(f"kv_encode_into: keep must be bool [{t}], got {keep.dtype} {tuple(keep.shape)}")


def kv_decode(layout, packed: torch.Tensor) -> torch.Tensor:
    """`layout.load(packed)`: packed bytes -> the bf16 values the oracle holds in its cache."""
    return layout.load(packed)


def kv_decode_rows(layout, store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The values of the stored rows `rows` (int64, any shape; a negative index reads row 0, for the caller to
    mask) of a packed store [N, bytes] -> [*rows.shape, dim]: `layout.load(store[rows.clamp(min=0)])`."""
    if store.dim() != 2 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_decode_rows: want store [N, bytes] and integer rows, got {tuple(store.shape)}, "
                         f"{rows.dtype}")
    return layout.load(store[rows.clamp(min=0)])


def moe_gate_sqrtsoftplus(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float,
                          norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, topk] fp32, indices [T, topk] int64): scores sqrt(softplus(logits)),
    the experts of the top-k biased scores (descending), their UNbiased scores renormalised to sum 1 (w / (sum
    + norm_eps): 0 for V4, 1e-20 for V4.1, spec §10.4), times route_scale (spec §3.9; the bias only selects)."""
    if logits.dim() != 2 or bias.shape != logits.shape[-1:] or not 0 < topk <= logits.shape[-1]:
        raise ValueError(f"moe_gate: logits [T, E], bias [E], 0 < topk <= E; got {tuple(logits.shape)}, "
                         f"{tuple(bias.shape)}, topk {topk}")
    scores = torch.nn.functional.softplus(logits).sqrt()
    indices = (scores + bias).topk(topk, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + norm_eps)  # (+ 0.0 leaves V4's sum as it is)
    return weights * route_scale, indices


def check_moe_gate_hash(logits: torch.Tensor, tid2eid: torch.Tensor, ids: torch.Tensor) -> None:
    """The argument contract of `moe_gate_hash_sqrtsoftplus` (shared with its Triton twin): ValueError naming
    what does not fit."""
    if logits.dim() != 2 or tid2eid.dim() != 2 or ids.dim() != 1 or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"moe_gate_hash: logits [T, E], tid2eid [vocab, k], ids [T]; got {tuple(logits.shape)}, "
                         f"{tuple(tid2eid.shape)}, {tuple(ids.shape)}")
    if tid2eid.dtype.is_floating_point or ids.dtype.is_floating_point:
        raise ValueError(f"moe_gate_hash: integer tid2eid and ids expected, got {tid2eid.dtype}, {ids.dtype}")


def moe_gate_hash_sqrtsoftplus(logits: torch.Tensor, tid2eid: torch.Tensor, ids: torch.Tensor,
                               route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A hash layer's gate: logits [T, E] fp32, tid2eid [vocab, k] (integer expert ids per token id), ids [T]
    -> (weights [T, k] fp32, indices [T, k] int64): the experts the token id's row names, in its order, their
    sqrt(softplus) scores renormalised to sum 1, times route_scale (spec §3.9; no bias, no top-k)."""
    check_moe_gate_hash(logits, tid2eid, ids)
    scores = torch.nn.functional.softplus(logits).sqrt()
    indices = tid2eid[ids].long()
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, indices


def check_moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int,
                    tid2eid: torch.Tensor | None, ids: torch.Tensor | None) -> None:
    """The argument contract of op "moe_route" (shared with its CUDA version): ValueError naming what does
    not fit. (No allocation: the CUDA op runs it at every MoE layer of an eager step.)"""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"moe_route: x [T, D], weight [E, D]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype != BF16 or weight.dtype not in (BF16, F32):
        raise ValueError(f"moe_route: bf16 x and a bf16 or fp32 weight expected, got {x.dtype}, {weight.dtype}")
    n_experts = weight.shape[0]
    if not 0 < topk <= n_experts:
        raise ValueError(f"moe_route: 0 < topk <= E = {n_experts}, got {topk}")
    if tid2eid is None:
        if bias is None or tuple(bias.shape) != (n_experts,):
            raise ValueError(f"moe_route: bias [{n_experts}] expected, got "
                             f"{None if bias is None else tuple(bias.shape)}")
        return
    if (ids is None or tid2eid.dim() != 2 or tid2eid.shape[1] != topk or ids.dim() != 1
            or ids.shape[0] != x.shape[0]):
        raise ValueError(f"moe_route: a hash gate needs tid2eid [vocab, {topk}] and ids [{x.shape[0]}]; got "
                         f"{tuple(tid2eid.shape)}, {None if ids is None else tuple(ids.shape)}")
    if tid2eid.dtype.is_floating_point or ids.dtype.is_floating_point:
        raise ValueError(f"moe_route: integer tid2eid and ids expected, got {tid2eid.dtype}, {ids.dtype}")


def route_steps(linear_f32, gate, hash_gate, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                topk: int, route_scale: float, norm_eps: float, gate_temp: float, tid2eid: torch.Tensor | None,
                ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layers' routing as its separate ops, given their implementations (the twins here; the CUDA
    op's unfused path passes its kernels): the fp32 logits, / gate_temp when it is not 1 (V4.1), then the
    biased top-k gate or, given tid2eid and ids, the hash gate."""
    logits = linear_f32(x, weight)
    if gate_temp != 1.0:
        logits = logits / gate_temp
    if tid2eid is not None:
        return hash_gate(logits, tid2eid, ids, route_scale)
    return gate(logits, bias, topk, route_scale, norm_eps)


def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float,
              norm_eps: float = 0.0, gate_temp: float = 1.0, act_block: int = 128,
              tid2eid: torch.Tensor | None = None, ids: torch.Tensor | None = None):
    """A MoE layer's routing: x [T, D] bf16, the gate's weight [E, D] -> (weights [T, k] fp32, indices [T, k]
    int64, None). `route_steps` on the twins: the official fp32 logits (`bf16_gemm.linear_f32_torch`),
    divided by gate_temp when it is not 1 (V4.1), then `moe_gate_sqrtsoftplus` (bias, norm_eps) or, given
    tid2eid and ids, the hash layer's `moe_gate_hash_sqrtsoftplus`: exactly the ops the MoE layers ran one by
    one. The third item is the CUDA op's `quant_weights.PreRouted` (the experts' slot blocks and
    act_quant(x, act_block), made in the same launch); None here: `fp4_moe` routes itself when it gets none."""
    from deepinfer.kernels.bf16_gemm import linear_f32_torch  # (bf16_gemm loads after this module)

    check_moe_route(x, weight, bias, topk, tid2eid, ids)
    w, idx = route_steps(linear_f32_torch, moe_gate_sqrtsoftplus, moe_gate_hash_sqrtsoftplus, x, weight, bias,
                         topk, route_scale, norm_eps, gate_temp, tid2eid, ids)
    return w, idx, None


def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 values with E8M0 pow2 scales per `block` values, dequantised, in x's dtype (the indexer's q)."""
    return formats.fp4_fake_quant(x, block)


def compress_decode_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state_kv: torch.Tensor,
                         state_score: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                         complete: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         overlap: bool) -> torch.Tensor:
    """One decode token per row through one compressor (the batched decode path; state updated in place).

    kv, gate [B, c*w]: the token's two fp32 projections (gate WITHOUT ape); ape [r, c*w]; state_kv /
    state_score [S, c*r, c*w] (c = 2 with overlap: rows [0, r) hold the previous complete block);
    slots, positions [B] int64; complete [B] bool (this token completes block p // r, i.e. (p + 1) % r == 0).
    Writes row (p % r) + (r if overlap) of each row's slot (score = gate + ape[p % r]); pools the slot's
    current block (overlap: the previous block's A-half and this block's B-half, one softmax over 2r rows);
    where complete and overlap, moves the block's rows into rows [0, r). Returns [B, w] bf16: bf16(RMSNorm(
    bf16(pooled))) where complete, 0 elsewhere (rows that complete nothing store no entry).
    Rows may share a slot only when their writes are interchangeable (batch padding in a scratch slot)."""
    c = 2 if overlap else 1
    r = state_kv.shape[1] // c
    if (kv.dim() != 2 or gate.shape != kv.shape or state_kv.shape != state_score.shape or state_kv.dim() != 3
            or state_kv.shape[1] != c * r or state_kv.shape[2] != kv.shape[1] or tuple(ape.shape) != (r, kv.shape[1])
            or kv.shape[1] % c or tuple(norm_weight.shape) != (kv.shape[1] // c,)):
        raise ValueError(f"compress_decode_step: want kv, gate [B, c*w], ape [r, c*w], states [S, c*r, c*w], "
                         f"norm_weight [w] (c={c}); got kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, ape "
                         f"{tuple(ape.shape)}, states {tuple(state_kv.shape)} / {tuple(state_score.shape)}, "
                         f"norm_weight {tuple(norm_weight.shape)}")
    off = r if overlap else 0  # overlap: rows [0, r) hold the previous complete block
    phase = positions % r  # the token's row in its block
    row = phase + off
    score = gate + ape[phase]
    state_kv[slots, row] = kv
    state_score[slots, row] = score
    kv_s, sc_s = state_kv[slots], state_score[slots]  # [B, c*r, c*w] (copies)
    if overlap:  # previous block's A-half and the current block's B-half: one softmax over 2r rows
        w = kv_s.shape[-1] // 2
        kv_p = torch.cat([kv_s[:, :r, :w], kv_s[:, r:, w:]], dim=1)
        sc_p = torch.cat([sc_s[:, :r, :w], sc_s[:, r:, w:]], dim=1)
        done = complete.view(-1, 1, 1)
        state_kv[slots, :r] = torch.where(done, kv_s[:, r:], kv_s[:, :r])
        state_score[slots, :r] = torch.where(done, sc_s[:, r:], sc_s[:, :r])
    else:
        kv_p, sc_p = kv_s, sc_s
    pooled = torch_ops.compress_pool(kv_p, sc_p, False).to(BF16).to(F32)  # [B, w]
    entries = torch_ops.rms_norm(pooled, norm_weight, eps).to(BF16)
    return torch.where(complete.unsqueeze(1), entries, 0)


def compress_decode_store(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state_kv: torch.Tensor,
                          state_score: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                          complete: torch.Tensor, norm_weight: torch.Tensor, eps: float, overlap: bool,
                          block_pos: torch.Tensor, freqs: torch.Tensor, table: torch.Tensor | None, layout,
                          store: torch.Tensor, rows: torch.Tensor) -> None:
    """The attention's KV compressor at decode, through to its cache: `compress_decode_step`, the RoPE of each
    entry's last 2 * len(freqs) channels at its block's first position `block_pos` (`table`: this device's
    `rope_table32` of them, or None), and the entry's layout bytes into store[rows] where `complete`
    (`kv_encode_into`): exactly the three ops the decode step ran."""
    entries = compress_decode_step(kv, gate, ape, state_kv, state_score, slots, positions, complete, norm_weight,
                                   eps, overlap)
    kv_encode_into(layout, official.rope32(entries, block_pos, freqs, table=table), store, rows, complete)


def paged_rows(ring: torch.Tensor, comp: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """The stored rows `idx` [T, K] names (-1 reads row 0; the attention masks it): row r < ring rows is
    ring row r (the ring [slots, window, w] flattened), row r >= that is compressed row r - ring rows."""
    flat = ring.flatten(0, -2)
    n_ring = flat.shape[0]
    rows = idx.clamp(min=0).long()
    if comp is None or comp.shape[0] == 0:  # a window-only layer: (index values are not checked: no sync)
        return flat[rows]
    if comp.shape[1:] != flat.shape[1:] or comp.dtype != flat.dtype:
        raise ValueError(f"sparse_attn_sink_paged: ring rows {tuple(flat.shape[1:])} {flat.dtype} and compressed "
                         f"rows {tuple(comp.shape[1:])} {comp.dtype} differ")
    in_ring = (rows < n_ring).unsqueeze(-1)
    return torch.where(in_ring, flat[rows.clamp(max=n_ring - 1)], comp[(rows - n_ring).clamp(min=0)])


def sparse_attn_sink_paged(q: torch.Tensor, ring: torch.Tensor, comp: torch.Tensor | None, layout,
                           sink: torch.Tensor, idx: torch.Tensor, scale: float,
                           initial_max: float = float("-inf")) -> torch.Tensor:
    """`official.sparse_attn_sink_official` over stored cache rows: q [T, H, d] bf16; ring [slots, window, w]
    and comp [rows, w] hold `layout`'s packed bytes (or bf16 values when layout is None); idx [T, K] names
    rows of the two (`paged_rows`), -1 = skip. The same rows in the same index order as attending over a
    decoded pool, so the same bits."""
    if idx.dim() != 2 or q.dim() != 3 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_attn_sink_paged: want q [T, H, d] and idx [T, K], got {tuple(q.shape)}, "
                         f"{tuple(idx.shape)}")
    stored = paged_rows(ring, comp, idx)  # [T, K, w]
    kv = stored if layout is None else layout.load(stored)
    T, K = idx.shape
    pool_idx = torch.arange(T * K, device=idx.device).view(T, K)
    return official.sparse_attn_sink_official(q, kv.reshape(T * K, -1), sink, torch.where(idx >= 0, pool_idx, -1),
                                              scale, initial_max)


def sparse_attn_sink_paged_mixed(q: torch.Tensor, ring: torch.Tensor, ring_layout, comp: torch.Tensor | None,
                                 comp_layout, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                                 ring_cols: int, initial_max: float = float("-inf")) -> torch.Tensor:
    """`sparse_attn_sink_paged` where the ring and the compressed rows have DIFFERENT layouts (V4.1: the FP8
    window ring, the FP4 latents): idx [T, K]'s first `ring_cols` columns name ring rows (of ring [slots,
    window, bytes] flattened) or -1, the rest compressed rows counted after the ring's rows or -1. Each part
    decoded with its own layout into one pool, attended in idx's order: the same bits as attending the
    decoded rows."""
    if idx.dim() != 2 or q.dim() != 3 or idx.shape[0] != q.shape[0] or not 0 <= ring_cols <= idx.shape[1]:
        raise ValueError(f"sparse_attn_sink_paged_mixed: want q [T, H, d], idx [T, K] and 0 <= ring_cols <= K; got "
                         f"{tuple(q.shape)}, {tuple(idx.shape)}, ring_cols {ring_cols}")
    if comp is None and ring_cols != idx.shape[1]:
        raise ValueError("sparse_attn_sink_paged_mixed: index columns past ring_cols need compressed rows")
    flat = ring.flatten(0, -2)
    parts = [kv_decode_rows(ring_layout, flat, idx[:, :ring_cols])]
    if ring_cols < idx.shape[1]:
        comp_idx = idx[:, ring_cols:]
        parts.append(kv_decode_rows(comp_layout, comp, torch.where(comp_idx >= 0, comp_idx - flat.shape[0], -1)))
    pool = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [T, K, d]
    T, K = idx.shape
    cols = torch.arange(T * K, device=idx.device).view(T, K)
    return official.sparse_attn_sink_official(q, pool.flatten(0, 1), sink, torch.where(idx >= 0, cols, -1), scale,
                                              initial_max)


def qkv_norm_rope_store(q_lora: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
                        eps: float, positions: torch.Tensor, freqs: torch.Tensor, table: torch.Tensor | None,
                        layout, store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The decode attention's steps between its stacked wq_a | wkv projection and the fork of its branches:
    q_lora [B, q_lora_rank] bf16 -> qr = `official.rms_norm_bf16(q_lora, q_weight)` (returned), and kv [B, d]
    bf16 -> RMSNorm (kv_weight), RoPE of its last 2 * len(freqs) channels at `positions` (`table`: this
    device's `rope_table32` of them, or None), its layout bytes into store[rows] (the window ring). The same
    ops and rounding points as running them one by one."""
    qr = official.rms_norm_bf16(q_lora, q_weight, eps)
    kvn = official.rope32(official.rms_norm_bf16(kv, kv_weight, eps), positions, freqs, table=table, inplace=True)
    kv_encode_into(layout, kvn, store, rows)
    return qr


def head_rms_norm_rope(q: torch.Tensor, eps: float, positions: torch.Tensor, freqs: torch.Tensor,
                       table: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, heads, d] bf16 -> the parameter-free per-head RMSNorm (`torch_ops.head_rms_norm`, the official
    bf16 torch ops), then RoPE of each head's last 2 * len(freqs) channels at `positions`: a new tensor
    (out: written into that [B, heads, d] tensor of q's dtype instead, e.g. a CUDA graph's buffer)."""
    y = official.rope32(torch_ops.head_rms_norm(q, eps), positions, freqs, table=table, inplace=True)
    return y if out is None else official.write_into(out, y, "head_rms_norm_rope")


def sparse_attn_sink_paged_rope(q: torch.Tensor, ring: torch.Tensor, comp: torch.Tensor | None, layout,
                                sink: torch.Tensor, idx: torch.Tensor, scale: float, positions: torch.Tensor,
                                freqs: torch.Tensor, table: torch.Tensor | None,
                                q_norm_eps: float | None = None) -> torch.Tensor:
    """`sparse_attn_sink_paged`, then the inverse RoPE of each head's last 2 * len(freqs) output channels at
    `positions` (`table`: this device's `rope_table32` of them, or None): the decode attention's output.
    q_norm_eps: q is the raw query projection, `head_rms_norm_rope` at `positions` first."""
    if q_norm_eps is not None:
        q = head_rms_norm_rope(q, q_norm_eps, positions, freqs, table)
    o = sparse_attn_sink_paged(q, ring, comp, layout, sink, idx, scale)
    return official.rope32(o, positions, freqs, True, table=table, inplace=True)


def sparse_attn_sink_qnorm(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                           eps: float, positions: torch.Tensor, freqs: torch.Tensor, table: torch.Tensor | None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """V4's prefill / extend attention over the raw query projection q [T, H, d]: `head_rms_norm_rope` at
    `positions`, then the official sparse attention over the pool kv (`official.sparse_attn_sink_official`, running
    max from -inf; out as there)."""
    qn = head_rms_norm_rope(q, eps, positions, freqs, table)
    return official.sparse_attn_sink_official(qn, kv, sink, idx, scale, out=out)


def indexer_q_rotate(q: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                     table: torch.Tensor | None) -> torch.Tensor:
    """The indexer query q [T, heads, d] bf16: RoPE of each head's last 2 * len(freqs) channels at
    `positions` (`table`: this device's `rope_table32` of them, or None), the Hadamard transform, the FP4
    fake quantisation per 32 values: a new tensor."""
    return fp4_fake_quant(official.hadamard32(official.rope32(q, positions, freqs, table=table)), 32)


def index_key_rotate_store(entries: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                           table: torch.Tensor | None, layout, store: torch.Tensor, rows: torch.Tensor,
                           keep: torch.Tensor | None = None) -> None:
    """New index keys entries [B, d] bf16: RoPE at `positions` (their blocks' first positions), the Hadamard
    transform, and their layout bytes into store[rows] where keep (`kv_encode_into`)."""
    rotated = official.hadamard32(official.rope32(entries, positions, freqs, table=table))
    kv_encode_into(layout, rotated, store, rows, keep)


def hc_post_pre_fused(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor, hc: int,
                      iters: int, hc_eps: float,
                      norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's `hc_post_fused` (-> x, the new residual streams) followed by the next sublayer's
    `hc_pre_fused` on x: (x, y, post, comb)."""
    x = hc_post_fused(f, residual, post, comb)
    return (x,) + hc_pre_fused(x, fn, scale, base, norm_weight, hc, iters, hc_eps, norm_eps)
