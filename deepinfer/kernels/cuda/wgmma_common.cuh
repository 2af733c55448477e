// Warpgroup-MMA helpers of fp4_moe_wgmma.cu, apart from its layout and pipeline:
// the fence / commit / wait of async wgmma groups, register pins that keep the compiler from touching what an
// in-flight wgmma reads or writes, the 128-byte-swizzle shared-memory descriptor, and the bf16 rounding of the
// epilogues. (inlined once per kernel by runtime.read_source after mma_common.cuh: no include guard needed)

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
