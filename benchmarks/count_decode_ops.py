"""Count the torch ops (= kernel launches on cuda) of one batched decode step of the fast engine, grouped by
the decode-path code they come from. Runs the tiny V4 checkpoint's DecodeRunner eager path on the CPU
(torch twins); ops that are one Triton kernel on cuda (`fp8_linear`, `fp4_moe`, `hc_pre_fused`, ...) are
counted as ONE launch each, so the totals approximate the cuda step's kernel count.

    PYTHONPATH=$PWD python benchmarks/count_decode_ops.py [--batch 4] [--pos 130] [--family v41]

Must not: change the model; it only observes one step with torch.profiler (with_stack).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from count_prefill_ops import codec_is_one_kernel  # noqa: E402

# ops that launch no kernel on cuda (views and allocations)
NO_KERNEL = {"empty", "empty_strided", "detach", "lift_fresh", "_local_scalar_dense", "alias", "_to_copy_noop",
             "set_", "resolve_conj", "resolve_neg", "is_nonzero", "item", "sym_size", "sym_stride", "dim"}


def cuda_kernel_ops(extra: tuple[str, ...] = ()) -> set[str]:
    """Op names registered for cuda by kernels.triton (plus the cuBLAS bf16 GEMMs): each is one (or a few)
    kernels on cuda, so one call counts as one launch and its torch twin's inner ops are skipped. Needs
    triton importable (it is on the dev machines; the kernels are not run)."""
    import importlib

    from deepinfer.kernels.triton import KERNEL_MODULES

    names = {"grouped_proj_bf16", "linear_f32", "blinear"}
    for m in KERNEL_MODULES + tuple(extra):
        names |= set(importlib.import_module(f"deepinfer.kernels.triton.{m}").REGISTRATIONS)
    return names


# kernels a fused op's cuda wrapper launches beyond its one kernel, from the twin frame's locals: rope32
# without a precomputed table builds its cos/sin table first (one kernel since 2026-12-02's fourth session,
# 4 torch ops before)
def cuda_launches(name: str, f_locals: dict) -> int:
    if name == "rope32":
        return 1 if f_locals.get("table") is not None else 2
    if name == "decode_rows":  # one launch per ratio (the window rows ride on the first)
        return max(1, len(f_locals.get("ratios") or ()))
    return 1


GROUPS = [  # (group, regex on the innermost model frame "file:function"); first match wins
    ("metadata (derive)", r"decode_metadata\.py:derive"),
    ("RoPE (tables + rotations)", r"decode_attention\.py:(rope|build_rope_table):"),
    ("entry selection (shared per step)", r"decode_attention\.py:build_ascending:"),
    ("KV codec (cache encode/decode)", r"(decode_attention|cache)\.py:(_store|_encode|_decode|encode|decode):"),
    ("attention q/kv norms", r"decode_attention\.py:rms:"),
    ("compressor", r"decode_attention\.py:(_compress_step|compress_decode)"),
    ("indexer (weights, query, scores, top-k, rows)", r"decode_attention\.py:(indexer_weights|indexer_query|indexer_rows):"),
    ("head", r"v4\.py:logits"),
    ("MoE gate", r"moe\.py:route"),
    ("shared expert", r"moe\.py:_swiglu_official"),
    ("MoE routed + sum", r"moe\.py:_forward_fast"),
    ("hc pre/post", r"v4\.py:_hc"),
    ("embedding", r"decode_step\.py:decode_hidden"),
]


class _OpCounter(TorchDispatchMode):
    """Counts every dispatched aten op that launches a kernel, attributed to its decode-path source line."""

    def __init__(self, line_of: dict[int, str], extra: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.line_of = line_of
        self.fused_ops = cuda_kernel_ops(extra)
        self.groups: collections.Counter = collections.Counter()
        self.lines: collections.Counter = collections.Counter()
        self.layers: collections.Counter = collections.Counter()
        self._last_fused = None  # the frame object of the fused-op call already counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return out
        model_frame, fused, outer, layer = None, None, None, "outside the blocks (prepare, head)"
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_name == "decode_hidden":  # the block loop: which layer this op belongs to
                block = f.f_locals.get("block")
                layer = (f"layer {block.attn.layer} (ratio {block.attn.ratio})" if block is not None
                         else "step start (metadata derive, embedding)")
                break
            if model_frame is not None:
                f = f.f_back
                continue
            path = f.f_code.co_filename
            if "deepinfer/kernels/" in path:
                if f.f_code.co_name.removesuffix("_torch") in self.fused_ops:
                    if codec_is_one_kernel(f.f_code.co_name, f.f_locals.get("layout")):
                        fused = f  # keep the outermost fused call
                outer = f
            elif "deepinfer/model/" in path:
                model_frame = f"{os.path.basename(path)}:{f.f_code.co_name}:{f.f_lineno}"
            f = f.f_back
        if fused is not None and fused is not outer:  # inside a twin that is NOT one kernel on cuda
            fused = None  # (head_rms_norm runs torch_ops.rms_norm's torch ops there): each op is a launch
        model_frame = model_frame or "?"
        if model_frame.startswith("decode_metadata.py:fill:") and name != "copy_" or (
                model_frame.startswith("decode_step.py:prepare:") and name in ("min", "max")):
            return out  # host-side work on the pinned buffer / host ids: no kernel on cuda
        n = 1
        if fused is not None:
            if fused is self._last_fused:
                return out
            self._last_fused = fused
            name = fused.f_code.co_name
            n = cuda_launches(name.removesuffix("_torch"), fused.f_locals)
        g = next((gname for gname, rx in GROUPS if re.search(rx, model_frame)), None)
        if g is None:
            if model_frame.startswith(("v41_decode.py:", "v41.py:", "v41_moe.py:", "engram.py:")):
                g = model_frame.rsplit(":", 1)[0]  # V4.1: by function
            elif "decode_attention.py:decode_attention" in model_frame:
                g = self.line_of.get(int(model_frame.rsplit(":", 1)[1]), "attention (other)")
            else:
                g = model_frame
        self.groups[g] += n
        self.layers[layer] += n
        self.lines[(model_frame, name)] += n
        return out


def attention_lines() -> dict[int, str]:
    """decode_attention.py line -> sub-group, by the source text of that line."""
    import inspect

    from deepinfer.model import decode_attention as da

    src, start = inspect.getsourcelines(da)
    out = {}
    for i, text in enumerate(src, start=start):
        if "idx" in text or "index" in text or "stable_topk" in text or "sel" in text:
            g = "indexer + selection"
        elif any(w in text for w in ("q_norm", "wq_b", "head_rms_norm")):
            g = "attention q path"
        elif "ring" in text or "pools" in text or "comp[chosen]" in text:
            g = "window/entry gathers"
        elif "wkv" in text:
            g = "attention kv path"
        elif "sparse_attn" in text or "inverse=True" in text or "wo_a" in text or "wo_b" in text:
            g = "attention out (sparse attn, wo)"
        else:
            g = "attention (other)"
        out[i] = g
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pos", type=int, default=130, help="prompt length before the profiled step")
    ap.add_argument("--top", type=int, default=0, help="also print the N most frequent source lines")
    ap.add_argument("--with", dest="extra", default="", help="Triton modules not yet in KERNEL_MODULES to count "
                    "as registered, comma-separated (e.g. fp4_quant)")
    ap.add_argument("--family", choices=("v4", "v41"), default="v4", help="the tiny checkpoint's family")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from deepinfer.config import ModelConfig
    from deepinfer.model import ForwardContext, SeqContext, V4EngineModel
    from deepinfer.model.decode_step import DecodeRunner
    from deepinfer.model.factory import v4_cache, v4_params
    from deepinfer.tiny import default_model_dir
    from deepinfer.weights import load_tensors

    d = default_model_dir(args.family, seed=0)
    cfg = ModelConfig.from_checkpoint(d)
    B, bps = args.batch, 4
    slots = B + 1
    if args.family == "v41":  # model/v41_decode.py's layers
        from deepinfer.model.v41 import build_v41_model
        from deepinfer.tokenizer import Tokenizer

        model = build_v41_model(cfg, load_tensors(d, cfg, progress=False), Tokenizer.from_checkpoint(d), "fast", "cpu",
                                num_blocks=bps * slots, max_num_seqs=slots)
    else:
        params = v4_params(load_tensors(d, cfg, progress=False), cfg, "fast", "cpu")
        model = V4EngineModel(cfg, params, v4_cache(cfg, "fast", bps * slots, 128, slots, "cpu"), "fast")
    tab = [tuple(range(bps * i, bps * (i + 1))) for i in range(B)]
    prompt = torch.randint(2, cfg.vocab_size, (B * args.pos,), generator=torch.Generator().manual_seed(0))
    model(prompt, ForwardContext(tuple(SeqContext(0, args.pos, i, i, tab[i]) for i in range(B))))
    runner = DecodeRunner(model, B, bps * 128, B, bps * B, cuda_graphs=False)
    seqs = [SeqContext(args.pos, 1, i, i, tab[i]) for i in range(B)]
    ids = torch.ones(B, dtype=torch.long)
    runner(ids, seqs)  # warm
    counter = _OpCounter(attention_lines(), tuple(m for m in args.extra.split(",") if m))
    with counter:
        runner(ids, seqs)
    groups, lines = counter.groups, counter.lines
    n_layers = cfg.n_layers
    total = sum(groups.values())
    print(f"tiny {args.family} ({n_layers} layers, ratios {cfg.compress_ratios[:n_layers]}), batch {B}, position "
          f"{args.pos}")
    print(f"{'group':36s} {'launches/step':>14s}")
    for g, n in groups.most_common():
        print(f"{g:36s} {n:14d}")
    print(f"{'TOTAL':36s} {total:14d}   ({total / n_layers:.0f} per layer incl. head)")
    for name, n in sorted(counter.layers.items()):
        print(f"  {name:34s} {n:14d}")
    if args.top:
        for (frame, name), n in lines.most_common(args.top):
            print(f"{n:5d}  {frame:45s} {name}")


if __name__ == "__main__":
    main()
