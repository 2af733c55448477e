"""Pure-decode steps of a fast-numerics `V4EngineModel` (or `V41EngineModel`: model/v41_decode.py's layers):
eager, or replayed from CUDA graphs captured per (batch size, context) bucket.

Owns: `decode_logits(model, ids, meta)` (the whole batched decode forward: embedding, every block with
`decode_attention`, the head) and `DecodeRunner` (one `DecodeMetadata` per bucket, a token-id buffer per
batch bucket, the padding rows' scratch slot and block, graph capture at start and replay per step).
A batch of n sequences runs in the smallest batch bucket >= n and the smallest context bucket above its
largest position (block_size * 2^k, then max_context); rows n.. are padding that decode position 0 in
`scratch_slot` over `scratch_block`, which the caller must keep away from every request (the engine's cache
has one slot and one block more than its scheduler hands out). Graph replay computes exactly the eager
kernels on the same buffers, so its logits are bit-identical to the eager path's on the same inputs.
Must not: decide whether a step is a decode (the runner does), sample, or import the oracle.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepinfer import env
from deepinfer.model.context import SeqContext
from deepinfer.model.decode_attention import decode_attention
from deepinfer.model.decode_metadata import DecodeMetadata
from deepinfer.model.v4 import resolved

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def decode_hidden(model, ids: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
    """ids [B] on the model's device, meta filled -> final 4-stream residual [B, hc, D]."""
    rows = meta.derive()  # once per step, shared by every layer
    x = model.embed(ids)
    for block in model.layers:  # each sublayer's hc_post runs inside the next one's hc_pre (PendingPost)
        x = block._hc(x, "attn", lambda y, b=block: decode_attention(b.attn, y, rows, model.cache), defer=True)
        x = block._hc(x, "ffn", block.ffn, ids, defer=True)
    return resolved(x, model.kdev)


def decode_logits(model, ids: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
    return model.logits(decode_hidden(model, ids, meta))  # [B, vocab] on the device


def context_buckets(max_context: int, block_size: int) -> tuple[int, ...]:
    """block_size, 2*block_size, 4*block_size, ... below max_context, then max_context itself."""
    out, c = [], block_size
    while c < max_context:
        out.append(c)
        c *= 2
    return tuple(out) + (max_context,)


class DecodeRunner:
    """Decode steps of `model` for up to `max_batch` sequences below `max_context` tokens.

    Buckets are (batch, context): a step runs in the smallest batch bucket >= its sequence count and the
    smallest context bucket above its largest position, so the padded entry gathers scale with the batch's
    context, not with max_context. With graphs, every (batch, context) bucket is captured at start."""

    def __init__(self, model, max_batch: int, max_context: int, scratch_slot: int, scratch_block: int,
                 cuda_graphs: bool = True, buckets: Sequence[int] = BUCKETS,
                 contexts: Sequence[int] | None = None) -> None:
        if not model.fast:
            raise ValueError("the batched decode path runs fast numerics only")
        cache = model.cache
        if not 0 <= scratch_slot < cache.max_num_seqs or not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"scratch slot {scratch_slot} / block {scratch_block} outside the cache "
                             f"({cache.max_num_seqs} slots, {cache.num_blocks} blocks)")
        if max_batch <= 0 or max_context <= 0:
            raise ValueError(f"DecodeRunner needs max_batch > 0 and max_context > 0, got {max_batch}, {max_context}")
        self.model, self.max_batch, self.max_context = model, max_batch, max_context
        self.scratch = (scratch_slot, scratch_block)
        # in a parallel group only when asked (env.parallel_cuda_graphs: not yet run on several GPUs) and with
        # dp = 1 (the MoE exchange between dp groups reads row counts on the host, which a graph cannot)
        in_group_ok = model.comm is not None and model.comm.parallel.dp == 1 and env.parallel_cuda_graphs()
        self.graphs_on = cuda_graphs and model.device.type == "cuda" and (model.comm is None or in_group_ok)
        self.buckets = tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))
        if contexts is None:
            contexts = context_buckets(max_context, cache.block_size)
        self.contexts = tuple(sorted({c for c in contexts if c < max_context} | {max_context}))
        self._ratios = [r for r in model.cfg.compress_ratios[: model.cfg.n_layers] if r]
        self._meta: dict[tuple[int, int], DecodeMetadata] = {}
        self._ids = {b: torch.zeros(b, dtype=torch.long, device=model.device) for b in self.buckets}
        # family v41 (model/v41_decode.py): its own layer math, and the Engram rows of a step in static buffers
        self._v41_logits = None
        self._engram = {}
        if model.cfg.is_v41:
            from deepinfer.model.v41_decode import EngramInputs, decode_logits as v41_decode_logits

            self._v41_logits = v41_decode_logits
            if model.engrams:
                self._engram = {b: EngramInputs(model, b) for b in self.buckets}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.last_bucket: tuple[int, int] | None = None  # the (batch, context) bucket of the last step
        self.replayed = self.eager = 0  # steps run from a captured graph / eagerly (benchmarks read them)
        if self.graphs_on:
            self.capture()

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} sequences exceeds max_batch {self.max_batch}")

    def context_bucket(self, max_position: int) -> int:
        for c in self.contexts:
            if c > max_position:
                return c
        raise ValueError(f"position {max_position} is past the decode path's max_context {self.max_context}")

    def _meta_for(self, b: int, c: int) -> DecodeMetadata:
        meta = self._meta.get((b, c))
        if meta is None:
            cfg = self.model.cfg
            meta = self._meta[(b, c)] = DecodeMetadata(b, c, self.model.cache.block_size, cfg.window_size,
                                                       self._ratios, self.model.device)
        return meta

    @torch.no_grad()
    def capture(self) -> None:
        """One graph per (batch, context) bucket, largest first, sharing one memory pool. The warm-up runs
        (which compile the Triton kernels) and the capture see only padding rows: they write only the
        scratch slot and block."""
        pool = None
        for b in sorted(self.buckets, reverse=True):
            for c in sorted(self.contexts, reverse=True):
                meta, ids = self._meta_for(b, c), self._ids[b]
                meta.fill([], *self.scratch)
                ids.zero_()
                if b in self._engram:
                    self._engram[b].fill(ids, [])
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(b, c)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(b, c)
                pool = graph.pool()
                self._graphs[(b, c)] = (graph, out)
        torch.cuda.synchronize()

    def _forward(self, b: int, c: int) -> torch.Tensor:
        """The decode forward of bucket (b, c) on its buffers (what a graph of the bucket captures)."""
        if self._v41_logits is not None:
            return self._v41_logits(self.model, self._ids[b], self._meta[(b, c)], self._engram.get(b))
        return decode_logits(self.model, self._ids[b], self._meta[(b, c)])

    def prepare(self, ids: torch.Tensor, seqs: Sequence[SeqContext]) -> tuple[int, int]:
        """Fill the bucket's buffers for this step (and reset fresh sequences' slots); returns the bucket."""
        n = len(seqs)
        if n == 0 or ids.dim() != 1 or ids.shape[0] != n:
            raise ValueError(f"decode ids must be flat [{n}] for {n} > 0 sequences, got {tuple(ids.shape)}")
        if ids.device.type == "cpu" and (int(ids.min()) < 0 or int(ids.max()) >= self.model.cfg.vocab_size):
            raise ValueError("token id outside the vocabulary")  # (device ids: no host sync to check them)
        cache = self.model.cache
        b, c = self.bucket(n), self.context_bucket(max(s.start_pos for s in seqs))
        meta = self._meta_for(b, c)
        # validates num_new == 1, the block tables, the slots' range and that no row uses the scratch
        meta.fill(seqs, *self.scratch, num_slots=cache.max_num_seqs)
        for s in seqs:
            if s.start_pos == 0:  # a fresh sequence: nothing of the slot's previous owner may leak in
                cache.reset(s.window_slot, s.state_slot)
        if b in self._engram:  # (after the resets: a fresh sequence's n-gram history starts empty)
            self._engram[b].fill(ids, seqs)
        buf = self._ids[b]
        buf[:n].copy_(ids, non_blocking=True)
        buf[n:].zero_()
        self.last_bucket = (b, c)
        return b, c

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, seqs: Sequence[SeqContext], graphs: bool | None = None) -> torch.Tensor:
        """ids [n] (host or device), one SeqContext per id with num_new == 1 -> logits [n, vocab] on the device.
        graphs=False forces the eager path (same buffers, same kernels)."""
        b, c = self.prepare(ids, seqs)
        if (self.graphs_on if graphs is None else graphs) and (b, c) in self._graphs:
            graph, out = self._graphs[(b, c)]
            graph.replay()
            self.replayed += 1
        else:
            out = self._forward(b, c)
            self.eager += 1
        return out[: len(seqs)]
