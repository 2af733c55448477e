"""fp4_moe on one CUDA device: its FP4 expansions (`EXPANSIONS`: 1 = the fp16 bit trick with an interleaved
tile, the default; 3 = FP8 tensor-core dots of 32 K promoted into fp32 = the official fp4_gemm on SM90) with a
tile sweep per regime, V4-Flash dims (E=256, k=6, D=4096, I=2048), uniform random routing.

    PYTHONPATH=$PWD python benchmarks/bench_fp4_moe.py [--ts 1,8,32,128,512,2048,8192] [--quick]

Each row: CUDA-graph replay median (the whole op: routing, act_quant, both grouped GEMMs, the k-row sum),
the experts' bytes over that time (GB/s, FP4 + E8M0 of every touched expert), the expert FLOPs (TFLOP/s), and
rel_err against the torch twin on the same inputs. Prints a table at the end; writes $OUT/fp4_moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch  # noqa: E402
from deepinfer.kernels.triton.fp4_moe import _config, fp4_moe  # noqa: E402

E, K_TOP, D, I = 256, 6, 4096, 2048


def bank(dev) -> FP4ExpertBank:
    def scales(*shape):  # 2**-8 .. 2**1, the real checkpoints' range
        return torch.randint(119, 129, shape, dtype=torch.uint8, device=dev)

    return FP4ExpertBank(torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev), scales(E, 2 * I, D // 32),
                         torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev), scales(E, D, I // 32), 128)


def graph_ms(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")


def candidates(t: int, quick: bool) -> list[tuple[int, dict | None]]:
    per = t * K_TOP / E
    out = [(1, None)] + ([(3, None)] if per <= 16 else [])  # the defaults (expand 3 is slow at large T)
    if per <= 16:
        grid = [dict(BM=16, BN=64, num_warps=4, num_stages=4), dict(BM=16, BN=128, num_warps=4, num_stages=4),
                dict(BM=16, BN=64, num_warps=4, num_stages=3, KB=256), dict(BM=16, BN=128, num_warps=8, num_stages=3)]
    elif per <= 64:
        grid = [dict(BM=32, BN=128, num_warps=4, num_stages=4), dict(BM=64, BN=128, num_warps=4, num_stages=3),
                dict(BM=64, BN=128, num_warps=8, num_stages=3)]
    else:
        grid = [dict(BM=128, BN=128, num_warps=8, num_stages=3), dict(BM=128, BN=256, num_warps=8, num_stages=3),
                dict(BM=64, BN=128, num_warps=4, num_stages=4), dict(BM=128, BN=128, num_warps=4, num_stages=4),
                dict(BM=128, BN=256, num_warps=8, num_stages=2, KB=64)]
    return out + ([] if quick else [(1, c) for c in grid])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,8,32,128,512,2048,8192")
    ap.add_argument("--quick", action="store_true", help="defaults only, no tile sweep")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b = bank(dev)
    per_expert_bytes = (b.w13[0].numel() + b.w13_scale[0].numel() + b.w2[0].numel() + b.w2_scale[0].numel())
    rows, res = [], []
    for t in (int(v) for v in args.ts.split(",")):
        x = torch.randn(t, D, device=dev).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=dev)[:K_TOP] for _ in range(t)]).to(torch.int64)
        w = torch.rand(t, K_TOP, device=dev) * 0.5
        touched = int(torch.unique(ids).numel())
        want = fp4_moe_torch(x, ids, w, b, 10.0)
        flops = 2 * t * K_TOP * 3 * D * I
        for expand, cfg in candidates(t, args.quick):
            label = f"T={t:5d} expand={expand} {cfg or ('default ' + str(_config(t * K_TOP, E)))}"
            try:
                got = fp4_moe(x, ids, w, b, 10.0, expand=expand, config=cfg)
                rel = float((got.double() - want.double()).norm() / want.double().norm())
                ms = graph_ms(lambda: fp4_moe(x, ids, w, b, 10.0, expand=expand, config=cfg))
            except Exception as err:  # a tile that does not compile or fit: report, go on
                print(f"{label}: FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            gbs = touched * per_expert_bytes / (ms * 1e-3) / 1e9
            tfs = flops / (ms * 1e-3) / 1e12
            res.append(dict(t=t, expand=expand, cfg=cfg, ms=ms, gbs=gbs, tflops=tfs, rel_err=rel, experts=touched))
            rows.append(f"{label:80s} {ms * 1e3:9.1f} us {gbs:7.0f} GB/s {tfs:6.1f} TFLOP/s rel {rel:.1e}")
            print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fp4_moe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n".join(["", "fp4_moe (CUDA-graph replay of the whole op):"] + rows))


if __name__ == "__main__":
    main()
