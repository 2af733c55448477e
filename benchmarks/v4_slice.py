"""The engine's fast path on a real-dimension V4-Flash slice (random weights in the official on-disk format,
made on the GPU): decode steps at several batch sizes and one-sequence prefills, timed with CUDA events.

Decode: `batch` sequences whose `context`-token prompts were prefilled first, then one-token steps that really
advance every sequence (positions move, rings and compressor states update). Prefill: one fresh sequence of
`tokens` tokens. Each measurement is reported for the whole forward (blocks + head) and for the blocks alone
(`V4EngineModel.hidden`), the latter divided by the number of layers = time per layer; prompts of up to 2048
tokens also through the extend graphs (the CUDA engine's path for them; whole forward only).
"""
from __future__ import annotations

import torch

from deepinfer.model.context import ForwardContext, SeqContext, forward_context
from deepinfer.model.factory import build_v4_model
from timing import back_to_back_ms, cuda_time_ms, graph_replay_ms

BLOCK = 128


def _profile_rows(fn, top: int) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total us) of the CUDA kernels `fn` runs, largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append((ev.key[:70], ev.count, t))
    return sorted(rows, key=lambda r: -r[2])[:top]


class SliceRunner:
    prefill_group = 8  # sequences one prefill forward takes

    def __init__(self, cfg, raw, max_batch: int, max_tokens: int) -> None:
        self.cfg = cfg
        self.blocks_per_seq = -(-max_tokens // BLOCK)
        # one slot and one block more than the sequences use: the batched decode path's padding scratch
        self.scratch = (max_batch, max_batch * self.blocks_per_seq)
        self.model = self._build(cfg, raw, max_batch * self.blocks_per_seq + 1, max_batch + 1)
        self.g = torch.Generator(device="cuda").manual_seed(0)

    @classmethod
    def random(cls, layers: int, max_batch: int, max_tokens: int) -> "SliceRunner":
        """The Triton kernels registered, then a runner over a `layers`-layer V4-Flash slice (`slice_config`)
        with random weights in the official format drawn on the GPU (the raw tensors freed once loaded)."""
        import gc

        from slice_config import slice_config

        from deepinfer.kernels.triton import register_cuda_kernels
        from deepinfer.tiny import make_tensors

        register_cuda_kernels()
        cfg = slice_config(layers)
        runner = cls(cfg, make_tensors(cfg, seed=0, device="cuda"), max_batch, max_tokens)
        gc.collect()
        torch.cuda.empty_cache()
        return runner

    def _build(self, cfg, raw, num_blocks: int, max_num_seqs: int):
        """The slice's fast-numerics model on cuda (a subclass builds another family's)."""
        return build_v4_model(cfg, raw, "fast", "cuda", num_blocks=num_blocks, block_size=BLOCK,
                              max_num_seqs=max_num_seqs)

    def _table(self, i: int) -> tuple[int, ...]:
        return tuple(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq))

    def _ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.cfg.vocab_size, (n,), device="cuda", generator=self.g)

    @torch.no_grad()
    def prefill(self, seqs: list[int], tokens: int, group: int | None = None) -> None:
        group = group or self.prefill_group
        for start in range(0, len(seqs), group):
            part = seqs[start : start + group]
            ctx = ForwardContext(tuple(SeqContext(0, tokens, i, i, self._table(i)) for i in part))
            self.model.forward(self._ids(tokens * len(part)), ctx)

    @torch.no_grad()
    def decode_ms(self, batch: int, context: int, reps: int = 10, blocks_only: bool = False) -> float:
        """Median ms of one decode step of `batch` sequences at ~`context` cached tokens."""
        self.prefill(list(range(batch)), context)
        pos = [context]

        def step():
            ctx = ForwardContext(tuple(SeqContext(pos[0], 1, i, i, self._table(i)) for i in range(batch)))
            ids = self._ids(batch)
            if blocks_only:
                with forward_context(ctx):
                    self.model.hidden(ids)
            else:
                self.model.forward(ids, ctx)
            pos[0] += 1

        return cuda_time_ms(step, reps=reps, warmup=3)

    @torch.no_grad()
    def decode_batched_ms(self, batch: int, context: int, reps: int = 10, graphs: bool = True) -> tuple[float, float]:
        """(median ms of one decode step, ms a step of `reps` steps run back to back) through the batched decode
        path (model/decode_step.py): replayed from the CUDA graph of bucket `batch` (captured here, not
        timed), or eager with graphs=False. The first number is each step alone (events around the host's
        preparation and the replay, synchronised after each step: the engine's case, which syncs to sample);
        the second has no synchronisation between steps, so the host prepares step n+1 while the device runs
        step n (the runner allows it; the engine does not run that way yet)."""
        from deepinfer.model.decode_step import DecodeRunner

        self.prefill(list(range(batch)), context)
        runner = DecodeRunner(self.model, batch, context + 64, *self.scratch, cuda_graphs=graphs, buckets=(batch,),
                              contexts=(context + 64,))
        pos = [context]

        def step():
            runner(self._ids(batch), [SeqContext(pos[0], 1, i, i, self._table(i)) for i in range(batch)])
            pos[0] += 1

        alone = cuda_time_ms(step, reps=reps, warmup=3)
        pos[0] = context  # rewound: the kernels' work depends on the context bucket, not on the values
        return alone, back_to_back_ms(step, reps)

    @torch.no_grad()
    def head_ms(self, batch: int) -> float:
        """Median ms of the head alone (collapse, norm, vocab GEMM) on `batch` rows, replayed from a CUDA graph
        as the decode step is: subtracted from a step to get the blocks' time. (Until 2026-12-02 it was timed
        eagerly, host launch gaps included: b1 0.61 ms, which made the blocks' share look smaller.)"""
        x = torch.randn(batch, self.cfg.hc_mult, self.cfg.dim, device="cuda", generator=self.g).to(torch.bfloat16)
        return graph_replay_ms(lambda: self.model.logits(x))

    @torch.no_grad()
    def decode_kernel_breakdown(self, batch: int, context: int, top: int = 14) -> list[tuple[str, int, float]]:
        """Kernels of one batched decode step run eagerly (the kernels a graph replays; the profiler does not
        see inside a graph), largest first."""
        from deepinfer.model.decode_step import DecodeRunner

        self.prefill(list(range(batch)), context)
        runner = DecodeRunner(self.model, batch, context + 64, *self.scratch, cuda_graphs=False, buckets=(batch,),
                              contexts=(context + 64,))
        seqs = [SeqContext(context, 1, i, i, self._table(i)) for i in range(batch)]
        ids = self._ids(batch)
        return _profile_rows(lambda: runner(ids, seqs), top)

    @torch.no_grad()
    def prefill_kernel_breakdown(self, tokens: int, top: int = 24) -> list[tuple[str, int, float]]:
        """Kernels of one fresh `tokens`-token prefill (blocks + head), largest first."""
        ctx = ForwardContext((SeqContext(0, tokens, 0, 0, self._table(0)),))
        ids = self._ids(tokens)
        return _profile_rows(lambda: self.model.forward(ids, ctx), top)

    @torch.no_grad()
    def prefill_graphs_ms(self, tokens: int, buckets: tuple[int, ...], reps: int = 10) -> float:
        """A fresh `tokens`-token prefill (blocks + head) as the CUDA engine runs it: through the piecewise
        graphs (`model/extend_graphs.py`; captured once for `buckets`, which should hold `tokens` itself: the
        engine's default buckets hold 1024 and 2048)."""
        from deepinfer.model.extend_graphs import ExtendGraphs

        if getattr(self, "_extend_graphs", None) is None or self._extend_graphs.buckets != tuple(sorted(buckets)):
            self._extend_graphs = ExtendGraphs(self.model, max(buckets), buckets=buckets)
        ctx = ForwardContext((SeqContext(0, tokens, 0, 0, self._table(0)),))
        ids = self._ids(tokens)
        return cuda_time_ms(lambda: self._extend_graphs(ids, ctx), reps=reps, warmup=2)

    @torch.no_grad()
    def prefill_ms(self, tokens: int, reps: int = 10, blocks_only: bool = False) -> float:
        ctx = ForwardContext((SeqContext(0, tokens, 0, 0, self._table(0)),))
        ids = self._ids(tokens)

        def run():
            if blocks_only:
                with forward_context(ctx):
                    self.model.hidden(ids)
            else:
                self.model.forward(ids, ctx)

        # 3 reps moved the 1k prefill by 30% between runs; 2 warm-ups left the 8k's whole forward ~10 ms over its
        # blocks in every rep of the first measurement, 8 none (H100 2026-12-06, benchmarks/prefill_forward_gap.py)
        return cuda_time_ms(run, reps=reps, warmup=4)
