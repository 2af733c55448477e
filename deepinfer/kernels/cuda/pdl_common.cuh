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
