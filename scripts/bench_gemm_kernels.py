"""Time the Triton fp8_linear and fp4_moe ops on a CUDA device (median of triton.testing.do_bench, events).

fp8_linear: N=K=4096 at M = 1, 128, 4096 for V4 (128x128 blocks) and V4.1 (32x32); cuBLAS bf16 beside it.
fp4_moe: V4-Flash dims (D=4096, I=2048, E=256, k=6) at T = 1, 128, 8192, uniform random routing.
Reports ms, GB/s over the bytes that must move (weights touched once + activations) and TFLOP/s.
(needs CUDA and triton)

Measured on one H200, 2026-11-29 (commit 190d767; eager / CUDA-graph replay, median):
  fp8_linear 4096x4096  M=1: 21.5 / 21.6 us (781 GB/s; cuBLAS bf16 19.1 us moving twice the bytes)
                        M=128: 96 / 60 us;  M=4096: 408 us = 337 TFLOP/s (cuBLAS bf16 189 us)
                        (V4.1 32x32 blocks: M=1 50.6 eager / 21.9 graph us, M=4096 406 us)
  fp4_moe (E=256 k=6 D=4096 I=2048)  T=1: 807 / 225 us (routing alone 405 us eager: host-bound torch ops)
                        T=128: 5.2 ms (624 GB/s over the 244 experts' bytes);  T=8192: 20.1 ms = 123 TFLOP/s
The GEMMs are bound by the in-register FP4/FP8 -> bf16 expansion (integer ops per element), not by bytes.
Again 2026-11-29, issue 7 (H8; one run, eager numbers are host-noisy, graph replay is device time):
  wo_a grouped 8x1024x4096 T=1: bf16 einsum 27.6 us (2.4 TB/s) vs fp32 upcast per call 160 us (T=128: 31 vs 357)
  head 129280x4096 N=1: bf16 weight, fp32 out 251 us (4.2 TB/s = the copy ceiling) vs fp32 head 516 us
                        (N=128: 291 us vs 2.8 ms)
  fp8_linear M=1: 21.2 us (794 GB/s), M=4096 406 us = 338 TFLOP/s (unchanged kernel; an fp16-codes variant
                        with per-chunk scaling measured 22.2 / 543 us and was dropped)
  fp4_moe T=1 graph: expand 0 (before) 168 us, expand 1 (fp16 trick, default) 114 us, expand 2 (dot_scaled)
                        143 us; routing alone 18.8 us (one Triton program) vs 223-405 us of torch ops
          T=128: 3.03 ms (1081 GB/s; expand 2 4.13 ms);  T=8192: 16.2 ms = 153 TFLOP/s (expand 2 19.2 ms)
Usage: python scripts/bench_gemm_kernels.py [--tiles | --decode-fp8 | --batch-fp8 | --batch-swap | --swap-wide |
                                              --batch-wgmma | --linear-f32]   (--tiles: decode tile sweep
with rel_err vs the twins; --decode-fp8: fp8_linear plans on the V4-Flash decode shapes; --linear-f32: the bf16
weight GEMMs alone)
"""
from __future__ import annotations

import sys

import torch
import triton

from deepinfer import formats
from deepinfer.kernels.quant_weights import FP4ExpertBank, QuantLinearWeight, fp4_moe_torch, fp8_linear_torch
from deepinfer.kernels.triton.fp4_moe import (SMALL_ROUTING_SLOTS, align_by_expert,
                                             align_by_expert_small, fp4_moe)
from deepinfer.kernels.triton.fp8_gemm import fp8_linear

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import graph_replay_ms  # noqa: E402


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _graph_ms(fn) -> float:
    """Median time of replaying `fn` captured in a CUDA graph (no Python launch overhead); nan if capture fails."""
    return graph_replay_ms(fn, warmup_ms=10, rep_ms=40)


def _row(rows: list[str], label: str, fn) -> None:
    """Append fn()'s row, or the error: one failing variant must not hide the others."""
    try:
        rows.append(fn())
    except Exception as err:
        rows.append(f"{label} FAILED: {type(err).__name__}: {str(err)[:300]}")


# (T, expand, tiles): expand 0 (the previous kernel) and 2 at decode only, for the side-by-side
FP4_CASES = [(1, 0, None), (1, 1, None), (1, 2, None), (128, 1, None), (8192, 1, None)]

FP8_CASES = [(128, 1), (128, 128), (128, 4096), (32, 1), (32, 4096)]  # (weight block, M)


def _fp8_weight(n: int, k: int, block: int) -> QuantLinearWeight:
    wq, ws = formats.quant_fp8_blocks(torch.randn(n, k, device="cuda"), block)
    return QuantLinearWeight(wq, formats.e8m0_to_float(ws), block, block)


def bench_fp8_linear(rows: list[str]) -> None:
    n = k = 4096
    weights = {block: _fp8_weight(n, k, block) for block in (128, 32)}
    wb = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    for block, m in FP8_CASES:
        w = weights[block]
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)

        def row():
            t = _ms(lambda: fp8_linear(x, w))
            tg = _graph_ms(lambda: fp8_linear(x, w)) if m == 1 else float("nan")
            tb = _ms(lambda: x @ wb.T)
            bytes_moved = n * k + m * k * 2 + m * n * 2
            flops = 2 * m * n * k
            return (f"fp8_linear block={block:3d} M={m:5d} N=K=4096 | {t * 1e3:8.1f} us | "
                    f"{bytes_moved / t / 1e6:7.0f} GB/s | {flops / t / 1e9:6.1f} TFLOP/s | graph {tg * 1e3:6.1f} us"
                    f" | cuBLAS bf16 {tb * 1e3:7.1f} us")
        _row(rows, f"fp8_linear block={block} M={m}", row)


def _fp4_bank(e: int, d: int, i: int) -> FP4ExpertBank:
    def scales(*shape):
        return torch.randint(119, 129, shape, dtype=torch.uint8, device="cuda")

    return FP4ExpertBank(torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, device="cuda"), scales(e, 2 * i, d // 32),
                         torch.randint(0, 256, (e, d, i // 2), dtype=torch.uint8, device="cuda"), scales(e, d, i // 32), 128)


def bench_fp4_moe(rows: list[str]) -> None:
    e, d, i, k = 256, 4096, 2048, 6
    bank = _fp4_bank(e, d, i)
    per_expert_bytes = (2 * i * d + d * i) // 2 + (2 * i * d + d * i) // 32
    inputs = {}
    for t in sorted({case[0] for case in FP4_CASES}):
        ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
        inputs[t] = (torch.randn(t, d, device="cuda").to(torch.bfloat16), ids, torch.rand(t, k, device="cuda"))
    for t, expand, cfg in FP4_CASES:
        x, ids, w = inputs[t]

        def row():
            touched = int(torch.unique(ids).numel())
            bytes_moved = touched * per_expert_bytes + t * d * 2 + t * d * 4
            flops = 2 * t * k * 3 * d * i
            ms = _ms(lambda: fp4_moe(x, ids, w, bank, 10.0, expand=expand, config=cfg))
            graph_ms = _graph_ms(lambda: fp4_moe(x, ids, w, bank, 10.0, expand=expand, config=cfg)) if t == 1 \
                else float("nan")
            route = align_by_expert_small if t * k <= SMALL_ROUTING_SLOTS else align_by_expert
            route_ms = _ms(lambda: route(ids, e, 16 if t < 64 else 128)) if expand == 1 and cfg is None \
                else float("nan")
            tiles = "default tiles" if cfg is None else f"BN={cfg['BN']} st={cfg['num_stages']}"
            return (f"fp4_moe expand={expand} T={t:5d} ({touched} experts, {tiles}) | {ms * 1e3:8.1f} us | "
                    f"{bytes_moved / ms / 1e6:7.0f} GB/s | {flops / ms / 1e9:6.1f} TFLOP/s | "
                    f"CUDA graph {graph_ms * 1e3:8.1f} us | routing alone {route_ms * 1e3:6.1f} us")
        _row(rows, f"fp4_moe expand={expand} T={t} {cfg}", row)


def bench_bf16_weights(rows: list[str]) -> None:
    """The fast path's bf16-weight GEMMs against the per-call fp32 upcasts they replace (V4-Flash dims)."""
    from deepinfer.kernels.bf16_gemm import grouped_proj_bf16_cublas, linear_f32_cublas

    wo_a = (torch.randn(8, 1024, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    head = (torch.randn(129280, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    head32 = head.float()
    for t in (1, 128):
        o = torch.randn(t, 8, 4096, device="cuda").to(torch.bfloat16)
        y = torch.randn(t, 4096, device="cuda").to(torch.bfloat16)
        new, old = _ms(lambda: grouped_proj_bf16_cublas(o, wo_a)), _ms(
            lambda: torch.einsum("tgd,grd->tgr", o.float(), wo_a.float()).to(torch.bfloat16))
        rows.append(f"wo_a grouped T={t:4d} | bf16 einsum {new * 1e3:7.1f} us ({wo_a.numel() * 2 / new / 1e6:5.0f} GB/s)"
                    f" | fp32 upcast per call {old * 1e3:7.1f} us")
        new, old = _ms(lambda: linear_f32_cublas(y, head)), _ms(lambda: y.float() @ head32.T)
        rows.append(f"head 129280x4096 N={t:4d} | bf16 w, fp32 out {new * 1e3:7.1f} us "
                    f"({head.numel() * 2 / new / 1e6:5.0f} GB/s) | fp32 head {old * 1e3:7.1f} us")
    # the compressor projections (attention wkv/wgate [1024, 4096] on ratio-4 layers) and the MoE gate
    for name, n in (("compressor wkv 1024x4096", 1024), ("moe gate 256x4096", 256)):
        w = (torch.randn(n, 4096, device="cuda") * 0.02).to(torch.bfloat16)
        w32 = w.float()
        for t in (1, 128, 8192):
            y = torch.randn(t, 4096, device="cuda").to(torch.bfloat16)
            new, old = _ms(lambda: linear_f32_cublas(y, w)), _ms(lambda: y.float() @ w32.T)
            flops = 2 * t * n * 4096
            rows.append(f"{name} N={t:4d} | bf16 w, fp32 out {new * 1e3:7.1f} us ({flops / new / 1e9:6.1f} TFLOP/s)"
                        f" | fp32 {old * 1e3:7.1f} us ({flops / old / 1e9:6.1f} TFLOP/s)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def sweep_decode_tiles(rows: list[str]) -> None:
    """Decode (batch 1) tile candidates: CUDA-graph replay time and rel_err against the torch twin."""
    w = _fp8_weight(4096, 4096, 128)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    want = fp8_linear_torch(x, w)
    for bn, warps, stages in ((32, 4, 6), (16, 4, 6), (16, 2, 8), (32, 4, 10), (64, 4, 6), (64, 8, 8)):
        cfg = dict(BM=16, BN=bn, GROUP_M=1, num_warps=warps, num_stages=stages)

        def row():
            rel = _rel(fp8_linear(x, w, config=cfg), want)
            tg = _graph_ms(lambda: fp8_linear(x, w, config=cfg))
            return f"tiles fp8_linear M=1 BN={bn} warps={warps} stages={stages} | graph {tg * 1e3:6.1f} us | rel_err {rel:.1e}"
        _row(rows, f"tiles fp8 {cfg}", row)
    e, d, i, k = 256, 4096, 2048, 6
    bank = _fp4_bank(e, d, i)
    xm = torch.randn(1, d, device="cuda").to(torch.bfloat16)
    ids = torch.rand(1, e, device="cuda").topk(k, dim=1).indices
    rw = torch.rand(1, k, device="cuda")
    want = fp4_moe_torch(xm, ids, rw, bank, 10.0)
    for bn, warps, stages in ((64, 4, 6), (64, 4, 3), (128, 4, 4), (128, 8, 4), (64, 8, 6), (256, 8, 3)):
        cfg = dict(BM=16, BN=bn, num_warps=warps, num_stages=stages)

        def row():
            rel = _rel(fp4_moe(xm, ids, rw, bank, 10.0, config=cfg), want)
            tg = _graph_ms(lambda: fp4_moe(xm, ids, rw, bank, 10.0, config=cfg))
            return f"tiles fp4_moe T=1 BN={bn} warps={warps} stages={stages} | graph {tg * 1e3:6.1f} us | rel_err {rel:.1e}"
        _row(rows, f"tiles fp4 {cfg}", row)


# V4-Flash decode GEMMs of one layer: (name, K, N)
DECODE_SHAPES = (("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("shared w1", 4096, 2048), ("wq_a", 4096, 1024))
BATCH_SHAPES = DECODE_SHAPES + (("wkv", 4096, 512), ("shared w2", 2048, 4096), ("index wq_b", 1024, 8192))


def _sweep_plans(rows: list[str], tag: str, shapes, ms, cands: list[dict], live: bool = False) -> None:
    """fp8_linear plan candidates (`mma` + `plan` config keys; {} = the default plan) on (name, K, N) shapes
    at each M: CUDA-graph replay, weight GB/s, TFLOP/s, rel_err against the twin; a BEST line per shape and
    M. Tiles taller than max(16, 2M) rows are skipped (mostly padding)."""
    for name, k, n in shapes:
        w = _fp8_weight(n, k, 128)
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            want = fp8_linear_torch(x, w)
            best = None
            for c in cands:
                cfg = {key: v for key, v in c.items() if key != "mma"}
                mma = c.get("mma")
                if cfg.get("BM", 0) > max(16, 2 * m) or cfg.get("BT", 0) > max(16, 2 * m):
                    continue

                def row(cfg=cfg, mma=mma, c=c):
                    nonlocal best
                    rel = _rel(fp8_linear(x, w, config=cfg or None, mma=mma), want)
                    tg = _graph_ms(lambda: fp8_linear(x, w, config=cfg or None, mma=mma))
                    if best is None or tg < best[0]:
                        best = (tg, c)
                    return (f"{tag} {name:12s} K={k:5d} N={n:5d} M={m:3d} {str(c or 'default'):105s} | graph "
                            f"{tg * 1e3:6.1f} us {n * k / tg / 1e6:5.0f} GB/s {2 * m * n * k / tg / 1e9:6.1f} TFLOP/s"
                            f" | rel_err {rel:.1e}")
                _row(rows, f"{tag} {name} M={m} {c}", row)
                if live:
                    print(rows[-1], flush=True)
            rows.append(f"BEST {tag} {name} M={m}: {best[0] * 1e3:.1f} us {n * k / best[0] / 1e6:.0f} GB/s {best[1]}")


def sweep_decode_fp8(rows: list[str]) -> None:
    """fp8_linear at M=1 and 8 on the layer's decode shapes: the default plan against wider tiles, more
    warps, the FP8 form and a separate activation-quantisation pass (CUDA-graph replay, weight GB/s)."""
    cands = [dict()]  # the default plan first
    for mma in ("bf16", "fp8"):
        tiles = ((32, 4, 4), (64, 4, 4), (128, 4, 4), (128, 8, 4)) if mma == "bf16" else ((32, 4, 4), (64, 4, 4), (128, 8, 4))
        for bn, warps, stages in tiles:
            for fused in (True, False):
                cands.append(dict(mma=mma, BM=16, BN=bn, GROUP_M=1, num_warps=warps, num_stages=stages,
                                  FUSED_ACT=fused))
    _sweep_plans(rows, "decode", DECODE_SHAPES, (1, 8), cands)


def sweep_batch_fp8(rows: list[str]) -> None:
    """fp8_linear at the batched decode steps' M (32, 128) on the layer's shapes: the default plan against
    narrower tiles (more programs), both forms, with the default split rule and without splitting."""
    cands = [dict()]
    for mma, tiles in (("bf16", ((32, 32, 4, 4), (32, 64, 4, 4), (64, 32, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3),
                                 (128, 64, 4, 3), (128, 128, 8, 3))),
                       ("fp8", ((64, 32, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 4)))):
        for bm, bn, warps, stages in tiles:
            for split in (None, 1):
                c = dict(mma=mma, BM=bm, BN=bn, GROUP_M=1, num_warps=warps, num_stages=stages)
                if split:
                    c["SPLIT_K"] = split
                cands.append(c)
    _sweep_plans(rows, "batch", BATCH_SHAPES, (32, 128), cands)


def sweep_batch_swap(rows: list[str]) -> None:
    """The swap form (weights as wgmma's register operand, tokens as its N) against the bf16 form's default
    plan at batched decode M on the layer's seven shapes: weight tiles of 64 / 128 rows, token tiles of all
    rows (<= 128) or 64, loop stages, the default split rule or none, fused or separate act_quant. Rows
    print as they finish (a time-limited device run keeps what it measured)."""
    cands = [dict(mma="bf16"), dict(mma="swap")]
    for bw, warps in ((64, 4), (128, 8)):
        for stages in (3, 5):
            for split in (None, 1):
                c = dict(mma="swap", BW=bw, num_warps=warps, num_stages=stages)
                if split:
                    c["SPLIT_K"] = split
                cands.append(c)
    cands += [dict(mma="swap", BW=64, BT=64, num_warps=4, num_stages=4),
              dict(mma="swap", BW=64, num_warps=4, num_stages=4, FUSED_ACT=False),
              dict(mma="swap", BW=64, num_warps=4, num_stages=4, FUSED_ACT=True)]
    for m in (32, 128, 16, 64, 256):  # the slice's batches first
        bt = min(128, max(16, triton.next_power_of_2(m)))
        ms_cands = [{**c, "BT": c.get("BT", bt)} if c["mma"] == "swap" and "BW" in c else c for c in cands]
        _sweep_plans(rows, "swap", BATCH_SHAPES, (m,), ms_cands, live=True)
        print("\n".join(r for r in rows if r.startswith("BEST swap") and f"M={m}:" in r), flush=True)


# the layer's fp8_linear shapes since params_fast stacks wq_a / wkv and the shared w1 / w3 (2026-12-03)
STACKED_SHAPES = (("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("shared w13", 4096, 4096), ("wq_a_wkv", 4096, 1536),
                  ("shared w2", 2048, 4096), ("index wq_b", 1024, 8192))


def sweep_swap_wide(rows: list[str]) -> None:
    """Wider swap weight tiles (256 rows over 8 / 16 warps: half the activation re-reads of 128) against the
    default plan and the bf16 form, on the stacked layer's shapes at M = 32, 128, 256."""
    cands = [dict(), dict(mma="bf16")]
    for bw, bt, warps, stages in ((256, 64, 8, 3), (256, 128, 8, 2), (256, 128, 16, 3), (256, 64, 16, 4),
                                  (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4)):
        cands.append(dict(mma="swap", BW=bw, BT=bt, num_warps=warps, num_stages=stages, FUSED_ACT=False))
    for m in (128, 32, 256):
        _sweep_plans(rows, "wide", STACKED_SHAPES, (m,), cands, live=True)


def sweep_batch_wgmma(rows: list[str]) -> None:
    """The wgmma CUDA kernel (kernels/cuda/fp8_linear_wgmma.cu: TMA ring, weights as wgmma's register operand)
    against the Triton swap and bf16 forms on the stacked layer's shapes at batched decode M: one or two
    consumer warpgroups, the default split rule, none, or twice it ("x2"), a shallower ring."""
    from deepinfer.kernels.cuda import fp8_linear_wgmma as wg

    cands = [dict(), dict(mma="swap"), dict(mma="bf16")]
    for cwg in (1, 2, 4):
        for split in (None, 1, "x2"):
            cands.append(dict(mma="wgmma", CWG=cwg) if split is None else dict(mma="wgmma", CWG=cwg, SPLIT_K=split))
    for m in (128, 32, 64, 256, 16):
        for name, k, n in STACKED_SHAPES:
            resolved = []
            for c in cands:
                if c.get("SPLIT_K") == "x2":  # twice the default rule's split, where K allows it
                    split = 2 * wg.plan(m, n, k, 132, {"CWG": c["CWG"]})["SPLIT_K"]
                    if k % (128 * split):
                        continue
                    c = dict(c, SPLIT_K=split)
                resolved.append(c)
            _sweep_plans(rows, "wgmma", ((name, k, n),), (m,), resolved, live=True)
        print("\n".join(r for r in rows if r.startswith("BEST wgmma") and f"M={m}:" in r), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows: list[str] = []
    if "--decode-fp8" in sys.argv:
        benches = (sweep_decode_fp8,)
    elif "--batch-fp8" in sys.argv:
        benches = (sweep_batch_fp8,)
    elif "--batch-swap" in sys.argv:
        benches = (sweep_batch_swap,)
    elif "--swap-wide" in sys.argv:
        benches = (sweep_swap_wide,)
    elif "--batch-wgmma" in sys.argv:
        benches = (sweep_batch_wgmma,)
    elif "--linear-f32" in sys.argv:
        benches = (bench_bf16_weights,)
    else:
        benches = (sweep_decode_tiles,) if "--tiles" in sys.argv else (bench_bf16_weights, bench_fp8_linear, bench_fp4_moe)
    for bench in benches:
        _row(rows, bench.__name__, lambda: bench(rows) or f"{bench.__name__} done")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
