"""Hand-written CUDA C++ kernels, compiled at first use by NVRTC and launched through the CUDA driver API.

Why not Triton for these: Triton 3.6 decides the register layout of a dot's operands itself, so an operand
made in registers (FP4 experts expanded to bf16) goes through shared memory and layout conversions, and the
expansion cannot be matched to the MMA's fragments. Here the kernel owns the fragments (`mma.sync`), so a
word of packed FP4 becomes MMA registers with a few integer instructions and no shared-memory round trip.
Why NVRTC + the driver API (`runtime.py`) and not a torch C++ extension: no compiler toolchain or torch
headers at run time (NVRTC ships with the CUDA torch wheels and the toolkit), compilation takes about a
second, and the cubin is cached on disk.

Owns: `runtime` (compile, load, launch on torch's current stream; CUDA-graph capturable) and one module
per kernel family (`fp4_moe_mma`: the routed experts' GEMMs at decode up to 8 slots, `fp4_moe_tma`: the same
above them, fed by TMA and a producer warp; `fp4_moe_wgmma`: the experts at prefill on warpgroup MMA;
`fp8_linear_mma`: the decode projections up to 8 rows; `fp8_linear_wgmma`: the projections at 17..256 rows,
TMA-fed, on warpgroup MMA). Kernels register nothing here: the Triton ops that dispatch to them
(`kernels/triton/fp4_moe.py`, `fp8_gemm.py`) decide when they are used, so a machine without NVRTC runs the
Triton kernels unchanged.
Must not: import triton; compile or load anything at import time.
"""
