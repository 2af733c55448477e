"""The host's cost of one launch on this machine, by kind, and of the pieces of a one-sequence prefill.

An eager prefill issues a few hundred launches; when their host cost passes the kernels' device time the
step is host-bound (prefill_host.py says whether it is). This says what one launch costs the host by kind:
`torch.empty`, a small torch op, a Triton kernel through its JIT launcher (op `rms_norm_bf16` on one row),
a CUDA-runtime kernel through `runtime.CudaKernel` (op `fp8_linear` on one row, the mma.sync kernel), and
the registry lookup `kernels.get`. Each: median over 5 rounds of 2000 calls, host clock, no synchronisation
inside a round (the queue never fills: the kernels are ~2 us).
Then, with --prefill T, the host time of one `T`-token prefill split by the model's pieces (perf_counter
wrappers around the attention, MoE, hc pre/post and the head; nothing synchronises).

    PYTHONPATH=$PWD python benchmarks/launch_overhead.py [--prefill 1024] [--layers 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import host_timed  # noqa: E402


def per_call_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def launch_table() -> None:
    from deepinfer import kernels
    from deepinfer.kernels.triton import register_cuda_kernels

    register_cuda_kernels()
    dev = "cuda"
    x = torch.randn(1, 4096, device=dev).to(torch.bfloat16)
    w = torch.randn(4096, device=dev).to(torch.bfloat16)
    small = torch.zeros(64, device=dev)
    rms = kernels.get("rms_norm_bf16", dev)
    rows = [
        ("torch.empty([1024, 4096] bf16)", lambda: torch.empty((1024, 4096), dtype=torch.bfloat16, device=dev)),
        ("small torch op (add_ on 64 floats)", lambda: small.add_(1.0)),
        ("kernels.get(name, 'cuda')", lambda: kernels.get("rms_norm_bf16", dev)),
        ("Triton kernel via JIT (rms_norm_bf16, 1 row)", lambda: rms(x, w, 1e-6)),
    ]
    from deepinfer.kernels.quant_weights import QuantLinearWeight

    lin = kernels.get("fp8_linear", dev)
    qw = QuantLinearWeight((torch.randn(4096, 4096, device=dev) / 8).to(torch.float8_e4m3fn),
                           torch.ones(32, 32, device=dev), 128, 128)
    rows.append(("fp8_linear op (1 row: the decode kernel + its split sum)", lambda: lin(x, qw)))
    from deepinfer.kernels.triton import launch

    for name, fn in rows:
        launch.ENABLED = False
        jit = per_call_us(fn)
        launch.ENABLED = True
        print(f"{per_call_us(fn):8.2f} us  {name}  (Triton's JIT dispatch: {jit:.2f} us)", flush=True)


@torch.no_grad()
def prefill_pieces(layers: int, tokens: int) -> None:
    from slice_config import slice_config
    from v4_slice import SliceRunner

    from deepinfer.model.context import ForwardContext, SeqContext
    from deepinfer.tiny import make_tensors

    cfg = slice_config(layers)
    runner = SliceRunner(cfg, make_tensors(cfg, seed=0, device="cuda"), 1, tokens)
    torch.cuda.empty_cache()
    model = runner.model
    times: dict[str, float] = {}

    def timer(fn, key: str):
        def add(ms: float) -> None:
            times[key] = times.get(key, 0.0) + ms

        return host_timed(fn, add)

    from deepinfer import kernels
    for b in model.layers:
        b.attn = timer(b.attn, "attention (all of it)")
        b.ffn = timer(b.ffn, "moe (all of it)")
    for op in ("hc_pre_fused", "hc_post_fused"):
        kernels.register(op, timer(kernels.get(op, "cuda"), f"{op} (each side of a sublayer)"), "cuda")
    model.logits = timer(model.logits, "head (logits)")
    ctx = ForwardContext((SeqContext(0, tokens, 0, 0, runner._table(0)),))
    ids = runner._ids(tokens)
    model.forward(ids, ctx)
    torch.cuda.synchronize()
    from deepinfer.kernels.triton import launch

    for fast in (False, True):
        launch.ENABLED = fast
        model.forward(ids, ctx)
        torch.cuda.synchronize()
        _pieces_table(model, ids, ctx, tokens, layers, times, "fast launch" if fast else "Triton's JIT dispatch")


def _pieces_table(model, ids, ctx, tokens, layers, times, label) -> None:
    rounds = []
    for _ in range(5):
        times.clear()
        t0 = time.perf_counter()
        model.forward(ids, ctx)
        total = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        rounds.append((total, dict(times)))
    total, pieces = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
    print(f"prefill {tokens} x {layers} layers, {label}: host {total:.2f} ms (the median round), of which:")
    for k, v in sorted(pieces.items(), key=lambda kv: -kv[1]):
        print(f"    {v:8.2f} ms  {k}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    launch_table()
    if args.prefill:
        prefill_pieces(args.layers, args.prefill)


if __name__ == "__main__":
    main()
