"""Programmatic dependent launch (PDL) for the Triton kernels: the device-side half.

Why: a decode step is ~150-250 dependent launches, most of them a few microseconds of work. Launched with
PDL, a kernel's grid is started while the kernel before it in the stream still runs, and waits on the device
for that kernel's end instead of the launch waiting for it. Measured on the H100 (benchmarks/bench_pdl.py,
2026-12-06): 1.59 -> 0.98 us a launch for one-program kernels, 6.78 -> 5.51 us for a split-K GEMV and its sum.

How: every launched kernel that takes part has a last parameter `PDL: tl.constexpr = False` and calls
`pdl_enter(PDL)` as its FIRST statement. With PDL true that is `griddepcontrol.wait` (returns once the
previous grid has finished and its writes are visible: it must come before any load or store, since the
grid may be running) and then `griddepcontrol.launch_dependents` (lets the next kernel's grid launch now;
it will wait in turn). Because each kernel waits for the one before it to END, and that one had waited for
its own predecessor before it did anything, the ordering of the whole stream is kept.
The host-side half is in launch.py: `FastLaunch` passes `PDL=True` and `launch_pdl=True` together, and only
to kernels that have the parameter (tests/test_kernels_pdl.py checks every such kernel starts with the call).
Also safe for multi-wave grids and clusters: the next grid launches only once every CTA of this one has
started (the trigger counts all of them), so early CTAs of the next grid never keep this one's from running.
A kernel whose CTAs waited for each other through global memory (a grid-wide spin barrier, which assumes
they are all resident) could deadlock behind them; no kernel here does that (cluster barriers are
hardware-scheduled).
Must not: be called anywhere but as a launched kernel's first statement.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous grid has ended and its writes are visible past this point
        tl.extra.cuda.gdc_launch_dependents()  # the next grid may launch (it waits for this one's end)


__all__ = ["pdl_enter"]
