"""One device call: ceilings, the engine's fast path on a real-dimension V4-Flash slice, the same slice through
transformers, and a table against the roofline. Writes `$OUT/slice.json` (or ./slice.json) and prints the table.

    PYTHONPATH=$PWD python benchmarks/run_slice.py --layers 4 [--no-hf] [--context 256]

Needs CUDA, triton (the fast kernels) and, for the comparison, transformers with DeepseekV4.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ceilings  # noqa: E402
import env_sets  # noqa: E402
from slice_config import decode_bytes_per_layer, flops_per_token_layer, slice_config  # noqa: E402

DECODE_BATCHES = (1, 8, 32, 128)
PREFILLS = (1024, 8192)
GRAPH_PREFILL_MAX = 2048  # prompts up to this many tokens also through the extend graphs (the engine's default cap)


def engine_part(cfg, args, res: dict) -> None:
    from deepinfer.tiny import make_tensors
    from v4_slice import SliceRunner

    t0 = time.time()
    raw = make_tensors(cfg, seed=0, device="cuda")
    n = cfg.n_layers
    bytes_b = {b: sum(decode_bytes_per_layer(cfg, raw, l, b, args.context) for l in range(n)) / n for b in args.batches}
    flops_tok = {s: sum(flops_per_token_layer(cfg, raw, l, s // 2) for l in range(n)) / n for s in args.prefills}
    runner = SliceRunner(cfg, raw, max(DECODE_BATCHES), max(max(PREFILLS), args.context + 64))
    del raw
    gc.collect()
    torch.cuda.empty_cache()
    res["engine_build_s"] = time.time() - t0
    res["engine_mem_gb"] = torch.cuda.memory_allocated() / 1e9
    for b in args.batches:
        # the engine's decode path: batched decode step replayed from its CUDA graph (model/decode_step.py)
        full, back_to_back = runner.decode_batched_ms(b, args.context, graphs=True)
        head = runner.head_ms(b)
        per_layer = (full - head) / n
        res[f"decode_b{b}"] = {"step_ms": full, "back_to_back_ms": back_to_back, "head_ms": head,
                               "per_layer_us": per_layer * 1e3,
                               "tok_s": b / full * 1e3, "layer_bytes_mb": bytes_b[b] / 1e6,
                               "hbm_gbs": bytes_b[b] / (per_layer * 1e-3) / 1e9}
        if b <= args.eager_max_batch:  # the mixed-batch (per-sequence) path, for comparison
            res[f"decode_b{b}"]["per_sequence_path_ms"] = runner.decode_ms(b, args.context, reps=5)
        print("decode", b, res[f"decode_b{b}"], flush=True)
    for b in (1, 128):
        if b in args.batches and not args.no_breakdown:
            res[f"decode_b{b}_kernels"] = runner.decode_kernel_breakdown(b, args.context, top=args.top)
    for s in args.prefills:
        full = runner.prefill_ms(s)
        blocks = runner.prefill_ms(s, blocks_only=True)
        per_layer = blocks / n
        res[f"prefill_{s}"] = {"ms": full, "blocks_ms": blocks, "per_layer_ms": per_layer, "tok_s": s / full * 1e3,
                               "tflops": flops_tok[s] * s / (per_layer * 1e-3) / 1e12}
        if s <= GRAPH_PREFILL_MAX:  # the engine's path for it: the piecewise extend graphs (whole forward)
            g = runner.prefill_graphs_ms(s, tuple(sorted({t for t in args.prefills if t <= GRAPH_PREFILL_MAX})))
            res[f"prefill_{s}"].update(graphs_ms=g, graphs_tflops=flops_tok[s] * s * n / (g * 1e-3) / 1e12)
        print("prefill", s, res[f"prefill_{s}"], flush=True)
    if args.prefill_env_sets:  # A/B of switches read at each call, in alternated rounds on this one engine
        sets = env_sets.parse(args.prefill_env_sets)
        own = env_sets.saved(sets)
        try:
            for s in args.prefills:
                rounds = res.setdefault(f"prefill_{s}_env_rounds", [])
                for _ in range(3):
                    for label, env_set in zip(args.prefill_env_sets, sets):
                        env_sets.apply(env_set, sets)
                        rounds.append((label or "defaults", runner.prefill_ms(s, blocks_only=True)))
                        print("prefill", s, "blocks", *rounds[-1], flush=True)
        finally:
            env_sets.restore(own)
    if PREFILLS[-1] in args.prefills and not args.no_breakdown:
        res[f"prefill_{PREFILLS[-1]}_kernels"] = runner.prefill_kernel_breakdown(PREFILLS[-1], top=args.top)
    del runner
    gc.collect()
    torch.cuda.empty_cache()


def hf_part(cfg, args, res: dict) -> None:
    import hf_slice

    model, _ = hf_slice.build(cfg.n_layers, list(cfg.compress_ratios[: cfg.n_layers]))
    for b in args.batches:
        ms = hf_slice.decode_ms(model, cfg.vocab_size, b, args.context)
        res[f"hf_decode_b{b}"] = {"step_ms": ms, "tok_s": b / ms * 1e3}
        print("hf decode", b, ms, flush=True)
    for s in args.prefills:
        ms = hf_slice.prefill_ms(model, cfg.vocab_size, s)
        res[f"hf_prefill_{s}"] = {"ms": ms, "tok_s": s / ms * 1e3}
        print("hf prefill", s, ms, flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def table(res: dict) -> str:
    c = res["ceilings"]
    lines = [f"device {res['device']}: copy {c['copy_gbs']:.0f} GB/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s, "
             f"fp8 {c['fp8_tflops']:.0f} TFLOP/s; {res['layers']} layers, decode context {res['context']}"]
    for b in DECODE_BATCHES:
        d, h = res.get(f"decode_b{b}"), res.get(f"hf_decode_b{b}")
        if d:
            ratio = f", x{d['tok_s'] / h['tok_s']:.1f} transformers" if h else ""
            if h and "back_to_back_ms" in d:
                ratio += f" (back to back x{h['step_ms'] / d['back_to_back_ms']:.1f})"
            lines.append(f"decode b{b:<4} step {d['step_ms']:7.2f} ms  {d['per_layer_us']:8.1f} us/layer  "
                         f"{d['hbm_gbs']:6.0f} GB/s = {100 * d['hbm_gbs'] / c['copy_gbs']:5.1f}% HBM  "
                         f"{d['tok_s']:8.0f} tok/s{ratio}")
    for s in PREFILLS:
        p, h = res.get(f"prefill_{s}"), res.get(f"hf_prefill_{s}")
        if p:
            ratio = f", x{p['tok_s'] / h['tok_s']:.1f} transformers" if h else ""
            lines.append(f"prefill {s:<5} {p['ms']:8.1f} ms  {p['per_layer_ms']:7.2f} ms/layer  {p['tflops']:6.0f} TFLOP/s"
                         f" = {100 * p['tflops'] / c['fp8_tflops']:5.1f}% FP8 peak  {p['tok_s']:8.0f} tok/s{ratio}")
            if "graphs_ms" in p:
                lines.append(f"prefill {s:<5} {p['graphs_ms']:8.1f} ms through the extend graphs (blocks + head): "
                             f"{p['graphs_tflops']:6.0f} TFLOP/s = {100 * p['graphs_tflops'] / c['fp8_tflops']:5.1f}% "
                             f"FP8 peak  {s / p['graphs_ms'] * 1e3:8.0f} tok/s")
    for key in ("decode_b1_kernels", "decode_b128_kernels", f"prefill_{PREFILLS[-1]}_kernels"):
        if key in res:
            what = "one fresh prefill" if key.startswith("prefill") else "one eager batched step"
            lines.append(f"{key} ({what}, all layers + head; us total, launches):")
            lines += [f"  {t:9.0f} us {c:5d}x  {name}" for name, c, t in res[key]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--top", type=int, default=14, help="kernels listed per breakdown")
    ap.add_argument("--eager-max-batch", type=int, default=1, help="also time the per-sequence path up to this batch")
    ap.add_argument("--batches", type=int, nargs="*", default=list(DECODE_BATCHES), help="decode batches to time")
    ap.add_argument("--prefills", type=int, nargs="*", default=list(PREFILLS), help="prefill lengths to time")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiler's per-kernel breakdowns")
    ap.add_argument("--prefill-env-sets", nargs="+", default=None,
                    help='also time the prefills\' blocks under each set ("K=V,K2=V2"; "" = the defaults) in 3 '
                         'alternated rounds on the same engine (switches read at each call)')
    args = ap.parse_args()
    from deepinfer.kernels.triton import register_cuda_kernels

    register_cuda_kernels()
    cfg = slice_config(args.layers)
    res = {"device": torch.cuda.get_device_name(), "layers": args.layers, "context": args.context,
           "ceilings": ceilings.measure(), "command": " ".join(sys.argv)}
    print(res["ceilings"], flush=True)
    if not args.no_engine:
        engine_part(cfg, args, res)
    if not args.no_hf:
        hf_part(cfg, args, res)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "slice.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))


if __name__ == "__main__":
    main()
