"""What programmatic dependent launch (PDL) saves per kernel boundary in a CUDA-graph-replayed chain of small
dependent Triton kernels on this GPU: N launches of a kernel that reads the previous one's output (a decode
step is ~250 such launches), with and without `launch_pdl=True` + `gdc_wait()` at each kernel's top (the
wait returns once the previous grid has finished and its writes are visible).

    PYTHONPATH=$PWD python benchmarks/bench_pdl.py      # prints us per launch for each form
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402


@triton.jit
def _step_kernel(src, dst, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous grid's writes are visible past this point
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m) * 1.0001 + 1.0, mask=m)


def chain(bufs, n, steps, pdl, programs):
    block = triton.next_power_of_2(triton.cdiv(n, programs))
    for i in range(steps):
        _step_kernel[(triton.cdiv(n, block),)](bufs[i % 2], bufs[(i + 1) % 2], n, PDL=pdl, BLOCK=block,
                                               launch_pdl=pdl)


def main() -> None:
    steps = 200
    for n, programs in ((4096, 1), (4096 * 16, 16), (4096 * 132, 132), (1 << 22, 264)):
        bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
        res = {}
        for pdl in (False, True):
            bufs[0].zero_()
            chain(bufs, n, steps, pdl, programs)
            torch.cuda.synchronize()
            out = bufs[steps % 2].clone()
            res[pdl] = graph_replay_ms(lambda: chain(bufs, n, steps, pdl, programs)) * 1e3 / steps
            bufs[0].zero_()
            chain(bufs, n, steps, pdl, programs)
            assert torch.equal(bufs[steps % 2], out)
        print(f"n={n:8d} programs={programs:4d}: {res[False]:.2f} us per launch plain, {res[True]:.2f} with PDL "
              f"({res[False] - res[True]:+.2f} us per boundary)")


if __name__ == "__main__":
    main()
