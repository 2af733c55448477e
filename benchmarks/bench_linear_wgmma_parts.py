"""Where the wgmma FP8 linear's time goes (kernels/cuda/fp8_linear_wgmma.cu), without hardware counters:
the kernel against its diagnostic builds (the .cu's DIAG), each replayed from a CUDA graph on the same
operands, at the batched-decode shapes of V4-Flash:

* DIAG0 the GEMM;
* DIAG1 the ring alone: the producer's TMA copies of weights and activations, consumers release each stage
  unread (what the loads cost with no math);
* DIAG2 the math alone: no copies (stale shared memory), the expansion and the wgmmas;
* DIAG3 the wgmmas alone: no copies, no expansion (the same registers every stage); whole-stage fragment
  buffers only, so "n/a" for plans with HALVES (the 4-warpgroup ones).
The act_quant pass before the kernel is not timed (the operand is made once).

    PYTHONPATH=$PWD python benchmarks/bench_linear_wgmma_parts.py     # results/fp8_linear_wgmma_parts_h200_*.log

H200, 2026-12-04 (results/fp8_linear_wgmma_parts_h200_2026-12-04_s14.log; the same diagnostic builds timed
by an earlier probe with 2 warpgroups everywhere: *_s14_probe.log), us:
    M=128 wq_b (N=32768, K=1024), 2 warpgroups    26.8 | ring 20.1 | math 22.0 | wgmmas 19.1
    M=128 wq_b, 4 warpgroups (the default)       26.0 | ring 18.6 | math 21.8 | wgmmas n/a (*)
    M=128 N=32768 K=4096, 2 warpgroups (probe)   67.7 | ring 48.1 | math 60.1 | wgmmas 46.3  (743 TFLOP/s)
    M=32  wq_b, 2 warpgroups (probe)             22.1 | ring 17.5 | math 15.4 | wgmmas 11.5
So at decode sizes each part alone takes 70-85% of the whole. The wgmmas-only build grows 9.2 us per 1024
K (~750 TFLOP/s) on top of ~10 us that do not depend on K (an estimate of what is in it: the graph launch,
the 8 MB bf16 output at 128 tokens, two waves of CTA ramps); the ring alone is as slow as the math alone
(its L2 traffic: the activations are re-read by every weight tile, 2x the weight bytes at 128 tokens). The
expansion adds ~3 us at K=1024 (math 21.7 vs wgmmas 18.7).
(*) That run's build ignored DIAG 3 under HALVES and timed the math again (22.0 us at K=1024, 61.6 at 4096);
DIAG 3 with HALVES is now refused (the .cu's #error, `fp8_linear_wgmma.tiles`).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from timing import graph_replay_ms  # noqa: E402

from deepinfer import formats  # noqa: E402
from deepinfer.kernels.cuda import fp8_linear_wgmma as wg  # noqa: E402
from deepinfer.kernels.quant_weights import QuantLinearWeight  # noqa: E402
from deepinfer.kernels.triton.act_quant import act_quant_wgmma  # noqa: E402

CASES = ((128, 32768, 1024, {}), (128, 32768, 4096, {}), (128, 32768, 1024, {"CWG": 2}),
         (128, 32768, 1024, {"CWG": 1}), (32, 32768, 1024, {}), (128, 4096, 4096, {}), (128, 8192, 1024, {}))
# (the default plans: `fp8_linear_wgmma.plan`; 4 warpgroups with half-stage fragment buffers for wq_b)


def main() -> None:
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: fp8_linear_wgmma and its diagnostic builds, CUDA-graph replay, us")
    for m, n, k, extra in CASES:
        wq, ws = formats.quant_fp8_blocks(torch.randn(n, k, device="cuda"), 128)
        w = QuantLinearWeight(wq, formats.e8m0_to_float(ws), 128, 128)
        a = act_quant_wgmma(torch.randn(m, k, device="cuda").to(torch.bfloat16), 128)
        times = []
        for diag in (0, 1, 2, 3):
            if diag == 3 and wg.plan(m, n, k, sms, extra)["HALVES"]:
                times.append(float("nan"))  # DIAG 3 needs whole-stage buffers
                continue
            cfg = wg.plan(m, n, k, sms, dict(extra, DIAG=diag))
            split = cfg["SPLIT_K"]
            out = torch.empty((split, m, n), device="cuda") if split > 1 else \
                torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            times.append(graph_replay_ms(lambda: wg.fp8_linear_partials(a, w, out, cfg), warmup_ms=10, rep_ms=40) * 1e3)
        plan = {key: v for key, v in cfg.items() if key != "DIAG"}
        print(f"M={m:3d} N={n:5d} K={k:4d} {plan}: GEMM {times[0]:6.1f} | ring {times[1]:6.1f} | math {times[2]:6.1f}"
              f" | wgmmas {times[3]:6.1f}  ({2 * m * n * k / times[0] / 1e6:.0f} TFLOP/s, "
              f"{n * k / times[0] / 1e3:.0f} GB/s of weights)", flush=True)


if __name__ == "__main__":
    main()
