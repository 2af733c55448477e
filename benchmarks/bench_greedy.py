"""The sampler's all-greedy step on V4's 129,280-token vocabulary: the general path (`log_softmax` of the
fp32 logits, `argmax`, the gather and the rank count: `sampling.logprobs.gather_logprobs`) against the fused
op `greedy_sample` (kernels/triton/greedy.py: one read of each row), device time per call as the median of
CUDA-graph replays, against the HBM copy rate measured in the same run. Bytes: one read of the logits
(what the fused op moves; the general path moves ~4x that).

    PYTHONPATH=$PWD python benchmarks/bench_greedy.py [--batches 1 8 32 128 256]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import copy_bandwidth_gbs  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

VOCAB = 129280


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    args = ap.parse_args()
    from deepinfer.kernels.triton.greedy import chunks_for, greedy_sample
    from deepinfer.kernels.triton.fp8_gemm import sm_count
    from deepinfer.sampling.logprobs import gather_logprobs, log_softmax

    copy = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: HBM copy {copy:.0f} GB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in args.batches:
        logits = torch.randn(b, VOCAB, generator=g, device="cuda") * 4

        def general():
            return gather_logprobs(log_softmax(logits), logits.argmax(-1), 0)

        ref, got = general(), greedy_sample(logits)
        assert torch.equal(ref.token_ids, got[0]) and torch.equal(ref.ranks, got[2])
        lp_err = float((ref.logprobs - got[1]).abs().max())
        nbytes = logits.numel() * 4
        t_gen = graph_replay_ms(general) * 1e3
        t_fused = graph_replay_ms(lambda: greedy_sample(logits)) * 1e3
        chunk, n = chunks_for(b, VOCAB, sm_count(logits.device))
        print(f"B={b:4d}  general {t_gen:7.1f} us  fused {t_fused:6.1f} us ({nbytes / t_fused / 1e3:6.0f} GB/s, "
              f"{nbytes / t_fused / 1e3 / copy:5.1%} of copy; {n} chunks of {chunk})  saved {t_gen - t_fused:6.1f} us"
              f"  logprob diff {lp_err:.1e}")


if __name__ == "__main__":
    main()
