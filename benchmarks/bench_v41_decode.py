"""V4.1-Flash decode steps on a real-dimension slice (random weights in the official on-disk format, made on the
GPU): the varlen path (`V41EngineModel.forward`, what every V4.1 step ran before 2026-12-06) against the batched
decode path (`model/v41_decode.py` through `DecodeRunner`), eager and replayed from a CUDA graph.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bench_v41_decode.py [--batches 1 8 32] [--context 2048]
        [--prefills 1024 4096]   # also one fresh prefill of each length (V4.1's varlen path, eager): device
                                 # ms, the host's call time (above the device's: host-bound) and its kernels
        [--prefill-seqs 16]      # ... split over that many fresh prompts in one step (each length / N tokens)
        [--per-sequence]         # ... also through the per-sequence attention (before 2026-12-06's
                                 # model/v41_extend.py: `V41Attention.batched_extend = False`), same process
        [--graphs]               # ... also through the piecewise extend graphs (model/v41_extend_graphs.py)

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
from prefill_host import kernel_us  # noqa: E402
from slice_config import decode_bytes_per_layer  # noqa: E402
from timing import cuda_time_ms, host_call_ms  # noqa: E402
from v4_slice import BLOCK, SliceRunner  # noqa: E402

from deepinfer.model.context import ForwardContext, SeqContext  # noqa: E402
from deepinfer.model.v41_attention import V41Attention  # noqa: E402

V41_FLASH_CONFIG = Path(__file__).resolve().parents[1] / "tests/fixtures/configs/v41-flash/inference/config.json"


def slice_config_v41():
    from deepinfer.config import ModelConfig

    args = json.loads(V41_FLASH_CONFIG.read_text())
    args.update(n_layers=4, n_mtp_layers=0, compress_ratios=[2, 2, 1, 1], kv_source_layers=[0, 2],
                index_source_layers=[0, 2, 3], candidate_source_layer=2, engram_layer_ids=[],
                engram_num_embeddings=[])
    return ModelConfig.from_dict(args, family="v41")


class V41Slice(SliceRunner):
    """v4_slice's runner over a V4.1 model: the same prefill, varlen decode step (`decode_ms`), batched decode
    steps (`decode_batched_ms`) and kernel breakdown."""

    prefill_group = 4  # (V4.1 prefills of 8 x 2048 tokens were not tried on an 80 GB card)

    def _build(self, cfg, raw, num_blocks: int, max_num_seqs: int):
        from deepinfer.model.v41 import build_v41_model

        return build_v41_model(cfg, raw, None, "fast", "cuda", num_blocks=num_blocks, block_size=BLOCK,
                               max_num_seqs=max_num_seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-varlen", action="store_true", help="skip the (slow) varlen path")
    ap.add_argument("--top", type=int, default=0, help="also list the top kernels of one step per batch")
    ap.add_argument("--prefills", type=int, nargs="*", default=[], help="also time a fresh prefill of each length")
    ap.add_argument("--prefill-seqs", type=int, default=1, help="each prefill split over this many fresh prompts")
    ap.add_argument("--per-sequence", action="store_true",
                    help="also time the prefills through V4.1's per-sequence attention (the batched path's reference)")
    ap.add_argument("--graphs", action="store_true", help="also time the prefills through the extend graphs")
    args = ap.parse_args()

    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.tiny import make_tensors

    register_cuda_kernels()
    ceil = ceilings.measure()
    cfg = slice_config_v41()
    raw = make_tensors(cfg, seed=0, device="cuda")
    layers = cfg.n_layers
    n_pre = args.prefill_seqs
    sl = V41Slice(cfg, raw, max([*(args.batches or [1]), n_pre]), max([args.context + 64, *args.prefills]))
    print(f"{torch.cuda.get_device_name()}, V4.1-Flash slice of {layers} layers (ratios "
          f"{list(cfg.compress_ratios[:layers])}), context {args.context}; copy {ceil['copy_gbs']:.0f} GB/s")
    forward = sl.model.forward
    paths = [("batched", True, forward)]
    if args.per_sequence:
        paths.append(("per sequence", False, forward))
    if args.graphs and args.prefills:
        from deepinfer.model.v41_extend_graphs import V41ExtendGraphs

        top = max(t // n_pre * n_pre for t in args.prefills)
        paths.append(("extend graphs", True, V41ExtendGraphs(sl.model, top, buckets=[t // n_pre * n_pre
                                                                                     for t in args.prefills])))
    for t in args.prefills:
        each = t // n_pre
        ids = sl._ids(each * n_pre)
        ctx = ForwardContext(tuple(SeqContext(0, each, i, i, sl._table(i)) for i in range(n_pre)))
        for label, batched, run in paths:
            V41Attention.batched_extend = batched
            with torch.no_grad():
                ms = cuda_time_ms(lambda: run(ids, ctx), reps=max(3, args.reps // 2), warmup=4)
                host = host_call_ms(lambda: run(ids, ctx), reps=3)
                kus, launches = kernel_us(lambda: run(ids, ctx))
            print(f"prefill {n_pre} x {each:5d} (varlen path, {label}): {ms:8.2f} ms, host call {host:8.2f} ms, "
                  f"kernels {kus / 1e3:8.2f} ms in {launches} launches, {each * n_pre / ms * 1e3:8.0f} tok/s",
                  flush=True)
        V41Attention.batched_extend = True
        if args.top:
            print(f"prefill {n_pre} x {each} kernels (batched, eager; the top {args.top}):")
            for name, n, us in sl.prefill_kernel_breakdown(each, args.top) if n_pre == 1 else []:
                print(f"      {us:9.1f} us {n:5d}x  {name}")
    for b in args.batches:
        # the layers' bytes and the bf16 head's
        nbytes = sum(decode_bytes_per_layer(cfg, raw, i, b, args.context) for i in range(layers)) + \
            2 * cfg.vocab_size * cfg.dim
        rows = {}
        if not args.no_varlen:
            rows["varlen path"] = (sl.decode_ms(b, args.context, reps=max(3, args.reps // 2)), float("nan"))
        eager = sl.decode_batched_ms(b, args.context, args.reps, graphs=False)
        graph = sl.decode_batched_ms(b, args.context, args.reps, graphs=True)
        rows["batched, eager"], rows["batched, graphs"] = eager, graph
        for name, (alone, b2b) in rows.items():
            gbs = nbytes / (alone * 1e-3) / 1e9
            print(f"b{b:<4} {name:16s}: {alone:8.3f} ms a step ({b2b:7.3f} back to back), {b / alone * 1e3:9.0f} tok/s, "
                  f"{gbs:6.0f} GB/s = {100 * gbs / ceil['copy_gbs']:5.1f}% of copy "
                  f"({nbytes / 1e9:.2f} GB a step)")
        if args.top:
            rows = sl.decode_kernel_breakdown(b, args.context, args.top)
            print(f"b{b:<4} kernels of one step (eager, {sum(n for _, n, _ in rows)} launches of the top {args.top}):")
            for name, n, us in rows:
                print(f"      {us:9.1f} us {n:5d}x  {name}")


if __name__ == "__main__":
    main()
