// Programmatic dependent launch (PDL), the device-side half for the CUDA kernels (the protocol and the
// measurements: kernels/triton/pdl.py; the launch attribute: runtime.CudaKernel(pdl=True)).
// A kernel launched with PDL may start while the previous kernel in the stream still runs. pdl_enter():
// griddepcontrol.wait (returns once that kernel has ended and its writes are visible), then
// griddepcontrol.launch_dependents (the next kernel may start now; it waits for this one's end in turn).
// Before pdl_enter a kernel may only read memory no earlier kernel writes (its weights), and write nothing.
// Launched without the attribute, both instructions return at once.
#pragma once

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// L2 prefetch of `bytes` (a multiple of 16) from p (16-byte aligned) by the bulk-copy engine: one instruction,
// no register result, so nothing waits on it. A kernel launched early (PDL) calls it before pdl_enter on its
// weights (which no kernel writes): they stream into L2 while the previous kernel, often a latency-bound one
// that leaves HBM idle, still runs. It also keeps ptxas from sinking the loads written before pdl_enter below
// griddepcontrol.wait (seen in the sm_90 SASS: without a memory instruction between them ptxas hoists the
// wait to the top; tests/test_kernels_pdl_sass.py checks the compiled order).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}
