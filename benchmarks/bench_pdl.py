"""What programmatic dependent launch (PDL) saves per kernel boundary in a CUDA-graph-replayed chain of
dependent Triton kernels on this GPU (a decode step is ~150-250 such launches).

Two chains, each replayed from a CUDA graph:
* tiny: N launches of a kernel that reads the previous one's output;
* gemv: N pairs of a split-K GEMV over its own bf16 weight (the weights cycle through more bytes than L2
  holds, as a decode step's do) and a small kernel that sums its partials into the next GEMV's input.

Forms: `plain` (no PDL); `wait` (`launch_pdl=True`, `gdc_wait()` at the kernel's top: the ninth session's
form, which the dependent only launches at the previous grid's end); `trigger` (`gdc_wait()` then
`gdc_launch_dependents()` at the top: the next kernel launches while this one runs and waits for it on the
device); `prefetch` (gemv only: as `trigger`, and the GEMV loads its weight tile before its wait, so the
weight stream overlaps the previous kernels). Every form's result is checked equal to the plain one.

    PYTHONPATH=$PWD python benchmarks/bench_pdl.py      # prints us per launch (per pair) for each form
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_replay_ms  # noqa: E402

FORMS = ("plain", "wait", "trigger", "prefetch")


@triton.jit
def _step_kernel(src, dst, n, WAIT: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()  # the previous grid's writes are visible past this point
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m) * 1.0001 + 1.0, mask=m)


@triton.jit
def _gemv_partial_kernel(w, x, part, N, K, WAIT: tl.constexpr, TRIGGER: tl.constexpr, PREFETCH: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
    pn, pk = tl.program_id(0), tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rk = pk * BK + tl.arange(0, BK)
    if PREFETCH:  # the weights do not depend on the previous kernels
        wt = tl.load(w + rn[:, None] * K + rk[None, :])
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if not PREFETCH:
        wt = tl.load(w + rn[:, None] * K + rk[None, :])
    xv = tl.load(x + rk).to(tl.float32)
    tl.store(part + pk * N + rn, tl.sum(wt.to(tl.float32) * xv[None, :], axis=1))


@triton.jit
def _sum_kernel(part, x, N, SPLITS: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part + s * N + offs)
    # the next GEMV's input (K = N here): squashed to stay finite over the chain
    tl.store(x + offs, (acc / (1.0 + tl.abs(acc))).to(tl.bfloat16))


def _flags(form):
    return dict(WAIT=form != "plain", TRIGGER=form in ("trigger", "prefetch")), form != "plain"


def tiny_chain(bufs, n, steps, form, programs):
    flags, pdl = _flags(form)
    block = triton.next_power_of_2(triton.cdiv(n, programs))
    for i in range(steps):
        _step_kernel[(triton.cdiv(n, block),)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=block, launch_pdl=pdl,
                                               **flags)


def gemv_chain(ws, x, part, steps, form, bn=16, bk=512):
    flags, pdl = _flags(form)
    n = k = x.numel()
    for i in range(steps):
        _gemv_partial_kernel[(n // bn, k // bk)](ws[i % len(ws)], x, part, n, k, PREFETCH=form == "prefetch",
                                                 BN=bn, BK=bk, launch_pdl=pdl, **flags)
        _sum_kernel[(n // 1024,)](part, x, n, SPLITS=k // bk, BLOCK=1024, launch_pdl=pdl, **flags)


def main() -> None:
    print(torch.cuda.get_device_name())
    steps = 200
    for n, programs in ((4096, 1), (4096 * 16, 16), (4096 * 132, 132), (1 << 22, 264)):
        bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
        res, ref = {}, None
        for form in FORMS[:3]:
            bufs[0].zero_()
            tiny_chain(bufs, n, steps, form, programs)
            torch.cuda.synchronize()
            out = bufs[steps % 2].clone()
            ref = out if ref is None else ref
            assert torch.equal(out, ref), form
            res[form] = graph_replay_ms(lambda: tiny_chain(bufs, n, steps, form, programs)) * 1e3 / steps
            bufs[0].zero_()
            tiny_chain(bufs, n, steps, form, programs)  # graph replays of the chain equal the eager chain
            torch.cuda.synchronize()
            assert torch.equal(bufs[steps % 2], ref), form
        print(f"tiny n={n:8d} programs={programs:4d}: us per launch " +
              "  ".join(f"{f} {v:.2f}" for f, v in res.items()))
    steps = 48
    for dim in (2048, 4096):
        count = max(2, (160 << 20) // (dim * dim * 2))  # > L2 (50-60 MB) of distinct weights
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = [torch.randn(dim, dim, device="cuda", generator=g).to(torch.bfloat16) * 0.05 for _ in range(count)]
        x = torch.empty(dim, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(dim // 512, dim, device="cuda")
        x0 = torch.randn(dim, device="cuda", generator=g).to(torch.bfloat16)
        res, ref = {}, None
        for form in FORMS:
            x.copy_(x0)
            gemv_chain(ws, x, part, steps, form)
            torch.cuda.synchronize()
            ref = x.clone() if ref is None else ref
            assert torch.equal(x, ref), form

            def run(form=form):
                x.copy_(x0)
                gemv_chain(ws, x, part, steps, form)

            res[form] = graph_replay_ms(run) * 1e3 / steps
        floor = dim * dim * 2 / 3.0e6  # us at 3 TB/s
        print(f"gemv {dim}x{dim} bf16 ({dim * dim * 2 / 2**20:.0f} MiB, ~{floor:.1f} us at 3 TB/s): us per "
              "GEMV + sum pair " + "  ".join(f"{f} {v:.2f}" for f, v in res.items()))


if __name__ == "__main__":
    main()
