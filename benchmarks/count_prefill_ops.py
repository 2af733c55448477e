"""Count the torch function calls and host syncs of fast-numerics prefill/extend steps on the tiny V4
checkpoint (CPU torch twins), grouped by the engine code they come from, and time the steps.

    PYTHONPATH=$PWD python benchmarks/count_prefill_ops.py [--tokens 512] [--chunk 128] [--seqs 1] [--top 25]
                                                         [--per-sequence] [--family v41]

Calls inside an op that is one kernel on cuda (kernels.triton's modules, kv_pack, the cuBLAS bf16 GEMMs)
count once, so the totals approximate the cuda launches of the step.
A "sync" is any call that needs a device value on the host (`.item()`, `.tolist()`, `bool()`/`int()` of a
tensor, `nonzero`, one-argument `where`, `unique`, `masked_select`, ...): on cuda each waits for the stream.
On this CPU run the host-side metadata's own reads show up too (check_batch's int() of the host token ids):
judge each listed line by whether its tensor lives on the device.
Must not: change the model; it only observes (TorchFunctionMode) and times.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

SYNC_NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "unique",
              "masked_select", "repeat_interleave", "bincount", "cpu", "numpy", "equal", "allclose"}


def _is_sync(func, args) -> bool:
    name = getattr(func, "__name__", str(func))
    if name in SYNC_NAMES:
        return name != "repeat_interleave" or not isinstance(args[1] if len(args) > 1 else None, int)
    if name == "where" and len(args) == 1:
        return True
    if name == "to" and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        return any(a == "cpu" or a == torch.device("cpu") for a in args[1:])  # a device-to-host copy
    return False


def cuda_kernel_ops() -> set[str]:
    """Ops that are one kernel on cuda (kernels.triton's REGISTRATIONS, kv_pack, the cuBLAS bf16 GEMMs): their
    CPU twins' inner calls count as ONE call, so the totals approximate the cuda launches. Needs triton
    importable (the kernels are not run)."""
    import importlib

    from deepinfer.kernels.triton import KERNEL_MODULES

    names = {"grouped_proj_bf16", "linear_f32", "blinear"}
    for m in set(KERNEL_MODULES) | {"kv_pack"}:
        names |= set(importlib.import_module(f"deepinfer.kernels.triton.{m}").REGISTRATIONS)
    return names


def codec_is_one_kernel(op_name: str, layout) -> bool:
    """Whether a cache-codec op (kv_pack's registrations; `layout` None: not a codec op) is one Triton kernel
    on cuda: the FP8 codec and the FP4 index-key codec both ways, V4.1's E4M3-scaled FP4 latents only decoded
    (their encode is the layout's torch codec). Shared with count_decode_ops.py."""
    codec = getattr(layout, "codec", None)
    return layout is None or codec in ("fp8_e8m0", "fp4_e8m0") or (codec == "fp4_e4m3" and op_name == "kv_decode")


def cuda_launches(name: str, f_locals: dict) -> int:
    """Kernels a fused op's cuda wrapper launches in all: rope32 without a precomputed table builds its
    cos/sin table first (positions to fp32, outer, cos, sin: 4 + the kernel); rope_table32 is those 4."""
    if name == "rope32":
        return 1 if f_locals.get("table") is not None else 5
    if name == "rope_table32":
        return 4
    return 1


_NOT_CALLS = {"__get__", "__set__", "shape", "dtype", "device", "size", "dim", "stride", "is_cuda"}  # no kernel


class CallCounter(TorchFunctionMode):
    """Every torch function call attributed to its innermost deepinfer frame (file:function:line); a call
    inside a cuda-fused op's twin counts once per op call, attributed to the op's caller."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_ops = cuda_kernel_ops()
        self._last_fused = None
        self.by_function: collections.Counter = collections.Counter()
        self.by_line: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.total = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in _NOT_CALLS:  # before the fused-op bookkeeping: a twin whose first torch call reads
            return func(*args, **(kwargs or {}))  # .shape would otherwise count as no launch at all
        f = sys._getframe(1)
        fused = outer = None
        g = f
        while g is not None:  # the outermost fused-op frame, if any
            if "/deepinfer/kernels/" in g.f_code.co_filename and \
                    g.f_code.co_name.removesuffix("_torch").removesuffix("_cublas") in self.fused_ops:
                if codec_is_one_kernel(g.f_code.co_name, g.f_locals.get("layout")):
                    fused = g
            if "/deepinfer/kernels/" in g.f_code.co_filename:
                outer = g
            g = g.f_back
        if fused is not None and fused is not outer:  # called by an op that is NOT one kernel (head_rms_norm
            fused = None  # runs torch_ops.rms_norm's ops on cuda): its ops are launches of their own
        n = 1
        if fused is not None:
            if fused is self._last_fused:
                return func(*args, **(kwargs or {}))
            self._last_fused = fused
            n = cuda_launches(fused.f_code.co_name, fused.f_locals)
            f = fused.f_back
        where = "?"
        while f is not None:
            path = f.f_code.co_filename
            if "/deepinfer/" in path and "/benchmarks/" not in path:
                rel = path.split("/deepinfer/", 1)[1]
                where = f"{rel}:{f.f_code.co_name}"
                line = f"{where}:{f.f_lineno}"
                break
            f = f.f_back
        else:
            line = where
        self.total += n
        self.by_function[where] += n
        self.by_line[line] += n
        if fused is None and _is_sync(func, args):
            self.syncs[f"{line} {name}"] += 1
        return func(*args, **(kwargs or {}))


def _model(n_seqs: int, tokens: int):
    from deepinfer.config import ModelConfig
    from deepinfer.model.factory import build_v4_model
    from deepinfer.tiny import default_model_dir
    from deepinfer.weights import load_tensors

    path = default_model_dir("v4")
    cfg = ModelConfig.from_checkpoint(path)
    raw = load_tensors(path, cfg, progress=False)
    blocks = -(-(tokens + 1) // 128)
    # one slot and one block more than the sequences use: the batched decode path's scratch (--split)
    model = build_v4_model(cfg, raw, "fast", "cpu", num_blocks=blocks * n_seqs + 1, max_num_seqs=n_seqs + 1)
    return cfg, model, blocks


def _report(counter, what: str, dt: float, top: int) -> None:
    print(f"{what}: {counter.total} torch calls, {sum(counter.syncs.values())} syncs, {dt * 1e3:.0f} ms (with counting)")
    print("\n-- by function --")
    for k, v in counter.by_function.most_common(top):
        print(f"{v:7d}  {k}")
    print("\n-- syncs --")
    for k, v in sorted(counter.syncs.items()):
        print(f"{v:7d}  {k}")


def mixed_step(args) -> None:
    """One step of `args.mixed` decoding sequences and one fresh prefill of `args.tokens` (the extend path:
    a step with any prefill in it is not a pure-decode step)."""
    from deepinfer.model import ForwardContext, SeqContext

    torch.set_num_threads(1)
    n = args.mixed + 1
    cfg, model, blocks = _model(n, args.tokens)
    table = lambda i: tuple(range(i * blocks, (i + 1) * blocks))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (n, args.tokens + 1), generator=g)
    ctx = ForwardContext(tuple(SeqContext(0, args.tokens, i, i, table(i)) for i in range(args.mixed)))
    model(ids[: args.mixed, : args.tokens].flatten(), ctx)  # the decoding sequences' prompts (not counted)
    seqs = [SeqContext(args.tokens, 1, i, i, table(i)) for i in range(args.mixed)]
    step_ids = ids[: args.mixed, args.tokens]
    if not args.no_prefill:
        seqs.append(SeqContext(0, args.tokens, args.mixed, args.mixed, table(args.mixed)))
        step_ids = torch.cat([step_ids, ids[args.mixed, : args.tokens]])
    forward = model
    if args.split:  # the engine's way since 2026-12-04: decode rows through the batched decode path
        from deepinfer.model.decode_step import DecodeRunner
        from deepinfer.model.mixed_step import forward_split

        runner = DecodeRunner(model, n, args.tokens + 64, scratch_slot=n, scratch_block=blocks * n)
        forward = lambda i, c: forward_split(model, runner, i, c)  # noqa: E731
        if args.no_prefill:  # a pure-decode step: the runner itself, as ModelRunner.forward_batch calls it
            forward = lambda i, c: runner(i, c.seqs)  # noqa: E731
    counter = CallCounter()
    t0 = time.perf_counter()
    with counter:
        forward(step_ids, ForwardContext(tuple(seqs)))
    what = "one pure-decode step" if args.no_prefill else "one mixed step"
    path = (" (batched decode path)" if args.no_prefill else " (split)") if args.split else ""
    rest = "" if args.no_prefill else f" + one {args.tokens}-token prefill"
    _report(counter, f"{what}{path}: {args.mixed} decoding{rest}", time.perf_counter() - t0, args.top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: one step)")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--per-sequence", action="store_true", help="the per-sequence attention path (reference)")
    ap.add_argument("--family", choices=("v4", "v41"), default="v4",
                    help="the tiny checkpoint's family (v41: its general varlen path, which its prefills take)")
    ap.add_argument("--mixed", type=int, default=0,
                    help="count one mixed step instead: this many sequences decoding one token each (prefilled "
                         "with --tokens first, not counted) beside one fresh --tokens prefill (continuous batching)")
    ap.add_argument("--split", action="store_true", help="with --mixed: the decode rows through the batched "
                                                         "decode path (model/mixed_step.py), as the engine runs it")
    ap.add_argument("--no-prefill", action="store_true",
                    help="with --mixed: a pure-decode step (without --split: the general varlen path, which a "
                         "parallel group took before 2026-12-05; with it: the batched decode path)")
    args = ap.parse_args()
    if args.mixed:
        if args.family != "v4":
            raise SystemExit("--mixed counts V4's split mixed step only")
        return mixed_step(args)
    torch.set_num_threads(1)
    from deepinfer.model.attention import V4Attention

    V4Attention.batched_extend = not args.per_sequence
    from deepinfer.config import ModelConfig
    from deepinfer.model import ForwardContext, SeqContext
    from deepinfer.model.factory import build_v4_model
    from deepinfer.tiny import default_model_dir
    from deepinfer.weights import load_tensors

    path = default_model_dir(args.family)
    cfg = ModelConfig.from_checkpoint(path)
    raw = load_tensors(path, cfg, progress=False)
    blocks = -(-args.tokens // 128)

    def build():
        if args.family == "v41":
            from deepinfer.model.v41 import build_v41_model
            from deepinfer.tokenizer import Tokenizer

            return build_v41_model(cfg, raw, Tokenizer.from_checkpoint(path), "fast", "cpu",
                                   num_blocks=blocks * args.seqs, max_num_seqs=args.seqs)
        return build_v4_model(cfg, raw, "fast", "cpu", num_blocks=blocks * args.seqs, max_num_seqs=args.seqs)

    model = build()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (args.seqs, args.tokens), generator=g)
    chunk = args.chunk or args.tokens
    counter = CallCounter()
    t0 = time.perf_counter()
    with counter:
        for start in range(0, args.tokens, chunk):
            n = min(chunk, args.tokens - start)
            ctx = ForwardContext(tuple(SeqContext(start, n, i, i, tuple(range(i * blocks, (i + 1) * blocks)))
                                       for i in range(args.seqs)))
            model(ids[:, start : start + n].flatten(), ctx)
    dt = time.perf_counter() - t0
    print(f"{args.seqs} x {args.tokens} tokens in chunks of {chunk}: {counter.total} torch calls, "
          f"{sum(counter.syncs.values())} syncs, {dt * 1e3:.0f} ms (with counting)")
    print("\n-- by function --")
    for k, v in counter.by_function.most_common(args.top):
        print(f"{v:7d}  {k}")
    print("\n-- by line --")
    for k, v in counter.by_line.most_common(args.top):
        print(f"{v:7d}  {k}")
    print("\n-- syncs --")
    for k, v in sorted(counter.syncs.items()):
        print(f"{v:7d}  {k}")
    t0 = time.perf_counter()
    model2 = build()
    t0 = time.perf_counter()
    for start in range(0, args.tokens, chunk):
        n = min(chunk, args.tokens - start)
        ctx = ForwardContext(tuple(SeqContext(start, n, i, i, tuple(range(i * blocks, (i + 1) * blocks)))
                                   for i in range(args.seqs)))
        model2(ids[:, start : start + n].flatten(), ctx)
    print(f"\nuncounted: {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
