"""Extend steps (prefills, prompt chunks, multi-token extends, the extend half of a mixed step) of a
fast-numerics `V41EngineModel` in piecewise CUDA graphs: V4's `extend_graphs.ExtendGraphs` (its buffers,
buckets, capture and binding) with V4.1's pieces.

Why: V4.1's eager prefill is bound by the host's launches as V4's was (a 512-token prefill of the tiny
checkpoint: 1,092 counted torch calls, ~100 a layer; V4's 1k slice prefill took 1.9x less time through its
graphs, BENCHMARKS.md). A replay issues a piece's launches for the cost of one.

Pieces of a step of T tokens in the bucket Tb >= T (rows T..Tb: token 0 at position 0, seen by graphed ops
only):
  piece 0      the embedding and its first pre mix, the Engram layer before layer 0 if any, layer 0's
               attention hc_pre (`V41Block.hc_pre`: mixes, Sinkhorn, collapse with the previous pre, norm)
               and `v41_extend.attention_pre` (q, the new window rows, the indexer's queries, the
               compressor's projections), and the step's RoPE tables;
  core l       (eager, rows :T only) `v41_extend.attention_core` of layer l: the compressor's state and
               entries, the ring, the index selection, the sparse attention, written into the o buffer;
  piece l + 1  `attention_post` of layer l, its mix-back, the FFN's hc_pre, the MoE, its mix-back, the
               Engram layer before layer l + 1 if any, layer l + 1's attention hc_pre and attention_pre
               (after the last layer: the final residual and pre mix).
Every graphed op is row-wise, so a replay computes what the same pieces compute eagerly at Tb (bit-identical,
tests/test_v41_extend_graphs.py -m gpu), within the fast path's numerics of `V41EngineModel.forward` at T.
The Engram rows a step reads are gathered on the host as on the eager path (`EngramLayer.rows`: the tables
stay there) and copied into a static buffer per Engram layer before the replay; the update itself is graphed.
Must not: run with a debug tap or several ranks; read host values of device tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext
from deepinfer.model.extend_graphs import BUCKETS, ExtendGraphs, _Carry
from deepinfer.model.v41_extend import V41Pre, attention_core, attention_pre, step_rows


class V41ExtendGraphs(ExtendGraphs):
    """`ExtendGraphs` over a fast `V41EngineModel` (see the module doc); cuda_graphs=False runs the same
    pieces eagerly on the same buffers (how the CPU tests check the padding and the split)."""

    def __init__(self, model, max_tokens: int, cuda_graphs: bool = True, buckets: Sequence[int] = BUCKETS) -> None:
        if not model.cfg.is_v41:
            raise ValueError("V41ExtendGraphs runs a V4.1 model (V4: extend_graphs.ExtendGraphs)")
        # the Engram rows of a step, per Engram layer [max_tokens, cols, head dim] (finite padding rows: zeros)
        self._emb: dict[int, torch.Tensor] = {}
        for layer, engram in model.engrams.items():
            cols = model.hasher.offsets.shape[-1]
            hd = engram.p["embed.weight"].shape[-1]
            self._emb[layer] = torch.zeros(max_tokens, cols, hd, dtype=torch.bfloat16, device=model.device)
        super().__init__(model, max_tokens, cuda_graphs, buckets)

    # ------------------------------------------------------------------ the pieces
    def _enter(self, layer: int, x: torch.Tensor, pre_mix: torch.Tensor, Tb: int, tables: dict) -> _Carry:
        """The Engram layer before `layer` (if any), its attention hc_pre and attention_pre."""
        model = self.model
        if layer in model.engrams:
            x = model.engrams[layer].update_official(x, self._emb[layer][:Tb])
        block = model.layers[layer]
        y, attn_mix, post, comb = block.hc_pre(x, pre_mix, "attn")
        a = block.attn
        pre = attention_pre(a, y, self._pos[:Tb], tables[a.rope_key], model.cache.layers[layer])
        return _Carry(x, post, comb, self._handoff(pre), mix=attn_mix)

    def _piece0(self, Tb: int, tables: dict) -> _Carry:
        model = self.model
        self._rope_tables(Tb, tables)
        x, pre_mix = model.embed(self._ids[:Tb])
        return self._enter(0, x, pre_mix, Tb, tables)

    def _piece(self, layer: int, Tb: int, tables: dict, c: _Carry) -> _Carry:
        model = self.model
        block = model.layers[layer]
        a = block.attn
        f = a.attention_post(self._o[:Tb], self._pos[:Tb], tables[a.rope_key])  # (rotates the o buffer in place)
        x = block.mix_back(f, c.residual, c.post, c.comb)
        y, ffn_mix, post, comb = block.hc_pre(x, c.mix, "ffn")
        x = block.mix_back(block.ffn(y), x, post, comb)
        if layer + 1 == len(model.layers):
            return _Carry(None, None, None, None, final=x, mix=ffn_mix)
        return self._enter(layer + 1, x, ffn_mix, Tb, tables)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, ctx: ForwardContext, graphs: bool | None = None) -> torch.Tensor:
        """ids [T] (host or device) of the batch `ctx` -> its logits rows (`V41EngineModel.forward`'s). A batch
        the pieces cannot take (`fits`) runs `model.forward`. graphs=False forces the eager pieces."""
        model = self.model
        if not self.fits(ctx):
            return model.forward(ids, ctx)
        ids, ctx, hashes = model.start_step(ids, ctx)
        T, Tb = self._load_step(ids, ctx)
        for layer, engram in model.engrams.items():  # gathered on the host, as the eager path does
            self._emb[layer][:T].copy_(engram.rows(model.engram_hashes(hashes, layer)))
        shared: dict = {}  # the forward's index rows and candidate mask, as `V41EngineModel.hidden`'s
        rows = step_rows(shared, ctx, model.cfg, model.cache)

        def core(layer: int, pre: V41Pre) -> None:
            attention_core(model.layers[layer].attn, pre.map(lambda _, t: t[:T]), ctx, model.cache, rows, shared,
                           out=self._o[:T])

        last = self._pieces_and_cores(Tb, core, graphs)
        sel = host_to_device(ctx.logit_rows(), model.device)
        return model.logits(last.final[:T][sel], last.mix[:T][sel])
