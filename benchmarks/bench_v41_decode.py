"""V4.1-Flash decode steps on a real-dimension slice (random weights in the official on-disk format, made on the
GPU): the varlen path (`V41EngineModel.forward`, what every V4.1 step ran before 2026-12-06) against the batched
decode path (`model/v41_decode.py` through `DecodeRunner`), eager and replayed from a CUDA graph.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bench_v41_decode.py [--batches 1 8 32] [--context 2048]

The slice keeps every kind of V4.1 layer once, in the real model's roles (inference/config.json of V4.1-Flash,
truncated to 4 layers, what an 80 GB card holds twice while the params are made): 0 a ratio-2 kv + index
source, 1 its consumer, 2 a ratio-1 kv + index source and the candidate-block source, 3 a ratio-1 index source
that applies the candidate filter (a consumer of the ratio-1 kv source). No Engram
layer (the real tables are ~98 GB each; a step reads a few hundred of their rows on the host, spec §10.5), no
window-only layer, no DSpark stage. Each sequence is prefilled with `context` tokens first; the steps then
really advance every sequence. Per step: ms (CUDA events; each step alone, synchronised, as the engine samples
after each), tokens/s, and the bytes a step must read (weights every token reads, the experts the batch
touches under uniform routing, the KV it attends, the head) as GB/s against the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ceilings  # noqa: E402
from slice_config import decode_bytes_per_layer  # noqa: E402
from timing import back_to_back_ms, cuda_time_ms  # noqa: E402

V41_FLASH_CONFIG = Path(__file__).resolve().parents[1] / "tests/fixtures/configs/v41-flash/inference/config.json"
BLOCK = 128


def slice_config_v41():
    from deepinfer.config import ModelConfig

    args = json.loads(V41_FLASH_CONFIG.read_text())
    args.update(n_layers=4, n_mtp_layers=0, compress_ratios=[2, 2, 1, 1], kv_source_layers=[0, 2],
                index_source_layers=[0, 2, 3], candidate_source_layer=2, engram_layer_ids=[],
                engram_num_embeddings=[])
    return ModelConfig.from_dict(args, family="v41")


class V41Slice:
    def __init__(self, cfg, raw, max_batch: int, max_tokens: int) -> None:
        from deepinfer.model.v41 import build_v41_model

        self.cfg = cfg
        self.blocks_per_seq = -(-max_tokens // BLOCK)
        self.scratch = (max_batch, max_batch * self.blocks_per_seq)  # the batched decode path's padding scratch
        self.model = build_v41_model(cfg, raw, None, "fast", "cuda", num_blocks=max_batch * self.blocks_per_seq + 1,
                                     block_size=BLOCK, max_num_seqs=max_batch + 1)
        self.g = torch.Generator(device="cuda").manual_seed(0)

    def table(self, i: int) -> tuple[int, ...]:
        return tuple(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq))

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.cfg.vocab_size, (n,), device="cuda", generator=self.g)

    @torch.no_grad()
    def prefill(self, batch: int, tokens: int, group: int = 4) -> None:
        from deepinfer.model.context import ForwardContext, SeqContext

        for start in range(0, batch, group):
            part = range(start, min(batch, start + group))
            self.model.forward(self.ids(tokens * len(part)),
                               ForwardContext(tuple(SeqContext(0, tokens, i, i, self.table(i)) for i in part)))

    @torch.no_grad()
    def varlen_ms(self, batch: int, context: int, reps: int) -> float:
        from deepinfer.model.context import ForwardContext, SeqContext

        self.prefill(batch, context)
        pos = [context]

        def step():
            ctx = ForwardContext(tuple(SeqContext(pos[0], 1, i, i, self.table(i)) for i in range(batch)))
            self.model.forward(self.ids(batch), ctx)
            pos[0] += 1

        return cuda_time_ms(step, reps=reps, warmup=2)

    @torch.no_grad()
    def batched_ms(self, batch: int, context: int, reps: int, graphs: bool) -> tuple[float, float]:
        """(ms a step alone, ms a step back to back) through the DecodeRunner (bucket `batch` only)."""
        from deepinfer.model.context import SeqContext
        from deepinfer.model.decode_step import DecodeRunner

        self.prefill(batch, context)
        runner = DecodeRunner(self.model, batch, context + 64, *self.scratch, cuda_graphs=graphs, buckets=(batch,),
                              contexts=(context + 64,))
        pos = [context]

        def step():
            runner(self.ids(batch), [SeqContext(pos[0], 1, i, i, self.table(i)) for i in range(batch)])
            pos[0] += 1

        alone = cuda_time_ms(step, reps=reps, warmup=3)
        pos[0] = context  # rewound: the kernels' work depends on the context bucket, not on the values
        return alone, back_to_back_ms(step, reps)

    @torch.no_grad()
    def breakdown(self, batch: int, context: int, top: int) -> list[tuple[str, int, float]]:
        """Kernels of one eager batched decode step (what its graph replays), largest first."""
        from deepinfer.model.context import SeqContext
        from deepinfer.model.decode_step import DecodeRunner
        from v4_slice import _profile_rows

        self.prefill(batch, context)
        runner = DecodeRunner(self.model, batch, context + 64, *self.scratch, cuda_graphs=False, buckets=(batch,),
                              contexts=(context + 64,))
        seqs = [SeqContext(context, 1, i, i, self.table(i)) for i in range(batch)]
        ids = self.ids(batch)
        return _profile_rows(lambda: runner(ids, seqs), top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-varlen", action="store_true", help="skip the (slow) varlen path")
    ap.add_argument("--top", type=int, default=0, help="also list the top kernels of one step per batch")
    args = ap.parse_args()

    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.tiny import make_tensors

    register_cuda_kernels()
    ceil = ceilings.measure()
    cfg = slice_config_v41()
    raw = make_tensors(cfg, seed=0, device="cuda")
    layers = cfg.n_layers
    sl = V41Slice(cfg, raw, max(args.batches), args.context + 64)
    print(f"{torch.cuda.get_device_name()}, V4.1-Flash slice of {layers} layers (ratios "
          f"{list(cfg.compress_ratios[:layers])}), context {args.context}; copy {ceil['copy_gbs']:.0f} GB/s")
    for b in args.batches:
        # the layers' bytes and the bf16 head's
        nbytes = sum(decode_bytes_per_layer(cfg, raw, i, b, args.context) for i in range(layers)) + \
            2 * cfg.vocab_size * cfg.dim
        rows = {}
        if not args.no_varlen:
            rows["varlen path"] = (sl.varlen_ms(b, args.context, max(3, args.reps // 2)), float("nan"))
        eager = sl.batched_ms(b, args.context, args.reps, graphs=False)
        graph = sl.batched_ms(b, args.context, args.reps, graphs=True)
        rows["batched, eager"], rows["batched, graphs"] = eager, graph
        for name, (alone, b2b) in rows.items():
            gbs = nbytes / (alone * 1e-3) / 1e9
            print(f"b{b:<4} {name:16s}: {alone:8.3f} ms a step ({b2b:7.3f} back to back), {b / alone * 1e3:9.0f} tok/s, "
                  f"{gbs:6.0f} GB/s = {100 * gbs / ceil['copy_gbs']:5.1f}% of copy "
                  f"({nbytes / 1e9:.2f} GB a step)")
        if args.top:
            rows = sl.breakdown(b, args.context, args.top)
            print(f"b{b:<4} kernels of one step (eager, {sum(n for _, n, _ in rows)} launches of the top {args.top}):")
            for name, n, us in rows:
                print(f"      {us:9.1f} us {n:5d}x  {name}")


if __name__ == "__main__":
    main()
