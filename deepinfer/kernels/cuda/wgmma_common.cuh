// Warpgroup-MMA helpers of fp4_moe_wgmma.cu, fp8_linear_wgmma.cu and fp8_linear_prefill.cu, apart from their layouts
// and pipelines: the fence / commit / wait of async wgmma groups, the bf16 register-operand wgmma (m64 x 16..128)
// and the E4M3 shared-memory-operand one (m64 x 64 / 128), register pins that keep the compiler from touching
// what an in-flight wgmma reads or writes, the 128-byte-swizzle shared-memory descriptor, and the bf16
// rounding of the epilogues.
// (inlined once per kernel by runtime.read_source after mma_common.cuh: no include guard needed)

typedef unsigned long long u64;

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// registers an in-flight wgmma reads or writes: the compiler must neither reuse nor move them before the wait
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void keep(u32& r) { asm volatile("" : "+r"(r)::"memory"); }
template <int N>
__device__ __forceinline__ void keep_all(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) keep(r[i]);
}
template <int N>
__device__ __forceinline__ void keep_all(u32 (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) keep(r[i][j]);
}

// A wgmma's m64 x N fp32 accumulator fragment (N / 2 registers a lane) as asm operands: WGMMA_REGS<R> names
// %0 .. %(R-1) in the instruction text, WGMMA_D<R> binds them to d[0 .. R-1] ("+f": read and written). The
// instruction's other operands follow from %R.
#define WGMMA_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define WGMMA_D8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define WGMMA_REGS16 WGMMA_REGS8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_D16 WGMMA_D8, \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WGMMA_REGS32 WGMMA_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_D32 WGMMA_D16, \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_REGS64 WGMMA_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D64 WGMMA_D32, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (the m64 x N fp32 accumulator fragment, N / 2 registers a lane) += A (registers, the m16n8k16 layout per
// warp: bf16 pairs of rows g / g + 8 at K 2t and 2t + 8) @ B (shared memory, by descriptor), bf16 inputs; one
// overload per N in 16 / 32 / 64 / 128 (N 256 would need 128 accumulators a lane: it spills)
__device__ __forceinline__ void wgmma_rs(float (&d)[8], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {" WGMMA_REGS8 "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : WGMMA_D8
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[16], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" WGMMA_REGS16 "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : WGMMA_D16
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WGMMA_REGS32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : WGMMA_D32
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WGMMA_REGS64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : WGMMA_D64
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
// d (+)= A (shared memory, by descriptor: 64 rows x 32 E4M3) @ B^T (shared memory: N rows x 32 E4M3), the FP8
// tensor cores' fp32 sum; scale_d 0 starts a fresh sum (fp8_linear_prefill.cu); one overload per N in 64 / 128
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" WGMMA_REGS32 "}, %32, %33, p, 1, 1;\n}\n"
        : WGMMA_D32
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[64], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WGMMA_REGS64 "}, %64, %65, p, 1, 1;\n}\n"
        : WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: start address >> 4,
// leading byte offset 16 (unused by this layout), stride byte offset 1024 (8 rows of 128 bytes), mode 1
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ float bf16_round(float x) {  // round to nearest even at bf16 (finite x)
    u32 b = __float_as_uint(x);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return __uint_as_float(b & 0xFFFF0000u);
}

// The expert GEMMs' epilogue from the m64 x TOKENS_ accumulator fragment, acc[4j + e] = (row gr0, token 8j + 2t + e),
// acc[4j + 2 + e] = (row gr1, the same token), tokens = the routing block's sorted slots (padding slots >=
// n_slots are skipped):
// * GATED: gr0 a gate row, gr1 its up row (feature gr0 < N): out bf16 [slot, gr0] = route_w[slot] * silu(g) * u
//   with g, u the bf16-rounded sums, up clamped to +-limit and gate to <= limit when limit > 0 (the official
//   expert epilogue);
// * else: out [slot, row] = the fp32 sum (OUT_F32) or its bf16 rounding, rows past N skipped.
template <int TOKENS_, int GATED_, int OUT_F32_>
__device__ __forceinline__ void store_tile(const float (&acc)[TOKENS_ / 2], void* __restrict__ out, i64 stride_om,
                                           const float* __restrict__ route_w, const int* __restrict__ block_slots,
                                           int n_slots, int N, int gr0, int gr1, int t, float limit) {
#pragma unroll
    for (int j = 0; j < TOKENS_ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int slot = block_slots[8 * j + 2 * t + e];
            if (slot >= n_slots) continue;
            if (GATED_) {
                if (gr0 >= N) continue;
                float gate = bf16_round(acc[4 * j + e]), up = bf16_round(acc[4 * j + 2 + e]);
                if (limit > 0.f) {
                    up = fminf(fmaxf(up, -limit), limit);
                    gate = fminf(gate, limit);
                }
                const float h = route_w[slot] * (gate / (1.f + expf(-gate)) * up);
                static_cast<u16*>(out)[(i64)slot * stride_om + gr0] = (u16)(__float_as_uint(bf16_round(h)) >> 16);
            } else if (OUT_F32_) {
                if (gr0 < N) static_cast<float*>(out)[(i64)slot * stride_om + gr0] = acc[4 * j + e];
                if (gr1 < N) static_cast<float*>(out)[(i64)slot * stride_om + gr1] = acc[4 * j + 2 + e];
            } else {
                u16* o = static_cast<u16*>(out) + (i64)slot * stride_om;
                if (gr0 < N) o[gr0] = (u16)(__float_as_uint(bf16_round(acc[4 * j + e])) >> 16);
                if (gr1 < N) o[gr1] = (u16)(__float_as_uint(bf16_round(acc[4 * j + 2 + e])) >> 16);
            }
        }
    }
}
