"""Extend steps (prefills, prompt chunks, multi-token extends, the extend half of a mixed step) of a
fast-numerics `V4EngineModel` in piecewise CUDA graphs: every op whose shapes depend on the token count
alone replayed from a graph captured per token bucket, the attention's cache work run eagerly between.

Why: an eager extend step is bound by the host's launches up to a few thousand tokens. The V4-Flash
slice's 1k-token prefill issued 409 launches whose host calls took 17-21 ms on the H200's host for 12.5 ms
of kernels (BENCHMARKS.md, sixteenth and eighteenth sessions); on the real model every layer adds ~100.
A graph replay issues a piece's launches for the cost of one. vLLM's piecewise graphs split at the
attention for the same reason.

A step of T tokens runs in the smallest bucket Tb >= T (default `BUCKETS`, up to `max_tokens`); rows
T..Tb are padding (token 0 at position 0) that only the graphed ops see:
  piece 0      embedding, layer 0's attention hc_pre, `attention_pre` (q, the new KV rows, the indexer's
               queries, the compressors' projections) and the step's RoPE tables;
  core l       (eager, rows :T only) `attention_core` of layer l: ring and compressed caches, indexer
               selection, sparse attention, written into the static o buffer;
  piece l + 1  `attention_post` of layer l, its hc_post + the FFN's hc_pre, the MoE, the hc_post + the next
               layer's attention hc_pre and `attention_pre` (after the last layer: the final residual).
Every graphed op is row-wise (GEMMs, norms, hc mixes, the MoE's per-token expert sums), so a real row's
values do not depend on the padding rows, only on the kernels' launch shapes: a replay computes exactly
what the same pieces compute eagerly at Tb (bit-identical, tests/test_extend_graphs.py -m gpu), which is
within the fast path's numerics of `V4EngineModel.forward` at T (other shapes can pick other kernel plans:
the same math in another order). The cores see the unpadded rows and the step's `ExtendRows` as the eager
path does.

Memory: the graphs of all buckets share one pool; a piece's outputs are dropped once the next piece is
captured, so the pool holds about one bucket's largest piece's working set plus the o buffer [max_tokens,
H, hd] and the per-bucket RoPE tables and final residual.
V4.1's pieces (its deferred hc mixes, Engram layers, own attention) are `v41_extend_graphs.V41ExtendGraphs`,
a subclass: the buffers, capture, buckets and binding are this class's.
Must not: run with a debug tap or several ranks (the MoE's exchange reads counts on the host); read host
values of device tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from deepinfer import kernels
from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext
from deepinfer.model.extend_attention import AttnPre, attention_core, attention_post, attention_pre
from deepinfer.model.v4 import PendingPost

# token buckets: powers of two up to 256, then steps of at most half the smaller bucket (padding < 50%
# above 256 tokens, where the padded rows cost device time)
BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass
class _Carry:
    """What one piece hands on: the attention sublayer's pending hc state (residual streams, post, comb) and
    its AttnPre (views of the static handoff buffers), or, after the last layer, the final residual."""

    residual: torch.Tensor | None
    post: torch.Tensor | None
    comb: torch.Tensor | None
    pre: AttnPre | None  # (V4.1: a v41_extend.V41Pre)
    final: torch.Tensor | None = None  # [Tb, hc, D]
    mix: torch.Tensor | None = None  # V4.1: the sublayer's deferred pre mix [Tb, hc] (after the last layer: the final one)


class ExtendGraphs:
    """Extend steps of `model` of up to `max_tokens` tokens through the pieces (see the module doc), replayed
    from CUDA graphs on cuda when `cuda_graphs`, run eagerly otherwise (the same pieces on the same buffers:
    how the CPU tests check the padding and the split)."""

    def __init__(self, model, max_tokens: int, cuda_graphs: bool = True,
                 buckets: Sequence[int] = BUCKETS) -> None:
        if not model.fast:
            raise ValueError("the extend graphs run fast numerics only")
        if model.comm is not None:
            raise ValueError("the extend graphs run in one process only (the MoE's exchange reads host counts)")
        if max_tokens <= 0:
            raise ValueError(f"ExtendGraphs needs max_tokens > 0, got {max_tokens}")
        self.model, self.max_tokens = model, max_tokens
        self.buckets = tuple(sorted({b for b in buckets if 0 < b < max_tokens} | {max_tokens}))
        cfg, dev = model.cfg, model.device
        attn0 = model.layers[0].attn
        self._ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self._pos = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        # the cores' outputs (finite padding rows: zeros until a step writes them)
        self._o = torch.zeros(max_tokens, attn0.H, cfg.head_dim, dtype=torch.bfloat16, device=dev)
        # AttnPre handoff: a piece copies its layer's AttnPre here, where the core reads it. Its own outputs
        # live in the graph pool, which the piece two layers on reuses; layers of one kind share a buffer.
        self._hand: dict[tuple, torch.Tensor] = {}
        self.graphs_on = cuda_graphs and dev.type == "cuda"
        # per bucket: a graph per piece, the AttnPre views each core reads, the final residual (the RoPE tables
        # are kept too: every piece of the bucket reads them)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._pres: dict[int, list[AttnPre]] = {}
        self._final: dict[int, _Carry] = {}  # the last piece's carry (its final residual)
        self._tables: dict[int, dict] = {}
        self.replayed = self.eager = 0  # steps through the graphs / the eager pieces (benchmarks read them)
        self._captured = None  # the model the graphs were captured on, once another is bound (`bind`)
        if self.graphs_on:
            self.capture()

    def bind(self, model) -> None:
        """Run the steps of `model` from now on: a model over the same params (the engine captures on its
        KV-sizing model, whose cache no graph reads, then binds the serving one)."""
        if model.p is not self.model.p or model.cfg is not self.model.cfg or not model.fast or model.comm is not None:
            raise ValueError("ExtendGraphs.bind: the model must share the captured model's params and config")
        # the graphs read tensors the captured model's layers made for themselves (each attention's RoPE
        # frequencies): it stays alive with them (its own cache is the sizing run's few blocks)
        self._captured = self._captured or self.model
        self.model = model

    # ------------------------------------------------------------------ the pieces
    def _k(self, name: str):
        return kernels.get(name, self.model.kdev)

    def _buffer(self, name: str, tail: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The handoff buffer [max_tokens, *tail] for `name` (made by the warm-up, before any capture)."""
        key = (name, tail, dtype)
        buf = self._hand.get(key)
        if buf is None:
            dev = self.model.device
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"extend graphs: handoff buffer {key} first met inside a capture")
            buf = self._hand[key] = torch.empty((self.max_tokens, *tail), dtype=dtype, device=dev)
        return buf

    def _handoff(self, pre: AttnPre) -> AttnPre:
        """pre copied into the static handoff buffers (views of their first rows); a tensor already written
        into its buffer (q: `attention_pre`'s q_out) is not copied."""
        def put(name: str, t: torch.Tensor) -> torch.Tensor:
            view = self._buffer(name, tuple(t.shape[1:]), t.dtype)[: t.shape[0]]
            return t if t.data_ptr() == view.data_ptr() else view.copy_(t)

        return pre.map(put)

    def _attention_pre(self, layer: int, y: torch.Tensor, Tb: int, tables: dict) -> AttnPre:
        a = self.model.layers[layer].attn
        q_out = self._buffer("q", (a.H, a.hd), torch.bfloat16)[:Tb]  # the q norm + RoPE writes it there
        pre = attention_pre(a, y, self._pos[:Tb], tables[a.rope_key], self.model.cache.layers[layer].layouts,
                            q_out=q_out)
        return self._handoff(pre)

    def _piece0(self, Tb: int, tables: dict) -> _Carry:
        """Embedding, layer 0's attention hc_pre and attention_pre; fills `tables` (one per frequency key)."""
        model = self.model
        self._rope_tables(Tb, tables)
        x = model.embed(self._ids[:Tb])
        y, post, comb = self._k("hc_pre_fused")(x, *model.layers[0].hc_pre_args("attn"))
        return _Carry(x, post, comb, self._attention_pre(0, y, Tb, tables))

    def _rope_tables(self, Tb: int, tables: dict) -> None:
        """The bucket's RoPE tables into `tables`, one per frequency key (every piece of the bucket reads them)."""
        for block in self.model.layers:
            a = block.attn
            if a.rope_key not in tables:
                tables[a.rope_key] = self._k("rope_table32")(self._pos[:Tb], a.inv_freq)

    def _piece(self, layer: int, Tb: int, tables: dict, c: _Carry) -> _Carry:
        """Layer `layer`'s attention_post from the o buffer, its FFN sublayer, and the next layer's attention
        hc_pre and attention_pre (the last layer: the final residual)."""
        model = self.model
        block = model.layers[layer]
        a = block.attn
        f = attention_post(a, self._o[:Tb], self._pos[:Tb], tables[a.rope_key])
        x, y, post, comb = self._k("hc_post_pre_fused")(f, c.residual, c.post, c.comb, *block.hc_pre_args("ffn"))
        f = block.ffn(y, self._ids[:Tb])
        if layer + 1 == len(model.layers):
            return _Carry(None, None, None, None, final=PendingPost(f, x, post, comb).resolve(model.kdev))
        x, y, post, comb = self._k("hc_post_pre_fused")(f, x, post, comb,
                                                        *model.layers[layer + 1].hc_pre_args("attn"))
        return _Carry(x, post, comb, self._attention_pre(layer + 1, y, Tb, tables))

    def _run_pieces(self, Tb: int, core=None) -> _Carry:
        """Every piece eagerly in order, `core(layer, pre)` between them (None: no cache work, the capture's
        warm-up) -> the last piece's carry (its final residual)."""
        tables: dict = {}
        c = self._piece0(Tb, tables)
        for layer in range(len(self.model.layers)):
            if core is not None:
                core(layer, c.pre)
            c = self._piece(layer, Tb, tables, c)
        return c

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self) -> None:
        """The pieces of every bucket, largest first, into one shared pool. A warm-up of each bucket's pieces
        (which compiles the Triton kernels for its shapes and makes the handoff buffers) runs first on a
        side stream; no cache is touched."""
        pool = None
        for Tb in sorted(self.buckets, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run_pieces(Tb)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            tables: dict = {}
            graphs, pres = [], []
            c = None
            for piece in range(len(self.model.layers) + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    # the previous piece's residual, post and comb are read by this one only: dropping `c` after
                    # it lets the next capture reuse their memory (the replays run in capture order)
                    c = self._piece0(Tb, tables) if piece == 0 else self._piece(piece - 1, Tb, tables, c)
                pool = g.pool()
                graphs.append(g)
                pres.append(c.pre)
            self._graphs[Tb], self._pres[Tb], self._final[Tb], self._tables[Tb] = graphs, pres, c, tables
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ one step
    def bucket(self, T: int) -> int | None:
        """The smallest bucket holding T tokens (None: more than max_tokens)."""
        for b in self.buckets:
            if b >= T:
                return b
        return None

    def _pad(self, T: int, Tb: int) -> None:
        """The padding rows' inputs: token 0 at position 0 (any valid token and position would do: no real
        row reads them, tests/test_extend_graphs.py fills them at random)."""
        self._ids[T:Tb].zero_()
        self._pos[T:Tb].zero_()

    def fits(self, ctx: ForwardContext) -> bool:
        """Whether the pieces take this batch (else `__call__` runs `model.forward`)."""
        return 0 < ctx.num_tokens <= self.max_tokens and self.model.tap is None

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, ctx: ForwardContext, graphs: bool | None = None) -> torch.Tensor:
        """ids [T] (host or device) of the batch `ctx` -> its logits rows (`V4EngineModel.forward`'s). A batch
        the pieces cannot take (`fits`) runs `model.forward`. graphs=False forces the eager pieces (same
        buffers, same kernels)."""
        model = self.model
        if not self.fits(ctx):
            return model.forward(ids, ctx)
        ids, ctx = model.start_step(ids, ctx)
        T, Tb = self._load_step(ids, ctx)
        cache = model.cache

        def core(layer: int, pre: AttnPre) -> None:
            attention_core(model.layers[layer].attn, pre.map(lambda _, t: t[:T]), ctx, cache, rows, out=self._o[:T])

        with model.extend_rows(ctx) as rows:  # the step's rows, built once (as forward builds them)
            if rows is None:
                raise ValueError("the extend graphs run the batched extend path (V4Attention.batched_extend)")
            final = self._pieces_and_cores(Tb, core, graphs).final
        return model.logits(final[:T][host_to_device(ctx.logit_rows(), model.device)])

    def _load_step(self, ids: torch.Tensor, ctx: ForwardContext) -> tuple[int, int]:
        """The step's device ids and positions into the static buffers, its bucket's padding rows filled ->
        (T, the bucket Tb)."""
        T = ctx.num_tokens
        Tb = self.bucket(T)
        self._ids[:T].copy_(ids)
        self._pos[:T].copy_(ctx.positions)
        self._pad(T, Tb)
        return T, Tb

    def _pieces_and_cores(self, Tb: int, core, graphs: bool | None) -> _Carry:
        """One step: the pieces of bucket Tb replayed (or run eagerly: graphs=False, or no graphs), `core(layer,
        pre)` between them -> the last piece's carry (its final residual)."""
        if (self.graphs_on if graphs is None else graphs) and Tb in self._graphs:
            graphs_ = self._graphs[Tb]
            graphs_[0].replay()
            for layer, pre in enumerate(self._pres[Tb][:-1]):
                core(layer, pre)
                graphs_[layer + 1].replay()
            self.replayed += 1
            return self._final[Tb]
        self.eager += 1
        return self._run_pieces(Tb, core)
