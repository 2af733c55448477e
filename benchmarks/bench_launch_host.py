"""Host cost of `kernels/triton/launch.py`'s fast path per Triton launch, on the CPU machine: a launched
kernel's cached-launch bookkeeping (binding, specialisation key, cache lookup, grid, stream) with the
compiled kernel's own launcher replaced by a no-op, so no GPU is needed and only our Python is timed.
The CUDA device and stream queries are stubbed (they cost ~1 us each on a real device).

    PYTHONPATH=$PWD python benchmarks/bench_launch_host.py

Prints us per launch for a kernel with the argument mix of the engine's ops (tensors, ints, a float, a
bool constexpr, launch options), median of 7 rounds of 20,000 launches.
"""
from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton import launch
from deepinfer.kernels.triton.launch import fast_launch


@fast_launch
@triton.jit
def _example_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, eps, stride_x, stride_o,
                    HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr):
    pass


class _NoOpKernel:
    function = packed_metadata = None

    def run(self, *args):
        return None


def main() -> None:
    launch.ENABLED = True
    torch.cuda.current_device = lambda: 0  # stubs: no GPU here
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    x, w, out = torch.zeros(64, 256), torch.zeros(256), torch.zeros(64, 256)
    args = (x, w, out, 64, 256, 1e-6, x.stride(0), out.stride(0))
    kw = dict(HAS_WEIGHT=True, BLOCK_D=256, num_warps=4)
    k = _example_kernel
    vals, options = k._bind(args, kw)
    key = (0, options, tuple(v if c else launch._spec(v) for v, c in zip(vals, k.constexpr)))
    k.kernels[key] = _NoOpKernel()
    grid = (64,)
    k[grid](*args, **kw)
    assert k.hits == 1 and k.misses == 0, "the stubbed key must be the one launch() builds"
    n = 20_000
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            k[grid](*args, **kw)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    print(f"fast launch host path, {len(args)} runtime args + 2 constexprs + 1 option: "
          f"{statistics.median(rounds):.2f} us a launch (median of 7 x {n})")


if __name__ == "__main__":
    main()
