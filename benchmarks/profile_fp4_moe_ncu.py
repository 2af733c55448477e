"""Drive the routed experts' op at one prefill size a few times, for Nsight Compute to profile its kernels
(the GEMMs' stall reasons and pipe use: what bounds `fp4_expert_gemm_wgmma`, which neither an unserialized wgmma
pipeline nor halved L2 reads of the activations made faster, thirty-seventh session).

    ncu --kernel-name fp4_expert_gemm_wgmma --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        python benchmarks/profile_fp4_moe_ncu.py [--t 8192] [--config '{"PRODUCER_WARP": 0}']

V4-Flash's expert dims (bench_fp4_moe.py's bank: random FP4 bytes, E8M0 scales in the checkpoints' range),
uniform random routing; the op runs --calls times (2 GEMM launches a call) after one warm-up call.
Must not: be imported by the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp4_moe import D, E, K_TOP, bank  # noqa: E402
from deepinfer.kernels.triton.fp4_moe import fp4_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8192, help="tokens (each routed to K_TOP experts)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--config", default="{}", help="fp4_moe config on top of {'WGMMA': True}, as JSON")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b = bank(dev)
    x = torch.randn(args.t, D, device=dev).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K_TOP] for _ in range(args.t)]).to(torch.int64)
    w = torch.rand(args.t, K_TOP, device=dev) * 0.5
    config = {"WGMMA": True, **json.loads(args.config)}
    for _ in range(1 + args.calls):
        fp4_moe(x, ids, w, b, 10.0, config=config)
    torch.cuda.synchronize()
    print(f"fp4_moe T={args.t} config {config}: {1 + args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
