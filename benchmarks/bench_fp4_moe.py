"""fp4_moe on one CUDA device: its FP4 expansions (`EXPANSIONS`: 1 = the fp16 bit trick with an interleaved
tile, the default; 3 = FP8 tensor-core dots of 32 K promoted into fp32 = the official fp4_gemm on SM90) with a
tile sweep per regime, V4-Flash dims (E=256, k=6, D=4096, I=2048), uniform random routing.

    PYTHONPATH=$PWD python benchmarks/bench_fp4_moe.py [--ts 1,8,32,128,512,2048,8192] [--quick]
    PYTHONPATH=$PWD python benchmarks/bench_fp4_moe.py --variants [--ts 1,8,32,128,512]
    PYTHONPATH=$PWD python benchmarks/bench_fp4_moe.py --mma [--ts 1,8,32,128]
    PYTHONPATH=$PWD python benchmarks/bench_fp4_moe.py --tma [--ts 1,8,32,128]
    PYTHONPATH=$PWD python benchmarks/bench_fp4_moe.py --wgmma [--ts 512,2048,8192]
    ... [--dims 384,6,5120,2304]   # other expert dims E,k,D,I (these: V4.1-Flash's)

--fp8: the current default (expand and plan chosen by the op) against the FP8 form's variants (`FP8_VARIANTS`);
--mma: the current default against the mma.sync CUDA kernel's variants (`MMA_VARIANTS`, kernels/cuda/fp4_moe_mma);
--tma: the current default against the TMA-fed CUDA kernel's variants (`TMA_VARIANTS`, kernels/cuda/fp4_moe_tma);
--wgmma: the current default against the Triton prefill plan and the wgmma kernel's tiles (`WGMMA_VARIANTS`,
kernels/cuda/fp4_moe_wgmma); every variants row also gives the expert TFLOP/s (2 x slots x 3 x D x I);
--variants: the default against the v2 path's variants (`fp4_moe(config=...)` with `V2_KEYS`: split-K with
fixed-order reduces, pre-dequantised bf16 activations, one gate+up tile; `VARIANTS` below), each row with
its speedup over the default at that T; writes $OUT/fp4_moe_variants.json.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch  # noqa: E402
from deepinfer.kernels.triton.fp4_moe import _config, fp4_moe  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

E, K_TOP, D, I = 256, 6, 4096, 2048


def bank(dev) -> FP4ExpertBank:
    def scales(*shape):  # 2**-8 .. 2**1, the real checkpoints' range
        return torch.randint(119, 129, shape, dtype=torch.uint8, device=dev)

    return FP4ExpertBank(torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev), scales(E, 2 * I, D // 32),
                         torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev), scales(E, D, I // 32), 128)


def graph_ms(fn) -> float:
    return graph_replay_ms(fn)


def candidates(t: int, quick: bool) -> list[tuple[int, dict | None]]:
    per = t * K_TOP / E
    out = [(1, None)]  # the old kernel's default
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


# (name, config, max T it is run at): the v2 path's variants (deepinfer/kernels/triton/fp4_moe.py `plan_v2`)
VARIANTS = [  # (name, config, expand, max T)
    ("default kernel, expand 5", None, 5, 10 ** 9),
    ("v2 fused gate+up tile, fp8 act", dict(SPLIT_K=1), 1, 128),
    ("v2 bf16 act", dict(A_BF16=True), 1, 10 ** 9),
    ("v2 bf16 act, expand 5", dict(A_BF16=True), 5, 10 ** 9),
    ("v2 bf16 act BN=128, expand 5", dict(A_BF16=True, BN=128), 5, 10 ** 9),
    ("v2 bf16 act BN=128 8 warps, e5", dict(A_BF16=True, BN=128, num_warps=8, num_stages=3), 5, 512),
    ("v2 split auto, fp8 act", dict(SPLIT_K=0), 1, 8),
    ("v2 split auto, bf16 act, e5", dict(SPLIT_K=0, A_BF16=True), 5, 32),
    ("v2 split 2, bf16 act, e5", dict(SPLIT_K=2, A_BF16=True), 5, 128),
    ("v2 split 8/4, bf16 act, e5", dict(SPLIT_K13=8, SPLIT_K2=4, A_BF16=True), 5, 8),
    ("v2 split 4 BN=128, bf16, e5", dict(SPLIT_K=4, A_BF16=True, BN=128), 5, 8),
    ("default kernel, expand 6", None, 6, 10 ** 9),
    ("v2 decode plan, expand 6", dict(SPLIT_K=0, A_BF16=True, BN=128), 6, 512),
    ("v2 bf16 act, expand 6", dict(A_BF16=True), 6, 10 ** 9),
    ("v2 bf16 act BN=128 8w, e6", dict(A_BF16=True, BN=128, num_warps=8, num_stages=3), 6, 10 ** 9),
    ("v2 bf16 act BM=128 BN=256 4 stages, e6", dict(A_BF16=True, BM=128, BN=256, num_warps=8, num_stages=4), 6, 10 ** 9),
    ("v2 bf16 act BM=64 BN=256 8w, e6", dict(A_BF16=True, BM=64, BN=256, num_warps=8, num_stages=3), 6, 10 ** 9),
    ("v2 bf16 act BM=128 BN=128 8w, e6", dict(A_BF16=True, BM=128, BN=128, num_warps=8, num_stages=3), 6, 10 ** 9),
]


# the FP8 form (`fp4_moe(config={"FP8": True, ...})`, kernels/triton/fp4_fp8_gemm.py) against the default
FP8_VARIANTS = [  # (name, config, expand, max T)
    ("fp8 form BW=128 3 stages", dict(FP8=True), None, 10 ** 9),
    ("fp8 form BW=128 4 stages", dict(FP8=True, num_stages=4), None, 10 ** 9),
    ("fp8 form BW=64", dict(FP8=True, BW=64), None, 512),
    ("fp8 form BW=256 8 warps", dict(FP8=True, BW=256, num_warps=8), None, 10 ** 9),
    ("fp8 form BW=128 no split", dict(FP8=True, SPLIT_K=1), None, 32),
    ("fp8 form BW=128 BT=32", dict(FP8=True, BT=32), None, 512),
    ("fp8 form BW=128 BT=64 8 warps", dict(FP8=True, BT=64, num_warps=8), None, 10 ** 9),
    ("fp8 form BW=256 BT=128 8 warps", dict(FP8=True, BT=128, BW=256, num_warps=8), None, 10 ** 9),
    ("fp8 form BW=128 BT=128 8 warps", dict(FP8=True, BT=128, BW=128, num_warps=8), None, 10 ** 9),
]


# the mma.sync form (`fp4_moe(config={"MMA_SYNC": True, ...})`, kernels/cuda/fp4_moe_mma.cu) against the default
MMA_VARIANTS = [  # (name, config, expand, max T); "default" (the first row) is the op's own plan
    ("triton v2 decode plan, expand 6", dict(SPLIT_K=0, A_BF16=True, BN=128), 6, 10 ** 9),
    ("mma MT2 w4 s2", dict(MMA_SYNC=True, MT=2, WARPS=4, STAGES=2, KSTEP=128), None, 10 ** 9),
    ("mma MT2 w4 s4", dict(MMA_SYNC=True, MT=2, WARPS=4, STAGES=4, KSTEP=128), None, 10 ** 9),
    ("mma MT1 w4 s2 k256", dict(MMA_SYNC=True, MT=1, WARPS=4, STAGES=2, KSTEP=256), None, 10 ** 9),
    ("mma MT2 w4 s2 k256", dict(MMA_SYNC=True, MT=2, WARPS=4, STAGES=2, KSTEP=256), None, 10 ** 9),
    ("mma MT1 w4 s4 k256", dict(MMA_SYNC=True, MT=1, WARPS=4, STAGES=4, KSTEP=256), None, 10 ** 9),
    ("mma MT1 w8 s2 k256", dict(MMA_SYNC=True, MT=1, WARPS=8, STAGES=2, KSTEP=256), None, 10 ** 9),
    ("mma async MT1 w4 s8", dict(MMA_SYNC=True, ASYNC=1, MT=1, WARPS=4, STAGES=8, KSTEP=128), None, 10 ** 9),
] + [  # the b1 plan's split-K counts (w13, w2) around its default (2, 2 on 132 SMs), 2026-12-07
    (f"mma MT1 w4 s2 k256 S{a},{b}", dict(MMA_SYNC=True, MT=1, WARPS=4, STAGES=2, KSTEP=256, SPLIT_K13=a, SPLIT_K2=b),
     None, 8) for a, b in ((1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (4, 4), (8, 4))  # S2 = 8: K per split 256, refused
] + [(f"mma MT1 w8 s2 k256 S{a},{b}", dict(MMA_SYNC=True, MT=1, WARPS=8, STAGES=2, KSTEP=256, SPLIT_K13=a,
                                             SPLIT_K2=b), None, 8) for a, b in ((2, 2), (4, 4))]


# the TMA form (`fp4_moe(config={"TMA": True, ...})`, kernels/cuda/fp4_moe_tma.cu) against the default
TMA_VARIANTS = [  # (name, config, expand, max T)
    ("mma.sync form (its plan)", dict(MMA_SYNC=True), None, 10 ** 9),
    ("tma MT4 cw4 s3", dict(TMA=True, MT=4, CWARPS=4, STAGES=3), None, 10 ** 9),
    ("tma MT2 cw4 s4", dict(TMA=True, MT=2, CWARPS=4, STAGES=4), None, 10 ** 9),
    ("tma MT2 cw4 s3", dict(TMA=True, MT=2, CWARPS=4, STAGES=3), None, 10 ** 9),
    ("tma MT2 cw8 s4", dict(TMA=True, MT=2, CWARPS=8, STAGES=4), None, 10 ** 9),
    ("tma MT2 cw4 s6", dict(TMA=True, MT=2, CWARPS=4, STAGES=6), None, 10 ** 9),
    ("tma MT1 cw4 s4", dict(TMA=True, MT=1, CWARPS=4, STAGES=4), None, 10 ** 9),
]
WGMMA_VARIANTS = [  # (name, config, expand, max T)
    ("wgmma (its plan)", dict(WGMMA=True), None, 10 ** 9),
    ("tma (its plan)", dict(TMA=True), None, 4096),  # the decode form: the crossover (WGMMA_SLOTS_PER_EXPERT)
    ("wgmma BT128 cwg4 s4 f1 h0", dict(WGMMA=True, BT=128, CWG=4, STAGES=4, FRAG_BUFS=1, HALVES=0, MIN_CTAS=1), None,
     10 ** 9),
    ("wgmma BT64 cwg2 s3 f1 h1 m3", dict(WGMMA=True, BT=64, CWG=2, STAGES=3, FRAG_BUFS=1, HALVES=1, MIN_CTAS=3), None, 10 ** 9),
]
# (rows earlier sessions timed, dropped to keep this sweep within one device call: the Triton prefill plan,
# untrimmed blocks, BT64 cwg4 h1, BT128 cwg2 s2 m2 h0/h1, BT128 cwg1 s3 h1 m2, BT64 cwg2 s4 h1 m2, and the
# thirty-seventh session's six PRODUCER_WARP 0 rows (not faster, BENCHMARKS.md), the two-fragment-buffer rows
# without ptxas's serialization (thirty-eighth session, H100: T = 8192 8.80 ms at BT64 x 2 warpgroups, 7.65 at
# BT128 x 2 untrimmed, against the plan's 6.11;
# results/bench_fp4_moe_wgmma_f2_persistent_static_h100_2026-12-07_s38.log); git history.
# The thirty-eighth session's persistent CTAs (PERSISTENT 1, d1226fb: a grid of an SM's CTAs taking tiles from a
# counter, the ring running on across a CTA's tiles) passed its GPU tests bit for bit and was slower at every
# shape on an H100: T = 8192 6.06 -> 7.36 ms (6.60 with a static deal of the tiles), T = 2048 2.25 -> 2.37 ms
# (BT 64, 3 CTAs an SM); the tile loop's extra live state spills at the 96-register cap into the stage loop
# (253 -> 272 instructions, 2 local loads a stage). Removed by git revert
# (results/bench_fp4_moe_wgmma_persistent_dynamic_h100_2026-12-07_s38.log).
# The thirty-seventh session's MCAST 2 (CTA pairs sharing the activation boxes by TMA multicast, 5ce02ec) passed
# its GPU tests and was slower at every shape on an H100: T = 8192 6.05 -> 7.19 ms, T = 2048 2.37 -> 3.10 ms;
# removed, results/bench_fp4_moe_wgmma_mcast_h100_2026-12-07_s37.log)
# (the seventh session's sweeps, results/fp4_moe_tma_h200_2026-12-02_s7*.log, also timed 8 stages, MT1 x 8
# warps, WAVES 2 / 8 and three variants since removed from the kernel: each slower than the rows kept here)


def run_variants(b, ts, per_expert_bytes, variants=None) -> None:
    from deepinfer.kernels.triton.fp4_moe import n_routing_blocks, plan_fp8, plan_mma, plan_tma, plan_v2

    dev = b.w13.device
    rows, res = [], []
    for t in ts:
        x = torch.randn(t, D, device=dev).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=dev)[:K_TOP] for _ in range(t)]).to(torch.int64)
        w = torch.rand(t, K_TOP, device=dev) * 0.5
        touched = int(torch.unique(ids).numel())
        want = fp4_moe_torch(x, ids, w, b, 10.0)
        base = None
        first = ("default", None, None, 10 ** 9) if variants is not None else ("default", None, 1, 10 ** 9)
        for name, cfg, expand, max_t in [first] + (VARIANTS if variants is None else variants):
            if t > max_t:
                continue
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            n_slots = t * K_TOP
            if cfg is None:
                desc = str(_config(n_slots, E))
            elif "MMA_SYNC" in cfg:
                pl = plan_mma(n_slots, E, D, I, sms, cfg)
                desc = (f"S13={pl['S13']} S2={pl['S2']} MT={pl['MT']} w={pl['WARPS']} st={pl['STAGES']} "
                        f"k={pl['KSTEP']}{' async' if pl['ASYNC'] else ''}")
            elif "TMA" in cfg:
                pl = plan_tma(n_slots, E, D, I, sms, cfg)
                desc = f"S13={pl['S13']} S2={pl['S2']} MT={pl['MT']} cw={pl['CWARPS']} st={pl['STAGES']}"
            elif "WGMMA" in cfg:
                from deepinfer.kernels.cuda.fp4_moe_wgmma import tiles as wgmma_tiles

                pl = wgmma_tiles(cfg)
                desc = (f"BT={pl['BT']} CWG={pl['CWG']} st={pl['STAGES']} fb={pl['FRAG_BUFS']} h={pl['HALVES']} "
                        f"m={pl['MIN_CTAS']}")
            elif "FP8" in cfg:
                pl = plan_fp8(n_slots, E, D, I, sms, cfg)
                desc = f"S13={pl['S13']} S2={pl['S2']} BT={pl['BT']} BW={pl['BW']} w={pl['num_warps']}"
            else:
                pl = plan_v2(n_slots, E, n_routing_blocks(n_slots, E, {**_config(n_slots, E), **cfg}["BM"]), D, I,
                             sms, cfg)
                desc = f"S13={pl['S13']} S2={pl['S2']} BN={pl['BN']} w={pl['num_warps']}"
            try:
                got = fp4_moe(x, ids, w, b, 10.0, expand=expand, config=cfg)
                rel = float((got.double() - want.double()).norm() / want.double().norm())
                ms = graph_ms(lambda: fp4_moe(x, ids, w, b, 10.0, expand=expand, config=cfg))
            except Exception as err:  # report, go on
                print(f"T={t:4d} {name}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            base = base or ms
            gbs = touched * per_expert_bytes / (ms * 1e-3) / 1e9
            tflops = 2 * n_slots * 3 * D * I / (ms * 1e-3) / 1e12
            res.append(dict(t=t, name=name, cfg=cfg, expand=expand, plan=desc, ms=ms, gbs=gbs, tflops=tflops,
                            rel_err=rel, experts=touched, speedup=base / ms))
            rows.append(f"T={t:4d} {name:32s} {desc:34s} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s {tflops:6.1f} TFLOP/s "
                        f"x{base / ms:5.2f} rel {rel:.1e}")
            print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fp4_moe_variants.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n".join(["", "fp4_moe variants (CUDA-graph replay of the whole op; x = speedup over the default):"]
                    + rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default=None, help="default 1,8,32,128,512,2048,8192 (--variants: 1,8,32,128,512)")
    ap.add_argument("--quick", action="store_true", help="defaults only, no tile sweep")
    ap.add_argument("--variants", action="store_true", help="the default against the v2 path's VARIANTS")
    ap.add_argument("--fp8", action="store_true", help="the current default against FP8_VARIANTS (the FP8 form)")
    ap.add_argument("--mma", action="store_true", help="the current default against MMA_VARIANTS (mma.sync kernel)")
    ap.add_argument("--tma", action="store_true", help="the current default against TMA_VARIANTS (TMA-fed kernel)")
    ap.add_argument("--wgmma", action="store_true", help="the current default against WGMMA_VARIANTS (prefill)")
    ap.add_argument("--dims", default=None, help="E,k,D,I instead of V4-Flash's 256,6,4096,2048")
    args = ap.parse_args()
    if args.dims:
        global E, K_TOP, D, I
        E, K_TOP, D, I = (int(v) for v in args.dims.split(","))
        print(f"expert dims E={E} k={K_TOP} D={D} I={I}", flush=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b = bank(dev)
    per_expert_bytes = (b.w13[0].numel() + b.w13_scale[0].numel() + b.w2[0].numel() + b.w2_scale[0].numel())
    if args.variants or args.fp8 or args.mma or args.tma or args.wgmma:
        ts = args.ts or ("512,2048,8192" if args.wgmma else "1,8,32,128,512")
        run_variants(b, [int(v) for v in ts.split(",")], per_expert_bytes,
                     FP8_VARIANTS if args.fp8 else MMA_VARIANTS if args.mma else TMA_VARIANTS if args.tma
                     else WGMMA_VARIANTS if args.wgmma else None)
        return
    rows, res = [], []
    for t in (int(v) for v in (args.ts or "1,8,32,128,512,2048,8192").split(",")):
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
